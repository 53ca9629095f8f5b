"""``make mutate``'s own parts: the operators (what they change and what they leave alone)
and the report written from the groups' results."""

from __future__ import annotations

import json

import parso
import pytest
from cosmic_ray.ast import ast_nodes, get_ast
from cosmic_ray.mutating import mutate_code

from leanstate._tools import mutation
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
    changed = set()
    for mutant in mutants(source):
        changed |= {i for i, (a, b) in enumerate(zip(source.splitlines(), mutant.splitlines())) if a != b}
    # only the raise, left out: not the docstring, the annotations, the stars or the f-string
    assert changed == {3}
    assert [mutant.splitlines()[3] for mutant in mutants(source)] == ["    pass"]


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
        ],
    }
    (results / "one.json").write_text(json.dumps(record))
    for name, value in [
        ("CONFIG", config),
        ("SURVIVORS", tmp_path / "survivors.toml"),
        ("RESULTS", results),
        ("REPORT", tmp_path / "MUTATION.md"),
    ]:
        monkeypatch.setattr(mutation, name, value)
    text = mutation.write_report().read_text()
    row = next(line for line in text.splitlines() if line.startswith("| core | one |"))
    # 6 mutants: killed 2, timeout 1, survived 2, not run 1; (2 + 1) / 5
    assert "| 6 | 2 | 1 | 2 | 1 | 60.0% | abc1234, 2026-01-01 00:00 UTC (stale" in row and "(partial)" in row
    assert "| core | two | `compat/zero.py` | - | - | - | - | - | not run | - |" in text
    assert "- `m.py:3:NumberPlusOne` `-x = 1` / `+x = 2`: equivalent: a cache size" in text
    assert "- `m.py:4:RemoveStatement` `-f()` / `+pass`: **not yet explained**" in text
    assert "- `m.py:5:AddNot` `-a` / `+b`: now killed by `tests/t.py::test_b`" in text
    assert "- core: 5 of 6 mutants run, kill rate 60.0%; not run yet: two" in text
