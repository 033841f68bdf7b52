"""The sampling transform and the draws that every speculative step makes.

p (target) and q (draft) are distributions *after* the request's sampling transform: temperature,
then top-k, then top-p (nucleus), the order transformers' generate() uses. Exactness needs the
*same* transform on both sides; :func:`transform` is that one function.

Everything works on numpy arrays on the CPU; probabilities are float64 internally so that
normalisation errors stay far below anything a statistical test could see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Probs = npt.NDArray[np.float64]

#: The smallest positive temperature: logits / T must stay finite in float64 (at 5e-324 every
#: logit becomes infinite and the transform a distribution with no mass). At 1e-4 sampling is
#: already the argmax for any logit gap above 0.01 (odds below e^-100); 0 is greedy.
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling parameters, which :func:`transform` applies (the wire's Hello
    carries them, and every part checks them). Temperature 0 means greedy (argmax), else at
    least :data:`MIN_TEMPERATURE`. top_k 0 and top_p 1 disable those filters."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {self.temperature}"
            )
        if isinstance(self.top_k, bool) or not 0 <= self.top_k <= 2**24:
            raise ValueError(f"top_k must be an integer in [0, 2**24], got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def transform(logits: npt.ArrayLike, params: SamplingParams) -> Probs:
    """Logits → sampling distribution.

    logits: [..., V] (any float dtype). Returns float64 probabilities [..., V], each row summing
    to 1. Greedy returns the one-hot of the first argmax (ties go to the lowest id, on both sides).
    """
    x = np.asarray(logits, dtype=np.float64)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError("logits must have a non-empty last axis")
    if params.greedy:
        onehot = np.zeros_like(x)
        np.put_along_axis(onehot, np.argmax(x, axis=-1)[..., None], 1.0, axis=-1)
        return onehot
    x = x / params.temperature
    v = x.shape[-1]
    if 0 < params.top_k < v:
        # Keep every logit >= the k-th largest (ties at the threshold are kept, as in HF).
        kth = np.partition(x, v - params.top_k, axis=-1)[..., v - params.top_k, None]
        x = np.where(x < kth, -np.inf, x)
    x = x - np.max(x, axis=-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        # Nucleus: drop the least likely ids whose cumulative mass (ascending) is <= 1 − top_p;
        # the most likely id always survives.
        order = np.argsort(p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        cum = np.cumsum(sorted_p, axis=-1)
        drop_sorted = cum <= 1.0 - params.top_p
        drop_sorted[..., -1] = False
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        p = np.where(drop, 0.0, p)
        p /= p.sum(axis=-1, keepdims=True)
    out: Probs = p
    return out


def sample(probs: npt.ArrayLike, rng: np.random.Generator) -> int:
    """Draw one id from a distribution. probs: [V], non-negative, positive sum."""
    p = np.asarray(probs, dtype=np.float64)
    cum = np.cumsum(p)
    total = cum[-1]
    if not (total > 0 and math.isfinite(total)):
        raise ValueError("cannot sample from a distribution with no mass")
    i = int(np.searchsorted(cum, rng.random() * total, side="right"))
    # searchsorted can land past the last positive entry only through rounding; step back.
    i = min(i, len(p) - 1)
    while p[i] <= 0.0:
        i -= 1
    return i


def accept(p_x: float, q_x: float, u: float) -> bool:
    """Accept the draft token x with probability min(1, p(x)/q(x)), u ~ U[0, 1).

    q(x) >= p(x): accept with probability p/q. q(x) < p(x): always accept.
    """
    return u * q_x < p_x


def residual(p: npt.ArrayLike, q: npt.ArrayLike) -> Probs:
    """The recovered-token distribution norm(max(0, p − q)). p, q: [V].

    When p == q there is no residual mass; a rejection cannot happen then, and p is returned.
    """
    pa = np.asarray(p, dtype=np.float64)
    r = np.maximum(pa - np.asarray(q, dtype=np.float64), 0.0)
    s = r.sum()
    out: Probs = r / s if s > 0 else pa / pa.sum()
    return out


def acceptance_rate(p: npt.ArrayLike, q: npt.ArrayLike) -> float:
    """α = Σ min(p, q) = 1 − TV(p, q): the probability that one draft token is accepted."""
    return float(np.minimum(np.asarray(p, np.float64), np.asarray(q, np.float64)).sum())


def total_variation(a: npt.ArrayLike, b: npt.ArrayLike) -> float:
    """TV(a, b) = ½ ‖a − b‖₁."""
    return 0.5 * float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).sum())
