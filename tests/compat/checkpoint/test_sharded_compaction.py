"""Compaction of a chain saved across ranks (version 2): the merge written as one full
version-2 checkpoint at the head's world size, byte for byte what a full save at that
world size writes from the stores the chain was saved from.

Two gloo ranks save a full checkpoint and deltas (training, writes, deletes and an
eviction between saves), then, from the same stores, a full checkpoint; this process
compacts the chain and compares file by file, loads the result at world 1, continues the
chain at world 1 (links of two world sizes) and damages links.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from leanstate import (
    CheckpointError,
    KVEmbeddingBagCollection,
    ShardedKVEmbeddingBagCollection,
    compact_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tests.compat.sharded_models import G, configs, local_batch, upstream
from tests.harness import one_rank_group, run_world

CHUNK = 5 * 48  # five rows of the exact table a chunk: a bucket holds several chunks
BUCKETS = 4  # the exact table's 64 ids in buckets of 16, the hashed table's interleaved
EXTRA = {"step": 7, "note": "compacted"}


def build() -> ShardedKVEmbeddingBagCollection:
    return ShardedKVEmbeddingBagCollection(configs(), clock=lambda: 1000, total_num_buckets=BUCKETS)


def union(module, rank: int, world: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """Every rank's rows of each table, gathered, ascending by id (on rank 0; else None)."""
    mine = {}
    for name, table in module.checkpoint_tables().items():
        keys = table.store.keys()
        mine[name] = (keys, table.store.get_rows(keys).view(torch.uint8).clone())
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    out = {}
    for name in mine:
        keys = torch.cat([part[name][0] for part in everyone])
        rows = torch.cat([part[name][1] for part in everyone])
        order = torch.argsort(keys)
        out[name] = (keys[order], rows[order])
    return out


def _operate(op: str, module, step: int, rank: int, world: int, data: torch.Generator) -> None:
    if op == "train":  # a collective: every rank
        b = G // world
        out = module(local_batch(step, rank, world))
        (out.values() * upstream(step)[rank * b : (rank + 1) * b]).sum().backward()
        return
    for name, table in module.checkpoint_tables().items():
        store = table.store
        if op == "set":
            upper = 64 if name.startswith("exact") else 2**40
            ids = torch.unique(torch.randint(0, upper, (8,), generator=data))
            ids = ids[table.owner(ids, world) == rank]
            width = store.layout.width - store.layout.header_elems
            store.set(ids, torch.randn(len(ids), width, generator=data).to(store.layout.dtype))
        elif op == "delete":
            keys = store.keys()
            store.delete(keys[torch.randperm(len(keys), generator=data)[: max(1, len(keys) // 4)]])
        elif op == "evict":
            store.evict(max_rows=max(0, len(store) - 2))


OPS = [["train", "set", "delete"], ["evict", "train", "delete"], ["set", "train", "set", "delete"]]


def save_chain(rank, world, folder):
    """c0, deltas d1..d3, then ``full``: a full save of the stores d3 was saved from."""
    folder, group = Path(folder) / "chain", dist.group.WORLD
    module = build()
    data = torch.Generator().manual_seed(100 + rank)
    for step in range(2):
        _operate("train", module, step, rank, world, data)
    base = folder / "c0"
    save_checkpoint(base, module.checkpoint_tables(), process_group=group, chunk_bytes=CHUNK)
    step = 2
    for k, ops in enumerate(OPS, start=1):
        for op in ops:
            _operate(op, module, step, rank, world, data)
            step += 1
        path = folder / f"d{k}"
        save_checkpoint(
            path, module.checkpoint_tables(), process_group=group, chunk_bytes=CHUNK, base=base, extra=EXTRA
        )
        base = path
    save_checkpoint(
        folder / "full", module.checkpoint_tables(), process_group=group, chunk_bytes=CHUNK, extra=EXTRA
    )
    expected = union(module, rank, world)
    if rank == 0:
        torch.save(expected, folder / "expected.pt")


SCENARIOS = {"save": save_chain}


@pytest.fixture(scope="module")
def group():
    with one_rank_group() as group:
        yield group


@pytest.fixture(scope="module")
def chain(tmp_path_factory, group) -> Path:
    folder = tmp_path_factory.mktemp("sharded-compaction")
    failures = run_world(2, folder, __name__, ["save"])["save"]
    assert not failures, "\n".join(failures)
    return folder / "chain"


def assert_same_files(got: Path, want: Path) -> None:
    names = sorted(p.name for p in want.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    for name in names:
        assert (got / name).read_bytes() == (want / name).read_bytes(), name


def assert_holds(module, expected) -> None:
    for name, table in module.checkpoint_tables().items():
        keys = table.store.keys()
        assert torch.equal(keys, expected[name][0]), name
        assert torch.equal(table.store.get_rows(keys).view(torch.uint8), expected[name][1]), name


def test_the_compaction_is_the_full_save_file_by_file(chain, tmp_path):
    manifest = json.loads((chain / "d3" / "manifest.json").read_text())
    assert manifest["format"] == "leanstate-whole-row-delta" and manifest["world_size"] == 2
    assert any(e["removed"]["ids"] for t in manifest["tables"].values() for e in t["files"])
    compact_checkpoint(chain / "d3", tmp_path / "compacted", chunk_bytes=CHUNK)
    assert_same_files(tmp_path / "compacted", chain / "full")
    full = json.loads((chain / "full" / "manifest.json").read_text())
    assert full["world_size"] == 2 and len(full["tables"]["exact.weight"]["files"]) == 2
    chunks = [c for f in full["tables"]["exact.weight"]["files"] for c in f["chunks"]]
    buckets = [c["bucket"] for c in chunks]  # buckets cut into several chunks, some of them short
    assert len(buckets) > len(set(buckets)) == BUCKETS and {c["rows"] for c in chunks} > {5}


def test_the_command_line_compacts_it_and_it_loads_at_another_world_size(chain, tmp_path, group, capsys):
    from leanstate._tools.cli import main

    out = tmp_path / "compacted"
    assert main(["compact", str(chain / "d3"), str(out), "--chunk-bytes", str(CHUNK)]) == 0
    assert "one full checkpoint" in capsys.readouterr().out
    assert_same_files(out, chain / "full")
    expected = torch.load(chain / "expected.pt", weights_only=True)
    module = build()
    extra = load_checkpoint(out, module.checkpoint_tables(), process_group=group)
    assert extra.items() >= EXTRA.items()  # beside the module's own: each table's optimizer step
    assert module.extra_state() == {name: extra[name] for name in module.extra_state()}
    assert_holds(module, expected)
    plain = KVEmbeddingBagCollection(configs(), clock=lambda: 1000)
    load_checkpoint(out, plain.checkpoint_tables())
    for name, (keys, rows) in expected.items():
        store = plain.embedding_bags[name.removesuffix(".weight")].store
        assert torch.equal(store.keys(), keys) and torch.equal(store.get_rows(keys).view(torch.uint8), rows)


def test_a_chain_of_two_world_sizes_compacts_at_its_heads(chain, tmp_path, group):
    """Loaded at world 1 and continued there: the chain's links were saved at 2 ranks and
    at 1; it compacts into one rank file per table, as a full save at world 1 writes."""
    module = build()
    load_checkpoint(chain / "d3", module.checkpoint_tables(), process_group=group)
    data = torch.Generator().manual_seed(5)
    for step, op in enumerate(["train", "set", "delete", "evict"]):
        _operate(op, module, 20 + step, 0, 1, data)
    head = tmp_path / "d4"
    save_checkpoint(
        head, module.checkpoint_tables(), process_group=group, base=chain / "d3", chunk_bytes=CHUNK
    )
    save_checkpoint(tmp_path / "full", module.checkpoint_tables(), process_group=group, chunk_bytes=CHUNK)
    compact_checkpoint(head, tmp_path / "compacted", chunk_bytes=CHUNK)
    assert_same_files(tmp_path / "compacted", tmp_path / "full")
    assert json.loads((tmp_path / "compacted" / "manifest.json").read_text())["world_size"] == 1


def _relink(copy: Path, link: str) -> None:
    """After ``link``'s manifest changed: each delta above it names the new digest."""
    links = ["c0", "d1", "d2", "d3"]
    for below, above in zip(links[links.index(link) :], links[links.index(link) + 1 :], strict=False):
        digest = hashlib.sha256((copy / below / "manifest.json").read_bytes()).hexdigest()
        file = copy / above / "manifest.json"
        manifest = json.loads(file.read_text())
        manifest["base"]["manifest_sha256"] = digest
        file.write_text(json.dumps(manifest, indent=1))


def _corrupt_removed(copy: Path) -> None:
    for link in ["d1", "d2", "d3"]:
        manifest = json.loads((copy / link / "manifest.json").read_text())
        entry = next(f["removed"] for f in manifest["tables"]["exact.weight"]["files"] if f["rank"] == 1)
        if entry["ids"]:
            file = copy / link / entry["file"]
            data = bytearray(file.read_bytes())
            data[-3] ^= 0x10
            file.write_bytes(bytes(data))
            return
    raise AssertionError("no delta removed an id of exact.weight on rank 1")


def _corrupt_rows(copy: Path) -> None:
    file = copy / "c0" / "hashed.weight.rank0.rows"
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x08
    file.write_bytes(bytes(data))


def _other_bucketing(copy: Path) -> None:
    file = copy / "c0" / "manifest.json"
    manifest = json.loads(file.read_text())
    manifest["tables"]["hashed.weight"]["bucketing"]["buckets"] *= 2
    file.write_text(json.dumps(manifest, indent=1))
    _relink(copy, "c0")


DAMAGE = {
    "corrupt-removed": (_corrupt_removed, r"d\d/exact\.weight\.rank1\.removed fails its crc32c check"),
    "corrupt-rows": (_corrupt_rows, r"c0/hashed\.weight\.rank0\.rows .*checksum mismatch"),
    "other-bucketing": (
        _other_bucketing,
        r"c0/manifest\.json: saved with .*every link of a chain has one bucketing",
    ),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_link_fails_the_compaction_and_writes_nothing(chain, tmp_path, kind):
    damage, pattern = DAMAGE[kind]
    copy = tmp_path / "chain"
    shutil.copytree(chain, copy)
    damage(copy)
    with pytest.raises(CheckpointError, match=pattern):
        compact_checkpoint(copy / "d3", tmp_path / "compacted", chunk_bytes=CHUNK)
    assert not (tmp_path / "compacted").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain"]  # no staging directory left
