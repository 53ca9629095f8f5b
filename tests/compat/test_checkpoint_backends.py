"""Checkpoints across backends: every checkpoint I/O backend, every store backend, the same bytes."""

import itertools

import pytest
import torch

import leanstate
from leanstate import _backends
from tests.conftest import FakeClock

STORES = sorted(_backends.implementations("kv_store"))
IO = sorted(_backends.implementations("checkpoint"))


def filled(backend, dtype):
    store = leanstate.KVStore(
        6, optimizer_state_dim=2, dtype=dtype, clock=FakeClock(77), backend=backend, num_shards=3
    )
    ids = torch.randperm(5000, generator=torch.Generator().manual_seed(1))[:700]
    store.set(ids, torch.randn(700, 6, generator=torch.Generator().manual_seed(2)).to(dtype))
    store.set(ids[:100], torch.ones(100, 2, dtype=dtype), width_offset=8)
    store.delete(ids[600:650])
    return store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("source, target, save_io, load_io", list(itertools.product(STORES, STORES, IO, IO)))
def test_any_backend_loads_what_any_backend_saved(tmp_path, dtype, source, target, save_io, load_io):
    src = filled(source, dtype)
    leanstate.save_checkpoint(tmp_path / "ck", {"t": src}, chunk_bytes=4096, backend=save_io)
    reference_bytes = tmp_path / "ref"
    leanstate.save_checkpoint(reference_bytes, {"t": src}, chunk_bytes=4096, backend="reference")
    assert (tmp_path / "ck" / "t.rows").read_bytes() == (reference_bytes / "t.rows").read_bytes()
    for holds_rows in (False, True):
        dst = leanstate.KVStore(6, optimizer_state_dim=2, dtype=dtype, backend=target)
        if holds_rows:  # the verify-first path: some rows are overwritten
            dst.set(src.keys()[:10], torch.zeros(10, 6, dtype=dtype))
        leanstate.load_checkpoint(tmp_path / "ck", {"t": dst}, chunk_bytes=3000, backend=load_io)
        keys = src.keys()
        assert torch.equal(dst.keys(), keys)
        assert torch.equal(dst.get_rows(keys).view(torch.uint8), src.get_rows(keys).view(torch.uint8))
