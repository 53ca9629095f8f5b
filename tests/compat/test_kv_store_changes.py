"""Change tracking through the front class, on every registered backend: the mark, epochs,
tracking on and off, copies, checkpoint loads and training steps (``spec/kv_store.md``,
"Change tracking"). The state machine of ``test_kv_store_differential`` holds the engines
to the reference on random programs; these pin the front's own rules."""

import copy

import pytest
import torch

from leanstate import _backends
from leanstate.checkpoint import load_checkpoint, save_checkpoint
from leanstate.embedding import KVEmbeddingBag
from leanstate.kv_store import KVStore
from leanstate.reference.kv_store import ChangeMark, SupportsRows
from tests.harness import FakeClock

BACKENDS = sorted(_backends.available("kv_store"))
DIGEST = "ab" * 32


def ids(*values):
    return torch.tensor(values, dtype=torch.int64)


def listed(changes):
    return tuple(t.tolist() for t in changes)


@pytest.fixture(params=BACKENDS)
def make(request):
    def build(**kwargs):
        return KVStore(4, optimizer_state_dim=1, backend=request.param, clock=FakeClock(), **kwargs)

    return build


def test_changes_default_to_the_mark(make):
    store = make()
    assert store.mark is None and store.tracking and isinstance(store, SupportsRows)
    store.set(ids(1, 2), torch.ones(2, 4))
    epoch = store.next_epoch()
    assert epoch == 1 and store.next_epoch() == 2  # an empty epoch is an epoch
    store.set(ids(3), torch.ones(1, 4))
    store.delete(ids(1, 50))
    assert listed(store.changes()) == ([2, 3], [1])  # no mark: since the store was made
    store.mark = ChangeMark(epoch, DIGEST)
    assert store.mark == (1, DIGEST) and store.mark.checkpoint == DIGEST
    assert listed(store.changes()) == listed(store.changes(since=epoch)) == ([3], [1])
    assert listed(store.changes(since=3)) == ([], [])
    for t in store.changes():
        assert t.dtype == torch.int64 and t.dim() == 1 and t.device.type == "cpu"


def test_setting_the_mark_forgets_the_removals_up_to_it(make):
    store = make()
    store.set(torch.arange(3000), torch.ones(3000, 4))
    store.delete(torch.arange(3000))
    with_removals = store.memory_bytes()
    store.mark = ChangeMark(store.next_epoch(), DIGEST)
    assert store.memory_bytes() < with_removals  # the removal records went
    assert listed(store.changes()) == ([], [])
    store.mark = None
    assert store.mark is None


def test_with_tracking_off_nothing_is_recorded_and_the_mark_goes(make):
    store = make()
    store.set(ids(1, 2), torch.ones(2, 4))
    store.mark = ChangeMark(store.next_epoch(), DIGEST)
    store.track_changes(True)  # no change of setting: the mark stays
    assert store.mark is not None
    store.track_changes(False)
    assert not store.tracking and store.mark is None and "tracking=False" in repr(store)
    store.set(ids(3, 1), torch.ones(2, 4))
    store.set_rows(store.get_rows(ids(2)))
    store.delete(ids(2))
    store.mark = ChangeMark(store.next_epoch(), DIGEST)  # a mark while off would promise a delta
    assert store.mark is None
    assert listed(store.changes(since=1)) == ([], [])
    store.track_changes()
    assert store.tracking and store.mark is None
    mark = store.next_epoch()
    store.set(ids(4), torch.ones(1, 4))
    assert listed(store.changes(since=mark)) == ([4], [])


def test_bad_arguments_are_refused(make):
    store = make()
    for since in (-1, 1.5, "1", True):
        with pytest.raises(ValueError, match="since"):
            store.changes(since=since)
    with pytest.raises(TypeError, match="mark"):
        store.mark = (1, DIGEST)
    with pytest.raises(TypeError, match="enabled"):
        store.track_changes("no")
    assert store.mark is None and store.tracking


@pytest.mark.parametrize("tracking", [True, False])
def test_a_copy_has_no_mark_and_tracks_as_the_original(make, tracking):
    store = make()
    store.track_changes(tracking)
    store.set(ids(5, 6), torch.ones(2, 4))
    store.mark = ChangeMark(store.next_epoch(), DIGEST)
    clone = copy.deepcopy(store)
    assert clone.mark is None and clone.tracking == tracking
    assert listed(clone.changes()) == (([5, 6] if tracking else []), [])


def test_a_load_writes_every_row_it_loads(make, tmp_path):
    source = make()
    source.set(torch.arange(0, 300, 3), torch.randn(100, 4))
    save_checkpoint(tmp_path / "c", {"t": source}, chunk_bytes=1024)
    empty = make()  # numba reads the rows in place and adopts them
    load_checkpoint(tmp_path / "c", {"t": empty}, chunk_bytes=1024)
    assert torch.equal(empty.changes(since=0)[0], source.keys())  # the load's writes, every row
    assert empty.mark is not None and [len(c) for c in empty.changes()] == [0, 0]  # marked after them
    full = make()  # not empty: upserted through set_rows
    full.set(ids(1, 3), torch.ones(2, 4))
    mark = full.next_epoch()
    load_checkpoint(tmp_path / "c", {"t": full}, chunk_bytes=1024)
    assert torch.equal(full.changes(since=mark)[0], source.keys())


EMBEDDING = sorted(_backends.available("embedding"))


@pytest.mark.parametrize("backend", EMBEDDING)
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("offloading", [True, False])
def test_a_training_step_writes_exactly_its_distinct_ids(backend, optimizer, offloading):
    bag = KVEmbeddingBag(
        None, 4, optimizer=optimizer, optimizer_offloading=offloading, return_whole_row=offloading,
        backend=backend, clock=FakeClock(),
    )  # fmt: skip
    stores = [s for s in (bag.store, bag.state_store) if s is not None]
    bag(ids(3, 5, 5, 9), ids(0, 2)).sum().backward()  # 3, 5 and 9 there before the marks
    marks = [store.next_epoch() for store in stores]
    pooled = bag(ids(5, 9, 12, 12, -1, 40, 5), ids(0, 3, 5))
    for store, mark in zip(stores, marks):
        assert listed(store.changes(since=mark)) == ([], [])  # a forward reads only
    pooled.sum().backward()
    for store, mark in zip(stores, marks):
        assert listed(store.changes(since=mark)) == ([5, 9, 12, 40], []), store
        assert listed(store.changes()) == ([3, 5, 9, 12, 40], [])


def test_each_epochs_removals_stay_in_their_epoch_and_a_rewrite_is_a_write(make):
    """A fixed sequence (the random machine may never draw it): removals in epochs 2 and 3
    asked since 1, 2 and 3; an id deleted then written again. Kills: removal records merged
    across epochs (``changes(since=2)`` losing epoch 3's), a rewritten id reported removed
    too, a removal recorded in the wrong epoch."""
    store = make()
    store.set(ids(1, 2, 3, 4), torch.ones(4, 5))  # epoch 1
    assert store.next_epoch() == 1
    store.delete(ids(1, 4))  # epoch 2
    store.set(ids(5), torch.ones(1, 5))
    assert store.next_epoch() == 2
    store.delete(ids(2, 5))  # epoch 3: 2 and 5 removed, 1 written again, 6 new
    store.set(ids(1, 6), torch.ones(2, 5))
    assert store.next_epoch() == 3
    assert listed(store.changes(since=0)) == ([1, 3, 6], [2, 4, 5])
    assert listed(store.changes(since=1)) == ([1, 6], [2, 4, 5])
    assert listed(store.changes(since=2)) == ([1, 6], [2, 5])
    assert listed(store.changes(since=3)) == ([], [])
    store.mark = ChangeMark(2, DIGEST)  # forgets removals of epoch 2 and earlier, not epoch 3's
    assert listed(store.changes()) == ([1, 6], [2, 5])


def test_locating_with_insert_never_inserts_padding(make):
    """``locate(insert=True)`` (the row-access interface, as the embedding updates call it)
    skips negative ids: a negative block, nothing inserted, nothing recorded. Kills: the torch
    engine inserting every missing id, padding included."""
    store = make()
    blocks = store.engine.locate(ids(3, -1, 8, -(2**63)), insert=True)
    assert blocks.tolist()[1] < 0 and blocks.tolist()[3] < 0 and min(blocks.tolist()[::2]) >= 0
    assert store.keys().tolist() == [3, 8] and len(store) == 2
    assert listed(store.changes(since=0)) == ([3, 8], [])
