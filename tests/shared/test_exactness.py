"""Statistical exactness: emitted tokens are distributed as the target's, for every exact mode.

Each test runs the whole speculative step (draw from q, accept/reject at the verifier, recover at
the edge) many times with a fixed seed on a small vocabulary and compares the emitted tokens with p
by a chi-square test. A deliberately broken variant (q not transformed like p) must be rejected
by the same test: proof that it has power. The lossy top-K mode is held to its TV bound instead.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from cloud_verifier.engine.rationing import Round, ration
from shared.maths import compression as C
from shared.maths.acceptance import Acceptance
from shared.maths.rejection import (
    CorrectionMode,
    Decision,
    draw_candidates,
    one_hot,
    recover,
    verify_batch,
)
from shared.maths.sampling import SamplingParams, sample, total_variation, transform
from tests.stats import ALPHA, SETTINGS, N, bigram, chi_square_pvalue, logit_pair

EXACT_MODES = [CorrectionMode.CANDIDATES, CorrectionMode.GREEDY_DRAFT, "topk_full"]


def speculative_step(
    p: np.ndarray,
    q: np.ndarray,
    mode: str,
    rng: np.random.Generator,
    *,
    k: int,
    q_sampled: np.ndarray | None = None,
) -> int:
    """One position: draft x, verifier decides, edge recovers. Returns the emitted token.

    ``q_sampled`` (negative control only) is the distribution x is really drawn from, while q is
    what the edge reports and uses.
    """
    v = len(p)
    if mode == CorrectionMode.GREEDY_DRAFT:
        x = int(np.argmax(q))
        q = one_hot(x, v)
    else:
        x = sample(q if q_sampled is None else q_sampled, rng)
    correction = CorrectionMode.TOPK if mode == "topk_full" else mode
    rows = np.stack([p, p])  # row 1 is the (unused) bonus position
    d = verify_batch(rows, [x], [q[x]], greedy=False, correction=correction, rng=rng, k=k)
    if d.accepted == 1:
        return x
    tok = recover(d, q, rng)
    while tok is None:  # all candidates failed: the edge sends Resample for more
        more = draw_candidates(p, x, 8, rng)
        tok = recover(Decision(0, candidates=more), q, rng)
    return tok


def run_steps(step: Callable[[np.random.Generator], int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([step(rng) for _ in range(N)])


@pytest.mark.parametrize("v", [8, 64])
@pytest.mark.parametrize("mode", EXACT_MODES)
@pytest.mark.parametrize("params", SETTINGS, ids=str)
def test_exact_modes_match_target(v: int, mode: str, params: SamplingParams) -> None:
    tl, dl = logit_pair(v * 7 + 1, v)
    p, q = transform(tl, params), transform(dl, params)
    out = run_steps(lambda rng: speculative_step(p, q, mode, rng, k=v), seed=v)
    pv = chi_square_pvalue(out, p)
    assert pv > ALPHA, f"{mode} at {params}: chi-square p-value {pv:.2e}"


def test_negative_control_q_not_transformed_like_p() -> None:
    """The known bug class: the draft samples from untransformed q but reports transformed q."""
    v = 16
    params = SamplingParams(0.5)
    tl, dl = logit_pair(3, v)
    p, q = transform(tl, params), transform(dl, params)
    q_raw = transform(dl, SamplingParams(1.0))  # what x is really drawn from
    out = run_steps(
        lambda rng: speculative_step(p, q, CorrectionMode.CANDIDATES, rng, k=v, q_sampled=q_raw),
        seed=5,
    )
    pv = chi_square_pvalue(out, p)
    assert pv < 1e-6, f"the broken variant passed (p-value {pv:.2e}): the test has no power"


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("params", SETTINGS[:3], ids=str)
def test_lossy_topk_within_tv_bound(k: int, params: SamplingParams) -> None:
    v = 32
    tl, dl = logit_pair(11, v)
    p, q = transform(tl, params), transform(dl, params)
    eps = C.top_k(p, k).eps
    bound = C.lossy_correction_tv_bound(eps)
    # the exact emitted distribution of a top-K step, and the sampled one
    p_hat = C.reconstruct(C.top_k(p, k), v)
    beta = 1.0 - np.minimum(p, q).sum()
    from shared.maths.sampling import residual

    analytic = np.minimum(p, q) + beta * residual(p_hat, q)
    assert total_variation(analytic, p) <= bound + 1e-9
    out = run_steps(lambda rng: speculative_step(p, q, CorrectionMode.TOPK, rng, k=k), seed=k)
    empirical = np.bincount(out, minlength=v) / N
    # sampling noise of an empirical distribution: E[TV] <= ½ Σ sqrt(p(1−p)/N)
    noise = 0.5 * np.sqrt(analytic * (1 - analytic) / N).sum()
    assert total_variation(empirical, p) <= bound + 4 * noise
    # and the sampler really draws from the analytic distribution
    assert chi_square_pvalue(out, analytic) > ALPHA


# ------------------------------------------------------------------ multi-position rounds


def _last_token(
    d: Decision, rows: np.ndarray, xs: list[int], qrows: list[np.ndarray], rng: np.random.Generator
) -> int:
    """A round's token after its accepted prefix: the edge's recovered one on a rejection
    (asking for more candidates while all fail), else the verifier's bonus."""
    if not d.rejected:
        assert d.bonus is not None
        return d.bonus
    tok = recover(d, qrows[d.accepted], rng)
    while tok is None:
        more = draw_candidates(rows[d.accepted], xs[d.accepted], 8, rng)
        tok = recover(Decision(0, candidates=more), qrows[d.accepted], rng)
    return tok


def _generate(
    P: np.ndarray, Q: np.ndarray, gamma: int, mode: str, rng: np.random.Generator, n: int
) -> list[int]:
    """Speculative rounds over a bigram 'model' until n tokens are emitted (start token 0)."""
    v = P.shape[0]
    out: list[int] = []
    prev = 0
    while len(out) < n:
        xs, qx, qrows = [], [], []
        t = prev
        for _ in range(gamma):
            qrow = Q[t]
            if mode == CorrectionMode.GREEDY_DRAFT:
                x = int(np.argmax(qrow))
                qrow = one_hot(x, v)
            else:
                x = sample(qrow, rng)
            xs.append(x)
            qx.append(qrow[x])
            qrows.append(qrow)
            t = x
        rows = np.stack([P[prev]] + [P[x] for x in xs])
        d = verify_batch(rows, xs, qx, greedy=False, correction=mode, rng=rng, want_bonus=True)
        out += [*xs[: d.accepted], _last_token(d, rows, xs, qrows, rng)]
        prev = out[-1]
    return out


@pytest.mark.parametrize("mode", [CorrectionMode.CANDIDATES, CorrectionMode.GREEDY_DRAFT])
@pytest.mark.parametrize("gamma", [1, 3])
def test_multi_position_rounds_match_target_joint(mode: str, gamma: int) -> None:
    """The joint law of the first three tokens equals P(t1|0) P(t2|t1) P(t3|t2)."""
    v = 5
    P, Q = bigram(v, 2, SamplingParams(1.0))
    rng = np.random.default_rng(gamma)
    seqs = np.array([_generate(P, Q, gamma, mode, rng, 3)[:3] for _ in range(N)])
    cells = seqs[:, 0] * v * v + seqs[:, 1] * v + seqs[:, 2]
    joint = (P[0][:, None, None] * P[:, :, None] * P[None, :, :]).reshape(-1)
    pv = chi_square_pvalue(cells, joint)
    assert pv > ALPHA, f"{mode}, γ={gamma}: p-value {pv:.2e}"


# ------------------------------------------------------------------ rationing cuts drafts


def _rationed(
    P: np.ndarray,
    Q: np.ndarray,
    gamma: int,
    rng: np.random.Generator,
    n: int,
    cut: Callable[[Acceptance, list[float]], int],
) -> list[int]:
    """Rounds over a bigram 'model' at T = 1 whose drafts the verifier may cut: ``cut`` says
    how many draft tokens are verified (the rest void); a bonus token from p follows a fully
    accepted (cut) draft. Each round's acceptance feeds the session's estimates."""
    acc, out, prev = Acceptance(), [], 0
    while len(out) < n:
        xs, qx, qrows, t = [], [], [], prev
        for _ in range(gamma):
            x = sample(Q[t], rng)
            xs.append(x)
            qx.append(float(Q[t][x]))
            qrows.append(Q[t])
            t = x
        k = cut(acc, qx)
        rows = np.stack([P[prev]] + [P[x] for x in xs[:k]])
        d = verify_batch(
            rows, xs[:k], qx[:k], greedy=False, correction=CorrectionMode.CANDIDATES, rng=rng,
            want_bonus=True,
        )  # fmt: skip
        acc.observe(qx[:k], d.accepted)
        out += [*xs[: d.accepted], _last_token(d, rows, xs, qrows, rng)]
        prev = out[-1]
    return out


def _loaded_ration(acc: Acceptance, q: list[float]) -> int:
    """The product's ration of this round among a crowd of other sessions' rounds at a
    step cost where the price cuts tails: the survival it ranks by reads q_0..q_{i-1} only."""
    me = Round(0, 2, acc.survival(q))
    crowd = [Round(k, 2, tuple(0.6 * 0.6**i for i in range(len(q)))) for k in range(1, 8)]
    return ration([me, *crowd], 0, 0.0, overhead=40.0, room=4096).keep[0]


def _peeking_cut(acc: Acceptance, q: list[float]) -> int:
    """Negative control: a cut that reads the token it decides about (verify x_i only while
    q(x_i) is high): which tokens are verified then depends on their own values."""
    return next((i for i, qi in enumerate(q) if i >= 1 and qi < 0.4), len(q))


@pytest.mark.parametrize(("cut", "exact"), [(_loaded_ration, True), (_peeking_cut, False)])
def test_rationed_rounds_keep_the_joint_law_and_a_peeking_cut_does_not(
    cut: Callable[[Acceptance, list[float]], int], exact: bool
) -> None:
    """The joint law of the first two tokens is P(t1|0)·P(t2|t1) when the ration cuts drafts
    by survival (every round cut somewhere: both paths, cut and whole, are exercised); a
    cut that looks at each token's own q is biased and fails the same test."""
    v = 5
    P, Q = bigram(v, 2, SamplingParams(1.0))
    rng = np.random.default_rng(7)
    kept: list[int] = []

    def recorded(acc: Acceptance, q: list[float]) -> int:
        kept.append(cut(acc, q))
        return kept[-1]

    seqs = [_rationed(P, Q, 4, rng, 2, recorded)[:2] for _ in range(N)]
    # drafts were cut, at more than one place (never before their first slot)
    assert min(kept) >= 1 and max(kept) > min(kept)
    assert sum(k < 4 for k in kept) > len(kept) / 2
    s = np.array(seqs)
    joint = (P[0][:, None] * P).reshape(-1)
    pv = chi_square_pvalue(s[:, 0] * v + s[:, 1], joint)
    if exact:
        assert pv > ALPHA, f"rationed: p-value {pv:.2e}"
    else:
        assert pv < 1e-6, f"the peeking cut went unnoticed: p-value {pv:.2e}"
