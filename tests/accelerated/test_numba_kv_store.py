"""The numba engine's own claims: initial rows, a large workload, threads, checkpoints, memory."""

import threading

import torch
from hypothesis import given
from hypothesis import strategies as st

from leanstate.checkpoint import load_checkpoint, save_checkpoint
from leanstate.kv_store import KVStore
from leanstate.reference.hashing import initial_weights
from leanstate.reference.row_format import unpack_metadata
from tests.harness import FakeClock, resident_bytes

int64s = st.integers(-(2**63), 2**63 - 1)


@given(
    st.lists(int64s, min_size=1, max_size=20),
    st.integers(0, 2**64 - 1),
    st.integers(1, 40),
    st.sampled_from([(-0.01, 0.01), (-1.0, 3.0), (0.0, 0.0), (-1e-30, 1e30)]),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_initial_weights_match_the_reference_bit_for_bit(ids, seed, dim, init_range, dtype):
    ids = torch.tensor(ids, dtype=torch.int64)
    store = KVStore(dim, seed=seed, init_range=init_range, dtype=dtype, backend="numba")
    low, high = store.init_range
    expected = initial_weights(ids, dim, seed=seed, low=low, high=high, dtype=dtype)
    rows = store.engine.initial_rows(ids)
    first = store.layout.weight_offset
    got = rows[:, first : first + dim].contiguous()
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_large_random_workload_matches_the_reference():
    clock = FakeClock()
    stores = [
        KVStore(24, optimizer_state_dim=3, num_shards=4, seed=5, clock=clock, backend=backend)
        for backend in ("reference", "numba")
    ]
    generator = torch.Generator().manual_seed(0)
    for step in range(30):
        ids = torch.randint(-5, 5000, (800,), generator=generator)
        values = torch.randn(800, 24, generator=generator)
        deleted = torch.randint(0, 5000, (100,), generator=generator)
        clock.now += 1
        for store in stores:
            store.set(ids, values)
            store.set(ids[:50], values[:50, :2], width_offset=25)
            store.delete(deleted)
        if step % 10 == 9:
            assert torch.equal(stores[0].evict(max_rows=2000), stores[1].evict(max_rows=2000))
    probe = torch.arange(-3, 5003)
    ref, fast = stores
    assert torch.equal(ref.keys(), fast.keys())
    assert torch.equal(ref.get_rows(probe), fast.get_rows(probe))
    assert torch.equal(ref.get(probe), fast.get(probe))
    assert torch.equal(ref.evict(max_rows=1000, min_count=2), fast.evict(max_rows=1000, min_count=2))
    assert torch.equal(ref.get_rows(probe), fast.get_rows(probe))


def test_concurrent_sets_lose_no_update():
    """Four writers on disjoint columns of the same (and of new) ids: every count and every
    writer's last value must survive (identical values would hide a lost update)."""
    store = KVStore(4, num_shards=4, backend="numba")
    ids = torch.arange(256)
    rounds = 50

    def work(writer: int):
        fresh = torch.arange(1000 + 100 * writer, 1000 + 100 * writer + 100)  # inserts race too
        for r in range(rounds):
            store.set(ids, torch.full((256, 1), float(writer * 1000 + r)), width_offset=writer)
            store.set(fresh, torch.full((100, 4), float(r)))
            store.get(ids)

    workers = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert unpack_metadata(store.metadata(ids))[1].tolist() == [4 * rounds] * 256
    want = torch.tensor([[w * 1000 + rounds - 1.0 for w in range(4)]]).expand(256, 4)
    assert torch.equal(store.get(ids, width=4), want)
    assert len(store) == 256 + 400
    assert torch.equal(store.get(torch.arange(1000, 1400)), torch.full((400, 4), rounds - 1.0))


def test_checkpoint_round_trip_between_backends(tmp_path):
    src = KVStore(8, optimizer_state_dim=1, clock=FakeClock(), backend="numba")
    src.set(torch.arange(0, 3000, 7), torch.randn(429, 8))
    save_checkpoint(tmp_path / "ck", {"t": src}, chunk_bytes=4096)
    ref = KVStore(8, optimizer_state_dim=1, num_shards=3, backend="reference")
    load_checkpoint(tmp_path / "ck", {"t": ref})
    keys = src.keys()
    assert torch.equal(ref.get_rows(keys), src.get_rows(keys))
    save_checkpoint(tmp_path / "back", {"t": ref}, chunk_bytes=4096)
    assert (tmp_path / "ck" / "t.rows").read_bytes() == (tmp_path / "back" / "t.rows").read_bytes()


def test_memory_is_the_pool_and_a_half_full_table():
    store = KVStore(128, optimizer_state_dim=1, backend="numba")
    store.set(torch.arange(5000), torch.zeros(5000, 128))
    rows = 5000 * store.layout.row_bytes
    pool = 5120 * store.layout.row_bytes  # five steps of 1024 rows
    table = 16384 * 12  # the first power of two at most half full, 12 bytes a slot
    stamps = 5120 * 4  # change tracking: an int32 epoch per block of the pool
    assert store.memory_bytes() == pool + table + stamps + 16 * 4  # and the 16-slot free list
    # 1.096 without the stamps; 5000 rows need a table of 3.3 slots a row, the worst case
    assert store.memory_bytes() <= 1.105 * rows


def test_reserve_faults_the_rows_in_and_the_inserts_that_follow_stay_in_place():
    store = KVStore(128, optimizer_state_dim=1, backend="numba")
    store.set(torch.arange(10), torch.ones(10, 128))
    rows = 40_000  # 21 MiB of rows: below the huge-page threshold
    before = resident_bytes()
    store.reserve(rows)
    assert resident_bytes() - before >= 0.9 * rows * store.layout.row_bytes
    pool, size = store.engine.rows.data_ptr(), store.memory_bytes()
    for start in range(10, rows, 10_000):  # no remap and no growth: the rows were there
        store.set(torch.arange(start, start + 10_000), torch.full((10_000, 128), 2.0))
    assert store.engine.rows.data_ptr() == pool and store.memory_bytes() == size
    assert torch.equal(store.get(torch.tensor([0, 9]), width=128), torch.ones(2, 128))
    assert torch.equal(store.get(torch.tensor([10, rows - 1]), width=128), torch.full((2, 128), 2.0))


def test_rows_faulted_in_ahead_are_bounded_and_change_no_result():
    clock = FakeClock()  # one clock: two stores stamping across a second's tick would differ
    stores = [KVStore(8, optimizer_state_dim=1, backend=b, clock=clock) for b in ("numba", "reference")]
    batch = 8192
    for start in range(0, 40 * 1024 + 8 * batch, batch):
        ids = torch.arange(start, start + batch)
        for store in stores:
            store.set(ids, torch.full((batch, 8), float(start)))
    numba, reference = stores
    keys = reference.keys()
    assert torch.equal(numba.keys(), keys) and torch.equal(numba.get_rows(keys), reference.get_rows(keys))
    engine = numba.engine
    engine._mapped.finish_populating()
    mapped_rows = engine._mapped.capacity
    # at most 1/12 of the pool beyond need (and the rounding to a step of 1024 rows)
    assert engine.handed_out < mapped_rows <= engine.handed_out * (1 + 1 / 12) + 1024


class _RecordingLock:
    """The engine's own readers-writer lock, recording which side each call takes."""

    def __init__(self, lock) -> None:
        self.lock, self.taken = lock, []

    def reading(self):
        self.taken.append("read")
        return self.lock.reading()

    def writing(self):
        self.taken.append("write")
        return self.lock.writing()


def test_every_write_takes_the_write_lock_and_every_read_the_read_lock():
    store = KVStore(6, optimizer_state_dim=2, backend="numba")
    store.set(torch.arange(10), torch.ones(10, 6))
    spy = _RecordingLock(store.engine.lock)
    ids = torch.tensor([1, 2, 30])
    rows = store.get_rows(ids)
    store.engine.lock = spy
    writes = {
        "partial-column set": lambda: store.set(ids, torch.ones(3, 2), width_offset=6),
        "full set": lambda: store.set(ids, torch.ones(3, 6)),
        "set_rows": lambda: store.set_rows(rows),
        "delete": lambda: store.delete(torch.tensor([30])),
        "evict": lambda: store.evict(max_rows=8),
    }
    reads = {
        "get": lambda: store.get(ids),
        "partial get": lambda: store.get(ids, width_offset=6, width=2),
        "get_rows": lambda: store.get_rows(ids),
        "contains": lambda: store.contains(ids),
        "metadata": lambda: store.metadata(ids),
        "keys": lambda: store.keys(),
        "keys_in_range": lambda: store.keys_in_range(0, 20),
    }
    for name, call in {**writes, **reads}.items():
        spy.taken.clear()
        call()
        want = "write" if name in writes else "read"
        assert spy.taken and set(spy.taken) == {want}, (name, spy.taken)


def test_kernels_run_serially_when_small_and_follow_torch_threads_when_large():
    import numba

    from leanstate.accelerated._numba_runtime import SERIAL_BELOW

    store = KVStore(128, optimizer_state_dim=1, backend="numba")
    small = torch.arange(8)
    large = torch.arange(SERIAL_BELOW // 128 + 1)
    store.set(large, torch.ones(len(large), 128))
    torch_threads = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            store.get(large, width=128)
            assert numba.get_num_threads() == min(threads, numba.config.NUMBA_NUM_THREADS)
            store.get(small, width=128)
            assert numba.get_num_threads() == 1
            store.set(large, torch.ones(len(large), 128))
            assert numba.get_num_threads() == min(threads, numba.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(torch_threads)


def test_starting_numba_threads_leaves_torch_thread_count_as_it_was():
    import subprocess
    import sys

    probe = """
import ctypes, torch
torch.set_num_threads(1)
import leanstate
store = leanstate.KVStore(8, backend="numba")
store.set(torch.arange(100), torch.ones(100, 8))
openmp = ctypes.CDLL("libgomp.so.1")  # the OpenMP runtime torch loaded first
print(torch.get_num_threads(), openmp.omp_get_max_threads())
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["1", "1"]


def test_adopt_stamps_the_block_each_row_ends_in():
    """A row read in place is written: its own block when its key was new, the present
    key's block when the key was there (the row moves into it)."""
    store = KVStore(4, backend="numba", clock=FakeClock())
    store.set(torch.tensor([5, 6]), torch.ones(2, 4))
    mark = store.next_epoch()
    rows = store.get_rows(torch.tensor([5, 8]))  # 8 is missing: a zero row
    rows[1, : store.layout.header_elems].view(torch.int64)[0] = 8
    engine = store.engine
    with engine.writing():
        first = engine.claim(2)
        engine.rows[first : first + 2] = rows
        engine.adopt(first, 2)
    written, removed = store.changes(since=mark)
    assert written.tolist() == [5, 8] and removed.tolist() == []
