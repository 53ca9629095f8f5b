"""The ``numba`` KV store: the reference store with its per-row Python work in Numba.

Same class, same API, same bits as ``leanstate.reference.kv_store.KVStore``: only the
hooks differ. A shard keeps its id -> block map in an open-addressing hash table of
two int64 arrays (linear probing, tombstones, rebuilt past half full) and its rows in
chunks of int64 words (a row is ``row_bytes / 8`` words, header included), so the
kernels move whole rows without knowing the dtype. The shard hash and the initial
weights are compiled restatements of ``leanstate.reference.hashing``. Kernels are
``@njit(nogil=True, cache=True)``: a shard's kernel runs without the GIL, under that
shard's lock.
"""

from __future__ import annotations

import threading

import numba
import numpy as np
import torch
from numba import njit

from leanstate.reference.hashing import INIT_BITS
from leanstate.reference.kv_store import ROWS_PER_CHUNK
from leanstate.reference.kv_store import KVStore as ReferenceKVStore
from leanstate.reference.row_format import RowLayout

_EMPTY = -1
_TOMBSTONE = -2
_USED = np.int64(-(2**63))  # bit 63 of the metadata word
_U64 = np.uint64


@njit(nogil=True, cache=True)
def _splitmix64(x):
    z = x + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


@njit(nogil=True, cache=True)
def _shards_of(ids, num_shards):
    out = np.empty(ids.shape[0], dtype=np.int64)
    n = _U64(num_shards)
    for i in range(ids.shape[0]):
        key = _U64(ids[i])  # two's complement bits of the int64
        h = _U64(0xCBF29CE484222325)
        for b in range(8):
            byte = (key >> _U64(8 * b)) & _U64(0xFF)
            h = h * _U64(0x100000001B3)
            if byte >= _U64(0x80):
                byte = byte | _U64(0xFFFFFFFFFFFFFF00)  # sign extension
            h = h ^ byte
        low = h & _U64(0xFFFFFFFF)
        high = h >> _U64(32)
        out[i] = np.int64((n * high + ((n * low) >> _U64(32))) >> _U64(32))
    return out


@njit(nogil=True, cache=True)
def _initial_weights(ids, dim, seed, low, high):
    out = np.empty((ids.shape[0], dim), dtype=np.float32)
    seeded = _splitmix64(seed)
    span = np.float32(np.float32(high) - np.float32(low))
    scale = np.float32(1.0 / 2**INIT_BITS)
    for i in range(ids.shape[0]):
        per_key = _splitmix64(_U64(ids[i]) ^ seeded)
        for c in range(dim):
            bits = _splitmix64(per_key ^ _U64(c))
            u = np.float32(bits >> _U64(64 - INIT_BITS)) * scale
            out[i, c] = np.float32(span * u) + np.float32(low)
    return out


@njit(nogil=True, cache=True)
def _slot(key, mask):
    return np.int64(_splitmix64(_U64(key)) & _U64(mask))


@njit(nogil=True, cache=True)
def _lookup(table_keys, table_blocks, keys):
    out = np.empty(keys.shape[0], dtype=np.int64)
    mask = table_keys.shape[0] - 1
    for i in range(keys.shape[0]):
        s = _slot(keys[i], mask)
        out[i] = -1
        while table_keys[s] != _EMPTY:
            if table_keys[s] == keys[i]:
                out[i] = table_blocks[s]
                break
            s = (s + 1) & mask
    return out


@njit(nogil=True, cache=True)
def _insert(table_keys, table_blocks, key, block):
    """Put a key known to be absent; reuses the first tombstone on its probe path."""
    mask = table_keys.shape[0] - 1
    s = _slot(key, mask)
    while table_keys[s] >= 0:
        s = (s + 1) & mask
    reused = table_keys[s] == _TOMBSTONE
    table_keys[s] = key
    table_blocks[s] = block
    return reused


@njit(nogil=True, cache=True)
def _rebuild(table_keys, table_blocks, capacity):
    new_keys = np.full(capacity, _EMPTY, dtype=np.int64)
    new_blocks = np.zeros(capacity, dtype=np.int64)
    for s in range(table_keys.shape[0]):
        if table_keys[s] >= 0:
            _insert(new_keys, new_blocks, table_keys[s], table_blocks[s])
    return new_keys, new_blocks


@njit(nogil=True, cache=True)
def _gather(chunks, rows_per_chunk, blocks, out, positions):
    words = out.shape[1]
    for i in range(blocks.shape[0]):
        chunk = chunks[blocks[i] // rows_per_chunk]
        row, target = blocks[i] % rows_per_chunk, positions[i]
        for w in range(words):  # an explicit loop: faster than a slice copy here
            out[target, w] = chunk[row, w]


@njit(nogil=True, cache=True)
def _gather_metadata(chunks, rows_per_chunk, blocks):
    out = np.empty(blocks.shape[0], dtype=np.int64)
    for i in range(blocks.shape[0]):
        out[i] = chunks[blocks[i] // rows_per_chunk][blocks[i] % rows_per_chunk, 1]
    return out


@njit(nogil=True, cache=True)
def _store(
    table_keys,
    table_blocks,
    chunks,
    rows_per_chunk,
    keys,
    blocks,
    rows,
    positions,
    free,
    free_top,
    handed_out,
):
    """Allocate blocks for keys with block -1, insert them, write each ``rows[positions[i]]``
    with ``used`` set.

    Returns (free_top, handed_out, tombstones reused).
    """
    reused = 0
    for i in range(keys.shape[0]):
        block = blocks[i]
        if block < 0:
            if free_top > 0:
                free_top -= 1
                block = free[free_top]
            else:
                block = handed_out
                handed_out += 1
            if _insert(table_keys, table_blocks, keys[i], block):
                reused += 1
        target = chunks[block // rows_per_chunk][block % rows_per_chunk]
        target[:] = rows[positions[i], :]
        target[1] |= _USED
    return free_top, handed_out, reused


@njit(nogil=True, cache=True)
def _remove(table_keys, table_blocks, chunks, rows_per_chunk, keys, free, free_top):
    """Tombstone present keys, zero and free their blocks. Returns (removed, free_top)."""
    mask = table_keys.shape[0] - 1
    removed = 0
    for i in range(keys.shape[0]):
        s = _slot(keys[i], mask)
        while table_keys[s] != _EMPTY:
            if table_keys[s] == keys[i]:
                block = table_blocks[s]
                table_keys[s] = _TOMBSTONE
                chunks[block // rows_per_chunk][block % rows_per_chunk, :] = 0
                free[free_top] = block
                free_top += 1
                removed += 1
                break
            s = (s + 1) & mask
    return removed, free_top


@njit(nogil=True, cache=True)
def _live_keys(table_keys, size):
    out = np.empty(size, dtype=np.int64)
    n = 0
    for s in range(table_keys.shape[0]):
        if table_keys[s] >= 0:
            out[n] = table_keys[s]
            n += 1
    return out


def _words(rows: torch.Tensor) -> np.ndarray:
    """Rows of any dtype as int64 words (a view when ``rows`` is contiguous)."""
    return rows.contiguous().view(torch.int64).numpy()


class _NumbaShard:
    """A shard with the reference shard's methods, backed by arrays and compiled kernels."""

    def __init__(self, layout: RowLayout, rows_per_chunk: int) -> None:
        self.lock = threading.Lock()
        self.layout = layout
        self.words = layout.row_bytes // 8
        self.rows_per_chunk = rows_per_chunk
        self.chunks = numba.typed.List.empty_list(numba.types.int64[:, ::1])
        self.table_keys = np.full(16, _EMPTY, dtype=np.int64)
        self.table_blocks = np.zeros(16, dtype=np.int64)
        self.size = 0
        self.tombstones = 0
        self.free = np.empty(16, dtype=np.int64)
        self.free_top = 0
        self.handed_out = 0

    def __len__(self) -> int:
        return self.size

    def keys(self) -> torch.Tensor:
        return torch.from_numpy(_live_keys(self.table_keys, self.size))

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(_lookup(self.table_keys, self.table_blocks, keys.numpy()))

    def read_into(self, blocks: torch.Tensor, out: torch.Tensor, positions: torch.Tensor) -> None:
        _gather(
            self.chunks, self.rows_per_chunk, blocks.numpy(), out.view(torch.int64).numpy(), positions.numpy()
        )

    def read_metadata(self, blocks: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(_gather_metadata(self.chunks, self.rows_per_chunk, blocks.numpy()))

    def _reserve(self, new: int) -> None:
        """Room for ``new`` more keys: table at most half full, blocks allocated."""
        if 2 * (self.size + self.tombstones + new) > len(self.table_keys):
            capacity = len(self.table_keys)
            while 2 * (self.size + new) > capacity // 2:
                capacity *= 2
            self.table_keys, self.table_blocks = _rebuild(self.table_keys, self.table_blocks, capacity)
            self.tombstones = 0
        fresh = self.handed_out + max(0, new - self.free_top)
        while fresh > len(self.chunks) * self.rows_per_chunk:
            self.chunks.append(np.zeros((self.rows_per_chunk, self.words), dtype=np.int64))

    def store(
        self, keys: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor
    ) -> None:
        new = int((blocks < 0).sum())
        self._reserve(new)
        self.free_top, self.handed_out, reused = _store(
            self.table_keys,
            self.table_blocks,
            self.chunks,
            self.rows_per_chunk,
            keys.numpy(),
            blocks.numpy(),
            _words(rows),
            positions.numpy(),
            self.free,
            self.free_top,
            self.handed_out,
        )
        self.size += new
        self.tombstones -= reused

    def remove(self, keys: torch.Tensor) -> int:
        if self.free_top + len(keys) > len(self.free):
            grown = np.empty(max(2 * len(self.free), self.free_top + len(keys)), dtype=np.int64)
            grown[: self.free_top] = self.free[: self.free_top]
            self.free = grown
        removed, self.free_top = _remove(
            self.table_keys,
            self.table_blocks,
            self.chunks,
            self.rows_per_chunk,
            keys.numpy(),
            self.free,
            self.free_top,
        )
        self.size -= removed
        self.tombstones += removed
        return removed

    def memory_bytes(self) -> int:
        arrays = (self.table_keys, self.table_blocks, self.free, *self.chunks)
        return sum(a.nbytes for a in arrays)


class KVStore(ReferenceKVStore):
    """The KV store with Numba kernels; see ``leanstate.reference.kv_store.KVStore``.

    Example::

        >>> store = KVStore(16, optimizer_state_dim=1)
        >>> store.set(torch.tensor([4]), torch.ones(1, 16))
        >>> store.backend
        'numba'
    """

    backend = "numba"

    def _new_shard(self) -> _NumbaShard:
        return _NumbaShard(self.layout, ROWS_PER_CHUNK)

    def _shard_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(_shards_of(ids.numpy(), self.num_shards))

    def _initial_weights(self, ids: torch.Tensor) -> torch.Tensor:
        low, high = self.init_range
        weights = _initial_weights(ids.numpy(), self.dim, _U64(self.seed & (2**64 - 1)), low, high)
        return torch.from_numpy(weights).to(self.dtype)
