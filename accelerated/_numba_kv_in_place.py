"""The numba engine's loads that read rows straight into its pool (``ReadsInPlace`` of
``leanstate.reference.kv_store``, ``spec/backends.md``): blocks claimed, written through
``rows`` by the caller's ``readinto``, then adopted by the keys in their headers or
abandoned. A capability only this engine has; the engine class mixes it in."""

from __future__ import annotations

import numpy as np

from leanstate.accelerated import _numba_kv_kernels as kernels

_HUGE_PAGE_RESERVE_BYTES = 64 * 2**20


class RowsReadInPlace:
    """Claim, adopt, fault in and abandon pool rows, over the numba engine's table, free
    list and mapped pool; call every method with the write lock held."""

    def _huge_pages_for(self, rows: int) -> None:
        """Ask for huge pages when ``rows`` is a bulk reservation (64 MiB or more)."""
        if rows * self.layout.row_bytes >= _HUGE_PAGE_RESERVE_BYTES:
            self._mapped.use_huge_pages()

    def claim(self, rows: int) -> int:
        """The first of ``rows`` fresh, zero blocks now owned by the caller: in no table,
        on no free list, mapped but not faulted in (the caller's ``readinto`` faults them,
        on huge pages for a bulk claim). Write whole rows there through ``rows``, then
        :meth:`adopt` them or :meth:`abandon` them."""
        self._reserve(rows + self.free_top, ahead=False)
        self._huge_pages_for(rows)
        first = self.handed_out
        self.handed_out += rows
        return first

    def adopt(self, first: int, count: int) -> None:
        """Index claimed blocks ``[first, first + count)`` by the keys in their headers, as
        ``set_rows`` of those rows would (timestamp and count kept, ``used`` set, a later
        row wins over a present one). A negative key raises ``ValueError`` and adopts none.
        The table was sized for them by :meth:`claim`; nothing here moves the pool."""
        self._free_room(count)
        added, reused, self.free_top = kernels.adopt(
            self.table_keys, self.table_blocks, self.words, first, count, self.free, self.free_top,
            self._mapped.stamps.numpy(), self._epoch(),
        )  # fmt: skip
        if added < 0:
            bad = -1 - added
            raise ValueError(
                f"row {first + bad} read in place has a negative key {int(self.words[first + bad, 0])}"
            )
        self.size += added
        self.dead -= reused

    def fault_in(self, first: int, count: int) -> None:
        """Fault in the pages of blocks ``[first, first + count)`` (no byte changes: safe
        beside a thread writing them)."""
        self._mapped.populate(first, first + count)

    def abandon(self, first: int, count: int) -> None:
        """Give back claimed blocks ``[first, first + count)`` never adopted: zeroed, freed."""
        kernels.zero_rows(self.words, first, count)
        if first + count == self.handed_out:
            self.handed_out = first
            return
        self._free_room(count)
        self.free[self.free_top : self.free_top + count] = np.arange(first + count - 1, first - 1, -1)
        self.free_top += count
