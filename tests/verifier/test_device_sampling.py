"""The device path (cloud_verifier.engine.device_sampling) against the NumPy reference it replaces.

Deterministic parts (the transform, greedy decisions, top-K corrections, federated rows) must
equal the reference; the random parts are held to the target distribution by the chi-square
tests of tests/shared/test_exactness.py (same N, thresholds and settings, from tests/stats.py), run
through batches of many sessions with different γ at once, with a negative control the same
test must reject. The tests run on CUDA when torch sees one, on the CPU otherwise.

Tolerances: float64 on the device equals the NumPy transform to 1e-12 (observed ~5e-16) with
the same support on every row; float32 only to 1e-6 (observed ~2.5e-7), and its federated l1
values are wrong at small ε (test_float32_is_not_the_reference). Hence DEVICE_DTYPE = float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from cloud_verifier.engine import device_sampling as D
from shared.maths import compression as C
from shared.maths.compression import SparseDist
from shared.maths.rejection import (
    CorrectionMode,
    Decision,
    one_hot,
    recover,
    try_candidates,
    verify_batch,
)
from shared.maths.sampling import SamplingParams, transform
from tests.stats import ALPHA, SETTINGS, N, bigram, chi_square_pvalue, logit_pair

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = D.DEVICE_DTYPE
CHUNK = 5_000  # sessions per verify call in the statistical tests
RESAMPLE_M = 32  # candidates per Resample in the statistical tests (i.i.d.: any m is exact)


def _t(a: Any, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a), dtype=dtype, device=DEVICE)


def _gens(seed: int, n: int) -> list[torch.Generator]:
    """One generator per session, seeded by the session."""
    return [torch.Generator(device=DEVICE).manual_seed(seed * 1_000_003 + i) for i in range(n)]


def _random_params(rng: np.random.Generator, v: int) -> SamplingParams:
    return SamplingParams(
        float(rng.choice([0.0, 0.5, 0.7, 1.0, 1.3])),
        int(rng.choice([0, 0, 1, 3, 6, v - 1, v, v + 5])),
        float(rng.choice([1.0, 1.0, 0.5, 0.8, 0.9, 0.99])),
    )


def _rows_logits(rng: np.random.Generator, n: int, v: int) -> np.ndarray:
    """float32-representable logits (what a model emits); every third row full of ties."""
    x = rng.normal(0, 3, (n, v))
    x[::3] = np.round(x[::3])
    return x.astype(np.float32).astype(np.float64)


# --------------------------------------------------------------------------------- transform


@pytest.mark.parametrize("v", [2, 8, 64, 1000])
def test_transform_rows_equals_transform_row_by_row(v: int) -> None:
    rng = np.random.default_rng(v)
    for _ in range(10):
        n = 24
        logits = _rows_logits(rng, n, v)
        params = [_random_params(rng, v) for _ in range(n)]
        t, k, tp = D.row_params(params, np.zeros(n, np.int64))
        ref = np.stack([transform(logits[i], params[i]) for i in range(n)])
        out = D.transform_rows(_t(logits, torch.float32), t, k, tp)
        assert out.dtype == torch.float64 and out.device.type == DEVICE.type
        got = out.cpu().numpy()
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(got > 0, ref > 0)  # the same ids can be emitted
        greedy = t == 0
        np.testing.assert_array_equal(got[greedy], ref[greedy])  # one-hot, exactly
        f32 = D.transform_rows(_t(logits, torch.float32), t, k, tp, dtype=torch.float32)
        np.testing.assert_allclose(f32.cpu().numpy(), ref, rtol=0, atol=1e-6)


def test_transform_rows_ties_and_boundaries() -> None:
    rows = np.array(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0],  # greedy: first argmax (1); top-k 2 keeps all three 3s
            [1.0, 3.0, 3.0, 0.0, 3.0],
            [0.0, 0.0, 0.0, 0.0, 5.0],  # top-p on four equal tails: the lower ids go first
            [2.0, 2.0, 2.0, 2.0, 2.0],  # all equal: top-p keeps the highest ids
        ]
    )
    params = [
        SamplingParams(0.0),
        SamplingParams(1.0, top_k=2),
        SamplingParams(1.0, top_p=0.995),
        SamplingParams(0.7, top_p=0.5),
    ]
    t, k, tp = D.row_params(params, [0, 0, 0, 0])
    got = D.transform_rows(_t(rows), t, k, tp).cpu().numpy()
    ref = np.stack([transform(r, p) for r, p in zip(rows, params, strict=True)])
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-15)
    np.testing.assert_array_equal(got > 0, ref > 0)
    assert got[0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert (got[1] > 0).tolist() == [False, True, True, False, True]


def test_transform_rows_takes_half_precision_logits_and_keeps_them() -> None:
    rng = np.random.default_rng(1)
    logits = torch.tensor(rng.normal(0, 2, (6, 50)), dtype=torch.bfloat16, device=DEVICE)
    before = logits.clone()
    params = [SamplingParams(0.0), SamplingParams(0.8, 5, 0.9)] * 3
    t, k, tp = D.row_params(params, [0] * 6)
    got = D.transform_rows(logits, t, k, tp).cpu().numpy()
    up = logits.double().cpu().numpy()  # bf16 → float64 is exact
    ref = np.stack([transform(up[i], params[i]) for i in range(6)])
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)
    assert torch.equal(logits, before)


def test_transform_rows_validates() -> None:
    x = _t(np.zeros((2, 4)))
    with pytest.raises(ValueError):
        D.transform_rows(x, [1.0, -1.0], 0, 1.0)
    with pytest.raises(ValueError):
        D.transform_rows(x, 1.0, 0, [1.0, 0.0])
    with pytest.raises(ValueError):
        D.transform_rows(x, [1.0, 1.0, 1.0], 0, 1.0)
    with pytest.raises(ValueError):
        D.transform_rows(_t(np.zeros((2, 0))), 1.0, 0, 1.0)


# ---------------------------------------------------------------------------- greedy: exact


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verify_logits_equals_verify_of_transformed_rows(seed: int) -> None:
    """The engine's lazy path (p(x) from one pass per row, only decision rows transformed)
    decides as verify() over every transformed row, with the same generators: same accepted
    counts, tokens, candidates and top-K corrections (values to float rounding)."""
    rng = np.random.default_rng(seed)
    v = 50
    gammas = [int(g) for g in rng.integers(0, 7, 24)]
    b = len(gammas)
    cu = D.cu_from_gammas(gammas)
    params = [_random_params(rng, v) for _ in range(b)]
    logits = _rows_logits(rng, int(cu[-1]) + b, v).astype(np.float32)
    t, k, tp = D.row_params(params, gammas)
    probs = D.transform_rows(_t(logits), t, k, tp)
    p_np = probs.cpu().numpy()
    draft = np.empty(int(cu[-1]), np.int64)
    for s in range(b):
        for i in range(gammas[s]):
            row = p_np[cu[s] + s + i]
            likely = rng.random() < 0.7
            draft[cu[s] + i] = rng.choice(v, p=row) if likely else rng.integers(v)
    q = rng.uniform(0.05, 1.0, len(draft)).astype(np.float32)
    kw: dict[str, Any] = dict(
        correction=[str(rng.choice(list(CorrectionMode))) for _ in range(b)],
        want_bonus=rng.random(b) < 0.5,
        k=[int(x) for x in rng.integers(1, 12, b)],
        eps_target=[float(x) for x in rng.choice([0.0, 0.01, 0.2], b)],
        m=3,
    )
    ref = D.verify(probs, draft, q, cu, greedy=[p.greedy for p in params],
                   corrections=D.Corrections(generators=_gens(seed, b), **kw))  # fmt: skip
    got = D.verify_logits(_t(logits, torch.float32), params, draft, q, cu,
                          D.Corrections(generators=_gens(seed, b), **kw))  # fmt: skip
    for r, g in zip(ref, got, strict=True):
        assert (r.accepted, r.token, r.bonus) == (g.accepted, g.token, g.bonus)
        for a, c in ((r.sparse, g.sparse), (r.candidates, g.candidates)):
            assert (a is None) == (c is None)
            if a is not None and c is not None:
                np.testing.assert_array_equal(a.ids, c.ids)
                np.testing.assert_allclose(a.probs, c.probs, rtol=1e-6)


def test_greedy_decisions_equal_verify_batch() -> None:
    """T = 0 sessions, several γ, in one batch with sampling sessions: the same decisions."""
    rng = np.random.default_rng(7)
    v = 40
    gammas = [0, 1, 2, 3, 5, 8, 1, 4, 2, 6] * 4
    b = len(gammas)
    cu = D.cu_from_gammas(gammas)
    sampling = rng.random(b) < 0.3  # these sessions are not greedy: they must not disturb
    params = [SamplingParams(1.0) if s else SamplingParams(0.0) for s in sampling]
    logits = _rows_logits(rng, int(cu[-1]) + b, v)
    t, k, tp = D.row_params(params, gammas)
    probs = D.transform_rows(_t(logits), t, k, tp)
    p_np = probs.cpu().numpy()
    draft = np.empty(int(cu[-1]), np.int64)
    for s in range(b):
        for i in range(gammas[s]):
            row = p_np[cu[s] + s + i]
            draft[cu[s] + i] = int(np.argmax(row)) if rng.random() < 0.8 else rng.integers(v)
    q = np.ones(len(draft), np.float32)
    bonus = rng.random(b) < 0.5
    modes = [str(rng.choice(list(CorrectionMode))) for _ in range(b)]
    decisions = D.verify(
        probs,
        draft,
        q,
        cu,
        greedy=~sampling,
        corrections=D.Corrections(
            correction=modes,
            want_bonus=bonus,
            generators=[g if s else None for g, s in zip(_gens(1, b), sampling, strict=True)],
        ),
    )
    assert len(decisions) == b
    for s in range(b):
        if sampling[s]:
            assert 0 <= decisions[s].accepted <= gammas[s]
            continue
        ref = verify_batch(
            p_np[cu[s] + s : cu[s + 1] + s + 1],
            draft[cu[s] : cu[s + 1]],
            q[cu[s] : cu[s + 1]],
            greedy=True,
            correction=modes[s],
            rng=np.random.default_rng(0),
            want_bonus=bool(bonus[s]),
        )
        assert decisions[s] == ref, (s, gammas[s])


def test_forced_outcomes_and_corrections_are_valid() -> None:
    """Sure accepts (q(x) <= p(x)) and sure rejections (p(x) = 0, q(x) = 1) land where they
    must; the correction of every mode respects the support and excludes x."""
    rng = np.random.default_rng(3)
    v = 30
    gammas = [3, 1, 4, 2, 5, 3]
    modes = [CorrectionMode.TOPK, CorrectionMode.CANDIDATES, CorrectionMode.GREEDY_DRAFT] * 2
    cu = D.cu_from_gammas(gammas)
    b = len(gammas)
    p = rng.dirichlet(np.full(v, 0.5), int(cu[-1]) + b)
    p[:, :10] = 0.0  # ids 0..9 impossible everywhere
    p /= p.sum(1, keepdims=True)
    reject_at = [int(rng.integers(g)) for g in gammas]
    draft = np.empty(int(cu[-1]), np.int64)
    q = np.empty(int(cu[-1]), np.float32)
    for s in range(b):
        for i in range(gammas[s]):
            row = p[cu[s] + s + i]
            if i == reject_at[s]:
                draft[cu[s] + i], q[cu[s] + i] = i, 1.0
            else:
                x = int(rng.integers(10, v))
                draft[cu[s] + i], q[cu[s] + i] = x, np.float32(row[x]) * np.float32(0.999)
    ds = D.verify(
        _t(p),
        draft,
        q,
        cu,
        greedy=[False] * b,
        corrections=D.Corrections(
            correction=modes,
            want_bonus=[True] * b,
            generators=_gens(2, b),
            k=4,
            m=5,
        ),
    )
    for s, d in enumerate(ds):
        assert d.accepted == reject_at[s] and d.rejected and d.bonus is None
        row = p[cu[s] + s + d.accepted]
        if modes[s] == CorrectionMode.TOPK:
            assert d.sparse is not None
            _assert_same_topk(d.sparse, C.compress(row, 4), row)
        elif modes[s] == CorrectionMode.CANDIDATES:
            assert d.candidates is not None and len(d.candidates.ids) == 5
            assert np.all(d.candidates.ids >= 10)
            np.testing.assert_array_equal(
                d.candidates.probs, row[d.candidates.ids].astype(np.float32)
            )
        else:
            assert d.token is not None and d.token >= 10


# ------------------------------------------------------------------- statistical exactness


def _first_tokens(
    p: np.ndarray,
    q: np.ndarray,
    mode: str,
    seed: int,
    *,
    q_sampled: np.ndarray | None = None,
    logits: tuple[np.ndarray, SamplingParams] | None = None,
) -> np.ndarray:
    """N one-session trials, CHUNK sessions (γ = 1..4) per verify call: the first emitted token
    of each session (x_0 if accepted, else the edge's recovered token)."""
    v = len(p)
    rng = np.random.default_rng(seed)
    p_dev = _t(p)[None]
    out: list[int] = []
    for c0 in range(0, N, CHUNK):
        b = min(CHUNK, N - c0)
        gammas = 1 + np.arange(b) % 4
        cu = D.cu_from_gammas(gammas)
        n_tok = int(cu[-1])
        if mode == CorrectionMode.GREEDY_DRAFT:
            draft = np.full(n_tok, int(np.argmax(q)), np.int64)
            q_row = one_hot(int(draft[0]), v)
        else:
            draft = rng.choice(v, n_tok, p=q if q_sampled is None else q_sampled)
            q_row = q
        gens = _gens(seed + c0, b)
        correction = CorrectionMode.TOPK if mode == "topk_full" else mode
        if logits is None:
            ds = D.verify(
                p_dev.expand(n_tok + b, v),
                draft,
                q_row[draft].astype(np.float32),
                cu,
                greedy=[False] * b,
                corrections=D.Corrections(
                    correction=[correction] * b,
                    want_bonus=[False] * b,
                    generators=gens,
                    k=v,
                ),
            )
        else:  # the engine's path: raw logits, transformed only where needed
            ds = D.verify_logits(
                _t(logits[0][None], torch.float32).expand(n_tok + b, v),
                [logits[1]] * b,
                draft,
                q_row[draft].astype(np.float32),
                cu,
                corrections=D.Corrections(
                    correction=[correction] * b,
                    want_bonus=[False] * b,
                    generators=gens,
                    k=v,
                ),
            )
        for s, d in enumerate(ds):
            x0 = int(draft[cu[s]])
            if d.accepted:
                out.append(x0)
                continue
            if d.candidates is None:
                tok = recover(d, q_row, rng)
            else:
                tok = try_candidates(d.candidates, q_row, rng)
            while tok is None:  # all candidates failed: Resample (more per try: the test's time)
                more = D.draw_candidates(p_dev[0], x0, RESAMPLE_M, gens[s])
                tok = try_candidates(more, q_row, rng)
            out.append(tok)
    return np.array(out)


@pytest.mark.parametrize("v", [8, 64])
@pytest.mark.parametrize("mode", [CorrectionMode.CANDIDATES, CorrectionMode.GREEDY_DRAFT])
@pytest.mark.parametrize("params", SETTINGS, ids=str)
@pytest.mark.parametrize("path", ["probs", "logits"])
def test_exact_modes_match_target(v: int, mode: str, params: SamplingParams, path: str) -> None:
    tl, dl = logit_pair(v * 7 + 1, v)
    tl = tl.astype(np.float32).astype(np.float64)  # what a model emits
    p = D.transform_rows(_t(tl[None]), params.temperature, params.top_k, params.top_p)[0]
    p_np, q = p.cpu().numpy(), transform(dl, params)
    from_logits = (tl, params) if path == "logits" else None
    out = _first_tokens(p_np, q, mode, seed=v, logits=from_logits)
    pv = chi_square_pvalue(out, transform(tl, params))
    assert pv > ALPHA, f"{mode} at {params}: chi-square p-value {pv:.2e}"


@pytest.mark.parametrize("v", [8, 64])
def test_lossless_topk_matches_target(v: int) -> None:
    """top-K with K = V is exact: the edge's residual from the full p."""
    params = SETTINGS[5]
    tl, dl = logit_pair(v * 7 + 1, v)
    p, q = transform(tl, params), transform(dl, params)
    pv = chi_square_pvalue(_first_tokens(p, q, "topk_full", seed=v + 1), p)
    assert pv > ALPHA, f"topk_full: chi-square p-value {pv:.2e}"


def test_negative_control_q_not_transformed_like_p() -> None:
    """The known bug class through the device path: x drawn from untransformed q, transformed q
    reported. The same test must reject it."""
    v = 16
    params = SamplingParams(0.5)
    tl, dl = logit_pair(3, v)
    p, q = transform(tl, params), transform(dl, params)
    q_raw = transform(dl, SamplingParams(1.0))
    out = _first_tokens(p, q, CorrectionMode.CANDIDATES, seed=5, q_sampled=q_raw)
    pv = chi_square_pvalue(out, p)
    assert pv < 1e-6, f"the broken variant passed (p-value {pv:.2e}): the test has no power"


def _generate_batch(
    P: np.ndarray, Q: np.ndarray, modes: Sequence[str], gammas: np.ndarray, seed: int, n_tokens: int
) -> np.ndarray:
    """Speculative rounds over a bigram 'model' for many sessions at once (start token 0), each
    with its own γ, mode and generator, bonus on full acceptance, until every session has
    emitted n_tokens. Returns [sessions, n_tokens]."""
    v = P.shape[0]
    rng = np.random.default_rng(seed)
    P_dev = _t(P)
    cumQ = np.cumsum(Q, axis=1)
    b = len(modes)
    gens = _gens(seed, b)
    out: list[list[int]] = [[] for _ in range(b)]
    while True:
        active = [s for s in range(b) if len(out[s]) < n_tokens]
        if not active:
            break
        g_act = gammas[active]
        cu = D.cu_from_gammas(g_act)
        row_tok = np.empty(int(cu[-1]) + len(active), np.int64)
        draft = np.empty(int(cu[-1]), np.int64)
        qx = np.empty(int(cu[-1]), np.float32)
        prev = np.array([out[s][-1] if out[s] else 0 for s in active])
        t = prev.copy()
        greedy_draft = np.array([modes[s] == CorrectionMode.GREEDY_DRAFT for s in active])
        for i in range(int(g_act.max())):
            has = g_act > i
            u = rng.random(len(active))
            sampled = np.minimum((u[:, None] >= cumQ[t]).sum(1), v - 1)
            x = np.where(greedy_draft, np.argmax(Q[t], axis=1), sampled)
            idx = cu[:-1][has] + i
            draft[idx] = x[has]
            qx[idx] = np.where(greedy_draft, 1.0, Q[t, x])[has]
            t = np.where(has, x, t)
        for j in range(len(active)):
            r0 = cu[j] + j
            row_tok[r0] = prev[j]
            row_tok[r0 + 1 : r0 + 1 + g_act[j]] = draft[cu[j] : cu[j + 1]]
        ds = D.verify(
            P_dev[_t(row_tok, torch.int64)],
            draft,
            qx,
            cu,
            greedy=[False] * len(active),
            corrections=D.Corrections(
                correction=[modes[s] for s in active],
                want_bonus=[True] * len(active),
                generators=[gens[s] for s in active],
            ),
        )
        for j, (s, d) in enumerate(zip(active, ds, strict=True)):
            xs = draft[cu[j] : cu[j + 1]].tolist()
            out[s] += xs[: d.accepted]
            if not d.rejected:
                assert d.bonus is not None
                out[s].append(d.bonus)
                continue
            qrow = Q[row_tok[cu[j] + j + d.accepted]]
            if d.token is not None:
                out[s].append(d.token)
                continue
            x_rej = xs[d.accepted]
            assert d.candidates is not None
            tok = try_candidates(d.candidates, qrow, rng)
            while tok is None:
                p_row = P_dev[int(row_tok[cu[j] + j + d.accepted])]
                tok = try_candidates(
                    D.draw_candidates(p_row, x_rej, RESAMPLE_M, gens[s]), qrow, rng
                )
            out[s].append(tok)
    return np.array([o[:n_tokens] for o in out])


def test_multi_position_rounds_match_target_joint() -> None:
    """Both exact modes in one batch, γ ∈ {1, 2, 3} mixed: per mode, the joint law of the first
    three tokens equals P(t1|0) P(t2|t1) P(t3|t2)."""
    v = 5
    P, Q = bigram(v, 2, SamplingParams(1.0))
    joint = (P[0][:, None, None] * P[:, :, None] * P[None, :, :]).reshape(-1)
    modes = [CorrectionMode.CANDIDATES, CorrectionMode.GREEDY_DRAFT] * N
    gammas = 1 + (np.arange(2 * N) // 2) % 3
    seqs = _generate_batch(P, Q, modes, gammas, seed=11, n_tokens=3)
    cells = seqs[:, 0] * v * v + seqs[:, 1] * v + seqs[:, 2]
    for j, mode in enumerate(modes[:2]):
        pv = chi_square_pvalue(cells[j::2], joint)
        assert pv > ALPHA, f"{mode}: p-value {pv:.2e}"


# ------------------------------------------------------------------------- top-K, federate


def _assert_same_topk(got: SparseDist, ref: SparseDist, p: np.ndarray) -> None:
    """Equal to compression.compress: the same values in the same order, the same ids for every
    value but the smallest kept one, where any ids of that probability may be chosen."""
    assert got.ids.dtype == np.int64 and got.probs.dtype == np.float32
    np.testing.assert_array_equal(got.probs, ref.probs)
    pg, pr = p[got.ids], p[ref.ids]
    np.testing.assert_array_equal(pg, pr)
    for val in np.unique(pr):
        if val == pr.min():
            assert set(got.ids[pg == val]) <= set(np.flatnonzero(p == val))
        else:
            assert set(got.ids[pg == val]) == set(ref.ids[pr == val])
    if len(np.unique(pr)) == len(pr):
        np.testing.assert_array_equal(got.ids[:-1], ref.ids[:-1])


def _rows_for_topk(rng: np.random.Generator, n: int, v: int) -> np.ndarray:
    logits = _rows_logits(rng, n, v)
    params = [_random_params(rng, v) for _ in range(n)]
    return np.stack([transform(logits[i], params[i]) for i in range(n)])


@pytest.mark.parametrize(
    "k,eps", [(1, 0.0), (5, 0.0), (64, 0.0), (500, 0.0), (10, 0.05), (64, 1e-4)]
)
def test_topk_corrections_equal_compress(k: int, eps: float) -> None:
    rng = np.random.default_rng(k)
    v = 200
    rows = _rows_for_topk(rng, 40, v)
    rows = rows[rows.max(1) < 1.0]  # a rejection needs mass outside x
    b = len(rows)
    p = np.repeat(rows, 2, axis=0)  # γ = 1: row 0 scores x, row 1 is the bonus row
    draft = np.array([int(np.argmin(r)) for r in rows])  # p(x) is the minimum: q = 1 rejects
    draft_p = rows[np.arange(b), draft]
    assert np.all(draft_p < 1.0)
    ds = D.verify(
        _t(p),
        draft,
        np.ones(b, np.float32),
        D.cu_from_gammas([1] * b),
        greedy=[False] * b,
        corrections=D.Corrections(
            correction=[CorrectionMode.TOPK] * b,
            want_bonus=[False] * b,
            generators=_gens(4, b),
            k=k,
            eps_target=eps,
        ),
    )
    n_checked = 0
    for s, d in enumerate(ds):
        if d.accepted:  # accepted with probability p(x) (> 0 only on flat rows)
            continue
        assert d.sparse is not None
        _assert_same_topk(d.sparse, C.compress(rows[s], k, eps), rows[s])
        n_checked += 1
    assert n_checked >= b // 2


def _federate_numpy(probs: np.ndarray, draft: np.ndarray, k: int, eps: float) -> D.FederatedRows:
    """cloud_verifier.session.SessionModel._federate, on one session's rows."""
    vocab = probs.shape[1]
    dists = tuple(C.compress(row, k, eps) for row in probs)
    p_draft = probs[np.arange(len(draft)), draft].astype(np.float32)
    l1 = np.array(
        [
            [C.l1(C.reconstruct(d, vocab, how), row) for how in C.RECONSTRUCTIONS]
            for d, row in zip(dists, probs, strict=True)
        ],
        dtype=np.float32,
    )
    return dists, p_draft, l1


def test_federate_rows_equals_numpy() -> None:
    rng = np.random.default_rng(5)
    v = 300
    gammas = [0, 1, 3, 2, 5, 4]
    ks = [1, 4, 10, 300, 50, 20]
    epss = [0.0, 0.0, 0.05, 0.0, 1e-3, 0.2]
    cu = D.cu_from_gammas(gammas)
    b = len(gammas)
    probs = _rows_for_topk(rng, int(cu[-1]) + b, v)
    draft = rng.integers(0, v, int(cu[-1]))
    got = D.federate_rows(_t(probs), draft, cu, ks, epss)
    assert len(got) == b
    for s in range(b):
        rows = probs[cu[s] + s : cu[s + 1] + s + 1]
        dists, p_draft, l1 = got[s]
        r_dists, r_p_draft, r_l1 = _federate_numpy(rows, draft[cu[s] : cu[s + 1]], ks[s], epss[s])
        assert len(dists) == gammas[s] + 1
        for d, r, row in zip(dists, r_dists, rows, strict=True):
            _assert_same_topk(d, r, row)
        assert p_draft.dtype == np.float32 and p_draft.shape == (gammas[s],)
        np.testing.assert_array_equal(p_draft, r_p_draft)
        assert l1.dtype == np.float32 and l1.shape == (gammas[s] + 1, 2)
        np.testing.assert_allclose(l1, r_l1, rtol=1e-6, atol=1e-12)


def test_float32_is_not_the_reference() -> None:
    """The dtype decision's evidence beyond the transform's tolerance: with float32
    probabilities the federated l1 of a near-lossless top-K (ε ~ 1e-8) is off by a large
    fraction of itself and adaptive K differs from compress on some rows (a correction with
    another support); float64 agrees on both."""
    rng = np.random.default_rng(2)
    v, g = 4096, 7
    rel: dict[torch.dtype, float] = {}
    k_differs = dict.fromkeys((torch.float64, torch.float32), 0)
    for trial in range(8):
        logits = rng.normal(0, 2.0, (g + 1, v)).astype(np.float32)
        ref_p = transform(logits, SamplingParams(1.0))
        for dtype in k_differs:
            p = D.transform_rows(_t(logits, torch.float32), 1.0, 0, 1.0, dtype=dtype)
            if trial == 0:
                _, _, ref_l1 = _federate_numpy(ref_p, np.arange(g), v, 0.0)
                ((_, _, l1),) = D.federate_rows(p, np.arange(g), [0, g], v)
                rel[dtype] = float(np.max(np.abs(l1 - ref_l1) / ref_l1))
            for eps in (1e-2, 1e-3, 1e-4):
                ((dists, _, _),) = D.federate_rows(p, np.arange(g), [0, g], v, eps)
                for d, row in zip(dists, ref_p, strict=True):
                    k_differs[dtype] += len(d.ids) != C.adaptive_k(row, eps, v)
    assert rel[torch.float64] < 1e-6 and k_differs[torch.float64] == 0
    assert rel[torch.float32] > 0.05 and k_differs[torch.float32] > 0, (rel, k_differs)


# ------------------------------------------------------------------------ shapes, transfers


def test_shapes_and_only_small_copies_leave_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    copies: list[int] = []
    real: Callable[[torch.Tensor], np.ndarray] = D._to_host

    def watched(t: torch.Tensor) -> np.ndarray:
        copies.append(t.numel())
        return real(t)

    monkeypatch.setattr(D, "_to_host", watched)
    rng = np.random.default_rng(9)
    v = 5000
    gammas = [0, 1, 2, 3, 5, 8, 4, 6, 1, 7, 2, 3]
    b = len(gammas)
    cu = D.cu_from_gammas(gammas)
    modes = [CorrectionMode.TOPK, CorrectionMode.CANDIDATES, CorrectionMode.GREEDY_DRAFT] * 4
    greedy = [s % 5 == 4 for s in range(b)]
    params = [SamplingParams(0.0) if g else SamplingParams(1.0, 50, 0.95) for g in greedy]
    t, k, tp = D.row_params(params, gammas)
    probs = D.transform_rows(_t(rng.normal(0, 3, (int(cu[-1]) + b, v)), torch.float32), t, k, tp)
    p_np = probs.cpu().numpy()
    draft = rng.integers(0, v, int(cu[-1]))
    for s in range(b):  # mostly likely tokens, so that some sessions accept everything
        for i in range(gammas[s]):
            if rng.random() < 0.7:
                draft[cu[s] + i] = int(np.argmax(p_np[cu[s] + s + i]))
    q = np.full(len(draft), 0.5, np.float32)
    copies.clear()
    ds = D.verify(
        probs,
        draft,
        q,
        cu,
        greedy=greedy,
        corrections=D.Corrections(
            correction=modes,
            want_bonus=[True] * b,
            generators=_gens(6, b),
            k=16,
            m=8,
        ),
    )
    assert len(ds) == b and 1 <= len(copies) <= 2
    assert sum(copies) <= b * (2 * 16 + 2 * 8 + 4)  # ids, counts and correction values only
    for s, d in enumerate(ds):
        assert isinstance(d, Decision) and 0 <= d.accepted <= gammas[s]
        assert d.rejected == (d.accepted < gammas[s])
        assert d.rejected or d.bonus is not None
        for sd in (d.sparse, d.candidates):
            assert sd is None or (sd.ids.nbytes + sd.probs.nbytes) <= 16 * 12
    copies.clear()
    fed = D.federate_rows(probs, draft, cu, 16, 0.01)
    assert len(copies) == 1 and copies[0] < 20 * (int(cu[-1]) + b) * 2 + 4 * b
    for s, (dists, p_draft, l1) in enumerate(fed):
        assert len(dists) == gammas[s] + 1 and p_draft.shape == (gammas[s],)
        assert l1.shape == (gammas[s] + 1, 2)
        assert all(len(d.ids) <= 16 for d in dists)
    copies.clear()
    cands = D.draw_candidates(probs[0], int(draft[0]) if len(draft) else 0, 8, _gens(7, 1)[0])
    assert len(cands.ids) == 8 and copies == [1 + 8 + 8]


def test_verify_validates() -> None:
    probs = _t(np.full((5, 4), 0.25))
    how = D.Corrections([CorrectionMode.CANDIDATES] * 2, [False, False], _gens(8, 2))
    ok: dict[str, Any] = dict(greedy=[False, False], corrections=how)
    D.verify(probs, [0, 1, 2], np.full(3, 0.25), [0, 2, 3], **ok)
    with pytest.raises(ValueError):  # rows ≠ T + B
        D.verify(probs, [0, 1], np.full(2, 0.25), [0, 1, 2], **ok)
    with pytest.raises(ValueError):
        D.verify(probs, [0, 1, 9], np.full(3, 0.25), [0, 2, 3], **ok)
    for bad in (replace(how, correction=["x"] * 2), replace(how, generators=[None] * 2)):
        with pytest.raises(ValueError):
            D.verify(probs, [0, 1, 2], np.full(3, 0.25), [0, 2, 3], **{**ok, "corrections": bad})
