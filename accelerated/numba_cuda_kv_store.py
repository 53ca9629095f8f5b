"""The ``numba-cuda`` KV store engine: a device-resident table and row pool, numba.cuda kernels.

Same interface and bits as ``leanstate.reference.kv_store.KVStoreEngine``
(``spec/backends.md``), written independently: it shares only the row layout and the
hash constants. The engine keeps, on its device,

- one open-addressing table, id -> block, in two int64 arrays (linear probing from
  ``splitmix64(id)`` in uint64 arithmetic, ``-1`` empty, ``-2`` a tombstone, rebuilt
  past half full);
- one pool tensor of rows that grows by an eighth (in whole 1024-row steps), with a
  last-in-first-out free list (the torch engine's ``RowPool``).

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
import warnings

import numpy as np
import torch
from numba import config, cuda

from leanstate.accelerated.torch_kv_store import RowPool, last_occurrences
from leanstate.reference.hashing import INIT_BITS, SPLITMIX_GOLDEN, SPLITMIX_MIX1, SPLITMIX_MIX2
from leanstate.reference.row_format import COUNT_MAX, RowLayout, header_words

SIMULATED = bool(config.ENABLE_CUDASIM)
DEVICES = ("cpu",) if SIMULATED else ("cuda",)
AUTO_PRIORITY = {"cuda": 25}  # after the torch engine until the GPU bench says otherwise
BENCH_TARGETS = {"find_bkvs": (">=", 0.5), "insert_bkvs": (">=", 0.5), "get": (">=", 0.5), "set": (">=", 0.5)}
if SIMULATED:  # the simulator runs kernels as Python: uint64 wrap-around warns there
    warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning, __name__)

_EMPTY, _TOMBSTONE = -1, -2
_NO_BID = np.int64(-1)  # below every id: ids are non-negative, so no id is mistaken for it
_USED = np.int64(-(2**63))
_STAMP_BITS = np.int64(0xFFFFFFFF)
_COUNT_MAX = np.int64(COUNT_MAX)
_THREADS = 16 if SIMULATED else 256  # the simulator starts one Python thread per thread of a block
_MIN_SLOTS = 16 if SIMULATED else 1024  # the simulator runs one Python thread per slot
_U64 = np.uint64
_GOLDEN, _MIX1, _MIX2 = _U64(SPLITMIX_GOLDEN), _U64(SPLITMIX_MIX1), _U64(SPLITMIX_MIX2)


def unavailable() -> str | None:
    """Why this engine cannot run here, or None."""
    if not cuda.is_available():
        return "numba.cuda reports no usable CUDA device (NUMBA_ENABLE_CUDASIM=1 runs it in the simulator)"
    return None


if SIMULATED:
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray


def device_array(t: torch.Tensor):
    """A tensor as a kernel argument without a copy: its CUDA array interface, or (in the
    simulator, on the CPU) its memory wrapped as a simulated device array. A plain numpy
    argument would be copied in and back out, and two views of one pool (rows and
    headers) would then overwrite each other's writes."""
    return cuda.as_cuda_array(t) if t.is_cuda else FakeCUDAArray(t.numpy())


def launch(kernel, n: int, *args) -> None:
    """Run ``kernel`` over ``n`` threads (nothing when ``n`` is 0)."""
    if n:
        kernel[(n + _THREADS - 1) // _THREADS, _THREADS](*args)


# -- arithmetic that is never contracted (shared with the embedding kernels) -------------

if SIMULATED:

    @cuda.jit(device=True)
    def mul(a, b):
        return np.float32(np.float32(a) * np.float32(b))

    @cuda.jit(device=True)
    def add(a, b):
        return np.float32(np.float32(a) + np.float32(b))

    @cuda.jit(device=True)
    def div(a, b):
        return np.float32(np.float32(a) / np.float32(b))

    @cuda.jit(device=True)
    def sqrt(a):
        return np.float32(np.sqrt(np.float64(a)))

else:  # pragma: no cover - needs a GPU
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def mul(a, b):
        return libdevice.fmul_rn(a, b)

    @cuda.jit(device=True)
    def add(a, b):
        return libdevice.fadd_rn(a, b)

    @cuda.jit(device=True)
    def div(a, b):
        return libdevice.fdiv_rn(a, b)

    @cuda.jit(device=True)
    def sqrt(a):
        return libdevice.fsqrt_rn(a)


# -- hashing and the table ---------------------------------------------------------------


@cuda.jit(device=True)
def _splitmix64(x):
    z = x + _GOLDEN
    z = (z ^ (z >> _U64(30))) * _MIX1
    z = (z ^ (z >> _U64(27))) * _MIX2
    return z ^ (z >> _U64(31))


@cuda.jit(device=True)
def _home(key, mask):
    return np.int64(_splitmix64(_U64(key)) & _U64(mask))


@cuda.jit
def _k_lookup(table_keys, table_blocks, ids, out):
    """Block of every id: -1 missing, -2 negative (padding)."""
    i = cuda.grid(1)
    if i >= ids.shape[0]:
        return
    key = ids[i]
    if key < 0:
        out[i] = -2
        return
    mask = table_keys.shape[0] - 1
    s = _home(key, mask)
    while True:
        found = table_keys[s]
        if found == key:
            out[i] = table_blocks[s]
            return
        if found == _EMPTY:
            out[i] = -1
            return
        s = (s + 1) & mask


@cuda.jit
def _k_start(table_keys, keys, position):
    i = cuda.grid(1)
    if i < keys.shape[0]:
        position[i] = _home(keys[i], table_keys.shape[0] - 1)


@cuda.jit
def _k_bid(table_keys, bids, position, keys, placed):
    """Each pending id bids for its slot when the slot is free (empty or a tombstone)."""
    i = cuda.grid(1)
    if i < keys.shape[0] and not placed[i] and table_keys[position[i]] < 0:
        cuda.atomic.max(bids, position[i], keys[i])


@cuda.jit
def _k_settle(table_keys, table_blocks, bids, position, keys, blocks, placed, reused, pending):
    """The largest bidder takes its free slot; the others move one slot on."""
    i = cuda.grid(1)
    if i >= keys.shape[0] or placed[i]:
        return
    s = position[i]
    if bids[s] == keys[i]:
        if table_keys[s] == _TOMBSTONE:
            cuda.atomic.add(reused, 0, 1)
        table_keys[s] = keys[i]
        table_blocks[s] = blocks[i]
        bids[s] = _NO_BID
        placed[i] = True
    else:
        position[i] = (s + 1) & (table_keys.shape[0] - 1)
        cuda.atomic.add(pending, 0, 1)


@cuda.jit
def _k_live(table_keys, table_blocks, keys, blocks, count):
    """Every live (key, block), in no particular order; ``count[0]`` ends up the number."""
    s = cuda.grid(1)
    if s < table_keys.shape[0] and table_keys[s] >= 0:
        n = cuda.atomic.add(count, 0, 1)
        keys[n] = table_keys[s]
        blocks[n] = table_blocks[s]


@cuda.jit
def _k_remove(table_keys, table_blocks, words, keys, freed, removed):
    """Tombstone each present key (distinct), zero its row and list its block as freed."""
    i = cuda.grid(1)
    if i >= keys.shape[0]:
        return
    key = keys[i]
    mask = table_keys.shape[0] - 1
    s = _home(key, mask)
    while table_keys[s] != _EMPTY:
        if table_keys[s] == key:
            block = table_blocks[s]
            table_keys[s] = _TOMBSTONE
            for c in range(words.shape[1]):
                words[block, c] = 0
            freed[cuda.atomic.add(removed, 0, 1)] = block
            return
        s = (s + 1) & mask


# -- rows --------------------------------------------------------------------------------


@cuda.jit
def _k_initial_weights(ids, seeded, span, low, out):
    """float32 ``[len(ids), dim]`` initial weights (``spec/kv_store.md``), one thread per value."""
    t = cuda.grid(1)
    dim = out.shape[1]
    if t >= ids.shape[0] * dim:
        return
    i, c = t // dim, t % dim
    per_key = _splitmix64(_U64(ids[i]) ^ seeded)
    bits = _splitmix64(per_key ^ _U64(c))
    u = np.float32(bits >> _U64(64 - INIT_BITS)) * np.float32(1.0 / 2**INIT_BITS)
    out[i, c] = add(mul(span, u), low)


@cuda.jit
def _k_gather(elems, blocks, start, out):
    """``out[i] = row(blocks[i])[start:start + width]``, zeros where the block is < 0."""
    t = cuda.grid(1)
    width = out.shape[1]
    if t >= blocks.shape[0] * width:
        return
    i, c = t // width, t % width
    b = blocks[i]
    out[i, c] = elems[b, start + c] if b >= 0 else 0


@cuda.jit
def _k_put(elems, blocks, rows):
    """Whole rows (as elements) written at distinct present blocks."""
    t = cuda.grid(1)
    width = rows.shape[1]
    if t < blocks.shape[0] * width:
        i, c = t // width, t % width
        elems[blocks[i], c] = rows[i, c]


@cuda.jit
def _k_write_columns(elems, blocks, source, values, start):
    """``row(blocks[u])[start:] = values[source[u]]`` for distinct blocks, one thread per value."""
    t = cuda.grid(1)
    width = values.shape[1]
    if t < blocks.shape[0] * width:
        u, c = t // width, t % width
        elems[blocks[u], start + c] = values[source[u], c]


@cuda.jit
def _k_stamp(words, blocks, writes, now):
    """Header of each distinct block after ``writes[u]`` more writes: count (saturating),
    timestamp ``now``, used."""
    u = cuda.grid(1)
    if u < blocks.shape[0]:
        meta = words[blocks[u], 1]
        count = min(((meta >> 32) & _COUNT_MAX) + writes[u], _COUNT_MAX)
        words[blocks[u], 1] = np.int64(now) | (count << 32) | _USED


@cuda.jit
def _k_write_rows(words, blocks, source, rows):
    """Whole rows ``rows[source[u]]`` (as words) at distinct blocks, ``used`` set."""
    t = cuda.grid(1)
    width = rows.shape[1]
    if t < blocks.shape[0] * width:
        u, c = t // width, t % width
        word = rows[source[u], c]
        words[blocks[u], c] = word | _USED if c == 1 else word


@cuda.jit
def _k_metadata(words, blocks, out):
    i = cuda.grid(1)
    if i < blocks.shape[0]:
        out[i] = words[blocks[i], 1] if blocks[i] >= 0 else 0


@cuda.jit
def _k_doomed(words, blocks, min_count, max_age_s, now, norms, min_l2_norm, doomed):
    """The eviction rules of ``spec/kv_store.md`` per live row (a threshold < 0 is off)."""
    i = cuda.grid(1)
    if i >= blocks.shape[0]:
        return
    meta = words[blocks[i], 1]
    stamp, count = meta & _STAMP_BITS, (meta >> 32) & _COUNT_MAX
    doomed[i] = (
        (min_count >= 0 and count < min_count)
        or (max_age_s >= 0 and now - stamp > max_age_s)
        or (min_l2_norm >= 0 and norms[i] < min_l2_norm)
    )


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
        self._table_keys = torch.full((_MIN_SLOTS,), _EMPTY, dtype=torch.int64, device=self.device)
        self._table_blocks = torch.full((_MIN_SLOTS,), -1, dtype=torch.int64, device=self.device)
        self._bids = torch.full((_MIN_SLOTS,), int(_NO_BID), dtype=torch.int64, device=self.device)
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
            _k_lookup,
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
        launch(_k_start, n, table[0], device_array(keys), device_array(position))
        bids, where, ids = device_array(self._bids), device_array(position), device_array(keys)
        done = device_array(placed)
        while n:
            counters[1] = 0
            launch(_k_bid, n, table[0], bids, where, ids, done)
            launch(
                _k_settle, n, *table, bids, where, ids, device_array(blocks), done,
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
        self._table_keys = torch.full((capacity,), _EMPTY, dtype=torch.int64, device=self.device)
        self._table_blocks = torch.full((capacity,), -1, dtype=torch.int64, device=self.device)
        self._bids = torch.full((capacity,), int(_NO_BID), dtype=torch.int64, device=self.device)
        self._tombstones = 0
        self._place(keys, blocks)

    def _live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, blocks) of every row, in table order."""
        keys = torch.empty(self._rows, dtype=torch.int64, device=self.device)
        blocks = torch.empty(self._rows, dtype=torch.int64, device=self.device)
        count = torch.zeros(1, dtype=torch.int64, device=self.device)
        launch(
            _k_live, len(self._table_keys), device_array(self._table_keys), device_array(self._table_blocks),
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
        header_words(rows)[:, 1] = _USED
        self.write_blocks(blocks, rows)
        return blocks

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Whole rows of missing ids: header (key, metadata 0), initial weights, zero state."""
        layout = self.layout
        weights = torch.empty(len(ids), layout.dim, dtype=torch.float32, device=self.device)
        launch(
            _k_initial_weights, len(ids) * layout.dim, device_array(ids), self._seeded, self._span,
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
        launch(_k_gather, out.numel(), device_array(elements(self.rows)), device_array(blocks), 0,
               device_array(elements(out)))  # fmt: skip
        return out

    def write_blocks(self, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        """Whole rows written at present, distinct blocks."""
        launch(_k_put, rows.numel(), device_array(elements(self.rows)), device_array(blocks),
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
            launch(_k_gather, len(ids) * width, device_array(elements(self.rows)), device_array(blocks), start,
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
            launch(_k_metadata, len(ids), device_array(self.rows.view(torch.int64)), device_array(blocks),
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
        unique, last, occurrences = last_occurrences(ids[kept])
        with self.lock:
            blocks = self.locate(unique, insert=True)
            launch(
                _k_write_columns, len(unique) * values.shape[1], device_array(elements(self.rows)),
                device_array(blocks), device_array(kept[last]), device_array(elements(values)), start,
            )  # fmt: skip
            launch(_k_stamp, len(unique), device_array(self.rows.view(torch.int64)), device_array(blocks),
                   device_array(occurrences), now)  # fmt: skip

    def write_rows(self, rows: torch.Tensor) -> None:
        """``set_rows``: keys from the headers, timestamp and count kept, ``used`` set; last row wins."""
        words = rows.view(torch.int64)
        unique, last, _ = last_occurrences(words[:, 0].contiguous())
        with self.lock:
            blocks = self.locate(unique, insert=True)
            launch(_k_write_rows, len(unique) * words.shape[1], device_array(self.rows.view(torch.int64)),
                   device_array(blocks), device_array(last), device_array(words))  # fmt: skip

    def _remove(self, keys: torch.Tensor) -> int:
        """Delete distinct non-negative keys: zero and free their blocks; how many were present."""
        freed = torch.empty(len(keys), dtype=torch.int64, device=self.device)
        removed = torch.zeros(1, dtype=torch.int64, device=self.device)
        launch(
            _k_remove, len(keys), device_array(self._table_keys), device_array(self._table_blocks),
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
                _k_doomed, len(keys), device_array(words), device_array(blocks),
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
    return _U64(z ^ (z >> 31))
