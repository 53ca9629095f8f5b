"""The main job: a click model trained on leanstate across gloo ranks, checkpointed, and proved.

Synthetic data (Zipf-distributed hashed int64 ids, built in), three KV tables (one feeds
two features, one takes per-sample weights) trained by rowwise Adagrad in a
``ShardedKVEmbeddingBagCollection``, an MLP of ``checkpoint_wrapper`` blocks under
``leanstate.ZeroRedundancyOptimizer``, and a whole-row checkpoint every few steps. Then
the claims are checked, each in fresh processes:

- resume: the last checkpoint, loaded at the same world size, continues bit-exactly;
- elastic: a checkpoint loads at another world size (2 -> 1, then 1 -> 2) and training
  continues to the same losses within ``ELASTIC_RTOL``;
- serving: while the first run trains, this process follows its checkpoints (a full
  one, then deltas) as they land, and ends holding the last one exactly;
- memory: whole-row versus legacy load peak memory, side by side.

``python -m leanstate demo`` exits non-zero if a claim fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import leanstate
from leanstate._tools.demo_serving import ServingFollower
from leanstate._tools.ranks import free_port, start_ranks

# Another world size sums gradients in another order: the losses of a continued run
# differ from the uninterrupted one's in the last bits, and by at most this much.
ELASTIC_RTOL = 1e-3
FEATURES = ("user", "item", "history", "context")
GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as an int64: multiplication wraps


def _hashed(raw: np.ndarray, salt: int) -> torch.Tensor:
    """Raw Zipf ranks spread over the non-negative int64 range (as hashed feature ids are)."""
    x = torch.from_numpy(raw.astype(np.int64)) + salt
    x = x * GOLDEN
    x = x ^ (x >> 29)
    return x & (2**63 - 1)


def global_batch(step: int, batch: int, space: int) -> dict[str, torch.Tensor]:
    """The built-in data of ``step``: per sample a user, an item, 0-4 history items, 1-3
    weighted contexts and a click label (more likely when user and item ranks agree)."""
    rng = np.random.default_rng(step)
    users = np.minimum(rng.zipf(1.3, batch), space) - 1
    items = np.minimum(rng.zipf(1.2, batch), space) - 1
    history_lengths = rng.integers(0, 5, batch)
    history = np.minimum(rng.zipf(1.2, int(history_lengths.sum())), space) - 1
    context_lengths = rng.integers(1, 4, batch)
    contexts = rng.integers(0, 64, int(context_lengths.sum()))
    affinity = ((users % 7) == (items % 7)).astype(np.float32)
    clicks = (rng.random(batch) < 0.15 + 0.7 * affinity).astype(np.float32)
    return {
        "user": _hashed(users, 1),
        "item": _hashed(items, 2),
        "history": _hashed(history, 2),  # items again: the same table
        "history_lengths": torch.from_numpy(history_lengths.astype(np.int64)),
        "context": _hashed(contexts, 3),
        "context_lengths": torch.from_numpy(context_lengths.astype(np.int64)),
        "context_weights": torch.from_numpy(rng.random(int(context_lengths.sum())).astype(np.float32)),
        "clicks": torch.from_numpy(clicks),
    }


def local_batch(data: dict[str, torch.Tensor], rank: int, world: int):
    """This rank's contiguous share of the global batch, as a KeyedJaggedTensor and labels."""
    batch = len(data["clicks"])
    share = batch // world
    first, end = rank * share, (rank + 1) * share
    ones = torch.ones(batch, dtype=torch.int64)
    lengths = {
        "user": ones,
        "item": ones,
        "history": data["history_lengths"],
        "context": data["context_lengths"],
    }
    values, weights, all_lengths = [], [], []
    for key in FEATURES:
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths[key].cumsum(0)])
        start, stop = int(offsets[first]), int(offsets[end])
        values.append(data[key][start:stop])
        all_lengths.append(lengths[key][first:end])
        weight = data["context_weights"][start:stop] if key == "context" else torch.ones(stop - start)
        weights.append(weight)
    features = leanstate.KeyedJaggedTensor(
        list(FEATURES), torch.cat(values), lengths=torch.cat(all_lengths), weights=torch.cat(weights)
    )
    return features, data["clicks"][first:end]


class _Block(nn.Module):
    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def build(dim: int, group, backend: str | None):
    """The model: the sharded tables, and the MLP whose blocks recompute in backward."""
    tables = [
        leanstate.KVTableConfig(
            "users", dim, feature_names=["user"], optimizer="rowwise_adagrad", lr=0.1, seed=1
        ),
        leanstate.KVTableConfig(
            "items", dim, feature_names=["item", "history"], optimizer="rowwise_adagrad", lr=0.1, seed=2
        ),
        leanstate.KVTableConfig(
            "contexts", dim, feature_names=["context"], optimizer="rowwise_adagrad", lr=0.1, seed=3
        ),
    ]
    ebc = leanstate.ShardedKVEmbeddingBagCollection(
        tables, is_weighted=True, process_group=group, backend=backend, clock=lambda: 0
    )
    torch.manual_seed(0)
    mlp = nn.Sequential(
        leanstate.checkpoint_wrapper(_Block(len(FEATURES) * dim, 64)),
        leanstate.checkpoint_wrapper(_Block(64, 32)),
        nn.Linear(32, 1),
    )
    zero = leanstate.ZeroRedundancyOptimizer(mlp.parameters(), torch.optim.Adam, lr=3e-3, process_group=group)
    return ebc, mlp, zero


def _digest(ebc, mlp, group) -> str:
    """SHA-256 over every table's rows (by id, gathered from all ranks) and the dense parameters."""
    digest = hashlib.sha256()
    for name, bag in ebc.embedding_bags.named_children():
        keys = bag.store.keys()
        mine = (keys, bag.store.get_rows(keys).view(torch.uint8))
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        keys = torch.cat([k for k, _ in everyone])
        rows = torch.cat([r for _, r in everyone])
        order = torch.argsort(keys)
        digest.update(name.encode())
        digest.update(rows[order].numpy().tobytes())
    for value in mlp.state_dict().values():
        digest.update(value.numpy().tobytes())
    return digest.hexdigest()


def _save(path: Path, ebc, mlp, zero, step: int, group, base: Path | None = None) -> None:
    """A whole-row checkpoint of the tables, with the dense state and the step as its extra
    (with ``base``: a delta of that checkpoint, the rows changed since it)."""
    rank = dist.get_rank(group)
    zero.consolidate_state_dict(to=0)
    extra = None
    if rank == 0:
        extra = {
            "dense": mlp.state_dict(),
            "optimizer": zero.state_dict(),
            "step": step,
            "tables": ebc.extra_state(),
        }
    leanstate.save_checkpoint(path, ebc.checkpoint_tables(), extra=extra, process_group=group, base=base)


def _load(path: Path, ebc, mlp, zero, group) -> int:
    """Restore what :func:`_save` wrote (at any world size); the step to go on from."""
    extra = leanstate.load_checkpoint(path, ebc.checkpoint_tables(), process_group=group)
    mlp.load_state_dict(extra["dense"])
    zero.load_state_dict(extra["optimizer"])
    ebc.load_extra_state(extra["tables"])
    return int(extra["step"])


def _train(run: dict, rank: int, world: int) -> dict:
    group = dist.group.WORLD
    out = Path(run["out"])
    ebc, mlp, zero = build(run["dim"], group, run["backend"])
    first, record = 0, {"losses": {}, "saves": [], "bytes": [], "delta": []}
    previous = None
    if run.get("load_from"):
        first = _load(Path(run["load_from"]), ebc, mlp, zero, group)
    steps = range(first, run["steps"])
    progress, bar = None, None
    if rank == 0 and run.get("progress"):
        try:
            from tqdm import tqdm

            # The bar starts after the first step: that one waits for numba to compile (or load
            # from its cache) every kernel, and an ETA drawn from it would be minutes off.
            print(f"{run['name']}: first step (compiling kernels, cached for later runs) ...", flush=True)
            bar = lambda: tqdm(  # noqa: E731
                total=len(steps), initial=1, desc=run["name"], unit="step", leave=True, file=sys.stdout
            )
        except ImportError:
            bar = None
    for step in steps:
        data = global_batch(step, run["batch"], run["space"])
        features, clicks = local_batch(data, rank, world)
        logits = mlp(ebc(features).values()).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, clicks, reduction="sum") / len(
            data["clicks"]
        )
        loss.backward()
        for p in mlp.parameters():
            dist.all_reduce(p.grad, group=group)
        zero.step()
        zero.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        record["losses"][step] = float(total)
        if progress is not None:
            progress.update(1)
        elif bar is not None:
            progress = bar()
        if progress is not None:
            progress.set_postfix(loss=f"{float(total):.4f}")
        if (step + 1) % run["every"] == 0 and (step + 1) < run["steps"] and run.get("save", True):
            # every full_every-th save is full, the ones between are deltas of the save before
            base = None if len(record["saves"]) % run["full_every"] == 0 else previous
            previous = out / run["name"] / f"step{step + 1}"
            _save(previous, ebc, mlp, zero, step + 1, group, base)
            record["saves"].append(step + 1)
            record["bytes"].append(sum(f.stat().st_size for f in previous.iterdir()))
            record["delta"].append(base is not None)
    if progress is not None:
        progress.close()
    record["digest"] = _digest(ebc, mlp, group)
    record["rows"] = {name: len(bag.store) for name, bag in ebc.embedding_bags.named_children()}
    return record


def _worker(rank: int, world: int, port: int, run: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        record = _train(run, rank, world)
        if rank == 0:
            Path(run["out"], f"{run['name']}.json").write_text(json.dumps(record))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _spawn(run: dict, world: int) -> dict:
    start_ranks(_worker, (world, free_port(), run), world)
    record = json.loads(Path(run["out"], f"{run['name']}.json").read_text())
    record["losses"] = {int(k): v for k, v in record["losses"].items()}
    return record


def _plot(path: Path, runs: dict, memory: dict, table_mib: float, speeds: dict, saves: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (losses, mem, io, written) = plt.subplots(1, 4, figsize=(20, 4.2))
    for name, record in runs.items():
        steps = sorted(record["losses"])
        losses.plot(steps, [record["losses"][s] for s in steps], label=name, linewidth=1.2)
    losses.set_xlabel("step")
    losses.set_ylabel("training loss (BCE)")
    losses.set_title("loss: uninterrupted, resumed, elastic")
    losses.legend(fontsize=8)
    labels = ["whole-row", "legacy", "table"]
    mem.bar(
        labels,
        [memory["whole"] / 2**20, memory["legacy"] / 2**20, table_mib],
        color=["tab:green", "tab:red", "tab:gray"],
    )
    mem.set_ylabel("MiB")
    mem.set_title("load peak memory beyond the live store")
    io.bar(list(speeds), list(speeds.values()), color="tab:blue")
    io.set_ylabel("MB/s")
    io.set_title("whole-row checkpoint save / load of the memory table")
    colors = ["tab:orange" if delta else "tab:blue" for delta in saves["delta"]]
    labels = [
        f"{step}\n{'delta' if delta else 'full'}" for step, delta in zip(saves["saves"], saves["delta"])
    ]
    written.bar(labels, [size / 2**20 for size in saves["bytes"]], color=colors)
    written.set_ylabel("MiB written")
    written.set_xlabel("checkpoint at step")
    written.set_title("bytes written per checkpoint: full against delta")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


@dataclass(frozen=True)
class Plan:
    """The demo's four runs, set up: the output folder, the settings every run shares, the
    world sizes (``world`` and the ``other`` one of the elastic proofs) and the checkpoint
    steps the resumed and elastic runs load (``last``, ``middle``, ``again``)."""

    out: Path
    base: dict
    world: int
    other: int
    last: int
    middle: int
    again: int
    serving: list = dataclasses.field(default_factory=list)  # the serving copy's proof


def _set_up(args: argparse.Namespace) -> Plan | None:
    """A fresh output folder and the plan of the runs; None (after saying why) when
    ``--steps`` leaves no checkpoint to resume from."""
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    world, other = args.nproc, 2 if args.nproc == 1 else 1
    base = {
        "out": str(out),
        "dim": args.dim,
        "batch": args.batch,
        "space": args.ids,
        "steps": args.steps,
        "every": args.every,
        "backend": args.backend,
        "progress": True,
        "full_every": args.full_every,
    }
    last = (args.steps - 1) // args.every * args.every
    middle = max(args.every, last // 2 // args.every * args.every)
    if last < args.every:
        print("demo: --steps must exceed --every, so that a checkpoint is written", file=sys.stderr)
        return None
    again = (middle + last) // 2 // args.every * args.every
    again = again if again > middle else last
    return Plan(out, base, world, other, last, middle, again)


def _train_runs(plan: Plan) -> dict[str, dict]:
    """The four training runs, in order: uninterrupted (checkpointing), resumed from its last
    checkpoint, loaded at its middle checkpoint at the other world size, and loaded back at
    ``world`` from that run's checkpoint; each run's record by name."""
    base, out, world, other = plan.base, plan.out, plan.world, plan.other
    runs = {}
    serving = ServingFollower(out / "uninterrupted", base["backend"])
    serving.start()  # this process serves while the ranks train and publish
    try:
        runs["uninterrupted"] = _spawn({**base, "name": "uninterrupted"}, world)
    finally:
        serving.stop()
    plan.serving.append(serving.proof(out / "uninterrupted" / f"step{plan.last}"))
    runs["resumed"] = _spawn(
        {
            **base,
            "name": "resumed",
            "load_from": str(out / "uninterrupted" / f"step{plan.last}"),
            "save": False,
        },
        world,
    )
    runs[f"{world}->{other} ranks"] = _spawn(
        {
            **base,
            "name": f"{world}->{other} ranks",
            "load_from": str(out / "uninterrupted" / f"step{plan.middle}"),
        },
        other,
    )
    runs[f"{other}->{world} ranks"] = _spawn(
        {
            **base,
            "name": f"{other}->{world} ranks",
            "load_from": str(out / f"{world}->{other} ranks" / f"step{plan.again}"),
            "save": False,
        },
        world,
    )
    return runs


def _measure(args: argparse.Namespace, runs: dict) -> dict:
    """The memory claim and the checkpoint speeds on a table large enough for them to show
    (the demo's own are small, fixed costs dominate): its ``rows``, the whole-row and legacy
    loads' peak extra bytes (``memory``), its size (``table_mib``) and MB/s (``speeds``)."""
    from leanstate._tools.workloads import CheckpointIO, best_time, load_peak_extra_bytes

    rows = max(args.memory_rows, sum(runs["uninterrupted"]["rows"].values()))
    memory = load_peak_extra_bytes(rows, args.dim, leanstate.backend_info().chosen["kv_store"], 2**20)
    table_mib = rows * (8 + (args.dim + 1) * 4) / 2**20
    table_io = CheckpointIO(rows, args.dim, leanstate.backend_info().chosen["kv_store"])
    try:
        size = table_io.bytes.nbytes / 1e6
        speeds = {"save": size / best_time(table_io.save, 2), "load": size / best_time(table_io.load, 2)}
        speeds["read"] = size / best_time(table_io.read_plain, 2)  # the ceiling: readinto a faulted buffer
    finally:
        table_io.close()
    return {"rows": rows, "memory": memory, "table_mib": table_mib, "speeds": speeds}


def _proofs(plan: Plan, runs: dict, measured: dict) -> list[tuple[str, bool, str]]:
    """Each claim as (claim, held, detail): the bit-exact resume, the two elastic loads'
    losses within ``ELASTIC_RTOL``, and the whole-row load's memory beside the legacy one's."""
    world, other = plan.world, plan.other
    memory, table_mib = measured["memory"], measured["table_mib"]
    proofs = []
    full = runs["uninterrupted"]
    resumed = runs["resumed"]
    same_losses = all(resumed["losses"][s] == full["losses"][s] for s in resumed["losses"])
    links = full["delta"][::-1].index(False) + 1 if False in full["delta"] else 1  # from the last full one
    proofs.append(
        (
            f"resume from step {plan.last} at {world} rank(s) ({'a chain of ' + str(links) + ' checkpoints' if links > 1 else 'a full checkpoint'}) is bit-exact",
            same_losses and resumed["digest"] == full["digest"],
            f"{len(resumed['losses'])} losses equal, final rows+dense sha256 {'equal' if resumed['digest'] == full['digest'] else 'DIFFER'}",
        )
    )
    for name, start in ((f"{world}->{other} ranks", plan.middle), (f"{other}->{world} ranks", plan.again)):
        record = runs[name]
        worst = max(
            abs(record["losses"][s] - full["losses"][s]) / abs(full["losses"][s]) for s in record["losses"]
        )
        proofs.append(
            (
                f"load at step {start}, {name}, trains on to the same losses",
                worst <= ELASTIC_RTOL,
                f"largest relative loss difference {worst:.2e} (tolerance {ELASTIC_RTOL:g})",
            )
        )
    proofs.extend(plan.serving)
    proofs.append(
        (
            "whole-row load needs a fraction of the legacy load's memory",
            memory["whole"] < memory["legacy"] / 4 and memory["legacy"] > 0.9 * table_mib * 2**20,
            f"whole-row +{memory['whole'] / 2**20:.1f} MiB, legacy +{memory['legacy'] / 2**20:.1f} MiB, "
            f"table {table_mib:.1f} MiB ({measured['rows']} rows)",
        )
    )
    return proofs


def _summarize(plan: Plan, runs: dict, measured: dict, proofs: list, drawn: bool, started: float) -> None:
    """Print the runs' table, the checkpoints' speeds and sizes, each proof, the figure's
    path and the time taken."""
    world, other = plan.world, plan.other
    full = runs["uninterrupted"]
    speeds = measured["speeds"]
    print()
    print(f"{'run':<22} {'ranks':>5} {'steps':>11} {'first loss':>11} {'last loss':>10}  rows on rank 0")
    for name, record in runs.items():
        steps = sorted(record["losses"])
        ranks = other if name.startswith(f"{world}->") else world
        print(
            f"{name:<22} {ranks:>5} {f'{steps[0]}..{steps[-1]}':>11} {record['losses'][steps[0]]:>11.5f} "
            f"{record['losses'][steps[-1]]:>10.5f}  {record['rows']}"
        )
    print(
        f"checkpoints: {len(full['saves'])} saves during training; a {measured['rows']}-row table saves at {speeds['save']:.0f} MB/s "
        f"and loads at {speeds['load']:.0f} MB/s (whole rows, CRC-32C per chunk, fsync; the fastest plain "
        f"read of the same bytes, readinto a faulted buffer: {speeds['read']:.0f} MB/s)"
    )
    sizes = {kind: [b for b, d in zip(full["bytes"], full["delta"]) if d == kind] for kind in (False, True)}
    if sizes[True] and sizes[False]:
        print(
            f"bytes written: {len(sizes[False])} full checkpoints of {statistics.mean(sizes[False]) / 2**20:.2f} MiB "
            f"on average, {len(sizes[True])} deltas of {statistics.mean(sizes[True]) / 2**20:.2f} MiB "
            f"({statistics.mean(sizes[True]) / statistics.mean(sizes[False]):.0%} of a full one)"
        )
    print()
    for claim, ok, detail in proofs:
        print(f"{'PASS' if ok else 'FAIL'}  {claim}: {detail}")
    png = plan.out / "demo.png"
    print(f"figure: {png}" if drawn else "figure: skipped (pip install 'leanstate[demo]' for matplotlib)")
    print(f"done in {time.perf_counter() - started:.0f} s; checkpoints under {plan.out}")


def main(args: argparse.Namespace) -> int:
    """Train, checkpoint, resume and reshard; print the proofs and a summary; draw the figure."""
    plan = _set_up(args)
    if plan is None:
        return 2
    print(
        f"leanstate demo: click model, {plan.world} gloo rank(s), {args.steps} steps of {args.batch} samples, "
        f"dim {args.dim}, checkpoint every {args.every} steps, backend {args.backend or leanstate.backend_info().chosen['embedding']}"
    )
    started = time.perf_counter()
    runs = _train_runs(plan)
    measured = _measure(args, runs)
    proofs = _proofs(plan, runs, measured)
    drawn = _plot(
        plan.out / "demo.png", runs, measured["memory"], measured["table_mib"], measured["speeds"],
        runs["uninterrupted"],
    )  # fmt: skip
    _summarize(plan, runs, measured, proofs, drawn, started)
    return 0 if all(ok for _, ok, _ in proofs) else 1
