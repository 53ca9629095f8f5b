"""``make mutate``'s report, ``tests/MUTATION.md``, written from the groups' results in
``tests/mutation/results/`` and the survivors' notes: kill rates per group (both tiers and
the fast tier alone), per module family and per operator family, with 95% Wilson intervals."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tests" / "mutation" / "groups.toml"
SURVIVORS = ROOT / "tests" / "mutation" / "survivors.toml"
RESULTS = ROOT / "tests" / "mutation" / "results"
REPORT = ROOT / "tests" / "MUTATION.md"


def read_groups() -> dict[str, dict]:
    return tomllib.loads(CONFIG.read_text())["groups"]


def digest(paths: list[str]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(path.encode() + b"\0" + (ROOT / path).read_bytes())
    return h.hexdigest()[:16]


OUTCOMES = ("killed", "timeout", "survived", "incompetent", "pending", "not sampled")


def count_outcomes(mutants: list[dict]) -> dict[str, int]:
    counts = dict.fromkeys(OUTCOMES, 0)
    for m in mutants:
        counts[m["outcome"]] += 1
    return counts


def wilson(killed: int, run: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a kill rate of ``killed`` of ``run`` mutants."""
    if not run:
        return (0.0, 1.0)
    p = killed / run
    centre = (p + z * z / (2 * run)) / (1 + z * z / run)
    half = z * math.sqrt(p * (1 - p) / run + z * z / (4 * run * run)) / (1 + z * z / run)
    return (max(0.0, centre - half), min(1.0, centre + half))


def rate(counts: dict[str, int]) -> str:
    """``91.3% (84.0-95.6)``: the kill rate over the mutants run, with its 95% interval."""
    killed = counts["killed"] + counts["timeout"]
    run = killed + counts["survived"]
    if not run:
        return "-"
    low, high = wilson(killed, run)
    return f"{100 * killed / run:.1f}% ({100 * low:.1f}-{100 * high:.1f})"


def _fast_tier(record: dict, counts: dict[str, int]) -> str:
    """The kill rate of the fast tier alone and how far below both tiers' it is."""
    if "slow_tests" not in record:
        return "- (run before the tiers were told apart)"
    if not record["slow_tests"]:
        return "the same: no slow tests"
    late = sum(m.get("tier") == "slow" for m in record["mutants"])
    fast = {
        **counts,
        "killed": counts["killed"] + counts["timeout"] - late,
        "timeout": 0,
        "survived": counts["survived"] + late,
    }
    run = counts["killed"] + counts["timeout"] + counts["survived"]
    below = 100 * late / run if run else 0.0
    return f"{rate(fast)}, {below:.1f} points below"


def _family(mutant: dict) -> str:
    from leanstate._tools._mutation_ops import family_of

    return family_of(mutant.get("operator") or mutant["id"].split(":")[2].split("#")[0])


def write_report() -> Path:
    """Rewrite ``tests/MUTATION.md`` from the groups' results and the survivors' notes."""
    from leanstate._tools._mutation_ops import REALISTIC

    groups = read_groups()
    notes = tomllib.loads(SURVIVORS.read_text()) if SURVIVORS.exists() else {}
    records = {
        n: json.loads((RESULTS / f"{n}.json").read_text()) for n in groups if (RESULTS / f"{n}.json").exists()
    }
    out = [
        "# Mutation testing",
        "",
        "Written by `make mutate` (`compat/_tools/mutation.py`) from cosmic-ray's results in",
        "`tests/mutation/results/`; do not edit by hand. A survivor's reason for being equivalent",
        "is kept in `tests/mutation/survivors.toml`. `make mutate GROUPS=name` runs one group;",
        "rerun a group whenever its modules change (its row then reads *stale*).",
        "",
        "Token operators (one token changed): comparison (`==`/`!=`, `<`/`<=`, `>`/`>=`,",
        "`is`/`is not`), boolean (`and`/`or`, `True`/`False`, an added or removed `not`),",
        "arithmetic (`+`/`-`, `*`/`/`, `//`, `%`, `**`, shifts, bit operators, unary minus removed),",
        "constant (a number one larger), loop (`break`/`continue` swapped, a `for` over nothing).",
        "Realistic operators (a step left out or misplaced): removed statement (a call, `raise`,",
        "`assert`, `del`, augmented assignment or assignment to an attribute or item replaced by",
        "`pass`), dropped keyword argument, condition forced (an `if`/`elif` condition replaced by",
        "`True` or `False`), early return (a `return` before a function's first statement),",
        "swapped statements (two adjacent statements of a block, one an effect or an `if`, in the",
        "other order), slice bound off by one. No string is mutated (docstrings, error messages),",
        "nor anything in an f-string or an annotation.",
        "",
        "Each group runs a seeded sample of its mutants (40 by default, all where it has fewer;",
        '`make mutate MUTATE_ARGS="--sample N --seed S"`); each mutant runs the tests that reach',
        "its line (`-x -q -p no:randomly`, `nice -n 19`, a timeout of twice the group's coverage",
        "run); a timeout counts as killed. Kill rate: (killed + timeout) / (killed + timeout +",
        "survived) over the mutants run, with its 95% Wilson interval. `make mutate-diff REV=...`",
        "runs every mutant on the lines changed since REV instead (not recorded here).",
        "",
        "The tiers: a mutant runs the fast tier's tests (`make test`) first and the slow tier's",
        "(`-m slow`, `make test-slow`) only when it survives them. *Kill rate* counts both tiers;",
        "*fast tier alone* counts only the fast tier's kills. A test may move to the slow tier",
        "only while the fast tier alone stays within 2 points of both tiers in every group.",
        "",
        "| family | group | modules | mutants | sampled | killed | timeout | survived | not run | kill rate (95%) | fast tier alone (95%) | run on |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_family: dict[str, list[dict]] = {}
    by_operator: dict[str, list[dict]] = {}
    for name, group in groups.items():
        modules = ", ".join(f"`{m}`" for m in group["modules"])
        record = records.get(name)
        if record is None:
            out.append(
                f"| {group['family']} | {name} | {modules} | - | - | - | - | - | - | not run | - | {group.get('note', '-')} |"
            )
            continue
        by_family.setdefault(group["family"], []).extend(record["mutants"])
        for m in record["mutants"]:
            if m["outcome"] not in ("not sampled", "pending", "incompetent"):
                by_operator.setdefault(_family(m), []).append(m)
        c = count_outcomes(record["mutants"])
        sampled = len(record["mutants"]) - c["not sampled"]
        stale = " (stale: modules changed since)" if record["modules"] != digest(group["modules"]) else ""
        stale += f" ({c['pending']} of the sample not run yet)" if c["pending"] else ""
        out.append(
            f"| {group['family']} | {name} | {modules} | {len(record['mutants'])} | sampled {sampled} of"
            f" {len(record['mutants'])} | {c['killed']} | {c['timeout']} | {c['survived']} |"
            f" {c['pending'] + c['incompetent']} | {rate(c)} | {_fast_tier(record, c)} |"
            f" {record['commit']}, {record['date']}{stale} |"
        )
    out += ["", "Per module family (the groups run so far):", ""]
    for family, mutants in by_family.items():
        c = count_outcomes(mutants)
        names = [n for n, g in groups.items() if g["family"] == family]
        missing = [n for n in names if n not in records]
        run = c["killed"] + c["timeout"] + c["survived"]
        out.append(
            f"- {family}: {run} mutants run, kill rate {rate(c)}"
            + (f"; not run yet: {', '.join(missing)}" if missing else "")
        )
    out += [
        "",
        "Per operator family (every group's sample):",
        "",
        "| operators | family | run | kill rate (95%) |",
    ]
    out.append("|---|---|---|---|")
    for family in sorted(by_operator, key=lambda f: (f in REALISTIC.values(), f)):
        c = count_outcomes(by_operator[family])
        kind = "realistic" if family in REALISTIC.values() else "token"
        out.append(f"| {kind} | {family} | {c['killed'] + c['timeout'] + c['survived']} | {rate(c)} |")
    everything = [m for ms in by_operator.values() for m in ms]
    out.append(f"| all | all | {len(everything)} | {rate(count_outcomes(everything))} |")
    for name, record in records.items():
        survivors = [m for m in record["mutants"] if m.get("diff")]
        if not survivors:
            continue
        out += ["", f"## {name}: survivors", "", f"Tests: {', '.join(f'`{t}`' for t in record['tests'])}", ""]
        for m in survivors:
            change = " / ".join(f"`{line}`" for line in m["diff"])
            if m["outcome"] in ("killed", "timeout"):
                verdict = f"now killed by `{m.get('killed_by', 'a timeout')}`"
            elif m["id"] in notes:
                verdict = f"equivalent: {notes[m['id']]['why']}"
            else:
                verdict = "**not yet explained**"
            out.append(f"- `{m['id']}` {change}: {verdict}")
    REPORT.write_text("\n".join(out) + "\n")
    return REPORT
