"""The CPU side of ``make gpu-check``: its message without a GPU, and its figures and table,
run here on the CPU with the torch engines at small sizes."""

from __future__ import annotations

import pytest
import torch

from leanstate._tools import gpu_check as _gpu_check
from leanstate._tools.cli import main

CPU = torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-device message needs a machine without CUDA")
def test_without_a_gpu_it_says_so_and_exits_1(tmp_path, capsys):
    assert main(["gpu-check", "--out", str(tmp_path / "out")]) == 1
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_device_backends_are_the_engines_that_run_there():
    cpu = _gpu_check.device_backends("kv_store", CPU)
    assert "torch" in cpu and "numba" in cpu and "reference" not in cpu
    assert "numba" not in _gpu_check.device_backends("kv_store", torch.device("cuda"))


def test_store_figures_put_rates_beside_hierarchical_kv_and_times_beside_dense():
    lines = _gpu_check.store_figures(CPU, "torch", rows=4096, batch=512, dim=8, repeat=2)
    assert [line["measure"] for line in lines] == [
        "find B KV/s (dim 8)",
        "insert_or_assign B KV/s (dim 8)",
        "get s",
        "set s",
    ]
    find = lines[0]
    assert find["peer value"] == 2.0 and find["ratio"] == pytest.approx(find["leanstate"] / 2.0)
    get = lines[2]
    assert get["ratio"] == pytest.approx(get["peer value"] / get["leanstate"])
    assert all(line["leanstate"] > 0 for line in lines)


def test_embedding_figures_and_the_table():
    lines = _gpu_check.embedding_figures(CPU, "torch", rows=1000, batch=64, pooling=4, dim=8, repeat=2)
    assert len(lines) == 1 and lines[0]["peer"] == "nn.EmbeddingBag(sparse)+SGD"
    table = _gpu_check.format_table(lines).splitlines()
    assert table[0].split() == ["measure", "backend", "leanstate", "peer", "peer", "value", "ratio"]
    assert "sgd step s (B=64x4, dim 8)" in table[1] and "torch" in table[1]
