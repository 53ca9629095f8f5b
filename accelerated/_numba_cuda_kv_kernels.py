"""The kernels of the ``numba-cuda`` store engine (``numba_cuda_kv_store``) and the one
helper that launches them: the table's lookups, bids, placements and removals, and the
row moves, plus the never-contracted float arithmetic the embedding kernels share.
Kernels move rows as raw words (int64 headers, element-wide columns), so they never
depend on the row dtype."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from numba import config, cuda

from leanstate.reference.hashing import INIT_BITS, SPLITMIX_GOLDEN, SPLITMIX_MIX1, SPLITMIX_MIX2
from leanstate.reference.row_format import COUNT_MAX

SIMULATED = bool(config.ENABLE_CUDASIM)
if SIMULATED:  # the simulator runs kernels as Python: uint64 wrap-around warns there
    warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning, __name__)

EMPTY, TOMBSTONE = -1, -2
NO_BID = np.int64(-1)  # below every id: ids are non-negative, so no id is mistaken for it
USED = np.int64(-(2**63))
STAMP_BITS = np.int64(0xFFFFFFFF)
COUNT_MAX64 = np.int64(COUNT_MAX)
THREADS = 16 if SIMULATED else 256  # the simulator starts one Python thread per thread of a block
MIN_SLOTS = 16 if SIMULATED else 1024  # the simulator runs one Python thread per slot
U64 = np.uint64
GOLDEN, MIX1, MIX2 = U64(SPLITMIX_GOLDEN), U64(SPLITMIX_MIX1), U64(SPLITMIX_MIX2)


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
        kernel[(n + THREADS - 1) // THREADS, THREADS](*args)


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
def splitmix64(x):
    z = x + GOLDEN
    z = (z ^ (z >> U64(30))) * MIX1
    z = (z ^ (z >> U64(27))) * MIX2
    return z ^ (z >> U64(31))


@cuda.jit(device=True)
def home(key, mask):
    return np.int64(splitmix64(U64(key)) & U64(mask))


@cuda.jit
def k_lookup(table_keys, table_blocks, ids, out):
    """Block of every id: -1 missing, -2 negative (padding)."""
    i = cuda.grid(1)
    if i >= ids.shape[0]:
        return
    key = ids[i]
    if key < 0:
        out[i] = -2
        return
    mask = table_keys.shape[0] - 1
    s = home(key, mask)
    while True:
        found = table_keys[s]
        if found == key:
            out[i] = table_blocks[s]
            return
        if found == EMPTY:
            out[i] = -1
            return
        s = (s + 1) & mask


@cuda.jit
def k_start(table_keys, keys, position):
    i = cuda.grid(1)
    if i < keys.shape[0]:
        position[i] = home(keys[i], table_keys.shape[0] - 1)


@cuda.jit
def k_bid(table_keys, bids, position, keys, placed):
    """Each pending id bids for its slot when the slot is free (empty or a tombstone)."""
    i = cuda.grid(1)
    if i < keys.shape[0] and not placed[i] and table_keys[position[i]] < 0:
        cuda.atomic.max(bids, position[i], keys[i])


@cuda.jit
def k_settle(table_keys, table_blocks, bids, position, keys, blocks, placed, reused, pending):
    """The largest bidder takes its free slot; the others move one slot on."""
    i = cuda.grid(1)
    if i >= keys.shape[0] or placed[i]:
        return
    s = position[i]
    if bids[s] == keys[i]:
        if table_keys[s] == TOMBSTONE:
            cuda.atomic.add(reused, 0, 1)
        table_keys[s] = keys[i]
        table_blocks[s] = blocks[i]
        bids[s] = NO_BID
        placed[i] = True
    else:
        position[i] = (s + 1) & (table_keys.shape[0] - 1)
        cuda.atomic.add(pending, 0, 1)


@cuda.jit
def k_live(table_keys, table_blocks, keys, blocks, count):
    """Every live (key, block), in no particular order; ``count[0]`` ends up the number."""
    s = cuda.grid(1)
    if s < table_keys.shape[0] and table_keys[s] >= 0:
        n = cuda.atomic.add(count, 0, 1)
        keys[n] = table_keys[s]
        blocks[n] = table_blocks[s]


@cuda.jit
def k_remove(table_keys, table_blocks, words, keys, freed, removed):
    """Tombstone each present key (distinct), zero its row and list its block as freed."""
    i = cuda.grid(1)
    if i >= keys.shape[0]:
        return
    key = keys[i]
    mask = table_keys.shape[0] - 1
    s = home(key, mask)
    while table_keys[s] != EMPTY:
        if table_keys[s] == key:
            block = table_blocks[s]
            table_keys[s] = TOMBSTONE
            for c in range(words.shape[1]):
                words[block, c] = 0
            freed[cuda.atomic.add(removed, 0, 1)] = block
            return
        s = (s + 1) & mask


# -- rows --------------------------------------------------------------------------------


@cuda.jit
def k_initial_weights(ids, seeded, span, low, out):
    """float32 ``[len(ids), dim]`` initial weights (``spec/kv_store.md``), one thread per value."""
    t = cuda.grid(1)
    dim = out.shape[1]
    if t >= ids.shape[0] * dim:
        return
    i, c = t // dim, t % dim
    per_key = splitmix64(U64(ids[i]) ^ seeded)
    bits = splitmix64(per_key ^ U64(c))
    u = np.float32(bits >> U64(64 - INIT_BITS)) * np.float32(1.0 / 2**INIT_BITS)
    out[i, c] = add(mul(span, u), low)


@cuda.jit
def k_gather(elems, blocks, start, out):
    """``out[i] = row(blocks[i])[start:start + width]``, zeros where the block is < 0."""
    t = cuda.grid(1)
    width = out.shape[1]
    if t >= blocks.shape[0] * width:
        return
    i, c = t // width, t % width
    b = blocks[i]
    out[i, c] = elems[b, start + c] if b >= 0 else 0


@cuda.jit
def k_put(elems, blocks, rows):
    """Whole rows (as elements) written at distinct present blocks."""
    t = cuda.grid(1)
    width = rows.shape[1]
    if t < blocks.shape[0] * width:
        i, c = t // width, t % width
        elems[blocks[i], c] = rows[i, c]


@cuda.jit
def k_write_columns(elems, blocks, source, values, start):
    """``row(blocks[u])[start:] = values[source[u]]`` for distinct blocks, one thread per value."""
    t = cuda.grid(1)
    width = values.shape[1]
    if t < blocks.shape[0] * width:
        u, c = t // width, t % width
        elems[blocks[u], start + c] = values[source[u], c]


@cuda.jit
def k_stamp(words, blocks, writes, now):
    """Header of each distinct block after ``writes[u]`` more writes: count (saturating),
    timestamp ``now``, used."""
    u = cuda.grid(1)
    if u < blocks.shape[0]:
        meta = words[blocks[u], 1]
        count = min(((meta >> 32) & COUNT_MAX64) + writes[u], COUNT_MAX64)
        words[blocks[u], 1] = np.int64(now) | (count << 32) | USED


@cuda.jit
def k_write_rows(words, blocks, source, rows):
    """Whole rows ``rows[source[u]]`` (as words) at distinct blocks, ``used`` set."""
    t = cuda.grid(1)
    width = rows.shape[1]
    if t < blocks.shape[0] * width:
        u, c = t // width, t % width
        word = rows[source[u], c]
        words[blocks[u], c] = word | USED if c == 1 else word


@cuda.jit
def k_metadata(words, blocks, out):
    i = cuda.grid(1)
    if i < blocks.shape[0]:
        out[i] = words[blocks[i], 1] if blocks[i] >= 0 else 0


@cuda.jit
def k_doomed(words, blocks, min_count, max_age_s, now, norms, min_l2_norm, doomed):
    """The eviction rules of ``spec/kv_store.md`` per live row (a threshold < 0 is off)."""
    i = cuda.grid(1)
    if i >= blocks.shape[0]:
        return
    meta = words[blocks[i], 1]
    stamp, count = meta & STAMP_BITS, (meta >> 32) & COUNT_MAX64
    doomed[i] = (
        (min_count >= 0 and count < min_count)
        or (max_age_s >= 0 and now - stamp > max_age_s)
        or (min_l2_norm >= 0 and norms[i] < min_l2_norm)
    )
