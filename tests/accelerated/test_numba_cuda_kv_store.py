"""The numba-cuda store engine in numba's CUDA simulator (``make test`` runs these in their own
process, with ``NUMBA_ENABLE_CUDASIM=1`` set before numba is imported)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import leanstate
from leanstate import _backends
from leanstate.reference.hashing import initial_weights
from tests.harness import FakeClock

pytestmark = pytest.mark.cudasim


@pytest.fixture(autouse=True)
def _simulated():
    if "numba-cuda" not in _backends.available("kv_store"):
        pytest.fail("numba-cuda is unavailable: run with NUMBA_ENABLE_CUDASIM=1 (make test does)")


def test_the_engine_runs_in_the_simulator_on_host_tensors():
    store = leanstate.KVStore(4, backend="numba-cuda")
    assert store.device == torch.device("cpu") and store.engine.backend == "numba-cuda"
    assert "numba-cuda" in leanstate.backend_info().registered["embedding"]


def test_what_a_batch_stores_does_not_depend_on_its_order():
    ids = torch.randperm(3000, generator=torch.Generator().manual_seed(0))[:300]
    values = torch.randn(300, 4, generator=torch.Generator().manual_seed(1))
    results = []
    for order in (torch.arange(300), torch.arange(299, -1, -1), torch.randperm(300)):
        store = leanstate.KVStore(4, backend="numba-cuda", clock=FakeClock(9))
        store.reserve(300)
        store.set(ids[order], values[order])
        table_keys = store.engine._table_keys
        blocks = store.engine.locate(torch.sort(ids).values)
        results.append((store.keys(), store.get_rows(ids), blocks, int((table_keys >= 0).sum())))
    for keys, rows, blocks, placed in results[1:]:
        assert torch.equal(keys, results[0][0]) and torch.equal(
            rows.view(torch.int32), results[0][1].view(torch.int32)
        )
        assert torch.equal(blocks, results[0][2])  # a new id's block is its rank among the new ids
        assert placed == 300


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_initial_rows_are_the_references_bits(dtype):
    # 111, 140, 1042 and 1313 each draw a float32 weight exactly halfway between two
    # bfloat16 values with an even lower one: round-to-nearest-even and round-half-up differ
    ids = torch.tensor([0, 1, 7, 2**40, 2**63 - 1, 111, 140, 1042, 1313])
    store = leanstate.KVStore(9, seed=2**64 - 5, init_range=(-1.0, 3.0), dtype=dtype, backend="numba-cuda")
    rows = store.engine.initial_rows(ids)
    first = store.layout.weight_offset
    expected = initial_weights(ids, 9, seed=2**64 - 5, low=-1.0, high=3.0, dtype=dtype)
    assert torch.equal(rows[:, first : first + 9].contiguous().view(torch.uint8), expected.view(torch.uint8))


def test_auto_on_a_cuda_machine_puts_the_gpu_engines_first(monkeypatch):
    monkeypatch.setattr(_backends, "cuda_present", lambda: True)
    assert _backends.auto_order("kv_store") == ["torch", "numba-cuda", "numba", "reference"]
    assert _backends.auto_order("embedding") == ["torch", "numba-cuda", "numba", "reference"]
    monkeypatch.setattr(_backends, "cuda_present", lambda: False)
    assert "numba-cuda" not in _backends.auto_order("kv_store")  # never picked for the CPU


def test_deleted_slots_are_reused_or_cleared_by_a_rebuild():
    store = leanstate.KVStore(4, backend="numba-cuda")
    for round_ in range(6):
        ids = torch.arange(round_ * 40, round_ * 40 + 40)
        store.set(ids, torch.full((40, 4), float(round_)))
        if round_ < 5:
            assert store.delete(ids[:30]) == 30
    keys = store.keys()
    expected = torch.cat(
        [torch.arange(r * 40 + 30, r * 40 + 40) for r in range(5)] + [torch.arange(200, 240)]
    )
    assert torch.equal(keys, expected)
    assert torch.equal(store.get(torch.tensor([35, 235]))[:, 0], torch.tensor([0.0, 5.0]))
    assert len(store) == 90 and store.engine._tombstones <= len(store.engine._table_keys) // 2


USER_SCRIPT = """
import tempfile, torch, leanstate
assert leanstate.backend_info().chosen["kv_store"] == "numba-cuda"
store = leanstate.KVStore(8, optimizer_state_dim=1)  # what a user writes: no backend, no device
store.set(torch.tensor([3, 1, 3]), torch.ones(3, 8))
assert store.get(torch.tensor([1]))[0, :8].sum() == 8 and len(store) == 2
bag = leanstate.KVEmbeddingBag(100, 8, optimizer="rowwise_adagrad", lr=0.5)
out = bag(torch.tensor([1, 2, 2, 5]), torch.tensor([0, 2]))
out.sum().backward()
assert bag.engine.backend == "numba-cuda" and len(bag.store) == 3
with tempfile.TemporaryDirectory() as folder:
    leanstate.save_checkpoint(folder + "/ck", bag.checkpoint_tables(), extra=bag.extra_state())
    fresh = leanstate.KVEmbeddingBag(100, 8, optimizer="rowwise_adagrad", lr=0.5, backend="reference")
    fresh.load_extra_state(leanstate.load_checkpoint(folder + "/ck", fresh.checkpoint_tables()))
keys = bag.store.keys()
assert torch.equal(fresh.store.get_rows(keys).view(torch.uint8), bag.store.get_rows(keys).view(torch.uint8))
print("ok")
"""


def test_a_users_script_runs_on_the_numba_cuda_backend_by_environment():
    env = {**os.environ, "LEANSTATE_BACKEND": "numba-cuda", "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run(
        [sys.executable, "-c", USER_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
