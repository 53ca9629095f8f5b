"""``python -m leanstate bench --gate``: the regression gate ``make test`` runs, and the
paired comparison behind ``make bench-compare``.

A ratio against a peer timed in the same process is too noisy on a shared 2-core machine
to catch a 3x slowdown (one unchanged figure read 0.34 and 12.7 in two runs: the peer's
time moves more than ours). So the gate compares leanstate with itself: this tree and a
baseline commit (its sources from git), each in its own worker process running the same
hot paths (``_gate_worker.py``: store get, set and insert; whole-row, version-2 and DCP
save and load; an SGD training step; a ZeRO step). Per round and figure one side runs
it, then the other at once (each the better of two back-to-back runs; the order
alternates), so a busy neighbour slows both sides of a pair alike. A figure's verdict is
the median of its paired ratios (this tree's time / the baseline's, one per round): a 3x
slowdown reads about 3, noise about 1 (recorded noise: ``tests/compat/gate_noise.json``).

- the gate fails a figure whose median ratio exceeds ``GATE_LIMIT`` (1.75);
- ``bench-compare`` calls a figure slower (faster) when its median exceeds
  ``1 + COMPARE_MARGIN`` (is below ``1 / (1 + margin)``) *and* a sign test over its
  rounds agrees (at least ``SIGN_SHARE`` of the pairs point the same way), so a few wild
  rounds never decide it.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

GATE_LIMIT = 1.75  # the geometric middle of 1 and 3: the noise tolerated either way (measured up to 1.55)
COMPARE_MARGIN = 0.75  # measured: unchanged trees beside a busy core read up to 1.6x apart
SIGN_SHARE = 0.8
WORKER = Path(__file__).with_name("_gate_worker.py")
SOURCES = ("compat", "reference", "accelerated")


@dataclass(frozen=True)
class Verdict:
    """A figure's paired ratios (this tree's time / the baseline's, one per round)."""

    name: str
    ratios: tuple[float, ...]

    @property
    def median(self) -> float:
        """The median paired ratio: above 1, this tree is slower."""
        return statistics.median(self.ratios)

    @property
    def spread(self) -> tuple[float, float]:
        """The lowest and highest paired ratio."""
        return min(self.ratios), max(self.ratios)

    @property
    def passed(self) -> bool:
        """The gate's verdict: no slowdown beyond ``GATE_LIMIT``."""
        return self.median <= GATE_LIMIT

    @property
    def change(self) -> str:
        """``slower``, ``faster`` or ``same``: beyond the margin and agreed by the sign test."""
        share_slower = sum(r > 1 for r in self.ratios) / len(self.ratios)
        if self.median > 1 + COMPARE_MARGIN and share_slower >= SIGN_SHARE:
            return "slower"
        if self.median < 1 / (1 + COMPARE_MARGIN) and 1 - share_slower >= SIGN_SHARE:
            return "faster"
        return "same"


def paired(new: list[dict], old: list[dict]) -> list[Verdict]:
    """Each figure's verdict from the two sides' round times (rounds where either side has no
    time for it are left out; a figure with no pair at all is left out)."""
    names = sorted({name for round_ in new for name in round_} & {name for round_ in old for name in round_})
    verdicts = []
    for name in names:
        ratios = tuple(
            a[name] / b[name] for a, b in zip(new, old) if a.get(name) and b.get(name) and b[name] > 0
        )
        if ratios:
            verdicts.append(Verdict(name, ratios))
    return verdicts


class _Worker:
    """One side: ``_gate_worker.py`` run over the leanstate found on ``pythonpath``."""

    def __init__(self, label: str, pythonpath: str, cwd: Path) -> None:
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": pythonpath}
        self.label = label
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER.read_text()],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.label} worker stopped: {self.process.stderr.read()[-2000:]}")
        return json.loads(line)

    def ready(self) -> dict:
        """Its set-up report: the figures it runs, and the ones its tree cannot."""
        return self._reply()

    def run(self, name: str) -> float | None:
        """The seconds of one figure (the better of two back-to-back runs), or None."""
        self.process.stdin.write(f"run {name}\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def baseline(root: Path, against: str | None = None) -> str:
    """The commit to compare with: ``against``; else ``HEAD`` when this tree's sources
    differ from it (a change not yet committed), else ``HEAD``'s parent (the last commit's
    change)."""
    if against is not None:
        return _git("rev-parse", "--verify", f"{against}^{{commit}}", cwd=root)
    changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *SOURCES], cwd=root).returncode != 0
    return _git("rev-parse", "--verify", "HEAD" if changed else "HEAD~1", cwd=root)


def checkout(root: Path, commit: str, into: Path) -> Path:
    """The sources of ``commit`` laid out as an importable ``leanstate`` package under
    ``into/<commit>`` (kept: a later run reuses it and its numba cache)."""
    folder = into / commit
    if (folder / "leanstate" / "__init__.py").exists():
        return folder
    staging = Path(tempfile.mkdtemp(dir=into))
    archive = subprocess.run(["git", "archive", commit, *SOURCES], cwd=root, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(staging, filter="data")
    (staging / "compat").rename(staging / "leanstate")
    for name in ("reference", "accelerated"):
        (staging / name).rename(staging / "leanstate" / name)
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)
    return folder


def working_tree(root: Path, into: Path) -> Path:
    """This checkout's sources, as they are now, laid out as an importable ``leanstate``
    package under ``into/worktree`` by links (whatever ``leanstate`` is installed, the
    gate times this tree's)."""
    folder = into / "worktree"
    shutil.rmtree(folder, ignore_errors=True)
    package = folder / "leanstate"
    package.mkdir(parents=True)
    for entry in (root / "compat").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name in ("reference", "accelerated"):
        (package / name).symlink_to(root / name)
    return folder


def this_tree_first(round_: int, figure: int) -> bool:
    """Whether this tree's side of figure ``figure`` runs first in round ``round_``: it
    alternates from round to round and from one figure to the next, so neither side is
    always first (a warm cache, a turbo boost) for any figure or in any round."""
    return (round_ + figure) % 2 == 0


def compare(root: Path, commit: str, rounds: int = 7, into: Path | None = None, log=print) -> list[Verdict]:
    """This tree against ``commit``, round by round, each figure's two sides back to back
    (their order alternating); each figure's verdict."""
    into = into or root / ".bench-old"
    into.mkdir(exist_ok=True)
    old_tree = checkout(root, commit, into)
    this_tree = working_tree(root, into)
    new = _Worker("this tree's", str(this_tree), this_tree)
    old = _Worker(f"baseline {commit[:10]}'s", str(old_tree), old_tree)
    try:
        figures = []
        for worker in (new, old):
            ready = worker.ready()
            figures.append(set(ready["figures"]))
            for name, problem in ready["problems"].items():
                log(f"gate: the {worker.label} tree has no {name} figures ({problem})")
        both = sorted(figures[0] & figures[1])
        new_times, old_times = [], []
        for k in range(rounds):
            new_times.append({})
            old_times.append({})
            for f, name in enumerate(both):
                # the two sides of a pair run back to back, first one then the other (ABBA)
                order = ((new, new_times), (old, old_times))
                for worker, times in order if this_tree_first(k, f) else order[::-1]:
                    times[-1][name] = worker.run(name)
        return paired(new_times, old_times)
    finally:
        new.close()
        old.close()


def report(verdicts: list[Verdict], commit: str, *, gate: bool) -> str:
    """One line per figure: the median ratio, its spread over the rounds and the verdict."""
    lines = [f"this tree vs {commit[:10]}: time ratio per round (above 1: slower), median and spread"]
    for v in verdicts:
        low, high = v.spread
        verdict = ("PASS" if v.passed else "FAIL") if gate else v.change
        lines.append(
            f"{verdict:>6}  {v.name}: median {v.median:.3g} ({low:.3g}..{high:.3g}, {len(v.ratios)} rounds)"
        )
    if gate:
        lines.append(f"(a figure fails above {GATE_LIMIT}x its baseline's time)")
    return "\n".join(lines)


def main(against: str | None, *, gate: bool, rounds: int, record: Path | None = None) -> int:
    """The gate (exit 1 on a slowdown beyond the limit) or the comparison (exit 0);
    ``record``: also write every figure's paired ratios there as JSON."""
    try:
        root = Path(_git("rev-parse", "--show-toplevel", cwd=Path.cwd()))
        commit = baseline(root, against)
    except (subprocess.CalledProcessError, FileNotFoundError):
        print("gate: no baseline commit to compare with (no git history here): nothing to judge")
        return 0
    verdicts = compare(root, commit, rounds)
    print(report(verdicts, commit, gate=gate))
    if record is not None:
        figures = {v.name: list(v.ratios) for v in verdicts}
        record.write_text(json.dumps({"baseline": commit, "figures": figures}, indent=1))
    return 0 if not gate or all(v.passed for v in verdicts) else 1
