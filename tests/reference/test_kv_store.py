"""The reference engine's own structure: shards by the hash, chunked pools, free lists."""

import torch

from leanstate.kv_store import KVStore
from leanstate.reference.hashing import shards_of
from leanstate.reference.kv_store import ROWS_PER_CHUNK


def make(**kwargs):
    return KVStore(6, optimizer_state_dim=1, backend="reference", **kwargs)


def test_shard_placement_follows_the_hash():
    store = make(num_shards=4)
    ids = torch.arange(40)
    store.set(ids, torch.zeros(40, 6))
    for s, shard in enumerate(store.engine._shards):
        assert sorted(shard.index) == ids[shards_of(ids, 4) == s].tolist()


def test_freed_blocks_are_reused_last_in_first_out():
    store = make(num_shards=1)
    store.set(torch.arange(10), torch.ones(10, 6))
    store.delete(torch.tensor([3, 4]))
    shard = store.engine._shards[0]
    assert shard.free == [3, 4]
    store.set(torch.tensor([20]), torch.ones(1, 6))
    assert shard.index[20] == 4 and shard.free == [3] and shard.handed_out == 10


def test_each_shard_grows_by_whole_chunks():
    store = make(num_shards=1)
    store.set(torch.arange(ROWS_PER_CHUNK + 1), torch.ones(ROWS_PER_CHUNK + 1, 6))
    assert len(store.engine._shards[0].chunks) == 2
