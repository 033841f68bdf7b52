"""bench.stats (paired bootstrap), bench.grid (the users' grid) and bench.capacity (edges per
verifier) on small synthetic traces."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from bench import stats

# ------------------------------------------------------------------------------------ stats


def test_ratio_ci_holds_the_point_estimate() -> None:
    rng = np.random.default_rng(1)
    den = rng.uniform(5, 15, 30)
    num = den * rng.uniform(1.2, 2.0, 30)
    point = stats.ratio(num, den)
    low, high = stats.ratio_ci(num, den)
    assert low < point < high
    assert low > 1.2 and high < 2.0


def test_paired_ratio_of_a_constant_per_prompt_ratio_is_exact() -> None:
    # Prompts differ wildly (0.1 to 1000 tok/s) but the mode is exactly 2x on each one.
    den = np.array([0.1, 1000.0, 3.0, 250.0, 7.5, 0.9, 60.0, 12.0, 400.0, 2.2])
    num = 2.0 * den
    low, high = stats.ratio_ci(num, den)
    assert abs(low - 2.0) < 1e-9 and abs(high - 2.0) < 1e-9
    # Resampling each side on its own ignores the pairing: the same data looks very uncertain.
    ulow, uhigh = stats.ratio_ci(num, den, paired=False)
    assert ulow < 1.0 and uhigh > 4.0


def test_intervals_are_deterministic_for_a_seed() -> None:
    rng = np.random.default_rng(2)
    a, b = rng.uniform(1, 10, 12), rng.uniform(1, 10, 12)
    assert stats.ratio_ci(a, b, seed=3) == stats.ratio_ci(a, b, seed=3)
    assert stats.ratio_ci(a, b, seed=3) != stats.ratio_ci(a, b, seed=4)
    assert stats.mean_ci(a, seed=5) == stats.mean_ci(a, seed=5)


def test_mean_ci_and_percentile() -> None:
    x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    low, high = stats.mean_ci(x)
    assert 1.0 <= low < 4.5 < high <= 8.0
    assert stats.mean_ci([3.0, 3.0, 3.0]) == [3.0, 3.0]
    assert stats.percentile(x, 50) == 4.5
    assert stats.percentile(x, 0) == 1.0 and stats.percentile(x, 100) == 8.0
    assert stats.percentile([0.0, 10.0], 10) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "call",
    [
        lambda: stats.ratio_ci([1.0, 2.0], [1.0]),
        lambda: stats.ratio_ci([], []),
        lambda: stats.ratio([1.0], [1.0, 2.0]),
        lambda: stats.ratio_ci([1.0], [0.0]),
        lambda: stats.ratio_ci([1.0, float("nan")], [1.0, 1.0]),
        lambda: stats.ratio_ci([1.0], [1.0], level=1.0),
        lambda: stats.ratio_ci([1.0], [1.0], n=0),
        lambda: stats.mean_ci([]),
        lambda: stats.percentile([], 50),
        lambda: stats.percentile([1.0], 101),
    ],
)
def test_bad_input_is_refused(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        call()


def test_ttft_uses_the_one_copy_of_the_median_helpers() -> None:
    from bench import ttft

    assert ttft.bootstrap_median is stats.bootstrap_median
    assert ttft.bootstrap_ratio is stats.bootstrap_ratio
    assert ttft.bootstrap_diff is stats.bootstrap_diff
    rng = np.random.default_rng(0)
    med, low, high = stats.bootstrap_median([1.0, 2.0, 3.0, 4.0, 100.0], rng)
    assert med == 3.0 and low <= med <= high
    r, rl, rh = stats.bootstrap_ratio([4.0, 4.0, 4.0], [2.0, 2.0, 2.0], rng)
    assert (r, rl, rh) == (2.0, 2.0, 2.0)
    d, dl, dh = stats.bootstrap_diff([5.0, 6.0, 7.0], [1.0, 2.0, 3.0], rng)
    assert d == 4.0 and dl <= d <= dh
