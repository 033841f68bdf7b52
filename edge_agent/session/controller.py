"""Online choice of the draft length γ and the pipeline depth D of one edge generation.

Pure: no I/O, no clock, no asyncio. The edge reports what it measured (seconds per draft token,
send → verdict latency of each batch, how many drafts each verdict accepted) and reads back
``gamma`` and ``depth``; tests drive it with made-up numbers.

**Model.** Notation: γ drafts per batch, D batches in flight at most, t_d seconds per draft
token, L seconds from sending a batch to receiving its verdict (RTT + verify time T_v +
queueing), a_i the probability that draft position i (1-based) is accepted given that positions
1..i-1 were, and P_i = a_1 ⋯ a_i (position i accepted). Per batch:

* expected committed tokens E(γ) = Σ_{i=1..γ} P_i + (1 − P_γ) (the recovered token of a
  rejection; a pipelined batch accepted in full gets no bonus);
* rejection probability r(γ) = 1 − P_γ;
* while batches are accepted a verdict arrives every flow = max(γ·t_d, L/D, T_v) seconds (the
  edge's drafting, the pipe's latency spread over D batches, or the verifier is the bottleneck);
* a rejection invalidates everything in flight: the pipe refills in refill = γ·t_d + L;
* with co-generation (``cogen``) the verifier, having no valid draft queued, decodes alone during
  the refill at one token per T_v: extra = max(0, refill − T_v) / T_v tokens per rejection.

throughput(γ, D) = (E + r·extra) / ((1 − r)·flow + r·refill) tokens/s.

**Estimates.** Acceptance: exponentially decayed counts (× ``_DECAY`` per verdict) of "reached
position i" R_i and "accepted position i" A_i, with a two-level Beta prior. The pooled mean
ā = (ΣA + 2·0.7) / (ΣR + 2) (prior mean 0.7, 2 pseudo counts) is the prior mean of every
position: a_i = (A_i + k·ā) / (R_i + k), k = 20, the steady decayed count of a position reached
every verdict, so a position's own rate and the pooled rate weigh equally. (Per-position rates
from ~20 verdicts are noisy and E(γ) multiplies them; conditional acceptance is roughly flat in
the position, so pooling costs little bias.) A position never reached (beyond the γ used so
far) gets ā, the mean acceptance of the observed ones: geometric extrapolation, so γ can grow.

t_d and L: medians of the last ``_WINDOW`` samples (robust to one slow step or a
retransmission). T_v is not observable from the edge (only L = RTT + T_v + queueing is): we take
T_v, the verifier's time per batch, is measured as the mean gap between consecutive verdicts
of batches that were in flight together (the verifier had the second queued when it answered the
first, so the gap is its service time; coalesced batches make it smaller, as they should).
Until ``_MIN_SERVICE`` such gaps exist, T_v = ``_TV_FRACTION`` × min(L over the window), floored
at ``_MIN_TV_S``. It bounds the flow term (an underestimate makes short batches look free: the
model then picks a small γ that the verifier's per-forward cost punishes) and sets the
co-generation rate.

**Choice.** After ``warmup_rounds`` verdicts (and once t_d and L are measured), every verdict
evaluates the model over γ ∈ 1..max_gamma (γ0 only when not adapting) × D ∈ 1..max_depth (D0
only); among candidates within ``_TIE`` of the best, the largest D then the smallest γ wins (a
deeper pipe lets the verifier coalesce queued Proposes, which the model leaves out; a longer
batch the model says buys nothing is not taken); the controller switches only if that beats
the current setting by more than
``hysteresis``.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

_DECAY = 0.95  # per verdict: the acceptance counts remember ~20 verdicts
_PRIOR_MEAN = 0.7
_PRIOR_STRENGTH = 2.0  # pseudo counts, Beta(1.4, 0.6) at the pooled level
_POS_STRENGTH = 20.0  # pseudo counts pulling each a_i towards the pooled mean (see module doc)
_FREE_WEIGHT = 0.5  # weight of a co-generation match (see on_free_accept)
_WINDOW = 15  # samples in the t_d and L medians
_TV_FRACTION = 0.25
_MIN_SERVICE = 3  # service-time samples before they replace the latency-based guess
_MIN_TV_S = 1e-3
_TIE = 0.01  # candidates within 1 % of the best are near-ties
_EPS_S = 1e-9


@dataclass(frozen=True)
class ControllerLimits:
    gamma0: int = 4  # starting γ (also the fixed γ when adapt_gamma is False)
    depth0: int = 2  # starting D (also the fixed D when adapt_depth is False)
    max_gamma: int = 12
    max_depth: int = 8
    adapt_gamma: bool = True
    adapt_depth: bool = True
    cogen: bool = True
    hysteresis: float = 0.05  # switch only when the predicted gain exceeds 5 %
    warmup_rounds: int = 4  # verdicts before the first change
    cut_min_prob: float = 0.3  # early cut threshold (see Controller.should_cut), 0 = never cut

    def __post_init__(self) -> None:
        for name in ("gamma0", "depth0", "max_gamma", "max_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.hysteresis >= 0.0:
            raise ValueError(f"hysteresis must be >= 0, got {self.hysteresis}")
        if self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {self.warmup_rounds}")
        if not 0.0 <= self.cut_min_prob <= 1.0:
            raise ValueError(f"cut_min_prob must be in [0, 1], got {self.cut_min_prob}")


def model_throughput(
    acceptance: list[float],
    gamma: int,
    depth: int,
    draft_s: float,
    latency_s: float,
    verify_s: float,
    cogen: bool,
) -> float:
    """Tokens/s of the module docstring's model; ``acceptance`` holds a_1..a_n, n ≥ gamma."""
    p = 1.0  # P_i, the probability that positions 1..i are all accepted
    expected = 0.0
    for a in acceptance[:gamma]:
        p *= a
        expected += p
    reject = 1.0 - p
    expected += reject  # the recovered token of a rejection
    flow = max(gamma * draft_s, latency_s / depth, verify_s)
    refill = gamma * draft_s + latency_s
    if cogen and verify_s > 0.0:
        expected += reject * max(0.0, refill - verify_s) / verify_s
    return expected / max((1.0 - reject) * flow + reject * refill, _EPS_S)


class Controller:
    """Picks γ (``gamma``) and D (``depth``) from the edge's measurements; see the module doc."""

    def __init__(self, limits: ControllerLimits) -> None:
        self.limits = limits
        # Start values are clamped to the bounds only when adapting: a fixed γ0 may exceed them.
        self.gamma = min(limits.gamma0, limits.max_gamma) if limits.adapt_gamma else limits.gamma0
        self.depth = min(limits.depth0, limits.max_depth) if limits.adapt_depth else limits.depth0
        self._n = max(limits.max_gamma, self.gamma)  # positions tracked: a_1..a_n
        self._reached = [0.0] * self._n  # R_i (decayed); invariant: A_i <= R_i
        self._accepted = [0.0] * self._n  # A_i (decayed)
        self._draft_s: deque[float] = deque(maxlen=_WINDOW)
        self._latency_s: deque[float] = deque(maxlen=_WINDOW)
        self._service_s: deque[float] = deque(maxlen=_WINDOW)
        self.verdicts = 0
        self.changes = 0  # how many times (γ, D) was switched

    # -- measurements ---------------------------------------------------------------------

    def on_draft_step(self, seconds: float) -> None:
        """One draft token took ``seconds`` (NaN / negative samples are ignored)."""
        if seconds >= 0.0 and math.isfinite(seconds):
            self._draft_s.append(seconds)

    def on_verdict(self, gamma: int, accepted: int, latency_s: float) -> None:
        """A batch of ``gamma`` drafts got its verdict: ``accepted`` of them accepted
        (accepted < gamma: rejected at position accepted + 1), ``latency_s`` after it was sent.
        Updates the estimates, then (after warmup) re-chooses γ and D with hysteresis."""
        if gamma < 1 or not 0 <= accepted <= gamma:
            raise ValueError(f"bad verdict: gamma={gamma}, accepted={accepted}")
        for i in range(self._n):
            self._reached[i] *= _DECAY
            self._accepted[i] *= _DECAY
        # Positions 1..accepted were reached and accepted; position accepted+1 (if drafted)
        # was reached and rejected; later ones were never judged.
        self._count(min(accepted, self._n), min(accepted + 1, gamma, self._n), 1.0)
        if latency_s >= 0.0 and math.isfinite(latency_s):
            self._latency_s.append(latency_s)
        self.verdicts += 1
        if self.verdicts >= self.limits.warmup_rounds and self._measured():
            self._choose()

    def on_free_accept(self, n: int) -> None:
        """``n`` drafts matched tokens the verifier co-generated (accepted with no model work).

        They are acceptance evidence (the draft predicted the target), counted as positions
        1..n reached and accepted, but at half weight: the mismatch that ended the match (if
        any) is not reported, so these are successes without their failure and would bias the
        estimate upwards at full weight. No decay step: decay ticks per verdict."""
        if n > 0:
            k = min(n, self._n)
            self._count(k, k, _FREE_WEIGHT)

    def _count(self, accepted: int, reached: int, weight: float) -> None:
        for i in range(reached):
            self._reached[i] += weight
        for i in range(accepted):
            self._accepted[i] += weight

    # -- estimates and model --------------------------------------------------------------

    def _measured(self) -> bool:
        return bool(self._draft_s) and bool(self._latency_s)

    def acceptance(self) -> list[float]:
        """Current estimates a_1..a_n (n = max(max_gamma, fixed γ0)), each in (0, 1)."""
        k = _PRIOR_STRENGTH
        pooled = (sum(self._accepted) + k * _PRIOR_MEAN) / (sum(self._reached) + k)
        pairs = zip(self._accepted, self._reached, strict=True)
        return [(a + _POS_STRENGTH * pooled) / (r + _POS_STRENGTH) for a, r in pairs]

    def draft_s(self) -> float:
        return statistics.median(self._draft_s) if self._draft_s else 0.0

    def latency_s(self) -> float:
        return statistics.median(self._latency_s) if self._latency_s else 0.0

    def on_service(self, seconds: float) -> None:
        """A gap between the verdicts of two batches that were in flight together: one
        sample of the verifier's time per batch."""
        if seconds >= 0.0 and math.isfinite(seconds):
            self._service_s.append(seconds)

    def verify_s(self) -> float:
        """T_v: the mean measured service gap, else a fraction of the smallest recent latency
        (see the module doc)."""
        if len(self._service_s) >= _MIN_SERVICE:
            return max(statistics.fmean(self._service_s), _MIN_TV_S)
        return max(_TV_FRACTION * min(self._latency_s), _MIN_TV_S) if self._latency_s else 0.0

    def predict(self, gamma: int, depth: int) -> float:
        """Model tokens/s at (γ, D) with the current estimates; 0.0 before t_d and L exist."""
        return self._scorer()(gamma, depth) if self._measured() else 0.0

    def _scorer(self) -> Callable[[int, int], float]:
        """The model at the current estimates (computed once, then evaluated per candidate)."""
        acc, draft, latency = self.acceptance(), self.draft_s(), self.latency_s()
        verify, cogen = self.verify_s(), self.limits.cogen
        return lambda g, d: model_throughput(acc, g, d, draft, latency, verify, cogen)

    def _choose(self) -> None:
        lim = self.limits
        score = self._scorer()
        gammas = range(1, lim.max_gamma + 1) if lim.adapt_gamma else [self.gamma]
        depths = range(1, lim.max_depth + 1) if lim.adapt_depth else [self.depth]
        scored = [(score(g, d), d, g) for g in gammas for d in depths]
        best = max(s for s, _, _ in scored)
        # Near-ties: the largest D, then the smallest γ. A deeper pipe costs only edge drafts
        # that a rejection may discard, and buys what the model leaves out: a verifier with
        # several Proposes queued coalesces them into one forward (measured: γ = 4, D = 4 beat
        # D = 2 by 1.2–1.4× at RTT 0, where the model ties them).
        value, depth, gamma = min(
            (t for t in scored if t[0] >= best * (1.0 - _TIE)), key=lambda t: (-t[1], t[2])
        )
        current = score(self.gamma, self.depth)
        if (gamma, depth) != (self.gamma, self.depth) and value > current * (1 + lim.hysteresis):
            self.gamma, self.depth = gamma, depth
            self.changes += 1

    # -- early cut and stats --------------------------------------------------------------

    def should_cut(self, position: int, prob: float) -> bool:
        """End the current batch after the token just drafted at 1-based ``position``, which
        the draft gave probability ``prob``? Yes when the draft is unsure (prob < cut_min_prob):
        the token is likely rejected, and drafting past it likely wasted. Only when γ adapts
        (a fixed γ is a promise), and never at or past γ (the batch ends there anyway)."""
        lim = self.limits
        return (
            lim.adapt_gamma
            and lim.cut_min_prob > 0.0
            and 1 <= position < self.gamma
            and prob < lim.cut_min_prob
        )

    def snapshot(self) -> dict[str, float | int | list[float]]:
        """Estimates for stats and logs."""
        return {
            "gamma": self.gamma,
            "depth": self.depth,
            "verdicts": self.verdicts,
            "changes": self.changes,
            "draft_s": self.draft_s(),
            "latency_s": self.latency_s(),
            "verify_s": self.verify_s(),
            "predicted_tps": self.predict(self.gamma, self.depth),
            "acceptance": self.acceptance(),
        }
