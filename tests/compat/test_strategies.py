"""The input strategies of ``leanstate.testing`` draw what they promise: the edges appear,
colliding ids collide under the reference's own hash definitions, dims past 128 appear
while most stay small, and every draw is an input the store accepts.

Draws are sampled with hypothesis's fixed seed (``derandomize``) or searched for with
``hypothesis.find``; nothing depends on the clock.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from leanstate import KVStore
from leanstate.reference.hashing import shard_of, splitmix64
from leanstate.reference.row_format import COUNT_MAX, RowLayout, header_words, pack_metadata
from leanstate.testing import (
    colliding_ids,
    counts,
    dims,
    dtypes,
    evictions,
    id_batches,
    ids,
    layouts,
    out_buffers,
    state_dims,
)

INT64_EDGES = (0, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1)
SEARCH = settings(database=None, max_examples=2000, derandomize=True)


def sample(strategy, n=300):
    """``n`` draws of ``strategy`` under hypothesis's fixed seed, each beside a draw of noise
    (as a test's other arguments are): hypothesis skips an example it has already run, so
    alone a strategy's few small values would be drawn once each, then never again."""
    drawn = []

    @settings(
        database=None,
        max_examples=n,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(strategy, st.integers(0, 2**63))
    def collect(value, noise):
        drawn.append(value)

    collect()
    return drawn


def home(key, slots=1024):
    return splitmix64(key) % slots


@pytest.mark.parametrize("edge", INT64_EDGES)
def test_ids_reach_every_int64_edge(edge):
    assert find(ids(), lambda i: i == edge, settings=SEARCH) == edge


def test_ids_are_non_negative_int64_unless_padding_is_asked_for():
    assert all(0 <= i <= 2**63 - 1 for i in sample(ids()))
    padded = sample(ids(padding=True))
    assert all(-(2**63) <= i <= 2**63 - 1 for i in padded)
    assert -1 in padded and sum(i < 0 for i in padded) >= len(padded) // 8, "padding is rare"
    assert find(ids(padding=True), lambda i: i == -(2**63), settings=SEARCH) == -(2**63)


@pytest.mark.parametrize("num_shards", [1, 5, 8, 65536])
def test_colliding_ids_share_a_shard_and_a_home_slot(num_shards):
    for group in sample(colliding_ids(num_shards), n=60):
        assert len(group) >= 2 and len(set(group)) == len(group), group
        assert len({shard_of(key, num_shards) for key in group}) == 1, group
        assert len({home(key) for key in group}) == 1, group
        assert len({home(key, 16) for key in group}) == 1, "they collide in smaller tables too"


def test_colliding_ids_reach_the_tables_last_slot_and_the_large_ids():
    wrap = find(colliding_ids(), lambda g: home(g[0]) == 1023, settings=SEARCH)
    assert home(wrap[1]) == 1023
    assert find(colliding_ids(), lambda g: min(g) >= 2**62, settings=SEARCH)


def test_colliding_ids_on_a_smaller_table():
    for group in sample(colliding_ids(3, table_slots=64), n=40):
        assert len({(shard_of(key, 3), home(key, 64)) for key in group}) == 1, group


@pytest.mark.parametrize(
    "arguments",
    [{"num_shards": 0}, {"num_shards": 65537}, {"table_slots": 1000}, {"table_slots": 0}, {"max_size": 1}],
)
def test_colliding_ids_refuse_bad_arguments(arguments):
    with pytest.raises(ValueError, match="colliding_ids"):
        colliding_ids(**arguments)


def test_id_batches_repeat_ids_collide_and_keep_their_size():
    batches = sample(id_batches(min_size=1, max_size=12))
    assert all(1 <= len(b) <= 12 and min(b) >= 0 for b in batches)
    assert sum(len(set(b)) <= len(b) // 2 for b in batches) >= len(batches) // 5, (
        "few duplicate-heavy batches"
    )

    def collides(batch):
        distinct = sorted(set(batch))
        return any(
            (shard_of(a, 8), home(a)) == (shard_of(b, 8), home(b))
            for a in distinct
            for b in distinct
            if a < b
        )

    assert sum(map(collides, batches)) >= len(batches) // 8, "few batches with colliding ids"


def test_id_batches_pad_when_asked_and_reach_the_edges():
    padded = sample(id_batches(padding=True))
    assert any(-1 in b for b in padded) and any(min(b, default=0) < -1 for b in padded)
    assert find(id_batches(max_size=4), lambda b: 2**63 - 1 in b and len(set(b)) >= 2, settings=SEARCH)


def test_dims_reach_past_64_and_128_odd_while_most_stay_small():
    drawn = sample(dims(), n=400)
    assert all(1 <= d <= 300 for d in drawn)
    assert 0.5 <= sum(d <= 8 for d in drawn) / len(drawn) <= 0.95, "most draws small, not all"
    for edge in (1, 65, 129, 257, 300):
        assert edge in drawn, edge
    assert any(d > 128 and d % 2 for d in drawn if d not in (129, 257))
    assert max(sample(dims(12), n=100)) <= 12
    with pytest.raises(ValueError, match="max_dim"):
        dims(0)


def test_dtypes_state_dims_and_layouts_cover_their_ranges():
    assert set(sample(dtypes(), n=50)) == {torch.float32, torch.float16, torch.bfloat16}
    assert set(sample(state_dims(), n=50)) == {0, 1, 2}
    drawn = sample(layouts(), n=200)
    assert all(isinstance(layout, RowLayout) for layout in drawn)
    assert {(layout.dtype, layout.state_dim) for layout in drawn} >= {(torch.bfloat16, 0), (torch.float16, 2)}
    assert any(layout.dim > 128 for layout in drawn)


def test_counts_reach_saturation():
    drawn = sample(counts())
    assert all(0 <= c <= COUNT_MAX for c in drawn)
    assert {0, 1, COUNT_MAX - 1, COUNT_MAX} <= set(drawn)


def test_evictions_sit_on_the_boundaries_of_the_rows_given():
    norm = float(np.float32(0.3))
    drawn = sample(evictions(counts=[5], ages=[7], norms=[norm], rows=4), n=400)
    seen = {key: {policy[key] for policy in drawn} for key in drawn[0]}
    assert {None, 5, 6, COUNT_MAX + 1} <= seen["min_count"]
    assert {None, 6, 7, 2**32} <= seen["max_age_s"]
    below, above = (float(np.nextafter(np.float32(norm), np.float32(x))) for x in (0, math.inf))
    assert {None, below, norm, above, math.inf} <= seen["min_l2_norm"]
    assert {None, 3, 4, 5, 0} <= seen["max_rows"]


def test_evictions_are_arguments_evict_takes_and_a_count_boundary_splits_the_rows():
    """Every policy drawn from a store's own rows is one evict takes; min_count at a row's
    count keeps it, one more evicts it."""
    counted = {1: 4, 2: 9, 3: COUNT_MAX}
    for policy in sample(evictions(counts=list(counted.values()), ages=[0], rows=3), n=150):
        store = KVStore(3, backend="reference", clock=lambda: 100)
        rows = torch.zeros(3, store.layout.width)
        header_words(rows)[:, 0] = torch.tensor(list(counted))
        header_words(rows)[:, 1] = pack_metadata(
            torch.full((3,), 100), torch.tensor(list(counted.values())), torch.ones(3, dtype=torch.bool)
        )
        store.set_rows(rows)
        evicted = store.evict(**policy).tolist()
        others = [policy[k] for k in ("max_age_s", "min_l2_norm", "max_rows")]
        if policy["min_count"] is not None and others == [None, None, None]:
            assert evicted == [k for k, c in counted.items() if c < policy["min_count"]], policy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_out_buffers_are_what_get_accepts_some_offset_and_full_of_garbage(dtype):
    drawn = sample(out_buffers((3, 4), dtype), n=60)
    store = KVStore(2, dtype=dtype, backend="reference")
    for out in drawn:
        assert out.shape == (3, 4) and out.dtype == dtype and out.is_contiguous()
        assert out.storage_offset() * out.element_size() % 8 == 0
        assert store.get(torch.tensor([5, -1, 7]), out=out) is out
    assert any(out.storage_offset() > 0 for out in drawn), "no buffer inside a larger one"
    assert any(bool(torch.isnan(out).all()) for out in sample(out_buffers((2, 2), dtype), n=60))
    assert sample(out_buffers((0, 5), dtype), n=5)[0].shape == (0, 5)
