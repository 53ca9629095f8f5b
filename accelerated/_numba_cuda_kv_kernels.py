"""The kernels of the ``numba-cuda`` store engine (``numba_cuda_kv_store``): the table's
lookups, placements and removals, the row moves, the initial weights computed where they
are needed (which the embedding kernels compute too). Kernels move rows as raw words
(int64 headers, element-wide columns), so they never depend on the row dtype; they start
through ``_numba_cuda_runtime.launch`` and use its never-contracted arithmetic."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from numba import cuda

from leanstate.accelerated._numba_cuda_runtime import SIMULATED, add, float_bits, half_bits, mul
from leanstate.reference.hashing import INIT_BITS, SPLITMIX_GOLDEN, SPLITMIX_MIX1, SPLITMIX_MIX2
from leanstate.reference.row_format import COUNT_MAX

if SIMULATED:  # the simulator runs kernels as Python: uint64 wrap-around warns there
    warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning, __name__)

EMPTY, TOMBSTONE = -1, -2  # table slots; ids are non-negative, so no id is mistaken for either
USED = np.int64(-(2**63))
COUNT_MAX64 = np.int64(COUNT_MAX)
MIN_SLOTS = 16 if SIMULATED else 1024  # the simulator runs one Python thread per slot
U64 = np.uint64
GOLDEN, MIX1, MIX2 = U64(SPLITMIX_GOLDEN), U64(SPLITMIX_MIX1), U64(SPLITMIX_MIX2)
# how a float32 value is stored as a row element: the kernels write bits, never floats
KIND_FLOAT32, KIND_FLOAT16, KIND_BFLOAT16 = 0, 1, 2
KINDS = {torch.float32: KIND_FLOAT32, torch.float16: KIND_FLOAT16, torch.bfloat16: KIND_BFLOAT16}


# -- row elements ------------------------------------------------------------------------


@cuda.jit(device=True)
def element(value, kind):
    """The row element (int32 or int16 bits, as a signed value) of float32 ``value``,
    rounded to nearest even as torch's ``.to(dtype)`` rounds a finite value."""
    bits = float_bits(value)
    if kind == KIND_FLOAT32:
        return bits
    if kind == KIND_FLOAT16:
        half = half_bits(value)
    else:
        unsigned = bits & np.int64(0xFFFFFFFF)
        half = (unsigned + np.int64(0x7FFF) + ((unsigned >> 16) & 1)) >> 16
    return ((half + np.int64(0x8000)) & np.int64(0xFFFF)) - np.int64(0x8000)


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


@cuda.jit(device=True)
def initial_weight(key, c, seeded, span, low):
    """Column ``c`` of ``key``'s initial weights (``spec/kv_store.md``), float32."""
    per_key = splitmix64(U64(key) ^ seeded)
    bits = splitmix64(per_key ^ U64(c))
    u = np.float32(bits >> U64(64 - INIT_BITS)) * np.float32(1.0 / 2**INIT_BITS)
    return add(mul(span, u), low)


@cuda.jit(cache=True)
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


@cuda.jit(cache=True)
def k_place(table_keys, table_blocks, keys, found, rank, fresh, blocks):
    """``blocks[i]``: ``found[i]``, or for a missing id (-1) the fresh block ``fresh[rank[i]]``,
    its key claimed in the first free slot of its probe (empty or a tombstone) by
    compare-and-swap. The keys are distinct and absent, so a lost race only moves an id
    on: every round of placing is inside this one kernel, with no host in the loop."""
    i = cuda.grid(1)
    if i >= keys.shape[0]:
        return
    if found[i] != -1:
        blocks[i] = found[i]
        return
    key, block = keys[i], fresh[rank[i]]
    mask = table_keys.shape[0] - 1
    s = home(key, mask)
    while True:
        seen = table_keys[s]
        if seen < 0 and cuda.atomic.cas(table_keys, s, seen, key) == seen:
            table_blocks[s] = block
            blocks[i] = block
            return
        s = (s + 1) & mask


@cuda.jit(cache=True)
def k_live(table_keys, table_blocks, keys, blocks, count):
    """Every live (key, block), in no particular order; ``count[0]`` ends up the number."""
    s = cuda.grid(1)
    if s < table_keys.shape[0] and table_keys[s] >= 0:
        n = cuda.atomic.add(count, 0, 1)
        keys[n] = table_keys[s]
        blocks[n] = table_blocks[s]


@cuda.jit(cache=True)
def k_remove(table_keys, table_blocks, words, keys, freed, gone, removed):
    """Tombstone each present key (distinct), zero its row and list its block as freed and
    the key as gone (at the same place)."""
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
            n = cuda.atomic.add(removed, 0, 1)
            freed[n] = block
            gone[n] = key
            return
        s = (s + 1) & mask


# -- rows --------------------------------------------------------------------------------


@cuda.jit(cache=True)
def k_initial_rows(elems, words, blocks, keys, found, first, dim, seeded, span, low, kind):
    """The whole initial row of each id that ``found`` says was missing (-1), at its new
    block: header (key, ``used``), initial weights, zero state (and padding); one thread
    per element. The weights start right after the header, at element ``first``."""
    t = cuda.grid(1)
    width = elems.shape[1]
    if t >= keys.shape[0] * width:
        return
    i, c = t // width, t % width
    if found[i] != -1:
        return
    b = blocks[i]
    if c == 0:
        words[b, 0] = keys[i]
        words[b, 1] = USED
    elif c >= first:
        column = c - first
        inside = column >= 0 and column < dim
        elems[b, c] = element(initial_weight(keys[i], column, seeded, span, low), kind) if inside else 0


@cuda.jit(cache=True)
def k_gather(elems, blocks, ids, start, initial, first, dim, seeded, span, low, kind, out):
    """``out[i] = row(blocks[i])[start:start + width]``; a missing id (-1) its initial
    weights when ``initial`` (zeros elsewhere), a negative one (-2) zeros."""
    t = cuda.grid(1)
    width = out.shape[1]
    if t >= blocks.shape[0] * width:
        return
    i, c = t // width, t % width
    b = blocks[i]
    if b >= 0:
        out[i, c] = elems[b, start + c]
        return
    column = start + c - first
    if b == -1 and initial and column >= 0 and column < dim:
        out[i, c] = element(initial_weight(ids[i], column, seeded, span, low), kind)
    else:
        out[i, c] = 0


@cuda.jit(cache=True)
def k_put(elems, blocks, rows):
    """Whole rows (as elements) written at distinct present blocks."""
    t = cuda.grid(1)
    width = rows.shape[1]
    if t < blocks.shape[0] * width:
        i, c = t // width, t % width
        elems[blocks[i], c] = rows[i, c]


@cuda.jit(cache=True)
def k_write_columns(elems, blocks, source, values, start):
    """``row(blocks[u])[start:] = values[source[u]]`` for distinct blocks (none < 0), one
    thread per value."""
    t = cuda.grid(1)
    width = values.shape[1]
    if t < blocks.shape[0] * width:
        u, c = t // width, t % width
        if blocks[u] >= 0:
            elems[blocks[u], start + c] = values[source[u], c]


@cuda.jit(cache=True)
def k_stamp(words, blocks, writes, now):
    """Header of each distinct block (none < 0) after ``writes[u]`` more writes: count
    (saturating), timestamp ``now``, used."""
    u = cuda.grid(1)
    if u < blocks.shape[0] and blocks[u] >= 0:
        meta = words[blocks[u], 1]
        count = min(((meta >> 32) & COUNT_MAX64) + writes[u], COUNT_MAX64)
        words[blocks[u], 1] = np.int64(now) | (count << 32) | USED


@cuda.jit(cache=True)
def k_write_rows(words, blocks, source, rows):
    """Whole rows ``rows[source[u]]`` (as words) at distinct blocks, ``used`` set."""
    t = cuda.grid(1)
    width = rows.shape[1]
    if t < blocks.shape[0] * width:
        u, c = t // width, t % width
        word = rows[source[u], c]
        words[blocks[u], c] = word | USED if c == 1 else word


@cuda.jit(cache=True)
def k_mark(stamps, blocks, epoch):
    """Stamp ``epoch`` on every block >= 0 (change tracking: the blocks written)."""
    u = cuda.grid(1)
    if u < blocks.shape[0] and blocks[u] >= 0:
        stamps[blocks[u]] = epoch


@cuda.jit(cache=True)
def k_metadata(words, blocks, out):
    i = cuda.grid(1)
    if i < blocks.shape[0]:
        out[i] = words[blocks[i], 1] if blocks[i] >= 0 else 0
