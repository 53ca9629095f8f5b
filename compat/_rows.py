"""Row copies between front-class stores, shared by the modules that deep-copy them."""

from __future__ import annotations

from typing import Protocol

import torch


class _Rows(Protocol):
    def keys(self) -> torch.Tensor: ...
    def get_rows(self, ids: torch.Tensor) -> torch.Tensor: ...
    def set_rows(self, rows: torch.Tensor) -> None: ...


def copy_rows(source: _Rows, target: _Rows, chunk_rows: int = 65536) -> None:
    """Write every row of ``source`` into ``target``, whole rows by header key, a chunk at a time."""
    keys = source.keys()
    for start in range(0, len(keys), chunk_rows):
        target.set_rows(source.get_rows(keys[start : start + chunk_rows]))
