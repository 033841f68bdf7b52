"""Speculative rejection sampling, split between the verifier and the edge.

The verifier holds p (target) for every position of a batch but only the scalar q_i(x_i) of each
draft token; the edge holds q in full but receives p only in compressed form. The split:

* verifier (:func:`verify_batch`): for i = 1..γ accept x_i w.p. min(1, p_i(x_i)/q_i(x_i))
  (greedy: x_i == argmax p_i). The *accepted* prefix ends at the first rejection, at which a
  correction is prepared; with every token accepted, a *bonus* token may be drawn from p_{γ+1}.
* edge (:func:`recover`): turns the correction into the *recovered* token, a draw from the
  residual norm(max(0, p − q)) at the rejected position.

Corrections (see ``CorrectionMode``):

* top-K (lossy): the edge draws from norm(max(0, p̂ − q)) with p̂ the reconstruction of the top-K;
  TV to the exact step is <= 2ε (``compression.lossy_correction_tv_bound``).
* candidates (exact): y ~ p' = p with x excluded (p'(y) = p(y)/(1 − p(x))), accepted with
  probability max(0, 1 − q(y)/p(y)). The accepted y then has density
  p'(y)·max(0, 1 − q(y)/p(y)) = max(0, p(y) − q(y))/(1 − p(x)) ∝ max(0, p − q)(y)
  (and max(0, p − q)(x) = 0 because x was rejected, which needs q(x) > p(x)). Each try succeeds
  with probability TV(p, q)/(1 − p(x)); if all M fail the edge asks for more (Resample).
* greedy draft (exact, ids only): q is one-hot at x, so acceptance is p(x) and the residual
  norm(max(0, p − 1_x)) is p with x zeroed, which the verifier samples itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shared.enums import TextEnum
from shared.maths import compression
from shared.maths.compression import SparseDist
from shared.maths.sampling import Probs, accept, residual, sample


class CorrectionMode(TextEnum):
    """How a rejection is corrected (negotiated in Hello).

    * ``topk``: the verifier sends the top-K of p at the rejected position; the edge samples the
      residual norm(max(0, p̂ − q)) from the reconstruction p̂. Lossy: error bounded by ε.
    * ``candidates``: exact. The verifier sends M ids drawn from p with the rejected id excluded,
      with p of each; the edge accepts the first y with probability max(0, 1 − q(y)/p(y)). If all
      M fail it sends Resample and receives M more (rare; counted).
    * ``greedy_draft``: exact, ids only. The draft proposes deterministically (q one-hot), so the
      acceptance probability is p(x) and the verifier samples the correction from p with x zeroed.
    """

    TOPK = "topk"
    CANDIDATES = "candidates"
    GREEDY_DRAFT = "greedy_draft"


@dataclass(frozen=True)
class Decision:
    """The verifier's outcome for one batch (the payload of a Verdict)."""

    accepted: int
    sparse: SparseDist | None = None
    candidates: SparseDist | None = None
    token: int | None = None
    bonus: int | None = None

    @property
    def rejected(self) -> bool:
        return self.sparse is not None or self.candidates is not None or self.token is not None


def one_hot(x: int, vocab_size: int) -> Probs:
    out = np.zeros(vocab_size, dtype=np.float64)
    out[x] = 1.0
    return out


def draw_candidates(p: Probs, exclude: int, m: int, rng: np.random.Generator) -> SparseDist:
    """M i.i.d. draws from p with ``exclude`` removed, each with its original p(y).

    p: [V]. Ids may repeat: each candidate is an independent trial at the edge.
    """
    pe = np.asarray(p, dtype=np.float64).copy()
    pe[exclude] = 0.0
    total = pe.sum()
    if total <= 0.0:
        raise ValueError("no mass outside the rejected token: a rejection was impossible")
    cum = np.cumsum(pe)
    ids = np.searchsorted(cum, rng.random(m) * total, side="right")
    ids = np.minimum(ids, len(pe) - 1)
    # Rounding can land on a zero entry at the top end; move each such draw down to mass.
    for j in np.flatnonzero(pe[ids] <= 0.0):
        i = int(ids[j])
        while pe[i] <= 0.0:
            i -= 1
        ids[j] = i
    ids = ids.astype(np.int64)
    return SparseDist(ids, np.asarray(p, np.float64)[ids].astype(np.float32))


def verify_batch(
    p: npt.ArrayLike,
    draft: npt.ArrayLike,
    q_draft: npt.ArrayLike,
    *,
    greedy: bool,
    correction: str,
    rng: np.random.Generator,
    k: int = 10,
    eps_target: float = 0.0,
    m: int = 8,
    want_bonus: bool = False,
) -> Decision:
    """Accept or reject a batch of draft tokens against the target.

    p: [γ+1, V] target distributions (after the sampling transform); row i scores draft[i],
    row γ is the bonus position. draft: [γ] ids. q_draft: [γ] the draft's q_i(x_i) (1 for a
    greedy draft).
    """
    pa = np.asarray(p, dtype=np.float64)
    x = np.asarray(draft, dtype=np.int64)
    qx = np.asarray(q_draft, dtype=np.float64)
    gamma = len(x)
    if pa.shape[0] != gamma + 1 or len(qx) != gamma:
        raise ValueError(f"p has {pa.shape[0]} rows for γ = {gamma} (needs γ + 1)")
    for i in range(gamma):
        xi = int(x[i])
        if greedy:
            # Greedy target: p_i is one-hot at argmax, so accept exactly on an argmax match.
            ok = bool(pa[i, xi] >= 1.0)
        else:
            ok = accept(float(pa[i, xi]), float(qx[i]), float(rng.random()))
        if ok:
            continue
        if greedy:
            return Decision(i, token=int(np.argmax(pa[i])))
        if correction == CorrectionMode.TOPK:
            return Decision(i, sparse=compression.compress(pa[i], k, eps_target))
        if correction == CorrectionMode.CANDIDATES:
            return Decision(i, candidates=draw_candidates(pa[i], xi, m, rng))
        if correction == CorrectionMode.GREEDY_DRAFT:
            return Decision(i, token=sample(residual(pa[i], one_hot(xi, pa.shape[1])), rng))
        raise ValueError(f"unknown correction mode {correction!r}")
    bonus = None
    if want_bonus:
        bonus = int(np.argmax(pa[gamma])) if greedy else sample(pa[gamma], rng)
    return Decision(gamma, bonus=bonus)


def try_candidates(cands: SparseDist, q: npt.ArrayLike, rng: np.random.Generator) -> int | None:
    """Exact recovery from candidates: the first y accepted w.p. max(0, 1 − q(y)/p(y)).

    q: [V] the draft distribution at the rejected position. None when every candidate failed.
    """
    qa = np.asarray(q, dtype=np.float64)
    for y, py in zip(cands.ids.tolist(), cands.probs.tolist(), strict=True):
        # u < 1 − q/p  ⇔  u·p < p − q (p > 0 is guaranteed by the codec).
        if rng.random() * py < py - qa[y]:
            return int(y)
    return None


def recover(
    decision: Decision,
    q: npt.ArrayLike,
    rng: np.random.Generator,
    *,
    reconstruction: str = compression.RENORMALISED,
) -> int | None:
    """The edge's recovered token at the rejected position. q: [V] draft distribution there.

    Returns None only for candidates that all failed (the caller sends Resample).
    """
    if decision.token is not None:
        return decision.token
    qa = np.asarray(q, dtype=np.float64)
    if decision.sparse is not None:
        p_hat = compression.reconstruct(decision.sparse, len(qa), reconstruction)
        return sample(residual(p_hat, qa), rng)
    if decision.candidates is not None:
        return try_candidates(decision.candidates, qa, rng)
    raise ValueError("decision carries no correction")
