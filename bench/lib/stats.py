"""Bootstrap intervals for the benchmark's figures (pure numpy, deterministic for a seed).

Ratios between two modes are *paired by prompt*: both modes ran the same prompts, so each
bootstrap resample draws one set of prompt indices and takes it from both. Prompt difficulty
then cancels in the ratio; only how the modes differ from prompt to prompt widens the interval.

    ratio_ci(num, den)  -> [low, high] of mean(num) / mean(den)
    mean_ci(x)          -> [low, high] of mean(x)
    percentile(x, q)    -> the q-th percentile of x
    paired_ratio_ci(num, den, stat) -> stat(num) / stat(den) and its [low, high]

``bootstrap_median``, ``bootstrap_ratio`` and ``bootstrap_diff`` are the medians-based helpers
``bench.studies.ttft`` uses (unpaired: its samples are repeated requests, not prompts).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

#: Bootstrap resamples per interval.
RESAMPLES = 2000
#: The interval's coverage.
LEVEL = 0.95

Array = npt.NDArray[np.float64]


def _values(x: Sequence[float], what: str) -> Array:
    """``x`` as a float array; ValueError when empty or not finite."""
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{what}: need a non-empty sequence of numbers, got {a.size} values")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{what}: every value must be finite")
    return a


def _check(n: int, level: float) -> None:
    if n < 1:
        raise ValueError(f"resamples must be >= 1, got {n}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")


def _interval(boots: Array, level: float) -> list[float]:
    """The percentile interval of the bootstrap statistics (NaN resamples left out)."""
    tail = (1.0 - level) / 2.0
    finite = boots[np.isfinite(boots)]
    if finite.size == 0:
        return [math.nan, math.nan]
    return [float(np.quantile(finite, tail)), float(np.quantile(finite, 1.0 - tail))]


def ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """mean(num) / mean(den) over paired values; ValueError on mismatched or empty input or a
    denominator whose mean is not positive."""
    a, b = _values(num, "numerator"), _values(den, "denominator")
    if a.size != b.size:
        raise ValueError(f"paired ratio: {a.size} numerator values against {b.size} denominator")
    if b.mean() <= 0:
        raise ValueError("paired ratio: the denominator's mean must be positive")
    return float(a.mean() / b.mean())


def ratio_ci(
    num: Sequence[float],
    den: Sequence[float],
    *,
    n: int = RESAMPLES,
    seed: int = 0,
    level: float = LEVEL,
    paired: bool = True,
) -> list[float]:
    """``[low, high]``: the percentile-bootstrap interval of mean(num) / mean(den).

    ``num[i]`` and ``den[i]`` belong to the same prompt; each resample draws prompt indices
    with replacement and, when ``paired`` (the default), the same indices for both.
    ``paired=False`` resamples each side on its own (for comparison only: it ignores that the
    prompts are shared and so overstates the uncertainty)."""
    _check(n, level)
    ratio(num, den)  # validates lengths, emptiness and the denominator
    a, b = _values(num, "numerator"), _values(den, "denominator")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, (n, a.size))
    other = idx if paired else rng.integers(0, b.size, (n, b.size))
    top, bottom = a[idx].mean(axis=1), b[other].mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        boots = np.where(bottom > 0, top / np.where(bottom > 0, bottom, 1.0), np.nan)
    return _interval(boots, level)


def paired_ratio_ci(
    num: npt.ArrayLike,
    den: npt.ArrayLike,
    stat: Callable[[Array], float],
    *,
    n: int = RESAMPLES,
    seed: int = 0,
    level: float = LEVEL,
) -> tuple[float, list[float]]:
    """``stat(num) / stat(den)`` and its percentile-bootstrap interval ``[low, high]``.

    Row ``i`` of ``num`` and row ``i`` of ``den`` are one pair (a user's reply, simulated and
    measured); a row is a number or a vector of fields (a statistic such as goodput needs
    several). Each resample draws row indices with replacement, takes the same rows from both
    sides and recomputes ``stat`` on each. With ``stat`` the mean this is :func:`ratio_ci`
    (the same resamples for the same seed). ValueError on mismatched, empty or non-finite input
    or a ``stat(den)`` that is not positive."""
    _check(n, level)
    a, b = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    if a.ndim == 0 or a.shape[0] == 0 or a.shape[0] != b.shape[0]:
        raise ValueError(f"paired ratio: need as many rows on both sides, got {a.shape}, {b.shape}")
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("paired ratio: every value must be finite")
    bottom = stat(b)
    if not bottom > 0:
        raise ValueError(f"paired ratio: stat(den) must be positive, got {bottom}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.shape[0], (n, a.shape[0]))
    boots = np.empty(n)
    for k, rows in enumerate(idx):
        d = stat(b[rows])
        boots[k] = stat(a[rows]) / d if d > 0 else math.nan
    return float(stat(a) / bottom), _interval(boots, level)


def mean_ci(
    x: Sequence[float], *, n: int = RESAMPLES, seed: int = 0, level: float = LEVEL
) -> list[float]:
    """``[low, high]``: the percentile-bootstrap interval of mean(x), resampling its values."""
    _check(n, level)
    a = _values(x, "mean")
    rng = np.random.default_rng(seed)
    boots = a[rng.integers(0, a.size, (n, a.size))].mean(axis=1)
    return _interval(boots, level)


def percentile(x: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100, linear interpolation) of ``x``; ValueError when empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    return float(np.percentile(_values(x, "percentile"), q))


# ---------------------------------------------------------- medians (bench.studies.ttft's helpers)


def bootstrap_median(x: Sequence[float], rng: np.random.Generator, n: int = 2000) -> list[float]:
    """The median and its 95 % percentile-bootstrap interval."""
    a = np.asarray(x, float)
    boots = np.median(rng.choice(a, (n, len(a))), axis=1)
    return [float(np.median(a)), float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))]


def _bootstrap_pair(
    num: Sequence[float],
    den: Sequence[float],
    rng: np.random.Generator,
    op: Callable[[Any, Any], Any],
    n: int = 2000,
) -> list[float]:
    """op(median(num), median(den)) and its 95 % interval (both resampled independently)."""
    a, b = np.asarray(num, float), np.asarray(den, float)
    ra = np.median(rng.choice(a, (n, len(a))), axis=1)
    rb = np.median(rng.choice(b, (n, len(b))), axis=1)
    r = op(ra, rb)
    return [
        float(op(np.median(a), np.median(b))),
        float(np.quantile(r, 0.025)),
        float(np.quantile(r, 0.975)),
    ]


def bootstrap_ratio(
    num: Sequence[float], den: Sequence[float], rng: np.random.Generator
) -> list[float]:
    """median(num) / median(den) and its 95 % interval."""
    return _bootstrap_pair(num, den, rng, operator.truediv)


def bootstrap_diff(
    num: Sequence[float], den: Sequence[float], rng: np.random.Generator
) -> list[float]:
    """median(num) − median(den) and its 95 % interval."""
    return _bootstrap_pair(num, den, rng, operator.sub)
