"""The checkpoint load's workloads beside their peers: a load of several tables on torch's
threads beside one thread, and a version-2 load across gloo ranks beside a version-1
load of the same rows (``python -m leanstate bench``)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

import leanstate
from leanstate._tools.ranks import free_port, start_ranks
from leanstate._tools.workloads import filled_store, samples
from leanstate.checkpoint import load_checkpoint, save_checkpoint


class TablesLoad:
    """A load of several tables of one checkpoint into fresh stores, on torch's threads or on one."""

    def __init__(self, tables: int, rows: int, dim: int, backend: str | None) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="leanstate-bench-"))
        self.path = self.folder / "ckpt"
        self.names = [f"t{i}" for i in range(tables)]
        self.backend, self.dim = backend, dim
        save_checkpoint(self.path, {name: filled_store(rows, dim, backend) for name in self.names})

    def load(self) -> dict[str, leanstate.KVStore]:
        """Every table into fresh stores, with ``torch.get_num_threads()`` as it is; the stores."""
        targets = {
            name: leanstate.KVStore(self.dim, optimizer_state_dim=1, backend=self.backend)
            for name in self.names
        }
        load_checkpoint(self.path, targets)
        return targets

    def load_one_thread(self) -> dict[str, leanstate.KVStore]:
        """The same load under ``torch.set_num_threads(1)`` (the count restored after)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self.load()
        finally:
            torch.set_num_threads(threads)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _sharded_load_worker(
    rank: int, world: int, port: int, folder: str, rows: int, dim: int, backend: str | None, rounds: int
) -> None:
    """One rank of the version-2 load figure: this rank's share of a table, saved once as
    version 2 across the ranks and once by this rank alone (version 1); then, in rounds, a
    version-2 load of it into fresh stores beside a version-1 load of the same rows."""

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # the ranks share the cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    config = leanstate.KVTableConfig("t", dim, num_embeddings=rows, optimizer="rowwise_adagrad")
    ebc = leanstate.ShardedKVEmbeddingBagCollection([config], backend=backend)
    ids = torch.arange(rows)
    mine = ids[ebc.owner("t", ids) == rank]
    store = ebc.embedding_bags["t"].store
    generator = torch.Generator().manual_seed(rank)
    for start in range(0, len(mine), 100_000):
        part = mine[start : start + 100_000]
        store.set(part, torch.randn(len(part), dim, generator=generator))
    v2, v1 = Path(folder) / "v2", Path(folder) / f"v1.rank{rank}"
    tables = ebc.checkpoint_tables()
    save_checkpoint(v2, tables, process_group=group)
    save_checkpoint(v1, {name: table.store for name, table in tables.items()})
    del ebc, tables, store
    fresh: dict[str, dict] = {}

    def into_fresh(kind: str) -> Callable[[], None]:
        def setup() -> None:
            module = leanstate.ShardedKVEmbeddingBagCollection([config], backend=backend)
            fresh[kind] = module.checkpoint_tables()
            dist.barrier()  # both ranks start the timed load together

        return setup

    def load_v2() -> None:
        load_checkpoint(v2, fresh["v2"], process_group=group)

    def load_v1() -> None:
        load_checkpoint(v1, {name: table.store for name, table in fresh["v1"].items()})

    fns = {"v2": (into_fresh("v2"), load_v2), "v1": (into_fresh("v1"), load_v1)}
    for setup, run in fns.values():  # warm-up: compiles, first touches
        setup()
        run()
    times = samples(fns, rounds)
    loaded = {kind: sum(len(table.store) for table in tables.values()) for kind, tables in fresh.items()}
    if any(n != len(mine) for n in loaded.values()):  # a figure of a load that missed rows would mislead
        raise RuntimeError(f"rank {rank} holds {len(mine)} rows, but the loads left {loaded}")
    result = {"times": times, "rows": len(mine)}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        (Path(folder) / "result.json").write_text(json.dumps(gathered))
    fresh.clear()
    gc.collect()  # each fresh module held the group: collected before the group is destroyed
    dist.destroy_process_group()


def sharded_load_comparison(
    rows: int, dim: int, backend: str | None, rounds: int, world: int = 2
) -> list[dict]:
    """Start ``world`` gloo ranks on 127.0.0.1, each holding its share of a ``rows``-row
    table: per rank, the wall times of a version-2 load of its share (``process_group=``,
    into fresh stores) and of a version-1 load of the same rows in that process, rounds
    interleaved, and the rows it holds (both loads are checked to have left exactly those)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="leanstate-bench-") as folder:
        start_ranks(_sharded_load_worker, (world, port, folder, rows, dim, backend, rounds), world)
        return json.loads((Path(folder) / "result.json").read_text())
