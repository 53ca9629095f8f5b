"""pytest plugin for ``make mutate``'s coverage run: the lines each test runs are recorded
under its node id, those run by the processes it starts (gloo ranks, subprocesses) too,
so that a mutant is tested by the tests that reach it. Each test's wall time goes to the
JSON file named by ``LEANSTATE_MUTATION_DURATIONS`` (a mutant's tests run fastest first),
with the node ids of the slow tier (``-m slow``, ``make test-slow``): a mutant runs the
fast tier's tests first and the slow tier's only when it survives them."""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import time

import coverage
import pytest

_durations: dict[str, float] = {}
_slow: set[str] = set()


def pytest_configure(config: pytest.Config) -> None:
    # Ranks normally fork from a server started with the first test's environment, which
    # would file every later test's rank lines under that first test: here each rank is a
    # fresh interpreter started with the running test's environment.
    from leanstate._tools import ranks

    ranks.forked = lambda fn: multiprocessing.get_context("spawn")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    cov = coverage.Coverage.current()
    if cov is None:
        yield
        return
    if item.get_closest_marker("slow"):
        _slow.add(item.nodeid)
    cov.switch_context(item.nodeid)
    # A Python process started during the test (coverage's .pth hook reads this variable)
    # measures itself under the test's node id.
    child = copy.copy(cov.config)
    child.context = item.nodeid
    os.environ["COVERAGE_PROCESS_CONFIG"] = child.serialize()
    start = time.perf_counter()
    try:
        yield
    finally:
        _durations[item.nodeid] = round(time.perf_counter() - start, 3)
        os.environ.pop("COVERAGE_PROCESS_CONFIG", None)
        cov.switch_context("")


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("LEANSTATE_MUTATION_DURATIONS")
    if path:
        with open(path, "w") as f:
            json.dump({"seconds": _durations, "slow": sorted(_slow)}, f)
