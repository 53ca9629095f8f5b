import subprocess
import sys


def run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "leanstate", *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_demo_runs_the_store_scenario():
    out = run("demo", "--rows", "2000", "--dim", "16")
    assert "filled     2000/2000 rows" in out
    assert "header of 0: timestamp=" in out and "count=1 used=True" in out
    assert "evict(max_rows=1000) removed 1000 rows" in out and "1000 remain" in out
    assert "rows and headers identical: True" in out


def test_info_explains_the_choice():
    out = run("info")
    assert "kv_store: numba" in out and "chose numba" in out


def test_bench_prints_ratios_beside_peers():
    out = run("bench", "--rows", "3000", "--dim", "16")
    for needle in (
        "dense index_select",
        "plain write+fsync",
        "plain read",
        "whole-row load extra MiB",
        "torch checkpoint_wrapper",
        "EmbeddingBag(sparse)+sgd",
        "torch ZeRO",
        "broadcasts per step",
    ):
        assert needle in out
