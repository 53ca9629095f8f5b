"""Sharded KV embeddings across 1-3 gloo ranks held to one process trained on the global batch.

Each rank runs the sharded collection on its local batch and, beside it, a plain
``KVEmbeddingBagCollection`` on the concatenated global batch (rank 0's samples, then
rank 1's...). Outputs and rows must match: bit for bit for the SGD table (each id at
most twice per global batch), within 1e-6 for the hashed rowwise-Adagrad table.
Checkpoints are saved at one world size and loaded at another, in the order
3 -> 2 -> 1 -> 3, and from a single-process (version 1) checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from leanstate import (
    CheckpointError,
    KeyedJaggedTensor,
    KVEmbeddingBagCollection,
    ShardedKVEmbeddingBagCollection,
    ZeroRedundancyOptimizer,
    load_checkpoint,
    save_checkpoint,
)
from leanstate.checkpoint import sharded as sharded_checkpoint
from tests.compat.sharded_models import (
    KEYS,
    G,
    assert_rows_match,
    batch_of,
    build,
    configs,
    global_batch,
    local_batch,
    train_step,
    upstream,
)
from tests.harness import free_port, run_world

# -- scenarios -------------------------------------------------------------------------


def train_matches_single(rank, world, folder):
    sharded, single = build()
    minimum = 0  # per step and table: this rank's distinct ids x (a row + a float32 gradient)
    for step in range(4):
        train_step(sharded, single, step, rank, world)
        batch = local_batch(step, rank, world)
        per_key = dict(
            zip(
                KEYS,
                torch.split(batch.values(), [int(n) for n in batch.lengths().view(len(KEYS), -1).sum(1)]),
            )
        )
        for features, dim in ((("f1", "f2"), 8), (("h",), 4)):
            distinct = torch.unique(torch.cat([per_key[f] for f in features]))
            minimum += len(distinct[distinct >= 0]) * dim * (4 + 4)
    assert_rows_match(sharded, single, rank, world)
    assert sharded.embedding_bags["hashed"].optimizer_step == 4
    assert sharded.exchange_stats["min_bytes"] == minimum, (sharded.exchange_stats, minimum)
    totals = torch.tensor([sharded.exchange_stats["bytes"], sharded.exchange_stats["min_bytes"]])
    dist.all_reduce(totals)
    assert totals[1] <= totals[0] <= 1.5 * totals[1] + 2048 * world * 4, totals  # near the minimum


def beside_zero(rank, world, folder):
    """Dense parameters on top, trained with leanstate's ZeRO in the same process group."""
    sharded, single = build()
    torch.manual_seed(0)
    dense, dense_single = nn.Linear(20, 3), nn.Linear(20, 3)
    dense_single.load_state_dict(dense.state_dict())
    zero = ZeroRedundancyOptimizer(dense.parameters(), torch.optim.SGD, lr=0.05)
    plain = torch.optim.SGD(dense_single.parameters(), lr=0.05)
    for step in range(3):
        dense(sharded(local_batch(step, rank, world)).values()).square().sum().backward()
        for p in dense.parameters():
            dist.all_reduce(p.grad)
        zero.step()
        zero.zero_grad()
        dense_single(single(global_batch(step)).values()).square().sum().backward()
        plain.step()
        plain.zero_grad()
    for p, q in zip(dense.parameters(), dense_single.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    for table in ("exact", "hashed"):
        mine, full = sharded.embedding_bags[table].store, single.embedding_bags[table].store
        keys = mine.keys()
        rows, want = mine.get_rows(keys), full.get_rows(keys)
        assert torch.equal(rows[:, :4].view(torch.int64), want[:, :4].view(torch.int64)), "headers differ"
        torch.testing.assert_close(rows[:, 4:], want[:, 4:], rtol=1e-6, atol=1e-6)


def resume(steps_before: int, load_from: str | None, save_to: str | None, steps_after: int):
    """Load (if ``load_from``) a checkpoint saved at another world size, check it, train on,
    save (if ``save_to``); the single process trains straight through from step 0."""

    def scenario(rank, world, folder):
        sharded, single = build()
        for step in range(steps_before):
            if load_from is None:
                train_step(sharded, single, step, rank, world)
            else:
                single(global_batch(step)).values().mul(upstream(step)).sum().backward()
        if load_from is not None:
            path = Path(folder, load_from)
            sharded.load_extra_state(
                load_checkpoint(path, sharded.checkpoint_tables(), process_group=dist.group.WORLD)
            )
            assert_rows_match(sharded, single, rank, world)
            assert sharded.extra_state() == single.extra_state()
            stats = sharded_checkpoint.last_load_stats
            manifest = json.loads((path / "manifest.json").read_text())
            owned, total = 0, 0
            for name, table in manifest["tables"].items():
                buckets = sharded.bucketing[name.split(".")[0]][0]
                for f in table["files"]:
                    for chunk in f["chunks"]:
                        size = chunk["rows"] * table["row_bytes"]
                        total += size
                        owned += size if chunk["bucket"] * world // buckets == rank else 0
            assert stats["bytes_read"] == owned, (stats, owned)  # only the owned byte ranges
            if world > 1:
                assert owned < total
        for step in range(steps_before, steps_before + steps_after):
            train_step(sharded, single, step, rank, world)
        assert_rows_match(sharded, single, rank, world)
        if save_to is not None:
            save_checkpoint(
                Path(folder, save_to),
                sharded.checkpoint_tables(),
                extra=sharded.extra_state(),
                process_group=dist.group.WORLD,
                chunk_bytes=4 * 48,  # several chunks per bucket for the wider rows
            )

    return scenario


def load_version_1(rank, world, folder):
    """A single-process checkpoint loads across ranks; each rank keeps only what it owns."""
    sharded, single = build()
    for step in range(2):
        single(global_batch(step)).values().mul(upstream(step)).sum().backward()
    path = Path(folder, "v1")
    if rank == 0:
        save_checkpoint(path, single.checkpoint_tables(), extra=single.extra_state())
    dist.barrier()
    sharded.load_extra_state(
        load_checkpoint(path, sharded.checkpoint_tables(), process_group=dist.group.WORLD)
    )
    assert_rows_match(sharded, single, rank, world)
    train_step(sharded, single, 2, rank, world)
    assert_rows_match(sharded, single, rank, world)


def failed_load_changes_nothing(rank, world, folder):
    """A chunk with a bad CRC on one rank's share fails the load on every rank; nothing stays."""
    sharded, single = build()
    path = Path(folder, "bad")
    if rank == 0:
        for step in range(2):
            single(global_batch(step)).values().mul(upstream(step)).sum().backward()
        save_checkpoint(path, single.checkpoint_tables())
        file = path / "exact.weight.rows"
        data = bytearray(file.read_bytes())
        data[-1] ^= 0xFF
        file.write_bytes(bytes(data))
    dist.barrier()
    with pytest.raises(Exception, match="checksum mismatch"):
        load_checkpoint(path, sharded.checkpoint_tables(), process_group=dist.group.WORLD)
    assert all(len(t.store) == 0 for t in sharded.checkpoint_tables().values())


def bad_chunk_leaves_trained_stores_as_they_were(rank, world, folder):
    """A flipped byte in a chunk of any rank's file: every rank raises, and no rank's trained
    store changes (every rank verifies, the ranks agree, and only then does any apply)."""
    sharded, single = build()
    for step in range(2):
        train_step(sharded, single, step, rank, world)
    for bad in range(world):
        path = Path(folder, f"bad-v2-{world}-{bad}")
        save_checkpoint(path, sharded.checkpoint_tables(), process_group=dist.group.WORLD, chunk_bytes=4 * 48)
        if rank == 0:
            file = path / f"exact.weight.rank{bad}.rows"
            data = bytearray(file.read_bytes())
            data[20] ^= 0x01  # a weight byte of that rank's first chunk
            file.write_bytes(bytes(data))
        dist.barrier()
        train_step(sharded, single, 2 + bad, rank, world)  # the stores move on past the checkpoint
        before = {t: sharded.embedding_bags[t].store for t in ("exact", "hashed")}
        before = {t: s.get_rows(s.keys()).clone() for t, s in before.items()}
        pattern = rf"rank \d: .*chunk 0 of .*exact.weight.rank{bad}.rows .*checksum mismatch"
        with pytest.raises(Exception, match=pattern):
            load_checkpoint(path, sharded.checkpoint_tables(), process_group=dist.group.WORLD)
        import leanstate

        stats = leanstate.last_load_stats  # also after a failed load: what was read, nothing applied
        assert stats is sharded_checkpoint.last_load_stats and stats["rows_loaded"] == 0, stats
        for table, rows in before.items():
            store = sharded.embedding_bags[table].store
            after = store.get_rows(store.keys())
            assert torch.equal(after.view(torch.uint8), rows.view(torch.uint8)), (
                f"{table} changed on rank {rank}"
            )


def reader_rules_hold_on_every_path(rank, world, folder):
    """A version-2 rank file with a trailing byte, and a version-1 checkpoint with a duplicate
    id in a chunk (CRC recomputed), are refused with process_group as a plain load refuses them."""
    sharded, single = build()
    for step in range(2):
        train_step(sharded, single, step, rank, world)
    v2 = Path(folder, "rules-v2")
    save_checkpoint(v2, sharded.checkpoint_tables(), process_group=dist.group.WORLD)
    v1_path = Path(folder, "rules-v1")
    if rank == 0:
        with open(v2 / "exact.weight.rank0.rows", "ab") as f:
            f.write(b"\0")
        save_checkpoint(v1_path, single.checkpoint_tables())
        manifest = json.loads((v1_path / "manifest.json").read_text())
        table = manifest["tables"]["exact.weight"]
        file = v1_path / table["file"]
        data = bytearray(file.read_bytes())
        row = table["row_bytes"]
        data[row : 2 * row] = data[0:row]  # the second row repeats the first id
        file.write_bytes(bytes(data))
        chunk = table["chunks"][0]
        import crc32c

        chunk["crc"] = crc32c.crc32c(bytes(data[: chunk["rows"] * row]))
        (v1_path / "manifest.json").write_text(json.dumps(manifest))
    dist.barrier()
    fresh, _ = build()
    with pytest.raises(Exception, match="trailing bytes"):
        load_checkpoint(v2, fresh.checkpoint_tables(), process_group=dist.group.WORLD)
    with pytest.raises(Exception, match="do not ascend"):
        load_checkpoint(v1_path, fresh.checkpoint_tables(), process_group=dist.group.WORLD)
    assert all(len(t.store) == 0 for t in fresh.checkpoint_tables().values())


def a_failed_save_names_the_failing_rank(rank, world, folder):
    """Rank 1 cannot write (its file size limit): every rank raises a CheckpointError naming
    rank 1 and its file, and the previous checkpoint stays."""
    import resource
    import signal

    from leanstate import CheckpointError

    sharded, single = build()
    train_step(sharded, single, 0, rank, world)
    path = Path(folder, "save-fails")
    save_checkpoint(path, sharded.checkpoint_tables(), process_group=dist.group.WORLD)
    before = sorted((f.name, f.read_bytes()) for f in path.iterdir())
    train_step(sharded, single, 1, rank, world)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, limits[1]))
    try:
        with pytest.raises(CheckpointError, match=r"rank 1: writing exact.weight.rank1.rows: OSError"):
            save_checkpoint(path, sharded.checkpoint_tables(), process_group=dist.group.WORLD)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    dist.barrier()
    assert sorted((f.name, f.read_bytes()) for f in path.iterdir()) == before


def weighted(batch: KeyedJaggedTensor, step: int) -> KeyedJaggedTensor:
    """The global ``batch`` with a per-sample weight in [0.5, 1.5) for each id position."""
    weights = torch.rand(len(batch.values()), generator=torch.Generator().manual_seed(500 + step)) + 0.5
    return KeyedJaggedTensor(KEYS, batch.values(), weights=weights, lengths=batch.lengths())


def weighted_training_matches_one_process(rank, world, folder):
    """Per-sample weights reach the forward and the backward of the exchange (the owners'
    gradients are weighted), as one process on the weighted global batch."""
    tables = [dataclasses.replace(c, pooling="sum") for c in configs()]  # weights need sum pooling
    sharded = ShardedKVEmbeddingBagCollection(tables, is_weighted=True, clock=lambda: 1000)
    single = KVEmbeddingBagCollection(tables, is_weighted=True, clock=lambda: 1000)
    per_key = G // world
    for step in range(3):
        full = weighted(global_batch(step), step)
        # this rank's slice of the global weights: per key, its samples' positions
        local = local_batch(step, rank, world)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), full.lengths().cumsum(0)])
        parts = [
            full.weights_or_none()[starts[k * G + rank * per_key] : starts[k * G + (rank + 1) * per_key]]
            for k in range(len(KEYS))
        ]
        local = KeyedJaggedTensor(KEYS, local.values(), weights=torch.cat(parts), lengths=local.lengths())
        grad = upstream(step)
        out = sharded(local)
        (out.values() * grad[rank * per_key : (rank + 1) * per_key]).sum().backward()
        want = single(full)
        (want.values() * grad).sum().backward()
        mine = want.values().detach()[rank * per_key : (rank + 1) * per_key]
        torch.testing.assert_close(out.values().detach(), mine, rtol=1e-6, atol=1e-6)
    assert_rows_match(sharded, single, rank, world)


def empty_rank_steps(rank, world, folder):
    """The last rank has an empty batch (an epoch's end): it steps with the others, no hang,
    its output has no rows and every feature's columns; the rows are what the others' batches give."""
    sharded, single = build()
    for step in range(2):
        if rank == world - 1:
            batch = KeyedJaggedTensor(
                KEYS, torch.empty(0, dtype=torch.int64), lengths=torch.zeros(0, dtype=torch.int64)
            )
        else:
            batch = local_batch(step, rank, world)
        out = sharded(batch)
        assert out.values().shape == (len(batch.lengths()) // len(KEYS), 8 + 8 + 4), out.values().shape
        assert [out[k].shape[1] for k in KEYS] == [8, 8, 4]
        out.values().sum().backward()
        first = batch_of(step, 0, (G // world) * (world - 1))  # every sample but the last rank's
        single(first).values().sum().backward()
    for table in ("exact",):
        mine, full = sharded.embedding_bags[table].store, single.embedding_bags[table].store
        keys = mine.keys()
        assert torch.equal(mine.get_rows(keys), full.get_rows(keys)), (
            "rows differ from the non-empty ranks' batches"
        )


SCENARIOS = {
    "train": train_matches_single,
    "beside-zero": beside_zero,
    "save-3": resume(2, None, "w3", 0),
    "3-to-2": resume(2, "w3", "w2", 1),
    "2-to-1": resume(3, "w2", "w1", 1),
    "1-to-3": resume(4, "w1", None, 1),
    "version-1": load_version_1,
    "bad-chunk": failed_load_changes_nothing,
    "empty-rank": empty_rank_steps,
    "bad-chunk-trained": bad_chunk_leaves_trained_stores_as_they_were,
    "reader-rules": reader_rules_hold_on_every_path,
    "save-fails": a_failed_save_names_the_failing_rank,
    "weighted": weighted_training_matches_one_process,
}
RUNS = [  # in order: each later world loads what an earlier one saved
    (
        2,
        ["train", "beside-zero", "version-1", "bad-chunk", "empty-rank", "bad-chunk-trained", "reader-rules"],
    ),
    (3, ["train", "save-3", "bad-chunk-trained"]),
    (2, ["3-to-2"]),
    (1, ["train", "2-to-1"]),
    (3, ["1-to-3"]),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("sharded")


@pytest.fixture(scope="module")
def runs(folder):
    return [(world, run_world(world, folder, __name__, names)) for world, names in RUNS]


CASES = [(i, world, name) for i, (world, names) in enumerate(RUNS) for name in names]


@pytest.mark.parametrize("index, world, scenario", CASES, ids=[f"world{w}-{n}" for _, w, n in CASES])
def test_sharded(runs, index, world, scenario):
    failures = runs[index][1][scenario]
    assert not failures, "\n".join(failures)


def test_inspect_verifies_every_ranks_files(runs, folder, capsys):
    from leanstate._tools.cli import main

    assert main(["inspect", str(folder / "w3")]) == 0
    out = capsys.readouterr().out
    assert "version 2" in out and "saved by 3 ranks" in out and "exact.weight.rank2.rows (rank 2)" in out
    assert "OK: " in out and "extra state verified" in out
    file = folder / "w3" / "exact.weight.rank1.rows"
    data = bytearray(file.read_bytes())
    data[-5] ^= 0x40
    file.write_bytes(bytes(data))
    assert main(["inspect", str(folder / "w3")]) == 1
    bad = capsys.readouterr().out
    assert "BAD: " in bad and "exact.weight.rank1.rows (bytes" in bad and "checksum mismatch" in bad


TORCHRUN = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from tests.compat.sharded_models import build, train_step, assert_rows_match
    dist.init_process_group("gloo")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded, single = build()
    for step in range(2):
        train_step(sharded, single, step, rank, world)
    assert_rows_match(sharded, single, rank, world)
    print(f"rank {rank} of {world} ok", flush=True)
    # The module holds the process group (as DDP does): dropped first, the group is really
    # destroyed here rather than at interpreter exit, where gloo's threads may abort.
    del sharded
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_torchrun_launch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3]), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 of 2 ok" in result.stdout and "rank 1 of 2 ok" in result.stdout


def test_a_checkpoint_saved_across_ranks_loads_into_a_plain_collection(runs, folder):
    """Version 2 (saved by 2 ranks) into one process's plain collection: every rank's file is
    read and every row applied, as one process trained straight through would hold them."""
    plain = KVEmbeddingBagCollection(configs(), clock=lambda: 1000)
    extra = load_checkpoint(folder / "w2", plain.checkpoint_tables())
    plain.load_extra_state(extra)
    single = KVEmbeddingBagCollection(configs(), clock=lambda: 1000)
    for step in range(3):
        single(global_batch(step)).values().mul(upstream(step)).sum().backward()
    for table in ("exact", "hashed"):
        mine, full = plain.embedding_bags[table].store, single.embedding_bags[table].store
        assert torch.equal(mine.keys(), full.keys()), table
        rows, want = mine.get_rows(full.keys()), full.get_rows(full.keys())
        assert torch.equal(rows[:, :4].view(torch.int64), want[:, :4].view(torch.int64)), table
        torch.testing.assert_close(rows[:, 4:], want[:, 4:], rtol=1e-6, atol=1e-6)
    assert plain.extra_state() == single.extra_state()


def test_id_range_is_refused_for_version_2_and_beside_process_group(runs, folder):
    """``id_range`` selects rows of a version-1 checkpoint only: for version 2 (buckets
    decide) and beside ``process_group`` it is an error naming it, and nothing is loaded."""
    plain = KVEmbeddingBagCollection(configs(), clock=lambda: 1000)
    with pytest.raises(ValueError, match="id_range applies to version-1 checkpoints; this one is version 2"):
        load_checkpoint(folder / "w2", plain.checkpoint_tables(), id_range=(0, 10))
    assert all(len(bag.store) == 0 for bag in plain.embedding_bags.values())
    with pytest.raises(ValueError, match="id_range and process_group exclude each other"):
        load_checkpoint(folder / "w2", plain.checkpoint_tables(), id_range=(0, 10), process_group=object())


def test_a_sharded_modules_tables_without_process_group_say_so(runs, folder):
    sharded_tables = {
        "t.weight": sharded_checkpoint.BucketedTable(
            KVEmbeddingBagCollection(configs()).embedding_bags["exact"].store, 64, 1
        )
    }
    with pytest.raises(TypeError, match="sharded module's table .* pass process_group="):
        load_checkpoint(folder / "w2", dict(sharded_tables, extra=object()))


def test_a_corrupt_or_missing_extra_state_of_version_2_is_bad(runs, folder, tmp_path, capsys):
    from leanstate._tools.cli import main

    for fault in ("corrupt", "missing"):
        copy = tmp_path / fault
        shutil.copytree(folder / "w2", copy)
        extra = copy / "extra.pt"
        if fault == "corrupt":
            data = bytearray(extra.read_bytes())
            data[len(data) // 2] ^= 0x01
            extra.write_bytes(bytes(data))
        else:
            extra.unlink()
        assert main(["inspect", str(copy)]) == 1
        out = capsys.readouterr().out
        assert (
            "extra state verified" not in out
            and sum(line.startswith("BAD") for line in out.splitlines()) == 1
        )
        assert "extra.pt" in out, out
        with pytest.raises(CheckpointError, match="extra"):
            load_checkpoint(copy, KVEmbeddingBagCollection(configs()).checkpoint_tables())
