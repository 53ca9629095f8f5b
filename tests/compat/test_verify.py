"""``python -m leanstate verify``: passes on the installed backends, fails on a broken one."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import leanstate
from leanstate._tools.verify import main


def test_verify_quick_passes_every_installed_backend():
    done = subprocess.run(
        [sys.executable, "-m", "leanstate", "verify", "--quick"], capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for component in ("kv_store", "checkpoint", "embedding", "wrappers", "sharded", "zero"):
        assert any(line.startswith(component) and "PASS" in line for line in out.splitlines()), component
    assert "FAIL" not in out and " 0 failed" in out
    passed = int(out.split(" passed, ")[0].split()[-1])
    assert sum(" PASS " in f" {line} " for line in out.splitlines()) == passed  # one table, each check once


@pytest.fixture
def broken():
    leanstate.register_backend("kv_store", "broken", "tests.compat.broken_kv_store")
    yield
    leanstate.unregister_backend("kv_store", "broken")


def test_verify_fails_on_a_backend_that_lists_its_ids_out_of_order(broken, capsys):
    assert main(argparse.Namespace(backend="broken", quick=True)) == 1
    out = capsys.readouterr().out
    failed = [
        line for line in out.splitlines() if "FAIL" in line and line.startswith(("kv_store", "checkpoint"))
    ]
    assert any(line.startswith("kv_store") and "broken" in line for line in failed), out
    assert any("broken->reference" in line for line in failed), out  # its checkpoints are out of order too


def test_verify_names_an_unknown_backend(capsys):
    assert main(argparse.Namespace(backend="nope", quick=True)) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().out
