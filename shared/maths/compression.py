"""Sparse top-K compression of a distribution, its reconstructions, aggregation and their bounds.

A verifier sends the K most likely ids of p with their exact probabilities (a
:class:`SparseDist`); ε = 1 − Σ kept is the mass it leaves out. The receiver
rebuilds a full distribution p̂ one of two ways (SpecFed):

* **A, renormalised**: p̂ = p / (1 − ε) on the kept ids, 0 elsewhere. ‖p̂ − p‖₁ = 2ε exactly.
* **B, residual redistribution**: kept values as they are, ε spread uniformly over the |V| − K
  other ids. ‖p̂ − p‖₁ <= 2ε.

For M verifiers with weights w_i (Σ w_i = 1) the aggregate is p̄ = Σ w_i p̂_i and the
aggregation bias ‖p̂̄ − p̄‖₁ <= Σ w_i ‖p̂_i − p_i‖₁ <= 2 Σ w_i ε_i (triangle inequality). Since the
acceptance rate is α = 1 − ½‖p − q‖₁, the change it suffers from using p̂̄ is
|Δα| <= ½ ‖p̂̄ − p̄‖₁ <= Σ w_i ε_i (the published eq. 19 states Δα <= Δ; half of it is right).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from shared.enums import TextEnum

Probs = npt.NDArray[np.float64]
#: Token ids, and probabilities as the wire carries them (float32).
IdArray = npt.NDArray[np.int64]
ProbArray = npt.NDArray[np.float32]


@dataclass(frozen=True)
class SparseDist:
    """Top-K of a distribution: ``ids`` in decreasing probability, ``probs`` their exact values."""

    ids: IdArray  # [K]
    probs: ProbArray  # [K]

    @property
    def eps(self) -> float:
        """ε: the probability mass outside the kept entries."""
        return max(0.0, 1.0 - float(np.sum(self.probs, dtype=np.float64)))


class Reconstruction(TextEnum):
    """How a sparse top-K becomes a full distribution (module docstring): A or B."""

    RENORMALISED = "A"
    REDISTRIBUTED = "B"


RENORMALISED: Final = Reconstruction.RENORMALISED
REDISTRIBUTED: Final = Reconstruction.REDISTRIBUTED
RECONSTRUCTIONS: Final = tuple(Reconstruction)


def top_k(p: npt.ArrayLike, k: int) -> SparseDist:
    """The k most likely ids of p ([V]) with their probabilities, in decreasing order.

    Zero-probability ids are never sent (so K can be smaller than k after top-k/top-p filtering).
    """
    pa = np.asarray(p, dtype=np.float64)
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    k = min(k, int(pa.shape[-1]))
    idx = np.argpartition(-pa, k - 1)[:k] if k < pa.shape[-1] else np.arange(pa.shape[-1])
    idx = idx[np.argsort(-pa[idx], kind="stable")]
    idx = idx[pa[idx] > 0.0]
    return SparseDist(idx.astype(np.int64), pa[idx].astype(np.float32))


def adaptive_k(p: npt.ArrayLike, eps_target: float, k_max: int) -> int:
    """Smallest K whose kept mass is >= 1 − eps_target, capped at k_max. p: [V]."""
    if not 0.0 <= eps_target < 1.0:
        raise ValueError(f"eps_target must be in [0, 1), got {eps_target}")
    pa = np.sort(np.asarray(p, dtype=np.float64))[::-1]
    cum = np.cumsum(pa)
    k = int(np.searchsorted(cum, 1.0 - eps_target - 1e-12, side="left")) + 1
    return max(1, min(k, k_max, int(pa.shape[0])))


def compress(p: npt.ArrayLike, k: int, eps_target: float = 0.0) -> SparseDist:
    """Fixed top-k (eps_target = 0) or adaptive K (eps_target > 0, k the cap)."""
    if eps_target > 0.0:
        k = adaptive_k(p, eps_target, k)
    return top_k(p, k)


def reconstruct(d: SparseDist, vocab_size: int, how: Reconstruction | str = RENORMALISED) -> Probs:
    """Full [V] distribution from a sparse one, reconstruction A or B (module docstring)."""
    out = np.zeros(vocab_size, dtype=np.float64)
    kept = d.probs.astype(np.float64)
    mass = float(kept.sum())
    if mass <= 0.0:
        raise ValueError("sparse distribution has no mass")
    if how == RENORMALISED:
        out[d.ids] = kept / mass
    elif how == REDISTRIBUTED:
        out[d.ids] = kept
        rest = vocab_size - len(d.ids)
        eps = max(0.0, 1.0 - mass)
        if rest > 0:
            others = np.ones(vocab_size, dtype=bool)
            others[d.ids] = False
            out[others] = eps / rest
        out /= out.sum()  # only float32 rounding of the kept values is corrected here
    else:
        raise ValueError(f"reconstruction must be one of {RECONSTRUCTIONS}, got {how!r}")
    return out


def aggregate(dists: npt.ArrayLike, weights: npt.ArrayLike) -> Probs:
    """p̄ = Σ w_i p_i. dists: [M, V]; weights: [M], positive, normalised here."""
    d = np.asarray(dists, dtype=np.float64)
    w = normalise_weights(weights)
    if d.ndim != 2 or d.shape[0] != w.shape[0]:
        raise ValueError(f"dists {d.shape} do not match {w.shape[0]} weights")
    out: Probs = w @ d
    return out


def normalise_weights(weights: npt.ArrayLike) -> Probs:
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"weights must be positive and finite, got {w.tolist()}")
    out: Probs = w / w.sum()
    return out


# ------------------------------------------------------------------------------------------
# Bounds, as functions (measured against on every round, never assumed)
# ------------------------------------------------------------------------------------------


def l1(a: npt.ArrayLike, b: npt.ArrayLike) -> float:
    """‖a − b‖₁."""
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).sum())


def reconstruction_bound(eps: float) -> float:
    """‖p̂ − p‖₁ <= 2ε for both reconstructions (equality for A)."""
    return 2.0 * eps


def aggregation_bias_bound(weights: Sequence[float] | npt.ArrayLike, eps: npt.ArrayLike) -> float:
    """‖p̂̄ − p̄‖₁ <= 2 Σ w_i ε_i."""
    return 2.0 * float(normalise_weights(weights) @ np.asarray(eps, np.float64))


def acceptance_change_bound(weights: Sequence[float] | npt.ArrayLike, eps: npt.ArrayLike) -> float:
    """|α(p̂̄, q) − α(p̄, q)| <= ½ ‖p̂̄ − p̄‖₁ <= Σ w_i ε_i."""
    return 0.5 * aggregation_bias_bound(weights, eps)


def lossy_correction_tv_bound(eps: float) -> float:
    """TV between the emitted and the target distribution of one speculative step whose
    correction is drawn from norm(max(0, p̂ − q)) instead of norm(max(0, p − q)).

    Emitted = min(p, q) + β·a/|a| with a = max(0, p̂ − q), b = max(0, p − q), β = |b|, so
    ‖emitted − p‖₁ = ‖β a/|a| − b‖₁ <= ||b| − |a|| + ‖a − b‖₁ <= 2‖a − b‖₁ <= 2‖p̂ − p‖₁ = 4ε,
    i.e. TV <= 2ε.
    """
    return 2.0 * eps
