"""What the store engines share: the growing row pool (the memory-mapped one of the numba
engine and of ``RowPool`` on the CPU, and ``RowPool``'s tensor on a GPU), whole-row access
to a pool held as one tensor, and the batch deduplication (last occurrence wins), so no
engine imports another."""

from __future__ import annotations

import mmap
import threading

import torch

from leanstate.accelerated._change_log import MappedArray
from leanstate.accelerated._pages import populate
from leanstate.reference.row_format import RowLayout

POOL_STEP_ROWS = 1024
"""Rows a pool grows by at least, and the multiple its size is rounded up to."""


class MappedRows:
    """Rows in an anonymous memory map that grows in place (``mremap``: no copy, and the
    new pages are zero and cost nothing until written), in ``POOL_STEP_ROWS``-row steps,
    with a per-block stamp array (change tracking) growing in place beside them.

    ``rows`` (``[capacity, width]``, typed) and ``stamps`` (``capacity + spare_stamps``
    long; the spare ones past the last block, zeroed when a grow makes them blocks') are
    views replaced by each :meth:`grow`: the map cannot resize while any view of it is
    alive, so an owner that keeps views (or arrays made from them) drops them before a
    grow and takes them again after. Pages may be faulted in ahead of need, now or on a
    background thread; a grow first waits for that thread.
    """

    def __init__(self, layout: RowLayout, stamp_dtype: torch.dtype, *, spare_stamps: int = 0) -> None:
        self.layout, self.spare_stamps = layout, spare_stamps
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self.map = mmap.mmap(-1, POOL_STEP_ROWS * layout.row_bytes, flags=flags)
        self._stamp_map = MappedArray(POOL_STEP_ROWS + spare_stamps, stamp_dtype)
        self._populating: threading.Thread | None = None
        self._view()

    def _view(self) -> None:
        raw = torch.frombuffer(self.map, dtype=torch.uint8)
        self.rows = raw.view(self.layout.dtype).view(self.capacity, self.layout.width)
        self.stamps = self._stamp_map.tensor

    @property
    def capacity(self) -> int:
        """Rows mapped."""
        return len(self.map) // self.layout.row_bytes

    def nbytes(self) -> int:
        """Bytes of the map and of the stamps' map."""
        return len(self.map) + self._stamp_map.nbytes()

    def grow(self, rows: int) -> bool:
        """At least ``rows`` rows, rounded up to a whole step (rows and stamps kept, new
        ones zero); whether it grew. Call it with no view of ``rows`` or ``stamps`` alive
        but its own."""
        old = self.capacity
        if rows <= old:
            return False
        size = -(-rows // POOL_STEP_ROWS) * POOL_STEP_ROWS
        self.finish_populating()  # no thread may touch the pages a resize can move
        del self.rows, self.stamps
        self.map.resize(size * self.layout.row_bytes)
        self._stamp_map.resize(size + self.spare_stamps)
        self._view()
        self.stamps[old : old + self.spare_stamps] = 0  # the old spare stamps are blocks' now
        return True

    def populate(self, first: int, last: int | None = None, *, touch: bool = False) -> None:
        """Fault in the pages of rows ``[first, last)`` (default: to the end); see
        ``_pages.populate`` (``touch``: only for rows no one uses yet, under the owner's
        write lock)."""
        row_bytes = self.layout.row_bytes
        end = None if last is None else last * row_bytes
        populate(self.map, first * row_bytes, end, touch=touch)

    def populate_behind(self, first: int) -> None:
        """Fault in rows ``[first, capacity)`` on a background thread (no byte changes)."""
        self.finish_populating()
        self._populating = threading.Thread(
            target=populate, args=(self.map, first * self.layout.row_bytes), daemon=True
        )
        self._populating.start()

    def finish_populating(self) -> None:
        """Wait for the background thread of :meth:`populate_behind`, if any."""
        if self._populating is not None:
            self._populating.join()
            self._populating = None

    def use_huge_pages(self) -> None:
        """Ask for huge pages (2 MiB faults instead of 4 KiB) where the system has them."""
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.map.madvise(mmap.MADV_HUGEPAGE)


class TensorRows:
    """``read_blocks`` and ``write_blocks`` of the row-access interface (``spec/backends.md``)
    for an engine whose ``rows`` is its pool as one indexable tensor."""

    def read_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Whole rows (a copy) of present blocks."""
        return self.rows.index_select(0, blocks)

    def write_blocks(self, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        """Whole rows written at present, distinct blocks."""
        self.rows.index_copy_(0, blocks, rows)


class RowPool:
    """One tensor of rows with a last-in-first-out free list (the torch and numba-cuda
    engines each keep their rows in one).

    On the CPU the rows and stamps live in a ``MappedRows`` (the numba engine's pool too),
    growing in place in 1024-row steps. On a GPU the tensor grows by an eighth, in whole
    1024-row steps, copying: at most an eighth of the pool sits unused (the memory target
    is 1.1x the row bytes), and each row is copied about eight times at most as the pool
    grows.

    ``stamps`` (int64, one per block and one more at the end, where ``mark`` sends the
    negative blocks) holds the epoch of each block's last write, for change tracking; it
    grows with the rows, in place on the CPU.
    """

    def __init__(self, layout: RowLayout, device: torch.device) -> None:
        self.layout, self.device = layout, device
        self._mapped = None
        if device.type == "cpu":
            self._mapped = MappedRows(layout, torch.int64, spare_stamps=1)
            self.rows, self.stamps = self._mapped.rows, self._mapped.stamps
        else:
            self.rows = torch.zeros(POOL_STEP_ROWS, layout.width, dtype=layout.dtype, device=device)
            self.stamps = torch.zeros(POOL_STEP_ROWS + 1, dtype=torch.int64, device=device)
        self.handed_out = 0  # blocks ever taken (free ones included)
        self.free = torch.empty(0, dtype=torch.int64, device=device)

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
        if self._mapped is not None:
            self._mapped.populate(self.handed_out, self.handed_out + fresh, touch=True)

    def grow(self, rows: int) -> None:
        """At least ``rows`` rows (existing rows kept; new ones zero)."""
        if rows <= len(self.rows):
            return
        old = len(self.rows)
        if self._mapped is not None:
            del self.rows, self.stamps  # no view of a map may outlive its resize
            self._mapped.grow(rows)
            self.rows, self.stamps = self._mapped.rows, self._mapped.stamps
            return
        size = max(rows, old + old // 8)
        size = -(-size // POOL_STEP_ROWS) * POOL_STEP_ROWS
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
