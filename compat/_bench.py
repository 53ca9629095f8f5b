"""Workloads shared by the asv benchmarks and ``python -m leanstate bench``.

Every measurement puts leanstate beside a peer measured in the same process, and the
figure that matters is the ratio. Times are the best of several repeats.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import leanstate
from leanstate import _backends
from leanstate.checkpoint import load_checkpoint, save_checkpoint
from leanstate.reference.legacy_checkpoint import save_legacy_checkpoint


def best_time(fn: Callable[[], object], repeat: int = 5) -> float:
    """Best wall time of ``repeat`` calls, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def best_times(fns: dict[str, Callable[[], object]], repeat: int = 3) -> dict[str, float]:
    """Best wall time of each function, the calls interleaved round by round (fairer under drift)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in times.items()}


Timed = Callable[[], object] | tuple[Callable[[], object], Callable[[], object]]


def samples(fns: dict[str, Timed], rounds: int, inner: int = 1) -> dict[str, list[float]]:
    """Wall times of each function in every round, the calls interleaved round by round.

    A round keeps the best of ``inner`` calls. A ``(setup, run)`` pair times ``run`` only,
    with ``setup`` called untimed before each call.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            setup, run = fn if isinstance(fn, tuple) else (None, fn)
            best = float("inf")
            for _ in range(inner):
                if setup is not None:
                    setup()
                start = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - start)
            times[name].append(best)
    return times


def fill(store: leanstate.KVStore, rows: int) -> leanstate.KVStore:
    """Insert ids ``0..rows-1`` with random weights into ``store``; returns it."""
    generator = torch.Generator().manual_seed(0)
    for start in range(0, rows, 100_000):
        n = min(100_000, rows - start)
        store.set(torch.arange(start, start + n), torch.randn(n, store.dim, generator=generator))
    return store


def filled_store(rows: int, dim: int, backend: str | None, state_dim: int = 1) -> leanstate.KVStore:
    """A store holding ids ``0..rows-1`` with random weights."""
    return fill(leanstate.KVStore(dim, optimizer_state_dim=state_dim, backend=backend), rows)


class KVGetSet:
    """KV get/set of a batch vs ``index_select``/``index_copy_`` on a dense table (the ceiling)."""

    def __init__(self, rows: int, dim: int, batch: int, backend: str | None) -> None:
        self.store = filled_store(rows, dim, backend)
        self.dense = torch.randn(rows, dim)
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, rows, (batch,), generator=generator)
        self.values = torch.randn(batch, dim, generator=generator)
        self.dim = dim
        self.out, self.dense_out = torch.empty(batch, dim), torch.empty(batch, dim)

    def get(self) -> torch.Tensor:
        return self.store.get(self.ids, width=self.dim)

    def get_out(self) -> torch.Tensor:
        return self.store.get(self.ids, width=self.dim, out=self.out)

    def reserve_next(self) -> None:
        """Reserve the rows of the next ``insert`` (untimed setup of the reserved figure)."""
        self.store.reserve(len(self.ids))

    def set(self) -> None:
        self.store.set(self.ids, self.values)

    def insert(self) -> None:
        """Set a batch of ids never seen before (fresh ones at every call)."""
        first = self._next_new = getattr(self, "_next_new", 2**40) + len(self.ids)
        self.store.set(torch.arange(first, first + len(self.ids)), self.values)

    def dense_get(self) -> torch.Tensor:
        return self.dense.index_select(0, self.ids)

    def dense_get_out(self) -> torch.Tensor:
        return torch.index_select(self.dense, 0, self.ids, out=self.dense_out)

    def dense_set(self) -> None:
        self.dense.index_copy_(0, self.ids, self.values)


def plain_write(path: Path, data: np.ndarray, block: int = 64 * 2**20) -> None:
    """The peer of a save: write the same bytes sequentially and fsync."""
    view = memoryview(data).cast("B")
    with open(path, "wb") as f:
        for offset in range(0, len(view), block):
            f.write(view[offset : offset + block])
        f.flush()
        os.fsync(f.fileno())


def plain_read(path: Path) -> np.ndarray:
    """The peer of a load: read the same bytes sequentially into fresh memory."""
    return np.fromfile(path, dtype=np.uint8)


class CheckpointIO:
    """Whole-row save/load vs a plain sequential write/read of the same bytes."""

    def __init__(self, rows: int, dim: int, backend: str | None, chunk_bytes: int = 64 * 2**20) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="leanstate-bench-"))
        self.store = filled_store(rows, dim, backend)
        self.backend, self.dim, self.chunk_bytes = backend, dim, chunk_bytes
        self.path = self.folder / "ckpt"
        save_checkpoint(self.path, {"t": self.store}, chunk_bytes=chunk_bytes)
        self.bytes = np.fromfile(self.path / "t.rows", dtype=np.uint8)
        self.plain = self.folder / "plain.bin"
        plain_write(self.plain, self.bytes)

    def save(self) -> None:
        save_checkpoint(self.path, {"t": self.store}, chunk_bytes=self.chunk_bytes)

    def load(self) -> None:
        target = leanstate.KVStore(self.dim, optimizer_state_dim=1, backend=self.backend)
        load_checkpoint(self.path, {"t": target}, chunk_bytes=self.chunk_bytes)

    def dcp_save(self) -> None:
        from leanstate import dcp

        dcp.save({"t": self.store}, checkpoint_id=self.folder / "dcp")

    def dcp_load(self) -> None:
        from leanstate import dcp

        target = leanstate.KVStore(self.dim, optimizer_state_dim=1, backend=self.backend)
        dcp.load({"t": target}, checkpoint_id=self.folder / "dcp")

    def write_plain(self) -> None:
        plain_write(self.plain, self.bytes)

    def read_plain(self) -> None:
        plain_read(self.plain)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


_MEMORY_PROBE = """
import ctypes, gc, json, sys, torch, leanstate
from leanstate.checkpoint import load_checkpoint
from leanstate.reference.legacy_checkpoint import load_legacy_checkpoint
kind, path, rows, dim, backend, chunk = sys.argv[1:7]
rows, dim, chunk = int(rows), int(dim), int(chunk)
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
store = leanstate.KVStore(dim, optimizer_state_dim=1, backend=backend)
for start in range(0, rows, 100_000):  # a live store that already holds the rows
    n = min(100_000, rows - start)
    store.set(torch.arange(start, start + n), torch.zeros(n, dim))
store.set_rows(store.get_rows(torch.arange(min(rows, 8))))  # compiled now, not inside the measure
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
if kind == "whole":
    load_checkpoint(path, {"t": store}, chunk_bytes=chunk)
else:
    load_legacy_checkpoint(path, {"t": store})
print(json.dumps({"extra": status("VmHWM") - base}))
"""


def load_peak_extra_bytes(rows: int, dim: int, backend: str, chunk_bytes: int) -> dict[str, int]:
    """Peak RSS a load adds to a live store holding the rows: whole-row vs legacy, in bytes."""
    folder = Path(tempfile.mkdtemp(prefix="leanstate-mem-"))
    try:
        store = filled_store(rows, dim, backend)
        save_checkpoint(folder / "whole", {"t": store}, chunk_bytes=chunk_bytes)
        save_legacy_checkpoint(folder / "legacy", {"t": store})
        del store
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        out = {}
        for kind in ("whole", "legacy"):
            args = [kind, str(folder / kind), str(rows), str(dim), backend, str(chunk_bytes)]
            done = subprocess.run(
                [sys.executable, "-c", _MEMORY_PROBE, *args], capture_output=True, text=True, check=True
            )
            out[kind] = json.loads(done.stdout)["extra"]
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _quiet_fds():
    """Send what native code prints to fds 1 and 2 (the profiler's ``USDT:`` lines) to /dev/null."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


class WrapperStep:
    """A training step of a transformer stack, plain or wrapped by leanstate's or torch's wrappers."""

    VARIANTS = ("none", "checkpoint", "torch_checkpoint", "offload", "torch_offload")

    def __init__(self, variant: str, layers: int = 6, d: int = 512, seq: int = 256, batch: int = 8) -> None:
        from torch import nn
        from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrappers

        torch.manual_seed(0)
        self.model = nn.Sequential(
            *(nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.1, batch_first=True) for _ in range(layers))
        )

        def is_layer(module):
            return isinstance(module, nn.TransformerEncoderLayer)

        if variant == "checkpoint":
            leanstate.apply_activation_checkpointing(self.model, check_fn=is_layer)
        elif variant == "torch_checkpoint":
            torch_wrappers.apply_activation_checkpointing(self.model, check_fn=is_layer)
        elif variant == "offload":
            self.model = leanstate.offload_wrapper(self.model)
        elif variant == "torch_offload":
            self.model = torch_wrappers.offload_wrapper(self.model)
        self.x = torch.randn(batch, seq, d)

    def step(self) -> None:
        torch.manual_seed(1)
        self.model(self.x).sum().backward()
        self.model.zero_grad(set_to_none=True)

    def saved_bytes(self) -> int:
        """Bytes allocated by a forward and still held when it returns (its saved state)."""
        from torch.profiler import ProfilerActivity, profile

        torch.manual_seed(1)
        with _quiet_fds(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = self.model(self.x)
        del out
        return sum(event.self_cpu_memory_usage for event in prof.events())


class EmbeddingStep:
    """Forward + backward + update of a KV embedding bag, or of nn.EmbeddingBag(sparse=True) + torch.optim."""

    def __init__(
        self,
        kind: str,
        optimizer: str,
        rows: int,
        dim: int = 128,
        batch: int = 4096,
        per_bag: int = 20,
        backend: str | None = None,
    ) -> None:
        from torch import nn

        from leanstate.embedding import KVEmbeddingBag

        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, rows, (batch * per_bag,), generator=generator)
        self.offsets = torch.arange(0, batch * per_bag, per_bag)
        self.upstream = torch.randn(batch, dim, generator=generator)
        self.kind = kind
        if kind == "kv":
            self.bag = KVEmbeddingBag(rows, dim, optimizer=optimizer, lr=0.01, backend=backend)
            fill(self.bag.store, rows)
        else:
            self.bag = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
            cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adagrad
            self.optimizer = cls(self.bag.parameters(), lr=0.01)

    def step(self) -> None:
        (self.bag(self.ids, self.offsets) * self.upstream).sum().backward()
        if self.kind != "kv":
            self.optimizer.step()
            self.optimizer.zero_grad()


def _zero_worker(rank: int, world: int, port: int, out: str, steps: int) -> None:
    """One rank of the ZeRO comparison: interleaved steps of leanstate's and torch's."""
    import statistics

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counts = {"broadcast": 0}
    broadcast = dist.broadcast

    def counting_broadcast(*args, **kwargs):
        counts["broadcast"] += 1
        return broadcast(*args, **kwargs)

    def build(kind):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8)))
        if kind == "torch":
            optimizer = TorchZero(
                model.parameters(), torch.optim.Adam, parameters_as_bucket_view=True, lr=1e-3
            )
        else:
            optimizer = leanstate.ZeroRedundancyOptimizer(
                model.parameters(),
                torch.optim.Adam,
                parameters_as_bucket_view=True,
                lr=1e-3,
            )
        x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(rank))
        model(x).square().mean().backward()
        return model, optimizer

    runs = {kind: build(kind) for kind in ("leanstate", "torch")}
    times: dict[str, list[float]] = {kind: [] for kind in runs}
    for step in range(steps + 2):  # two warm-up steps, then interleaved timings
        for kind, (_, optimizer) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            optimizer.step()
            if step >= 2:
                times[kind].append(time.perf_counter() - start)
    dist.broadcast = counting_broadcast
    runs["leanstate"][1].step()
    dist.broadcast = broadcast
    consolidate = {}
    for kind, (_, optimizer) in runs.items():
        dist.barrier()
        start = time.perf_counter()
        optimizer.consolidate_state_dict(to=0)
        consolidate[kind] = time.perf_counter() - start
    optim = runs["leanstate"][1].optim
    state_bytes = sum(
        t.numel() * t.element_size() for s in optim.state.values() for t in s.values() if torch.is_tensor(t)
    )
    total_state = sum(2 * p.numel() * 4 for p in runs["leanstate"][0].parameters())
    largest = max(2 * p.numel() * 4 for p in runs["leanstate"][0].parameters())
    if rank == 0:
        result = {
            "step": {k: statistics.median(v) for k, v in times.items()},
            "steps": times,
            "broadcasts": counts["broadcast"],
            "consolidate": consolidate,
            "state_bytes": state_bytes,
            "even_share": total_state / world,
            "largest": largest,
        }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a gloo rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def zero_comparison(world: int = 2, steps: int = 10) -> dict:
    """Spawn ``world`` gloo ranks on 127.0.0.1 comparing leanstate's ZeRO with torch's."""
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "zero.json")
        mp.start_processes(_zero_worker, args=(world, port, out, steps), nprocs=world, start_method="spawn")
        return json.loads(Path(out).read_text())


def _sharded_worker(rank: int, world: int, port: int, out: str, steps: int, dim: int, ids: int) -> None:
    """One rank of the sharded benchmark: step times, and the bytes it sent against the minimum."""
    import statistics

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = leanstate.KVTableConfig("t", dim, num_embeddings=10_000_000, optimizer="rowwise_adagrad")
    ebc = leanstate.ShardedKVEmbeddingBagCollection([config])
    generator = torch.Generator().manual_seed(rank)
    per_bag = 8
    times = []
    for step in range(steps + 2):
        batch = leanstate.KeyedJaggedTensor(
            ["t"], torch.randint(0, 10_000_000, (ids,), generator=generator),
            lengths=torch.full((ids // per_bag,), per_bag),
        )  # fmt: skip
        if step == 2:
            ebc.exchange_stats.update(bytes=0, min_bytes=0)
            ebc.exchange_stats["seconds"].clear()
            cpu = time.process_time()
        dist.barrier()
        start = time.perf_counter()
        ebc(batch).values().sum().backward()
        dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu  # every thread of this rank, barriers' waits included
    phases = sorted(ebc.exchange_stats["seconds"])
    totals = torch.tensor([ebc.exchange_stats["bytes"], ebc.exchange_stats["min_bytes"]], dtype=torch.float64)
    seconds = torch.tensor([cpu] + [ebc.exchange_stats["seconds"][p] for p in phases], dtype=torch.float64)
    dist.all_reduce(totals)
    dist.all_reduce(seconds)
    if rank == 0:
        result = {
            "step": statistics.median(times),
            "bytes": int(totals[0]),
            "min_bytes": int(totals[1]),
            "cpu_per_id": float(seconds[0]) / (world * ids * steps),  # summed over ranks
            "phases": {p: float(v) / (world * steps) for p, v in zip(phases, seconds[1:], strict=True)},
        }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def sharded_comparison(world: int, steps: int = 5, dim: int = 64, ids: int = 16_384) -> dict:
    """Spawn ``world`` gloo ranks stepping a sharded table (``ids`` lookups per rank per step);
    the median step time and the bytes exchanged against the minimum, summed over ranks."""
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "sharded.json")
        mp.start_processes(
            _sharded_worker, args=(world, port, out, steps, dim, ids), nprocs=world, start_method="spawn"
        )
        return json.loads(Path(out).read_text())


_THREADS_PROBE = """
import json, statistics, time, torch
from leanstate.embedding import KVEmbeddingBag
bag = KVEmbeddingBag(100_000, 128, optimizer="rowwise_adagrad", lr=0.01, backend="numba")
generator = torch.Generator().manual_seed(0)
bag.store.set(torch.arange(100_000), torch.randn(100_000, 128, generator=generator))
ids = torch.randint(0, 100_000, (256 * 20,), generator=generator)
offsets, upstream = torch.arange(0, 256 * 20, 20), torch.randn(256, 128, generator=generator)
rows = bag.store.get_rows(torch.tensor([1, 2]))
def step():
    (bag(ids, offsets) * upstream).sum().backward()
def set_rows():
    bag.store.set_rows(rows)
out = {}
for name, fn, calls in (("step", step, 60), ("set_rows", set_rows, 400)):
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    out[name] = statistics.median(times)
print(json.dumps(out))
"""


def threads_under_load(rounds: int) -> dict[str, list[float]]:
    """Median times of a 256 x 20 embedding step and of a 2-row ``set_rows`` (numba), with a
    second CPU-bound process running: numba's default threads, then ``NUMBA_NUM_THREADS=1``
    (the peer), alternating in fresh processes; one sample per round each."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        results: dict[str, list[float]] = {}
        for _ in range(rounds):
            for kind, extra in (("default", {}), ("one", {"NUMBA_NUM_THREADS": "1"})):
                env = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"} | extra
                done = subprocess.run(
                    [sys.executable, "-c", _THREADS_PROBE],
                    capture_output=True,
                    text=True,
                    check=True,
                    env=env,
                )
                for name, value in json.loads(done.stdout).items():
                    results.setdefault(f"{name} {kind}", []).append(value)
        return results
    finally:
        busy.kill()
        busy.wait()


# DCP save and load throughput against the native whole-row format's, in the same run.
DCP_TARGET = (">=", 0.7)


def _target(component: str, op: str, backend: str) -> tuple[str, float] | None:
    """The target of ``op`` declared by ``backend``'s engine module of ``component``
    (``BENCH_TARGETS``: throughput of leanstate / throughput of the peer, 1.0 = as fast,
    or for memory the plain ratio of the two figures); None: reported, no target."""
    module, _ = _backends.load(component, backend)
    return getattr(module, "BENCH_TARGETS", {}).get(op)


def _verdict(ratios: list[float], target: tuple[str, float] | None) -> str:
    """ "yes" when every sample meets the target, "no" when none does, else "noisy"."""
    if target is None:
        return "-"
    op, value = target
    meets = [(r >= value if op == ">=" else r <= value) for r in ratios]
    return "yes" if all(meets) else "no" if not any(meets) else "noisy"


def _line(component, measure, backend, ours, peer_name, peer, target, *, time=True) -> tuple:
    """One row of the bench table from samples of leanstate's figure and its peer's (lists
    of the same length, or one number): medians, the median ratio (a throughput ratio for
    times, the plain ratio for sizes), the ratios' spread, the target and the verdict."""
    ours = ours if isinstance(ours, list) else [ours]
    peer = peer if isinstance(peer, list) else [peer] * len(ours)
    ratios = [(p / o if time else o / p) for o, p in zip(ours, peer, strict=True)]
    spread = f"{min(ratios):.4g}..{max(ratios):.4g}" if len(ratios) > 1 else f"{ratios[0]:.4g}"
    shown = "-" if target is None else f"{target[0]} {target[1]}"
    return (
        component, measure, backend, statistics.median(ours), peer_name, statistics.median(peer),
        statistics.median(ratios), spread, shown, _verdict(ratios, target),
    )  # fmt: skip


def store_figures(
    rows: int, dim: int, batch: int, backends: list[str] | None = None, rounds: int = 5
) -> list[tuple]:
    """The store's rows of the bench table (get, get into ``out``, set, insert with and
    without ``reserve``, memory) for every available store backend of the registry (or
    ``backends``), each beside the dense peer."""
    lines = []
    for name in _backends.available("kv_store") if backends is None else backends:
        kv = KVGetSet(rows, dim, batch, name)
        for op, label, peer_name, ours, peer in (
            ("get", "get", "dense index_select", kv.get, kv.dense_get),
            ("get_out", "get(out=)", "index_select(out=)", kv.get_out, kv.dense_get_out),
            ("set", "set", "dense index_copy_", kv.set, kv.dense_set),
            ("insert", "insert", "dense index_copy_", kv.insert, kv.dense_set),
            ("insert_reserved", "reserve+insert", "dense index_copy_", (kv.reserve_next, kv.insert), kv.dense_set),
        ):  # fmt: skip
            (ours[1] if isinstance(ours, tuple) else ours)()  # warm-up
            times = samples({"ours": ours, "peer": peer}, rounds, inner=3)
            target = _target("kv_store", op, name)
            lines.append(
                _line(
                    "kv_store",
                    f"{label} {batch} ids s",
                    name,
                    times["ours"],
                    peer_name,
                    times["peer"],
                    target,
                )
            )
        per_row = kv.store.memory_bytes() / len(kv.store)
        target = _target("kv_store", "memory", name)
        row_bytes = kv.store.layout.row_bytes
        lines.append(
            _line("kv_store", "memory bytes/row", name, per_row, "row bytes", row_bytes, target, time=False)
        )
        del kv
    return lines


def report(
    rows: int = 200_000,
    dim: int = 128,
    batch: int = 16_384,
    backend: str | None = None,
    wrapper_batch: int = 2,
    quick: bool = False,
    checkpoint_rows: int | None = None,
) -> list[dict]:
    """Run the benchmarks (``quick``: fewer rounds, steps and ranks); rows (dicts of ``COLUMNS``)
    of leanstate beside its peer, with targets.

    Every figure is measured in several rounds, leanstate's and the peer's interleaved;
    the row gives the medians, the median ratio and the ratios' spread. ``ratio`` is a
    throughput ratio for times (peer time / leanstate time: 1.0 = as fast as the peer,
    higher is better) and the plain ratio leanstate / peer for sizes. ``met`` is "yes"
    when every round meets the target, "no" when none does, and "noisy" otherwise. The
    store rows run on every registered backend; the rest on ``backend`` (default: the
    import-time choice). Targets apply to the accelerated backends; the reference is
    reported beside them. ``checkpoint_rows``: the table of the checkpoint figures
    (default ``rows``).
    """
    backend = backend or leanstate.backend_info().chosen["kv_store"]
    checkpoint_rows = checkpoint_rows or rows
    rounds = 3 if quick else 5
    lines = []

    def add(component, measure, ours, peer_name, peer, target, *, time=True, name=backend):
        lines.append(_line(component, measure, name, ours, peer_name, peer, target, time=time))

    lines.extend(store_figures(rows, dim, batch, rounds=rounds))
    for name in _backends.available("kv_store"):
        io = CheckpointIO(checkpoint_rows, dim, name)
        try:
            io.dcp_save()
            io.load()
            times = samples(
                {
                    "save": io.save,
                    "write": io.write_plain,
                    "load": io.load,
                    "read": io.read_plain,
                    "dcp save": io.dcp_save,
                    "dcp load": io.dcp_load,
                },
                rounds,
            )
        finally:
            io.close()
        for op, peer_name, peer in (("save", "plain write+fsync", "write"), ("load", "plain read", "read")):
            target = _target("kv_store", op, name)
            measure = f"{op} {checkpoint_rows} rows s"
            add("checkpoint", measure, times[op], peer_name, times[peer], target, name=name)
        for op in ("save", "load"):  # the same table through torch.distributed.checkpoint
            mine = f"dcp {op}"
            add(
                "checkpoint",
                f"{mine} {checkpoint_rows} rows s",
                times[mine],
                f"whole-row {op}",
                times[op],
                DCP_TARGET,
                name=name,
            )
    chunk = 16 * 2**20
    memory = load_peak_extra_bytes(rows, dim, backend, chunk)
    table = rows * (8 + (dim + 1) * 4)  # ids, weights and optimizer state: what legacy holds
    add(
        "checkpoint",
        "whole-row load extra MiB",
        memory["whole"] / 2**20,
        "2 x chunk + 64 MiB",
        (2 * chunk + 64 * 2**20) / 2**20,
        ("<=", 1.0),
        time=False,
    )
    add(
        "checkpoint",
        "legacy load extra MiB",
        memory["legacy"] / 2**20,
        "table MiB",
        table / 2**20,
        (">=", 1.0),
        time=False,
    )
    steps = {v: WrapperStep(v, batch=wrapper_batch) for v in WrapperStep.VARIANTS}
    for w in steps.values():
        w.step()  # warm-up
    times = samples({v: w.step for v, w in steps.items()}, rounds)
    saved = {v: w.saved_bytes() for v, w in steps.items()}
    add(
        "wrappers",
        f"checkpoint step s (batch {wrapper_batch})",
        times["checkpoint"],
        "torch checkpoint_wrapper",
        times["torch_checkpoint"],
        (">=", 0.95),
        name="reference",
    )
    add(
        "wrappers",
        "checkpoint saved MiB",
        saved["checkpoint"] / 2**20,
        "torch checkpoint_wrapper",
        saved["torch_checkpoint"] / 2**20,
        ("<=", 1.0),
        time=False,
        name="reference",
    )
    add(
        "wrappers",
        "offload saved MiB",
        saved["offload"] / 2**20,
        "no wrapper",
        saved["none"] / 2**20,
        ("<=", 1.0),
        time=False,
        name="reference",
    )
    add(
        "wrappers",
        "torch offload saved MiB",
        saved["torch_offload"] / 2**20,
        "no wrapper",
        saved["none"] / 2**20,
        None,
        time=False,
        name="reference",
    )
    add(
        "wrappers",
        f"offload step s (batch {wrapper_batch})",
        times["offload"],
        "torch offload_wrapper",
        times["torch_offload"],
        None,
        name="reference",
    )
    del steps
    for name, (optimizer, peer) in itertools.product(
        _backends.available("embedding"), (("sgd", "sgd"), ("rowwise_adagrad", "adagrad"))
    ):
        ours = EmbeddingStep("kv", optimizer, rows, dim, backend=name)
        dense = EmbeddingStep("dense", peer, rows, dim)
        ours.step()
        dense.step()
        times = samples({"ours": ours.step, "peer": dense.step}, rounds)
        add(
            "embedding",
            f"{optimizer} step s (B=4096x20)",
            times["ours"],
            f"EmbeddingBag(sparse)+{peer}",
            times["peer"],
            _target("embedding", optimizer, name),
            name=name,
        )
        del ours, dense
    if "numba" in _backends.available("embedding"):
        loaded = threads_under_load(2 if quick else 3)
        for figure, measure in (
            ("step", "256x20 step s, CPU-bound neighbour"),
            ("set_rows", "set_rows 2 rows s, CPU-bound neighbour"),
        ):
            add(
                "threads",
                measure,
                loaded[f"{figure} default"],
                "NUMBA_NUM_THREADS=1",
                loaded[f"{figure} one"],
                (">=", 0.8),
                name="numba",
            )  # fmt: skip
    zero = zero_comparison(steps=4 if quick else 10)
    add(
        "zero",
        "step s (2 ranks, buckets)",
        zero["steps"]["leanstate"],
        "torch ZeRO",
        zero["steps"]["torch"],
        (">=", 1.05),
        name="reference",
    )
    add(
        "zero",
        "broadcasts per step",
        zero["broadcasts"],
        "world size",
        2,
        ("<=", 1.0),
        time=False,
        name="reference",
    )
    consolidate = zero["consolidate"]
    add(
        "zero",
        "consolidate s (~32 MiB/rank)",
        consolidate["leanstate"],
        "torch ZeRO",
        consolidate["torch"],
        (">=", 1.0),
        name="reference",
    )
    add(
        "zero",
        "consolidate s (~32 MiB/rank)",
        consolidate["leanstate"],
        "budget s",
        0.1,
        ("<=", 1.0),
        time=False,
        name="reference",
    )
    add(
        "zero",
        "state MiB on rank 0",
        zero["state_bytes"] / 2**20,
        "total / world",
        zero["even_share"] / 2**20,
        ("<=", 1.001),
        time=False,
        name="reference",
    )
    ids = 4096 if quick else 16_384
    exchange = {"steps": 2, "ids": ids} if quick else {}
    embedding = leanstate.backend_info().chosen["embedding"]
    single = sharded_comparison(1, **exchange)
    for world in (1, 2) if quick else (1, 2, 3):
        run = single if world == 1 else sharded_comparison(world, **exchange)
        add(
            "sharded",
            f"lookups+updates/s, {world} rank(s) x {ids}",
            world * ids / run["step"],
            "1 rank",
            ids / single["step"],
            None,
            time=False,
            name=embedding,
        )
        if world == 1:
            continue
        add(
            "sharded",
            f"CPU s per lookup+update, all {world} ranks",
            run["cpu_per_id"],
            "1 rank",
            single["cpu_per_id"],
            ("<=", 1.5) if world == 2 else None,
            time=False,
            name=embedding,
        )
        add(
            "sharded",
            f"bytes exchanged / minimum, {world} ranks",
            run["bytes"],
            "distinct ids x (row + grad)",
            run["min_bytes"],
            ("<=", 1.1),
            time=False,
            name=embedding,
        )
        if world == 2:  # where a step's time goes, per rank (the 1-rank run beside it)
            for phase, seconds in run["phases"].items():
                add(
                    "sharded",
                    f"{phase} s per step, 2 ranks",
                    seconds,
                    "1 rank",
                    single["phases"].get(phase, float("nan")),
                    None,
                    time=False,
                    name=embedding,
                )
    return [dict(zip(COLUMNS, line, strict=True)) for line in lines]


COLUMNS = (
    "component", "measure", "backend", "leanstate", "peer", "peer value", "ratio", "spread", "target", "met",
)  # fmt: skip


def format_table(rows: list[dict]) -> str:
    """The rows as a plain-text table, numbers to four significant digits."""

    def cell(value) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    cells = [list(COLUMNS)] + [[cell(row[c]) for c in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    numeric = {"leanstate", "peer value", "ratio"}
    out = []
    for line in cells:
        out.append(
            " ".join(
                value.rjust(width) if COLUMNS[i] in numeric else value.ljust(width)
                for i, (value, width) in enumerate(zip(line, widths, strict=True))
            ).rstrip()
        )
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """A PNG of each figure's ratio beside its target (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['component']}: {r['measure']} [{r['backend']}]" for r in rows]
    figure, axes = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.5))
    colours = {"yes": "tab:green", "no": "tab:red", "noisy": "tab:orange", "-": "tab:gray"}
    axes.barh(range(len(rows)), [r["ratio"] for r in rows], color=[colours[r["met"]] for r in rows])
    for i, r in enumerate(rows):
        if r["target"] != "-":
            axes.plot([float(r["target"].split()[1])] * 2, [i - 0.4, i + 0.4], color="black")
    axes.set_yticks(range(len(rows)), labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_xscale("log")
    axes.set_xlabel("median ratio against the peer (black: target; green met, red missed, orange noisy)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
