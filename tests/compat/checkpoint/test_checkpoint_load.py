"""The one load pipeline of every format (``leanstate.checkpoint._load``), held to the
textbook: the textbook's checkpoint (``leanstate.reference.checkpoint``) loads into the
same rows, bit for bit, as version 1, as version 2 (resharded and saved on 1, 2 and 3
gloo ranks, loaded back at another world size) and as DCP (``leanstate.dcp.convert``),
into empty stores of every backend (numba's read in place, the others' ``set_rows``) and
into live ones (verify first); the same damage raises ``CheckpointError`` in every format
on every rank and leaves every store as it was; a failed in-place load leaves the numba
pool whole (no block lost, none handed out twice, every free block zero); tables applied
on two threads equal tables applied on one; and a DCP load into live stores finishes
its apply before Ctrl-C is raised.
"""

from __future__ import annotations

import contextlib
import functools
import json
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch
import torch.distributed as dist

import leanstate
import leanstate.dcp as kvdcp
from leanstate import CheckpointError, KVStore
from leanstate.accelerated.numba_kv_store import KVStoreEngine
from leanstate.checkpoint._bucketed_table import BucketedTable
from leanstate.dcp._state import MAX_ID, MIN_ID, OFFSET
from leanstate.reference import checkpoint as reference
from leanstate.reference.sharding import bucket_owner
from tests.harness import FakeClock, rewrite_dcp_item, run_world

BACKENDS = ("numba", "torch", "reference")
# name -> (dim, state dim, dtype, first id): both rows 48 bytes, so one chunk_bytes cuts
# both into chunks of CHUNK_ROWS rows; "b" has a padded weight (10 of 12 columns).
SPECS = {"a": (4, 1, torch.float32, 0), "b": (10, 4, torch.bfloat16, 1)}
CHUNK_ROWS = 10
# Ids first, first + 2, ... below 240: chunk k holds the ids of bucket k (id // 20), so at
# 1, 2 and 3 ranks (12 buckets) every chunk is one rank's and the DCP load reads in place.
BUCKETS, BUCKET_SIZE = 12, 20
# The rows a live store holds before a load: some saved (of one table or the other), some not.
LIVE_IDS = torch.tensor([0, 1, 38, 39, 150, 151, 236, 237])
DAMAGED = "a"  # the table whose middle chunk (or file) is damaged
DAMAGE = ("flipped byte", "truncated file", "ids back inside a chunk", "ids back across chunks")
FORMATS = ("v1", "v2", "dcp")


def new_store(name: str, backend: str, live: bool, keep=None) -> KVStore:
    """An empty store of table ``name``, or a live one holding ``LIVE_IDS`` (those ``keep``
    selects); a fixed clock, so every backend writes the same headers."""
    dim, state, dtype, _ = SPECS[name]
    store = KVStore(dim, optimizer_state_dim=state, dtype=dtype, backend=backend, clock=FakeClock(5))
    if live:
        ids = LIVE_IDS if keep is None else LIVE_IDS[keep(LIVE_IDS)]
        store.set(ids, torch.full((len(ids), dim), -1.5, dtype=dtype))
    return store


def textbook_store(name: str) -> KVStore:
    dim, state, dtype, first = SPECS[name]
    store = KVStore(dim, optimizer_state_dim=state, dtype=dtype, backend="reference", clock=FakeClock(11))
    ids = torch.arange(first, 240, 2)
    generator = torch.Generator().manual_seed(first)
    store.set(ids, torch.randn(len(ids), dim, generator=generator).to(dtype))
    state_values = torch.randn(len(ids), state, generator=generator).to(dtype)
    store.set(ids, state_values, width_offset=store.layout.padded_dim)
    return store


def snapshot(store) -> tuple[torch.Tensor, torch.Tensor]:
    keys = store.keys()
    return keys, store.get_rows(keys).view(torch.uint8).clone()


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@functools.cache
def textbook_rows(folder: str, name: str, live: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Table ``name`` of the version-1 checkpoint as the textbook loads it into a reference
    store, empty or live."""
    store = new_store(name, "reference", live)
    reference.load_checkpoint(Path(folder, "v1"), {name: store})
    return snapshot(store)


def owned_rows(folder: str, name: str, live: bool, rank: int, world: int):
    """The textbook's rows that rank ``rank`` of ``world`` owns."""
    keys, rows = textbook_rows(folder, name, live)
    mine = owned_by(rank, world)(keys)
    return keys[mine], rows[mine]


def pool_problems(store: KVStore) -> list[str]:
    """What is wrong with a numba store's pool: every block handed out must be either a live
    row's or on the free list, exactly once, and every free block (and the next ones not
    yet handed out) zero."""
    if store.backend != "numba":
        return []
    engine = store.engine
    free = engine.free[: engine.free_top].astype(np.int64)
    live = engine.locate(store.keys()).numpy()
    blocks = np.sort(np.concatenate([free, live]))
    ahead = engine.words[engine.handed_out : engine.handed_out + 4 * CHUNK_ROWS * BUCKETS]
    checks = {
        "a block lost or handed out twice": np.array_equal(blocks, np.arange(engine.handed_out)),
        "a free block holds stale bytes": not engine.words[free].any(),
        "a block past the handed-out ones holds stale bytes": not ahead.any(),
    }
    return [problem for problem, ok in checks.items() if not ok]


def assert_pool_whole(store: KVStore) -> None:
    problems = pool_problems(store)
    assert not problems, problems


def _refuse_staging(self, rows):
    raise AssertionError("a load into an empty numba store went through set_rows, not in place")


@contextlib.contextmanager
def in_place_only(on: bool):
    """While ``on``, a numba store's ``set_rows`` fails: the load must read in place."""
    saved = KVStoreEngine.write_rows
    if on:
        KVStoreEngine.write_rows = _refuse_staging
    try:
        yield
    finally:
        KVStoreEngine.write_rows = saved


# -- damage: the same faults in every format ---------------------------------------------------


def _damage_native(path: Path, fmt: str, kind: str) -> None:
    """``kind`` in the middle chunk of table ``DAMAGED`` (version 2: of rank 0's file)."""
    manifest = json.loads((path / "manifest.json").read_text())
    table = manifest["tables"][DAMAGED]
    part = table if fmt == "v1" else table["files"][0]
    row_bytes, chunks, file = table["row_bytes"], part["chunks"], path / part["file"]
    k = len(chunks) // 2
    chunk = chunks[k]
    start, end = chunk["offset"], chunk["offset"] + chunk["rows"] * row_bytes
    data = bytearray(file.read_bytes())
    if kind == "flipped byte":
        data[start + 3 * row_bytes + 20] ^= 0x10
    elif kind == "truncated file":
        del data[start + 3 * row_bytes + 5 :]
    elif kind == "ids back inside a chunk":  # rows 3 and 4 swapped: the id range stays
        third = bytes(data[start + 3 * row_bytes : start + 4 * row_bytes])
        data[start + 3 * row_bytes : start + 4 * row_bytes] = data[
            start + 4 * row_bytes : start + 5 * row_bytes
        ]
        data[start + 4 * row_bytes : start + 5 * row_bytes] = third
    else:  # the chunk's first row takes the id the chunk before it ended on
        data[start : start + 8] = data[start - row_bytes : start - row_bytes + 8]
        chunk["min_id"] = chunks[k - 1]["max_id"]
    if kind.startswith("ids"):  # every chunk sound on its own: only the order rules can tell
        chunk["crc"] = crc32c.crc32c(bytes(data[start:end]))
    file.write_bytes(bytes(data))
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))


def _damage_dcp(path: Path, kind: str) -> None:
    """``kind`` in the middle chunk of table ``DAMAGED``: its rows item, its stored CRC and
    the chunk index in ``.metadata`` rewritten to match where the kind says so."""
    metadata = kvdcp.SafeFileSystemReader(path).read_metadata()
    chunks = metadata.planner_data[kvdcp.INDEX_KEY]["tables"][DAMAGED]["chunks"]
    k = len(chunks) // 2
    item = f"{DAMAGED}/rows"
    if kind == "truncated file":
        info = next(
            v
            for key, v in metadata.storage_data.items()
            if key.fqn == item and key.offset[0] == chunks[k][OFFSET]
        )
        file = path / info.relative_path
        file.write_bytes(file.read_bytes()[: info.offset + info.length // 2])
        return
    crcs = []

    def edit(rows: torch.Tensor) -> torch.Tensor:
        if kind == "flipped byte":
            rows[3, 20] ^= 0x10
            return rows
        if kind == "ids back inside a chunk":
            rows[[3, 4]] = rows[[4, 3]]
        else:
            rows[0, :8] = torch.tensor([chunks[k - 1][MAX_ID]]).view(torch.uint8)
        crcs.append(crc32c.crc32c(rows.numpy().tobytes()))
        return rows

    rewrite_dcp_item(path, item, chunks[k][OFFSET], edit)
    if crcs:
        rewrite_dcp_item(
            path, f"{DAMAGED}/crc", 0, lambda saved: saved.index_fill_(0, torch.tensor([k]), crcs[0])
        )
    if kind == "ids back across chunks":
        chunks[k][MIN_ID] = chunks[k - 1][MAX_ID]
        (path / ".metadata").write_bytes(pickle.dumps(metadata))


def damaged(folder: Path, source: str, fmt: str, kind: str) -> Path:
    """A copy of checkpoint ``source`` of format ``fmt`` with damage ``kind``."""
    path = folder / f"bad-{fmt}-{kind.replace(' ', '-')}"
    shutil.copytree(folder / source, path)
    if fmt == "dcp":
        _damage_dcp(path, kind)
    else:
        _damage_native(path, fmt, kind)
    return path


# -- across ranks ---------------------------------------------------------------------------


def owned_by(rank: int, world: int):
    """Which of some ids rank ``rank`` of ``world`` owns."""
    return lambda ids: (
        bucket_owner(ids, world_size=world, total_num_buckets=BUCKETS, bucket_size=BUCKET_SIZE) == rank
    )


def bucketed(name: str, backend: str, live: bool, rank: int, world: int) -> BucketedTable:
    """Table ``name`` as rank ``rank`` holds it: empty, or live with the ``LIVE_IDS`` it owns."""
    return BucketedTable(new_store(name, backend, live, owned_by(rank, world)), BUCKETS, BUCKET_SIZE)


def _load(fmt: str, path: Path, tables: dict, group) -> None:
    if fmt == "dcp":
        kvdcp.load(dict(tables), checkpoint_id=path, process_group=group)
    else:
        assert leanstate.load_checkpoint(path, tables, process_group=group) == {"step": 7}


def _loads_the_textbooks_rows(fmt: str, path: Path, rank: int, world: int, folder: str) -> dict:
    """Load ``path`` into empty and live tables of every backend; each must hold the rows of
    the textbook's that this rank owns, and empty numba tables read them in place (but from
    version 1 on several ranks, whose chunks hold every rank's rows). The empty numba
    tables, loaded.

    A rank's problems are raised once every load (each a collective) has run on it, so a
    rank that finds one does not leave the others waiting."""
    kept, problems = {}, []
    for backend in BACKENDS:
        for live in (False, True):
            tables = {name: bucketed(name, backend, live, rank, world) for name in SPECS}
            with in_place_only(backend == "numba" and not live and (fmt != "v1" or world == 1)):
                _load(fmt, path, tables, dist.group.WORLD)
            for name, table in tables.items():
                what = f"{fmt} {backend} {'live' if live else 'empty'} {name!r}"
                if not same(snapshot(table.store), owned_rows(folder, name, live, rank, world)):
                    problems.append(f"{what}: rows differ from the textbook's")
                problems += [f"{what}: {problem}" for problem in pool_problems(table.store)]
            if backend == "numba" and not live:
                kept = tables
    assert not problems, "\n".join(problems)
    return kept


def reshard(rank, world, folder):
    """The textbook's version-1 checkpoint loaded across this world (each rank keeps what it
    owns) and saved as version 2 from the numba tables it was loaded into."""
    tables = _loads_the_textbooks_rows("v1", Path(folder, "v1"), rank, world, folder)
    leanstate.save_checkpoint(
        Path(folder, f"v2-{world}"), tables, extra={"step": 7}, process_group=dist.group.WORLD
    )


def v2_from(saved: int):
    def scenario(rank, world, folder):
        _loads_the_textbooks_rows("v2", Path(folder, f"v2-{saved}"), rank, world, folder)

    return scenario


def dcp(rank, world, folder):
    _loads_the_textbooks_rows("dcp", Path(folder, "dcp"), rank, world, folder)


def refused(fmt: str, kind: str):
    """The damaged copy is refused on every rank, whichever rank reads the bad chunk, and no
    store changes: empty ones stay empty (their pools whole), live ones keep their rows."""

    def scenario(rank, world, folder):
        path = Path(folder, f"bad-{fmt}-{kind.replace(' ', '-')}")
        problems = []  # raised once every load (a collective) has run on this rank
        for backend in BACKENDS:
            for live in (False, True):
                what = f"{backend} {'live' if live else 'empty'}"
                tables = {name: bucketed(name, backend, live, rank, world) for name in SPECS}
                before = {name: snapshot(table.store) for name, table in tables.items()}
                try:
                    _load(fmt, path, tables, dist.group.WORLD)
                    problems.append(f"{what}: loaded without an error")
                except CheckpointError:
                    pass
                for name, table in tables.items():
                    if not same(snapshot(table.store), before[name]):
                        problems.append(f"{what} {name!r}: the store changed")
                    problems += [f"{what} {name!r}: {problem}" for problem in pool_problems(table.store)]
        assert not problems, "\n".join(problems)

    return scenario


SCENARIOS = {
    "reshard": reshard,
    "v2-from-1": v2_from(1),
    "v2-from-3": v2_from(3),
    "dcp": dcp,
    **{f"refused {fmt} {kind}": refused(fmt, kind) for fmt in FORMATS for kind in DAMAGE},
}
REFUSED = [f"refused {fmt} {kind}" for fmt in FORMATS for kind in DAMAGE]
RUNS = [  # in order: each world loads what an earlier one saved (1 -> 3 -> 2; 2 -> one process below)
    (3, ["reshard", "v2-from-1", "dcp", *REFUSED]),
    (2, ["reshard", "v2-from-3", "dcp", *REFUSED]),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The textbook's checkpoint as version 1, DCP and version 2 saved at 1 (a gloo group of
    this process alone), 3 and 2 ranks, damaged copies of each, and the outcome of every
    scenario across ranks."""
    folder = tmp_path_factory.mktemp("load")
    reference.save_checkpoint(
        folder / "v1",
        {name: textbook_store(name) for name in SPECS},
        extra={"step": 7},
        chunk_bytes=CHUNK_ROWS * 48,
    )
    kvdcp.convert(folder / "v1", folder / "dcp")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        reshard(0, 1, str(folder))
    finally:
        dist.destroy_process_group()
    for fmt, source in (("v1", "v1"), ("v2", "v2-1"), ("dcp", "dcp")):
        for kind in DAMAGE:
            damaged(folder, source, fmt, kind)
    return folder, [(world, run_world(world, folder, __name__, names)) for world, names in RUNS]


CASES = [
    pytest.param(i, name, id=f"world{world}-{name}")
    for i, (world, names) in enumerate(RUNS)
    for name in names
]


@pytest.mark.parametrize("index, scenario", CASES)
def test_across_ranks(checkpoints, index, scenario):
    failures = checkpoints[1][index][1][scenario]
    assert not failures, "\n".join(failures)


# -- in one process -----------------------------------------------------------------------------


def _load_plain(fmt: str, path: Path, stores: dict) -> None:
    """One process, plain stores: version 2 takes every rank's rows."""
    if fmt == "dcp":
        kvdcp.load(dict(stores), checkpoint_id=path)
    else:
        assert leanstate.load_checkpoint(path, stores) == {"step": 7}


PLAIN_SOURCES = {"v1": "v1", "v2": "v2-2", "dcp": "dcp"}


@pytest.mark.parametrize("live", [False, True], ids=["empty", "live"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_loads_the_textbooks_rows_in_one_process(checkpoints, fmt, backend, live):
    """Version 1, version 2 saved by two ranks, and DCP, into plain stores: the textbook's
    rows, bit for bit; an empty numba store reads them in place (never ``set_rows``)."""
    folder = checkpoints[0]
    stores = {name: new_store(name, backend, live) for name in SPECS}
    with in_place_only(backend == "numba" and not live):
        _load_plain(fmt, folder / PLAIN_SOURCES[fmt], stores)
    for name, store in stores.items():
        assert same(snapshot(store), textbook_rows(str(folder), name, live)), name
        assert_pool_whole(store)


@pytest.mark.parametrize("fmt, kind", [(f, k) for f in FORMATS for k in DAMAGE])
def test_every_format_refuses_the_same_damage_in_one_process(checkpoints, fmt, kind):
    """The damaged copy, into empty and live plain stores of every backend: a
    ``CheckpointError`` (the textbook's class for the version-1 copy), and no store changes."""
    folder = checkpoints[0]
    path = folder / f"bad-{fmt}-{kind.replace(' ', '-')}"
    if fmt == "v1":
        with pytest.raises(CheckpointError):
            reference.load_checkpoint(path, {name: new_store(name, "reference", False) for name in SPECS})
    for backend in BACKENDS:
        for live in (False, True):
            stores = {name: new_store(name, backend, live) for name in SPECS}
            before = {name: snapshot(store) for name, store in stores.items()}
            with pytest.raises(CheckpointError):
                _load_plain(fmt, path, stores)
            for name, store in stores.items():
                assert same(snapshot(store), before[name]), (backend, live, name)
                assert_pool_whole(store)


@pytest.mark.parametrize("before", ["a new store", "a store whose rows were all deleted"])
@pytest.mark.parametrize("fmt", ["v2", "dcp"])
def test_a_failed_in_place_load_leaves_the_pool_clean(checkpoints, tmp_path, fmt, before):
    """A flipped byte in a middle chunk, loaded in place into an empty numba store: refused,
    the store empty and its pool whole (the blocks claimed but never adopted given back,
    zeroed); then inserts, an in-place load of the sound checkpoint and inserts again give
    exactly what a reference store given the same calls holds."""
    folder = checkpoints[0]
    shutil.copytree(folder / PLAIN_SOURCES[fmt], tmp_path / "c")
    bad = tmp_path / "bad"
    shutil.copytree(folder / PLAIN_SOURCES[fmt], bad)
    if fmt == "dcp":
        _damage_dcp(bad, "flipped byte")
    else:
        _damage_native(bad, fmt, "flipped byte")
    twins = [{name: new_store(name, b, False) for name in SPECS} for b in ("numba", "reference")]
    for stores in twins:
        if before != "a new store":
            for store in stores.values():
                store.set(LIVE_IDS, torch.ones(len(LIVE_IDS), store.layout.dim, dtype=store.layout.dtype))
                store.delete(store.keys())
        with pytest.raises(CheckpointError, match="chunk"), in_place_only(True):
            _load_plain(fmt, bad, stores)
        assert all(len(store) == 0 for store in stores.values())
    for store in twins[0].values():
        assert_pool_whole(store)
    inserted = torch.arange(0, 300, 3)  # ids of the load's and new ones, past the claimed blocks
    for stores in twins:
        for store in stores.values():
            store.set(inserted, torch.ones(len(inserted), 2, dtype=store.layout.dtype), width_offset=1)
    for name in SPECS:
        assert same(snapshot(twins[0][name]), snapshot(twins[1][name])), name
        assert_pool_whole(twins[0][name])
    for stores in twins:  # in place again, into stores with a free list
        for store in stores.values():
            store.delete(store.keys())
        with in_place_only(True):
            _load_plain(fmt, tmp_path / "c", stores)
    for name in SPECS:
        assert same(snapshot(twins[0][name]), textbook_rows(str(folder), name, False)), name
        assert_pool_whole(twins[0][name])
    for stores in twins:
        for store in stores.values():
            store.set(inserted + 1, torch.ones(len(inserted), 2, dtype=store.layout.dtype), width_offset=1)
    for name in SPECS:
        assert same(snapshot(twins[0][name]), snapshot(twins[1][name])), name
        assert_pool_whole(twins[0][name])


# -- three tables on one thread and on two --------------------------------------------------

THREE = {"x": (4, 1, torch.float32), "y": (5, 3, torch.bfloat16), "z": (12, 4, torch.float16)}


@pytest.fixture
def threads():
    """``torch.set_num_threads``, restored after the test."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def three_store(name: str, backend: str, live: bool) -> KVStore:
    dim, state, dtype = THREE[name]
    store = KVStore(dim, optimizer_state_dim=state, dtype=dtype, backend=backend, clock=FakeClock(5))
    if live:
        store.set(LIVE_IDS * 5, torch.full((len(LIVE_IDS), dim), 2.5, dtype=dtype))
    return store


def save_three(folder: Path) -> Path:
    """A version-1 checkpoint of three tables, each of several chunks, by the textbook."""
    stores = {}
    for i, (name, (dim, state, dtype)) in enumerate(THREE.items()):
        store = KVStore(dim, optimizer_state_dim=state, dtype=dtype, backend="reference", clock=FakeClock(3))
        generator = torch.Generator().manual_seed(i)
        ids = torch.randperm(1200, generator=generator)[: 120 + 30 * i]
        store.set(ids, torch.randn(len(ids), dim, generator=generator).to(dtype))
        stores[name] = store
    return reference.save_checkpoint(folder / "three", stores, chunk_bytes=500)


def _thread_of(seen: set, *progress) -> None:
    seen.add(threading.current_thread().name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_tables_applied_on_two_threads_equal_one_thread_and_the_textbook(tmp_path, threads, backend):
    path = save_three(tmp_path)
    for live in (False, True):
        want = {}
        for name in THREE:
            store = three_store(name, "reference", live)
            reference.load_checkpoint(path, {name: store})
            want[name] = snapshot(store)
        for count in (1, 2):
            threads(count)
            stores = {name: three_store(name, backend, live) for name in THREE}
            seen = set()
            leanstate.load_checkpoint(path, stores, progress=functools.partial(_thread_of, seen))
            in_place = not live and all(store.rows_in_place() is not None for store in stores.values())
            if count == 1 or not in_place:  # upserts run one table after another
                assert seen == {threading.main_thread().name}, seen
            else:  # tables read in place: their steps ran on the pool
                assert seen and all(name.startswith("leanstate-load") for name in seen), seen
            for name, store in stores.items():
                assert same(snapshot(store), want[name]), (count, live, name)
                assert_pool_whole(store)


@pytest.mark.parametrize("live", [False, True], ids=["empty", "live"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_chunk_in_the_second_of_three_tables_undoes_all_three(tmp_path, threads, backend, live):
    """Tables applied on two threads, a flipped byte in the middle chunk of the second: into
    empty stores the others are applied and emptied again; into live ones nothing moves."""
    path = save_three(tmp_path)
    table = json.loads((path / "manifest.json").read_text())["tables"]["y"]
    chunk = table["chunks"][len(table["chunks"]) // 2]
    data = bytearray((path / "y.rows").read_bytes())
    data[chunk["offset"] + 20] ^= 0x10
    (path / "y.rows").write_bytes(bytes(data))
    threads(2)
    stores = {name: three_store(name, backend, live) for name in THREE}
    before = {name: snapshot(store) for name, store in stores.items()}
    with pytest.raises(CheckpointError, match="y.rows"):
        leanstate.load_checkpoint(path, stores)
    for name, store in stores.items():
        assert same(snapshot(store), before[name]), name
        assert_pool_whole(store)


# -- Ctrl-C --------------------------------------------------------------------------------------

INTERRUPTED = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    import leanstate.dcp as kvdcp
    from leanstate import CheckpointError, KVStore

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where the parent ignores SIGINT
    calls = []

    class Interrupted(KVStore):
        def set_rows(self, rows):
            calls.append(len(rows))
            if len(calls) == 2:  # Ctrl-C while the second chunk is applied
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # the main thread, reading the next chunks, takes the signal now
            super().set_rows(rows)

    for mode in ("live", "empty"):
        calls.clear()
        store = Interrupted(8, optimizer_state_dim=1, backend="torch")
        if mode == "live":
            store.set(torch.arange(500), torch.zeros(500, 8))  # a store that already holds rows
        try:
            kvdcp.load({"t": store}, checkpoint_id=sys.argv[1])
            outcome = "none"
        except KeyboardInterrupt:
            outcome = "KeyboardInterrupt"
        except CheckpointError:
            outcome = "CheckpointError"
        print(mode, outcome, len(store), len(calls))
    """
)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Ctrl-C during a DCP load (in a process of its own) into a live store and an empty one
    (both applied through ``set_rows``): mode -> (what was raised, rows, chunks applied), and
    the chunks of the checkpoint."""
    source = KVStore(8, optimizer_state_dim=1, backend="reference")
    source.set(torch.arange(4000), torch.ones(4000, 8))
    path = kvdcp.save({"t": source}, checkpoint_id=tmp_path_factory.mktemp("ctrl-c") / "c", chunk_bytes=4096)
    index = kvdcp.SafeFileSystemReader(path).read_metadata().planner_data[kvdcp.INDEX_KEY]
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED, str(path)], capture_output=True, text=True, timeout=300
    )
    outcomes = {}
    for line in done.stdout.splitlines():
        mode, raised, rows, calls = line.split()
        outcomes[mode] = (raised, int(rows), int(calls))
    assert outcomes.keys() == {"live", "empty"}, done.stdout + done.stderr
    return outcomes, len(index["tables"]["t"]["chunks"])


def test_ctrl_c_during_a_dcp_load_into_a_live_store_is_raised_once_every_chunk_is_applied(interrupted):
    """Into a live store rows are applied only after every chunk was verified, and the
    apply is not stopped half-way (a half-applied live store could not be restored):
    every chunk applied, 4000 rows (not 500 and a part), then ``KeyboardInterrupt``."""
    outcomes, chunks = interrupted
    assert outcomes["live"] == ("KeyboardInterrupt", 4000, chunks) and chunks > 2, outcomes


def test_ctrl_c_during_a_dcp_load_into_an_empty_store_empties_it_and_is_raised(interrupted):
    """Into an empty store rows are applied as they are read: Ctrl-C stops the load, the
    store is emptied again, and the interrupt reaches the caller as ``KeyboardInterrupt``
    (as ``load_checkpoint``'s does), not as a damaged checkpoint."""
    outcomes, chunks = interrupted
    raised, rows, calls = outcomes["empty"]
    assert rows == 0 and 2 <= calls < chunks, outcomes
    assert raised == "KeyboardInterrupt", outcomes
