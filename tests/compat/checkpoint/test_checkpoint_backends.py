"""Checkpoints across backends: every store backend to every other, either writer, the same bytes."""

import itertools

import pytest
import torch

import leanstate
from leanstate import _backends
from tests.harness import FakeClock

STORES = sorted(_backends.available("kv_store"))
WRITERS = {"pipelined": True, "plain": False}


def filled(backend, dtype, n=700):
    store = leanstate.KVStore(
        6, optimizer_state_dim=2, dtype=dtype, clock=FakeClock(77), backend=backend, num_shards=3
    )
    ids = torch.randperm(5000, generator=torch.Generator().manual_seed(1))[:n]
    store.set(ids, torch.randn(n, 6, generator=torch.Generator().manual_seed(2)).to(dtype))
    store.set(ids[: n // 7], torch.ones(n // 7, 2, dtype=dtype), width_offset=8)
    store.delete(ids[n * 6 // 7 : n * 13 // 14])
    return store


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("source, target, writer", list(itertools.product(STORES, STORES, WRITERS)))
def test_any_backend_loads_what_any_backend_saved(tmp_path, dtype, source, target, writer):
    # the simulator runs each kernel thread as Python: fewer rows, as many chunks
    n, chunk = (70, 512) if "numba-cuda" in (source, target) else (700, 4096)
    src = filled(source, dtype, n)
    leanstate.save_checkpoint(tmp_path / "ck", {"t": src}, chunk_bytes=chunk, pipelined=WRITERS[writer])
    reference_bytes = tmp_path / "ref"
    leanstate.save_checkpoint(
        reference_bytes, {"t": filled("reference", dtype, n)}, chunk_bytes=chunk, pipelined=False
    )
    assert (tmp_path / "ck" / "t.rows").read_bytes() == (reference_bytes / "t.rows").read_bytes()
    for holds_rows in (False, True):
        dst = leanstate.KVStore(6, optimizer_state_dim=2, dtype=dtype, backend=target)
        if holds_rows:  # the verify-first path: some rows are overwritten
            dst.set(src.keys()[:10], torch.zeros(10, 6, dtype=dtype))
        leanstate.load_checkpoint(tmp_path / "ck", {"t": dst}, chunk_bytes=chunk * 3 // 4)
        keys = src.keys()
        assert torch.equal(dst.keys(), keys)
        assert torch.equal(dst.get_rows(keys).view(torch.uint8), src.get_rows(keys).view(torch.uint8))


# host stores: the simulator would run 400k rows through Python threads
@pytest.mark.parametrize("backend", [b for b in STORES if b not in ("reference", "numba-cuda")])
def test_a_resume_load_into_an_accelerated_store_holds_about_a_chunk(backend):
    """Loading into a live store that holds the rows (a resume) must not grow it by the
    table (a reserve of rows it already holds did: +26.8 MiB for a 16.8 MiB table)."""
    from leanstate._tools.workloads import load_peak_extra_bytes

    rows, dim, chunk = 200_000, 16, 2**20
    memory = load_peak_extra_bytes(rows, dim, backend, chunk)
    table = rows * (8 + (dim + 1) * 4)
    assert memory["legacy"] > 0.9 * table, memory  # the probe sees what the legacy load holds
    assert memory["whole"] < memory["legacy"] / 2, memory
