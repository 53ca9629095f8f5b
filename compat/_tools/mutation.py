"""``make mutate``: mutation testing of the checkpoint core, DCP, ZeRO, the conformance kit
and the engines, with cosmic-ray, and the report ``tests/MUTATION.md``.

Why cosmic-ray: it writes each mutant into the source file on disk and runs a test
command in a new process group. The tests start gloo ranks and subprocesses that import
``leanstate`` from this tree (an editable install), so they run the mutant too; numba
compiles the mutated source like any other; a hung mutant's whole process group is
killed at the timeout. mutmut 3 instead rewrites every function of a module into a
trampoline run from a copy of the tree: the child processes would import the unmutated
tree, and ``@njit`` bodies cannot call its trampolines.

Per group (``tests/mutation/groups.toml``: modules, the test files that cover them):

1. the group's tests run once, unmutated, under coverage with one context per test
   (``_mutation_context.py``), child processes included: which tests reach which line;
2. cosmic-ray enumerates the mutants (``_mutation_ops.py``: comparison, boolean,
   arithmetic, constant, removed statement or keyword argument; no string is mutated) into
   its session database ``.mutation/<group>.sqlite``, kept while the modules are unchanged
   so an interrupted run resumes;
3. each mutant runs ``pytest -x -q -p no:randomly`` under ``nice -n 19`` on the tests that
   reach its line, fastest first; a line reached by none (a numba kernel's body) gets all of
   the group's tests; a line run at import (outside a function body) gets the tests that
   reach the module, and, when it survives them, all of the group's tests. The fast tier
   (``make test``) runs first and the slow tier (``-m slow``) only on a survivor of it, so
   each kill is filed under the tier that made it: the report gives the fast tier's kill
   rate beside both tiers', the rule for what may move to ``make test-slow``;
4. the outcomes go to ``tests/mutation/results/<group>.json`` (committed) and the report
   is rewritten from all groups' results and ``tests/mutation/survivors.toml`` (why a
   survivor is equivalent).

A run is a seeded sample (``--sample``, 40 a group by default, every mutant where the
group has fewer; ``--seed``): the same seed and modules give the same sample, so a stopped
run resumes where it stopped. The report gives each group's kill rate with its 95% Wilson
interval, and the same per operator family (token and realistic, ``_mutation_ops.py``).

``--diff REV`` (``make mutate-diff REV=...``) judges a change before it lands: every
mutant (not a sample) on the lines of the groups' modules changed since ``REV``, its
outcomes in ``.mutation/diff.json`` and printed, survivors with their diffs.

``--rerun-survivors`` runs a group's survivors again (after a test was added for them),
but not those ``survivors.toml`` explains: the report then names the test that kills each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import tomllib

from leanstate._tools._mutation_report import (
    RESULTS,
    ROOT,
    SURVIVORS,
    count_outcomes,
    digest,
    rate,
    read_groups,
    write_report,
)

WORK = ROOT / ".mutation"
PYTEST = ["-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider"]
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
_SLOW_TIER = "[killed in the slow tier]\n"  # heads a result's output


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


# -- which tests reach which line -------------------------------------------------------


def _coverage_map(name: str, group: dict) -> dict:
    """The group's tests run once unmutated under coverage; ``{module: {line: [node ids]}}``
    and the run's wall time, cached until the modules or test files change."""
    key = digest([*group["modules"], *group["tests"], "compat/_tools/_mutation_context.py"])
    cache = WORK / f"{name}.baseline.json"
    if cache.exists() and json.loads(cache.read_text())["key"] == key:
        return json.loads(cache.read_text())
    for old in WORK.glob(f"{name}.cov*"):
        old.unlink()
    rcfile = WORK / f"{name}.coveragerc"
    include = ",".join(str(ROOT / m) for m in group["modules"])
    rcfile.write_text(
        f"[run]\ndata_file = {WORK / (name + '.cov')}\nparallel = true\ninclude = {include}\npatch = _exit\n"
    )
    command = [sys.executable, "-m", "coverage", "run", f"--rcfile={rcfile}", *PYTEST]
    command += ["-p", "leanstate._tools._mutation_context", *group["tests"]]
    print(f"[{name}] baseline: the tests unmutated, under coverage", flush=True)
    start = time.monotonic()
    durations = WORK / f"{name}.durations.json"
    # each test starts its own ranks (tests.harness.Worlds): their lines are filed under it
    env = {**os.environ, "LEANSTATE_MUTATION_DURATIONS": str(durations), "LEANSTATE_TESTS_ONE_AT_A_TIME": "1"}
    run = subprocess.run(["nice", "-n", "19", *command], cwd=ROOT, capture_output=True, text=True, env=env)
    seconds = time.monotonic() - start
    if run.returncode != 0:
        sys.exit(f"[{name}] the group's tests fail unmutated:\n{run.stdout[-3000:]}{run.stderr[-2000:]}")
    subprocess.run(
        [sys.executable, "-m", "coverage", "combine", f"--rcfile={rcfile}", "-q"], cwd=ROOT, check=True
    )
    from coverage import CoverageData

    data = CoverageData(basename=str(WORK / f"{name}.cov"))
    data.read()
    lines: dict[str, dict[int, list[str]]] = {}
    for module in group["modules"]:
        contexts = data.contexts_by_lineno(str(ROOT / module))
        lines[module] = {str(line): sorted(c for c in ids if c) for line, ids in contexts.items()}
    timings = json.loads(durations.read_text())
    baseline = {
        "key": key,
        "seconds": round(seconds, 1),
        "lines": lines,
        "durations": timings["seconds"],
        "slow": timings["slow"],
    }
    cache.write_text(json.dumps(baseline))
    return baseline


def _in_function_body(tree, position: tuple[int, int]) -> bool:
    """Whether ``position`` is in a function's body (not run at import)."""
    node = tree.get_leaf_for_position(position, include_prefixes=True)
    while node is not None and node.parent is not None:
        if node.parent.type == "funcdef" and node is node.parent.children[-1]:
            return True
        node = node.parent
    return False


# -- running the mutants ----------------------------------------------------------------


def _open_session(name: str, group: dict):
    """cosmic-ray's session database of the group, enumerated anew when a module changed."""
    import cosmic_ray.plugins
    from cosmic_ray.commands import init
    from cosmic_ray.work_db import WorkDB

    from leanstate._tools._mutation_ops import OperatorProvider

    cosmic_ray.plugins.OPERATOR_PROVIDERS.clear()
    cosmic_ray.plugins.OPERATOR_PROVIDERS["leanstate"] = OperatorProvider()
    key = digest([*group["modules"], "compat/_tools/_mutation_ops.py"])
    stamp = WORK / f"{name}.modules"
    db = WorkDB(str(WORK / f"{name}.sqlite"), WorkDB.Mode.create)
    if not stamp.exists() or stamp.read_text() != key:
        init([Path(m) for m in group["modules"]], db, {})
        stamp.write_text(key)
    return db


def sample_of(ids: list[str], size: int, seed: str) -> set[str]:
    """A seeded sample of ``size`` of the mutant ids (all of them when there are fewer)."""
    ordered = sorted(ids)
    return set(ordered if len(ordered) <= size else random.Random(seed).sample(ordered, size))


def changed_lines(rev: str, module: str) -> set[int]:
    """The lines of ``module`` (as it is now) added or changed since ``rev``."""
    diff = _git("diff", "-U0", rev, "--", module)
    lines: set[int] = set()
    for start, count in re.findall(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", diff, re.MULTILINE):
        lines.update(range(int(start), int(start) + (1 if count == "" else int(count))))
    return lines


def _run_group(
    name: str,
    group: dict,
    deadline: float,
    rerun_survivors: bool,
    *,
    sample: int = 40,
    seed: int = 0,
    diff: str | None = None,
) -> dict | None:
    """Run the group's chosen mutants: its sample, or with ``diff`` every mutant on a line
    changed since that revision (its outcomes returned instead of exported)."""
    import parso
    from cosmic_ray.work_item import TestOutcome

    dirty = _git("status", "--porcelain", "--", *group["modules"])
    if dirty:
        sys.exit(
            f"[{name}] uncommitted changes in the modules (a mutant left behind? `git diff` shows it):\n{dirty}"
        )
    WORK.mkdir(exist_ok=True)
    os.environ.update(group.get("env", {}))  # the tests' processes inherit it
    baseline = _coverage_map(name, group)
    timeout = float(group.get("timeout", max(60.0, 2 * baseline["seconds"])))
    db = _open_session(name, group)
    if diff is not None:
        touched = {m: changed_lines(diff, m) for m in group["modules"]}

        def chosen(item) -> bool:
            m = item.mutations[0]
            return bool(touched[str(m.module_path)] & set(range(m.start_pos[0], m.end_pos[0] + 1)))
    else:
        picked = sample_of([i for _, i in _ids(db)], sample, f"{seed}:{name}")
        by_job = {w.job_id: i for w, i in _ids(db)}

        def chosen(item) -> bool:
            return by_job[item.job_id] in picked

    try:
        trees = {m: parso.parse((ROOT / m).read_text()) for m in group["modules"]}

        def order(item) -> tuple:  # import-time mutants last: each runs every test of its module
            m = item.mutations[0]
            return (
                not _in_function_body(trees[str(m.module_path)], m.start_pos),
                str(m.module_path),
                m.start_pos,
            )

        if rerun_survivors:  # their results are overwritten; those explained as equivalent stay
            explained = tomllib.loads(SURVIVORS.read_text()) if SURVIVORS.exists() else {}
            survived = {
                w.job_id for w, r in db.completed_work_items if r.test_outcome == TestOutcome.SURVIVED
            }
            todo = [w for w, i in _ids(db) if w.job_id in survived and i not in explained]
        else:
            todo = list(db.pending_work_items)
        pending = sorted((w for w in todo if chosen(w)), key=order)
        print(
            f"[{name}] {db.num_work_items} mutants, {len(pending)} to run, timeout {timeout:.0f}s", flush=True
        )
        for done, item in enumerate(pending):
            if time.monotonic() > deadline:
                print(
                    f"[{name}] out of time: {len(pending) - done} mutants left for the next run", flush=True
                )
                break
            mutation = item.mutations[0]
            module = str(mutation.module_path)
            lines = baseline["lines"][module]
            tests: set[str] = set()
            at_import = not _in_function_body(trees[module], mutation.start_pos)
            if not at_import:
                for line in range(mutation.start_pos[0], mutation.end_pos[0] + 1):
                    tests.update(lines.get(str(line), ()))
            else:  # run at import: first the tests that run the module
                tests.update(t for ids in lines.values() for t in ids)
            every = sorted(baseline["durations"], key=lambda t: (baseline["durations"][t], t))
            # fastest first: -x stops at the first failure
            targets = sorted(tests, key=lambda t: (baseline["durations"].get(t, 0.0), t)) or every
            result = _test_in_tiers(item, targets, set(baseline["slow"]), timeout)
            if at_import and _outcome(result) == "survived" and tests:
                # what it defines may reach a test through another module (a default
                # argument there) without running a line of this one: all the tests then
                result = _test_in_tiers(item, every, set(baseline["slow"]), timeout)
            db.set_result(item.job_id, result)
            print(f"[{name}] {done + 1}/{len(pending)} {_describe(mutation)}: {_outcome(result)}", flush=True)
    finally:  # also when stopped: what ran is reported, the rest as not run
        outcome = (
            _diff_outcomes(db, chosen) if diff is not None else _export(name, group, db, baseline, chosen)
        )
        db.close()
    return outcome


def _test_in_tiers(item, targets: list[str], slow: set[str], timeout: float):
    """``targets`` on the mutant: the fast tier's, then, if it survives them, the slow
    tier's; a kill in the slow tier is marked in the result's output."""
    from attrs import evolve
    from cosmic_ray.mutating import mutate_and_test

    result = None
    for tier in ([t for t in targets if t not in slow], [t for t in targets if t in slow]):
        if not tier:
            continue
        command = shlex.join(["nice", "-n", "19", sys.executable, *PYTEST, "-x", *tier])
        later = result is not None
        result = mutate_and_test(item.mutations, command, timeout)
        if _outcome(result) != "survived":
            return evolve(result, output=_SLOW_TIER + (result.output or "")) if later else result
    return result


def _diff_outcomes(db, chosen) -> dict:
    """The outcomes of the mutants a diff run chose: ``{id: {outcome, diff}}``."""
    results = dict(db.results)
    out = {}
    for item, mutant_id in _ids(db):
        if chosen(item):
            result = results.get(item.job_id)
            out[mutant_id] = {
                "outcome": "pending" if result is None else _outcome(result),
                "diff": [] if result is None else _diff_lines(result.diff),
            }
    return out


def _stop(*_) -> None:
    """SIGTERM: end the running test command's process group (its own session, so the
    signal did not reach it) and leave; cosmic-ray puts the mutated file back on the way out."""
    import psutil

    for child in psutil.Process().children():
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sys.exit("stopped: what ran is kept, the rest is left for the next run")


def _describe(mutation) -> str:
    return f"{mutation.module_path}:{mutation.start_pos[0]} {mutation.operator_name.split('/')[-1]}"


def _outcome(result) -> str:
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    if result.worker_outcome != WorkerOutcome.NORMAL:
        return "incompetent"  # no test ran: the mutant could not be applied
    if result.test_outcome == TestOutcome.SURVIVED:
        return "survived"
    return "timeout" if result.output == "timeout" else "killed"


def _diff_lines(diff: str) -> list[str]:
    return [
        line for line in (diff or "").splitlines() if line[:1] in "+-" and not line.startswith(("---", "+++"))
    ]


def _ids(db) -> list[tuple]:
    """(work item, its id ``module:line:operator``, ``#n`` from the second on a line), in
    source order: the ids of the results files and of ``survivors.toml``."""
    out, seen = [], {}
    for item in sorted(
        db.work_items, key=lambda w: (str(w.mutations[0].module_path), w.mutations[0].start_pos)
    ):
        mutation = item.mutations[0]
        base = f"{mutation.module_path}:{mutation.start_pos[0]}:{mutation.operator_name.split('/')[-1]}"
        seen[base] = seen.get(base, -1) + 1
        out.append((item, base if not seen[base] else f"{base}#{seen[base]}"))
    return out


def _export(name: str, group: dict, db, baseline: dict, sampled) -> None:
    """The session's outcomes into ``tests/mutation/results/<group>.json`` (a mutant outside
    the sample is ``not sampled``)."""
    path = RESULTS / f"{name}.json"
    before = {m["id"]: m for m in json.loads(path.read_text())["mutants"]} if path.exists() else {}
    results = dict(db.results)
    mutants = []
    for item, mutant_id in _ids(db):
        entry = {"id": mutant_id}
        result = results.get(item.job_id)
        entry["operator"] = item.mutations[0].operator_name.split("/")[-1]
        if result is None:
            entry["outcome"] = "pending" if sampled(item) else "not sampled"
        else:
            entry["outcome"] = _outcome(result)
        if entry["outcome"] == "killed":
            match = _FAILED.search(result.output or "")
            entry["killed_by"] = match.group(1) if match else "(collection or import)"
        if entry["outcome"] in ("killed", "timeout"):
            entry["tier"] = "slow" if (result.output or "").startswith(_SLOW_TIER) else "fast"
        if result is not None and (entry["outcome"] == "survived" or before.get(entry["id"], {}).get("diff")):
            entry["diff"] = _diff_lines(result.diff)  # a survivor, now or once
        mutants.append(entry)
    record = {
        "group": name,
        "commit": _git("rev-parse", "--short", "HEAD"),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "modules": digest(group["modules"]),
        "tests": group["tests"],
        "baseline_seconds": baseline["seconds"],
        "slow_tests": len(baseline["slow"]),
        "mutants": mutants,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def _run_diff(rev: str, groups: dict, chosen: list[str], deadline: float) -> int:
    """``--diff REV``: every mutant on a changed line of each group's modules; the outcomes
    printed and kept in ``.mutation/diff.json``; exit 1 while a survivor is unexplained."""
    notes = tomllib.loads(SURVIVORS.read_text()) if SURVIVORS.exists() else {}
    outcomes: dict[str, dict] = {}
    for name in chosen:
        group = groups[name]
        if not any(changed_lines(rev, m) for m in group["modules"]):
            continue
        outcomes.update(_run_group(name, group, deadline, False, diff=rev) or {})
    WORK.mkdir(exist_ok=True)
    (WORK / "diff.json").write_text(json.dumps({"rev": rev, "mutants": outcomes}, indent=1) + "\n")
    c = count_outcomes([{"outcome": v["outcome"]} for v in outcomes.values()])
    print(f"mutate-diff since {rev}: {len(outcomes)} mutants on changed lines, kill rate {rate(c)}")
    open_survivors = 0
    for mutant_id, v in sorted(outcomes.items()):
        if v["outcome"] == "survived":
            why = notes.get(mutant_id, {}).get("why")
            open_survivors += why is None
            print(
                f"  survived {mutant_id}: {' / '.join(v['diff'])}" + (f" (equivalent: {why})" if why else "")
            )
    return 1 if open_survivors else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m leanstate._tools.mutation [--groups a,b] [--minutes N] ...``"""
    groups = read_groups()
    parser = argparse.ArgumentParser(prog="make mutate", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--groups", default="", help=f"comma-separated, of: {', '.join(groups)} (default: all)"
    )
    parser.add_argument(
        "--minutes", type=float, default=0, help="start no mutant after this long (0: no limit)"
    )
    parser.add_argument(
        "--rerun-survivors", action="store_true", help="run only the groups' survivors, again"
    )
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from the results")
    parser.add_argument(
        "--sample", type=int, default=40, help="mutants run a group (default 40; all if fewer)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    parser.add_argument("--diff", metavar="REV", help="every mutant on the lines changed since REV instead")
    args = parser.parse_args(argv)
    chosen = [g for g in args.groups.split(",") if g] or list(groups)
    unknown = [g for g in chosen if g not in groups]
    if unknown:
        parser.error(f"--groups: unknown {', '.join(unknown)}; the groups are {', '.join(groups)}")
    deadline = time.monotonic() + args.minutes * 60 if args.minutes else float("inf")
    os.chdir(ROOT)
    # a stopped run puts the mutated file back (cosmic-ray restores it on the way out)
    signal.signal(signal.SIGTERM, _stop)
    if args.diff:
        return _run_diff(args.diff, groups, chosen, deadline)
    if not args.report_only:
        for name in chosen:
            if time.monotonic() > deadline:
                print(f"[{name}] not started: out of time", flush=True)
                continue
            _run_group(name, groups[name], deadline, args.rerun_survivors, sample=args.sample, seed=args.seed)
            write_report()
    print(f"report: {write_report().relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
