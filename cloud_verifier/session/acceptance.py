"""One session's measured acceptance of its draft tokens and the survival estimates that
rationing ranks draft slots by (:mod:`cloud_verifier.engine.rationing`). Pure.

Slot i of a round's draft (0-based, token x_i) is worth s_i, the estimated probability that it
is reached and accepted: s_i = α · Π_{j<i} â(q_j), with α the session's measured acceptance
of its draft tokens and â(q) = α·q/q̄ the acceptance of a token the draft gave probability q,
q̄ the session's mean q over the tokens it had verified (the draft's own confidence, corrected
by the session's measured acceptance). s_i reads the draft's probabilities of the tokens
*before* x_i only, never q_i: whether x_i is verified must not depend on x_i itself (a rule
"verify x_i only if q(x_i) is high" selects which x_i are verified and breaks the law;
docs/how-it-works/exactness.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

#: Bounds on â(q): no token is taken as certain or as hopeless.
_A_MIN: Final = 0.02
_A_MAX: Final = 0.98
#: Acceptance counts decay by this per verified round (they remember ~50 rounds).
_DECAY: Final = 0.98
_PRIOR_ALPHA: Final = 0.7
_PRIOR_COUNT: Final = 4.0


class Acceptance:
    """One session's measured acceptance of its draft tokens (decayed counts with a prior),
    owned by its :class:`~cloud_verifier.session.core.VerifierCore`: α and q̄ of the module
    docstring."""

    def __init__(self) -> None:
        self._reached = _PRIOR_COUNT
        self._accepted = _PRIOR_ALPHA * _PRIOR_COUNT
        self._q_sum = _PRIOR_ALPHA * _PRIOR_COUNT  # q of reached tokens (prior: q̄ = α, â(q) = q)

    def observe(self, q: Sequence[float], accepted: int) -> None:
        """A round's decision: draft tokens with probabilities ``q`` were verified, the first
        ``accepted`` accepted (the next one, if any, rejected; the rest not reached)."""
        reached = min(len(q), accepted + 1)
        if reached == 0:
            return
        self._reached = _DECAY * self._reached + reached
        self._accepted = _DECAY * self._accepted + min(accepted, reached)
        self._q_sum = _DECAY * self._q_sum + float(sum(q[:reached]))

    @property
    def alpha(self) -> float:
        return self._accepted / self._reached

    @property
    def q_mean(self) -> float:
        return max(1e-6, self._q_sum / self._reached)

    def token(self, q: float) -> float:
        """â(q): the estimated acceptance of a draft token of probability ``q``."""
        return min(_A_MAX, max(_A_MIN, self.alpha * q / self.q_mean))

    def survival(self, q: Sequence[float]) -> tuple[float, ...]:
        """s_0..s_{γ-1} of a draft whose tokens have probabilities ``q`` (module docstring):
        s_i reads q_0..q_{i-1}, never q_i."""
        out: list[float] = []
        reach = 1.0
        for qi in q:
            out.append(reach * self.alpha)
            reach *= self.token(float(qi))
        return tuple(out)
