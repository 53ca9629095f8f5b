"""The ``numba-cuda`` KV store engine: a device-resident table and row pool, numba.cuda kernels.

Same interface and bits as ``leanstate.reference.kv_store.KVStoreEngine``
(``spec/backends.md``), written independently: it shares only the row layout and the
hash constants. The engine keeps, on its device,

- one open-addressing table, id -> block, in two int64 arrays (linear probing from
  ``splitmix64(id)`` in uint64 arithmetic, ``-1`` empty, ``-2`` a tombstone, rebuilt
  past half full);
- one pool tensor of rows that grows by an eighth (in whole 1024-row steps), with a
  last-in-first-out free list (``RowPool``, shared with the torch engine).

A batch of new ids is placed in one kernel: each new id gets its block from its rank
among the batch's new ids (so blocks do not depend on thread order), then claims the
first free slot of its probe by compare-and-swap; losing a race only moves it on. Which
slot an id lands in may depend on thread order; no result does. Lookups, gathers (with
the initial weights of missing ids computed in the kernel), scatters, whole-row writes,
metadata, key listing, deletes and the eviction decision are kernels; sorting and
deduplicating ids are torch ops on the same device. Every kernel starts through
``launch`` (the tensors' device, torch's current stream there), and every wait for a
device value through ``host_read``: a ``get`` waits for none, a ``set`` for two (the
distinct ids, and how many are new). Kernels move rows as raw words (int64 headers,
element-wide columns), so they never depend on the row dtype. Ids and values are taken
as CUDA tensors through ``__cuda_array_interface__`` (no copies), and results are torch
CUDA tensors.

For change tracking, ``locate(..., insert=True)`` (which ``set`` and ``set_rows`` go
through) stamps each block's epoch in the pool's ``stamps`` in one kernel, and the
removed ids are logged by epoch.

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

from leanstate._host_reads import host_read
from leanstate.accelerated import _numba_cuda_kv_kernels as kernels
from leanstate.accelerated._change_log import ChangeTracking
from leanstate.accelerated._eviction import Eviction
from leanstate.accelerated._numba_cuda_runtime import SIMULATED, launch
from leanstate.accelerated._numba_cuda_runtime import unavailable as unavailable  # the registry asks here
from leanstate.accelerated._row_pool import RowPool, last_occurrences
from leanstate.reference.hashing import SPLITMIX_GOLDEN, SPLITMIX_MIX1, SPLITMIX_MIX2
from leanstate.reference.row_format import RowLayout

DEVICES = ("cpu",) if SIMULATED else ("cuda",)
AUTO_PRIORITY = {"cuda": 25}  # after the torch engine until the GPU bench says otherwise
BENCH_TARGETS = {"find_bkvs": (">=", 0.5), "insert_bkvs": (">=", 0.5), "get": (">=", 0.5), "set": (">=", 0.5)}

_ELEMENTS = {4: torch.int32, 2: torch.int16}


def elements(t: torch.Tensor) -> torch.Tensor:
    """Row data as same-width integers (bits, not values)."""
    return t.view(_ELEMENTS[t.element_size()])


class KVStoreEngine(ChangeTracking, Eviction):
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
        slots = kernels.MIN_SLOTS
        self._table_keys = torch.full((slots,), kernels.EMPTY, dtype=torch.int64, device=self.device)
        self._table_blocks = torch.full((slots,), -1, dtype=torch.int64, device=self.device)
        self._tombstones = 0  # an upper bound: a placement may reuse one without telling the host
        self._rows = 0
        self._pool = RowPool(layout, self.device)
        low, high = init_range
        #: (seeded, span, low): what ``initial_weight`` takes to compute initial weights in a kernel
        self.initial_scalars = (
            _host_splitmix64(seed),
            np.float32(np.float32(high) - np.float32(low)),
            np.float32(low),
        )
        self._initial = (layout.weight_offset, layout.dim, *self.initial_scalars, kernels.KINDS[layout.dtype])
        self._start_tracking()  # each block's epoch of last write in the pool's stamps; removals logged

    def __len__(self) -> int:
        return self._rows

    def memory_bytes(self) -> int:
        """The pool, the free list and the table (keys, blocks), in bytes."""
        tables = (self._table_keys, self._table_blocks)
        return self._pool.nbytes() + sum(t.numel() * t.element_size() for t in tables) + self._log.nbytes()

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more rows in the pool and the table now."""
        with self.lock:
            self._pool.reserve(rows)
            self._fit_table(self._rows + rows)

    # -- the table -------------------------------------------------------------------

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(ids), dtype=torch.int64, device=self.device)
        launch(kernels.k_lookup, len(ids), self._table_keys, self._table_blocks, ids, out)
        return out

    def _fit_table(self, rows: int) -> None:
        """Rebuild the table, larger if needed, when rows and tombstones would pass half of it."""
        capacity = len(self._table_keys)
        if 2 * (rows + self._tombstones) <= capacity:
            return
        while 2 * rows > capacity:
            capacity *= 2
        keys, blocks = self._live()
        self._table_keys = torch.full((capacity,), kernels.EMPTY, dtype=torch.int64, device=self.device)
        self._table_blocks = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        self._tombstones = 0
        missing = torch.full_like(keys, -1)
        rank = torch.arange(len(keys), device=self.device)
        launch(kernels.k_place, len(keys), self._table_keys, self._table_blocks, keys, missing, rank, blocks,
               torch.empty_like(blocks))  # fmt: skip

    def _live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, blocks) of every row, in table order."""
        keys = torch.empty(self._rows, dtype=torch.int64, device=self.device)
        blocks = torch.empty(self._rows, dtype=torch.int64, device=self.device)
        count = torch.zeros(1, dtype=torch.int64, device=self.device)
        launch(
            kernels.k_live, len(self._table_keys), self._table_keys, self._table_blocks, keys, blocks, count
        )
        return keys, blocks

    def _live_sorted(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids ascending, their blocks): a hook of change tracking and eviction."""
        keys, blocks = self._live()
        keys, order = torch.sort(keys)
        return keys, blocks[order]

    def _written_since(self, mark: int) -> torch.Tensor:
        """Present ids whose block was stamped after epoch ``mark``, ascending: a hook of
        change tracking."""
        keys, blocks = self._live_sorted()
        return keys[self._pool.stamps[blocks] > mark]

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Whole rows of missing ids: header (key, metadata 0), initial weights, zero state."""
        rows = torch.zeros(len(ids), self.layout.width, dtype=self.layout.dtype, device=self.device)
        where = torch.arange(len(ids), device=self.device)
        launch(kernels.k_initial_rows, rows.numel(), elements(rows), rows.view(torch.int64), where, ids,
               torch.full_like(where, -1), *self._initial)  # fmt: skip
        rows.view(torch.int64)[:, 1] = 0
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
        (distinct, non-negative) ids with their initial rows, header ``(key, used)``, and
        stamps every block located as written (change tracking).

        An insert waits for the device once (how many ids are new), however many there
        are; a lookup not at all."""
        found = self._lookup(ids)
        if not insert or not len(ids):
            return found
        blocks = self._insert_missing(ids, found)
        if self.tracking:
            launch(kernels.k_mark, len(ids), self._pool.stamps, blocks, self._log.epoch)
        return blocks

    def _insert_missing(self, ids: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
        """The blocks of ``ids`` after inserting those ``found`` missing (-1)."""
        missing = found == -1
        rank = torch.cumsum(missing, 0) - 1
        new = host_read(int, rank[-1]) + 1
        if not new:
            return found
        self._fit_table(self._rows + new)
        fresh = self._pool.allocate(new)
        blocks = torch.empty_like(found)
        launch(
            kernels.k_place, len(ids), self._table_keys, self._table_blocks, ids, found, rank, fresh, blocks
        )
        self._rows += new
        rows = self.rows
        launch(kernels.k_initial_rows, len(ids) * self.layout.width, elements(rows), rows.view(torch.int64),
               blocks, ids, found, *self._initial)  # fmt: skip
        return blocks

    def read_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Whole rows (a copy) of present blocks."""
        out = torch.empty(len(blocks), self.layout.width, dtype=self.layout.dtype, device=self.device)
        launch(kernels.k_gather, out.numel(), elements(self.rows), blocks, blocks, 0, False, *self._initial,
               elements(out))  # fmt: skip
        return out

    def write_blocks(self, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        """Whole rows written at present, distinct blocks."""
        launch(kernels.k_put, rows.numel(), elements(self.rows), blocks, elements(rows.contiguous()))

    # -- reads -----------------------------------------------------------------------

    def gather(
        self, ids: torch.Tensor, *, start: int, width: int, initial: bool, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Columns ``[start, start + width)``; a missing id its initial row or zeros, a negative
        one zeros. One lookup and one gather kernel: the host waits for nothing."""
        result = (
            out
            if out is not None
            else torch.empty(len(ids), width, dtype=self.layout.dtype, device=self.device)
        )
        with self.lock:
            blocks = self._lookup(ids)
            launch(kernels.k_gather, len(ids) * width, elements(self.rows), blocks, ids, start, initial,
                   *self._initial, elements(result))  # fmt: skip
        return result

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """Which ids have a row."""
        with self.lock:
            return self._lookup(ids) >= 0

    def metadata(self, ids: torch.Tensor) -> torch.Tensor:
        """Eviction metadata word of each id (0 when missing)."""
        out = torch.empty(len(ids), dtype=torch.int64, device=self.device)
        with self.lock:
            launch(kernels.k_metadata, len(ids), self.rows.view(torch.int64), self._lookup(ids), out)
        return out

    def keys(self) -> torch.Tensor:
        """Every id, ascending."""
        with self.lock:
            return self._live_sorted()[0]

    # -- writes ----------------------------------------------------------------------

    def scatter(self, ids: torch.Tensor, values: torch.Tensor, *, start: int, now: int) -> None:
        """``set``: last occurrence wins; count += occurrences (saturating), stamped ``now``;
        negative ids skipped. Two waits for the device: the distinct ids, and how many are new."""
        unique, last, occurrences, _ = host_read(last_occurrences, ids)
        with self.lock:
            blocks = self.locate(unique, insert=True)  # negative ids stay -2 and are skipped
            launch(kernels.k_write_columns, len(unique) * values.shape[1], elements(self.rows), blocks,
                   last, elements(values), start)  # fmt: skip
            launch(kernels.k_stamp, len(unique), self.rows.view(torch.int64), blocks, occurrences, now)

    def write_rows(self, rows: torch.Tensor) -> None:
        """``set_rows``: keys from the headers, timestamp and count kept, ``used`` set; last row wins."""
        words = rows.view(torch.int64)
        unique, last, _, _ = host_read(last_occurrences, words[:, 0].contiguous())
        with self.lock:
            blocks = self.locate(unique, insert=True)
            launch(kernels.k_write_rows, len(unique) * words.shape[1], self.rows.view(torch.int64), blocks,
                   last, words)  # fmt: skip

    def _remove(self, keys: torch.Tensor) -> int:
        """Delete distinct non-negative keys: zero and free their blocks; how many were present."""
        freed = torch.empty(len(keys), dtype=torch.int64, device=self.device)
        gone = torch.empty(len(keys), dtype=torch.int64, device=self.device)
        removed = torch.zeros(1, dtype=torch.int64, device=self.device)
        launch(kernels.k_remove, len(keys), self._table_keys, self._table_blocks, self.rows.view(torch.int64),
               keys, freed, gone, removed)  # fmt: skip
        count = host_read(int, removed[0])
        self._removed(gone[:count].clone())
        # the threads listed the freed blocks in any order: sorted, reuse is the same every run
        self._pool.release(torch.sort(freed[:count]).values)
        self._tombstones += count
        self._rows -= count
        return count

    def delete(self, ids: torch.Tensor) -> int:
        """Remove ids (missing and negative ones ignored); the count removed."""
        unique = host_read(torch.unique, ids)
        with self.lock:
            return self._remove(unique[host_read(int, (unique < 0).sum()) :])  # negatives sort first


def _host_splitmix64(seed: int) -> np.uint64:
    """``splitmix64(seed)`` on the host, in Python integers (the kernels take it as a scalar)."""
    mask = 2**64 - 1
    z = (seed + SPLITMIX_GOLDEN) & mask  # seed & mask: a negative seed wraps as uint64
    z = ((z ^ (z >> 30)) * SPLITMIX_MIX1) & mask
    z = ((z ^ (z >> 27)) * SPLITMIX_MIX2) & mask
    return kernels.U64(z ^ (z >> 31))
