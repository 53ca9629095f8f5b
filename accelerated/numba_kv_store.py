"""The ``numba`` KV store engine: a fixed handful of compiled calls per batch, parallel across cores.

``get`` is a lookup and a gather (plus the initial weights of missing ids); ``set`` a
lookup, an insert of the missing ids, a backward marking pass and a parallel write;
``set_rows`` the same with whole rows. No Python loop runs over ids or rows.

Same interface and same bits as ``leanstate.reference.kv_store.KVStoreEngine``
(``spec/backends.md``), written independently: it shares only the row layout and the
hash constants with the reference. The store keeps

- one open-addressing hash table, id -> block, in two arrays (linear probing on
  ``splitmix64(id)``, tombstones for deletes, rebuilt when live + dead slots pass half);
- one flat pool of rows in an anonymous memory map that grows in place (``mremap``:
  no copy, and pages that were never written cost nothing), in steps of 1024 rows
  (on huge pages after a bulk ``reserve``): ``_row_pool.MappedRows``, as ``RowPool``'s
  on the CPU;
- a free list of released blocks, reused last in first out, as the reference does;
- a readers-writer lock: reads run concurrently (the kernels release the GIL), writes
  are exclusive. One call already spreads over every core, so the shards of the
  reference are not needed for parallelism here;
- for change tracking, an int32 epoch per block (stamped by the kernels that write the
  rows, mapped and grown in place with the pool) and a log of the removed ids by epoch.

What every accelerated engine does alike is mixed in, written once: change tracking
(``_change_log.ChangeTracking``) and eviction (``_eviction.Eviction``) over this engine's
hooks, whole-row access to the pool (``_row_pool.TensorRows``); loads that read rows
straight into the pool, a capability only this engine has, are ``_numba_kv_in_place``'s.

Kernels move rows as raw words (int64 for headers and whole rows, the element width
for columns), so they never depend on the row dtype. Duplicates in one ``set`` are
resolved without scratch memory: a backward pass marks each row's last writer by
clearing its ``used`` bit and counts occurrences in its timestamp field, both rewritten
by the write pass that follows.

Example::

    >>> engine = KVStoreEngine(RowLayout(4, 1, torch.float32), num_shards=8, init_range=(-0.01, 0.01), seed=0)
    >>> engine.scatter(torch.tensor([7, 3]), torch.ones(2, 4), start=4, now=0)
    >>> engine.keys()
    tensor([3, 7])
"""

from __future__ import annotations

import numpy as np
import torch

from leanstate.accelerated import _host_buffers
from leanstate.accelerated import _numba_kv_kernels as kernels
from leanstate.accelerated._change_log import ChangeTracking
from leanstate.accelerated._eviction import Eviction
from leanstate.accelerated._numba_kv_in_place import RowsReadInPlace
from leanstate.accelerated._numba_runtime import ReadersWriterLock, use_threads
from leanstate.accelerated._row_pool import POOL_STEP_ROWS, MappedRows, TensorRows
from leanstate.reference.row_format import RowLayout

_HEADROOM_DIVISOR = 12  # rows faulted in ahead of need: at most 1/12 of the pool (memory <= 1.1x rows)
_MIN_SLOTS = 16

DEVICES = ("cpu",)
AUTO_PRIORITY = {"cpu": 20, "cuda": 10}
BENCH_TARGETS = {
    "get": (">=", 1.0),
    "get_out": (">=", 0.8),
    "set": (">=", 0.6),
    "insert": (">=", 0.6),
    "insert_reserved": (">=", 0.8),
    "memory": ("<=", 1.1),
    "save": (">=", 0.85),
    "load": (">=", 0.8),
    "load_dim16": (">=", 0.6),  # 96-byte rows: the per-row work weighs more beside the bytes
}


# -- the engine --------------------------------------------------------------------------


class KVStoreEngine(ChangeTracking, Eviction, TensorRows, RowsReadInPlace):
    """The numba store engine; see the module docstring and ``spec/backends.md``.

    Args:
        layout: the row layout (dim, optimizer state, dtype).
        num_shards: recorded only: one table serves every id (a call already spreads over
            every core, so shards would add no parallelism).
        init_range: (low, high) of the initial weights of missing ids.
        seed: seed of the initial weights.
        device: the CPU (rows live in host memory).
    """

    backend = "numba"
    MAX_EPOCH = np.iinfo(np.int32).max  # the blocks' stamps are int32: 4 bytes a row

    def __init__(
        self,
        layout: RowLayout,
        *,
        num_shards: int,
        init_range: tuple[float, float],
        seed: int,
        device: torch.device | None = None,
    ) -> None:
        self.layout = layout
        self.num_shards = num_shards
        self.init_range = init_range
        self.seed = seed
        self.lock = ReadersWriterLock()
        self._words_per_row = layout.row_bytes // 8
        self.table_keys = np.full(_MIN_SLOTS, kernels.EMPTY, dtype=np.int64)
        self.table_blocks = np.zeros(_MIN_SLOTS, dtype=np.int32)
        self.size = 0
        self.dead = 0
        self.free = np.empty(_MIN_SLOTS, dtype=np.int32)
        self.free_top = 0
        self.handed_out = 0
        # the rows, and for change tracking each block's epoch of last write (int32: 4 bytes a row)
        self._mapped = MappedRows(layout, torch.int32)
        self._faulted_to = 0  # pool rows below this were handed out or faulted in ahead
        self._start_tracking()
        self._view_pool()

    def _view_pool(self) -> None:
        self.pool = self._mapped.rows  # the rows, typed
        self.words = kernels.as_words(self.pool)
        self.elems = kernels.as_elements(self.pool)

    def __len__(self) -> int:
        return self.size

    def memory_bytes(self) -> int:
        """The mapped pool, the hash table and the free list."""
        with self.lock.reading():
            tables = self.table_keys.nbytes + self.table_blocks.nbytes + self.free.nbytes
            return self._mapped.nbytes() + tables + self._log.nbytes()

    # -- capacity (under the write lock) -------------------------------------------

    def _reserve(self, new: int, *, ahead: bool = True) -> None:
        """Room for ``new`` more keys: table at most half full, pool rows mapped.

        ``ahead``: when the pool must grow, also map up to ``new`` more rows (at most 1/12 of
        the pool, and none below 32 steps of rows) and fault them in on a background thread, so the next insert of that
        size finds its pages ready instead of faulting them on its own path (page faults
        are the cost of an insert: 12 ms of a 17 ms insert of 65,536 rows of 544 bytes).
        """
        if 2 * (self.size + self.dead + new) > len(self.table_keys):
            capacity = _MIN_SLOTS
            while 2 * (self.size + new) > capacity:
                capacity *= 2
            self.table_keys, self.table_blocks = kernels.rebuild(self.table_keys, self.table_blocks, capacity)
            self.dead = 0
        rows_needed = self.handed_out + max(0, new - self.free_top)
        rows_mapped = self._mapped.capacity
        headroom = min(new, rows_mapped // _HEADROOM_DIVISOR) if ahead else 0
        if headroom < POOL_STEP_ROWS:  # a small pool faults in cheaply: grow it by need only
            headroom = 0
        if rows_needed > rows_mapped:
            del self.pool, self.words, self.elems  # no view may outlive a resize
            self._mapped.grow(rows_needed + headroom)
            self._view_pool()
            if headroom:
                self._mapped.populate_behind(max(self._faulted_to, rows_needed))
                self._faulted_to = self._mapped.capacity

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more rows now: one table rebuild, and the pool rows mapped and
        faulted in, so the inserts that follow write to memory that is already there.

        A bulk reservation (64 MiB of rows or more, as a checkpoint load makes) also asks
        for huge pages: the pool is then filled in 2 MiB faults instead of 4 KiB ones
        (measured: a 1M-row load 0.21 s instead of 0.40 s).
        """
        with self.lock.writing():
            self._reserve(max(0, rows), ahead=False)
            self._huge_pages_for(rows)
            self._mapped.finish_populating()
            first = self.handed_out
            last = first + max(0, rows - self.free_top)
            self._mapped.populate(first, last, touch=True)
            self._faulted_to = max(self._faulted_to, last)

    def _free_room(self, count: int) -> None:
        """Room on the free list for ``count`` more blocks."""
        if self.free_top + count > len(self.free):
            grown = np.empty(max(2 * len(self.free), self.free_top + count), dtype=np.int32)
            grown[: self.free_top] = self.free[: self.free_top]
            self.free = grown

    # -- helpers -------------------------------------------------------------------

    def _initial_weights(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), dim] initial weights in the row dtype."""
        low, high = self.init_range
        weights = kernels.initial_weights(
            ids.numpy(), self.layout.dim, kernels.U64(self.seed & (2**64 - 1)), low, high
        )
        return torch.from_numpy(weights).to(self.layout.dtype)

    def _fill_initial(self, ids: torch.Tensor, blocks: np.ndarray, fresh: np.ndarray) -> None:
        """Initial weights into the rows of freshly inserted ``ids[fresh]``."""
        if len(fresh):
            offset = self.layout.weight_offset
            chosen = torch.from_numpy(blocks[fresh])
            self.pool[chosen, offset : offset + self.layout.dim] = self._initial_weights(ids[fresh])

    # -- row access (spec/backends.md) --------------------------------------------

    def reading(self):
        """The shared side of the readers-writer lock: hold it while reading ``rows``."""
        return self.lock.reading()

    def writing(self):
        """The exclusive side: hold it while inserting or writing ``rows``."""
        return self.lock.writing()

    @property
    def rows(self) -> torch.Tensor:
        """The row pool ``[capacity, width]`` (a view): ``rows[block]`` is a block's row.

        Valid until the next insert (the pool may be remapped); read it under the lock.
        """
        return self.pool

    def locate(self, ids: torch.Tensor, *, insert: bool = False) -> torch.Tensor:
        """Block of each id, -1 missing, -2 negative; ``insert=True`` (under ``writing()``)
        inserts the missing ids with their initial rows, header ``(key, used)``."""
        use_threads(len(ids) * self.layout.width)
        if not insert:
            return torch.from_numpy(kernels.lookup(self.table_keys, self.table_blocks, ids.numpy()))
        blocks, fresh = self._locate_or_insert(ids)
        self._fill_initial(ids, blocks, fresh)
        if self.tracking:  # the caller writes every row it locates so (the embedding updates)
            kernels.stamp_blocks(self._mapped.stamps.numpy(), blocks, self._log.epoch)
        return torch.from_numpy(blocks)

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Whole rows of missing ids: header (key, metadata 0), initial weights, zero state."""
        layout = self.layout
        rows = torch.zeros(len(ids), layout.width, dtype=layout.dtype)
        rows[:, layout.weight_offset : layout.weight_offset + layout.dim] = self._initial_weights(ids)
        rows[:, : layout.header_elems].view(torch.int64)[:, 0] = ids
        return rows

    # -- reads ---------------------------------------------------------------------

    def gather(
        self, ids: torch.Tensor, *, start: int, width: int, initial: bool, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        use_threads(len(ids) * width)
        if out is None:
            out = _host_buffers.empty((len(ids), width), self.layout.dtype)
        with self.lock.reading():
            blocks = np.empty(len(ids), dtype=np.int64)
            kernels.lookup_gather(
                self.table_keys, self.table_blocks, self.elems, ids.numpy(), start, kernels.as_elements(out),
                blocks,
            )  # fmt: skip
        if initial and width:
            missing = torch.from_numpy(np.flatnonzero(blocks == -1))
            if len(missing):
                out[missing] = self.initial_rows(ids[missing])[:, start : start + width]
        return out

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        use_threads(len(ids))
        with self.lock.reading():
            return torch.from_numpy(kernels.lookup(self.table_keys, self.table_blocks, ids.numpy()) >= 0)

    def metadata(self, ids: torch.Tensor) -> torch.Tensor:
        use_threads(len(ids))
        with self.lock.reading():
            blocks = kernels.lookup(self.table_keys, self.table_blocks, ids.numpy())
            return torch.from_numpy(kernels.gather_metadata(self.words, blocks))

    def keys(self) -> torch.Tensor:
        with self.lock.reading():
            keys, _ = kernels.live(self.table_keys, self.table_blocks, self.size)
        return torch.from_numpy(np.sort(keys))  # numpy's vectorised sort: 20 ms for 1M keys, torch's 55

    # -- the hooks of change tracking and eviction (call them with the lock held) ---

    def _live_sorted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids ascending, their blocks)."""
        keys, blocks = kernels.live(self.table_keys, self.table_blocks, self.size)
        order = np.argsort(keys, kind="stable")
        return torch.from_numpy(keys[order]), torch.from_numpy(blocks[order].astype(np.int64))

    def _written_since(self, mark: int) -> torch.Tensor:
        """Present ids whose block was stamped after epoch ``mark``, ascending."""
        stamps = self._mapped.stamps.numpy()
        return torch.from_numpy(
            np.sort(kernels.written_since(self.table_keys, self.table_blocks, stamps, mark))
        )

    # -- writes --------------------------------------------------------------------

    def _locate_or_insert(self, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, positions inserted) for ``ids``; call with the write lock held.

        Missing non-negative ids are inserted with header (key, used), zero columns.
        """
        keys = ids.numpy()
        blocks = kernels.lookup(self.table_keys, self.table_blocks, keys)
        missing = int(np.count_nonzero(blocks == -1))
        fresh = np.empty(missing, dtype=np.int64)
        if missing:
            self._reserve(missing)
            self.free_top, self.handed_out, inserted, reused = kernels.insert_missing(
                self.table_keys,
                self.table_blocks,
                keys,
                blocks,
                self.free,
                self.free_top,
                self.handed_out,
                fresh,
            )
            fresh = fresh[:inserted]
            kernels.init_fresh(self.words, keys, blocks, fresh)
            self.size += inserted
            self.dead -= reused
        return blocks, fresh

    def scatter(self, ids: torch.Tensor, values: torch.Tensor, *, start: int, now: int) -> None:
        layout = self.layout
        end = start + values.shape[1]
        covers_weights = start <= layout.weight_offset and end >= layout.weight_offset + layout.dim
        use_threads(len(ids) * values.shape[1])
        with self.lock.writing():
            blocks, fresh = self._locate_or_insert(ids)
            if not covers_weights:
                self._fill_initial(ids, blocks, fresh)
            winner = np.empty(len(blocks), dtype=np.bool_)
            kernels.mark_last_writers(self.words, blocks, winner)
            kernels.write_columns(
                self.elems, self.words, blocks, winner, kernels.as_elements(values), start, now,
                self._mapped.stamps.numpy(), self._epoch(),
            )  # fmt: skip

    def write_rows(self, rows: torch.Tensor) -> None:
        words = kernels.as_words(rows)
        use_threads(rows.numel())
        with self.lock.writing():
            blocks, _ = self._locate_or_insert(torch.from_numpy(words[:, 0].copy()))
            winner = np.empty(len(blocks), dtype=np.bool_)
            kernels.mark_last_rows(self.words, blocks, winner)
            kernels.write_rows(self.words, blocks, winner, words, self._mapped.stamps.numpy(), self._epoch())

    def delete(self, ids: torch.Tensor) -> int:
        with self.lock.writing():
            return self._remove(ids)

    def _remove(self, ids: torch.Tensor) -> int:
        """Delete ``ids`` (missing and negative ones ignored); how many were present."""
        self._free_room(len(ids))
        gone = np.empty(len(ids), dtype=np.int64)
        removed, self.free_top = kernels.remove(
            self.table_keys, self.table_blocks, self.words, ids.numpy(), self.free, self.free_top, gone
        )
        self.size -= removed
        self.dead += removed
        self._removed(torch.from_numpy(gone[:removed].copy()))
        return removed
