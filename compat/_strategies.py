"""Hypothesis strategies for leanstate's inputs, weighted to where stores and bags break:
the int64 edges, ids that collide in the project's hashes, duplicate-heavy batches with
padding, dims past 64 and 128 and odd, every row dtype, saturating counts, eviction
thresholds on their exact boundaries and ``out=`` buffers. ``leanstate.testing`` exports
them; every differential test draws from them.

Most draws stay small (a small dim, a short batch), so a test keeps its speed; the edges
come often enough that a few dozen examples meet each of them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch
from hypothesis import strategies as st

from leanstate.reference.hashing import SPLITMIX_GOLDEN, SPLITMIX_MIX1, SPLITMIX_MIX2, shards_of
from leanstate.reference.row_format import COUNT_MAX, TIMESTAMP_MAX, RowLayout

ID_MAX = 2**63 - 1
# Where an id changes width or sign in some representation: a byte, int32, uint32, a
# double's exact integers, and the top of int64 (the largest ids once passed every
# differential test while a mirror lost one of them).
ID_EDGES = (0, 1, 2, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**62, ID_MAX - 1, ID_MAX)
PADDING_IDS = (-1, -2, -(2**31), -(2**63))
DIM_EDGES = (1, 2, 3, 4, 5, 7, 8, 31, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 299, 300)
COUNT_EDGES = (0, 1, 2, COUNT_MAX - 2, COUNT_MAX - 1, COUNT_MAX)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TABLE_SLOTS = 1024  # the accelerated engines' tables start at 16 or 1024 slots


def ids(*, padding: bool = False) -> st.SearchStrategy[int]:
    """One int64 id: a third from a small pool (0-40, so batches hit, miss and repeat), a
    third from :data:`ID_EDGES`, a third anywhere in ``[0, 2**63 - 1]``. With ``padding``,
    a quarter each, the fourth negative (padding in reads, writes and bags; refused by
    ``set_rows``): mostly -1, or :data:`PADDING_IDS`, or another small negative."""
    parts = [st.integers(0, 40), st.sampled_from(ID_EDGES), st.integers(0, ID_MAX)]
    if padding:
        parts.append(st.just(-1) | st.sampled_from(PADDING_IDS) | st.integers(-40, -1))
    return st.one_of(parts)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """``reference.hashing.splitmix64`` over a uint64 array (numpy wraps modulo 2**64)."""
    z = x + np.uint64(SPLITMIX_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(SPLITMIX_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(SPLITMIX_MIX2)
    return z ^ (z >> np.uint64(31))


_Groups = tuple[tuple[int, ...], ...]


@functools.cache
def _collision_groups(num_shards: int, table_slots: int) -> tuple[_Groups, _Groups]:
    """Groups of ids sharing a shard and a home slot: (the groups, those homed on the last slot).

    The candidates are five runs of ids, one in each region of the id space, long enough
    that a (shard, slot) pair holds several on average (each run at most 2**18 ids).
    """
    per_start = min(2**18, max(2**12, 8 * num_shards * table_slots // 4))
    starts = (0, 2**31 - per_start // 2, 2**32 - per_start // 2, 2**62, 2**63 - per_start)
    run = np.arange(per_start, dtype=np.int64)
    candidates = np.concatenate([np.int64(s) + run for s in starts])  # disjoint runs
    shard = shards_of(torch.from_numpy(candidates), num_shards).numpy()
    home = (_splitmix64(candidates.view(np.uint64)) & np.uint64(table_slots - 1)).astype(np.int64)
    bucket = shard * table_slots + home
    order = np.argsort(bucket, kind="stable")
    same = bucket[order][1:] == bucket[order][:-1]
    shared = np.zeros(len(order), dtype=bool)
    shared[1:] |= same
    shared[:-1] |= same
    order = order[shared]  # only the ids whose bucket holds another, before splitting
    groups = np.split(order, np.flatnonzero(np.diff(bucket[order])) + 1) if len(order) else []
    everything = tuple(tuple(int(i) for i in candidates[g]) for g in groups)
    wrapping = tuple(tuple(int(i) for i in candidates[g]) for g in groups if home[g[0]] == table_slots - 1)
    return everything, wrapping


def colliding_ids(
    num_shards: int = 8, *, table_slots: int = TABLE_SLOTS, max_size: int = 8
) -> st.SearchStrategy[list[int]]:
    """Lists of 2 to ``max_size`` distinct ids that collide in both of the project's hashes:
    one shard under ``reference.hashing.shard_of(id, num_shards)``, and one home slot of
    an open-addressing table of ``table_slots`` slots (a power of two), ``splitmix64(id)
    mod table_slots``, where the accelerated engines start their linear probes (so they
    collide in every smaller table too). Half the groups sit on the table's last slot, so
    their probe runs wrap to slot 0. Ids come from near 0, 2**31, 2**32, 2**62 and 2**63."""
    if not 1 <= num_shards <= 65536 or table_slots < 1 or table_slots & (table_slots - 1) or max_size < 2:
        raise ValueError(
            "colliding_ids: num_shards in [1, 65536], table_slots a power of two, max_size >= 2; "
            f"got {num_shards}, {table_slots}, {max_size}"
        )
    _collision_groups(num_shards, table_slots)  # the search runs once, here, not in a draw
    picks = st.lists(st.integers(0, max(15, max_size)), min_size=2, max_size=max_size, unique=True)
    return _picked(num_shards, table_slots, picks)


# The composites below take strategies built once, by the function that returns them:
# a strategy built inside a draw (flatmap's way) is validated afresh every time.
_INDEX = st.integers(0, 2**32 - 1)


@st.composite
def _picked(draw: st.DrawFn, num_shards: int, table_slots: int, picks: st.SearchStrategy) -> list[int]:
    everything, wrapping = _collision_groups(num_shards, table_slots)
    groups = wrapping if draw(st.booleans()) and wrapping else everything
    group = groups[draw(_INDEX) % len(groups)]
    chosen = list(dict.fromkeys(group[i % len(group)] for i in draw(picks)))
    return chosen if len(chosen) >= 2 else list(group[:2])


@st.composite
def _from_pool(draw: st.DrawFn, pools: st.SearchStrategy, picks: st.SearchStrategy) -> list[int]:
    """Picks from a drawn pool; a pick past the pool takes the next of the extra ids."""
    pool, extra = draw(pools)
    extra = extra or pool
    return [pool[i % len(pool)] if i < 8 else extra[i % len(extra)] for i in draw(picks)]


def id_batches(
    *, min_size: int = 0, max_size: int = 16, padding: bool = False, num_shards: int = 8
) -> st.SearchStrategy[list[int]]:
    """Lists of ids, between ``min_size`` and ``max_size`` long: a third spread (each as
    ``ids(padding=padding)`` draws it), a third duplicate-heavy (picked from a pool of one
    to three such ids), a third mostly picked from a group of :func:`colliding_ids` for
    ``num_shards``, among a few spread ids."""
    one = ids(padding=padding)
    spread = st.lists(one, min_size=min_size, max_size=max_size)
    pools = st.tuples(st.lists(one, min_size=1, max_size=3), st.just(()))
    groups = st.tuples(colliding_ids(num_shards), st.lists(one, max_size=3))  # and extra ids
    repeats = _from_pool(pools, st.lists(st.integers(0, 7), min_size=min_size, max_size=max_size))
    colliding = _from_pool(groups, st.lists(st.integers(0, 9), min_size=min_size, max_size=max_size))
    return st.one_of(spread, repeats, colliding)


@st.composite
def _dims(draw: st.DrawFn, small: st.SearchStrategy[int], wide: st.SearchStrategy[int]) -> int:
    return draw(small if draw(_QUARTERS) < 3 else wide)


_QUARTERS = st.integers(0, 3)  # shrinks to 0: the small side


def dims(max_dim: int = 300) -> st.SearchStrategy[int]:
    """An embedding dim in ``[1, max_dim]``: three in four at most 8; the rest from
    :data:`DIM_EDGES` (odd, and either side of 4's multiples, 64, 128 and 256) or anywhere
    up to ``max_dim``. Wide dims cost time; pass a smaller ``max_dim`` where they do."""
    if max_dim < 1:
        raise ValueError(f"dims: max_dim must be >= 1; got {max_dim}")
    wide = st.sampled_from([d for d in DIM_EDGES if d <= max_dim]) | st.integers(1, max_dim)
    return _dims(st.integers(1, min(8, max_dim)), wide)


def dtypes() -> st.SearchStrategy[torch.dtype]:
    """A row dtype: float32, float16 or bfloat16."""
    return st.sampled_from(DTYPES)


def state_dims(max_state: int = 2) -> st.SearchStrategy[int]:
    """An ``optimizer_state_dim`` in ``[0, max_state]`` (0: no state columns at all)."""
    return st.integers(0, max_state)


def layouts(max_dim: int = 300, max_state: int = 2) -> st.SearchStrategy[RowLayout]:
    """A ``RowLayout`` of :func:`dims`, :func:`state_dims` and :func:`dtypes`."""
    return st.builds(RowLayout, dims(max_dim), state_dims(max_state), dtypes())


def counts() -> st.SearchStrategy[int]:
    """A header count in ``[0, 2**31 - 1]``: small (0-3), at or just below saturation
    (:data:`COUNT_EDGES`), or anywhere; a few writes to a saturating one must not wrap."""
    return st.one_of(st.integers(0, 3), st.sampled_from(COUNT_EDGES), st.integers(0, COUNT_MAX))


def _float32_beside(value: float) -> list[float]:
    """``value`` and its float32 neighbours (non-negative ones)."""
    x = np.float32(value)
    near = (np.nextafter(x, np.float32(0)), x, np.nextafter(x, np.float32(np.inf)))
    return [float(v) for v in near if v >= 0]


def evictions(
    *, counts: Sequence[int] = (), ages: Sequence[int] = (), norms: Sequence[float] = (), rows: int = 0
) -> st.SearchStrategy[dict]:
    """Keyword arguments for ``KVStore.evict``, each criterion ``None`` or on a boundary of
    the rows present (their header ``counts``, their ``ages`` in seconds, the float32 L2
    ``norms`` of their weights, how many ``rows``): ``min_count`` a count or one more,
    ``max_age_s`` an age or one less, ``min_l2_norm`` a norm or its float32 neighbours,
    ``max_rows`` the row count or one either side; or at the ends of each range (0, 1,
    ``2**31 - 1``, ``2**32``, infinity, and integers past int64, which mean those ends)."""
    min_count = sorted({0, 1, COUNT_MAX, COUNT_MAX + 1, 2**64} | {c + d for c in counts for d in (0, 1)})
    max_age = sorted(
        {0, TIMESTAMP_MAX, TIMESTAMP_MAX + 1, 2**64} | {a - d for a in ages for d in (0, 1) if a - d >= 0}
    )
    min_norm = sorted({0.0, 2.0**-149, math.inf} | {v for n in norms for v in _float32_beside(n)})
    max_rows = sorted({0, 1, 2**64} | {rows + d for d in (-1, 0, 1) if rows + d >= 0})
    return st.fixed_dictionaries(
        {
            "min_count": st.none() | st.sampled_from(min_count),
            "max_age_s": st.none() | st.sampled_from(max_age),
            "min_l2_norm": st.none() | st.sampled_from(min_norm),
            "max_rows": st.none() | st.sampled_from(max_rows),
        }
    )


@st.composite
def _out_buffers(draw: st.DrawFn, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    fill = draw(st.sampled_from([math.nan, -9.0, torch.finfo(dtype).max, 0.0]))
    aligned = max(1, 8 // torch.tensor([], dtype=dtype).element_size())  # 8-byte steps
    before, after = draw(st.integers(0, 2)) * aligned, draw(st.integers(0, 2))
    size = math.prod(shape)
    buffer = torch.full((before + size + after,), fill, dtype=dtype)
    return buffer[before : before + size].view(shape)


def out_buffers(shape: Sequence[int], dtype: torch.dtype) -> st.SearchStrategy[torch.Tensor]:
    """Tensors to pass as ``out=`` for a result of ``shape`` and ``dtype``: contiguous, full
    of a value a missed write leaves visible (NaN, -9, the largest finite, or 0), some a
    view at an 8-byte aligned storage offset inside a larger buffer."""
    return _out_buffers(tuple(shape), dtype)
