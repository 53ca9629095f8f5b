"""The regression gate's arithmetic, on a clock the test drives: a 3x slowdown of
leanstate's side always fails it, the margin's worth of noise never does (no wall time)."""

from leanstate._tools import gate


class Clock:
    """A timer that moves only when an operation says it took time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def work(self, seconds: float):
        def run() -> None:
            self.now += seconds

        return run


def figure(clock: Clock, ours: float, peer: float, typical: float) -> gate.Figure:
    return gate.Figure("store get vs index_select", clock.work(ours), clock.work(peer), typical)


def test_a_figure_at_its_typical_ratio_passes():
    clock = Clock()
    (verdict,) = gate.judge([figure(clock, 1.25, 1.0, 0.8)], timer=clock)  # ratio 0.8
    assert verdict.passed and abs(verdict.ratio - 0.8) < 1e-12 and verdict.floor == 0.8 / gate.MARGIN


def test_a_planted_3x_slowdown_fails_and_noise_within_the_margin_does_not():
    for typical in (0.3, 0.8, 1.0, 4.0):
        clock = Clock()
        normal, slowed, noisy = (
            figure(clock, factor / typical, 1.0, typical) for factor in (1.0, 3.0, gate.MARGIN * 0.99)
        )
        verdicts = gate.judge([normal, slowed, noisy], timer=clock)
        assert [v.passed for v in verdicts] == [True, False, True], (typical, verdicts)


def test_the_best_round_counts():
    clock = Clock()
    steps = iter([5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # one slow round of leanstate's side

    def ours() -> None:
        clock.now += next(steps)

    ratio = gate.best_ratio(ours, clock.work(1.0), rounds=4, timer=clock)
    assert ratio == 1.0


def test_the_report_names_each_figure_and_its_verdict():
    text = gate.report([gate.Verdict("a", 0.5, 0.32), gate.Verdict("b", 0.1, 0.2)])
    assert text.splitlines() == ["PASS  a: ratio 0.5, floor 0.32", "FAIL  b: ratio 0.1, floor 0.2"]
