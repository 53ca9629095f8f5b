"""``python -m leanstate verify``: every installed backend against the reference, on random workloads.

Store operations (the conformance kit's state machine), checkpoints from every store
backend into every other (whole-row and DCP), embedding updates per optimizer, the
sharded exchange and the ZeRO step at 2 gloo ranks, and the activation wrappers. A
pass/fail table; the exit status is 1 if anything differs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import leanstate
from leanstate import _backends
from leanstate.reference.row_format import header_words


def _store_ops(backend: str, quick: bool) -> str:
    from leanstate.testing import run_store_machine

    examples = 15 if quick else 60
    run_store_machine(
        lambda dim, **options: leanstate.KVStore(dim, backend=backend, **options), examples=examples
    )
    return f"{examples} random operation sequences, every result bit-identical"


def _filled(backend: str, dtype: torch.dtype) -> leanstate.KVStore:
    store = leanstate.KVStore(6, optimizer_state_dim=2, dtype=dtype, backend=backend, seed=3)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randperm(50_000, generator=generator)[:2000]
    store.set(ids, torch.randn(2000, 6, generator=generator).to(dtype))
    store.delete(ids[:100])
    return store


def _checkpoints(source: str, target: str, quick: bool) -> str:
    from leanstate import dcp

    for dtype in (torch.float32,) if quick else (torch.float32, torch.bfloat16):
        store = _filled(source, dtype)
        keys = store.keys()
        with tempfile.TemporaryDirectory() as folder:
            leanstate.save_checkpoint(Path(folder, "whole"), {"t": store}, chunk_bytes=8192)
            dcp.save({"t": store}, checkpoint_id=Path(folder, "dcp"), chunk_bytes=8192)
            for kind in ("whole", "dcp"):
                fresh = leanstate.KVStore(6, optimizer_state_dim=2, dtype=dtype, backend=target)
                if kind == "whole":
                    leanstate.load_checkpoint(Path(folder, kind), {"t": fresh})
                else:
                    dcp.load({"t": fresh}, checkpoint_id=Path(folder, kind))
                same = torch.equal(fresh.keys(), keys) and torch.equal(
                    fresh.get_rows(keys).view(torch.uint8), store.get_rows(keys).view(torch.uint8)
                )
                assert same, f"{kind} checkpoint {source} -> {target} ({dtype}): rows differ"
    return "whole-row and DCP: rows and headers bit-identical"


def _embedding(backend: str, quick: bool) -> str:
    steps = 3 if quick else 8
    for optimizer, dtype in itertools.product(
        ("sgd", "rowwise_adagrad", "adam"), (torch.float32, torch.float16)
    ):
        bags = {
            name: leanstate.KVEmbeddingBag(
                None, 8, optimizer=optimizer, lr=0.1, dtype=dtype, seed=4, backend=name, clock=lambda: 100
            )
            for name in ("reference", backend)
        }
        for step in range(steps):
            generator = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 300, (64,), generator=generator)
            offsets = torch.arange(0, 64, 4)
            weights = torch.rand(64, generator=generator)
            grad = torch.randn(16, 8, generator=generator)
            outs = {}
            for name, bag in bags.items():
                out = bag(ids, offsets, per_sample_weights=weights)
                (out * grad).sum().backward()
                outs[name] = out.detach()
            torch.testing.assert_close(outs[backend], outs["reference"], rtol=1e-5, atol=1e-6)
        ref, fast = bags["reference"].store, bags[backend].store
        keys = ref.keys()
        assert torch.equal(keys, fast.keys()), f"{optimizer} {dtype}: different ids"
        rows, want = fast.get_rows(keys), ref.get_rows(keys)
        layout = ref.layout
        assert torch.equal(header_words(rows), header_words(want)), f"{optimizer} {dtype}: headers differ"
        for part in (
            slice(layout.weight_offset, layout.weight_offset + layout.dim),
            slice(layout.state_offset, None),
        ):
            # the optimizer state is float32 bytes, also in 16-bit rows
            a, b = (r[:, part].contiguous() for r in (rows, want))
            if part.stop is None and dtype != torch.float32:
                a, b = a.view(torch.float32), b.view(torch.float32)
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-5)
    return f"sgd, rowwise_adagrad, adam x fp32, fp16: {steps} weighted steps, outputs and rows within 1e-5"


def _wrappers(name: str, quick: bool) -> str:
    from leanstate.testing import WrapperConformance

    wrap = leanstate.checkpoint_wrapper if name == "checkpoint_wrapper" else leanstate.offload_wrapper
    kit = WrapperConformance()
    kit.test_outputs_and_gradients_match_the_module(wrap=wrap)
    kit.test_state_dict_keys_are_the_modules(wrap=wrap)
    return "outputs and gradients bit-identical to the module; state_dict keys the module's"


# -- two gloo ranks ------------------------------------------------------------------------


def _rank_checks(rank: int, world: int, steps: int) -> dict[str, str]:
    """The sharded exchange (against one process on the global batch) and leanstate's ZeRO
    step (against torch's), on this rank; check -> "ok" or the failure."""
    from torch import nn
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    results = {}
    try:
        configs = [
            leanstate.KVTableConfig("t", 8, num_embeddings=512, feature_names=["a", "b"], lr=0.5, seed=1)
        ]
        sharded = leanstate.ShardedKVEmbeddingBagCollection(configs, clock=lambda: 7)
        single = leanstate.KVEmbeddingBagCollection(configs, clock=lambda: 7)
        per_rank = 8
        for step in range(steps):
            generator = torch.Generator().manual_seed(step)
            ids = torch.randperm(512, generator=generator)[: 2 * per_rank * world]  # distinct: exact sums
            lengths = torch.ones(2 * per_rank * world, dtype=torch.int64)
            full = leanstate.KeyedJaggedTensor(["a", "b"], ids, lengths=lengths)
            mine = torch.cat([ids[k * per_rank * world + rank * per_rank :][:per_rank] for k in range(2)])
            local = leanstate.KeyedJaggedTensor(
                ["a", "b"], mine, lengths=torch.ones(2 * per_rank, dtype=torch.int64)
            )
            grad = torch.randn(per_rank * world, 16, generator=generator)
            out = sharded(local)
            (out.values() * grad[rank * per_rank : (rank + 1) * per_rank]).sum().backward()
            want = single(full)
            (want.values() * grad).sum().backward()
            assert torch.equal(
                out.values().detach(), want.values().detach()[rank * per_rank : (rank + 1) * per_rank]
            )
        store, full_store = sharded.embedding_bags["t"].store, single.embedding_bags["t"].store
        keys = store.keys()
        assert torch.equal(
            store.get_rows(keys).view(torch.uint8), full_store.get_rows(keys).view(torch.uint8)
        )
        results["sharded"] = "ok"
    except Exception:
        results["sharded"] = traceback.format_exc(limit=3)
    try:
        torch.manual_seed(0)
        a, b = nn.Linear(16, 8), nn.Linear(16, 8)
        b.load_state_dict(a.state_dict())
        ours = leanstate.ZeroRedundancyOptimizer(a.parameters(), torch.optim.Adam, lr=0.01)
        theirs = TorchZero(b.parameters(), torch.optim.Adam, lr=0.01)
        for step in range(steps):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))
            for model, optimizer in ((a, ours), (b, theirs)):
                model(x).square().sum().backward()
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                optimizer.step()
                optimizer.zero_grad()
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q), "parameters differ from torch's ZeroRedundancyOptimizer"
        results["zero"] = "ok"
    except Exception:
        results["zero"] = traceback.format_exc(limit=3)
    return results


def _rank_worker(rank: int, world: int, port: int, out: str, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        Path(out, f"rank{rank}.json").write_text(json.dumps(_rank_checks(rank, world, steps)))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _two_ranks(quick: bool) -> dict[str, str]:
    from leanstate._tools.ranks import free_port, start_ranks

    with tempfile.TemporaryDirectory() as folder:
        start_ranks(_rank_worker, (2, free_port(), folder, 2 if quick else 5), 2)
        ranks = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(2)]
    return {check: next((r[check] for r in ranks if r[check] != "ok"), "ok") for check in ranks[0]}


# -- the table ---------------------------------------------------------------------------


def _checks(backend: str | None, quick: bool) -> list[tuple[str, str, str, Callable[[], str]]]:
    """(component, backend, what, run) for every installed backend (or ``backend`` only)."""

    def wanted(name: str) -> bool:
        return name != "reference" and (backend is None or name == backend)

    stores = _backends.available("kv_store")
    checks = []
    for name in filter(wanted, stores):
        checks.append(("kv_store", name, "store operations", lambda n=name: _store_ops(n, quick)))
    for source, target in itertools.product(stores, stores):
        if (source != target or source != "reference") and (backend is None or backend in (source, target)):
            checks.append(
                (
                    "checkpoint",
                    f"{source}->{target}",
                    "save, then load",
                    lambda s=source, t=target: _checkpoints(s, t, quick),
                )
            )
    for name in filter(wanted, _backends.available("embedding")):
        checks.append(("embedding", name, "fused updates", lambda n=name: _embedding(n, quick)))
    if backend in (None, "reference"):
        for wrapper in ("checkpoint_wrapper", "offload_wrapper"):
            checks.append(("wrappers", "reference", wrapper, lambda w=wrapper: _wrappers(w, quick)))
    return checks


def main(args: argparse.Namespace) -> int:
    """Run the checks, print the table; 1 if any check fails."""
    if args.backend is not None and args.backend not in _backends.backends():
        print(f"verify: unknown backend {args.backend!r}; known: {', '.join(_backends.backends())}")
        return 2
    print(leanstate.backend_info())
    rows, failed = [], 0
    for component, backend, what, run in _checks(args.backend, args.quick):
        start = time.perf_counter()
        try:
            detail, ok = run(), True
        except Exception as exc:
            detail, ok = (
                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                False,
            )
        rows.append(
            (
                component,
                backend,
                what,
                "PASS" if ok else "FAIL",
                f"{time.perf_counter() - start:.1f}s",
                detail,
            )
        )
        failed += not ok
        if sys.stderr.isatty():  # progress on one line of the terminal; the table is the output
            print(
                f"\r{len(rows)} checks done, {failed} failed: {component} [{backend}]\033[K",
                end="",
                file=sys.stderr,
            )
    if args.backend in (None, "reference") or args.backend == leanstate.backend_info().chosen["embedding"]:
        start = time.perf_counter()
        outcome = _two_ranks(args.quick)
        for check, result in outcome.items():
            what = {"sharded": "exchange vs one process", "zero": "step vs torch's ZeRO"}[check]
            component = "sharded" if check == "sharded" else "zero"
            ok = result == "ok"
            detail = "2 gloo ranks: bit-identical" if ok else result.strip().splitlines()[-1]
            rows.append(
                (
                    component,
                    "2 ranks",
                    what,
                    "PASS" if ok else "FAIL",
                    f"{time.perf_counter() - start:.1f}s",
                    detail,
                )
            )
            failed += not ok
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print()
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:5], widths, strict=True)), " ", row[5])
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0
