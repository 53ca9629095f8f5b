"""What version 2 and DCP need of ``torch.distributed`` (``leanstate.checkpoint._ranks``), on
a subgroup of a larger world: the group's own ranks, its rank 0 and its members only, never
the default group's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from leanstate import KVStore, load_checkpoint, save_checkpoint
from leanstate.checkpoint._ranks import all_true, broadcast, from_every_rank, group_rank, staged_by_rank_0
from leanstate.checkpoint.core import BucketedTable
from leanstate.reference.checkpoint import CheckpointError
from tests.harness import FailingRows, run_world


def on_a_subgroup(rank: int, world: int, folder: str) -> None:
    sub = dist.new_group([1, 2])  # every rank takes part in creating it
    if rank == 0:
        return
    assert group_rank(sub) == (rank - 1, 2)
    assert broadcast(f"from {rank}", sub) == "from 1"  # the subgroup's rank 0 is global rank 1
    assert all_true(True, sub) and not all_true(rank == 1, sub)
    assert from_every_rank(rank * 10, sub) == [10, 20]
    target = Path(folder, "ckpt")
    with staged_by_rank_0(target, "save_checkpoint", sub, lambda: target) as staging:
        assert staging.parent == target.parent and staging.exists()
        seen = from_every_rank(str(staging), sub)  # both ranks are inside the block now
        # only rank 0 made one (kills: every rank preparing and staging a directory of its own)
        assert len([p for p in target.parent.glob(".ckpt.saving-*") if p.suffix != ".lock"]) == 1
    assert seen[0] == seen[1]

    def refuse() -> Path:
        raise ValueError("no room")

    with pytest.raises(CheckpointError, match=r"rank 0: ValueError: no room; .*ckpt is unchanged"):
        with staged_by_rank_0(target, "save_checkpoint", sub, refuse):
            pass


def saves_on_a_subgroup(rank: int, world: int, folder: str) -> None:
    """A version-2 checkpoint and its delta saved by the subgroup [1, 2] (of 3 ranks) and
    loaded back by it: a checkpoint of 2 ranks, rank 0 taking no part; a save that fails
    on the group's rank 1 fails on both. Kills: the ranks' file entries gathered to global
    rank 0, or over the default group; the group's rank 0 raising before it tells the
    others the outcome."""
    sub = dist.new_group([1, 2])
    if rank == 0:
        return
    store = KVStore(4, optimizer_state_dim=1, seed=rank)
    ids = torch.arange(40)
    mine = ids[BucketedTable(store, 4, None).owner(ids, 2) == rank - 1]
    store.set(mine, torch.full((len(mine), 4), float(rank)))
    first, second = Path(folder, "sub-0"), Path(folder, "sub-1")
    save_checkpoint(first, {"t": BucketedTable(store, 4, None)}, process_group=sub)
    store.set(mine[:3], torch.full((3, 4), 9.0))
    save_checkpoint(second, {"t": BucketedTable(store, 4, None)}, process_group=sub, base=first)
    manifest = json.loads((second / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and [f["rank"] for f in manifest["tables"]["t"]["files"]] == [0, 1]
    fresh = KVStore(4, optimizer_state_dim=1)
    load_checkpoint(second, {"t": BucketedTable(fresh, 4, None)}, process_group=sub)
    keys = store.keys().sort().values
    assert torch.equal(fresh.keys().sort().values, keys)
    assert torch.equal(fresh.get_rows(keys), store.get_rows(keys))
    failing = FailingRows(4, optimizer_state_dim=1) if rank == 2 else store
    failing.set(mine[:2], torch.ones(2, 4))
    with pytest.raises(
        CheckpointError, match=r"the save across ranks failed \(rank 1: writing t\.rank1\.rows"
    ):
        save_checkpoint(Path(folder, "sub-2"), {"t": BucketedTable(failing, 4, None)}, process_group=sub)
    assert not Path(folder, "sub-2").exists()


def on_the_default_group(rank: int, world: int, folder: str) -> None:
    assert group_rank(None) == (rank, world)
    assert broadcast(rank + 5, None) == 5
    assert all_true(True, None) and not all_true(rank != 2, None)
    assert from_every_rank(rank, None) == [rank]  # no group: this process only


SCENARIOS = {
    "subgroup": on_a_subgroup,
    "saves on a subgroup": saves_on_a_subgroup,
    "default": on_the_default_group,
}
BY_WORLD = {3: list(SCENARIOS)}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    return run_world(3, tmp_path_factory.mktemp("ranks"), __name__)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_on_three_ranks(outcome, scenario):
    failures = outcome[scenario]
    assert not failures, "\n".join(failures)


def test_one_process_without_a_group_is_rank_0_of_1():
    assert group_rank(None) == (0, 1)
    assert broadcast("x", None) == "x" and all_true(False, None) is False
    assert from_every_rank("x", None) == ["x"]  # asks no process group for its size
