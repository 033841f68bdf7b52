"""Federated verification (SpecFed) at the edge: aggregate M workers' replies and decide.

Each worker i (weight w_i, Σ w_i = 1) answers a batch with, for every position j = 0..γ, a top-k_i
sparse distribution of its p_i,j and the exact scalars p_i,j(x_j) of the drafted tokens. The edge:

* accepts x_j with probability min(1, p̄_j(x_j)/q_j(x_j)) using the **exact** aggregate scalar
  p̄_j(x_j) = Σ w_i p_i,j(x_j) (our addition: acceptance stays exact under compression);
  greedy decoding accepts iff x_j is the argmax of the aggregated reconstruction;
* on the first rejection draws the recovered token from norm(max(0, p̂̄_j − q_j)), where
  p̂̄_j = Σ w_i p̂_i,j is the aggregate of the reconstructions (A or B); with every token accepted
  the bonus token comes from p̂̄_γ. With k_i = |V| everything is exact.

Measured on every position (never assumed), against the bounds of :mod:`shared.maths.compression`:
ε_i,j; the workers' own exact ‖p̂_i,j − p_i,j‖₁ when they report it; Σ_i w_i ‖p̂_i − p_i‖₁, which
bounds the aggregation bias ‖p̂̄ − p̄‖₁ from above and must stay below 2 Σ w_i ε_i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from shared.maths import compression
from shared.maths.sampling import Probs, accept, residual, sample
from shared.wire.messages import FederatedReply

#: Tolerance for float32 values on the wire when checking a bound.
BOUND_TOL = 1e-4


@dataclass
class PositionMeasure:
    """What one decided position tells about compression (weights already renormalised)."""

    eps: list[float]  # ε_i per worker
    l1_reported: list[float | None]  # the worker's exact ‖p̂_i − p_i‖₁ for the reconstruction used
    bias_bound: float  # 2 Σ w_i ε_i
    bias_upper: float | None  # Σ w_i ‖p̂_i − p_i‖₁ (when every worker reported it)
    violations: list[str] = field(default_factory=list)


@dataclass
class FederatedDecision:
    accepted: int
    token: int | None  # recovered token (on a rejection) or bonus token
    rejected: bool
    measures: list[PositionMeasure]


def aggregate_reconstruction(
    replies: Sequence[FederatedReply],
    weights: npt.ArrayLike,
    j: int,
    vocab_size: int,
    how: str,
) -> Probs:
    """p̂̄_j = Σ w_i p̂_i,j: [V]."""
    rows = [compression.reconstruct(r.dists[j], vocab_size, how) for r in replies]
    return compression.aggregate(rows, weights)


def measure_position(
    replies: Sequence[FederatedReply], weights: npt.ArrayLike, j: int, how: str
) -> PositionMeasure:
    w = compression.normalise_weights(weights)
    eps = [r.dists[j].eps for r in replies]
    col = 0 if how == compression.RENORMALISED else 1
    reported: list[float | None] = [None if r.l1 is None else float(r.l1[j, col]) for r in replies]
    violations = []
    for i, (e, l1) in enumerate(zip(eps, reported, strict=True)):
        if l1 is None:
            continue
        # A: equality 2ε; B: at most 2ε. Either way never above.
        if l1 > compression.reconstruction_bound(e) + BOUND_TOL:
            violations.append(f"worker {i}: ‖p̂ − p‖₁ = {l1:.6f} > 2ε = {2 * e:.6f}")
    bias_bound = compression.aggregation_bias_bound(w, eps)
    bias_upper = None
    if all(x is not None for x in reported):
        bias_upper = float(sum(wi * float(x) for wi, x in zip(w, reported, strict=True)))  # type: ignore[arg-type]
        if bias_upper > bias_bound + BOUND_TOL:
            violations.append(f"Σ w‖p̂ − p‖₁ = {bias_upper:.6f} > 2Σwε = {bias_bound:.6f}")
    return PositionMeasure(eps, reported, bias_bound, bias_upper, violations)


def decide(
    replies: Sequence[FederatedReply],
    weights: npt.ArrayLike,
    draft: Sequence[int],
    q_rows: Sequence[Probs],
    *,
    vocab_size: int,
    greedy: bool,
    rng: np.random.Generator,
    how: str = compression.RENORMALISED,
    want_bonus: bool = True,
) -> FederatedDecision:
    """Verify one batch against the weighted aggregate of the workers that replied.

    replies: one per worker (same batch), each with γ+1 sparse rows and γ exact scalars.
    weights: [M] positive (renormalised here: missing workers are simply left out).
    q_rows: [γ][V] the distributions the draft tokens were drawn from.
    """
    if not replies:
        raise ValueError("no worker replied")
    gamma = len(draft)
    for r in replies:
        if len(r.dists) != gamma + 1 or len(r.p_draft) != gamma:
            raise ValueError(f"a reply covers {len(r.p_draft)} draft tokens, the batch {gamma}")
    w = compression.normalise_weights(weights)
    measures: list[PositionMeasure] = []
    for j in range(gamma):
        measures.append(measure_position(replies, w, j, how))
        x = int(draft[j])
        if greedy:
            p_hat = aggregate_reconstruction(replies, w, j, vocab_size, how)
            ok = int(np.argmax(p_hat)) == x
        else:
            p_bar_x = float(sum(wi * float(r.p_draft[j]) for wi, r in zip(w, replies, strict=True)))
            ok = accept(p_bar_x, float(q_rows[j][x]), float(rng.random()))
        if ok:
            continue
        p_hat = aggregate_reconstruction(replies, w, j, vocab_size, how)
        token = int(np.argmax(p_hat)) if greedy else sample(residual(p_hat, q_rows[j]), rng)
        return FederatedDecision(j, token, True, measures)
    if not want_bonus:
        return FederatedDecision(gamma, None, False, measures)
    measures.append(measure_position(replies, w, gamma, how))
    p_hat = aggregate_reconstruction(replies, w, gamma, vocab_size, how)
    token = int(np.argmax(p_hat)) if greedy else sample(p_hat, rng)
    return FederatedDecision(gamma, token, False, measures)
