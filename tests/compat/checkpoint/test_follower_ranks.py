"""``leanstate.Follower`` across ranks (``spec/follower.md``, F8): a chain saved across ranks
at one world size is followed at another, each rank holding exactly the saved union's rows
of the buckets it owns; a stale delta is refused on every rank and changes no store.

This process saves chain ``s1`` at world 1 and follows ``s2``; two spawned ranks follow
``s1`` (1 -> 2) and save ``s2`` (followed here 2 -> 1, with a group and into plain stores).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import leanstate
from leanstate import (
    CheckpointError,
    KVEmbeddingBagCollection,
    ShardedKVEmbeddingBagCollection,
    load_checkpoint,
    save_checkpoint,
)
from tests.compat.sharded_models import G, configs, local_batch, upstream
from tests.harness import one_rank_group, run_world

DELTAS = 2
CHUNK = 5 * 48  # a few rows a chunk: each rank file has several


def build() -> ShardedKVEmbeddingBagCollection:
    return ShardedKVEmbeddingBagCollection(configs(), clock=lambda: 1000)


def digest(path: Path) -> str:
    return hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()


def rows_of(store) -> tuple[torch.Tensor, torch.Tensor]:
    keys = store.keys()
    return keys, store.get_rows(keys).view(torch.uint8).clone()


def _train(module, step: int, rank: int, world: int) -> None:
    b = G // world
    out = module(local_batch(step, rank, world))
    (out.values() * upstream(step)[rank * b : (rank + 1) * b]).sum().backward()


def save_chain(rank: int, world: int, folder: Path, name: str) -> list[Path]:
    """A full checkpoint and ``DELTAS`` deltas of training (and a deleted row each) at this
    world size under ``folder/name``; the union of every rank's stores in ``expected.pt``."""
    group = dist.group.WORLD
    module, links, step = build(), [], 0
    for k in range(DELTAS + 1):
        for _ in range(2):
            _train(module, step, rank, world)
            step += 1
        for table in module.checkpoint_tables().values():
            keys = table.store.keys()
            table.store.delete(keys[k : k + 1])
        path = folder / name / f"link-{k}"
        save_checkpoint(
            path,
            module.checkpoint_tables(),
            process_group=group,
            chunk_bytes=CHUNK,
            base=links[-1] if links else None,
        )
        links.append(path)
    everyone = [None] * world
    mine = {name: rows_of(table.store) for name, table in module.checkpoint_tables().items()}
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        expected = {}
        for table in everyone[0]:
            keys = torch.cat([part[table][0] for part in everyone])
            rows = torch.cat([part[table][1] for part in everyone])
            order = torch.argsort(keys)
            expected[table] = (keys[order], rows[order])
        torch.save(expected, folder / f"{name}-expected.pt")
    dist.barrier()
    return links


def assert_union(stores: dict, folder: Path, name: str, rank: int, world: int, owner) -> None:
    """``stores`` (table name -> store) hold exactly the union's rows of what ``rank`` owns."""
    expected = torch.load(folder / f"{name}-expected.pt", weights_only=True)
    for table_name, store in stores.items():
        keys, rows = expected[table_name]
        mine = owner(table_name, keys) == rank
        got_keys, got_rows = rows_of(store)
        assert torch.equal(got_keys, keys[mine]), f"{table_name}: rank {rank} holds other ids"
        assert torch.equal(got_rows, rows[mine]), f"{table_name}: rank {rank}'s rows differ"


def follow_here(rank: int, world: int, folder: Path, name: str) -> None:
    """A fresh module follows chain ``name`` at this world size: every link, then nothing."""
    module = build()
    tables = module.checkpoint_tables()
    follower = leanstate.Follower(folder / name, tables, process_group=dist.group.WORLD)
    links = sorted((folder / name).glob("link-*"))
    assert follower.poll() == links
    stores = {table_name: table.store for table_name, table in tables.items()}
    assert_union(stores, folder, name, rank, world, lambda t, keys: tables[t].owner(keys, world))
    for table in tables.values():
        assert table.store.mark.checkpoint == digest(links[-1])
    assert follower.poll() == []
    return follower, module


# -- scenarios of the spawned ranks ----------------------------------------------------------


def follow_s1(rank, world, folder):
    folder = Path(folder)
    follower, module = follow_here(rank, world, folder, "s1")
    before = {name: rows_of(table.store) for name, table in module.checkpoint_tables().items()}
    old = build()  # a trainer at this world size resumed from the chain's middle link
    load_checkpoint(folder / "s1" / "link-1", old.checkpoint_tables(), process_group=dist.group.WORLD)
    _train(old, 100, rank, world)
    stale = folder / "s1" / "stale"
    save_checkpoint(
        stale, old.checkpoint_tables(), process_group=dist.group.WORLD, base=folder / "s1" / "link-1"
    )
    with pytest.raises(CheckpointError, match="stale"):
        follower.poll()
    assert digest(stale) in follower.refused
    for name, table in module.checkpoint_tables().items():  # every rank refused it: nothing applied
        keys, rows = rows_of(table.store)
        assert torch.equal(keys, before[name][0]) and torch.equal(rows, before[name][1])
    # a follower made again over the same module resumes where the marks are, on every rank
    again = leanstate.Follower(folder / "s1", module.checkpoint_tables(), process_group=dist.group.WORLD)
    assert again.position == folder / "s1" / f"link-{DELTAS}"
    assert f"rank={rank} of {world}" in repr(again) and "link-2" in repr(again)


def save_s2(rank, world, folder):
    save_chain(rank, world, Path(folder), "s2")


SCENARIOS = {"follow-s1": follow_s1, "save-s2": save_s2}


# -- this process: world 1 ---------------------------------------------------------------


@pytest.fixture(scope="module")
def group():
    with one_rank_group() as group:
        yield group


@pytest.fixture(scope="module")
def folder(tmp_path_factory, group):
    folder = tmp_path_factory.mktemp("follower-ranks")
    save_chain(0, 1, folder, "s1")
    return folder


@pytest.fixture(scope="module")
def world2(folder):
    return run_world(2, folder, __name__, ["follow-s1", "save-s2"])


@pytest.mark.parametrize("scenario", ["follow-s1", "save-s2"])
def test_two_ranks(world2, scenario):
    failures = world2[scenario]
    assert not failures, "\n".join(failures)


def test_a_chain_saved_at_two_ranks_is_followed_at_one(world2, folder, group):
    assert not world2["save-s2"]
    follow_here(0, 1, folder, "s2")


def test_a_chain_saved_across_ranks_is_followed_into_plain_stores(world2, folder):
    assert not world2["save-s2"]
    plain = KVEmbeddingBagCollection(configs(), clock=lambda: 1000)
    tables = plain.checkpoint_tables()
    follower = leanstate.Follower(folder / "s2", tables)
    assert follower.poll() == sorted((folder / "s2").glob("link-*"))
    stores = {
        name: plain.embedding_bags[name.removesuffix(".weight")].store for name in tables if ".weight" in name
    }
    assert_union(stores, folder, "s2", 0, 1, lambda t, keys: torch.zeros_like(keys))
