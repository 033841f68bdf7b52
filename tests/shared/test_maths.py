"""Pure sampling maths: the transform, compression, reconstructions and their bounds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shared.maths import compression as C
from shared.maths.rejection import Decision, draw_candidates, recover, verify_batch
from shared.maths.sampling import (
    SamplingParams,
    acceptance_rate,
    residual,
    sample,
    total_variation,
    transform,
)

pytestmark = pytest.mark.fast

TOL = 1e-9


def _dist(seed: int, v: int, conc: float = 0.3) -> np.ndarray:
    return np.random.default_rng(seed).dirichlet(np.full(v, conc))


distributions = st.builds(
    _dist, st.integers(0, 2**31), st.integers(2, 300), st.sampled_from([0.05, 0.3, 1.0, 5.0])
)


# --------------------------------------------------------------------------------- transform


def test_transform_matches_transformers_warpers() -> None:
    """Our transform equals transformers' own warpers (the same order: T, top-k, top-p)."""
    import torch
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(5, 200))
    for t, k, p in [(0.7, 0, 1.0), (1.0, 20, 1.0), (1.3, 0, 0.9), (0.8, 50, 0.95)]:
        procs = LogitsProcessorList([TemperatureLogitsWarper(t)])
        if k:
            procs.append(TopKLogitsWarper(k))
        if p < 1.0:
            procs.append(TopPLogitsWarper(p))
        ref = torch.softmax(procs(None, torch.tensor(logits)), dim=-1).numpy()
        ours = transform(logits, SamplingParams(t, k, p))
        np.testing.assert_allclose(ours, ref, atol=1e-9)


def test_transform_greedy_is_one_hot_first_argmax() -> None:
    p = transform(np.array([[1.0, 3.0, 3.0, 0.0]]), SamplingParams(temperature=0.0))
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_k": -1}]
)
def test_sampling_params_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(
    arrays(np.float64, st.integers(1, 100), elements=st.floats(-50, 50)),
    st.floats(0.05, 3.0),
    st.integers(0, 120),
    st.floats(0.01, 1.0),
)
def test_transform_is_a_distribution(logits: np.ndarray, t: float, k: int, p: float) -> None:
    out = transform(logits, SamplingParams(t, k, p))
    assert np.all(out >= 0)
    assert abs(out.sum() - 1) < 1e-9
    # the mode (one of the tied maxima, as in transformers) always survives the filters
    soft = transform(logits, SamplingParams(t))
    assert out[soft >= soft.max() * (1 - 1e-12)].sum() > 0
    if 0 < k < len(logits):
        # ties at the threshold may keep more than k, never fewer than min(k, support)
        assert np.count_nonzero(out) >= 1


def test_sample_respects_support() -> None:
    rng = np.random.default_rng(1)
    p = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    draws = {sample(p, rng) for _ in range(500)}
    assert draws == {1, 3}
    with pytest.raises(ValueError):
        sample(np.zeros(3), rng)


# ---------------------------------------------------------------------- compression bounds


@settings(max_examples=300, deadline=None)
@given(distributions, st.integers(1, 400))
def test_reconstructions_are_distributions_with_l1_bounds(p: np.ndarray, k: int) -> None:
    d = C.top_k(p, k)
    eps = d.eps
    a = C.reconstruct(d, len(p), C.RENORMALISED)
    b = C.reconstruct(d, len(p), C.REDISTRIBUTED)
    for r in (a, b):
        assert np.all(r >= 0) and abs(r.sum() - 1) < 1e-6
    # ‖A − p‖₁ = 2ε exactly; ‖B − p‖₁ <= 2ε. (float32 values on the wire: 1e-6 slack.)
    assert abs(C.l1(a, p) - 2 * eps) < 1e-5
    assert C.l1(b, p) <= C.reconstruction_bound(eps) + 1e-5
    # B never loses to A
    assert C.l1(b, p) <= C.l1(a, p) + 1e-5


@settings(max_examples=200, deadline=None)
@given(distributions, st.floats(0.0, 0.5), st.integers(1, 64))
def test_adaptive_k_is_smallest_meeting_target(p: np.ndarray, eps_target: float, cap: int) -> None:
    k = C.adaptive_k(p, eps_target, cap)
    kept = np.sort(p)[::-1].cumsum()
    assert 1 <= k <= min(cap, len(p))
    if k < min(cap, len(p)):
        assert kept[k - 1] >= 1 - eps_target - 1e-9
    if k > 1:
        assert kept[k - 2] < 1 - eps_target - 1e-12


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**31),
    st.integers(2, 4),
    st.integers(8, 200),
    st.integers(1, 50),
    st.sampled_from(C.RECONSTRUCTIONS),
)
def test_aggregation_bias_and_acceptance_change_bounds(
    seed: int, m: int, v: int, k: int, how: str
) -> None:
    rng = np.random.default_rng(seed)
    ps = rng.dirichlet(np.full(v, 0.2), size=m)
    q = rng.dirichlet(np.full(v, 0.2))
    w = rng.uniform(0.1, 1, size=m)
    sparse = [C.top_k(p, k) for p in ps]
    eps = np.array([d.eps for d in sparse])
    p_bar = C.aggregate(ps, w)
    p_hat_bar = C.aggregate([C.reconstruct(d, v, how) for d in sparse], w)
    bias = C.l1(p_hat_bar, p_bar)
    assert bias <= C.aggregation_bias_bound(w, eps) + 1e-5
    d_alpha = abs(acceptance_rate(p_hat_bar, q) - acceptance_rate(p_bar, q))
    assert d_alpha <= C.acceptance_change_bound(w, eps) + 1e-5


def test_acceptance_change_bound_is_half_the_bias_example() -> None:
    """The counter-example to the published eq. 19: p = (0.9, 0.1), K = 1."""
    p = np.array([0.9, 0.1])
    d = C.top_k(p, 1)
    assert d.eps == pytest.approx(0.1)
    p_hat = C.reconstruct(d, 2, C.RENORMALISED)
    assert C.l1(p_hat, p) == pytest.approx(0.2)
    q = np.array([0.0, 1.0])
    assert abs(acceptance_rate(p_hat, q) - acceptance_rate(p, q)) == pytest.approx(0.1)
    assert C.acceptance_change_bound([1.0], [d.eps]) == pytest.approx(0.1)


def test_weights_validated() -> None:
    for bad in ([], [0.5, 0.0], [1.0, -1.0], [float("nan")]):
        with pytest.raises(ValueError):
            C.normalise_weights(bad)


def test_residual_and_tv() -> None:
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.6, 0.2])
    np.testing.assert_allclose(residual(p, q), [1.0, 0.0, 0.0])
    assert total_variation(p, q) == pytest.approx(0.3)
    assert acceptance_rate(p, q) == pytest.approx(0.7)
    np.testing.assert_allclose(residual(p, p), p)


# ----------------------------------------------------------------------- verify / recover


def test_verify_batch_greedy_matches_argmax() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 16))
    p = transform(logits, SamplingParams(temperature=0.0))
    target = np.argmax(logits, axis=-1)
    draft = target[:3].copy()
    d = verify_batch(p, draft, np.ones(3), greedy=True, correction="topk", rng=rng, want_bonus=True)
    assert d == Decision(3, bonus=int(target[3]))
    draft[1] = (draft[1] + 1) % 16
    d = verify_batch(p, draft, np.ones(3), greedy=True, correction="topk", rng=rng)
    assert d.accepted == 1 and d.token == int(target[1])


def test_candidates_exclude_the_rejected_id() -> None:
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.25, 0.25, 0.0])
    c = draw_candidates(p, 0, 200, rng)
    assert set(c.ids.tolist()) == {1, 2}
    np.testing.assert_allclose(c.probs, 0.25)


def test_recover_needs_a_correction() -> None:
    with pytest.raises(ValueError):
        recover(Decision(2), np.ones(4) / 4, np.random.default_rng(0))
