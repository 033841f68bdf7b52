"""One session's measured acceptance of its draft tokens, and what both ends read from it:
on the verifier, the survival estimates that rationing ranks draft slots by
(:mod:`cloud_verifier.engine.rationing`) and what a token tree's branches are expected to add
(what the scheduler prices a tree by); on the edge, how likely each outcome of a batch in
flight is (:mod:`edge_agent.session.branch_plan`: where a branch is drafted). Pure.

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
#: The prior share of a session's rejections at a branched position that open a branch.
_PRIOR_OPEN: Final = 0.5


class Acceptance:
    """One session's measured acceptance of its draft tokens (decayed counts with a prior),
    owned by its :class:`~cloud_verifier.session.core.VerifierCore` (and, on the edge, by its
    :class:`~edge_agent.session.branches.BranchBook`): α and q̄ of the module docstring."""

    def __init__(self) -> None:
        self._reached = _PRIOR_COUNT
        self._accepted = _PRIOR_ALPHA * _PRIOR_COUNT
        self._q_sum = _PRIOR_ALPHA * _PRIOR_COUNT  # q of reached tokens (prior: q̄ = α, â(q) = q)
        # rejections where a branch forked (tree or hedge), and those a branch opened
        self._branched = _PRIOR_COUNT
        self._opened = _PRIOR_OPEN * _PRIOR_COUNT

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

    def observe_branches(self, opened: bool) -> None:
        """A rejection at a position where a branch of the edge's forked: whether the
        recovered token opened one (a tree branch taken, or a hedge that matched)."""
        self._branched = _DECAY * self._branched + 1.0
        self._opened = _DECAY * self._opened + float(opened)

    @property
    def open_rate(self) -> float:
        """The share of rejections at a branched position whose correction opens a branch."""
        return self._opened / self._branched

    def tree_value(self, q: Sequence[float], branches: Sequence[tuple[int, int]]) -> float:
        """The tokens a tree's branches are expected to add to a round whose draft tokens have
        probabilities ``q``: each branch, forking at draft index ``at`` with ``n`` draft
        tokens after its own, opens when the chain reaches ``at`` and rejects there and the
        correction is its token (the session's :attr:`open_rate` of such rejections), and then
        commits its token and the accepted prefix of its draft (each accepted at â of an
        average token). Reads the draft's probabilities only, never the target's."""
        reach, reached = 1.0, []
        for qi in q:
            reached.append(reach)
            reach *= self.token(float(qi))
        a = self.token(self.q_mean)
        value = 0.0
        for at, n in branches:
            if not 0 <= at < len(q):
                continue
            rejected = reached[at] * (1.0 - self.token(float(q[at])))
            value += rejected * self.open_rate * (1.0 + sum(a ** (j + 1) for j in range(n)))
        return value
