"""Rationing speculation: which draft tokens a loaded step verifies, and how many tokens a round
each session is told to draft. Pure: no torch, no clock (the scheduler calls it with the
engine's measured step cost).

**Survival.** Slot i of a round's draft (0-based, token x_i) is worth s_i, the estimated
probability that it is reached and accepted, which the session's core sends with its Verify
(:class:`~shared.maths.acceptance.Acceptance`): it reads the draft's probabilities
of the tokens before x_i only, never q_i, and is non-increasing in i, so ranking by s cuts a
round's tail, never its middle.

**Price.** A step of n tokens costs a + b·n (:class:`~cloud_verifier.engine.step_times.
StepTimes`) and commits E tokens in expectation: per round 1 (its recovered or bonus token)
plus the survival of every slot it verifies. Adding a slot of survival s raises E/(a + b·n)
iff s > E/(a/b + n) =: the *price* (tokens committed per token of step cost). :func:`ration`
takes the rounds' mandatory part (their fixed tokens, the scoring row and the slots the
session was promised: its first batch up to its budget) and the step's other work (prefill
chunks, co-generations) as given, then adds slots in order of survival while each pays its
price and the step has room: a step much cheaper than its overhead (an idle verifier on a GPU)
verifies whole drafts; a loaded one leaves out the tails that would probably be rejected.

**Room.** Beside the step's token bound, the slots past the mandatory part may add at most
``share`` of the step's overhead a (the verifier's ``ration_share`` setting), less what the
step's prefill chunks add (a first token's prefill comes first): a step is never stretched by
speculation past (1 + share)·a + b·(its mandatory and prefill tokens), so what waits for the
next step (a new prompt's first token above all) waits for a short one.

**Batches.** A round may hold several of its session's batches (Proposes coalesced into one
row). A ration that ends past the first batch stops at a batch's end: the batches behind it are
*deferred*, not dropped: they stay queued, in order, for the next step (still valid if the
verified ones are accepted whole, stale otherwise, as if never coalesced), so a deep pipeline
keeps a round queued for every step. Only a first batch longer than the promise is *cut*
inside: verified to the ration's end with a bonus token after it, the rest void.

**Budget.** What a session is told (Verdict.budget): the draft tokens a round of it the
verifier expects to verify whole at the step's *clearing price* (the survival of the best slot
left out, the price where nothing was): its round's slots above it, plus the further slots a
longer draft would have had above it (its last survival times â of an average token,
repeated), at most :data:`MAX_AHEAD` (no bound to speak of). The edge drafts batches of at most
that many tokens and keeps its pipeline as deep as its round trip needs. The price a session
is told is the one its rounds would clear beside the step's rounds alone: a prefill chunk takes
the speculative share of its own step (above), but one new prompt does not shorten every
session's next batches.

**Weights.** Every round carries its session's weight w (:mod:`cloud_verifier.session.pace`:
above 1 for a session behind the rate it is owed, below 1 for one ahead of it). A slot of
survival s is worth w·s: slots are ranked by it, and priced against the step's weighted yield
E_w = Σ w·(1 + the survival of its verified slots): a slot is added while w·s > E_w / (a/b + n).
With every weight 1 this is the rule above; a session furthest below its rate has its slots
verified first and its budget told at price / w. Weights read the session's timing only, so
the law stays p.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from cloud_verifier.engine.work import DEFER_BOUND, MAX_WEIGHT, CoGenerate, Verify, Work
from shared.wire.messages import MAX_BUDGET

#: The budget that means "draft as you like": the protocol's bound on it.
MAX_AHEAD: Final = MAX_BUDGET
#: The survival rate assumed for a cloud draft token whose session has measured none.
COGEN_ALPHA: Final = 0.7


def survival_of(work: Work) -> tuple[tuple[float, ...], float]:
    """What the ration ranks ``work``'s draft slots by: each slot's survival and â of an
    average token of its session; ((), 0.0) for work whose draft is never cut. A Verify's come
    from its session's core (a tree row's chain too: its branches are priced apart); a
    co-generation's own (deterministic) draft
    survives each token at its session's measured α (any rule keeps a point-mass draft's law:
    nothing about the token is random given the text)."""
    if isinstance(work, Verify):
        if len(work.survival) == len(work.draft) > 0:
            return work.survival, work.mean_token
        return (), 0.0
    if isinstance(work, CoGenerate) and work.cloud:
        a = work.model_alpha if work.model_alpha is not None else COGEN_ALPHA
        n = max(len(work.draft), work.model_tokens)
        return tuple(a ** (i + 1) for i in range(n)), a
    return (), 0.0


@dataclass(frozen=True)
class Round:
    """A round as :func:`ration` sees it: ``key`` names it, ``fixed`` its fixed tokens and
    scoring row, ``survival`` its slots' s_i, ``ends`` the draft length at each of its batches'
    ends (() : one batch), ``sure`` the slots no ration leaves out (its promise), ``weight`` its
    session's (:mod:`cloud_verifier.session.pace`), ``waited`` the steps in a row its batches
    were deferred (at :data:`~cloud_verifier.engine.work.DEFER_BOUND` it is served whole)."""

    key: int
    fixed: int
    survival: tuple[float, ...]
    ends: tuple[int, ...] = ()
    sure: int = 1
    weight: float = 1.0
    waited: int = 0

    @property
    def starved(self) -> bool:
        """Deferred for the bound: served whole now, first."""
        return self.waited >= DEFER_BOUND

    @property
    def priority(self) -> float:
        """What its slots are weighed by: its weight, the most once starved."""
        return MAX_WEIGHT if self.starved else self.weight

    @property
    def mandatory(self) -> int:
        """Slots always verified: the promise, within the first batch (a starved round's
        whole draft)."""
        if self.starved:
            return len(self.survival)
        first = self.ends[0] if self.ends else len(self.survival)
        return min(len(self.survival), first, max(1, self.sure))

    @property
    def base(self) -> int:
        """Tokens of the row no ration touches."""
        return self.fixed + self.mandatory

    def snap(self, kept: int) -> int:
        """``kept`` slots as verified: inside the first batch as they are (a cut), past it back
        to the end of the last whole batch (the rest deferred)."""
        ends = self.ends or (len(self.survival),)
        if kept <= ends[0]:
            return kept
        return max(e for e in ends if e <= kept)


@dataclass(frozen=True)
class Ration:
    """What :func:`ration` decided: draft tokens verified per round key, and the step's
    clearing price (0: nothing was priced or left out, every draft whole)."""

    keep: Mapping[int, int]
    price: float

    def budget(self, r: Round, mean_token: float) -> int:
        """Round ``r``'s session's draft budget (module docstring). ``mean_token``: â of an
        average draft token of that session (its α: q = q̄)."""
        return ahead(self.price / r.priority, r.survival, mean_token)


def own_budget(
    price: float, survival: Sequence[float], mean_token: float, weight: float = 1.0
) -> int:
    """The budget of a verifier's own draft (co-generation), not cut in this step: the slots
    whose weighted survival is above ``price`` are what it would have kept (:func:`ahead`)."""
    return ahead(price / weight, survival, mean_token)


def ahead(price: float, survival: Sequence[float], mean_token: float) -> int:
    """A round's draft budget at ``price`` (module docstring): its slots of ``survival`` above
    the price, and the next slots a longer draft would have had above it (each surviving
    ``mean_token`` as often as the one before)."""
    if price <= 0.0 or not survival:
        return MAX_AHEAD
    kept = sum(1 for s in survival if s > price)
    if kept < len(survival):
        return max(1, kept)
    s, extra = survival[-1], 0
    while kept + extra < MAX_AHEAD:
        s *= mean_token
        if s <= price:
            break
        extra += 1
    return max(1, kept + extra)


def ration(
    rounds: Sequence[Round],
    other_tokens: int,
    other_yield: float,
    overhead: float,
    room: int,
    share: float = float("inf"),
    prefill: int = 0,
) -> Ration:
    """Draft tokens each round verifies (module docstring). ``other_tokens`` / ``other_yield``:
    the tokens of the step's other rows and the tokens they commit; ``overhead``: a/b, one
    forward's fixed cost in tokens (inf: not priced, drafts left out only for ``room``);
    ``room``: the most tokens the step may hold; ``share``: the most the slots past the
    mandatory part may add, in forward overheads (inf: no such bound), less ``prefill``, the
    step's prefill tokens. Slots are ranked and priced by their weighted survival (module
    docstring: Weights)."""
    if not rounds:
        return Ration({}, 0.0)
    keep = {r.key: r.mandatory for r in rounds}
    n = other_tokens + sum(r.base for r in rounds)
    # the step's weighted yield (module docstring: Weights; other rows weigh 1)
    e = other_yield + sum(r.priority * (1.0 + sum(r.survival[: r.mandatory])) for r in rounds)
    priced = overhead != float("inf")
    if priced and share != float("inf"):
        # the step's prefill chunks take the speculative slots' share first
        room = min(room, n + max(0, int(share * overhead) - prefill))
    slots = sorted(
        (
            (r.priority * s, i, r.key)
            for r in rounds
            for i, s in enumerate(r.survival)
            if i >= r.mandatory
        ),
        key=lambda t: (-t[0], t[1], t[2]),
    )
    clearing = 0.0
    for s, i, key in slots:
        if keep[key] != i:  # only a tail is added (s is non-increasing along a draft)
            continue
        if n + 1 > room or (priced and s * (overhead + n) <= e):
            clearing = s
            break
        keep[key] = i + 1
        n, e = n + 1, e + s
    if priced:
        clearing = max(clearing, e / max(1e-9, overhead + n))
    by_key = {r.key: r for r in rounds}
    return Ration({k: by_key[k].snap(v) for k, v in keep.items()}, clearing)
