"""Row copies between front-class stores, shared by the modules that deep-copy them."""

from __future__ import annotations

from leanstate.reference.kv_store import SupportsRows


def copy_rows(source: SupportsRows, target: SupportsRows, chunk_rows: int = 65536) -> None:
    """Write every row of ``source`` into ``target``, whole rows by header key, a chunk at a time."""
    keys = source.keys()
    for start in range(0, len(keys), chunk_rows):
        target.set_rows(source.get_rows(keys[start : start + chunk_rows]))
