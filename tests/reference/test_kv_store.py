"""The reference engine's own structure: shards by the hash, chunked pools, free lists."""

import torch

from leanstate.kv_store import KVStore
from leanstate.reference.hashing import shards_of
from leanstate.reference.kv_store import ROWS_PER_CHUNK
from tests.harness import FakeClock


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


# -- change tracking: the textbook's semantics (spec/kv_store.md, "Change tracking") --------


def changes(store, since):
    written, removed = store.engine.changes_since(since)
    return written.tolist(), removed.tolist()


def test_epochs_count_from_one_and_each_change_belongs_to_the_epoch_it_was_made_in():
    store = make()
    store.set(torch.tensor([5, 1]), torch.zeros(2, 6))
    assert store.engine.new_epoch() == 1
    store.set(torch.tensor([9]), torch.zeros(1, 6))
    store.delete(torch.tensor([1, 77]))  # 77 was never there: no removal
    assert store.engine.new_epoch() == 2
    assert changes(store, 0) == ([5, 9], [1])
    assert changes(store, 1) == ([9], [1])
    assert changes(store, 2) == ([], [])


def test_the_last_of_a_write_and_a_removal_decides():
    store = make()
    store.set(torch.tensor([1, 2]), torch.zeros(2, 6))
    mark = store.engine.new_epoch()
    store.delete(torch.tensor([1]))  # written before the mark, removed after: removed
    store.set(torch.tensor([3]), torch.zeros(1, 6))
    store.delete(torch.tensor([3]))  # written and removed after the mark: removed
    store.delete(torch.tensor([2]))
    store.set(torch.tensor([2]), torch.zeros(1, 6))  # removed, then written again: written
    assert changes(store, mark) == ([2], [1, 3])
    assert changes(store, 0) == ([2], [1, 3])


def test_a_freed_block_reused_by_another_id_writes_the_new_id_and_removes_the_old():
    store = make(num_shards=1)
    store.set(torch.tensor([10, 11]), torch.zeros(2, 6))
    mark = store.engine.new_epoch()
    store.delete(torch.tensor([10]))
    store.set(torch.tensor([20]), torch.zeros(1, 6))
    assert store.engine._shards[0].index[20] == 0  # 10's block
    assert changes(store, mark) == ([20], [10])


def test_set_rows_locate_to_write_and_eviction_are_changes_and_reads_are_not():
    clock = FakeClock(100)
    store = make(clock=clock)
    store.set(torch.tensor([1, 2, 3]), torch.ones(3, 6))
    mark = store.engine.new_epoch()
    store.get(torch.tensor([1, 50]))
    store.get_rows(torch.tensor([2]))
    store.metadata(torch.tensor([3]))
    store.contains(torch.tensor([4]))
    engine = store.engine
    with engine.reading():
        engine.locate(torch.tensor([1, 60]))  # a lookup only
    assert changes(store, mark) == ([], [])
    store.set_rows(store.get_rows(torch.tensor([2])))
    with engine.writing():  # the embedding updates write every row they locate so
        engine.locate(torch.tensor([3, 70, -1]), insert=True)
    assert changes(store, mark) == ([2, 3, 70], [])
    clock.now += 50
    store.set(torch.tensor([5]), torch.ones(1, 6))
    assert store.evict(max_age_s=10).tolist() == [1, 2, 3, 70]
    assert changes(store, mark) == ([5], [1, 2, 3, 70])
    assert changes(store, store.engine.new_epoch()) == ([], [])


def test_forget_drops_the_removals_up_to_its_mark():
    store = make(num_shards=2)
    store.set(torch.arange(10), torch.zeros(10, 6))
    store.delete(torch.arange(4))
    first = store.engine.new_epoch()
    store.delete(torch.arange(4, 6))
    second = store.engine.new_epoch()
    store.engine.forget(first)
    assert changes(store, first) == ([], [4, 5])  # what may still be asked is intact
    assert sorted(k for s in store.engine._shards for k in s.removed) == [4, 5]
    store.engine.forget(second)
    assert all(not s.removed for s in store.engine._shards)


def test_with_tracking_off_nothing_is_recorded():
    store = make()
    store.set(torch.tensor([1, 2]), torch.zeros(2, 6))
    store.engine.tracking = False
    mark = store.engine.new_epoch()
    store.set(torch.tensor([3]), torch.zeros(1, 6))
    store.delete(torch.tensor([1]))
    assert changes(store, mark) == ([], [])
    assert sorted(k for s in store.engine._shards for k in s.written) == [1, 2]  # from before
    assert all(not s.removed for s in store.engine._shards)


def test_changes_are_ascending_int64_on_the_cpu():
    store = make(num_shards=3)
    ids = torch.tensor([2**62, 7, 0, 2**40, 3])
    store.set(ids, torch.zeros(5, 6))
    written, removed = store.engine.changes_since(0)
    assert written.dtype == removed.dtype == torch.int64 and written.device.type == "cpu"
    assert written.tolist() == sorted(ids.tolist()) and removed.tolist() == []
