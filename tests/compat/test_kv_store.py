"""The store's public behaviour, on every registered backend (the front class over each engine)."""

import threading

import pytest
import torch

from leanstate import _backends
from leanstate.kv_store import KVStore
from leanstate.reference.hashing import initial_weights
from leanstate.reference.row_format import COUNT_MAX, header_words, unpack_metadata
from tests.harness import FakeClock

BACKENDS = sorted(_backends.available("kv_store"))


@pytest.fixture(params=BACKENDS, autouse=True)
def backend(request):
    return request.param


@pytest.fixture
def make(backend):
    def build(dim=6, state=1, **kwargs):
        kwargs.setdefault("clock", FakeClock())
        return KVStore(dim, optimizer_state_dim=state, backend=backend, **kwargs)

    return build


def state_of(store):
    """Everything observable, for 'left unchanged' checks."""
    keys = store.keys()
    return keys, store.get_rows(keys), len(store)


def assert_same_state(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


def test_missing_ids_read_initial_rows_without_insert(make):
    store = make(dim=5, state=2, seed=9, init_range=(-1.0, 1.0))
    ids = torch.tensor([4, 100, 2**40])
    got = store.get(ids)
    expected = initial_weights(ids, 5, seed=9, low=-1.0, high=1.0, dtype=torch.float32)
    assert torch.equal(got[:, :5], expected)
    assert torch.count_nonzero(got[:, 5:]) == 0  # weight padding and optimizer state
    assert len(store) == 0 and not store.contains(ids).any()


def test_initial_rows_do_not_depend_on_shards_or_order(make):
    ids = torch.tensor([3, 1, 2, 99, 7])
    a = make(num_shards=1).get(ids)
    b = make(num_shards=5).get(ids.flip(0)).flip(0)
    assert torch.equal(a, b)


def test_negative_ids_are_padding(make):
    store = make()
    store.set(torch.tensor([-1, 2, -7]), torch.ones(3, 6))
    assert store.keys().tolist() == [2]
    got = store.get(torch.tensor([-1, 2]))
    assert torch.count_nonzero(got[0]) == 0 and torch.equal(got[1, :6], torch.ones(6))
    assert torch.count_nonzero(store.get_rows(torch.tensor([-3]))) == 0


def test_set_stamps_timestamp_and_counts_every_occurrence(make):
    clock = FakeClock(100)
    store = make(clock=clock)
    store.set(torch.tensor([5, 5, 6]), torch.arange(18.0).reshape(3, 6))
    clock.now = 250
    store.set(torch.tensor([5]), torch.zeros(1, 6))
    t, c, used = unpack_metadata(store.metadata(torch.tensor([5, 6, 8])))
    assert t.tolist() == [250, 100, 0] and c.tolist() == [3, 1, 0] and used.tolist() == [True, True, False]


def test_duplicate_ids_last_occurrence_wins(make):
    store = make()
    store.set(torch.tensor([1, 2, 1]), torch.tensor([[1.0] * 6, [2.0] * 6, [3.0] * 6]))
    assert store.get(torch.tensor([1]), width=6).tolist() == [[3.0] * 6]


def test_partial_columns_keep_the_rest_of_the_row(make):
    store = make(dim=6, state=1, seed=4)
    ids = torch.tensor([11])
    initial = store.get(ids)
    store.set(ids, torch.full((1, 1), 7.0), width_offset=8)  # the optimizer state column
    after = store.get(ids)
    assert after[0, 8] == 7.0 and torch.equal(after[0, :8], initial[0, :8])
    store.set(ids, torch.full((1, 2), 5.0), width_offset=1)
    assert store.get(ids, width_offset=1, width=2).tolist() == [[5.0, 5.0]]
    assert store.get(ids)[0, 8] == 7.0


def test_get_rows_and_set_rows_round_trip_keeping_metadata(make):
    clock = FakeClock(123)
    src = make(clock=clock)
    ids = torch.tensor([8, 3, 1000])
    src.set(ids, torch.randn(3, 6))
    src.set(ids[:1], torch.randn(1, 6))
    rows = src.get_rows(ids)
    assert header_words(rows)[:, 0].tolist() == ids.tolist()
    dst = make(clock=FakeClock(999), num_shards=3)
    meta = header_words(rows)[:, 1].clone()
    header_words(rows)[:, 1] &= ~torch.tensor(-(2**63))  # clear 'used': set_rows sets it
    dst.set_rows(rows)
    assert torch.equal(dst.metadata(ids), meta)
    assert torch.equal(dst.get_rows(ids), src.get_rows(ids))


@pytest.mark.parametrize("keys", [[1, 2, 2, 3], [4, 4, 9], [5, 8, 8], [7, 7, 7], [1, 3, 3, 3, 6, 6]])
def test_set_rows_of_ascending_keys_with_repeats_keeps_one_row_per_key_the_last(make, keys):
    """Rows sorted by key but with a key repeated (each occurrence with its own weights): a
    shortcut for sorted, distinct rows (as a checkpoint's are) must not take them; the
    store holds each key once, with its last row, as the reference does."""
    source = make()
    rows = source.get_rows(torch.tensor(keys))
    header_words(rows)[:, 0] = torch.tensor(keys)
    rows[:, source.layout.header_elems] = torch.arange(len(keys), dtype=rows.dtype)  # which occurrence
    store = make()
    store.set_rows(rows)
    distinct = sorted(set(keys))
    assert len(store) == len(distinct) and store.keys().tolist() == distinct
    last = {key: i for i, key in enumerate(keys)}
    got = store.get_rows(torch.tensor(distinct))[:, source.layout.header_elems]
    assert got.tolist() == [float(last[key]) for key in distinct]


def test_golden_row_bytes(make, vectors):
    v = vectors("rows.json")
    h = v["header"]
    for dtype, field in (
        (torch.float32, "float32_hex"),
        (torch.float16, "float16_hex"),
        (torch.bfloat16, "bfloat16_hex"),
    ):
        store = make(dim=6, state=1, dtype=dtype, clock=FakeClock(h["timestamp"]))
        key = torch.tensor([h["key"]])
        for _ in range(h["count"] - 1):
            store.set(key, torch.tensor([v["weight"]], dtype=dtype))
        store.set(key, torch.tensor([v["state"]], dtype=dtype), width_offset=8)
        assert store.get_rows(key).view(torch.uint8).numpy().tobytes().hex() == v[field]
        # and the checkpoint path reproduces the same bytes from them
        raw = bytes.fromhex(v[field])
        fresh = make(dim=6, state=1, dtype=dtype)
        fresh.set_rows(torch.frombuffer(bytearray(raw), dtype=dtype).reshape(1, -1))
        assert fresh.get_rows(key).view(torch.uint8).numpy().tobytes() == raw


def test_count_saturates(make):
    store = make()
    row = store.get_rows(torch.tensor([1]))
    header_words(row)[0] = torch.tensor([1, (COUNT_MAX << 32) | 5])
    store.set_rows(row)
    store.set(torch.tensor([1, 1]), torch.zeros(2, 6))
    assert int(unpack_metadata(store.metadata(torch.tensor([1])))[1]) == COUNT_MAX


def test_delete_frees_blocks_for_reuse(make):
    store = make(num_shards=1)
    width = store.layout.value_width
    store.set(torch.arange(10), torch.full((10, width), 7.0))  # weights and state: 7
    assert store.delete(torch.tensor([3, 3, 4, 50, -1])) == 2
    assert store.keys().tolist() == [0, 1, 2, 5, 6, 7, 8, 9]
    before = store.memory_bytes()
    store.set(torch.tensor([20, 21]), torch.ones(2, 2))  # the first two weights only
    # the two freed blocks were reused: no chunk of 1024 rows was added (only map entries)
    assert store.memory_bytes() - before < 1024 * store.layout.row_bytes
    # the ids in the reused blocks hold their own initial rows and fresh headers, nothing of
    # the deleted rows (whose every column was 7)
    fresh = make(num_shards=1)
    fresh.set(torch.tensor([20, 21]), torch.ones(2, 2))
    ids = torch.tensor([20, 21])
    assert torch.equal(store.get(ids), fresh.get(ids)) and not bool((store.get(ids) == 7.0).any())
    assert torch.equal(store.metadata(ids), fresh.metadata(ids))
    # and a re-inserted id starts from its initial row, not from the deleted values
    assert torch.equal(store.get(torch.tensor([3])), make(num_shards=1).get(torch.tensor([3])))


def test_pool_grows_in_chunks_of_1024_rows(make):
    store = make(num_shards=1, dim=4, state=0)
    store.set(torch.arange(1024), torch.ones(1024, 4))
    full = store.memory_bytes()
    store.set(torch.tensor([1024]), torch.ones(1, 4))
    grown = store.memory_bytes() - full
    # one more chunk of rows, plus (here) the id map doubling: at most 64 KiB for 1025 ids
    assert 1024 * store.layout.row_bytes <= grown <= 1024 * store.layout.row_bytes + 64 * 1024
    assert torch.equal(store.get(torch.tensor([1024, 0])), torch.ones(2, 4))


def test_keys_and_ranges(make):
    store = make()
    ids = torch.tensor([50, 3, 1, 2**40, 7])
    store.set(ids, torch.zeros(5, 6))
    assert store.keys().tolist() == sorted(ids.tolist())
    assert store.keys_in_range(7, 50).tolist() == [7]
    assert store.keys().dtype == torch.int64 and make().keys().tolist() == []


def test_memory_bytes_counts_rows_and_map(make, backend):
    # the simulator runs a Python thread per value, of the rows and of the chunks they grow
    n, dim, row = (200, 8, 64) if backend == "numba-cuda" else (5000, 128, 544)
    store = make(dim=dim, state=1, num_shards=2)
    assert store.layout.width * store.layout.itemsize == row  # 16-byte header, weights, padded state
    store.set(torch.arange(n), torch.zeros(n, dim))
    # Rows in whole chunks of 1024 per shard, plus the id map: per-key objects in the
    # reference, a half-full table of 12-byte slots in numba, a table of 16-byte slots at most
    # a quarter to a half full in torch, of 16-byte slots (key, block) in numba-cuda.
    per_key = {"reference": 160, "numba": 24, "torch": 64, "numba-cuda": 96}[backend]
    assert n * row <= store.memory_bytes() <= n * row + 2 * 1024 * row + n * per_key + 4096


def test_eviction_by_count_age_norm_and_budget(make):
    clock = FakeClock(1000)
    store = make(clock=clock)
    store.set(torch.tensor([1, 2, 3, 4]), torch.tensor([[1.0] * 6, [2.0] * 6, [0.01] * 6, [3.0] * 6]))
    clock.now = 1100
    store.set(torch.tensor([2, 4, 4]), torch.tensor([[2.0] * 6, [3.0] * 6, [3.0] * 6]))
    assert store.evict(min_count=2).tolist() == [1, 3]
    clock.now = 1150
    store.set(torch.tensor([1, 3]), torch.tensor([[1.0] * 6, [0.01] * 6]))
    assert store.evict(max_age_s=100).tolist() == []
    clock.now = 1201
    assert store.evict(max_age_s=100).tolist() == [2, 4]
    assert store.evict(min_l2_norm=0.1).tolist() == [3]
    store.set(torch.tensor([5, 5, 6]), torch.ones(3, 6))
    assert store.evict(max_rows=2).tolist() == [1]  # counts: 1->1, 5->2, 6->1, and 1 is older
    assert store.keys().tolist() == [5, 6]


def test_concurrent_sets_lose_no_update(make):
    store = make(4, 0, num_shards=4)
    ids = torch.arange(64)
    rounds, threads = 40, 4

    def work(t):
        for r in range(rounds):
            chunk = ids[(r * 7 + t) % 64 :][:16]
            store.set(chunk, torch.full((len(chunk), 4), float(t)))

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    expected = torch.zeros(64, dtype=torch.int64)
    for t in range(threads):
        for r in range(rounds):
            expected[ids[(r * 7 + t) % 64 :][:16]] += 1
    present = expected > 0
    _, count, _ = unpack_metadata(store.metadata(ids))
    assert torch.equal(count[present], expected[present])
    assert torch.equal(store.contains(ids), present)
    values = store.get(ids[present], width=4)
    assert torch.all(values == values[:, :1]) and set(values[:, 0].tolist()) <= {0.0, 1.0, 2.0, 3.0}


# -- bad input: a clear error naming the argument, and the store unchanged --------------

BAD_CALLS = [
    ("get", lambda s: s.get([1, 2]), TypeError, "ids must be a torch.Tensor"),
    (
        "get",
        lambda s: s.get(torch.tensor([1, 2], dtype=torch.int32)),
        TypeError,
        "ids must have dtype",
    ),
    ("get", lambda s: s.get(torch.tensor([[1]])), ValueError, "ids must be 1-D"),
    ("get", lambda s: s.get(torch.tensor([1]), width_offset=99), ValueError, "width_offset"),
    ("get", lambda s: s.get(torch.tensor([1]), width_offset=2, width=99), ValueError, "width"),
    (
        "set",
        lambda s: s.set(torch.tensor([1, 2]), torch.zeros(3, 6)),
        ValueError,
        "values must have shape",
    ),
    (
        "set",
        lambda s: s.set(torch.tensor([1]), torch.zeros(1, 6, dtype=torch.float64)),
        TypeError,
        "values must have",
    ),
    (
        "set",
        lambda s: s.set(torch.tensor([1]), torch.zeros(1, 20)),
        ValueError,
        "values must have shape",
    ),
    (
        "set",
        lambda s: s.set(torch.tensor([1]), torch.zeros(1, 6), width_offset=7),
        ValueError,
        "values",
    ),
    (
        "set",
        lambda s: s.set(torch.tensor([1.0]), torch.zeros(1, 6)),
        TypeError,
        "ids must have dtype",
    ),
    ("set_rows", lambda s: s.set_rows(torch.zeros(2, 11)), ValueError, "rows must have shape"),
    (
        "set_rows",
        lambda s: s.set_rows(torch.zeros(2, 16, dtype=torch.float16)),
        TypeError,
        "rows must have",
    ),
    ("set_rows", lambda s: s.set_rows("rows"), TypeError, "rows must be a torch.Tensor"),
    ("delete", lambda s: s.delete(torch.tensor([0.5])), TypeError, "ids must have dtype"),
    ("evict", lambda s: s.evict(min_count=-1), ValueError, "min_count"),
    ("evict", lambda s: s.evict(max_rows=1.5), ValueError, "max_rows"),
]


@pytest.mark.parametrize(
    "method, call, error, message", BAD_CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)]
)
def test_bad_input_is_rejected_and_changes_nothing(make, method, call, error, message):
    store = make()
    store.set(torch.tensor([1, 2, 3]), torch.randn(3, 6))
    before = state_of(store)
    with pytest.raises(error, match=message) as info:
        call(store)
    assert method in str(info.value)
    assert_same_state(before, state_of(store))


def test_set_rows_with_a_negative_key_names_the_row_and_changes_nothing(make):
    store = make()
    store.set(torch.tensor([1]), torch.ones(1, 6))
    rows = store.get_rows(torch.tensor([1, 1]))
    header_words(rows)[1, 0] = -5
    before = state_of(store)
    with pytest.raises(ValueError, match=r"rows\[1\] has a negative key -5"):
        store.set_rows(rows)
    assert_same_state(before, state_of(store))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": torch.float64}, "dtype"),
        ({"num_shards": 0}, "num_shards"),
        ({"init_range": (1.0, -1.0)}, "init_range"),
        ({"num_shards": 2**16 + 1}, "num_shards"),
        ({"backend": "fast"}, "backend"),
        ({"device": "meta"}, "device"),
    ],
)
def test_bad_constructor_arguments(make, kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        make(4, **kwargs)


def test_repr_names_the_shape_and_backend(make, backend):
    text = repr(make(dim=3, state=2))
    assert "dim=3" in text and "optimizer_state_dim=2" in text and f"backend={backend!r}" in text
