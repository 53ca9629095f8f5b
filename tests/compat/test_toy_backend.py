"""A new backend is one file and one registry line: a toy store backend, registered by the
hook, shows up in ``backend_info()``, the differential machine and the bench."""

from __future__ import annotations

import pytest
import torch

import leanstate
from leanstate import _backends
from leanstate._tools import bench as _bench
from tests.harness import check_backend


@pytest.fixture
def toy():
    leanstate.register_backend("kv_store", "toy", "tests.compat.toy_kv_store")  # the one line
    yield
    leanstate.unregister_backend("kv_store", "toy")


def test_the_toy_backend_appears_in_backend_info(toy):
    info = leanstate.backend_info()
    assert "toy" in info.registered["kv_store"]
    assert info.dependencies["toy"] == "available"
    assert info.chosen["kv_store"] != "toy"  # it declares no auto priority: chosen only by name
    assert _backends.select("kv_store", "toy")[0] == "toy"
    store = leanstate.KVStore(4, backend="toy")
    store.set(torch.tensor([5]), torch.ones(1, 4))
    assert store.engine.backend == "toy" and store.get(torch.tensor([5])).sum() == 4


def test_the_toy_backend_runs_the_differential_machine(toy):
    check_backend("toy", examples=5)


def test_the_toy_backend_has_its_rows_in_the_bench_with_its_declared_target(toy):
    lines = _bench.store_figures(rows=2000, dim=8, batch=256)
    toy_lines = [line for line in lines if line[2] == "toy"]
    assert [line[1] for line in toy_lines] == [
        "get 256 ids s",
        "get(out=) 256 ids s",
        "set 256 ids s",
        "insert 256 ids s",
        "reserve+insert 256 ids s",
        "memory bytes/row",
    ]
    assert toy_lines[0][8] == ">= 0" and toy_lines[0][9] == "yes"


def test_unregistering_removes_it():
    leanstate.register_backend("kv_store", "toy", "tests.compat.toy_kv_store")
    leanstate.unregister_backend("kv_store", "toy")
    assert "toy" not in leanstate.backend_info().registered["kv_store"]
    with pytest.raises(ValueError, match="not one of"):
        leanstate.KVStore(4, backend="toy")
