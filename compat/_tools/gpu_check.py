"""``python -m leanstate gpu-check`` (``make gpu-check``): the GPU tests and the GPU bench, one run.

On a CUDA machine it runs the ``gpu``-marked tests, then measures, for every store
backend that runs on the device:

- find and insert-or-assign throughput in billions of key-value pairs per second at
  dim 64, beside HierarchicalKV's published A100 figures (find 2.0, insert_or_assign
  0.83 B KV/s: published, not measured here);
- get and set beside a dense device table's ``index_select`` / ``index_copy_``;
- a KVEmbeddingBag training step beside ``nn.EmbeddingBag(sparse=True)`` + SGD.

Everything lands as one table (``gpu_bench.txt``, ``gpu_bench.json``) in the output
folder, with the tests' report. Without a CUDA device it says so and exits 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from leanstate import _backends
from leanstate.embedding import KVEmbeddingBag
from leanstate.kv_store import KVStore

HIERARCHICAL_KV_A100 = {"find": 2.0, "insert_or_assign": 0.83}  # B KV/s, dim 64, published
NO_DEVICE = "gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to measure"


def _timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Best wall time of ``repeat`` calls, the device synchronised around each."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def device_backends(component: str, device: torch.device) -> list[str]:
    """The available backends of ``component`` whose engines run on ``device``'s type."""
    found = []
    for backend in _backends.available(component):
        module, _ = _backends.load(component, backend)
        if backend != "reference" and device.type in module.DEVICES:
            found.append(backend)
    return found


def store_figures(
    device: torch.device, backend: str, *, rows: int, batch: int, dim: int = 64, repeat: int = 5
) -> list[dict]:
    """One store backend on ``device``: find / insert rates and get / set beside a dense table."""
    generator = torch.Generator().manual_seed(0)
    store = KVStore(dim, device=device, backend=backend)
    store.reserve(rows + repeat * batch)
    for start in range(0, rows, batch):
        ids = torch.arange(start, min(rows, start + batch), device=device)
        store.set(ids, torch.randn(len(ids), dim, generator=generator).to(device))
    dense = torch.randn(rows, dim, device=device)
    ids = torch.randint(0, rows, (batch,), generator=generator).to(device)
    values = torch.randn(batch, dim, generator=generator).to(device)
    out = torch.empty(batch, dim, device=device)
    fresh = iter(range(repeat + 1))

    def insert_or_assign():  # half the ids new, half present
        first = rows + next(fresh) * batch
        mixed = torch.cat([ids[: batch // 2], torch.arange(first, first + batch - batch // 2, device=device)])
        store.set(mixed, values)

    times = {
        "find": _timed(lambda: store.get(ids, out=out), device, repeat),
        "insert_or_assign": _timed(insert_or_assign, device, repeat),
        "set": _timed(lambda: store.set(ids, values), device, repeat),
        "dense get": _timed(lambda: torch.index_select(dense, 0, ids, out=out), device, repeat),
        "dense set": _timed(lambda: dense.index_copy_(0, ids, values), device, repeat),
    }
    lines = []
    for op in ("find", "insert_or_assign"):
        rate = batch / times[op] / 1e9
        peer = HIERARCHICAL_KV_A100[op]
        lines.append(
            _line(f"{op} B KV/s (dim {dim})", backend, rate, "HierarchicalKV A100 (published)", peer)
        )
    lines.append(_line("get s", backend, times["find"], "dense index_select", times["dense get"], time=True))
    lines.append(_line("set s", backend, times["set"], "dense index_copy_", times["dense set"], time=True))
    return lines


def embedding_figures(
    device: torch.device,
    backend: str,
    *,
    rows: int,
    batch: int,
    pooling: int = 20,
    dim: int = 128,
    repeat: int = 5,
) -> list[dict]:
    """A KVEmbeddingBag SGD step on ``device`` beside ``nn.EmbeddingBag(sparse=True)`` + SGD."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, rows, (batch * pooling,), generator=generator).to(device)
    offsets = torch.arange(0, batch * pooling, pooling, device=device)
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

    ours()
    peer()
    step = f"sgd step s (B={batch}x{pooling}, dim {dim})"
    return [
        _line(
            step,
            backend,
            _timed(ours, device, repeat),
            "nn.EmbeddingBag(sparse)+SGD",
            _timed(peer, device, repeat),
            time=True,
        )
    ]


def _line(
    measure: str, backend: str, ours: float, peer_name: str, peer: float, *, time: bool = False
) -> dict:
    """A table row; ``ratio`` is leanstate's throughput over the peer's (1.0 = as fast)."""
    ratio = peer / ours if time else ours / peer
    return {
        "measure": measure,
        "backend": backend,
        "leanstate": ours,
        "peer": peer_name,
        "peer value": peer,
        "ratio": ratio,
    }


def format_table(lines: list[dict]) -> str:
    """The figures as an aligned text table."""
    header = ["measure", "backend", "leanstate", "peer", "peer value", "ratio"]
    cells = [header] + [
        [
            line["measure"],
            line["backend"],
            f"{line['leanstate']:.4g}",
            line["peer"],
            f"{line['peer value']:.4g}",
            f"{line['ratio']:.3f}",
        ]
        for line in lines
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in cells)


def figures(
    device: torch.device, *, rows: int, batch: int, embedding_rows: int, embedding_batch: int
) -> list[dict]:
    """Every store and embedding backend that runs on ``device``, beside its peers."""
    lines = []
    for backend in device_backends("kv_store", device):
        lines += store_figures(device, backend, rows=rows, batch=batch)
    for backend in device_backends("embedding", device):
        lines += embedding_figures(device, backend, rows=embedding_rows, batch=embedding_batch)
    return lines


def run(out: Path, *, rows: int = 2**23, batch: int = 2**20) -> int:
    """The whole GPU check into ``out``; 1 without a CUDA device, else the tests' exit code."""
    if not torch.cuda.is_available():
        print(NO_DEVICE)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check on {torch.cuda.get_device_name()}: the gpu-marked tests", flush=True)
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", f"--junitxml={out / 'gpu_tests.xml'}"],
        env={**os.environ, "LEANSTATE_GPU_OUT": str(out)},
    )
    print("gpu-check: the GPU bench", flush=True)
    device = torch.device("cuda")
    lines = figures(device, rows=rows, batch=batch, embedding_rows=2**22, embedding_batch=4096)
    table = format_table(lines)
    print(table)
    header = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}\n"
    (out / "gpu_bench.txt").write_text(header + table + "\n")
    (out / "gpu_bench.json").write_text(json.dumps(lines, indent=1))
    return tests.returncode
