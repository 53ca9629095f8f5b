"""Workloads shared by the asv benchmarks, ``python -m leanstate bench`` and the demo.

Every measurement puts leanstate beside a peer measured in the same process, and the
figure that matters is the ratio. Times are the best of several repeats.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import mmap
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
from leanstate._tools.ranks import free_port, start_ranks
from leanstate.checkpoint import load_checkpoint, save_checkpoint
from leanstate.checkpoint.legacy import load_legacy_checkpoint, save_legacy_checkpoint


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


def fresh_read(path: Path) -> np.ndarray:
    """The same bytes read into freshly allocated memory (``np.fromfile``): each new page
    faulted in as it is written, so not the machine's ceiling; kept as a labelled row."""
    return np.fromfile(path, dtype=np.uint8)


def faulted(size: int) -> np.ndarray:
    """A buffer of ``size`` bytes, every page written once (faulted in) before any timing."""
    buffer = np.empty(size, dtype=np.uint8)
    buffer.fill(1)
    return buffer


def read_into(path: Path, buffer: np.ndarray) -> None:
    """The fastest plain read of a file: ``readinto`` a faulted buffer of its size, unbuffered."""
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise EOFError(f"{path} is shorter than its buffer")
            done += got


def mmap_copy(path: Path, buffer: np.ndarray) -> None:
    """The file's bytes copied out of an ``mmap`` of it into a faulted buffer (faster than
    ``read`` on some kernels: it is the other candidate for the ceiling)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        source = np.frombuffer(mapped, dtype=np.uint8)
        np.copyto(buffer, source)
        del source  # the map closes only once no array views it


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
        # the ceiling's buffers, faulted now: a read into them costs the copy, not page faults
        self.buffer, self.copy = faulted(len(self.bytes)), faulted(len(self.bytes))
        save_legacy_checkpoint(self.folder / "legacy", {"t": self.store})

    def save(self) -> None:
        save_checkpoint(self.path, {"t": self.store}, chunk_bytes=self.chunk_bytes)

    def load(self) -> None:
        target = leanstate.KVStore(self.dim, optimizer_state_dim=1, backend=self.backend)
        load_checkpoint(self.path, {"t": target}, chunk_bytes=self.chunk_bytes)

    def legacy_load(self) -> None:
        """The legacy format's load into a fresh store: every id, weight and state held, then applied."""
        target = leanstate.KVStore(self.dim, optimizer_state_dim=1, backend=self.backend)
        load_legacy_checkpoint(self.folder / "legacy", {"t": target})

    def dcp_save(self) -> None:
        from leanstate import dcp

        dcp.save({"t": self.store}, checkpoint_id=self.folder / "dcp")

    def dcp_load(self) -> None:
        from leanstate import dcp

        target = leanstate.KVStore(self.dim, optimizer_state_dim=1, backend=self.backend)
        dcp.load({"t": target}, checkpoint_id=self.folder / "dcp")

    def write_plain(self) -> None:
        plain_write(self.plain, self.bytes)

    def read_fresh(self) -> None:
        fresh_read(self.plain)

    def read_plain(self) -> None:
        """The ceiling of a load: the same bytes ``readinto`` a buffer faulted before timing."""
        read_into(self.plain, self.buffer)

    def read_mapped(self) -> None:
        mmap_copy(self.plain, self.buffer)

    def copy_memory(self) -> None:
        """The physical limit beside it: a memcpy of as many bytes between faulted buffers."""
        np.copyto(self.copy, self.buffer)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


_MEMORY_PROBE = """
import ctypes, gc, json, sys, torch, leanstate
from leanstate.checkpoint import load_checkpoint
from leanstate.checkpoint.legacy import load_legacy_checkpoint
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

    def track(self, enabled: bool) -> None:
        """Change tracking on or off in the bag's stores (a KV bag)."""
        for store in (self.bag.store, self.bag.state_store):
            if store is not None:
                store.track_changes(enabled)


def _zero_worker(rank: int, world: int, port: int, out: str, steps: int) -> None:
    """One rank of the ZeRO comparison: interleaved steps of leanstate's and torch's."""

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


def zero_comparison(world: int = 2, steps: int = 10) -> dict:
    """Start ``world`` gloo ranks on 127.0.0.1 comparing leanstate's ZeRO with torch's."""
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "zero.json")
        start_ranks(_zero_worker, (world, port, out, steps), world)
        return json.loads(Path(out).read_text())


def _sharded_worker(rank: int, world: int, port: int, out: str, steps: int, dim: int, ids: int) -> None:
    """One rank of the sharded benchmark: step times, and the bytes it sent against the minimum."""

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
    """Start ``world`` gloo ranks stepping a sharded table (``ids`` lookups per rank per step);
    the median step time and the bytes exchanged against the minimum, summed over ranks."""
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "sharded.json")
        start_ranks(_sharded_worker, (world, port, out, steps, dim, ids), world)
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
