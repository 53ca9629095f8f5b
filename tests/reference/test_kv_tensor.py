import pytest
import torch

from leanstate.kv_store import KVStore
from leanstate.reference.kv_tensor import KVTensor
from leanstate.reference.row_format import header_words
from tests.harness import FakeClock


@pytest.fixture
def store():
    s = KVStore(6, optimizer_state_dim=1, num_shards=3, clock=FakeClock())
    s.set(torch.tensor([9, 2, 5, 7]), torch.arange(24.0).reshape(4, 6))
    return s


def test_default_ids_are_a_sorted_snapshot(store):
    view = KVTensor(store)
    store.set(torch.tensor([100]), torch.zeros(1, 6))
    assert view.ids.tolist() == [2, 5, 7, 9]
    assert view.shape == (4, 12) and view.dtype == torch.float32 and len(view) == 4 and view.size(1) == 12


def test_narrow_and_getitem_read_the_rows(store):
    view = KVTensor(store, width=6)
    assert torch.equal(view.narrow(0, 1, 2), store.get(torch.tensor([5, 7]), width=6))
    assert torch.equal(view[1:3], view.narrow(0, 1, 2))
    assert torch.equal(view[0], store.get(torch.tensor([2]), width=6)[0])
    assert torch.equal(view[-1], store.get(torch.tensor([9]), width=6)[0])
    with pytest.raises(ValueError, match="dim=0"):
        view.narrow(1, 0, 1)
    with pytest.raises(IndexError, match="outside"):
        view.narrow(0, 3, 2)
    with pytest.raises(TypeError, match="step 1"):
        view[::2]


def test_width_offset_addresses_the_optimizer_state(store):
    view = KVTensor(store, width_offset=8, width=1)
    view.set_range(0, torch.full((4, 1), 3.5))
    assert store.get(view.ids, width_offset=8, width=1).flatten().tolist() == [3.5] * 4
    assert store.get(view.ids, width=6)[0].tolist() == list(range(6, 12))  # weights untouched


def test_whole_row_views_include_headers_and_write_by_header_key(store):
    ids = torch.tensor([2, 9])
    whole = KVTensor(store, ids=ids, whole_rows=True)
    rows = whole.narrow(0, 0, 2)
    assert rows.shape == (2, store.layout.width)
    assert header_words(rows)[:, 0].tolist() == [2, 9]
    other = KVStore(6, optimizer_state_dim=1, num_shards=5)
    target = KVTensor(other, ids=torch.tensor([-1, -1]), whole_rows=True)  # ids ignored on write
    target.copy_(whole, chunk_rows=1)
    assert other.keys().tolist() == [2, 9]
    assert torch.equal(other.get_rows(ids), store.get_rows(ids))


def test_read_only_view_ignores_writes_and_counts_them(store):
    view = KVTensor(store, width_offset=8, width=1, read_only=True)
    before = store.get_rows(store.keys())
    view.set_range(1, torch.ones(2, 1))
    view.copy_(torch.ones(4, 1), chunk_rows=3)
    assert view.ignored_writes == 6
    assert torch.equal(store.get_rows(store.keys()), before)
    assert "read_only=True" in repr(view) and "ignored_writes=6" in repr(view)


def test_copy_from_a_tensor_in_chunks(store):
    view = KVTensor(store, width=6)
    src = torch.randn(4, 6)
    assert view.copy_(src, chunk_rows=3) is view
    assert torch.equal(view.narrow(0, 0, 4), src)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda v: v.set_range(3, torch.zeros(2, 12)), IndexError, "fit"),
        (lambda v: v.set_range(0, torch.zeros(2, 5)), ValueError, "width 12"),
        (lambda v: v.copy_(torch.zeros(3, 12)), ValueError, "shape"),
        (lambda v: v.copy_(torch.zeros(4, 12), chunk_rows=0), ValueError, "chunk_rows"),
    ],
)
def test_bad_writes_are_rejected_and_change_nothing(store, call, error, message):
    before = store.get_rows(store.keys())
    with pytest.raises(error, match=message):
        call(KVTensor(store))
    assert torch.equal(store.get_rows(store.keys()), before)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"width_offset": 13}, "width_offset"),
        ({"width": 20}, "width"),
        ({"ids": torch.tensor([1.0])}, "ids"),
    ],
)
def test_bad_views(store, kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        KVTensor(store, **kwargs)


def test_partial_whole_row_write_is_refused(store):
    view = KVTensor(store, whole_rows=True, width_offset=4)
    with pytest.raises(ValueError, match="full width"):
        view.set_range(0, torch.zeros(1, view.width))
