"""Bucket ownership: every non-negative id has exactly one owner at every world size."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from leanstate import bucket_owner
from leanstate.reference.sharding import bucket_of, bucket_range

int64_ids = st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=50)


@given(
    ids=int64_ids,
    world=st.integers(1, 8),
    buckets=st.integers(8, 2048),
    size=st.none() | st.integers(1, 2**40),
)
def test_every_id_has_exactly_one_owner_whose_buckets_hold_it(ids, world, buckets, size):
    ids = torch.tensor(ids, dtype=torch.int64)
    owners = bucket_owner(ids, world_size=world, total_num_buckets=buckets, bucket_size=size)
    of = bucket_of(ids, total_num_buckets=buckets, bucket_size=size)
    assert torch.equal(owners < 0, ids < 0) and torch.equal(of < 0, ids < 0)
    for rank in range(world):
        first, end = bucket_range(rank, world, buckets)
        mine = (of >= first) & (of < end)
        assert torch.equal(mine, owners == rank)  # the owner is the rank whose range holds the bucket


@given(world=st.integers(1, 64), buckets=st.integers(64, 5000))
def test_bucket_ranges_partition_the_buckets_contiguously_and_evenly(world, buckets):
    ranges = [bucket_range(r, world, buckets) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == buckets
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [end - first for first, end in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_chunk_mode_keeps_ids_past_the_end_in_the_last_bucket_and_balances_sequential_ids():
    ids = torch.arange(0, 1000)
    owners = bucket_owner(ids, world_size=4, total_num_buckets=100, bucket_size=10)
    assert torch.bincount(owners).tolist() == [250, 250, 250, 250]
    assert bucket_of(torch.tensor([10**12]), total_num_buckets=100, bucket_size=10).item() == 99
    interleaved = bucket_owner(torch.tensor([0, 1023, 1024, 2**63 - 1]), world_size=2, total_num_buckets=1024)
    assert interleaved.tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=0, total_num_buckets=8), "world_size"),
        (dict(world_size=9, total_num_buckets=8), "world_size"),
        (dict(world_size=2, total_num_buckets=0), "total_num_buckets"),
        (dict(world_size=2, total_num_buckets=8, bucket_size=0), "bucket_size"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bucket_owner(torch.tensor([1]), **kwargs)
