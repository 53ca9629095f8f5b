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
  (on huge pages after a bulk ``reserve``);
- a free list of released blocks, reused last in first out, as the reference does;
- a readers-writer lock: reads run concurrently (the kernels release the GIL), writes
  are exclusive. One call already spreads over every core, so the shards of the
  reference are not needed for parallelism here.

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

import mmap
import threading
from contextlib import contextmanager

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from leanstate.accelerated import _host_buffers
from leanstate.accelerated._pages import populate
from leanstate.reference.hashing import INIT_BITS
from leanstate.reference.row_format import COUNT_MAX, RowLayout

_EMPTY = -1
_TOMBSTONE = -2
_USED = np.int64(-(2**63))  # bit 63 of the metadata word
_STAMP_BITS = np.int64(0xFFFFFFFF)
_COUNT_MAX = np.int64(COUNT_MAX)
_U64 = np.uint64
POOL_STEP_ROWS = 1024
_HUGE_PAGE_RESERVE_BYTES = 64 * 2**20
_HEADROOM_DIVISOR = 32  # rows faulted in ahead of need: at most 1/32 of the pool (memory)
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
}


# -- threads -----------------------------------------------------------------------------

SERIAL_BELOW = 2**21
"""Elements moved by one call (ids x row columns) below which its kernels run on one thread.

Measured on 2 cores with a second CPU-bound process running: a parallel region waits for
its slowest thread, and a thread that lost its core costs a scheduler slice, so a 256 x 20
embedding step took 6.4 ms on 2 threads against 2.0 ms on one. Alone, 2 threads gain
little below this size (16,384 ids x 128: 1.8 ms serial, 1.3 ms parallel).
"""


_pool_started = False


def use_threads(work: int) -> None:
    """Set this thread's numba thread count for a call that moves ``work`` elements: one
    below ``SERIAL_BELOW``, else ``torch.get_num_threads()`` (so ``OMP_NUM_THREADS``,
    ``torch.set_num_threads`` and torchrun's setting apply), capped by numba's pool."""
    global _pool_started
    if not _pool_started:
        # Starting numba's OpenMP pool sets the OpenMP thread count of the whole process,
        # torch's included (it reached torch's libgomp here): torch.set_num_threads(1)
        # silently became 2, and 2 ranks on 2 cores spun 4 threads (3.7x the CPU per
        # lookup of 1 rank). Put torch's own setting back.
        wanted = torch.get_num_threads()
        numba.get_num_threads()
        torch.set_num_threads(wanted)
        _pool_started = True
    threads = 1 if work < SERIAL_BELOW else min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)


# -- hashing -----------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def _splitmix64(x):
    z = x + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


@njit(nogil=True, cache=True, parallel=True)
def _initial_weights(ids, dim, seed, low, high):
    """float32 [len(ids), dim] initial weights: ``spec/kv_store.md`` restated per element."""
    out = np.empty((ids.shape[0], dim), dtype=np.float32)
    seeded = _splitmix64(seed)
    span = np.float32(np.float32(high) - np.float32(low))
    low32 = np.float32(low)
    scale = np.float32(1.0 / 2**INIT_BITS)
    for i in prange(ids.shape[0]):
        per_key = _splitmix64(_U64(ids[i]) ^ seeded)
        for c in range(dim):
            bits = _splitmix64(per_key ^ _U64(c))
            u = np.float32(bits >> _U64(64 - INIT_BITS)) * scale
            out[i, c] = np.float32(span * u) + low32
    return out


@njit(nogil=True, cache=True)
def _home(key, mask):
    return np.int64(_splitmix64(_U64(key)) & _U64(mask))


@njit(nogil=True, cache=True)
def _probe(table_keys, table_blocks, key):
    """Block of ``key``, or -1 when it is absent (-2 for a negative key)."""
    if key < 0:
        return -2
    mask = table_keys.shape[0] - 1
    s = _home(key, mask)
    while table_keys[s] != _EMPTY:
        if table_keys[s] == key:
            return np.int64(table_blocks[s])
        s = (s + 1) & mask
    return -1


@intrinsic
def _prefetch(typingctx, array, index):
    """Ask the CPU to start loading ``array.flat[index]``'s cache line (a hint: no effect on results)."""

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        data = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, data, [args[1]], wraparound=False)
        byte_pointer = ir.IntType(8).as_pointer()
        int32 = ir.IntType(32)
        function = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [byte_pointer, int32, int32, int32]),
            "llvm.prefetch.p0",
        )
        # read, keep in every cache level, data cache
        builder.call(
            function,
            [
                builder.bitcast(pointer, byte_pointer),
                ir.Constant(int32, 0),
                ir.Constant(int32, 3),
                ir.Constant(int32, 1),
            ],
        )
        return context.get_dummy_value()

    return types.void(array, index), codegen


_GATHER_CHUNK = 1024  # ids per task of the prefetching lookup and gather
_AHEAD = 8  # ids between a probe and the copy of its row (measured best of 4..32 at 1M rows)


@njit(nogil=True, cache=True)
def _prefetch_home(table_keys, table_blocks, key, mask):
    if key >= 0:
        s = _home(key, mask)
        _prefetch(table_keys, s)
        _prefetch(table_blocks, s)


@njit(nogil=True, cache=True, parallel=True)
def _lookup(table_keys, table_blocks, ids):
    """Block of every id: -1 missing, -2 negative (padding); each task prefetches the
    table slots ``_AHEAD`` ids ahead of its probe (the table is far bigger than the caches)."""
    n = ids.shape[0]
    out = np.empty(n, dtype=np.int64)
    mask = table_keys.shape[0] - 1
    for chunk in prange((n + _GATHER_CHUNK - 1) // _GATHER_CHUNK):
        lo = chunk * _GATHER_CHUNK
        hi = min(n, lo + _GATHER_CHUNK)
        for i in range(lo, min(hi, lo + _AHEAD)):
            _prefetch_home(table_keys, table_blocks, ids[i], mask)
        for i in range(lo, hi):
            if i + _AHEAD < hi:
                _prefetch_home(table_keys, table_blocks, ids[i + _AHEAD], mask)
            out[i] = _probe(table_keys, table_blocks, ids[i])
    return out


@njit(nogil=True, cache=True)
def _place(table_keys, table_blocks, key, block):
    """Put an absent key in the first free or dead slot of its probe path; True if dead."""
    mask = table_keys.shape[0] - 1
    s = _home(key, mask)
    while table_keys[s] >= 0:
        s = (s + 1) & mask
    dead = table_keys[s] == _TOMBSTONE
    table_keys[s] = key
    table_blocks[s] = block
    return dead


@njit(nogil=True, cache=True)
def _rebuild(table_keys, table_blocks, capacity):
    new_keys = np.full(capacity, _EMPTY, dtype=np.int64)
    new_blocks = np.zeros(capacity, dtype=np.int32)
    for s in range(table_keys.shape[0]):
        if table_keys[s] >= 0:
            _place(new_keys, new_blocks, table_keys[s], table_blocks[s])
    return new_keys, new_blocks


@njit(nogil=True, cache=True)
def _insert_missing(table_keys, table_blocks, ids, blocks, free, free_top, handed_out, fresh):
    """Give every id with block -1 a block, in batch order (a repeat finds the first's).

    ``fresh`` receives the positions of the ids that were inserted (``_init_fresh``
    writes their headers). Returns (free_top, handed_out, inserted, dead slots reused).
    """
    inserted = 0
    reused = 0
    mask = table_keys.shape[0] - 1
    for i in range(min(ids.shape[0], _AHEAD)):
        if blocks[i] == -1:
            _prefetch_home(table_keys, table_blocks, ids[i], mask)
    for i in range(ids.shape[0]):
        # the table is far bigger than the caches: start loading a later id's slot now
        if i + _AHEAD < ids.shape[0] and blocks[i + _AHEAD] == -1:
            _prefetch_home(table_keys, table_blocks, ids[i + _AHEAD], mask)
        if blocks[i] != -1:
            continue
        block = _probe(table_keys, table_blocks, ids[i])
        if block < 0:
            if free_top > 0:
                free_top -= 1
                block = free[free_top]
            else:
                block = handed_out
                handed_out += 1
            if _place(table_keys, table_blocks, ids[i], block):
                reused += 1
            fresh[inserted] = i
            inserted += 1
        blocks[i] = block
    return free_top, handed_out, inserted, reused


@njit(nogil=True, cache=True)
def _init_fresh(words, ids, blocks, fresh):
    """Header (key, used) of each freshly inserted row; the rest keeps the pool's zeros.

    Serial on purpose: this is the first touch of new pool pages, and page faults from
    several threads of one process contend in the kernel (measured 2.6x slower).
    """
    for k in range(fresh.shape[0]):
        i = fresh[k]
        words[blocks[i], 0] = ids[i]
        words[blocks[i], 1] = _USED


# -- reads -------------------------------------------------------------------------------


@njit(nogil=True, cache=True, parallel=True)
def _lookup_gather(table_keys, table_blocks, elems, ids, start, out, blocks):
    """``blocks[i]`` = block of ``ids[i]`` (as ``_lookup``) and ``out[i]`` = its columns
    ``[start, start + width)`` (zeros where the block is < 0).

    A software pipeline per chunk of ids: the table slots of id ``i + 2 * _AHEAD`` and the
    row of id ``i + _AHEAD`` are prefetched while row ``i`` is copied, so the random reads
    of the table and the pool overlap instead of waiting one after another (measured at
    1M rows: 3.1 ms instead of 4.7 ms for 65,536 ids).
    """
    n = ids.shape[0]
    width = out.shape[1]
    row_elems = elems.shape[1]
    flat = elems.reshape(-1)
    mask = table_keys.shape[0] - 1
    line = 64 // elems.itemsize  # elements per 64-byte cache line
    lines = (width + line - 1) // line
    for chunk in prange((n + _GATHER_CHUNK - 1) // _GATHER_CHUNK):
        lo = chunk * _GATHER_CHUNK
        hi = min(n, lo + _GATHER_CHUNK)
        for i in range(lo, min(hi, lo + 2 * _AHEAD)):
            _prefetch_home(table_keys, table_blocks, ids[i], mask)
        for i in range(lo, min(hi, lo + _AHEAD)):
            b = _probe(table_keys, table_blocks, ids[i])
            blocks[i] = b
            if b >= 0:
                for k in range(lines):
                    _prefetch(flat, b * row_elems + start + k * line)
        for i in range(lo, hi):
            if i + 2 * _AHEAD < hi:
                _prefetch_home(table_keys, table_blocks, ids[i + 2 * _AHEAD], mask)
            ahead = i + _AHEAD
            if ahead < hi:
                b = _probe(table_keys, table_blocks, ids[ahead])
                blocks[ahead] = b
                if b >= 0:
                    for k in range(lines):
                        _prefetch(flat, b * row_elems + start + k * line)
            b = blocks[i]
            if b >= 0:
                out[i, :] = elems[b, start : start + width]
            else:
                out[i, :] = 0


@njit(nogil=True, cache=True, parallel=True)
def _gather_metadata(words, blocks):
    out = np.zeros(blocks.shape[0], dtype=np.int64)
    for i in prange(blocks.shape[0]):
        if blocks[i] >= 0:
            out[i] = words[blocks[i], 1]
    return out


@njit(nogil=True, cache=True)
def _live(table_keys, table_blocks, size):
    keys = np.empty(size, dtype=np.int64)
    blocks = np.empty(size, dtype=np.int64)
    n = 0
    for s in range(table_keys.shape[0]):
        if table_keys[s] >= 0:
            keys[n] = table_keys[s]
            blocks[n] = table_blocks[s]
            n += 1
    return keys, blocks


# -- writes ------------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def _mark_last_writers(words, blocks, winner):
    """Backward pass: ``winner[i]`` for the last occurrence of each block.

    While the call runs, a marked row has ``used`` cleared and its occurrence count in
    the timestamp bits; every present row has ``used`` set before the call.
    """
    for i in range(blocks.shape[0] - 1, -1, -1):
        b = blocks[i]
        if b < 0:
            winner[i] = False
            continue
        meta = words[b, 1]
        if meta < 0:  # used: not seen yet from the back
            winner[i] = True
            words[b, 1] = (meta & ~_USED & ~_STAMP_BITS) | 1
        else:
            winner[i] = False
            words[b, 1] = meta + 1


@njit(nogil=True, cache=True, parallel=True)
def _write_columns(elems, words, blocks, winner, values, start, now):
    """Copy each winner's values into its row, then stamp ``now`` and add its occurrences."""
    width = values.shape[1]
    for i in prange(blocks.shape[0]):
        if not winner[i]:
            continue
        b = blocks[i]
        if width > 0:
            elems[b, start : start + width] = values[i, :]
        meta = words[b, 1]
        count = min(((meta >> 32) & _COUNT_MAX) + (meta & _STAMP_BITS), _COUNT_MAX)
        words[b, 1] = np.int64(now) | (count << 32) | _USED


@njit(nogil=True, cache=True)
def _mark_last_rows(words, blocks, winner):
    """Backward pass for ``set_rows``: the last row of each block wins (marks: ``used`` cleared)."""
    for i in range(blocks.shape[0] - 1, -1, -1):
        b = blocks[i]
        winner[i] = words[b, 1] < 0
        words[b, 1] &= ~_USED


@njit(nogil=True, cache=True, parallel=True)
def _write_rows(words, blocks, winner, rows):
    for i in prange(blocks.shape[0]):
        if winner[i]:
            b = blocks[i]
            words[b, :] = rows[i, :]
            words[b, 1] |= _USED


@njit(nogil=True, cache=True)
def _remove(table_keys, table_blocks, words, ids, free, free_top):
    """Tombstone present ids, zero and free their blocks. Returns (removed, free_top)."""
    removed = 0
    mask = table_keys.shape[0] - 1
    for i in range(ids.shape[0]):
        if ids[i] < 0:
            continue
        s = _home(ids[i], mask)
        while table_keys[s] != _EMPTY:
            if table_keys[s] == ids[i]:
                block = table_blocks[s]
                table_keys[s] = _TOMBSTONE
                words[block, :] = 0
                free[free_top] = block
                free_top += 1
                removed += 1
                break
            s = (s + 1) & mask
    return removed, free_top


# -- the engine --------------------------------------------------------------------------


class _ReadersWriterLock:
    """Many readers or one writer; a waiting writer holds back new readers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextmanager
    def reading(self):
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def writing(self):
        with self._cond:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


_ELEMENT_VIEW = {4: torch.int32, 2: torch.int16}


def as_elements(t: torch.Tensor) -> np.ndarray:
    """A row tensor as a numpy array of same-width integers (bits, not values)."""
    return t.view(_ELEMENT_VIEW[t.element_size()]).numpy()


def as_words(t: torch.Tensor) -> np.ndarray:
    """A contiguous [N, W] row tensor as int64 words [N, row_bytes / 8]."""
    return t.view(torch.int64).numpy()


class KVStoreEngine:
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
        self.lock = _ReadersWriterLock()
        self._words_per_row = layout.row_bytes // 8
        self.table_keys = np.full(_MIN_SLOTS, _EMPTY, dtype=np.int64)
        self.table_blocks = np.zeros(_MIN_SLOTS, dtype=np.int32)
        self.size = 0
        self.dead = 0
        self.free = np.empty(_MIN_SLOTS, dtype=np.int32)
        self.free_top = 0
        self.handed_out = 0
        self._map = mmap.mmap(
            -1, POOL_STEP_ROWS * layout.row_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        self._prefault: threading.Thread | None = None
        self._faulted_to = 0  # pool bytes below this were handed out or faulted in ahead
        self._view_pool()

    def _view_pool(self) -> None:
        rows = len(self._map) // self.layout.row_bytes
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pool = raw.view(self.layout.dtype).view(rows, self.layout.width)  # the rows, typed
        self.words = as_words(self.pool)
        self.elems = as_elements(self.pool)

    def __len__(self) -> int:
        return self.size

    def memory_bytes(self) -> int:
        """The mapped pool, the hash table and the free list."""
        with self.lock.reading():
            return len(self._map) + self.table_keys.nbytes + self.table_blocks.nbytes + self.free.nbytes

    # -- capacity (under the write lock) -------------------------------------------

    def _reserve(self, new: int, *, ahead: bool = True) -> None:
        """Room for ``new`` more keys: table at most half full, pool rows mapped.

        ``ahead``: when the pool must grow, also map up to ``new`` more rows (at most 1/32 of
        the pool, and none below 32 steps of rows) and fault them in on a background thread, so the next insert of that
        size finds its pages ready instead of faulting them on its own path (page faults
        are the cost of an insert: 12 ms of a 17 ms insert of 65,536 rows of 544 bytes).
        """
        if 2 * (self.size + self.dead + new) > len(self.table_keys):
            capacity = _MIN_SLOTS
            while 2 * (self.size + new) > capacity:
                capacity *= 2
            self.table_keys, self.table_blocks = _rebuild(self.table_keys, self.table_blocks, capacity)
            self.dead = 0
        row_bytes = self.layout.row_bytes
        rows_needed = self.handed_out + max(0, new - self.free_top)
        rows_mapped = len(self._map) // row_bytes
        headroom = min(new, rows_mapped // _HEADROOM_DIVISOR) if ahead else 0
        if headroom < POOL_STEP_ROWS:  # a small pool faults in cheaply: grow it by need only
            headroom = 0
        if rows_needed > rows_mapped:
            rows = -(-(rows_needed + headroom) // POOL_STEP_ROWS) * POOL_STEP_ROWS
            self._finish_prefault()  # no thread may touch the pages a resize can move
            del self.pool, self.words, self.elems  # no view may outlive a resize
            self._map.resize(rows * row_bytes)
            self._view_pool()
            if headroom:
                first = max(self._faulted_to, rows_needed * row_bytes)
                self._prefault = threading.Thread(target=populate, args=(self._map, first), daemon=True)
                self._prefault.start()
                self._faulted_to = len(self._map)

    def _finish_prefault(self) -> None:
        if self._prefault is not None:
            self._prefault.join()
            self._prefault = None

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more rows now: one table rebuild, and the pool rows mapped and
        faulted in, so the inserts that follow write to memory that is already there.

        A bulk reservation (64 MiB of rows or more, as a checkpoint load makes) also asks
        for huge pages: the pool is then filled in 2 MiB faults instead of 4 KiB ones
        (measured: a 1M-row load 0.21 s instead of 0.40 s).
        """
        with self.lock.writing():
            self._reserve(max(0, rows), ahead=False)
            if rows * self.layout.row_bytes >= _HUGE_PAGE_RESERVE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
                self._map.madvise(mmap.MADV_HUGEPAGE)
            self._finish_prefault()
            first = self.handed_out * self.layout.row_bytes
            last = first + max(0, rows - self.free_top) * self.layout.row_bytes
            populate(self._map, first, last, touch=True)
            self._faulted_to = max(self._faulted_to, last)

    # -- helpers -------------------------------------------------------------------

    def _initial_weights(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), dim] initial weights in the row dtype."""
        low, high = self.init_range
        weights = _initial_weights(ids.numpy(), self.layout.dim, _U64(self.seed & (2**64 - 1)), low, high)
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
            return torch.from_numpy(_lookup(self.table_keys, self.table_blocks, ids.numpy()))
        blocks, fresh = self._locate_or_insert(ids)
        self._fill_initial(ids, blocks, fresh)
        return torch.from_numpy(blocks)

    def read_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Whole rows (a copy) of present blocks."""
        return self.pool.index_select(0, blocks)

    def write_blocks(self, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        """Whole rows written at present, distinct blocks."""
        self.pool.index_copy_(0, blocks, rows)

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
            _lookup_gather(
                self.table_keys, self.table_blocks, self.elems, ids.numpy(), start, as_elements(out), blocks
            )
        if initial and width:
            missing = torch.from_numpy(np.flatnonzero(blocks == -1))
            if len(missing):
                self._initial_columns(ids[missing], out, missing, start)
        return out

    def _initial_columns(
        self, ids: torch.Tensor, out: torch.Tensor, positions: torch.Tensor, start: int
    ) -> None:
        """Columns ``[start, start + width)`` of the initial rows of ``ids`` into ``out[positions]``."""
        out[positions] = self.initial_rows(ids)[:, start : start + out.shape[1]]

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        use_threads(len(ids))
        with self.lock.reading():
            return torch.from_numpy(_lookup(self.table_keys, self.table_blocks, ids.numpy()) >= 0)

    def metadata(self, ids: torch.Tensor) -> torch.Tensor:
        use_threads(len(ids))
        with self.lock.reading():
            blocks = _lookup(self.table_keys, self.table_blocks, ids.numpy())
            return torch.from_numpy(_gather_metadata(self.words, blocks))

    def keys(self) -> torch.Tensor:
        with self.lock.reading():
            keys, _ = _live(self.table_keys, self.table_blocks, self.size)
        return torch.sort(torch.from_numpy(keys)).values

    def _live_sorted(self) -> tuple[torch.Tensor, np.ndarray]:
        """(ids ascending, their blocks); call with the lock held."""
        keys, blocks = _live(self.table_keys, self.table_blocks, self.size)
        order = np.argsort(keys, kind="stable")
        return torch.from_numpy(keys[order]), blocks[order]

    # -- writes --------------------------------------------------------------------

    def _locate_or_insert(self, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, positions inserted) for ``ids``; call with the write lock held.

        Missing non-negative ids are inserted with header (key, used), zero columns.
        """
        keys = ids.numpy()
        blocks = _lookup(self.table_keys, self.table_blocks, keys)
        missing = int(np.count_nonzero(blocks == -1))
        fresh = np.empty(missing, dtype=np.int64)
        if missing:
            self._reserve(missing)
            self.free_top, self.handed_out, inserted, reused = _insert_missing(
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
            _init_fresh(self.words, keys, blocks, fresh)
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
            _mark_last_writers(self.words, blocks, winner)
            _write_columns(self.elems, self.words, blocks, winner, as_elements(values), start, now)

    def write_rows(self, rows: torch.Tensor) -> None:
        words = as_words(rows)
        use_threads(rows.numel())
        with self.lock.writing():
            blocks, _ = self._locate_or_insert(torch.from_numpy(words[:, 0].copy()))
            winner = np.empty(len(blocks), dtype=np.bool_)
            _mark_last_rows(self.words, blocks, winner)
            _write_rows(self.words, blocks, winner, words)

    def delete(self, ids: torch.Tensor) -> int:
        with self.lock.writing():
            return self._delete(ids.numpy())

    def _delete(self, ids: np.ndarray) -> int:
        if self.free_top + len(ids) > len(self.free):
            grown = np.empty(max(2 * len(self.free), self.free_top + len(ids)), dtype=np.int32)
            grown[: self.free_top] = self.free[: self.free_top]
            self.free = grown
        removed, self.free_top = _remove(
            self.table_keys, self.table_blocks, self.words, ids, self.free, self.free_top
        )
        self.size -= removed
        self.dead += removed
        return removed

    # -- eviction ------------------------------------------------------------------

    def evict(
        self,
        *,
        min_count: int | None,
        max_age_s: int | None,
        min_l2_norm: float | None,
        max_rows: int | None,
        now: int,
    ) -> torch.Tensor:
        """Decide and delete under the write lock: atomic with respect to every other call."""
        layout = self.layout
        with self.lock.writing():
            keys, blocks = self._live_sorted()
            meta = torch.from_numpy(self.words[blocks, 1])
            stamp, count = meta & 0xFFFFFFFF, (meta >> 32) & COUNT_MAX
            doomed = torch.zeros(len(keys), dtype=torch.bool)
            if min_count is not None:
                doomed |= count < min_count
            if max_age_s is not None:
                doomed |= (now - stamp) > max_age_s
            if min_l2_norm is not None:
                weights = self.pool[
                    torch.from_numpy(blocks), layout.weight_offset : layout.weight_offset + layout.dim
                ]
                doomed |= torch.linalg.vector_norm(weights.float(), dim=1) < min_l2_norm
            if max_rows is not None:
                survivors = torch.nonzero(~doomed).flatten()
                excess = len(survivors) - max_rows
                if excess > 0:
                    # lexsort: the last key is the primary one (count, then stamp, then id)
                    order = np.lexsort(
                        (keys[survivors].numpy(), stamp[survivors].numpy(), count[survivors].numpy())
                    )
                    doomed[survivors[torch.from_numpy(order[:excess])]] = True
            victims = keys[doomed]
            self._delete(victims.numpy())
        return victims
