"""What the torch and numba-cuda store engines share: the row pool and the batch
deduplication (last occurrence wins), so neither engine imports the other."""

from __future__ import annotations

import mmap

import torch

from leanstate.accelerated._change_log import MappedArray
from leanstate.accelerated._pages import populate
from leanstate.reference.row_format import RowLayout


class RowPool:
    """One tensor of rows with a last-in-first-out free list (the torch and numba-cuda
    engines each keep their rows in one).

    On the CPU the rows live in an anonymous memory map that grows in place (``mremap``:
    no copy, and the new pages are zero and cost nothing until written), in 1024-row
    steps. On a GPU the tensor grows by an eighth, in whole 1024-row steps, copying: at
    most an eighth of the pool sits unused (the memory target is 1.1x the row bytes),
    and each row is copied about eight times at most as the pool grows.

    ``stamps`` (int64, one per block and one more at the end, where ``mark`` sends the
    negative blocks) holds the epoch of each block's last write, for change tracking; it
    grows with the rows, in place on the CPU.
    """

    def __init__(self, layout: RowLayout, device: torch.device) -> None:
        self.layout, self.device = layout, device
        self._map = None
        self._stamp_map = None
        if device.type == "cpu":
            self._map = mmap.mmap(-1, 1024 * layout.row_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._view_map()
            self._stamp_map = MappedArray(1024 + 1, torch.int64)
            self.stamps = self._stamp_map.tensor
        else:
            self.rows = torch.zeros(1024, layout.width, dtype=layout.dtype, device=device)
            self.stamps = torch.zeros(1024 + 1, dtype=torch.int64, device=device)
        self.handed_out = 0  # blocks ever taken (free ones included)
        self.free = torch.empty(0, dtype=torch.int64, device=device)

    def _view_map(self) -> None:
        rows = len(self._map) // self.layout.row_bytes
        self.rows = torch.frombuffer(self._map, dtype=self.layout.dtype).view(rows, self.layout.width)

    def nbytes(self) -> int:
        """Bytes of the rows, their epoch stamps and the free list."""
        return self.rows.numel() * self.rows.element_size() + (self.stamps.numel() + self.free.numel()) * 8

    def mark(self, blocks: torch.Tensor, epoch: int) -> None:
        """Stamp ``epoch`` on each block >= 0 (a negative one lands on the spare last stamp)."""
        spare = len(self.stamps) - 1
        self.stamps.index_fill_(0, torch.where(blocks >= 0, blocks, spare), epoch)

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more blocks now (on the CPU also faulted in, so the inserts that
        follow write to memory that is already there)."""
        fresh = max(0, rows - len(self.free))
        self.grow(self.handed_out + fresh)
        if self._map is not None:
            row_bytes = self.layout.row_bytes
            populate(
                self._map, self.handed_out * row_bytes, (self.handed_out + fresh) * row_bytes, touch=True
            )

    def grow(self, rows: int) -> None:
        """At least ``rows`` rows (existing rows kept; new ones zero)."""
        if rows <= len(self.rows):
            return
        old = len(self.rows)
        if self._map is not None:
            size = -(-rows // 1024) * 1024
            del self.rows, self.stamps  # no view of a map may outlive its resize
            self._map.resize(size * self.layout.row_bytes)
            self._view_map()
            self._stamp_map.resize(size + 1)
            self.stamps = self._stamp_map.tensor
            self.stamps[old] = 0  # the old spare stamp is a block's now
            return
        size = max(rows, old + old // 8)
        size = -(-size // 1024) * 1024
        grown = torch.zeros(size, self.layout.width, dtype=self.layout.dtype, device=self.device)
        grown[:old] = self.rows
        self.rows = grown
        stamps = torch.zeros(size + 1, dtype=torch.int64, device=self.device)
        stamps[:old] = self.stamps[:old]
        self.stamps = stamps

    def allocate(self, n: int) -> torch.Tensor:
        """``n`` blocks: freed ones first (the last freed first), then fresh ones."""
        reused = self.free[len(self.free) - min(n, len(self.free)) :].flip(0)
        self.free = self.free[: len(self.free) - len(reused)]
        fresh = n - len(reused)
        self.grow(self.handed_out + fresh)
        new = torch.arange(self.handed_out, self.handed_out + fresh, dtype=torch.int64, device=self.device)
        self.handed_out += fresh
        return torch.cat([reused, new])

    def release(self, blocks: torch.Tensor) -> None:
        """Blocks (already zeroed) back on the free list, in order."""
        self.free = torch.cat([self.free, blocks])


def last_occurrences(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(distinct keys ascending, position of each one's last occurrence, occurrences, and
    the index of each key's distinct key)."""
    unique, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    last = torch.full((len(unique),), -1, dtype=torch.int64, device=keys.device)
    last.scatter_reduce_(0, inverse, torch.arange(len(keys), device=keys.device), reduce="amax")
    return unique, last, counts, inverse
