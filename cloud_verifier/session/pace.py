"""What each session is owed: the operator's service level (a rate of tokens per second), how
far below it a session is, and the weight the scheduler gives its work for it. Pure: no clock
(the session's core measures, with the ``now`` it is given), no torch.

**The rule.** A session owed r* tokens/s that has attained r (tokens committed since its first
round, over the seconds since then) weighs w = clamp((r*/r)², 1/4, 4): a session at pace
weighs 1, one at half its rate 4 (the most), one at twice its rate 1/4. The scheduler
(:mod:`cloud_verifier.engine.scheduler`) ranks every speculative slot of a step by its
survival times its session's weight, and prices slots against the step's weighted yield
(:func:`~cloud_verifier.engine.rationing.ration`): a step's room goes first to the sessions
furthest below their rate, then to the rest by survival. A session that has committed nothing
yet (its first token is due) weighs the most. One rule for every kind of session: an edge's
rounds, co-generation, a cloud draft, a cloud-only session's credits.

**No session starves.** A round whose batches the ration deferred
:data:`~cloud_verifier.engine.work.DEFER_BOUND` steps in a row is served whole in the next (its
weight the most, its draft promised), so no session's work waits more than that many steps
behind others. The bounds (:data:`~cloud_verifier.engine.work.MIN_WEIGHT`,
:data:`~cloud_verifier.engine.work.MAX_WEIGHT`, ``DEFER_BOUND``) are in the work a session asks
for, which the scheduler reads.

**Exactness.** The weight moves which work runs in a step and how much of a draft is verified,
from the session's timing and draft-side information only: never from the target's randomness
or the drafted tokens' values. Like rationing, it changes timing, never a decision's law.
"""

from __future__ import annotations

from dataclasses import dataclass

from cloud_verifier.engine.work import MAX_WEIGHT, MIN_WEIGHT


def pace_weight(attained: float, owed: float) -> float:
    """The weight of a session that has attained ``attained`` tokens/s where it is owed
    ``owed`` (module docstring); 1 with no service level (``owed`` ≤ 0)."""
    if owed <= 0.0:
        return 1.0
    if attained <= 0.0:
        return MAX_WEIGHT
    return min(MAX_WEIGHT, max(MIN_WEIGHT, (owed / attained) ** 2))


@dataclass
class PaceMeter:
    """One session's attained rate: the text's length and the time at its first round (the
    prompt's end, when the first Propose or credit came), and the rate since. Owned by the
    session's core, which feeds it ``now`` and the text's length."""

    owed: float
    started_at: float | None = None
    base: int = 0

    def start(self, now: float, length: int) -> None:
        """The session's first round came at ``now``, its text ``length`` long (the prompt)."""
        if self.started_at is None:
            self.started_at, self.base = now, length

    def attained(self, now: float, length: int) -> float:
        """Tokens per second committed since the first round, the text now ``length`` long."""
        if self.started_at is None:
            return 0.0
        return max(0, length - self.base) / max(1e-3, now - self.started_at)

    def weight(self, now: float, length: int) -> float:
        """The session's weight now (:func:`pace_weight`)."""
        return pace_weight(self.attained(now, length), self.owed)
