"""How long the engine's steps take: a small model of step time against tokens, for the
verifier's progress reports and admission control. Pure: no clock, no torch (times passed in).

A step that forwards ``n`` padded tokens takes about ``a + b·n`` seconds: ``a`` the fixed
cost of a forward (launches, the decisions), ``b`` the cost per token (prefill-dominated).
Both are fitted by least squares over the recent steps and the warm-up's anchors (two shapes
of different sizes, so the fit is never degenerate), then floored at zero. The fit is only an
estimate; what uses it allows a generous factor on top (see :meth:`StepTimes.stalled`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

#: Recent steps the fit uses (besides the anchors).
WINDOW = 64


@dataclass(frozen=True)
class StallRule:
    """A running step is *stalled* once it has run ``factor`` times its estimate and at least
    ``floor_s`` seconds: the verifier then stops telling its sessions that their work
    progresses, and their edges leave after their own verdict deadline."""

    factor: float = 8.0
    floor_s: float = 30.0


class StepTimes:
    """Observed (tokens, seconds) of forward steps and the fitted ``a + b·n``."""

    def __init__(self, window: int = WINDOW) -> None:
        self._anchors: list[tuple[int, float]] = []
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None

    def anchor(self, tokens: int, seconds: float) -> None:
        """A warm-up measurement, kept for good (the fit's lower end and upper end)."""
        self._anchors.append((max(1, tokens), max(0.0, seconds)))
        self._fit = None

    def observe(self, tokens: int, seconds: float) -> None:
        self._recent.append((max(1, tokens), max(0.0, seconds)))
        self._fit = None

    @property
    def known(self) -> bool:
        return bool(self._anchors or self._recent)

    def coefficients(self) -> tuple[float, float]:
        """(a, b), both >= 0; (0, 0) with nothing observed."""
        if self._fit is None:
            self._fit = _fit([*self._anchors, *self._recent])
        return self._fit

    def estimate(self, tokens: int) -> float:
        """Seconds a step of ``tokens`` padded tokens is expected to take."""
        a, b = self.coefficients()
        return a + b * max(1, tokens)

    def slowest(self) -> float:
        """The longest recent step (0 with none)."""
        return max((t for _, t in self._recent), default=0.0)

    def stalled(self, tokens: int, elapsed: float, rule: StallRule) -> bool:
        """Has a step of ``tokens`` that has run ``elapsed`` seconds stalled (``rule``)?"""
        return elapsed > max(rule.floor_s, rule.factor * self.estimate(tokens))


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``t = a + b·n`` over ``points``, with a, b >= 0: a negative slope (noise)
    becomes the mean time; a negative intercept, the line through the origin."""
    if not points:
        return 0.0, 0.0
    k = len(points)
    mn = sum(n for n, _ in points) / k
    mt = sum(t for _, t in points) / k
    var = sum((n - mn) ** 2 for n, _ in points)
    if var == 0:
        return mt, 0.0
    b = sum((n - mn) * (t - mt) for n, t in points) / var
    if b <= 0:
        return mt, 0.0
    a = mt - b * mn
    if a < 0:
        b = sum(n * t for n, t in points) / sum(n * n for n, _ in points)
        return 0.0, b
    return a, b


class DraftCost:
    """c: the time of one forward of the verifier's draft model relative to one target forward
    (Leviathan et al.'s cost coefficient), from moving averages of observed times. 0 until
    both have been seen (a first draft is made at the length asked)."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight  # of the newest observation in each moving average
        self._draft_s: float | None = None  # per draft forward
        self._target_s: float | None = None  # per target forward

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1.0 - self.weight) * old + self.weight * new

    def observe_draft(self, forwards: int, seconds: float) -> None:
        """``forwards`` batched draft forwards took ``seconds`` together."""
        if forwards > 0:
            self._draft_s = self._mix(self._draft_s, max(0.0, seconds) / forwards)

    def observe_target(self, seconds: float) -> None:
        self._target_s = self._mix(self._target_s, max(0.0, seconds))

    @property
    def ratio(self) -> float:
        if self._draft_s is None or not self._target_s:
            return 0.0
        return self._draft_s / self._target_s
