"""One side of the regression gate: the hot paths of whichever leanstate ``import leanstate``
finds, each timed on command.

The gate runs this source twice, with ``python -c``: once over this tree and once over
the baseline's sources (on ``PYTHONPATH``), and alternates their runs. So it uses the
public API alone (what every commit has), and a figure a tree cannot run is reported as
missing rather than failing the worker. Protocol: after set-up, one JSON line on stdout
(the figures it runs, and why any are missing); then per command line on stdin,
``run NAME``, one JSON line: the seconds of the better of two runs of that figure (or
null); anything else ends it.
"""

import importlib
import json
import os
import shutil
import sys
import tempfile
import time

import torch

import leanstate

ROWS, DIM, BATCH = 100_000, 64, 32_768
torch.manual_seed(0)


def timed(operation) -> float:
    start = time.perf_counter()
    operation()
    return time.perf_counter() - start


def store_figures(folder: str) -> dict:
    """Store get, set and insert; whole-row save and load."""
    ids = torch.randperm(ROWS)
    values = torch.randn(ROWS, DIM)
    store = leanstate.KVStore(DIM, optimizer_state_dim=1)
    store.set(ids, values)
    batch = ids[:BATCH]
    fresh_ids = torch.arange(10 * ROWS, 10 * ROWS + BATCH)
    path = os.path.join(folder, "ck")

    def insert() -> float:
        empty = leanstate.KVStore(DIM, optimizer_state_dim=1)
        return timed(lambda: empty.set(fresh_ids, values[:BATCH]))

    def save() -> float:
        return timed(lambda: leanstate.save_checkpoint(path, {"t": store}))

    def load() -> float:
        empty = leanstate.KVStore(DIM, optimizer_state_dim=1)
        return timed(lambda: leanstate.load_checkpoint(path, {"t": empty}))

    return {
        "store get": lambda: timed(lambda: store.get(batch)),
        "store set": lambda: timed(lambda: store.set(batch, values[:BATCH])),
        "store insert": insert,
        "checkpoint save": save,
        "checkpoint load": load,
    }, store


def one_rank_group():
    """A one-process gloo group (version 2 and ZeRO need one), made once."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def sharded_figures(folder: str, store) -> dict:
    """Version-2 save and load (one rank) and DCP save and load of the same rows."""
    import leanstate.dcp

    # where it lives now, and where a baseline from before the moves had it
    for place in (
        "leanstate.checkpoint._bucketed_table",
        "leanstate._bucketed_table",
        "leanstate.reference.sharding",
    ):
        try:
            BucketedTable = importlib.import_module(place).BucketedTable  # noqa: N806 - a class
            break
        except (ImportError, AttributeError):
            continue

    group = one_rank_group()
    v2, dcp = os.path.join(folder, "v2"), os.path.join(folder, "dcp")

    def table(target):
        return {"t": BucketedTable(target, 1024, None)}

    def v2_save() -> float:
        return timed(lambda: leanstate.save_checkpoint(v2, table(store), process_group=group))

    def v2_load() -> float:
        empty = leanstate.KVStore(DIM, optimizer_state_dim=1)
        return timed(lambda: leanstate.load_checkpoint(v2, table(empty), process_group=group))

    def dcp_save() -> float:
        shutil.rmtree(dcp, ignore_errors=True)
        return timed(lambda: leanstate.dcp.save({"t": store}, checkpoint_id=dcp))

    def dcp_load() -> float:
        empty = leanstate.KVStore(DIM, optimizer_state_dim=1)
        return timed(lambda: leanstate.dcp.load({"t": empty}, checkpoint_id=dcp))

    return {
        "version-2 save": v2_save,
        "version-2 load": v2_load,
        "DCP save": dcp_save,
        "DCP load": dcp_load,
    }


def training_figures() -> dict:
    """An SGD step of a KV embedding bag (forward, backward, fused update) and a ZeRO step."""
    from torch import nn

    bag = leanstate.KVEmbeddingBag(ROWS, DIM, optimizer="sgd", lr=0.01)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ROWS, (8 * 4096,), generator=generator)
    offsets = torch.arange(0, len(ids), 8)

    def sgd_step() -> float:
        return timed(lambda: bag(ids, offsets).sum().backward())

    one_rank_group()
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(12)))
    optimizer = leanstate.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    model(torch.randn(64, 1024)).sum().backward()

    def zero_step() -> float:
        return timed(optimizer.step)

    return {"sgd training step": sgd_step, "ZeRO step": zero_step}


def main() -> None:
    folder = tempfile.mkdtemp(prefix="leanstate-gate-")
    figures, problems = {}, {}
    try:
        built, store = store_figures(folder)
        figures.update(built)
        for name, build in (
            ("sharded", lambda: sharded_figures(folder, store)),
            ("training", training_figures),
        ):
            try:
                figures.update(build())
            except Exception as exc:  # noqa: BLE001 - a tree without this API: its figures are missing
                problems[name] = f"{type(exc).__name__}: {exc}"
        for run in figures.values():  # untimed: compiles, caches, first files
            run()
        print(json.dumps({"figures": sorted(figures), "problems": problems}), flush=True)
        for line in sys.stdin:
            command, _, name = line.strip().partition(" ")
            if command != "run":
                break
            try:  # the better of two back-to-back runs: one preempted run does not count
                seconds = min(figures[name](), figures[name]())
            except Exception:  # noqa: BLE001 - reported as missing for this round
                seconds = None
            print(json.dumps(seconds), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
