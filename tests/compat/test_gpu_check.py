"""The CPU side of ``make gpu-check``: its message without a GPU, and its figures and table,
run here on the CPU with the torch engines at small sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


TINY = _gpu_check.Sizes(rows=4096, batch=512, embedding_rows=1000, embedding_batch=64, wrapper_layers=1,
                        wrapper_width=8, repeat=2)  # fmt: skip


def test_store_figures_put_rates_beside_hierarchical_kv_and_the_dense_ceiling():
    lines = _gpu_check.store_figures(CPU, "torch", TINY, dim=8)
    assert [(line["measure"], line["peer"]) for line in lines] == [
        ("find B KV/s (dim 8)", "HierarchicalKV A100 (published)"),
        ("find B KV/s (dim 8)", "index_select here (ceiling)"),
        ("get s", "dense index_select"),
        ("insert_or_assign B KV/s (dim 8)", "HierarchicalKV A100 (published)"),
        ("insert_or_assign B KV/s (dim 8)", "index_copy_ here (ceiling)"),
        ("set s", "dense index_copy_"),
    ]
    find = lines[0]
    assert find["peer value"] == 2.0 and find["ratio"] == pytest.approx(find["leanstate"] / 2.0)
    get = lines[2]
    assert get["ratio"] == pytest.approx(get["peer value"] / get["leanstate"])
    assert all(line["leanstate"] > 0 for line in lines)


def test_embedding_figures_and_the_table():
    lines = _gpu_check.embedding_figures(CPU, "torch", TINY, pooling=4, dim=8)
    assert len(lines) == 1 and lines[0]["peer"] == "nn.EmbeddingBag(sparse)+SGD"
    table = _gpu_check.format_table(lines).splitlines()
    assert table[0].split() == ["measure", "backend", "leanstate", "peer", "peer", "value", "ratio"]
    assert "sgd step s (B=64x4, dim 8)" in table[1] and "torch" in table[1]


def test_a_failing_figure_is_written_as_a_failure_and_the_next_one_still_runs(tmp_path):
    report = _gpu_check.Report(tmp_path, "title")

    def broken():
        raise RuntimeError("an illegal memory access was encountered")

    report.measure("store", "numba-cuda", broken)
    written = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert written["failures"][0]["error"] == "RuntimeError: an illegal memory access was encountered"
    report.measure("embedding step", "torch", lambda: _gpu_check.embedding_figures(CPU, "torch", TINY, dim=8))
    written = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert [line["backend"] for line in written["figures"]] == ["torch"]  # written as soon as measured
    assert "FAILED store (numba-cuda): RuntimeError" in (tmp_path / "gpu_bench.txt").read_text()


@pytest.mark.cudasim
def test_the_check_runs_in_the_simulator_and_its_waits_are_within_budget(tmp_path):
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "leanstate", "gpu-check", "--simulate", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    written = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert written["failures"] == [] and "simulator" in written["title"]
    figures = {(f["measure"], f["backend"]): f for f in written["figures"]}
    assert {backend for _, backend in figures} == {"numba-cuda"}
    assert figures[("find B KV/s (dim 64)", "numba-cuda")]["leanstate"] > 0
    assert figures[("sgd step s (B=4x20, dim 128)", "numba-cuda")]["leanstate"] > 0
    waits = {m: f["leanstate"] for (m, _), f in figures.items() if m.startswith("host waits")}
    assert all(figures[(m, "numba-cuda")]["ratio"] is None for m in waits)  # a budget, not a rate
    assert waits == {
        "host waits per get (counted)": 0,
        "host waits per set (new ids) (counted)": 2,
        "host waits per training step (counted)": 3,
    }
