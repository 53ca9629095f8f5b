"""``python -m leanstate gpu-check`` (``make gpu-check``): the GPU bench and the GPU tests, one run.

On a CUDA machine it measures, for every backend that runs on the device, each figure
in its own try, warmed up before it is timed, and written to ``gpu_bench.txt`` and
``gpu_bench.json`` in the output folder the moment it is measured (a figure that
fails is written as a failure, and the next one runs):

- find and insert-or-assign in billions of key-value pairs per second at dim 64, beside
  HierarchicalKV's published A100 figures (find 2.0, insert_or_assign 0.83 B KV/s:
  published, not measured here; an H200 has about 2.4x an A100's bandwidth) and beside
  this device's own ``index_select`` / ``index_copy_`` on a dense table, the ceiling;
- get and set beside ``index_select`` / ``index_copy_``;
- a KVEmbeddingBag training step beside ``nn.EmbeddingBag(sparse=True)`` + SGD;
- the offload wrapper's training step beside torch's ``offload_wrapper``;
- waits for the device per get, set (new ids) and training step: leanstate's own count
  (``host_read``) and, on a GPU, torch's sync debug mode's.

Then it runs the ``gpu``-marked tests in the time left. ``--simulate`` runs the same
script in numba's CUDA simulator at tiny sizes (the figures then say nothing about
speed; the run says the script works). Without a CUDA device and without
``--simulate`` it says so and exits 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from leanstate import _backends
from leanstate._host_reads import host_reads
from leanstate.embedding import KVEmbeddingBag
from leanstate.kv_store import KVStore

HIERARCHICAL_KV_A100 = {"find": 2.0, "insert_or_assign": 0.83}  # B KV/s, dim 64, published
NO_DEVICE = (
    "gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to measure "
    "(--simulate runs the script in numba's CUDA simulator)"
)
BUDGET_S = 480  # the whole check, tests included, on one GPU
T = TypeVar("T")
BUDGET = {"get": 0, "set (new ids)": 2, "training step": 4}  # waits per call, spec/backends.md


@dataclass(frozen=True)
class Sizes:
    """How big each figure's work is."""

    rows: int
    batch: int
    embedding_rows: int
    embedding_batch: int
    wrapper_layers: int
    wrapper_width: int
    repeat: int


GPU_SIZES = Sizes(2**22, 2**20, 2**22, 4096, 6, 1024, 5)
SIMULATED_SIZES = Sizes(64, 16, 64, 4, 1, 8, 2)


def device_backends(component: str, device: torch.device) -> list[str]:
    """The available backends of ``component`` whose engines run on ``device``'s type."""
    found = []
    for backend in _backends.available(component):
        module, _ = _backends.load(component, backend)
        if backend != "reference" and device.type in module.DEVICES:
            found.append(backend)
    return found


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeat: int, warmup: int = 2) -> float:
    """Best wall time of ``repeat`` calls after ``warmup`` untimed ones (compiles, caches,
    pools), the device synchronised around each."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def line(
    measure: str,
    backend: str,
    ours: float,
    peer_name: str,
    peer: float,
    *,
    time: bool = False,
    budget: bool = False,
) -> dict:
    """A table row; ``ratio`` is leanstate's throughput over the peer's (1.0 = as fast),
    None where the peer is a budget (a count to stay within, maybe 0) rather than a rate."""
    ratio = None if budget else (peer / ours if time else ours / peer)
    return {
        "measure": measure,
        "backend": backend,
        "leanstate": ours,
        "peer": peer_name,
        "peer value": peer,
        "ratio": ratio,
    }


class Report:
    """The figures so far, rewritten to ``gpu_bench.txt`` / ``.json`` after every one."""

    def __init__(self, out: Path, title: str) -> None:
        self.out, self.title = out, title
        self.lines: list[dict] = []
        self.failures: list[dict] = []
        out.mkdir(parents=True, exist_ok=True)

    def attempt(self, what: str, backend: str, step: Callable[[], T]) -> T | None:
        """``step()`` in its own try: its result, or None with the failure kept and written."""
        print(f"gpu-check: {what} ({backend})", flush=True)
        try:
            return step()
        except Exception as error:  # noqa: BLE001 - one figure's failure must not lose the others
            self.failures.append(
                {"figure": what, "backend": backend, "error": f"{type(error).__name__}: {error}",
                 "traceback": traceback.format_exc()}
            )  # fmt: skip
            print(f"gpu-check: {what} ({backend}) FAILED: {type(error).__name__}: {error}", flush=True)
            self.write()
            return None

    def measure(self, what: str, backend: str, figures: Callable[[], list[dict]]) -> None:
        """Run ``figures`` in its own try; keep its lines, or the failure, and write both."""
        self.lines += self.attempt(what, backend, figures) or []
        self.write()

    def write(self) -> None:
        text = f"{self.title}\n{format_table(self.lines)}\n"
        for failure in self.failures:
            text += f"FAILED {failure['figure']} ({failure['backend']}): {failure['error']}\n"
        (self.out / "gpu_bench.txt").write_text(text)
        document = {"title": self.title, "figures": self.lines, "failures": self.failures}
        (self.out / "gpu_bench.json").write_text(json.dumps(document, indent=1))


def format_table(lines: list[dict]) -> str:
    """The figures as an aligned text table."""
    header = ["measure", "backend", "leanstate", "peer", "peer value", "ratio"]
    cells = [header] + [
        [
            item["measure"],
            item["backend"],
            f"{item['leanstate']:.4g}",
            item["peer"],
            f"{item['peer value']:.4g}",
            "-" if item["ratio"] is None else f"{item['ratio']:.3f}",
        ]
        for item in lines
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in cells)


def _filled_store(device: torch.device, backend: str, rows: int, batch: int, dim: int, spare: int) -> KVStore:
    generator = torch.Generator().manual_seed(0)
    store = KVStore(dim, device=device, backend=backend)
    store.reserve(rows + spare)
    for start in range(0, rows, batch):
        ids = torch.arange(start, min(rows, start + batch), device=device)
        store.set(ids, torch.randn(len(ids), dim, generator=generator).to(device))
    return store


class StoreBench:
    """One store backend on a device, filled, beside a dense table of the same rows; each
    figure a method, so each is measured in its own try."""

    def __init__(self, device: torch.device, backend: str, sizes: Sizes, dim: int = 64) -> None:
        self.device, self.backend, self.sizes, self.dim = device, backend, sizes, dim
        rows, batch = sizes.rows, sizes.batch
        self.calls = sizes.repeat + 2  # timed() warms up twice
        self.store = _filled_store(device, backend, rows, batch, dim, spare=2 * self.calls * batch)
        generator = torch.Generator().manual_seed(1)
        self.dense = torch.randn(rows, dim, device=device)
        self.ids = torch.randint(0, rows, (batch,), generator=generator).to(device)
        self.values = torch.randn(batch, dim, generator=generator).to(device)
        self.out = torch.empty(batch, dim, device=device)
        self.fresh = iter(range(2 * self.calls))
        self.kv = f"B KV/s (dim {dim})"

    def _timed(self, fn: Callable[[], object]) -> float:
        return timed(fn, self.device, self.sizes.repeat)

    def find(self) -> list[dict]:
        """find (a get into ``out``) in B KV/s beside HierarchicalKV and the ceiling, and as a time."""
        batch, backend = self.sizes.batch, self.backend
        ours = self._timed(lambda: self.store.get(self.ids, out=self.out))
        dense = self._timed(lambda: torch.index_select(self.dense, 0, self.ids, out=self.out))
        return [
            line(f"find {self.kv}", backend, batch / ours / 1e9, "HierarchicalKV A100 (published)",
                 HIERARCHICAL_KV_A100["find"]),
            line(f"find {self.kv}", backend, batch / ours / 1e9, "index_select here (ceiling)", batch / dense / 1e9),
            line("get s", backend, ours, "dense index_select", dense, time=True),
        ]  # fmt: skip

    def insert_or_assign(self) -> list[dict]:
        """A set of half present, half new ids, in B KV/s beside HierarchicalKV and the ceiling."""
        rows, batch, backend, device = self.sizes.rows, self.sizes.batch, self.backend, self.device

        def mixed_set():
            first = rows + next(self.fresh) * batch
            fresh = torch.arange(first, first + batch - batch // 2, device=device)
            self.store.set(torch.cat([self.ids[: batch // 2], fresh]), self.values)

        ours = self._timed(mixed_set)
        dense = self._timed(lambda: self.dense.index_copy_(0, self.ids, self.values))
        return [
            line(f"insert_or_assign {self.kv}", backend, batch / ours / 1e9, "HierarchicalKV A100 (published)",
                 HIERARCHICAL_KV_A100["insert_or_assign"]),
            line(f"insert_or_assign {self.kv}", backend, batch / ours / 1e9, "index_copy_ here (ceiling)",
                 batch / dense / 1e9),
        ]  # fmt: skip

    def waits(self) -> list[dict]:
        """Waits for the device per get, per set of new ids and per training step, beside the budget."""
        device, backend, batch, dim = self.device, self.backend, self.sizes.batch, self.dim
        first = self.sizes.rows + next(self.fresh) * batch
        new = torch.arange(first, first + batch, device=device)
        bag = KVEmbeddingBag(None, dim, optimizer="rowwise_adagrad", device=device, backend=backend)
        steps = iter(range(10))

        def step():
            start = next(steps) * batch
            ids = torch.arange(start, start + batch, device=device)
            bag(ids, torch.arange(0, batch, 4, device=device)).sum().backward()

        self.store.get(self.ids)
        step()  # warm
        counted = {
            "get": _waits(lambda: self.store.get(self.ids), device),
            "set (new ids)": _waits(lambda: self.store.set(new, self.values), device),
            "training step": _waits(step, device),
        }
        lines = []
        for call, (ours, torchs) in counted.items():
            lines.append(
                line(f"host waits per {call} (counted)", backend, ours, "budget", BUDGET[call], budget=True)
            )
            if torchs is not None:
                measure = f"host syncs per {call} (torch debug mode)"
                lines.append(line(measure, backend, torchs, "budget", BUDGET[call], budget=True))
        return lines

    def set(self) -> list[dict]:
        """A set of present ids beside ``index_copy_``, as times."""
        ours = self._timed(lambda: self.store.set(self.ids, self.values))
        dense = self._timed(lambda: self.dense.index_copy_(0, self.ids, self.values))
        return [line("set s", self.backend, ours, "dense index_copy_", dense, time=True)]


def store_figures(device: torch.device, backend: str, sizes: Sizes, dim: int = 64) -> list[dict]:
    """Every store figure of one backend, in one go (find, insert_or_assign, set)."""
    bench = StoreBench(device, backend, sizes, dim)
    return bench.find() + bench.insert_or_assign() + bench.set()


def _bag_batch(device: torch.device, rows: int, batch: int, pooling: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (batch * pooling,), generator=generator).to(device)
    return ids, torch.arange(0, batch * pooling, pooling, device=device)


def embedding_figures(
    device: torch.device, backend: str, sizes: Sizes, *, pooling: int = 20, dim: int = 128
) -> list[dict]:
    """A KVEmbeddingBag SGD step on ``device`` beside ``nn.EmbeddingBag(sparse=True)`` + SGD."""
    rows, batch = sizes.embedding_rows, sizes.embedding_batch
    ids, offsets = _bag_batch(device, rows, batch, pooling, seed=1)
    bag = KVEmbeddingBag(rows, dim, optimizer="sgd", lr=0.01, device=device, backend=backend)
    bag.store.reserve(rows)
    dense = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True).to(device)
    sgd = torch.optim.SGD(dense.parameters(), lr=0.01)

    def ours():
        bag(ids, offsets).sum().backward()

    def peer():
        sgd.zero_grad()
        dense(ids, offsets).sum().backward()
        sgd.step()

    step = f"sgd step s (B={batch}x{pooling}, dim {dim})"
    return [
        line(step, backend, timed(ours, device, sizes.repeat), "nn.EmbeddingBag(sparse)+SGD",
             timed(peer, device, sizes.repeat), time=True)
    ]  # fmt: skip


def offload_figures(device: torch.device, backend: str, sizes: Sizes) -> list[dict]:
    """A training step of a linear stack wrapped by leanstate's offload wrapper, beside torch's."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_wrappers

    import leanstate

    width = sizes.wrapper_width

    def model():
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(sizes.wrapper_layers)]
        return nn.Sequential(*layers).to(device)

    ours = leanstate.offload_wrapper(model(), backend=backend)
    theirs = torch_wrappers.offload_wrapper(model())
    x = torch.randn(64, width, device=device)

    def step(wrapped):
        def run():
            wrapped(x).sum().backward()
            wrapped.zero_grad(set_to_none=True)

        return run

    return [
        line(f"offload step s ({sizes.wrapper_layers}x{width})", backend, timed(step(ours), device, sizes.repeat),
             "torch offload_wrapper", timed(step(theirs), device, sizes.repeat), time=True)
    ]  # fmt: skip


def _waits(fn: Callable[[], object], device: torch.device) -> tuple[int, int | None]:
    """(leanstate's counted waits, torch's sync debug count on a GPU, else None) of one call."""
    before = host_reads()
    if device.type != "cuda":
        fn()
        return host_reads() - before, None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return host_reads() - before, sum("synchroniz" in str(w.message) for w in caught)


def _simulated_run(out: Path) -> int:
    """The same script in a process where numba's CUDA simulator is on from the start."""
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    return subprocess.run(
        [sys.executable, "-m", "leanstate", "gpu-check", "--simulate", "--out", str(out)], env=env
    ).returncode


def run(out: Path, *, simulate: bool = False, sizes: Sizes | None = None, tests: bool = True) -> int:
    """The whole check into ``out``: 1 without a device (or a simulator), or when a figure
    or a test failed; else 0."""
    if simulate:
        from numba import config

        if not config.ENABLE_CUDASIM:  # numba reads the switch once, at import: a fresh process
            return _simulated_run(out)
        device, sizes, name = torch.device("cpu"), sizes or SIMULATED_SIZES, "numba's CUDA simulator"
    elif not torch.cuda.is_available():
        print(NO_DEVICE)
        return 1
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        sizes, name = sizes or GPU_SIZES, torch.cuda.get_device_name()
    started = time.monotonic()
    report = Report(out, f"{name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    stores = [b for b in device_backends("kv_store", device) if not simulate or b == "numba-cuda"]
    bags = [b for b in device_backends("embedding", device) if not simulate or b == "numba-cuda"]
    for backend in stores:
        bench = report.attempt("store setup", backend, lambda b=backend: StoreBench(device, b, sizes))
        if bench is not None:
            for figure in (bench.find, bench.insert_or_assign, bench.set, bench.waits):
                report.measure(figure.__name__, backend, figure)
        del bench
    for backend in bags:
        report.measure("embedding step", backend, lambda b=backend: embedding_figures(device, b, sizes))
    for backend in device_backends("offload", device):
        report.measure("offload step", backend, lambda b=backend: offload_figures(device, b, sizes))
    print(format_table(report.lines), flush=True)
    failed = bool(report.failures) or not report.lines
    if tests and device.type == "cuda":
        left = max(30, BUDGET_S - (time.monotonic() - started))
        print(f"gpu-check: the gpu-marked tests ({left:.0f} s left)", flush=True)
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "gpu",
            "tests",
            f"--junitxml={out / 'gpu_tests.xml'}",
        ]
        try:
            done = subprocess.run(command, env={**os.environ, "LEANSTATE_GPU_OUT": str(out)}, timeout=left)
            failed |= done.returncode != 0
        except subprocess.TimeoutExpired:
            print("gpu-check: the tests ran out of time", flush=True)
            failed = True
    return 1 if failed else 0
