"""The statistics of the exactness tests: chi-square tests of emitted tokens against the target's
distribution, the size and level they run at, and the synthetic target/draft pairs they use.

Each test compares tokens emitted by a speculative path with p, the target's distribution, by
Pearson's chi-square; a deliberately broken variant must fail the same test (proof that it has
power). Seeds are fixed: every run is identical, and a failure is a reproducible one.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from shared.maths.sampling import SamplingParams, transform

#: Samples per case.
N = 20_000
#: Per-case size of the test. ~50 cases run, so Bonferroni at a family-wise 0.5% gives 1e-4; the
#: negative control must fall below 1e-6, so the test keeps its power.
ALPHA = 1e-4

#: The sampling settings every exact mode is checked under.
SETTINGS = [
    SamplingParams(0.7),
    SamplingParams(1.0),
    SamplingParams(1.3),
    SamplingParams(1.0, top_k=6),
    SamplingParams(0.7, top_p=0.8),
    SamplingParams(1.3, top_k=10, top_p=0.9),
]


def chi_square_pvalue(samples: np.ndarray, p: np.ndarray) -> float:
    """Pearson chi-square of sample counts against p; bins expected < 5 are pooled."""
    n = len(samples)
    observed = np.bincount(samples, minlength=len(p)).astype(np.float64)
    assert observed[p == 0].sum() == 0, "emitted a token the target can never produce"
    expected = p * n
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp *= obs.sum() / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)


def sequential_chi_square(tokens: np.ndarray, rows: np.ndarray) -> float:
    """Tokens x_t each drawn from its own p_t (``rows``: [n, V]): p-value of Pearson's statistic
    with E_j = Σ_t p_t(j) (ids with E_j < 5 pooled). The count O_j has variance
    Σ_t p_t(j)(1 − p_t(j)) <= E_j, so the statistic is (slightly conservatively) chi-square with
    |V| − 1 degrees of freedom."""
    observed = np.bincount(tokens, minlength=rows.shape[1]).astype(np.float64)
    expected = rows.sum(axis=0)
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(stats.chi2.sf(stat, len(obs) - 1))


def logit_pair(seed: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    """Target logits and a correlated, imperfect draft's: ([V], [V])."""
    rng = np.random.default_rng(seed)
    target = rng.normal(0, 1.5, v)
    draft = target + rng.normal(0, 1.0, v)
    return target, draft


def bigram(v: int, seed: int, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """A bigram 'model' pair: P[t] and Q[t] are the target's and the draft's next-token
    distributions after token t, transformed by ``params``: ([V, V], [V, V])."""
    rng = np.random.default_rng(seed)
    tl = rng.normal(0, 1.5, (v, v))
    dl = tl + rng.normal(0, 0.8, (v, v))
    return transform(tl, params), transform(dl, params)
