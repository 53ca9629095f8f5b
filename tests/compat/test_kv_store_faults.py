"""The store under races and bad input, on every backend.

- eviction racing writers: atomic, so no update is lost and every evicted row was a
  victim at one instant;
- a hypothesis fuzz of the public methods with wrong types, values and bounds: each
  call works or raises TypeError/ValueError naming the argument, and a call that
  raises leaves the store exactly as it was.
"""

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leanstate import _backends
from leanstate.kv_store import KVStore
from leanstate.reference.row_format import header_words, unpack_metadata
from tests.harness import FakeClock

BACKENDS = sorted(_backends.available("kv_store"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_eviction_racing_writers_loses_no_update(backend):
    """Writers set their ids again and again while an evictor removes rows with count < 2.

    Atomic eviction removes a row only while its count is 1, so each eviction takes
    exactly one of the id's sets away: for every id, its final count (0 when absent)
    is its number of sets minus the times it was evicted. A lost update (a row deleted
    after a write raised its count) breaks that equality.

    The interleaving does not depend on the machine's load: every writer waits after its
    first round until the evictor has made one pass, which evicts those rows (count 1);
    after that, writers and evictor race freely.
    """
    store = KVStore(4, num_shards=4, backend=backend, clock=FakeClock())
    # the simulator runs a Python thread per kernel thread: fewer rounds, the same races
    writers, ids_per_writer, rounds = 3, 40, (30 if backend == "numba-cuda" else 80)
    evicted: list[int] = []
    done = threading.Event()
    first_round = threading.Barrier(writers + 1)  # passed twice: round 0 written, first pass made

    def write(w):
        ids = torch.arange(w * 1000, w * 1000 + ids_per_writer)
        for r in range(rounds):
            store.set(ids[r % 4 :: 4], torch.full((ids_per_writer // 4, 4), float(r)))
            if r == 0:
                first_round.wait()
                first_round.wait()

    def evict():
        first_round.wait()
        evicted.extend(store.evict(min_count=2).tolist())
        first_round.wait()
        while not done.is_set():
            evicted.extend(store.evict(min_count=2).tolist())

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    evictor = threading.Thread(target=evict)
    evictor.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    evictor.join()
    for w in range(writers):
        ids = torch.arange(w * 1000, w * 1000 + ids_per_writer)
        _, count, _ = unpack_metadata(store.metadata(ids))  # 0 for absent ids
        sets = rounds // 4 + (torch.arange(ids_per_writer) % 4 < rounds % 4).to(torch.int64)
        for i, key in enumerate(ids.tolist()):
            assert int(count[i]) == int(sets[i]) - evicted.count(key), (key, int(count[i]), int(sets[i]))
    first_pass = [w * 1000 + i for w in range(writers) for i in range(0, ids_per_writer, 4)]
    assert set(first_pass) <= set(evicted)  # the forced first pass evicted every round-0 row


# -- bad input ------------------------------------------------------------------------

WRONG = [
    None,
    "x",
    1.5,
    True,
    -1,
    2**63,
    2**64,
    np.int64(2),
    [1, 2],
    (1.0, 2.0),
    torch.tensor([1, 2], dtype=torch.int32),
    torch.tensor([[1]]),
    torch.tensor([1.0]),
    torch.zeros(2, 20),
    torch.zeros(2, 16, dtype=torch.float16),
    torch.zeros(1, 6, dtype=torch.float64),
    torch.tensor([1, 2]).to_sparse(),
    torch.empty(2, dtype=torch.int64, device="meta"),
]
values = st.sampled_from(WRONG) | st.integers(-5, 30)
CALLS = {
    "get": lambda s, a, b: s.get(a, width_offset=b),
    "get-width": lambda s, a, b: s.get(torch.tensor([1]), width=a, width_offset=b),
    "set": lambda s, a, b: s.set(a, b),
    "set-offset": lambda s, a, b: s.set(torch.tensor([1]), torch.zeros(1, 2), width_offset=a),
    "set_rows": lambda s, a, b: s.set_rows(a),
    "get_rows": lambda s, a, b: s.get_rows(a),
    "contains": lambda s, a, b: s.contains(a),
    "metadata": lambda s, a, b: s.metadata(a),
    "delete": lambda s, a, b: s.delete(a),
    "keys_in_range": lambda s, a, b: s.keys_in_range(a, b),
    "evict": lambda s, a, b: s.evict(min_count=a, max_rows=b),
    "evict-age": lambda s, a, b: s.evict(max_age_s=a),
    "evict-norm": lambda s, a, b: s.evict(min_l2_norm=a),
}
ARGUMENTS = (
    "ids",
    "values",
    "rows",
    "width",
    "width_offset",
    "lo",
    "hi",
    "min_count",
    "max_rows",
    "max_age_s",
    "min_l2_norm",
)


def state(store):
    keys = store.keys()
    return keys, store.get_rows(keys).view(torch.uint8), len(store)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=300, deadline=None)
@given(call=st.sampled_from(sorted(CALLS)), a=values, b=values)
def test_every_call_works_or_names_its_argument_and_changes_nothing(backend, call, a, b):
    store = KVStore(6, optimizer_state_dim=2, backend=backend, clock=FakeClock(100))
    store.set(torch.tensor([1, 2, 3]), torch.randn(3, 6, generator=torch.Generator().manual_seed(0)))
    before = state(store)
    try:
        CALLS[call](store, a, b)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        assert message.startswith("KVStore."), message
        assert any(name in message for name in ARGUMENTS), message
        after = state(store)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]) and before[2] == after[2]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"init_range": "ab"}, "init_range"),
        ({"init_range": (0.0,)}, "init_range"),
        ({"seed": "x"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"clock": 5}, "clock"),
        ({"num_shards": 2**32 - 1}, "num_shards"),
        ({"num_shards": True}, "num_shards"),
        ({"dtype": torch.int64}, "dtype"),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_constructor_arguments_name_the_argument(backend, kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        KVStore(4, backend=backend, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_likes_and_misaligned_contiguous_tensors_work(backend):
    store = KVStore(6, optimizer_state_dim=2, backend=backend, clock=FakeClock())
    store.set(torch.tensor([5]), torch.ones(1, 2), width_offset=np.int64(8))
    assert store.get(torch.tensor([5]), width_offset=np.int64(8), width=np.int32(2)).tolist() == [[1.0, 1.0]]
    rows = store.get_rows(torch.tensor([5]))
    header_words(rows)[0, 0] = 9
    odd = torch.zeros(rows.numel() + 1)[1:].view(1, -1)  # contiguous, at an odd storage offset
    odd.copy_(rows)
    store.set_rows(odd)
    assert torch.equal(store.get_rows(torch.tensor([9]))[:, 4:], rows[:, 4:])
    assert store.keys_in_range(0, 2**63).tolist() == [5, 9]
    assert store.keys_in_range(-(2**63), 6).tolist() == [5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_eviction_age_is_strictly_older_than(backend):
    clock = FakeClock(1000)
    store = KVStore(4, backend=backend, clock=clock)
    store.set(torch.tensor([1]), torch.ones(1, 4))
    clock.now = 1100
    assert store.evict(max_age_s=100).tolist() == []  # exactly max_age_s old: kept
    clock.now = 1101
    assert store.evict(max_age_s=100).tolist() == [1]
    store.set(torch.tensor([2, 2]), torch.ones(2, 4))
    assert store.evict(min_count=2).tolist() == []  # count == min_count: kept
    assert store.evict(min_count=3).tolist() == [2]
