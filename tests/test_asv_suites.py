"""Every asv benchmark runs on its own: each in a fresh process, in asv's discovery order
(modules, then names, alphabetically), at tiny sizes (``LEANSTATE_ASV=tiny``), with no
state left by another benchmark (asv runs each in a process of its own too)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITES = ROOT / "asv_bench"
PREFIXES = ("time_", "track_", "mem_", "peakmem_")


def discovered() -> list[tuple[str, str, str]]:
    """(module, class, method) of every benchmark, in asv's order."""
    import importlib

    sys.path.insert(0, str(SUITES))
    before = os.environ.get("LEANSTATE_ASV")
    os.environ["LEANSTATE_ASV"] = "tiny"  # the parameters the tiny run will see
    try:
        found = []
        for file in sorted((SUITES / "benchmarks").glob("[!_]*.py")):
            module = importlib.import_module(f"benchmarks.{file.stem}")
            for class_name, cls in sorted(vars(module).items()):
                if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                    continue
                for name in sorted(dir(cls)):
                    if name.startswith(PREFIXES):
                        found.append((file.stem, class_name, name))
        return found
    finally:
        sys.path.remove(str(SUITES))
        if before is None:
            del os.environ["LEANSTATE_ASV"]
        else:
            os.environ["LEANSTATE_ASV"] = before


RUN_ONE = """
import itertools, math, sys
sys.path.insert(0, sys.argv[1])
import importlib
module = importlib.import_module("benchmarks." + sys.argv[2])
cls = getattr(module, sys.argv[3])
bench = cls()
params = getattr(cls, "params", [])
if params and not isinstance(params[0], (list, tuple)):
    params = [params]
cached = [bench.setup_cache()] if hasattr(bench, "setup_cache") else []
for combo in itertools.product(*params) if params else [()]:
    args = [*cached, *combo]
    if hasattr(bench, "setup"):
        bench.setup(*args)
    try:
        value = getattr(bench, sys.argv[4])(*args)
    except NotImplementedError:
        value = None  # asv's way to skip a combination
    if hasattr(bench, "teardown"):
        bench.teardown(*args)
    if sys.argv[4].startswith("track_") and value is not None:
        assert isinstance(value, (int, float)) and math.isfinite(value), value
        assert value == float(f"{value:.3g}") or isinstance(value, int), f"not rounded: {value!r}"
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("module, cls, method", discovered(), ids=lambda x: x)
def test_each_benchmark_runs_alone_at_tiny_sizes(module, cls, method):
    done = subprocess.run(
        [sys.executable, "-c", RUN_ONE, str(SUITES), module, cls, method],
        env={**os.environ, "LEANSTATE_ASV": "tiny"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
