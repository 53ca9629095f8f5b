"""pytest plugin for ``make mutate``'s coverage run: the lines each test runs are recorded
under its node id, those run by the processes it starts (gloo ranks, subprocesses) too,
so that a mutant is tested by the tests that reach it."""

from __future__ import annotations

import copy
import os

import coverage
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    cov = coverage.Coverage.current()
    if cov is None:
        yield
        return
    cov.switch_context(item.nodeid)
    # A Python process started during the test (coverage's .pth hook reads this variable)
    # measures itself under the test's node id.
    child = copy.copy(cov.config)
    child.context = item.nodeid
    os.environ["COVERAGE_PROCESS_CONFIG"] = child.serialize()
    try:
        yield
    finally:
        os.environ.pop("COVERAGE_PROCESS_CONFIG", None)
        cov.switch_context("")
