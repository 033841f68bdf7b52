"""SpecFed decision at the edge: exactness without compression, measured bounds with it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_agent.session.aggregation import decide
from shared.maths import compression as C
from shared.maths.sampling import SamplingParams, sample, transform
from shared.wire.messages import FederatedReply
from tests.stats import ALPHA, chi_square_pvalue

pytestmark = pytest.mark.fast


def reply_for(ps: np.ndarray, draft: list[int], k: int) -> FederatedReply:
    """What a worker with exact rows ps ([γ+1, V]) sends for ``draft`` at top-k."""
    dists = tuple(C.compress(p, k) for p in ps)
    l1 = np.array(
        [
            [C.l1(C.reconstruct(d, ps.shape[1], how), p) for how in C.RECONSTRUCTIONS]
            for d, p in zip(dists, ps, strict=True)
        ],
        np.float32,
    )
    p_draft = np.array([ps[j, x] for j, x in enumerate(draft)], np.float32)
    return FederatedReply(0, 0, dists, p_draft, l1)


def _workers(seed: int, m: int, v: int, t: float) -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.normal(0, 1.5, v)
    workers = [transform(base + rng.normal(0, 0.7, v), SamplingParams(t)) for _ in range(m)]
    q = transform(base + rng.normal(0, 1.0, v), SamplingParams(t))
    return workers, q


@pytest.mark.parametrize("how", C.RECONSTRUCTIONS)
@pytest.mark.parametrize("m", [2, 3])
def test_uncompressed_federated_step_is_exact_for_the_aggregate(m: int, how: str) -> None:
    v = 12
    ps, q = _workers(m, m, v, 1.0)
    w = np.arange(1, m + 1, dtype=np.float64)
    p_bar = C.aggregate(ps, w)
    rng = np.random.default_rng(7)
    by_x = {x: [reply_for(np.stack([p, p]), [x], v) for p in ps] for x in range(v)}
    out = []
    for _ in range(20_000):
        x = sample(q, rng)
        replies = by_x[x]
        d = decide(
            replies, w, [x], [q], vocab_size=v, greedy=False, rng=rng, how=how, want_bonus=False
        )
        out.append(x if d.accepted == 1 else d.token)
    pv = chi_square_pvalue(np.array(out), p_bar)
    assert pv > ALPHA, f"p-value {pv:.2e}"


def test_compressed_federated_step_is_biased_negative_control() -> None:
    """With K = 1 the emitted law is measurably not p̄: the chi-square test notices."""
    v = 12
    ps, q = _workers(2, 2, v, 1.0)
    w = np.array([0.5, 0.5])
    p_bar = C.aggregate(ps, w)
    rng = np.random.default_rng(8)
    by_x = {x: [reply_for(np.stack([p, p]), [x], 1) for p in ps] for x in range(v)}
    out = []
    for _ in range(20_000):
        x = sample(q, rng)
        replies = by_x[x]
        d = decide(replies, w, [x], [q], vocab_size=v, greedy=False, rng=rng, want_bonus=False)
        out.append(x if d.accepted == 1 else d.token)
    assert chi_square_pvalue(np.array(out), p_bar) < 1e-6


def test_greedy_accepts_the_aggregate_argmax() -> None:
    v = 10
    p1 = np.full(v, 0.01)
    p1[3] = 0.91
    p2 = np.full(v, 0.01)
    p2[5] = 0.91
    w = np.array([0.4, 0.6])  # aggregate argmax is 5
    draft = [3]
    q = [np.eye(v)[3]]
    replies = [reply_for(np.stack([p, p]), draft, v) for p in (p1, p2)]
    d = decide(replies, w, draft, q, vocab_size=v, greedy=True, rng=np.random.default_rng(0))
    assert (d.accepted, d.token, d.rejected) == (0, 5, True)
    d = decide(
        replies, w, [5], [np.eye(v)[5]], vocab_size=v, greedy=True, rng=np.random.default_rng(0)
    )
    assert (d.accepted, d.token, d.rejected) == (1, 5, False)  # bonus = argmax again


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    m=st.integers(2, 3),
    k=st.integers(1, 40),
    how=st.sampled_from(C.RECONSTRUCTIONS),
    t=st.sampled_from([0.8, 1.0, 1.2]),
)
def test_measured_bias_never_exceeds_bound(seed: int, m: int, k: int, how: str, t: float) -> None:
    v = 50
    ps, q = _workers(seed, m, v, t)
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.1, 1.0, m)
    rows = [np.stack([p, p, p]) for p in ps]
    draft = [sample(q, rng), sample(q, rng)]
    d = decide(
        [reply_for(r, draft, k) for r in rows],
        w,
        draft,
        [q, q],
        vocab_size=v,
        greedy=False,
        rng=rng,
        how=how,
    )
    for meas in d.measures:
        assert not meas.violations
        assert meas.bias_upper is not None and meas.bias_upper <= meas.bias_bound + 1e-4
    # and the true bias (which the edge cannot see) is below the measured upper bound
    p_bar = C.aggregate(ps, w)
    p_hat_bar = C.aggregate([C.reconstruct(C.compress(p, k), v, how) for p in ps], w)
    assert C.l1(p_hat_bar, p_bar) <= d.measures[0].bias_upper + 1e-4  # type: ignore[operator]


def test_violation_is_reported() -> None:
    v = 8
    p = np.full(v, 1 / v)
    r = reply_for(np.stack([p, p]), [1], 2)
    bad = FederatedReply(0, 0, r.dists, r.p_draft, np.full((2, 2), 1.9, np.float32))
    d = decide([bad], [1.0], [1], [p], vocab_size=v, greedy=False, rng=np.random.default_rng(0))
    assert d.measures[0].violations
