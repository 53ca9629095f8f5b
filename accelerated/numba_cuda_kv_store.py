"""The ``numba-cuda`` KV store engine: a device-resident table and row pool, numba.cuda kernels.

Same interface and bits as ``leanstate.reference.kv_store.KVStoreEngine``
(``spec/backends.md``), written independently: it shares only the row layout and the
hash constants. The engine keeps, on its device,

- one open-addressing table, id -> block, in two int64 arrays (linear probing from
  ``splitmix64(id)`` in uint64 arithmetic, ``-1`` empty, ``-2`` a tombstone, rebuilt
  past half full);
- one pool tensor of rows that grows by an eighth (in whole 1024-row steps), with a
  last-in-first-out free list (``RowPool``, shared with the torch engine).

A batch of new ids is placed by rounds of bidding, so the table does not depend on
thread order: every pending id bids for its current slot with ``cuda.atomic.max``; the
largest bidder for a free slot takes it (the no-bid sentinel is -1, which no id equals), the others move one slot on. Lookups,
gathers, scatters, whole-row writes, metadata, key listing, deletes and the eviction
decision are kernels; sorting and deduplicating ids are torch ops on the same device.
Kernels move rows as raw words (int64 headers, element-wide columns), so they never
depend on the row dtype. Ids and values are taken as CUDA tensors through
``__cuda_array_interface__`` (no copies), and results are torch CUDA tensors.

Under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, set before numba is
imported) the same kernels run on the CPU over tensors in host memory: the engine then
runs on ``device="cpu"``, and that is how the tests here drive it.

The initial weights are ``span * u + low`` with each operation rounded once: on a GPU
through libdevice's ``__fmul_rn`` / ``__fadd_rn``, which the compiler never contracts
into a fused multiply-add (numba-cuda otherwise lets NVVM contract ``a * b + c``).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from leanstate.accelerated._numba_cuda_kv_kernels import (
    EMPTY,
    MIN_SLOTS,
    NO_BID,
    SIMULATED,
    U64,
    USED,
    device_array,
    k_bid,
    k_doomed,
    k_gather,
    k_initial_weights,
    k_live,
    k_lookup,
    k_metadata,
    k_put,
    k_remove,
    k_settle,
    k_stamp,
    k_start,
    k_write_columns,
    k_write_rows,
    launch,
)
from leanstate.accelerated._numba_cuda_kv_kernels import unavailable as unavailable  # the registry asks here
from leanstate.accelerated._row_pool import RowPool, last_occurrences
from leanstate.reference.hashing import SPLITMIX_GOLDEN, SPLITMIX_MIX1, SPLITMIX_MIX2
from leanstate.reference.row_format import COUNT_MAX, RowLayout, header_words

DEVICES = ("cpu",) if SIMULATED else ("cuda",)
AUTO_PRIORITY = {"cuda": 25}  # after the torch engine until the GPU bench says otherwise
BENCH_TARGETS = {"find_bkvs": (">=", 0.5), "insert_bkvs": (">=", 0.5), "get": (">=", 0.5), "set": (">=", 0.5)}

_ELEMENTS = {4: torch.int32, 2: torch.int16}


def elements(t: torch.Tensor) -> torch.Tensor:
    """Row data as same-width integers (bits, not values)."""
    return t.view(_ELEMENTS[t.element_size()])


class KVStoreEngine:
    """The numba-cuda store engine; see the module docstring and ``spec/backends.md``.

    Args:
        layout: the row layout.
        num_shards: recorded only: one table serves every id.
        init_range: (low, high) of the initial weights.
        seed: seed of the initial weights.
        device: where the table and the rows live (a CUDA device; the CPU in the simulator).
    """

    backend = "numba-cuda"

    def __init__(
        self,
        layout: RowLayout,
        *,
        num_shards: int,
        init_range: tuple[float, float],
        seed: int,
        device: torch.device | str | None = None,
    ) -> None:
        self.layout, self.num_shards, self.init_range, self.seed = layout, num_shards, init_range, seed
        self.device = torch.device(device or DEVICES[0])
        self.lock = threading.RLock()
        self._table_keys = torch.full((MIN_SLOTS,), EMPTY, dtype=torch.int64, device=self.device)
        self._table_blocks = torch.full((MIN_SLOTS,), -1, dtype=torch.int64, device=self.device)
        self._bids = torch.full((MIN_SLOTS,), int(NO_BID), dtype=torch.int64, device=self.device)
        self._tombstones = 0
        self._rows = 0
        self._pool = RowPool(layout, self.device)
        self._seeded = _host_splitmix64(seed)
        low, high = init_range
        self._low = np.float32(low)
        self._span = np.float32(np.float32(high) - np.float32(low))

    def __len__(self) -> int:
        return self._rows

    def memory_bytes(self) -> int:
        """The pool, the free list and the table (keys, blocks, bids), in bytes."""
        tables = (self._table_keys, self._table_blocks, self._bids)
        return self._pool.nbytes() + sum(t.numel() * t.element_size() for t in tables)

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more rows in the pool and the table now."""
        with self.lock:
            self._pool.reserve(rows)
            self._fit_table(self._rows + rows)

    # -- the table -------------------------------------------------------------------

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(ids), dtype=torch.int64, device=self.device)
        launch(
            k_lookup,
            len(ids),
            device_array(self._table_keys),
            device_array(self._table_blocks),
            device_array(ids),
            device_array(out),
        )
        return out

    def _place(self, keys: torch.Tensor, blocks: torch.Tensor) -> None:
        """Put distinct absent ``keys`` in the table: rounds of bids, largest id first."""
        n = len(keys)
        position = torch.empty(n, dtype=torch.int64, device=self.device)
        placed = torch.zeros(n, dtype=torch.bool, device=self.device)
        counters = torch.zeros(2, dtype=torch.int64, device=self.device)  # reused, pending
        table = (device_array(self._table_keys), device_array(self._table_blocks))
        launch(k_start, n, table[0], device_array(keys), device_array(position))
        bids, where, ids = device_array(self._bids), device_array(position), device_array(keys)
        done = device_array(placed)
        while n:
            counters[1] = 0
            launch(k_bid, n, table[0], bids, where, ids, done)
            launch(
                k_settle, n, *table, bids, where, ids, device_array(blocks), done,
                device_array(counters[:1]), device_array(counters[1:]),
            )  # fmt: skip
            if int(counters[1]) == 0:  # one sync per probe step, never per id
                break
        self._tombstones -= int(counters[0])

    def _fit_table(self, rows: int) -> None:
        """Rebuild the table, larger if needed, when rows and tombstones would pass half of it."""
        capacity = len(self._table_keys)
        if 2 * (rows + self._tombstones) <= capacity:
            return
        while 2 * rows > capacity:
            capacity *= 2
        keys, blocks = self._live()
        self._table_keys = torch.full((capacity,), EMPTY, dtype=torch.int64, device=self.device)
        self._table_blocks = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        self._bids = torch.full((capacity,), int(NO_BID), dtype=torch.int64, device=self.device)
        self._tombstones = 0
        self._place(keys, blocks)

    def _live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, blocks) of every row, in table order."""
        keys = torch.empty(self._rows, dtype=torch.int64, device=self.device)
        blocks = torch.empty(self._rows, dtype=torch.int64, device=self.device)
        count = torch.zeros(1, dtype=torch.int64, device=self.device)
        launch(
            k_live, len(self._table_keys), device_array(self._table_keys), device_array(self._table_blocks),
            device_array(keys), device_array(blocks), device_array(count),
        )  # fmt: skip
        return keys, blocks

    def _sorted_live(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, blocks = self._live()
        keys, order = torch.sort(keys)
        return keys, blocks[order]

    def _insert(self, keys: torch.Tensor) -> torch.Tensor:
        """Blocks for distinct absent keys, holding their initial rows and header (key, used)."""
        self._fit_table(self._rows + len(keys))
        blocks = self._pool.allocate(len(keys))
        self._place(keys, blocks)
        self._rows += len(keys)
        rows = self.initial_rows(keys)
        header_words(rows)[:, 1] = USED
        self.write_blocks(blocks, rows)
        return blocks

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Whole rows of missing ids: header (key, metadata 0), initial weights, zero state."""
        layout = self.layout
        weights = torch.empty(len(ids), layout.dim, dtype=torch.float32, device=self.device)
        launch(
            k_initial_weights, len(ids) * layout.dim, device_array(ids), self._seeded, self._span,
            self._low, device_array(weights),
        )  # fmt: skip
        rows = torch.zeros(len(ids), layout.width, dtype=layout.dtype, device=self.device)
        rows[:, layout.weight_offset : layout.weight_offset + layout.dim] = weights.to(layout.dtype)
        header_words(rows)[:, 0] = ids
        return rows

    # -- row access (spec/backends.md) ------------------------------------------------

    def reading(self) -> threading.RLock:
        """The engine's lock (one for readers and writers): hold it around row access."""
        return self.lock

    writing = reading

    @property
    def rows(self) -> torch.Tensor:
        """The row pool ``[capacity, width]`` on the engine's device; valid until the next insert."""
        return self._pool.rows

    def locate(self, ids: torch.Tensor, *, insert: bool = False) -> torch.Tensor:
        """Block of each id, -1 missing, -2 negative; ``insert=True`` inserts the missing
        (distinct, non-negative) ids with their initial rows, header ``(key, used)``."""
        blocks = self._lookup(ids)
        if insert:
            missing = torch.nonzero(blocks == -1).flatten()
            if len(missing):
                blocks[missing] = self._insert(ids[missing])
        return blocks

    def read_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Whole rows (a copy) of present blocks."""
        out = torch.empty(len(blocks), self.layout.width, dtype=self.layout.dtype, device=self.device)
        launch(k_gather, out.numel(), device_array(elements(self.rows)), device_array(blocks), 0,
               device_array(elements(out)))  # fmt: skip
        return out

    def write_blocks(self, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        """Whole rows written at present, distinct blocks."""
        launch(k_put, rows.numel(), device_array(elements(self.rows)), device_array(blocks),
               device_array(elements(rows.contiguous())))  # fmt: skip

    # -- reads -----------------------------------------------------------------------

    def gather(
        self, ids: torch.Tensor, *, start: int, width: int, initial: bool, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Columns ``[start, start + width)``; a missing id its initial row or zeros, a negative one zeros."""
        result = (
            out
            if out is not None
            else torch.empty(len(ids), width, dtype=self.layout.dtype, device=self.device)
        )
        with self.lock:
            blocks = self._lookup(ids)
            launch(k_gather, len(ids) * width, device_array(elements(self.rows)), device_array(blocks), start,
                   device_array(elements(result)))  # fmt: skip
        if initial and width:
            missing = torch.nonzero(blocks == -1).flatten()
            if len(missing):
                result[missing] = self.initial_rows(ids[missing])[:, start : start + width]
        return result

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """Which ids have a row."""
        with self.lock:
            return self._lookup(ids) >= 0

    def metadata(self, ids: torch.Tensor) -> torch.Tensor:
        """Eviction metadata word of each id (0 when missing)."""
        out = torch.empty(len(ids), dtype=torch.int64, device=self.device)
        with self.lock:
            blocks = self._lookup(ids)
            launch(k_metadata, len(ids), device_array(self.rows.view(torch.int64)), device_array(blocks),
                   device_array(out))  # fmt: skip
        return out

    def keys(self) -> torch.Tensor:
        """Every id, ascending."""
        with self.lock:
            return self._sorted_live()[0]

    # -- writes ----------------------------------------------------------------------

    def scatter(self, ids: torch.Tensor, values: torch.Tensor, *, start: int, now: int) -> None:
        """``set``: last occurrence wins; count += occurrences (saturating), stamped ``now``."""
        kept = torch.nonzero(ids >= 0).flatten()
        unique, last, occurrences, _ = last_occurrences(ids[kept])
        with self.lock:
            blocks = self.locate(unique, insert=True)
            launch(
                k_write_columns, len(unique) * values.shape[1], device_array(elements(self.rows)),
                device_array(blocks), device_array(kept[last]), device_array(elements(values)), start,
            )  # fmt: skip
            launch(k_stamp, len(unique), device_array(self.rows.view(torch.int64)), device_array(blocks),
                   device_array(occurrences), now)  # fmt: skip

    def write_rows(self, rows: torch.Tensor) -> None:
        """``set_rows``: keys from the headers, timestamp and count kept, ``used`` set; last row wins."""
        words = rows.view(torch.int64)
        unique, last, _, _ = last_occurrences(words[:, 0].contiguous())
        with self.lock:
            blocks = self.locate(unique, insert=True)
            launch(k_write_rows, len(unique) * words.shape[1], device_array(self.rows.view(torch.int64)),
                   device_array(blocks), device_array(last), device_array(words))  # fmt: skip

    def _remove(self, keys: torch.Tensor) -> int:
        """Delete distinct non-negative keys: zero and free their blocks; how many were present."""
        freed = torch.empty(len(keys), dtype=torch.int64, device=self.device)
        removed = torch.zeros(1, dtype=torch.int64, device=self.device)
        launch(
            k_remove, len(keys), device_array(self._table_keys), device_array(self._table_blocks),
            device_array(self.rows.view(torch.int64)), device_array(keys), device_array(freed),
            device_array(removed),
        )  # fmt: skip
        count = int(removed)
        # the threads listed the freed blocks in any order: sorted, reuse is the same every run
        self._pool.release(torch.sort(freed[:count]).values)
        self._tombstones += count
        self._rows -= count
        return count

    def delete(self, ids: torch.Tensor) -> int:
        """Remove ids (missing and negative ones ignored); the count removed."""
        unique = torch.unique(ids)
        with self.lock:
            return self._remove(unique[unique >= 0])

    def evict(
        self,
        *,
        min_count: int | None,
        max_age_s: int | None,
        min_l2_norm: float | None,
        max_rows: int | None,
        now: int,
    ) -> torch.Tensor:
        """Decide and delete under the lock: atomic with respect to every other call."""
        layout = self.layout
        with self.lock:
            keys, blocks = self._sorted_live()
            words = self.rows.view(torch.int64)
            if min_l2_norm is not None:
                weights = self.read_blocks(blocks)[
                    :, layout.weight_offset : layout.weight_offset + layout.dim
                ]
                norms = torch.linalg.vector_norm(weights.float(), dim=1)  # torch's norm, as every engine
            else:
                norms = torch.zeros(len(keys), device=self.device)
            doomed = torch.zeros(len(keys), dtype=torch.bool, device=self.device)
            launch(
                k_doomed, len(keys), device_array(words), device_array(blocks),
                -1 if min_count is None else min_count, -1 if max_age_s is None else max_age_s, now,
                device_array(norms), np.float32(-1.0 if min_l2_norm is None else min_l2_norm),
                device_array(doomed),
            )  # fmt: skip
            if max_rows is not None:
                survivors = torch.nonzero(~doomed).flatten()
                excess = len(survivors) - max_rows
                if excess > 0:  # fewest writes, then oldest, then smallest id (keys ascend)
                    meta = words[blocks[survivors], 1]
                    stamps, counts = meta & 0xFFFFFFFF, (meta >> 32) & COUNT_MAX
                    by_stamp = torch.argsort(stamps, stable=True)
                    ranked = by_stamp[torch.argsort(counts[by_stamp], stable=True)]
                    doomed[survivors[ranked[:excess]]] = True
            victims = keys[doomed]
            self._remove(victims)
            return victims


def _host_splitmix64(seed: int) -> np.uint64:
    """``splitmix64(seed)`` on the host, in Python integers (the kernels take it as a scalar)."""
    mask = 2**64 - 1
    z = (seed + SPLITMIX_GOLDEN) & mask  # seed & mask: a negative seed wraps as uint64
    z = ((z ^ (z >> 30)) * SPLITMIX_MIX1) & mask
    z = ((z ^ (z >> 27)) * SPLITMIX_MIX2) & mask
    return U64(z ^ (z >> 31))
