"""On a real CUDA device: the GPU engines held to the reference, host syncs per batch, the
offload wrapper's stream path, and checkpoints of device stores. ``make gpu-check`` runs
these; without a GPU they are skipped (and ``make test`` leaves them out)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import leanstate
from leanstate._tools.gpu_check import device_backends
from tests.harness import FakeClock

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
STORES = device_backends("kv_store", CUDA) if torch.cuda.is_available() else []
BAGS = device_backends("embedding", CUDA) if torch.cuda.is_available() else []


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def record(name: str, value) -> None:
    """Keep a figure beside the bench table when gpu-check asked for one."""
    folder = os.environ.get("LEANSTATE_GPU_OUT")
    if folder:
        path = Path(folder) / "gpu_tests_figures.json"
        figures = json.loads(path.read_text()) if path.exists() else {}
        figures[name] = value
        path.write_text(json.dumps(figures, indent=1))


@pytest.mark.parametrize("backend", STORES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_device_store_matches_the_reference_bit_for_bit(backend, dtype):
    clock = FakeClock(10)
    fast = leanstate.KVStore(8, optimizer_state_dim=2, dtype=dtype, clock=clock, device=CUDA, backend=backend)
    ref = leanstate.KVStore(8, optimizer_state_dim=2, dtype=dtype, clock=clock, backend="reference")
    generator = torch.Generator().manual_seed(0)
    for step in range(6):
        ids = torch.randint(-1, 3000, (4000,), generator=generator)
        values = torch.randn(4000, 10, generator=generator).to(dtype)
        for store in (fast, ref):
            store.set(ids.to(store.device), values.to(store.device), width_offset=step % 3)
        clock.now += 7
        gone = torch.randint(0, 3000, (300,), generator=generator)
        assert fast.delete(gone.to(CUDA)) == ref.delete(gone)
        probe = torch.randint(-1, 4000, (5000,), generator=generator)
        assert same_bits(fast.get(probe.to(CUDA)), ref.get(probe))
        assert same_bits(fast.get_rows(probe.to(CUDA)), ref.get_rows(probe))
        assert same_bits(fast.metadata(probe.to(CUDA)), ref.metadata(probe))
    assert fast.get(torch.tensor([1], device=CUDA)).device.type == "cuda"
    assert torch.equal(fast.keys().cpu(), ref.keys())
    assert torch.equal(fast.evict(max_rows=1000, min_count=2).cpu(), ref.evict(max_rows=1000, min_count=2))
    assert same_bits(fast.get_rows(ref.keys().to(CUDA)), ref.get_rows(ref.keys()))


@pytest.mark.parametrize("backend", BAGS)
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_device_bag_trains_like_the_reference(backend, optimizer, dtype):
    bags = [
        leanstate.KVEmbeddingBag(
            None, 16, optimizer=optimizer, lr=0.1, dtype=dtype, clock=FakeClock(3), device=d, backend=b
        )
        for d, b in ((CUDA, backend), (None, "reference"))
    ]
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 500, (2048,), generator=generator)
        offsets = torch.arange(0, 2048, 8)
        weights = torch.rand(2048, generator=generator)
        outs = [bag(ids.to(bag.device), offsets.to(bag.device), weights.to(bag.device)) for bag in bags]
        assert outs[0].device.type == "cuda"
        grad = torch.randn(outs[1].shape, generator=generator)
        for out in outs:
            out.backward(grad.to(out.device))
    keys = bags[1].store.keys()
    assert torch.equal(bags[0].store.keys().cpu(), keys)
    rows = [bag.store.get_rows(keys.to(bag.device)).cpu() for bag in bags]
    if backend == "numba-cuda":  # fixed summation order, no contraction: the reference's bits
        assert same_bits(rows[0], rows[1])
    else:  # torch's index_add_ on CUDA adds repeated ids in no fixed order: values, field by field
        layout = bags[1].store.layout
        weights = slice(layout.weight_offset, layout.weight_offset + layout.dim)
        state = slice(layout.state_offset, layout.width)  # float32 values stored as row elements
        assert same_bits(rows[0][:, : layout.weight_offset], rows[1][:, : layout.weight_offset])
        torch.testing.assert_close(
            rows[0][:, weights].float(), rows[1][:, weights].float(), rtol=1e-2, atol=1e-4
        )
        fields = [r[:, state].contiguous().view(torch.float32) for r in rows]
        torch.testing.assert_close(fields[0], fields[1], rtol=1e-3, atol=1e-6)


def _syncs(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("backend", BAGS)
def test_host_syncs_per_batch_do_not_grow_with_the_batch(backend):
    bag = leanstate.KVEmbeddingBag(None, 32, optimizer="rowwise_adagrad", device=CUDA, backend=backend)
    counts, first = {}, 0
    for batch in (256, 16_384):
        for _ in range(2):  # the first step warms the kernels; every step brings new ids
            ids = torch.arange(first, first + batch * 10, device=CUDA)
            first += batch * 10
            offsets = torch.arange(0, batch * 10, 10, device=CUDA)
            counts[batch] = _syncs(lambda ids=ids, offsets=offsets: bag(ids, offsets).sum().backward())
    record(f"host syncs per training step ({backend})", counts)
    assert counts[256] == counts[16_384]  # a fixed handful per step, never one per id or probe
    if backend == "numba-cuda":
        assert counts[16_384] <= 4


class _CopyStreams(TorchFunctionMode):
    """Records the current CUDA stream at every copy between the host and the device."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[torch.cuda.Stream] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
        crossing = func is torch.Tensor.copy_ and len(tensors) == 2 and tensors[0].device != tensors[1].device
        crossing |= (
            func is torch.Tensor.to
            and tensors
            and tensors[0].device.type == "cpu"
            and ("cuda" in str(args[1:] + tuple(kwargs.values())))
        )
        if crossing:
            self.streams.append(torch.cuda.current_stream())
        return func(*args, **kwargs)


def test_offload_wrapper_copies_on_a_side_stream_and_keeps_the_budget():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512)).to(CUDA)
    reference = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512)).to(CUDA)
    reference.load_state_dict(model.state_dict())
    budget = 4 * 2**20
    wrapped = leanstate.offload_wrapper(model, min_offload_bytes=1024, pinned_budget_bytes=budget)
    x = torch.randn(256, 512, device=CUDA)
    copies = _CopyStreams()
    with copies:
        for _ in range(3):
            wrapped(x).square().sum().backward()
            reference(x).square().sum().backward()
    # every device<->host copy of an activation ran on the copier's stream, not the compute one
    assert copies.streams and set(copies.streams) == {wrapped.copier.stream}, copies.streams
    assert wrapped.copier.stream != torch.cuda.default_stream(CUDA)
    assert wrapped.stats.offloaded_bytes > 0
    assert wrapped.pool.pooled_bytes <= budget and wrapped.pool.in_use_bytes == 0
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("backend", STORES)
def test_checkpoints_of_device_stores_load_anywhere(tmp_path, backend):
    source = leanstate.KVStore(16, optimizer_state_dim=1, device=CUDA, backend=backend, clock=FakeClock(5))
    ids = torch.randperm(50_000)[:20_000]
    source.set(ids.to(CUDA), torch.randn(20_000, 16, device=CUDA))
    leanstate.save_checkpoint(tmp_path / "ck", {"t": source}, chunk_bytes=2**20)
    host = leanstate.KVStore(16, optimizer_state_dim=1, backend="reference")
    leanstate.load_checkpoint(tmp_path / "ck", {"t": host}, chunk_bytes=2**20)
    keys = host.keys()
    assert same_bits(host.get_rows(keys), source.get_rows(keys.to(CUDA)))
    back = leanstate.KVStore(16, optimizer_state_dim=1, device=CUDA, backend=backend)
    leanstate.load_checkpoint(tmp_path / "ck", {"t": back}, chunk_bytes=2**20)
    assert same_bits(back.get_rows(keys.to(CUDA)), host.get_rows(keys))
