"""A follower beside its peers (``python -m leanstate bench``): applying a delta of 1% of
a table beside a full load of it, a reader's latency while deltas are applied beside the
same reader idle, the longest a reader waited, and an apply's extra memory beside the
delta's own bytes (``spec/follower.md``)."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import torch

import leanstate
from leanstate._tools.workloads import filled_store
from leanstate.checkpoint import load_checkpoint, save_checkpoint

APPLY_TARGET = 10.0  # a 1% delta applies at least 10x faster than a full load of the table
READER_P99_TARGET = 1 / 2.0  # a reader's p99 during applies at most 2x its idle p99
PAUSE_BUDGET_S = 0.010  # the longest a reader call takes during applies: the commit step
MEMORY_TARGET = 1 / 2.5  # an apply holds at most 2.5x the delta's bytes (staged rows, read slices)
READ_IDS = 4096


class FollowedChain:
    """A table of ``rows`` rows saved full, then ``links`` deltas each after touching 1% of
    its rows (written, a few new, and deleted), saved aside and published one at a time
    (renamed) into the followed directory; a serving store following it."""

    def __init__(self, rows: int, dim: int, backend: str, links: int) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="leanstate-follow-"))
        self.saved, self.followed = self.root / "saved", self.root / "followed"
        self.followed.mkdir()
        self.dim, self.backend = dim, backend
        trainer = filled_store(rows, dim, backend)
        generator = torch.Generator().manual_seed(11)
        save_checkpoint(self.saved / "c000", {"t": trainer})
        for k in range(1, links + 1):
            count = rows // 100
            ids = torch.randint(0, int(rows * 1.01), (count,), generator=generator)
            trainer.set(ids, torch.randn(count, dim, generator=generator))
            trainer.delete(torch.randint(0, rows, (count // 20,), generator=generator))
            save_checkpoint(self.saved / f"c{k:03d}", {"t": trainer}, base=self.saved / f"c{k - 1:03d}")
        del trainer
        self.links = sorted(self.saved.iterdir())
        self.serving = leanstate.KVStore(dim, optimizer_state_dim=1, backend=backend)
        self.follower = leanstate.Follower(self.followed, {"t": self.serving})
        self.ids = torch.randint(0, rows, (READ_IDS,), generator=generator)
        self.out = torch.empty(READ_IDS, dim)

    def publish(self, k: int) -> int:
        """Link ``k`` renamed into the followed directory (as a save publishes); its bytes."""
        path = self.followed / self.links[k].name
        self.links[k].rename(path)
        return sum(p.stat().st_size for p in path.iterdir())

    def full_load(self) -> None:
        store = leanstate.KVStore(self.dim, optimizer_state_dim=1, backend=self.backend)
        load_checkpoint(self.followed / self.links[0].name, {"t": store})

    def read_while(self, work: Callable[[], None]) -> list[float]:
        """The seconds of each ``get`` of ``READ_IDS`` ids a reader thread makes while ``work`` runs."""
        latencies, stop = [], threading.Event()

        def read() -> None:
            while not stop.is_set():
                start = time.perf_counter()
                self.serving.get(self.ids, width=self.dim, out=self.out)
                latencies.append(time.perf_counter() - start)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            work()
        finally:
            stop.set()
            reader.join()
        return latencies

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]


def follower_figures(
    rows: int, dim: int, backend: str, links: int, line: Callable[..., tuple]
) -> list[tuple]:
    """The follower's rows of the bench table on ``backend``, made by ``line``: ``links``
    deltas of 1% of ``rows`` rows, each published and applied while a reader reads."""
    chain = FollowedChain(rows, dim, backend, links)
    try:
        chain.publish(0)
        chain.publish(1)
        chain.follower.poll()  # the full checkpoint and a delta: every kernel compiled, untimed
        full_loads, applies = [], []

        def apply_all() -> None:
            for k in range(2, len(chain.links) - 1):
                chain.publish(k)
                chain.follower.poll()
                applies.append(chain.follower.history[-1].seconds)

        during = chain.read_while(apply_all)
        spent = sum(applies)
        idle = chain.read_while(lambda: time.sleep(spent))
        # The last link applied alone, its allocations traced (numpy's buffers are: the read
        # slices and the staged rows), beside the delta's own bytes.
        delta_bytes = chain.publish(len(chain.links) - 1)
        tracemalloc.start()
        chain.follower.poll()
        extra = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        for _ in range(3):
            start = time.perf_counter()
            chain.full_load()
            full_loads.append(time.perf_counter() - start)
    finally:
        chain.close()
    full = statistics.median(full_loads)
    share = f"1% of {rows} rows"
    lines = [
        line("follower", f"apply a delta of {share} s", backend, applies, "full load of the table", full,
             APPLY_TARGET),
        line("follower", f"reader p99 of a {READ_IDS}-id get during applies s", backend, _p99(during),
             "the same reader idle", _p99(idle), READER_P99_TARGET),
        line("follower", "longest reader get during applies s", backend, max(during), "the budget",
             PAUSE_BUDGET_S, 1.0),
    ]  # fmt: skip
    lines.append(
        line(
            "follower",
            f"extra memory of applying a delta of {share} bytes",
            backend,
            extra,
            "the delta's files",
            delta_bytes,
            MEMORY_TARGET,
        )  # fmt: skip
    )
    return lines
