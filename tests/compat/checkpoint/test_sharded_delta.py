"""Delta checkpoints across ranks (version 2): a random history of training steps, direct
writes, deletes and evictions, saved as a full checkpoint and deltas at world size W,
loads at W' (W' != W included) as the union of the saving ranks' stores, bit for bit.

World 1 runs in this process (a gloo group of one); worlds 3 and 2 are spawned, in that
order, each loading what the worlds before it saved. Each chain compacts into a full
checkpoint of the union. Damaged chains (a missing or
replaced base, a corrupt removed-ids file of one rank, a cycle) fail on every rank and
change no store, empty or live.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import crc32c
import pytest
import torch
import torch.distributed as dist

from leanstate import (
    CheckpointError,
    KVEmbeddingBagCollection,
    ShardedKVEmbeddingBagCollection,
    load_checkpoint,
    save_checkpoint,
)
from leanstate.reference.kv_store import ChangeMark
from tests.compat.sharded_models import G, configs, global_batch, local_batch, upstream
from tests.harness import files_opened, one_rank_group, run_world

DELTAS = 3  # each history: a full checkpoint c0, then deltas d1..d3
HEAD = f"d{DELTAS}"
CHUNK = 5 * 48  # a few rows a chunk: chunks span buckets' rows and files hold several


def build() -> ShardedKVEmbeddingBagCollection:
    return ShardedKVEmbeddingBagCollection(configs(), clock=lambda: 1000)


def digest(path: Path) -> str:
    return hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()


def rows_of(store) -> tuple[torch.Tensor, torch.Tensor]:
    keys = store.keys()
    return keys, store.get_rows(keys).view(torch.uint8).clone()


def snapshot(module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: rows_of(table.store) for name, table in module.checkpoint_tables().items()}


# -- a random history ---------------------------------------------------------------------


def _train(module, step: int, rank: int, world: int) -> None:
    b = G // world
    out = module(local_batch(step, rank, world))
    (out.values() * upstream(step)[rank * b : (rank + 1) * b]).sum().backward()


def _owned(table, ids: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return ids[table.owner(ids, world) == rank]


def _operate(op: str, module, step: int, rank: int, world: int, data: torch.Generator) -> None:
    """One operation on every rank (``train`` is a collective; the rest are this rank's own)."""
    if op == "train":
        _train(module, step, rank, world)
        return
    for name, table in module.checkpoint_tables().items():
        store = table.store
        if op == "set":
            upper = 64 if name.startswith("exact") else 2**40  # the hashed table: any id
            ids = torch.unique(torch.randint(0, upper, (6,), generator=data))
            ids = _owned(table, ids, rank, world)
            width = store.layout.width - store.layout.header_elems
            store.set(ids, torch.randn(len(ids), width, generator=data).to(store.layout.dtype))
        elif op == "delete":
            keys = store.keys()
            pick = torch.randperm(len(keys), generator=data)[: max(1, len(keys) // 4)]
            store.delete(torch.cat([keys[pick], torch.tensor([2**50 + 7])]))  # one absent id too
        elif op == "evict":
            store.evict(max_rows=max(0, len(store) - 2))


def history(rank: int, world: int, folder: Path, name: str, module=None, base: Path | None = None) -> Path:
    """A random history saved as ``folder/name``: a full checkpoint ``c0`` (or, with
    ``base``, deltas on top of it) and deltas ``d1..``; every rank's stores at the head
    gathered into ``expected.pt``. The operations are drawn alike on every rank, their
    data per rank."""
    group = dist.group.WORLD
    module = module or build()
    choose = random.Random(f"{name}-{world}")
    data = torch.Generator().manual_seed(1000 * world + rank)
    step = 0
    if base is None:
        for step in range(2):
            _train(module, step, rank, world)
        base = folder / name / "c0"
        save_checkpoint(base, module.checkpoint_tables(), process_group=group, chunk_bytes=CHUNK)
        assert all(t.store.mark.checkpoint == digest(base) for t in module.checkpoint_tables().values())
    for k in range(1, DELTAS + 1):
        ops = ["train", "set", "evict", "delete", *choose.choices(["train", "set", "delete", "evict"], k=2)]
        choose.shuffle(ops)
        for op in [*ops, "delete"]:  # every rank's delta removes something
            step += 1
            _operate(op, module, step, rank, world, data)
        path = folder / name / f"d{k}"
        save_checkpoint(path, module.checkpoint_tables(), process_group=group, chunk_bytes=CHUNK, base=base)
        for table in module.checkpoint_tables().values():
            assert table.store.mark.checkpoint == digest(path)
        base = path
    everyone = [None] * world
    dist.all_gather_object(everyone, snapshot(module))
    if rank == 0:
        expected = {}
        for table in everyone[0]:
            keys = torch.cat([part[table][0] for part in everyone])
            rows = torch.cat([part[table][1] for part in everyone])
            order = torch.argsort(keys)
            expected[table] = (keys[order], rows[order])
        torch.save(expected, folder / name / "expected.pt")
    dist.barrier()
    return base


def assert_loaded(module, folder: Path, name: str, head: str, rank: int, world: int, before=None) -> None:
    """This rank's stores hold exactly the saved union's rows of the buckets it owns (with
    ``before``, a live load: its own other rows stay, the chain's replace theirs; the
    marks are checked by the caller)."""
    expected = torch.load(folder / name / "expected.pt", weights_only=True)
    for table_name, table in module.checkpoint_tables().items():
        keys, rows = expected[table_name]
        mine = table.owner(keys, world) == rank
        keys, rows = keys[mine], rows[mine]
        if before is not None:
            own_keys, own_rows = before[table_name]
            kept = ~torch.isin(own_keys, keys)
            keys = torch.cat([keys, own_keys[kept]])
            rows = torch.cat([rows, own_rows[kept]])
            order = torch.argsort(keys)
            keys, rows = keys[order], rows[order]
        got_keys, got_rows = rows_of(table.store)
        assert torch.equal(got_keys, keys), f"{table_name}: rank {rank} holds other ids"
        assert torch.equal(got_rows, rows), f"{table_name}: rank {rank}'s rows differ"
        if before is None:
            mark = table.store.mark
            assert mark is not None and mark.checkpoint == digest(folder / name / head), mark


def load_at(name: str, head: str = HEAD):
    """Load chain ``name`` into a fresh module at this world size; it must be the union."""

    def scenario(rank, world, folder):
        module = build()
        load_checkpoint(Path(folder, name, head), module.checkpoint_tables(), process_group=dist.group.WORLD)
        assert_loaded(module, Path(folder), name, head, rank, world)

    return scenario


def save(name: str):
    def scenario(rank, world, folder):
        history(rank, world, Path(folder), name)

    return scenario


# -- scenarios ------------------------------------------------------------------------------


def load_into_live_stores(rank, world, folder):
    """Into trained stores: every link verified, then the chain's merge upserted; a row the
    chain removed but the store holds stays (the chain loads as its compaction would)."""
    module = build()
    data = torch.Generator().manual_seed(7 + rank)
    for step, op in enumerate(["train", "set", "train"]):
        _operate(op, module, 50 + step, rank, world, data)
    tables = module.checkpoint_tables()
    tables["exact.weight"].store.mark = ChangeMark(tables["exact.weight"].store.next_epoch(), "ab" * 32)
    marks = {name: table.store.mark for name, table in tables.items()}
    before = snapshot(module)
    load_checkpoint(Path(folder, "s1", HEAD), tables, process_group=dist.group.WORLD)
    assert_loaded(module, Path(folder), "s1", HEAD, rank, world, before=before)
    # not the checkpoint: each mark stays (every row the load wrote is a change since it)
    assert {name: table.store.mark for name, table in tables.items()} == marks


def continue_at_another_world(rank, world, folder):
    """A chain saved at 3 ranks, loaded at 2 into empty stores, then continued there: the
    deltas at 2 ranks stack on the links of 3 ranks (loaded at 1 by the test process)."""
    module = build()
    head = Path(folder, "s3", HEAD)
    load_checkpoint(head, module.checkpoint_tables(), process_group=dist.group.WORLD)
    assert_loaded(module, Path(folder), "s3", HEAD, rank, world)
    history(rank, world, Path(folder), "s3x2", module=module, base=head)


def _damaged(folder: Path, kind: str) -> Path:
    """A copy of chain ``s2`` damaged as ``kind`` says (made by rank 0); its head."""
    source, copy = folder / "s2", folder / f"broken-{kind}"
    if kind == "missing-base":
        shutil.copytree(source / HEAD, copy / HEAD)  # its base ../d2 is not beside it
    else:
        shutil.copytree(source, copy)
    if kind == "replaced-base":  # the same manifest, other bytes: another digest
        manifest = copy / "d1" / "manifest.json"
        manifest.write_text(json.dumps(json.loads(manifest.read_text()), indent=2))
    elif kind == "corrupt-removed":  # rank 1's removed ids of a delta, one byte flipped
        for link in [f"d{k}" for k in range(1, DELTAS + 1)]:
            manifest = json.loads((copy / link / "manifest.json").read_text())
            entry = next(f["removed"] for f in manifest["tables"]["exact.weight"]["files"] if f["rank"] == 1)
            if entry["ids"]:
                file = copy / link / entry["file"]
                data = bytearray(file.read_bytes())
                data[-3] ^= 0x10
                file.write_bytes(bytes(data))
                break
        else:
            raise AssertionError("no delta of s2 removed an id on rank 1")
    elif kind == "cycle":  # the head's base is the head (no digest names the head's manifest)
        manifest = json.loads((copy / HEAD / "manifest.json").read_text())
        manifest["base"]["path"] = f"../{HEAD}"
        (copy / HEAD / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return copy / HEAD


FAULTS = {
    "missing-base": "is missing",
    "replaced-base": "was replaced",
    "corrupt-removed": r"exact\.weight\.rank1\.removed fails its crc32c check",
    "cycle": "a cycle",
}


def damaged_chains_change_no_store(rank, world, folder):
    """Each damaged chain raises on every rank, into empty stores and into live ones, and
    no store changes anywhere."""
    folder = Path(folder)
    if rank == 0:
        for kind in FAULTS:
            _damaged(folder, kind)
    dist.barrier()
    heads = {kind: folder / f"broken-{kind}" / HEAD for kind in FAULTS}
    live = build()
    _train(live, 60, rank, world)
    for kind, pattern in FAULTS.items():
        for module in (build(), live):
            before = snapshot(module)
            with pytest.raises(CheckpointError, match=pattern):
                load_checkpoint(heads[kind], module.checkpoint_tables(), process_group=dist.group.WORLD)
            after = snapshot(module)
            for table, (keys, rows) in before.items():
                assert torch.equal(after[table][0], keys) and torch.equal(after[table][1], rows), (
                    kind,
                    table,
                )


def a_delta_needs_its_base_on_every_rank(rank, world, folder):
    """A delta whose base is not where every rank's stores stand is refused on every rank,
    naming the rank and table and saying to save a full checkpoint; nothing is written."""
    folder = Path(folder)
    module = build()
    _train(module, 0, rank, world)
    base = folder / "refuse" / "c0"
    save_checkpoint(base, module.checkpoint_tables(), process_group=dist.group.WORLD)
    _train(module, 1, rank, world)
    if rank == 1:  # this rank's store was loaded live, say: it equals no checkpoint
        module.checkpoint_tables()["hashed.weight"].store.mark = None
    with pytest.raises(ValueError, match=r"rank 1: tables\['hashed.weight'\].*save a full checkpoint first"):
        save_checkpoint(
            folder / "refuse" / "d1", module.checkpoint_tables(), process_group=dist.group.WORLD, base=base
        )
    other = ShardedKVEmbeddingBagCollection(configs(), clock=lambda: 1000, total_num_buckets=32)
    for table in other.checkpoint_tables().values():
        table.store.mark = module.checkpoint_tables()["exact.weight"].store.mark
    with pytest.raises(
        ValueError, match=r"rank 0: tables\['exact.weight'\] does not match its base.*buckets"
    ):
        save_checkpoint(
            folder / "refuse" / "d1", other.checkpoint_tables(), process_group=dist.group.WORLD, base=base
        )
    dist.barrier()
    assert not (folder / "refuse" / "d1").exists()


def a_version_1_chain_loads_across_ranks(rank, world, folder):
    """A chain saved by one process (version 1) loads with process_group too: each rank
    reads every chunk and removed id and applies those of the buckets it owns."""
    folder = Path(folder) / "v1-chain"
    single = KVEmbeddingBagCollection(configs(), clock=lambda: 1000)  # the same on every rank
    for step in range(2):
        single(global_batch(step)).values().mul(upstream(step)).sum().backward()
    if rank == 0:
        save_checkpoint(folder / "c0", single.checkpoint_tables())
    for step in range(2, 4):
        single(global_batch(step)).values().mul(upstream(step)).sum().backward()
    for bag in single.embedding_bags.values():
        bag.store.delete(bag.store.keys()[::3])
    if rank == 0:
        save_checkpoint(folder / "d1", single.checkpoint_tables(), base=folder / "c0")
    dist.barrier()
    module = build()
    load_checkpoint(folder / "d1", module.checkpoint_tables(), process_group=dist.group.WORLD)
    for name, table in module.checkpoint_tables().items():
        full = single.embedding_bags[name.removesuffix(".weight")].store
        keys = full.keys()
        keys = keys[table.owner(keys, world) == rank]
        assert torch.equal(table.store.keys(), keys), name
        assert torch.equal(rows_of(table.store)[1], full.get_rows(keys).view(torch.uint8)), name


SCENARIOS = {
    "save-s3": save("s3"),
    "save-s2": save("s2"),
    "load-s1": load_at("s1"),
    "load-s2": load_at("s2"),
    "load-s3": load_at("s3"),
    "live": load_into_live_stores,
    "continue": continue_at_another_world,
    "damaged": damaged_chains_change_no_store,
    "refused": a_delta_needs_its_base_on_every_rank,
    "version-1": a_version_1_chain_loads_across_ranks,
}
RUNS = [  # in order, after this process saved s1 at world 1
    (3, ["save-s3", "load-s1", "load-s3", "live"]),
    (2, ["save-s2", "load-s1", "continue", "damaged", "refused", "version-1"]),
]


# -- the test process: world 1 ------------------------------------------------------------


@pytest.fixture(scope="module")
def group():
    with one_rank_group() as group:
        yield group


@pytest.fixture(scope="module")
def folder(tmp_path_factory, group):
    folder = tmp_path_factory.mktemp("sharded-delta")
    history(0, 1, folder, "s1")
    return folder


@pytest.fixture(scope="module")
def runs(folder):
    return [run_world(world, folder, __name__, names) for world, names in RUNS]


CASES = [(i, world, name) for i, (world, names) in enumerate(RUNS) for name in names]


@pytest.mark.parametrize("index, world, scenario", CASES, ids=[f"world{w}-{n}" for _, w, n in CASES])
def test_across_ranks(runs, index, world, scenario):
    failures = runs[index][scenario]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", ["s1", "s2", "s3", "s3x2"])
def test_a_chain_loads_at_world_1_and_into_plain_stores(runs, folder, name):
    """At one rank every link's every file is read; into a plain collection (no process
    group) too: both are the union of the saving ranks' stores."""
    head = HEAD
    module = build()
    load_checkpoint(folder / name / head, module.checkpoint_tables(), process_group=dist.group.WORLD)
    assert_loaded(module, folder, name, head, 0, 1)
    plain = KVEmbeddingBagCollection(configs(), clock=lambda: 1000)
    load_checkpoint(folder / name / head, plain.checkpoint_tables())
    expected = torch.load(folder / name / "expected.pt", weights_only=True)
    for table in expected:  # "<table>.weight": the bag's store (the optimizer state inside)
        keys, rows = rows_of(plain.embedding_bags[table.removesuffix(".weight")].store)
        assert torch.equal(keys, expected[table][0]) and torch.equal(rows, expected[table][1]), table


def test_a_chain_load_reads_each_links_manifest_once(runs, folder, group):
    """Across ranks (here one) and into plain stores alike: the head's manifest, read to
    learn the version, is not read again for the chain."""
    links = sorted(["c0", *(f"d{k}" for k in range(1, DELTAS + 1))])
    for tables, process_group in [
        (build().checkpoint_tables(), group),
        (KVEmbeddingBagCollection(configs(), clock=lambda: 1000).checkpoint_tables(), None),
    ]:
        with files_opened() as opened:
            load_checkpoint(folder / "s1" / HEAD, tables, process_group=process_group)
        assert sorted(Path(p).parent.name for p in opened if Path(p).name == "manifest.json") == links


def test_a_chain_loads_statistics_count_every_links_chunks_once(runs, folder):
    """Into empty stores (the full link loaded, the deltas merged on top) and into the same
    stores again, live (every link merged): the figures are the apply pass's, each chunk of
    every link once. Kills: the merge's chunks left uncounted."""
    from leanstate import last_load_stats

    files = [
        file
        for link in ["c0", *(f"d{k}" for k in range(1, DELTAS + 1))]
        for table in json.loads((folder / "s1" / link / "manifest.json").read_text())["tables"].values()
        for file in table["files"]
    ]
    expected = {
        "bytes_read": sum(f["bytes"] for f in files),
        "chunks_read": sum(len(f["chunks"]) for f in files),
    }
    assert expected["chunks_read"] > len(files) > DELTAS  # several links, files of several chunks
    plain = KVEmbeddingBagCollection(configs(), clock=lambda: 1000)
    for into in ("empty", "live"):
        load_checkpoint(folder / "s1" / HEAD, plain.checkpoint_tables())
        got = {key: last_load_stats[key] for key in expected}
        assert got == expected, into


def test_the_manifest_layout(folder):
    """The delta's manifest: the version-2 table entry, each file with its rank and removed
    ids (bucket-major: min_id/max_id are the file's first and last), the base relative."""
    manifest = json.loads((folder / "s1" / "d1" / "manifest.json").read_text())
    assert list(manifest) == ["format", "version", "world_size", "base", "tables", "extra"]
    assert (manifest["format"], manifest["version"], manifest["world_size"]) == (
        "leanstate-whole-row-delta",
        2,
        1,
    )
    assert manifest["base"] == {"path": "../c0", "manifest_sha256": digest(folder / "s1" / "c0")}
    entry = manifest["tables"]["hashed.weight"]
    assert entry["bucketing"] == {"buckets": 1024, "bucket_size": None}
    (file,) = entry["files"]
    assert list(file) == ["file", "bytes", "chunks", "rank", "removed"] and file["rank"] == 0
    removed = file["removed"]
    data = (folder / "s1" / "d1" / removed["file"]).read_bytes()
    ids = torch.frombuffer(bytearray(data), dtype=torch.int64)
    assert removed["file"] == "hashed.weight.rank0.removed" and removed["ids"] == len(ids) > 0
    assert (removed["min_id"], removed["max_id"], removed["crc"]) == (
        int(ids[0]),
        int(ids[-1]),
        crc32c.crc32c(data),
    )
    buckets = ids % 1024
    assert bool(((buckets[1:] > buckets[:-1]) | ((buckets[1:] == buckets[:-1]) & (ids[1:] > ids[:-1]))).all())


@pytest.mark.parametrize(
    "change, key",
    [
        (lambda m, f: f["removed"].update(file="other.removed"), r"files\[0\]\.removed\.file"),
        (lambda m, f: f["removed"].update(bytes=f["removed"]["bytes"] + 8), r"files\[0\]\.removed\.bytes"),
        (lambda m, f: f.pop("rank"), r"files\[0\]\.rank"),
        (lambda m, f: m.pop("base"), "'base' is missing"),
        (lambda m, f: m.update(version=3), "version 3"),
    ],
)
def test_a_bad_delta_manifest_names_the_key(folder, tmp_path, change, key):
    copy = tmp_path / "s1"
    shutil.copytree(folder / "s1", copy)
    file = copy / "d1" / "manifest.json"
    manifest = json.loads(file.read_text())
    change(manifest, manifest["tables"]["exact.weight"]["files"][0])
    file.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=rf"d1/manifest.json: .*{key}"):
        load_checkpoint(copy / HEAD, KVEmbeddingBagCollection(configs()).checkpoint_tables())


def test_a_version_1_base_is_refused(folder, tmp_path, group):
    module = build()
    one = tmp_path / "v1"
    save_checkpoint(one, KVEmbeddingBagCollection(configs()).checkpoint_tables())
    with pytest.raises(ValueError, match="version 1.*save a full checkpoint with process_group first"):
        save_checkpoint(tmp_path / "d", module.checkpoint_tables(), process_group=group, base=one)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("name", ["s1", "s2", "s3", "s3x2"])
def test_a_chain_compacts_to_a_full_checkpoint_of_its_union(runs, folder, tmp_path, group, name):
    """At the head's world size (s3x2: links of 3 ranks and of 2, compacted at 2); loaded
    at world 1 it is the union (byte identity: tests/compat/checkpoint/test_sharded_compaction.py)."""
    from leanstate import compact_checkpoint

    out = compact_checkpoint(folder / name / HEAD, tmp_path / "full", chunk_bytes=CHUNK)
    manifest = json.loads((out / "manifest.json").read_text())
    head = json.loads((folder / name / HEAD / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"]) == ("leanstate-whole-row", 2)
    assert manifest["world_size"] == head["world_size"] == len(manifest["tables"]["exact.weight"]["files"])
    module = build()
    load_checkpoint(out, module.checkpoint_tables(), process_group=group)
    expected = torch.load(folder / name / "expected.pt", weights_only=True)
    for table_name, table in module.checkpoint_tables().items():
        assert torch.equal(rows_of(table.store)[0], expected[table_name][0]), table_name
        assert torch.equal(rows_of(table.store)[1], expected[table_name][1]), table_name


def test_inspect_shows_and_verifies_a_chain_saved_across_ranks(runs, folder, tmp_path, capsys):
    from leanstate._tools.cli import main

    assert main(["inspect", str(folder / "s3x2" / HEAD)]) == 0
    out = capsys.readouterr().out
    assert (
        f"a delta chain of {2 * DELTAS + 1} links" in out
        and "in 3 rank files" in out
        and "in 2 rank files" in out
    )
    assert f"OK: {2 * DELTAS + 1} links verified" in out
    copy = tmp_path / "s2"
    shutil.copytree(folder / "s2", copy)
    file = copy / "d2" / "hashed.weight.rank0.rows"
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x08
    file.write_bytes(bytes(data))
    assert main(["inspect", str(copy / HEAD)]) == 1
    out = capsys.readouterr().out
    assert "BAD: link 1" in out and "hashed.weight.rank0.rows" in out and "checksum mismatch" in out


def test_a_row_deleted_while_saving_is_a_removed_id(tmp_path, group):
    """A written id whose row is gone by the time the save reads it is not a row of the
    delta but one of its removed ids, in (bucket, id) order with the others."""
    from leanstate import KVStore
    from leanstate.checkpoint._bucketed_table import BucketedTable

    class DeletingStore(KVStore):
        victim = None

        def get_rows(self, ids, *, out=None):
            if self.victim is not None:
                self.delete(torch.tensor([self.victim]))
                self.victim = None
            return super().get_rows(ids, out=out)

    store = DeletingStore(4, clock=lambda: 5)
    store.set(torch.arange(0, 40), torch.ones(40, 4))
    tables = {"t": BucketedTable(store, 4, None)}
    save_checkpoint(tmp_path / "c0", tables, process_group=group)
    store.set(torch.tensor([5, 6, 9]), torch.full((3, 4), 2.0))
    store.delete(torch.tensor([3, 12]))
    store.victim = 6
    save_checkpoint(tmp_path / "d1", tables, process_group=group, base=tmp_path / "c0")
    (entry,) = json.loads((tmp_path / "d1" / "manifest.json").read_text())["tables"]["t"]["files"]
    assert [(c["bucket"], c["min_id"], c["max_id"]) for c in entry["chunks"]] == [(1, 5, 9)]  # 6 dropped
    removed = torch.frombuffer(
        bytearray((tmp_path / "d1" / "t.rank0.removed").read_bytes()), dtype=torch.int64
    )
    assert removed.tolist() == [12, 6, 3]  # buckets (id % 4) 0, 2, 3
    assert (entry["removed"]["min_id"], entry["removed"]["max_id"]) == (12, 3)  # first and last
    fresh = KVStore(4)
    load_checkpoint(tmp_path / "d1", {"t": fresh})
    assert torch.equal(fresh.keys(), store.keys()) and torch.equal(
        fresh.get_rows(store.keys()), store.get_rows(store.keys())
    )
