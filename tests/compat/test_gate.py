"""The regression gate and the paired comparison: the arithmetic on times the test chooses
(a controlled clock: no wall time), on noise recorded on a busy 2-core machine, and the
two trees it lays out (a baseline commit's sources, this checkout's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from leanstate._tools import gate

ROOT = Path(__file__).resolve().parents[2]


def rounds(times: dict[str, list[float]]) -> list[dict]:
    """Per-figure lists of round times as the workers report them: one dict per round."""
    count = len(next(iter(times.values())))
    return [{name: values[k] for name, values in times.items()} for k in range(count)]


def test_paired_ratios_are_per_round_and_the_median_decides():
    new = rounds({"get": [2.0, 3.0, 30.0, 3.0, 3.0], "set": [1.0, 1.0, 1.0, 1.0, 1.0]})
    old = rounds({"get": [1.0, 1.0, 1.0, 1.0, 1.0], "set": [1.0, 2.0, 0.5, 1.0, 1.0]})
    get, set_ = gate.paired(new, old)
    assert (get.name, get.ratios, get.median, get.spread) == (
        "get",
        (2.0, 3.0, 30.0, 3.0, 3.0),
        3.0,
        (2.0, 30.0),
    )
    assert not get.passed and get.change == "slower"
    assert set_.ratios == (1.0, 0.5, 2.0, 1.0, 1.0) and set_.median == 1.0 and set_.passed
    assert set_.change == "same"


def test_the_median_not_the_last_or_the_best_round_counts():
    """One wild round either way moves neither the gate nor the comparison."""
    steady = [1.0] * 6
    for wild in (0.05, 40.0):
        (verdict,) = gate.paired(rounds({"f": [*steady, wild]}), rounds({"f": [1.0] * 7}))
        assert verdict.median == 1.0 and verdict.passed and verdict.change == "same"
    (slowed,) = gate.paired(rounds({"f": [3.0] * 6 + [0.5]}), rounds({"f": [1.0] * 7}))
    assert slowed.median == 3.0 and not slowed.passed  # a 3x slowdown with one lucky round


def test_a_3x_slowdown_fails_and_a_limit_below_it_passes():
    for factor, passes in (
        (3.0, False),
        (gate.GATE_LIMIT * 1.01, False),
        (gate.GATE_LIMIT, True),
        (1.0, True),
    ):
        (verdict,) = gate.paired(rounds({"f": [factor] * 7}), rounds({"f": [1.0] * 7}))
        assert verdict.passed is passes, factor


def test_compare_needs_the_margin_and_the_sign_test():
    old = rounds({"f": [1.0] * 10})
    beyond = 1 + gate.COMPARE_MARGIN + 0.25
    mixed = [beyond] * 7 + [0.9] * 3  # median beyond the margin, but 3 of 10 rounds faster
    (verdict,) = gate.paired(rounds({"f": mixed}), old)
    assert verdict.median > 1 + gate.COMPARE_MARGIN and verdict.change == "same"
    (verdict,) = gate.paired(rounds({"f": [beyond] * 9 + [0.9]}), old)
    assert verdict.change == "slower"
    (verdict,) = gate.paired(rounds({"f": [1 / beyond] * 10}), old)
    assert verdict.change == "faster"
    (verdict,) = gate.paired(rounds({"f": [1 + gate.COMPARE_MARGIN - 0.05] * 10}), old)
    assert verdict.change == "same"  # within the margin


def test_rounds_a_side_could_not_time_are_left_out():
    new = [{"f": 1.0, "g": None}, {"f": 2.0, "g": 1.0}, {"f": 1.0}]
    old = [{"f": 1.0, "g": 1.0}, {"f": 1.0, "g": 1.0}, {"f": 1.0, "h": 1.0}]
    f, g = gate.paired(new, old)
    assert (f.name, f.ratios) == ("f", (1.0, 2.0, 1.0)) and (g.name, g.ratios) == ("g", (1.0,))


def test_the_report_names_each_figure_its_spread_and_verdict():
    verdicts = [gate.Verdict("store get", (3.0, 3.1, 2.9)), gate.Verdict("store set", (0.9, 1.1, 1.0))]
    lines = gate.report(verdicts, "abcdef0123456789", gate=True).splitlines()
    assert lines[0].startswith("this tree vs abcdef0123")
    assert lines[1] == "  FAIL  store get: median 3 (2.9..3.1, 3 rounds)"
    assert lines[2] == "  PASS  store set: median 1 (0.9..1.1, 3 rounds)"
    compared = gate.report(verdicts, "abcdef0123456789", gate=False).splitlines()
    assert compared[1].split()[0] == "slower" and compared[2].split()[0] == "same"


def test_both_trees_are_laid_out_as_importable_packages(tmp_path):
    """The baseline's sources from git, and this checkout's through links: each imports as
    ``leanstate`` from its own folder, whatever is installed."""
    head = gate.baseline(ROOT, "HEAD")
    old = gate.checkout(ROOT, head, tmp_path)
    assert gate.checkout(ROOT, head, tmp_path) == old  # kept for the next run
    new = gate.working_tree(ROOT, tmp_path)
    for tree in (old, new):
        where = subprocess.run(
            [sys.executable, "-c", "import leanstate.reference.kv_store as m, leanstate; print(m.__file__)"],
            cwd=tree,
            env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
        )
        assert where.returncode == 0, where.stderr[-2000:]
        assert Path(where.stdout.strip()).is_relative_to(tree), where.stdout
    assert (new / "leanstate" / "kv_store.py").resolve() == ROOT / "compat" / "kv_store.py"


def test_the_baseline_is_head_for_a_changed_tree_else_its_parent(tmp_path):
    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    for name in gate.SOURCES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.py").write_text("x = 1\n")
    for message in ("one", "two"):
        git("add", "-A")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message, "--allow-empty")
    head, parent = git("rev-parse", "HEAD").strip(), git("rev-parse", "HEAD~1").strip()
    assert gate.baseline(tmp_path) == parent
    (tmp_path / "compat" / "m.py").write_text("x = 2\n")
    assert gate.baseline(tmp_path) == head
    assert gate.baseline(tmp_path, "HEAD~1") == parent
    with pytest.raises(subprocess.CalledProcessError):
        gate.baseline(tmp_path, "no-such-commit")


RECORDED = Path(__file__).with_name("gate_noise.json")


def test_recorded_noise_of_an_unchanged_tree_raises_no_alarm_and_a_3x_slowdown_fails():
    """Paired ratios recorded on this project's 2-core machine beside a CPU-bound process
    (``gate_noise.json``, runs of 7 rounds): an unchanged tree against its own commit (10
    runs) fails no figure and reads as changed nowhere; the same rounds with this tree's
    times tripled fail every figure; and in the runs with a real 3x slowdown planted (the
    store's get and set, the checkpoint load and save, an SGD step; 3 runs each) the
    planted figure fails every time."""
    recorded = json.loads(RECORDED.read_text())
    runs = recorded["unchanged"]
    assert len(runs) >= 10
    for figures in runs:
        verdicts = [gate.Verdict(name, tuple(ratios)) for name, ratios in figures.items()]
        assert len(verdicts) >= 11
        assert all(v.passed for v in verdicts), [(v.name, v.median) for v in verdicts if not v.passed]
        changed = [(v.name, v.ratios) for v in verdicts if v.change != "same"]
        assert not changed, changed
        slowed = [gate.Verdict(v.name, tuple(3 * r for r in v.ratios)) for v in verdicts]
        assert not any(v.passed for v in slowed), [(v.name, v.median) for v in slowed if v.passed]
    planted = recorded["planted"]
    assert len(planted) == 5 and all(len(r) == 3 for r in planted.values())
    for name, planted_runs in planted.items():
        for ratios in planted_runs:
            assert not gate.Verdict(name, tuple(ratios)).passed, (name, ratios)


def test_the_side_that_runs_first_alternates_by_round_and_by_figure():
    """Kills: the order alternating by round only (every figure of a round then runs the same
    side first) or by figure only (a figure's first side never changes)."""
    from leanstate._tools.gate import this_tree_first

    rounds, figures = 6, 5
    firsts = [[this_tree_first(k, f) for f in range(figures)] for k in range(rounds)]
    for k in range(rounds):  # within a round, neighbouring figures start on different sides
        assert all(firsts[k][f] != firsts[k][f + 1] for f in range(figures - 1))
    for f in range(figures):  # a figure starts on each side in turn
        assert all(firsts[k][f] != firsts[k + 1][f] for k in range(rounds - 1))
        assert sum(firsts[k][f] for k in range(rounds)) == rounds // 2
