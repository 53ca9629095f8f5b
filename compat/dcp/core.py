"""DCP's surface for the rest of leanstate: how a key of leanstate's DCP state dict splits
into a table's name and the suffix of its part (the tools' ``inspect`` reads DCP metadata
with it). Another sub-package imports it from here, never from ``dcp``'s underscore modules
(``tests/test_seams.py`` checks it)."""

from __future__ import annotations

from leanstate.dcp._state import split_key

__all__ = ["split_key"]
