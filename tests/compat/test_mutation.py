"""``make mutate``'s own parts: the operators (what they change and what they leave alone)
and the report written from the groups' results."""

from __future__ import annotations

import json
import os

import parso
import pytest
from cosmic_ray.ast import ast_nodes, get_ast
from cosmic_ray.mutating import mutate_code

from leanstate._tools import _mutation_report, mutation
from leanstate._tools._mutation_ops import OperatorProvider

PROVIDER = OperatorProvider()


def mutants(source: str) -> list[str]:
    """Every mutant of ``source`` the operators make."""
    out = []
    for name in PROVIDER:
        operator = PROVIDER[name]()
        count = sum(1 for node in ast_nodes(get_ast(source)) for _ in operator.mutation_positions(node))
        out += [mutate_code(source, operator, i) for i in range(count)]
    return out


@pytest.mark.parametrize("name", list(PROVIDER))
def test_each_operator_mutates_its_examples_as_stated(name):
    operator = PROVIDER[name]
    for example in operator.examples():
        mutated = mutate_code(
            example.pre_mutation_code, operator(**example.operator_args), example.occurrence
        )
        assert mutated == example.post_mutation_code


def test_strings_annotations_f_strings_and_signature_stars_are_left_alone():
    source = (
        "def f(x: int | None = None, *, y, **kw) -> int | None:\n"
        '    """Twice x."""\n'
        "    y: int | None = kw\n"
        '    raise ValueError(f"x={x + 1}")\n'
    )
    kept = ['"""Twice x."""', "x: int | None = None, *, y, **kw) -> int | None:", "y: int | None = kw"]
    made = mutants(source)
    for mutant in made:  # the docstring, the annotations, the stars and the f-string stay
        assert all(piece in mutant for piece in kept), mutant
        assert "raise" not in mutant or 'raise ValueError(f"x={x + 1}")' in mutant, mutant
    # what is mutated: the raise left out, a return before the body, the two lines swapped
    lines = source.splitlines(keepends=True)
    assert sorted(made) == sorted(
        [
            "".join([*lines[:3], "    pass\n"]),
            "".join([*lines[:2], "    return\n", *lines[2:]]),
            "".join([*lines[:2], lines[3], lines[2]]),
        ]
    )


def test_the_realistic_operators_make_the_bugs_token_operators_cannot():
    source = (
        "def save(store, rows, n):\n"
        '    """Save."""\n'
        "    check(rows)\n"
        "    store.mark = n\n"
        "    if n > 0:\n"
        "        write(rows[1:n])\n"
    )
    made = mutants(source)
    assert source.replace("    store.mark = n\n", "    pass\n") in made  # a mark never set
    assert (
        source.replace("    check(rows)\n    store.mark = n\n", "    store.mark = n\n    check(rows)\n")
        in made
    )
    assert source.replace("if n > 0", "if True") in made and source.replace("if n > 0", "if False") in made
    assert source.replace('"""Save."""\n', '"""Save."""\n    return\n') in made
    assert (
        source.replace("rows[1:n]", "rows[(1) + 1:n]") in made
        and source.replace("rows[1:n]", "rows[1:(n) - 1]") in made
    )
    assert all(compile(m, "m", "exec") for m in made)  # every mutant is valid Python


def test_each_operator_has_a_family_and_the_realistic_ones_are_named():
    from leanstate._tools._mutation_ops import REALISTIC, family_of

    families = {family_of(name) for name in PROVIDER}
    assert set(REALISTIC.values()) <= families
    assert {"comparison", "boolean", "arithmetic", "constant", "loop"} <= families
    assert family_of("core/Eq_NotEq") == "comparison" and family_of("core/Add_Sub") == "arithmetic"


def test_each_kind_of_mistake_is_made_once():
    made = mutants("if a < 1 and not b:\n    n += 2\n    f(c, key=d)\n")
    assert "if a <= 1 and not b:\n    n += 2\n    f(c, key=d)\n" in made
    assert "if a < 2 and not b:\n    n += 2\n    f(c, key=d)\n" in made
    assert "if a < 1 or not b:\n    n += 2\n    f(c, key=d)\n" in made
    assert "if a < 1 and  b:\n    n += 2\n    f(c, key=d)\n" in made
    assert "if a < 1 and not b:\n    pass\n    f(c, key=d)\n" in made
    assert "if a < 1 and not b:\n    n += 2\n    f(c)\n" in made
    assert len(made) == len(set(made))  # 'not not b' would repeat the removed 'not'


def test_a_function_body_is_told_from_what_runs_at_import():
    tree = parso.parse("LIMIT = 3\n\n\ndef f(x=4):\n    return x + LIMIT\n")
    assert not mutation._in_function_body(tree, (1, 8))  # the constant
    assert not mutation._in_function_body(tree, (4, 8))  # a default, evaluated at import
    assert mutation._in_function_body(tree, (5, 11))


def test_the_report_counts_explains_and_names_the_killing_test(tmp_path, monkeypatch):
    config = tmp_path / "groups.toml"
    config.write_text(
        '[groups.one]\nfamily = "core"\nmodules = ["compat/wrappers.py"]\ntests = ["tests/t.py"]\n'
        '[groups.two]\nfamily = "core"\nmodules = ["compat/zero.py"]\ntests = ["tests/u.py"]\n'
    )
    (tmp_path / "survivors.toml").write_text('["m.py:3:NumberPlusOne"]\nwhy = "a cache size"\n')
    results = tmp_path / "results"
    results.mkdir()
    record = {
        "group": "one",
        "commit": "abc1234",
        "date": "2026-01-01 00:00 UTC",
        "modules": "0" * 16,  # not the module's digest now: stale
        "tests": ["tests/t.py"],
        "baseline_seconds": 1.0,
        "mutants": [
            {"id": "m.py:1:AddNot", "outcome": "killed", "killed_by": "tests/t.py::test_a"},
            {"id": "m.py:2:AddNot", "outcome": "timeout"},
            {"id": "m.py:3:NumberPlusOne", "outcome": "survived", "diff": ["-x = 1", "+x = 2"]},
            {"id": "m.py:4:RemoveStatement", "outcome": "survived", "diff": ["-f()", "+pass"]},
            {
                "id": "m.py:5:AddNot",
                "outcome": "killed",
                "killed_by": "tests/t.py::test_b",
                "diff": ["-a", "+b"],
            },
            {"id": "m.py:6:AddNot", "outcome": "pending"},
            {"id": "m.py:7:SwapStatements", "outcome": "not sampled"},
        ],
    }
    (results / "one.json").write_text(json.dumps(record))
    for name, value in [
        ("CONFIG", config),
        ("SURVIVORS", tmp_path / "survivors.toml"),
        ("RESULTS", results),
        ("REPORT", tmp_path / "MUTATION.md"),
    ]:
        monkeypatch.setattr(_mutation_report, name, value)
    text = _mutation_report.write_report().read_text()
    row = next(line for line in text.splitlines() if line.startswith("| core | one |"))
    # 7 mutants, 6 sampled: killed 2, timeout 1, survived 2, not run 1; (2 + 1) / 5, Wilson 23.1-88.2
    assert (
        "| 7 | sampled 6 of 7 | 2 | 1 | 2 | 1 | 60.0% (23.1-88.2) | - (run before the tiers were told apart) |"
        " abc1234, 2026-01-01 00:00 UTC (stale" in row
    )
    assert "(1 of the sample not run yet)" in row and "partial" not in text
    assert "| core | two | `compat/zero.py` | - | - | - | - | - | - | not run | - | - |" in text
    assert "| token | boolean | 3 | 100.0% (43.8-100.0) |" in text  # the AddNot mutants run
    assert "| realistic | removed statement | 1 | 0.0% (0.0-79.3) |" in text
    assert "- `m.py:3:NumberPlusOne` `-x = 1` / `+x = 2`: equivalent: a cache size" in text
    assert "- `m.py:4:RemoveStatement` `-f()` / `+pass`: **not yet explained**" in text
    assert "- `m.py:5:AddNot` `-a` / `+b`: now killed by `tests/t.py::test_b`" in text
    assert "- core: 5 mutants run, kill rate 60.0% (23.1-88.2); not run yet: two" in text


def test_the_sample_is_seeded_the_whole_group_when_small_and_wilson_is_exact():
    ids = [f"m.py:{i}:AddNot" for i in range(100)]
    first = mutation.sample_of(ids, 40, "0:core")
    assert len(first) == 40 and first == mutation.sample_of(list(reversed(ids)), 40, "0:core")
    assert first != mutation.sample_of(ids, 40, "1:core")
    assert mutation.sample_of(ids[:30], 40, "0:core") == set(ids[:30])
    low, high = _mutation_report.wilson(36, 40)
    assert round(low, 4) == 0.7695 and round(high, 4) == 0.9604
    assert _mutation_report.wilson(0, 0) == (0.0, 1.0)


def test_changed_lines_are_the_new_sides_hunks(tmp_path, monkeypatch):
    hunks = "@@ -3 +3 @@\n-a\n+b\n@@ -10,0 +11,2 @@\n+c\n+d\n@@ -20,2 +22,0 @@\n-e\n-f\n"
    monkeypatch.setattr(mutation, "_git", lambda *args: hunks)
    assert mutation.changed_lines("HEAD", "m.py") == {3, 11, 12}


def test_the_slow_tier_runs_only_on_a_survivor_of_the_fast_tier_and_its_kills_are_marked(
    tmp_path, monkeypatch
):
    import cosmic_ray.plugins
    from cosmic_ray.work_item import MutationSpec, TestOutcome

    cosmic_ray.plugins.OPERATOR_PROVIDERS.clear()
    cosmic_ray.plugins.OPERATOR_PROVIDERS["leanstate"] = PROVIDER
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text("X = 1\nY = 2\n")  # the mutant: X = 2
    ran = tmp_path / "slow-ran"
    (tmp_path / "test_t.py").write_text(
        "import pathlib\nimport m\n"
        "def test_y():\n    assert m.Y == 2\n"
        "def test_x():\n    assert m.X == 1\n"
        f"def test_x_slowly():\n    pathlib.Path({str(ran)!r}).touch()\n    assert m.X == 1\n"
    )
    item = type(
        "Item", (), {"mutations": [MutationSpec("m.py", "leanstate/NumberPlusOne", 0, (1, 4), (1, 5))]}
    )()
    y, x, x_slowly = (f"test_t.py::{t}" for t in ("test_y", "test_x", "test_x_slowly"))
    slow = {x_slowly}

    killed_late = mutation._test_in_tiers(item, [y, x_slowly], slow, 60)
    assert killed_late.test_outcome == TestOutcome.KILLED and ran.exists()
    assert killed_late.output.startswith(mutation._SLOW_TIER) and "test_x_slowly" in killed_late.output
    ran.unlink()
    killed_early = mutation._test_in_tiers(item, [y, x, x_slowly], slow, 60)
    assert killed_early.test_outcome == TestOutcome.KILLED and not ran.exists()  # slow tier not run
    assert not killed_early.output.startswith(mutation._SLOW_TIER)
    assert mutation._test_in_tiers(item, [y], slow, 60).test_outcome == TestOutcome.SURVIVED
    assert (tmp_path / "m.py").read_text() == "X = 1\nY = 2\n"


def test_the_report_gives_the_fast_tiers_kill_rate_beside_both_tiers(tmp_path, monkeypatch):
    config = tmp_path / "groups.toml"
    config.write_text(
        "".join(
            f'[groups.{g}]\nfamily = "core"\nmodules = ["compat/wrappers.py"]\ntests = ["tests/t.py"]\n'
            for g in ("tiers", "flat", "old")
        )
    )
    results = tmp_path / "results"
    results.mkdir()
    kills = [{"id": f"m.py:{i}:AddNot", "outcome": "killed", "tier": "fast"} for i in range(7)]
    late = [{"id": "m.py:8:AddNot", "outcome": "killed", "tier": "slow"}]
    late += [{"id": "m.py:9:AddNot", "outcome": "timeout", "tier": "slow"}]
    survivor = [{"id": "m.py:10:AddNot", "outcome": "survived", "diff": ["-a", "+b"]}]
    base = {"commit": "abc1234", "date": "d", "modules": "0" * 16, "tests": [], "baseline_seconds": 1}
    for name, extra, mutants in [
        ("tiers", {"slow_tests": 3}, kills + late + survivor),
        ("flat", {"slow_tests": 0}, kills + survivor),
        ("old", {}, kills),
    ]:
        (results / f"{name}.json").write_text(
            json.dumps({**base, **extra, "group": name, "mutants": mutants})
        )
    for name, value in [("CONFIG", config), ("RESULTS", results), ("REPORT", tmp_path / "MUTATION.md")]:
        monkeypatch.setattr(_mutation_report, name, value)
    monkeypatch.setattr(_mutation_report, "SURVIVORS", tmp_path / "none.toml")
    rows = {
        line.split(" | ")[1]: line
        for line in _mutation_report.write_report().read_text().splitlines()
        if "| core |" in line
    }
    # both tiers: 9 of 10; the fast tier alone: 7 of 10, 20 points below
    assert "| 90.0% (59.6-98.2) | 70.0% (39.7-89.2), 20.0 points below |" in rows["tiers"]
    assert "| 87.5% (52.9-97.8) | the same: no slow tests |" in rows["flat"]
    assert "| - (run before the tiers were told apart) |" in rows["old"]


def test_the_coverage_run_files_each_tests_time_and_the_slow_tiers_tests(tmp_path):
    import subprocess
    import sys

    (tmp_path / "test_t.py").write_text(
        "import pytest\ndef test_quick():\n    pass\n@pytest.mark.slow\ndef test_long():\n    pass\n"
    )
    out = tmp_path / "durations.json"
    env = {**os.environ, "LEANSTATE_MUTATION_DURATIONS": str(out)}
    command = [sys.executable, "-m", "coverage", "run", f"--data-file={tmp_path / '.cov'}", *mutation.PYTEST]
    command += ["-p", "leanstate._tools._mutation_context", "test_t.py"]
    subprocess.run(command, cwd=tmp_path, env=env, check=True, capture_output=True)
    timings = json.loads(out.read_text())
    assert sorted(timings["seconds"]) == ["test_t.py::test_long", "test_t.py::test_quick"]
    assert timings["slow"] == ["test_t.py::test_long"]
