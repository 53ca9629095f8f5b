"""``python -m leanstate bench --gate``: the cheap regression gate ``make test`` runs.

A handful of figures, each leanstate's time beside a peer's in the same process, read as
the throughput ratio (peer time / leanstate time, higher is better). Each round times
leanstate then the peer once; the best of the rounds counts, which a busy machine
disturbs least. A figure fails when its ratio falls below its floor: the ratio measured
on a quiet 2-core machine divided by ``MARGIN``. ``MARGIN`` (2.5) is wide enough that
load and machine differences do not trip it and narrow enough that a 3x slowdown of
leanstate's side always does (``tests/compat/test_gate.py`` plants one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

MARGIN = 2.5


@dataclass(frozen=True)
class Figure:
    """One gated figure: leanstate's operation, the peer's, and the ratio a quiet 2-core
    machine measures (its floor is ``typical / MARGIN``)."""

    name: str
    ours: Callable[[], object]
    peer: Callable[[], object]
    typical: float

    @property
    def floor(self) -> float:
        """The lowest ratio that passes."""
        return self.typical / MARGIN


@dataclass(frozen=True)
class Verdict:
    """A figure's measured ratio against its floor."""

    name: str
    ratio: float
    floor: float

    @property
    def passed(self) -> bool:
        """Whether the ratio is at or above the floor."""
        return self.ratio >= self.floor


def best_ratio(
    ours: Callable[[], object], peer: Callable[[], object], rounds: int, timer=time.perf_counter
) -> float:
    """Best peer time / best leanstate time over ``rounds`` interleaved rounds."""
    best_ours = best_peer = float("inf")
    for _ in range(rounds):
        start = timer()
        ours()
        best_ours = min(best_ours, timer() - start)
        start = timer()
        peer()
        best_peer = min(best_peer, timer() - start)
    return best_peer / best_ours


def judge(figures: list[Figure], rounds: int = 7, timer=time.perf_counter) -> list[Verdict]:
    """Each figure's verdict (every operation runs once untimed first: compiles, caches)."""
    verdicts = []
    for figure in figures:
        figure.ours()
        figure.peer()
        ratio = best_ratio(figure.ours, figure.peer, rounds, timer)
        verdicts.append(Verdict(figure.name, ratio, figure.floor))
    return verdicts


def run(rounds: int = 7) -> list[Verdict]:
    """Measure the gated figures, small enough to take seconds: the store's get and set
    beside a dense table, the whole-row load beside a plain read of the same bytes, and
    an embedding step beside ``nn.EmbeddingBag(sparse=True)`` + SGD, on the import-time
    backend."""
    from leanstate._tools.workloads import CheckpointIO, EmbeddingStep, KVGetSet

    store = KVGetSet(100_000, 64, 8192, None)
    io = CheckpointIO(100_000, 64, None)
    ours_step = EmbeddingStep("kv", "sgd", 100_000, 64, batch=1024)
    dense_step = EmbeddingStep("dense", "sgd", 100_000, 64, batch=1024)
    try:  # typical: the median of three runs on a quiet 2-core machine, numba backend
        return judge(
            [
                Figure("store get vs index_select", store.get, store.dense_get, 0.30),
                Figure("store set vs index_copy_", store.set, store.dense_set, 0.80),
                Figure("whole-row load vs plain read", io.load, io.read_plain, 0.15),
                Figure("sgd step vs EmbeddingBag(sparse)+SGD", ours_step.step, dense_step.step, 0.37),
            ],
            rounds,
        )
    finally:
        io.close()


def report(verdicts: list[Verdict]) -> str:
    """One line per figure: its ratio, its floor and PASS or FAIL."""
    return "\n".join(
        f"{'PASS' if v.passed else 'FAIL'}  {v.name}: ratio {v.ratio:.3g}, floor {v.floor:.3g}"
        for v in verdicts
    )
