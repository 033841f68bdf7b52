"""Rationing speculation: which draft tokens a loaded step verifies, and how many tokens ahead
each session is told to draft. Pure: no torch, no clock (the scheduler calls it with the
engine's measured step cost).

**Survival.** Slot i of a round's draft (0-based, token x_i) is worth s_i, the estimated
probability that it is reached and accepted, which the session's core sends with its Verify
(:class:`~cloud_verifier.session.acceptance.Acceptance`): it reads the draft's probabilities
of the tokens before x_i only, never q_i, and is non-increasing in i, so ranking by s cuts a
round's tail, never its middle.

**Price.** A step of n tokens costs a + b·n (:class:`~cloud_verifier.engine.step_times.
StepTimes`) and commits E tokens in expectation: per round 1 (its recovered or bonus token)
plus the survival of every slot it verifies. Adding a slot of survival s raises E/(a + b·n)
iff s > E/(a/b + n) =: the *price* (tokens committed per token of step cost). :func:`ration`
takes the rounds' mandatory part (their fixed tokens, the scoring row and their first draft
slot) and the step's other work (prefill chunks, co-generations) as given, then adds slots in
order of survival while each pays its price and the step has room: a step much cheaper than
its overhead (an idle verifier on a GPU) verifies whole drafts; a loaded one cuts the tails
that would probably be rejected.

**Budget.** What a session is told (Verdict.budget): the draft tokens ahead of its committed
text the verifier expects to verify at the current price: the slots its round kept, plus the
further slots a longer draft would have had above the price (its last kept survival times â
of an average token, repeated), at most :data:`MAX_AHEAD` (no bound to speak of).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from cloud_verifier.engine.work import CoGenerate, Verify, Work
from shared.wire.messages import MAX_BUDGET

#: The budget that means "draft as you like": the protocol's bound on it.
MAX_AHEAD: Final = MAX_BUDGET
#: The survival rate assumed for a cloud draft token whose session has measured none.
COGEN_ALPHA: Final = 0.7


def survival_of(work: Work) -> tuple[tuple[float, ...], float]:
    """What the ration ranks ``work``'s draft slots by: each slot's survival and â of an
    average token of its session; ((), 0.0) for work whose draft is never cut. A Verify's come
    from its session's core (none for a tree row); a co-generation's own (deterministic) draft
    survives each token at its session's measured α (any rule keeps a point-mass draft's law:
    nothing about the token is random given the text)."""
    if isinstance(work, Verify):
        if not work.branches and len(work.survival) == len(work.draft) > 0:
            return work.survival, work.mean_token
        return (), 0.0
    if isinstance(work, CoGenerate) and work.cloud:
        a = work.model_alpha if work.model_alpha is not None else COGEN_ALPHA
        n = max(len(work.draft), work.model_tokens)
        return tuple(a ** (i + 1) for i in range(n)), a
    return (), 0.0


@dataclass(frozen=True)
class Round:
    """A round as :func:`ration` sees it: ``key`` names it, ``base`` its mandatory tokens
    (fixed tokens, the scoring row, the first draft slot), ``survival`` its slots' s_i."""

    key: int
    base: int
    survival: tuple[float, ...]


@dataclass(frozen=True)
class Ration:
    """What :func:`ration` decided: draft tokens kept per round key, and the step's price
    (0: nothing was priced, every draft whole)."""

    keep: Mapping[int, int]
    price: float

    def budget(self, r: Round, mean_token: float) -> int:
        """Round ``r``'s session's draft budget (module docstring). ``mean_token``: â of an
        average draft token of that session (its α: q = q̄)."""
        return ahead(self.price, r.survival, self.keep.get(r.key, len(r.survival)), mean_token)


def own_budget(price: float, survival: Sequence[float], mean_token: float) -> int:
    """The budget of a verifier's own draft (co-generation), not cut in this step: the slots
    above ``price`` are what it would have kept (:func:`ahead`)."""
    kept = sum(1 for s in survival if s > price) if price > 0 else len(survival)
    return ahead(price, survival, kept, mean_token)


def ahead(price: float, survival: Sequence[float], kept: int, mean_token: float) -> int:
    """A session's draft budget at ``price`` (module docstring): its round of ``survival``
    kept ``kept`` slots; a longer draft's next slots would survive ``mean_token`` as often
    as the one before each."""
    if kept < len(survival):
        return max(1, kept)
    if price <= 0.0 or not survival:
        return MAX_AHEAD
    s, extra = survival[-1], 0
    while kept + extra < MAX_AHEAD:
        s *= mean_token
        if s <= price:
            break
        extra += 1
    return max(1, kept + extra)


def ration(
    rounds: Sequence[Round], other_tokens: int, other_yield: float, overhead: float, room: int
) -> Ration:
    """Draft tokens each round verifies (module docstring). ``other_tokens`` / ``other_yield``:
    the tokens of the step's other rows and the tokens they commit; ``overhead``: a/b, one
    forward's fixed cost in tokens (inf: not priced, drafts cut only to ``room``); ``room``:
    the most tokens the step may hold."""
    if not rounds:
        return Ration({}, 0.0)
    keep = {r.key: min(1, len(r.survival)) for r in rounds}
    n = other_tokens + sum(r.base for r in rounds)
    e = other_yield + sum(1.0 + (r.survival[0] if r.survival else 0.0) for r in rounds)
    slots = sorted(
        ((s, i, r.key) for r in rounds for i, s in enumerate(r.survival) if i >= 1),
        key=lambda t: (-t[0], t[1], t[2]),
    )
    priced = overhead != float("inf")
    for s, i, key in slots:
        if keep[key] != i:  # only a tail is cut (s is non-increasing along a draft)
            continue
        if n + 1 > room or (priced and s * (overhead + n) <= e):
            break
        keep[key] = i + 1
        n, e = n + 1, e + s
    return Ration(keep, e / max(1e-9, overhead + n) if priced else 0.0)
