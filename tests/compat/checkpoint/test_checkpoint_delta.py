"""Delta checkpoints (``spec/checkpoint_format.md``, "Delta checkpoints"): a chain of a full
checkpoint and deltas loads (and compacts) to exactly the store it was saved from, on
every backend; a damaged chain is a clear error that changes no store; a failed or
killed save loses no change."""

import hashlib
import json
import shutil
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leanstate import _backends
from leanstate.checkpoint import _chain as _checkpoint_chain
from leanstate.checkpoint import compact_checkpoint, last_load_stats, load_checkpoint, save_checkpoint
from leanstate.checkpoint.core import BucketedTable
from leanstate.kv_store import KVStore
from leanstate.reference import delta_checkpoint as textbook
from leanstate.reference.checkpoint import CheckpointError
from tests.harness import FakeClock, files_opened, kill_during, one_rank_group

BACKENDS = ["reference", "numba", "torch"]
DIM, STATE = 6, 2


def new_store(backend="reference", clock=None):
    return KVStore(DIM, optimizer_state_dim=STATE, backend=backend, clock=clock or FakeClock(100))


def rows_of(store):
    keys = store.keys()
    return keys, store.get_rows(keys)


def assert_same(a, b):
    keys_a, rows_a = rows_of(a)
    keys_b, rows_b = rows_of(b)
    assert torch.equal(keys_a, keys_b)
    assert torch.equal(rows_a.view(torch.int32), rows_b.view(torch.int32))  # bit for bit


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names
    )


# -- the chain equals the store ---------------------------------------------------------


def manifests_read(opened: list[str]) -> dict[str, int]:
    """How many times each link's manifest was opened, by the link's folder name."""
    names = [Path(p).parent.name for p in opened if Path(p).name == "manifest.json"]
    return {name: names.count(name) for name in names}


@pytest.mark.parametrize("version", [1, 2])
def test_a_chain_load_reads_each_links_manifest_once(tmp_path, version):
    """Version 2 too, loaded by one process into plain stores."""
    store = new_store()
    base = None
    with one_rank_group() as group:
        for link in range(3):
            store.set(torch.arange(link, 40, 3), torch.full((len(range(link, 40, 3)), DIM), float(link)))
            tables = {"t": store} if version == 1 else {"t": BucketedTable(store, 4, None)}
            options = {} if version == 1 else {"process_group": group}
            save_checkpoint(tmp_path / f"l{link}", tables, base=base, **options)
            base = tmp_path / f"l{link}"
    fresh = new_store()
    with files_opened() as opened:
        load_checkpoint(base, {"t": fresh})
    assert manifests_read(opened) == {"l0": 1, "l1": 1, "l2": 1}
    assert_same(fresh, store)


def test_a_load_refused_before_it_reads_records_nothing_read(tmp_path):
    """After a load that read rows, one refused at once (id_range with process_group) leaves
    last_load_stats all zero, not the previous load's. Kills: the record reset after that
    refusal can happen."""
    store = new_store()
    store.set(torch.arange(20), torch.ones(20, DIM))
    save_checkpoint(tmp_path / "c", {"t": store})
    load_checkpoint(tmp_path / "c", {"t": new_store()})
    assert last_load_stats["rows_loaded"] == 20
    with one_rank_group() as group:
        with pytest.raises(ValueError, match="id_range and process_group exclude each other"):
            load_checkpoint(
                tmp_path / "c",
                {"t": BucketedTable(new_store(), 4, None)},
                id_range=(0, 5),
                process_group=group,
            )
    assert last_load_stats == {"bytes_read": 0, "chunks_read": 0, "rows_loaded": 0}


def test_every_load_returns_its_statistics_and_records_the_last(tmp_path):
    """A version-1 load returns what it read (each chunk of every link once, the rows it
    applied), as a version-2 load does; ``last_load_stats`` is the last load's, and a load
    refused before it reads records nothing read, not the previous load's figures."""
    store = new_store()
    base = None
    for link in range(3):
        ids = torch.arange(link, 40, 3)
        store.set(ids, torch.full((len(ids), DIM), float(link)))
        store.delete(torch.tensor([link * 7]))
        save_checkpoint(
            tmp_path / f"l{link}", {"t": store}, base=base, chunk_bytes=10 * store.layout.row_bytes
        )
        base = tmp_path / f"l{link}"
    tables = [json.loads((tmp_path / f"l{k}" / "manifest.json").read_text())["tables"]["t"] for k in range(3)]
    expected = {
        "bytes_read": sum(t["rows"] for t in tables) * store.layout.row_bytes,
        "chunks_read": sum(len(t["chunks"]) for t in tables),
        "rows_loaded": sum(t["rows"] for t in tables),  # into an empty store: each link's rows applied
    }
    links = _checkpoint_chain.read_chain(base)
    targets = [_checkpoint_chain.Target("t", new_store(), None)]
    extra, stats = _checkpoint_chain.load_chain(
        links, targets, id_range=None, chunk_bytes=2**20, progress=None
    )
    assert extra == {} and stats == expected and stats["chunks_read"] > 3
    assert _checkpoint_chain.last_load_stats == expected
    load_checkpoint(tmp_path / "l0", {"t": new_store()})  # the last load's figures replace them
    assert last_load_stats == {
        "bytes_read": tables[0]["rows"] * store.layout.row_bytes,
        "chunks_read": len(tables[0]["chunks"]),
        "rows_loaded": tables[0]["rows"],
    }
    with pytest.raises(CheckpointError, match="table 'u' is not in"):
        load_checkpoint(base, {"u": new_store()})
    assert last_load_stats == {"bytes_read": 0, "chunks_read": 0, "rows_loaded": 0}


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.lists(st.integers(0, 400), min_size=1, max_size=40)),
        st.tuples(st.just("delete"), st.lists(st.integers(0, 400), max_size=30)),
        st.tuples(st.just("evict"), st.integers(0, 200)),
        st.tuples(st.just("delta"), st.integers(1, 3)),
        st.tuples(st.just("full"), st.integers(1, 3)),
    ),
    max_size=14,
)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, seed=st.integers(0, 2**16))
def test_a_chain_loads_and_compacts_to_the_store_it_was_saved_from(tmp_path_factory, backend, ops, seed):
    folder = tmp_path_factory.mktemp("chain")
    generator = torch.Generator().manual_seed(seed)
    clock = FakeClock(100)
    store = new_store(backend, clock)
    store.set(torch.arange(0, 300, 3), torch.randn(100, DIM + STATE, generator=generator))
    head = folder / "c0"
    save_checkpoint(head, {"t": store}, chunk_bytes=256)
    for k, (op, arg) in enumerate(ops, start=1):
        clock.now += 1
        if op == "set":
            ids = torch.tensor(arg)
            store.set(ids, torch.randn(len(ids), DIM + STATE, generator=generator))
        elif op == "delete":
            store.delete(torch.tensor(arg, dtype=torch.int64))
        elif op == "evict":
            store.evict(max_rows=arg)
        else:
            path = folder / f"c{k}"
            base = head if op == "delta" else None
            save_checkpoint(path, {"t": store}, base=base, chunk_bytes=64 * arg, extra={"k": k})
            head = path
    final = folder / "final"
    save_checkpoint(final, {"t": store}, base=head, chunk_bytes=256, extra={"k": "end"})
    for into in BACKENDS:
        fresh = new_store(into)
        assert load_checkpoint(final, {"t": fresh}) == {"k": "end"}
        assert_same(store, fresh)
    # into a live store: the chain's rows are upserted; its other rows stay as they were
    live = new_store("torch")
    mine = torch.tensor([1, 2, 500, 501])
    live.set(mine, torch.full((4, DIM + STATE), 7.0))
    load_checkpoint(final, {"t": live})
    keys, rows = rows_of(store)
    assert torch.equal(live.get_rows(keys), rows)
    others = mine[~torch.isin(mine, keys)]
    assert torch.all(live.get(others, width=DIM + STATE) == 7.0) and len(live) == len(keys) + len(others)
    # compaction: byte for byte a full save of the same rows
    compact_checkpoint(final, folder / "compacted", chunk_bytes=256)
    save_checkpoint(folder / "full", {"t": store}, chunk_bytes=256, extra={"k": "end"})
    assert same_files(folder / "compacted", folder / "full")
    shutil.rmtree(folder)


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_steps_are_in_the_delta_and_resume_bit_exactly(tmp_path, backend):
    import leanstate

    def bag():
        return leanstate.KVEmbeddingBag(
            None, 4, optimizer="rowwise_adagrad", lr=0.1, backend=backend, clock=FakeClock(5)
        )

    def step(module, k):
        ids = torch.randint(0, 5000, (64,), generator=torch.Generator().manual_seed(k))
        module(ids, torch.arange(0, 64, 8)).sum().backward()

    trained = bag()
    for k in range(3):
        step(trained, k)
    save_checkpoint(tmp_path / "0", trained.checkpoint_tables())
    changed = []
    for link in range(1, 4):
        before = set(trained.store.keys().tolist())
        step(trained, 10 + link)
        written, _ = trained.store.changes()
        changed.append(len(written))
        assert set(written.tolist()) >= set(trained.store.keys().tolist()) - before
        save_checkpoint(tmp_path / f"{link}", trained.checkpoint_tables(), base=tmp_path / f"{link - 1}")
        manifest = json.loads((tmp_path / f"{link}" / "manifest.json").read_text())
        assert manifest["tables"]["weight"]["rows"] == changed[-1]  # only the step's rows
    resumed = bag()
    load_checkpoint(tmp_path / "3", resumed.checkpoint_tables())
    assert_same(trained.store, resumed.store)
    step(trained, 99)
    step(resumed, 99)
    assert_same(trained.store, resumed.store)


def test_a_delta_holds_exactly_the_rows_written_and_the_ids_removed(tmp_path):
    store = new_store()
    store.set(torch.arange(100), torch.zeros(100, DIM + STATE))
    save_checkpoint(tmp_path / "0", {"t": store})
    store.set(torch.tensor([5, 7, 250]), torch.ones(3, DIM + STATE))
    store.delete(torch.tensor([9, 10, 7, 999]))
    save_checkpoint(tmp_path / "1", {"t": store}, base=tmp_path / "0")
    table = json.loads((tmp_path / "1" / "manifest.json").read_text())["tables"]["t"]
    rows = np.frombuffer((tmp_path / "1" / "t.rows").read_bytes(), dtype="<i8")
    assert rows[:: store.layout.row_bytes // 8].tolist() == [5, 250]
    removed = np.frombuffer((tmp_path / "1" / "t.removed").read_bytes(), dtype="<i8")
    assert removed.tolist() == [7, 9, 10]
    assert table["removed"] == {
        "file": "t.removed",
        "ids": 3,
        "bytes": 24,
        "min_id": 7,
        "max_id": 10,
        "crc": crc32c.crc32c(removed.tobytes()),
    }
    digest = hashlib.sha256((tmp_path / "0" / "manifest.json").read_bytes()).hexdigest()
    assert json.loads((tmp_path / "1" / "manifest.json").read_text())["base"] == {
        "path": "../0",
        "manifest_sha256": digest,
    }
    # nothing changed since: an empty delta
    save_checkpoint(tmp_path / "2", {"t": store}, base=tmp_path / "1")
    table = json.loads((tmp_path / "2" / "manifest.json").read_text())["tables"]["t"]
    assert table["rows"] == 0 and table["removed"]["ids"] == 0


# -- saves that fail or are refused -------------------------------------------------------


def test_a_failed_delta_save_keeps_the_mark_and_the_next_delta_has_every_change(tmp_path):
    store = new_store()
    store.set(torch.arange(50), torch.zeros(50, DIM + STATE))
    save_checkpoint(tmp_path / "0", {"t": store})
    mark = store.mark
    store.set(torch.arange(0, 50, 2), torch.ones(25, DIM + STATE))

    def broken(*_):
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        save_checkpoint(tmp_path / "1", {"t": store}, base=tmp_path / "0", chunk_bytes=64, progress=broken)
    assert store.mark == mark and not (tmp_path / "1").exists()
    store.set(torch.tensor([1]), torch.ones(1, DIM + STATE))
    save_checkpoint(tmp_path / "1", {"t": store}, base=tmp_path / "0")
    fresh = new_store("numba")
    load_checkpoint(tmp_path / "1", {"t": fresh})
    assert_same(store, fresh)


def test_delta_saves_that_cannot_be_right_are_refused(tmp_path):
    store = new_store()
    store.set(torch.arange(10), torch.zeros(10, DIM + STATE))
    with pytest.raises(ValueError, match="is not a checkpoint"):
        save_checkpoint(tmp_path / "1", {"t": store}, base=tmp_path / "none")
    save_checkpoint(tmp_path / "0", {"t": store})
    other = new_store()
    with pytest.raises(ValueError, match=r"tables\['t'\].*no change mark.*full checkpoint first"):
        save_checkpoint(tmp_path / "1", {"t": other}, base=tmp_path / "0")
    save_checkpoint(tmp_path / "elsewhere", {"t": other})
    with pytest.raises(ValueError, match="another checkpoint"):
        save_checkpoint(tmp_path / "1", {"t": other}, base=tmp_path / "0")
    with pytest.raises(ValueError, match="tables of its base"):
        save_checkpoint(tmp_path / "1", {"t": store, "u": new_store()}, base=tmp_path / "0")
    with pytest.raises(ValueError, match="(is|lies inside|holds) the base"):
        save_checkpoint(tmp_path / "0", {"t": store}, base=tmp_path / "0")
    wide = KVStore(DIM + 1, optimizer_state_dim=STATE, backend="reference")
    with pytest.raises(ValueError, match="does not match its base"):
        save_checkpoint(tmp_path / "1", {"t": wide}, base=tmp_path / "0")
    with pytest.raises(TypeError, match="base must be the path"):
        save_checkpoint(tmp_path / "1", {"t": store}, base=3)
    store.track_changes(False)
    with pytest.raises(ValueError, match="no change mark"):
        save_checkpoint(tmp_path / "1", {"t": store}, base=tmp_path / "0")
    assert not (tmp_path / "1").exists()


def _delta_save_when_told(folder: str, ready, go) -> None:
    """The process killed during its delta save."""
    store = new_store()
    store.set(torch.arange(4000), torch.zeros(4000, DIM + STATE))
    save_checkpoint(Path(folder) / "0", {"t": store}, chunk_bytes=4096)
    store.set(torch.arange(0, 4000, 2), torch.ones(2000, DIM + STATE))
    store.delete(torch.arange(1, 200, 2))
    ready.set()
    go.wait()
    save_checkpoint(Path(folder) / "1", {"t": store}, base=Path(folder) / "0", chunk_bytes=512)


@pytest.mark.parametrize("trial", range(6))
def test_a_delta_save_killed_at_a_random_point_leaves_the_chain_whole(tmp_path, trial):
    kill_during(_delta_save_when_told, (str(tmp_path),), trial, 0.1)
    fresh = new_store()
    load_checkpoint(tmp_path / "0", {"t": fresh})
    assert len(fresh) == 4000 and torch.all(fresh.get(fresh.keys()) == 0)
    if (tmp_path / "1" / "manifest.json").exists():  # it got as far as publishing: the whole delta
        fresh = new_store()
        load_checkpoint(tmp_path / "1", {"t": fresh})
        assert len(fresh) == 3900 and int(fresh.get(torch.arange(0, 4000, 2)).sum()) == 2000 * (DIM + STATE)


def _compaction_when_told(folder: str, ready, go) -> None:
    """The process killed while it compacts a chain over an existing checkpoint."""
    store = new_store()
    store.set(torch.arange(4000), torch.zeros(4000, DIM + STATE))
    save_checkpoint(Path(folder) / "0", {"t": store}, chunk_bytes=4096)
    store.set(torch.arange(0, 4000, 3), torch.ones(1334, DIM + STATE))
    save_checkpoint(Path(folder) / "1", {"t": store}, base=Path(folder) / "0", chunk_bytes=512)
    old = new_store()
    old.set(torch.arange(10), torch.full((10, DIM + STATE), 5.0))
    save_checkpoint(Path(folder) / "out", {"t": old})
    ready.set()
    go.wait()
    compact_checkpoint(Path(folder) / "1", Path(folder) / "out", chunk_bytes=512, overwrite=True)


@pytest.mark.parametrize(
    "trial", [*range(3), *(pytest.param(t, marks=pytest.mark.slow) for t in range(3, 40))]
)
def test_a_compaction_killed_at_a_random_point_leaves_the_chain_and_the_old_destination(tmp_path, trial):
    """kill -9 during ``compact --force``: the chain still loads, and ``out`` is either the
    checkpoint it was or the whole compaction, never a mix."""
    kill_during(_compaction_when_told, (str(tmp_path),), trial, 0.08)
    chain = new_store()
    load_checkpoint(tmp_path / "1", {"t": chain})
    assert len(chain) == 4000
    out = new_store()
    load_checkpoint(tmp_path / "out", {"t": out})
    assert len(out) == 10 or (len(out) == 4000 and torch.equal(rows_of(out)[1], rows_of(chain)[1]))


def test_saves_and_loads_of_one_chain_from_threads_at_once_stay_whole(tmp_path):
    """Delta saves of one store into fresh directories while other threads load the chain's
    links: every load sees a complete link (the rows of the store when it was saved), every
    save is published whole."""
    import threading

    store = new_store()
    store.set(torch.arange(2000), torch.zeros(2000, DIM + STATE))
    save_checkpoint(tmp_path / "l0", {"t": store}, chunk_bytes=1024)
    sizes = {"l0": 2000}
    errors: list[BaseException] = []

    def reader(stop: threading.Event) -> None:
        while not stop.is_set():
            for name, size in list(sizes.items()):
                fresh = new_store()
                try:
                    load_checkpoint(tmp_path / name, {"t": fresh})
                    assert len(fresh) == size, (name, len(fresh), size)
                except BaseException as exc:  # reported by the main thread
                    errors.append(exc)
                    return

    stop = threading.Event()
    readers = [threading.Thread(target=reader, args=(stop,)) for _ in range(2)]
    for thread in readers:
        thread.start()
    for link in range(1, 9):
        store.set(torch.arange(2000 + 10 * link, 2010 + 10 * link), torch.ones(10, DIM + STATE))
        save_checkpoint(tmp_path / f"l{link}", {"t": store}, base=tmp_path / f"l{link - 1}", chunk_bytes=1024)
        sizes[f"l{link}"] = len(store)
    stop.set()
    for thread in readers:
        thread.join()
    assert not errors, errors[0]
    final = new_store()
    load_checkpoint(tmp_path / "l8", {"t": final})
    assert_same(store, final)


# -- damaged chains -------------------------------------------------------------------------


@pytest.fixture
def chain(tmp_path):
    """A full checkpoint and two deltas of one table, and the store they hold."""
    store = new_store()
    store.set(torch.arange(0, 200), torch.randn(200, DIM + STATE, generator=torch.Generator().manual_seed(1)))
    save_checkpoint(tmp_path / "base", {"t": store}, chunk_bytes=512)
    store.set(torch.arange(0, 200, 7), torch.ones(29, DIM + STATE))
    store.delete(torch.tensor([3, 4, 5]))
    save_checkpoint(tmp_path / "d1", {"t": store}, base=tmp_path / "base", chunk_bytes=512)
    store.set(torch.tensor([3, 300]), torch.full((2, DIM + STATE), 2.0))
    store.delete(torch.tensor([6, 7]))
    save_checkpoint(tmp_path / "d2", {"t": store}, base=tmp_path / "d1", chunk_bytes=512)
    return tmp_path, store


def edit_manifest(path: Path, change) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))


def digest_of(path: Path) -> str:
    return hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()


def flip_byte(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x40
    file.write_bytes(bytes(data))


def rewrite_removed(path: Path, ids: list[int]) -> None:
    """A removed file holding ``ids``, its manifest entry made to agree (CRC too)."""
    data = np.array(ids, dtype="<i8").tobytes()
    (path / "t.removed").write_bytes(data)

    def change(manifest):
        manifest["tables"]["t"]["removed"].update(
            ids=len(ids), bytes=len(data), min_id=ids[0], max_id=ids[-1], crc=crc32c.crc32c(data)
        )

    edit_manifest(path, change)


def missing_base(folder):
    shutil.rmtree(folder / "base")


def replaced_base(folder):
    other = new_store()
    other.set(torch.arange(5), torch.zeros(5, DIM + STATE))
    save_checkpoint(folder / "base", {"t": other})


def corrupt_rows(folder):
    flip_byte(folder / "d1" / "t.rows", 40)


def corrupt_removed(folder):
    flip_byte(folder / "d2" / "t.removed", 9)  # the last id grows: still ascending


def truncated_removed(folder):
    data = (folder / "d1" / "t.removed").read_bytes()
    (folder / "d1" / "t.removed").write_bytes(data[:-8])


def removed_out_of_order(folder):
    rewrite_removed(folder / "d2", [6, 9, 7])  # first and last agree with the manifest


def removed_range_misstated(folder):
    edit_manifest(folder / "d2", lambda m: m["tables"]["t"]["removed"].update(min_id=5))  # holds 6, 7


def removed_and_written(folder):
    rewrite_removed(folder / "d2", [3, 6, 7])  # 3 is also a row of d2


def cycle(folder):
    def to_d2(manifest):
        manifest["base"] = {"path": "../d2", "manifest_sha256": digest_of(folder / "d2")}

    edit_manifest(folder / "d1", to_d2)
    d1 = digest_of(folder / "d1")
    edit_manifest(folder / "d2", lambda m: m["base"].update(manifest_sha256=d1))


def absolute_base(folder):
    edit_manifest(folder / "d2", lambda m: m["base"].update(path=str(folder / "d1")))


def table_missing_below(folder):
    def add(manifest):
        manifest["tables"]["u"] = dict(manifest["tables"]["t"], file="u.rows")
        manifest["tables"]["u"]["removed"] = dict(manifest["tables"]["t"]["removed"], file="u.removed")

    edit_manifest(folder / "d2", add)
    shutil.copy(folder / "d2" / "t.rows", folder / "d2" / "u.rows")
    shutil.copy(folder / "d2" / "t.removed", folder / "d2" / "u.removed")


FAULTS = {
    missing_base: "its base '../base' is missing",
    replaced_base: "base.manifest_sha256 does not match",
    corrupt_rows: r"d1/t.rows.*crc32c check",
    corrupt_removed: r"d2/t.removed fails its crc32c check",
    truncated_removed: r"d1/t.removed has \d+ bytes",
    removed_out_of_order: "do not strictly ascend",
    removed_range_misstated: r"d2/t.removed holds ids 6..7, the manifest says",
    removed_and_written: "removed and also a row of the same delta",
    cycle: "a cycle",
    absolute_base: "base.path must be a non-empty relative path",
}


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("into", ["empty numba", "live torch"])
def test_a_damaged_chain_is_a_clear_error_naming_the_link_and_changes_no_store(chain, fault, into):
    folder, _ = chain
    fault(folder)
    store = new_store(into.split()[1])
    if into.startswith("live"):
        store.set(torch.arange(0, 400, 5), torch.full((80, DIM + STATE), 3.0))
    before = rows_of(store)
    with pytest.raises(CheckpointError, match=FAULTS[fault]):
        load_checkpoint(folder / "d2", {"t": store})
    after = rows_of(store)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_a_table_missing_from_a_link_below_is_named(chain):
    folder, _ = chain
    table_missing_below(folder)
    with pytest.raises(
        CheckpointError, match=r"table 'u' is not in .*base/manifest.json \(a link of the chain"
    ):
        load_checkpoint(folder / "d2", {"u": new_store()})


def test_a_chain_longer_than_the_limit_is_refused(chain, monkeypatch):
    folder, store = chain
    monkeypatch.setattr(_checkpoint_chain, "MAX_CHAIN_LINKS", 2)
    # named at the link that would be the third (kills: naming the link before it)
    with pytest.raises(
        CheckpointError, match=r"d1[/\\]manifest\.json: the chain from .* has more than 2 links"
    ):
        load_checkpoint(folder / "d2", {"t": new_store()})
    monkeypatch.setattr(_checkpoint_chain, "MAX_CHAIN_LINKS", 3)
    fresh = new_store()
    load_checkpoint(folder / "d2", {"t": fresh})
    assert_same(store, fresh)


def test_a_reader_of_full_checkpoints_refuses_a_delta(chain):
    from leanstate.checkpoint._files import read_manifest

    folder, _ = chain
    with pytest.raises(CheckpointError, match="a delta checkpoint.*compact_checkpoint"):
        read_manifest(folder / "d2")


def test_id_range_and_marks_after_loads(chain):
    folder, store = chain
    part = new_store()
    load_checkpoint(folder / "d2", {"t": part}, id_range=(50, 120))
    keys = store.keys()
    inside = keys[(keys >= 50) & (keys < 120)]
    assert torch.equal(part.keys(), inside) and torch.equal(part.get_rows(inside), store.get_rows(inside))
    # a load into an empty store marks it at the head: a delta of it follows the chain
    fresh = new_store()
    load_checkpoint(folder / "d2", {"t": fresh})
    assert fresh.mark.checkpoint == digest_of(folder / "d2")
    fresh.set(torch.tensor([1000]), torch.ones(1, DIM + STATE))
    save_checkpoint(folder / "d3", {"t": fresh}, base=folder / "d2")
    again = new_store("numba")
    load_checkpoint(folder / "d3", {"t": again})
    assert_same(fresh, again)


def test_compaction_refuses_to_write_over_a_link(chain):
    folder, _ = chain
    with pytest.raises(ValueError, match="a link of the chain from the head of the chain being compacted"):
        compact_checkpoint(folder / "d2", folder / "d1")
    assert (folder / "d1" / "manifest.json").exists()


# -- held to the textbook ---------------------------------------------------------------------

VECTOR = Path(__file__).parents[3] / "spec" / "vectors" / "delta_v1"


def test_the_golden_vector_loads_and_compacts_byte_for_byte(tmp_path):
    shutil.copytree(VECTOR, tmp_path / "v")
    compact_checkpoint(tmp_path / "v" / "delta", tmp_path / "c", chunk_bytes=96)
    assert same_files(tmp_path / "c", VECTOR / "compacted")
    for backend in BACKENDS:
        chained, compacted = (KVStore(3, optimizer_state_dim=1, backend=backend) for _ in range(2))
        load_checkpoint(tmp_path / "v" / "delta", {"t": chained})
        load_checkpoint(VECTOR / "compacted", {"t": compacted})
        assert_same(chained, compacted)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, seed=st.integers(0, 2**16))
def test_every_link_is_byte_for_byte_the_textbooks(tmp_path_factory, ops, seed):
    from leanstate.reference import delta_checkpoint as textbook

    folder = tmp_path_factory.mktemp("differential")
    stores = [new_store("reference", FakeClock(100)), new_store("numba", FakeClock(100))]
    saves = [textbook.save_checkpoint, save_checkpoint]
    initial = torch.randn(100, DIM + STATE, generator=torch.Generator().manual_seed(seed))
    heads = []
    for side, (store, save) in enumerate(zip(stores, saves, strict=True)):
        store.set(torch.arange(0, 300, 3), initial)
        heads.append(folder / f"{side}" / "c0")
        save(heads[side], {"t": store}, chunk_bytes=256)
    for k, (op, arg) in enumerate(ops, start=1):
        values = torch.randn(
            len(arg) if op == "set" else 0, DIM + STATE, generator=torch.Generator().manual_seed(k)
        )
        for side, (store, save) in enumerate(zip(stores, saves, strict=True)):
            store.clock.now += 1
            if op == "set":
                store.set(torch.tensor(arg), values)
            elif op == "delete":
                store.delete(torch.tensor(arg, dtype=torch.int64))
            elif op == "evict":
                store.evict(max_rows=arg)
            else:
                path = folder / f"{side}" / f"c{k}"
                save(path, {"t": store}, base=heads[side] if op == "delta" else None, chunk_bytes=64 * arg)
                heads[side] = path
    for side, (store, save) in enumerate(zip(stores, saves, strict=True)):
        save(folder / f"{side}" / "end", {"t": store}, base=heads[side], chunk_bytes=256, extra={"k": 1})
    for link in sorted(p.name for p in (folder / "0").iterdir()):
        assert same_files(folder / "0" / link, folder / "1" / link), link
    # each side loads the other's chain to the same rows
    for loader in (textbook.load_checkpoint, load_checkpoint):
        fresh = new_store("reference")
        loader(folder / "1" / "end", {"t": fresh})
        assert_same(stores[0], fresh)
    shutil.rmtree(folder)


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
def test_the_textbook_refuses_every_damaged_chain_with_the_same_error_class(chain, fault):
    from leanstate.reference import delta_checkpoint as textbook

    folder, _ = chain
    fault(folder)
    with pytest.raises(CheckpointError):
        textbook.load_checkpoint(folder / "d2", {"t": new_store()})
    with pytest.raises(CheckpointError):
        compact_checkpoint(folder / "d2", folder / "compacted")
    assert not (folder / "compacted").exists()


CHAIN_MEMORY_PROBE = """
import json, sys, torch
from leanstate.kv_store import KVStore
from leanstate.checkpoint import load_checkpoint

path, rows, dim, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
store = KVStore(dim, optimizer_state_dim=1)  # live: it holds the rows, so only the load's memory shows
for start in range(0, rows, 50_000):
    store.set(torch.arange(start, min(rows, start + 50_000)), torch.zeros(min(50_000, rows - start), dim))
base = reset_peak()
load_checkpoint(path, {"t": store}, chunk_bytes=chunk)
print(json.dumps({"extra": peak_since(base), "rows": len(store)}))
"""


def test_a_chain_loads_in_bounded_memory(tmp_path):
    """The issue's bound: at most 64 MiB and two slices per file beyond the store, whatever
    the table's size (here a quarter of the table is far more than that)."""
    from tests.harness import run_probe

    rows, dim, links, chunk = 400_000, 128, 10, 2 * 2**20
    store = KVStore(dim, optimizer_state_dim=1)
    generator = torch.Generator().manual_seed(0)
    for start in range(0, rows, 50_000):
        store.set(torch.arange(start, start + 50_000), torch.randn(50_000, dim, generator=generator))
    save_checkpoint(tmp_path / "c0", {"t": store})
    for k in range(1, links + 1):
        touched = torch.randint(0, rows, (rows // 100,), generator=generator)
        store.set(touched, torch.randn(len(touched), dim, generator=generator))
        store.delete(torch.randint(0, rows, (rows // 2000,), generator=generator))
        save_checkpoint(tmp_path / f"c{k}", {"t": store}, base=tmp_path / f"c{k - 1}")
    result = run_probe(CHAIN_MEMORY_PROBE, tmp_path / f"c{links}", rows, dim, chunk)
    files = 1 + 2 * links
    assert result["rows"] == rows  # the live store's rows: upserted, none removed
    assert result["extra"] <= 64 * 2**20 + 2 * chunk * files, result
    assert result["extra"] < rows * store.layout.row_bytes / 4, result


@pytest.mark.parametrize("backend", sorted(_backends.available("kv_store")))  # numba-cuda: in the simulator
def test_a_small_chain_round_trips_on_every_available_backend(tmp_path, backend):
    """Every registered store engine (numba-cuda in the CUDA simulator's own process):
    writes, deletes, an eviction and a training step between saves; the chain loads into
    this backend and the reference to the store's exact rows."""
    import leanstate

    bag = leanstate.KVEmbeddingBag(None, DIM, optimizer="adam", lr=0.05, backend=backend, clock=FakeClock(9))
    store = bag.store
    store.set(torch.arange(0, 60, 2), torch.ones(30, store.layout.value_width))
    save_checkpoint(tmp_path / "c0", bag.checkpoint_tables(), chunk_bytes=512)
    bag(torch.tensor([1, 4, 70, 4]), torch.tensor([0, 2])).sum().backward()
    store.delete(torch.tensor([6, 8, 99]))
    save_checkpoint(tmp_path / "c1", bag.checkpoint_tables(), base=tmp_path / "c0", chunk_bytes=512)
    store.evict(max_rows=25)
    store.set(torch.tensor([8]), torch.full((1, store.layout.value_width), 3.0))
    save_checkpoint(tmp_path / "c2", bag.checkpoint_tables(), base=tmp_path / "c1", chunk_bytes=512)
    for into in {backend, "reference"}:
        fresh = leanstate.KVEmbeddingBag(None, DIM, optimizer="adam", lr=0.05, backend=into)
        load_checkpoint(tmp_path / "c2", fresh.checkpoint_tables())
        assert torch.equal(fresh.store.keys().cpu(), store.keys().cpu())
        assert torch.equal(fresh.store.get_rows(store.keys()).cpu(), store.get_rows(store.keys()).cpu())


def test_a_cycle_below_the_head_is_named_a_cycle(chain):
    """d3 -> d2 -> d1 -> d2: the loop does not pass through the head."""
    folder, store = chain
    store.set(torch.tensor([5]), torch.ones(1, DIM + STATE))
    save_checkpoint(folder / "d3", {"t": store}, base=folder / "d2")

    def to_d2(manifest):
        manifest["base"] = {"path": "../d2", "manifest_sha256": digest_of(folder / "d2")}

    edit_manifest(folder / "d1", to_d2)
    d1 = digest_of(folder / "d1")
    edit_manifest(folder / "d2", lambda m: m["base"].update(manifest_sha256=d1))
    d2 = digest_of(folder / "d2")
    edit_manifest(folder / "d3", lambda m: m["base"].update(manifest_sha256=d2))
    with pytest.raises(CheckpointError, match="a cycle"):
        load_checkpoint(folder / "d3", {"t": new_store()})


def test_a_link_of_another_version_is_refused(chain, tmp_path):
    """A version-1 delta whose base was saved across ranks (version 2)."""
    folder, _ = chain
    sharded = KVStore(DIM, optimizer_state_dim=STATE, backend="reference")
    sharded.set(torch.arange(5), torch.zeros(5, DIM + STATE))
    from leanstate.checkpoint._bucketed_table import BucketedTable
    from tests.harness import one_rank_group

    with one_rank_group() as group:
        save_checkpoint(folder / "v2", {"t": BucketedTable(sharded, 4, None)}, process_group=group)
    edit_manifest(
        folder / "d1", lambda m: m["base"].update(path="../v2", manifest_sha256=digest_of(folder / "v2"))
    )
    d1 = digest_of(folder / "d1")
    edit_manifest(folder / "d2", lambda m: m["base"].update(manifest_sha256=d1))
    with pytest.raises(
        CheckpointError, match=r"saved across ranks \(version 2\), the chain .* by one process"
    ):
        load_checkpoint(folder / "d2", {"t": new_store()})


def test_links_of_different_layouts_are_refused_by_compaction_and_load(chain):
    folder, _ = chain

    def wider(manifest):  # a link of another layout, its rows file emptied to agree
        table = manifest["tables"]["t"]
        table.update(optimizer_state_dim=table["optimizer_state_dim"] + 4, width=table["width"] + 4)
        table.update(row_bytes=table["width"] * 4, rows=0, bytes=0, min_id=None, max_id=None, chunks=[])

    edit_manifest(folder / "d1", wider)
    (folder / "d1" / "t.rows").write_bytes(b"")
    d1 = digest_of(folder / "d1")
    edit_manifest(folder / "d2", lambda m: m["base"].update(manifest_sha256=d1))
    with pytest.raises(
        CheckpointError, match=r"table 't' in .*d1/manifest.json was saved as .*; its base as"
    ):
        compact_checkpoint(folder / "d2", folder / "compacted")
    with pytest.raises(CheckpointError, match="optimizer_state_dim"):
        load_checkpoint(folder / "d2", {"t": new_store()})
    wide = KVStore(DIM, optimizer_state_dim=STATE + 4, backend="reference")
    with pytest.raises(CheckpointError, match="optimizer_state_dim"):
        load_checkpoint(folder / "d2", {"t": wide})


def test_a_table_missing_from_a_single_checkpoint_names_what_it_has(chain):
    folder, _ = chain
    with pytest.raises(CheckpointError, match=r"table 'u' is not in checkpoint .*base \(it has: t\)"):
        load_checkpoint(folder / "base", {"u": new_store()})


def test_a_chain_counts_a_read_only_view_and_refuses_a_writable_partial_one(chain):
    from leanstate.reference.kv_tensor import KVTensor

    folder, store = chain
    state = KVTensor(store, width_offset=DIM, width=STATE, read_only=True)
    save_checkpoint(folder / "d3", {"t": store, "t.state": state}, base=folder / "d2")
    fresh = new_store()
    view = KVTensor(fresh, width_offset=DIM, width=STATE, read_only=True)
    load_checkpoint(folder / "d3", {"t": fresh, "t.state": view})
    assert view.ignored_writes == len(store)
    assert_same(store, fresh)
    with pytest.raises(ValueError, match="writable partial view"):
        load_checkpoint(folder / "d3", {"t.state": KVTensor(new_store(), width_offset=DIM, width=STATE)})


# -- what realistic bugs would change (each test names the bug it kills) -----------------------


@pytest.mark.parametrize("which", ["textbook", "hardened"])
def test_a_share_loaded_by_id_range_is_not_the_checkpoint_and_takes_no_delta(chain, which):
    """Kills: a load with ``id_range`` setting the store's change mark (a later delta of the
    share would be accepted against the whole checkpoint and load rows it never held)."""
    folder, _ = chain
    load = textbook.load_checkpoint if which == "textbook" else load_checkpoint
    save = textbook.save_checkpoint if which == "textbook" else save_checkpoint
    part = new_store()
    load(folder / "d2", {"t": part}, id_range=(50, 120))
    assert part.mark is None
    with pytest.raises(ValueError, match="full checkpoint first"):
        save(folder / "share-delta", {"t": part}, base=folder / "d2")
    assert not (folder / "share-delta").exists()


@pytest.mark.parametrize("pipelined", [True, False])
def test_an_id_deleted_while_a_delta_is_written_is_saved_as_removed(tmp_path, pipelined):
    """Version 1: an id listed as written, deleted after the first chunk was written and
    before its own chunk is read, is in the delta's removed ids, so the chain does not bring
    it back. Kills: the rows dropped while saving not added to the removed ids."""
    store = new_store()
    store.set(torch.arange(400), torch.zeros(400, DIM + STATE))
    save_checkpoint(tmp_path / "0", {"t": store})
    store.set(torch.arange(0, 400, 2), torch.ones(200, DIM + STATE))
    deleted = []

    def delete_late_id(table, done, total):
        if not deleted:
            store.delete(torch.tensor([398]))  # in the last chunk of the 200 written ids
            deleted.append(398)

    save_checkpoint(
        tmp_path / "1",
        {"t": store},
        base=tmp_path / "0",
        chunk_bytes=10 * store.layout.row_bytes,
        pipelined=pipelined,
        progress=delete_late_id,
    )
    removed = np.frombuffer((tmp_path / "1" / "t.removed").read_bytes(), dtype="<i8").tolist()
    assert deleted == [398] and removed == [398]
    fresh = new_store()
    load_checkpoint(tmp_path / "1", {"t": fresh})
    assert_same(store, fresh)
    assert not bool(fresh.contains(torch.tensor([398]))[0])


class WritesAfterItsSnapshot(KVStore):
    """A store a trainer writes to the moment a save has taken its changes: ``then`` (ids,
    weights) is set right after ``changes()`` answers, once."""

    then: tuple[torch.Tensor, torch.Tensor] | None = None

    def changes(self, since=None):
        found = super().changes(since)
        if self.then is not None:
            ids, rows = self.then
            self.then = None
            self.set(ids, rows)
        return found


def test_a_write_just_after_a_save_took_its_changes_is_in_the_next_delta(tmp_path):
    """A save ends the store's epoch before it asks for the changes: a row written after
    they were taken belongs to the next epoch, so the next delta holds it. Kills: the
    changes taken before the epoch ends (that write then falls in the epoch the mark
    closes, and no delta ever saves it)."""
    store = WritesAfterItsSnapshot(DIM, optimizer_state_dim=STATE, backend="reference", clock=FakeClock(100))
    store.set(torch.arange(10), torch.zeros(10, DIM))
    save_checkpoint(tmp_path / "0", {"t": store})
    store.set(torch.tensor([3]), torch.ones(1, DIM))
    store.then = (torch.tensor([7]), torch.full((1, DIM), 5.0))
    save_checkpoint(tmp_path / "1", {"t": store}, base=tmp_path / "0")
    assert store.then is None  # the write landed while the save ran
    save_checkpoint(tmp_path / "2", {"t": store}, base=tmp_path / "1")
    fresh = new_store()
    load_checkpoint(tmp_path / "2", {"t": fresh})
    assert_same(store, fresh)
    assert torch.equal(fresh.get(torch.tensor([7]))[:, :DIM], torch.full((1, DIM), 5.0))


@pytest.mark.parametrize("which", ["textbook", "hardened"])
def test_a_removed_id_repeated_across_a_slice_boundary_is_refused(chain, which):
    """Removed ids read 8 to a slice (``chunk_bytes=64``): ids 7 and 8 of the file equal, so
    the repeat lies exactly across the boundary. Kills: strict order checked within a slice
    only (a repeated removal passes, and a merge could count it twice)."""
    folder, _ = chain
    ids = [1000 + i for i in range(16)]
    ids[8] = ids[7]
    rewrite_removed(folder / "d2", ids)
    load = textbook.load_checkpoint if which == "textbook" else load_checkpoint
    with pytest.raises(CheckpointError, match="ascend"):
        load(folder / "d2", {"t": new_store()}, chunk_bytes=64)


def _spaced_checkpoint(folder: Path) -> Path:
    store = new_store()
    store.set(
        torch.arange(0, 600, 3), torch.randn(200, DIM + STATE, generator=torch.Generator().manual_seed(8))
    )
    save_checkpoint(folder / "c", {"t": store}, chunk_bytes=20 * store.layout.row_bytes)
    return folder / "c"


@pytest.mark.parametrize("field, shift", [("min_id", -1), ("max_id", 1)])
@pytest.mark.parametrize("into", ["empty numba", "live torch", "textbook"])
def test_a_chunk_whose_ids_are_not_its_manifest_range_is_refused(tmp_path, field, shift, into):
    """A middle chunk's ``min_id`` one below its first id (or ``max_id`` one above its last),
    still between its neighbours' (ids spaced by 3): only the content check R10 sees it.
    Kills: a chunk's first id (or last) no longer compared with the manifest."""
    path = _spaced_checkpoint(tmp_path)
    edit_manifest(
        path,
        lambda m: m["tables"]["t"]["chunks"][3].update({field: m["tables"]["t"]["chunks"][3][field] + shift}),
    )
    store = new_store(into.split()[-1] if into != "textbook" else "reference")
    if into.startswith("live"):
        store.set(torch.tensor([1, 2]), torch.ones(2, DIM + STATE))
    before = rows_of(store)
    load = textbook.load_checkpoint if into == "textbook" else load_checkpoint
    with pytest.raises(CheckpointError, match=r"chunk 3"):
        load(path, {"t": store})
    assert all(torch.equal(a, b) for a, b in zip(before, rows_of(store)))


@pytest.mark.parametrize("which", ["textbook", "hardened"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_store_named_under_two_tables_gets_both_and_no_mark(tmp_path, which, backend):
    """Tables ``a`` and ``b`` loaded into the one empty store: it holds both tables' rows,
    and it has no mark (it equals neither table). Kills: such a store counted as empty (the
    second table read in place over the first, or the mark set)."""
    a, b = new_store(), new_store()
    a.set(torch.arange(0, 50), torch.ones(50, DIM + STATE))
    b.set(torch.arange(100, 140), torch.full((40, DIM + STATE), 2.0))
    save_checkpoint(tmp_path / "c", {"a": a, "b": b})
    both = new_store(backend)
    load = textbook.load_checkpoint if which == "textbook" else load_checkpoint
    load(tmp_path / "c", {"a": both, "b": both})
    assert both.keys().tolist() == [*range(50), *range(100, 140)]
    assert torch.equal(both.get(torch.arange(100, 140)), b.get(torch.arange(100, 140)))
    assert both.mark is None
