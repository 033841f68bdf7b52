"""Where the edge drafts branches: the outcomes of its batches in flight (a rejection at a
position and the correction after it), ranked by how likely each is to be the first one, and
chosen within a budget. Pure: no I/O, no clock, no model.

An *outcome* (i, y): every undecided draft token before position i is accepted, the one at i is
rejected and y is the correction. With c_j the draft's own (temperature-1) probability of the
token it drafted at j, corrected by the session's measured acceptance (â(c) = α·c/c̄,
:class:`~shared.maths.acceptance.Acceptance`: the same calibration the verifier ranks slots
by), and q_i(y) the draft's probability of y:

    L(i, y) = Π_{j<i} â(c_j) · (1 − â(c_i)) · q_i(y) / (1 − c_i)

the chance that the tokens before i are accepted, that i is rejected, and that the correction is
y given a rejection (the draft's own conditional over the tokens other than its own). Σ L over
the outcomes with a branch is the chance that the next rejection finds one ready: *coverage*.

Budget (:class:`BranchBudget`): at most ``kept`` branches prepared at once (the cap), and none
for an outcome less likely than ``floor``: where the draft is sure, nothing is drafted, and a
session whose draft the target often rejects (its α low, so every â is) gets branches at more
positions. Which outcomes are prepared depends on the draft's probabilities and the session's
measured acceptance only; which branch is *taken* depends on the committed text only (the
correction), so the law stays the target's (:mod:`edge_agent.session.branches`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from shared.maths.acceptance import Acceptance


class RivalView(Protocol):
    """What planning reads of one draft step (:class:`~edge_agent.session.branches.Rival`)."""

    @property
    def conf(self) -> float: ...
    def alternatives(self) -> tuple[tuple[int, float], ...]: ...


@dataclass(frozen=True)
class Fork:
    """The undecided draft tokens of one batch (in flight, or being drafted) as planning reads
    them: ``start`` the position of ``draft[0]``, ``rivals`` each token's confidence and
    alternatives (as many as there are steps with one)."""

    start: int
    draft: Sequence[int]
    rivals: Sequence[RivalView]


@dataclass(frozen=True)
class Outcome:
    """A rejection at ``pos`` corrected to ``token``, and its likelihood (module docstring)."""

    pos: int
    token: int
    likelihood: float


@dataclass(frozen=True)
class BranchBudget:
    """What branch planning may spend: branches prepared at once (``kept``), and the least
    likelihood an outcome must have to get one (``floor``)."""

    kept: int
    floor: float = 0.02

    def __post_init__(self) -> None:
        if self.kept < 0:
            raise ValueError(f"kept must be >= 0, got {self.kept}")
        if not 0.0 <= self.floor < 1.0:
            raise ValueError(f"floor must be in [0, 1), got {self.floor}")


def outcomes(
    forks: Iterable[Fork], committed: int, acceptance: Acceptance, floor: float = 0.0
) -> list[Outcome]:
    """Every outcome of the undecided draft tokens of ``forks`` (in text order, positions
    before ``committed`` already decided) at least ``floor`` likely, likeliest first (ties:
    the earlier position, then the likelier alternative's order)."""
    out: list[tuple[float, int, int, int]] = []
    alive = 1.0  # the chance that every undecided token so far is accepted
    for f in forks:
        if alive < floor or alive <= 0.0:
            break  # no outcome further on is that likely (L ≤ alive)
        for i, r in enumerate(f.rivals[: len(f.draft)]):
            if alive < floor:
                break
            pos = f.start + i
            if pos < committed:
                continue
            c = min(1.0, max(0.0, float(r.conf)))
            kept = acceptance.token(c)
            if c < 1.0:
                rejected = alive * (1.0 - kept)
                for rank, (y, qy) in enumerate(r.alternatives()):
                    if y == f.draft[i]:
                        continue
                    likelihood = rejected * min(1.0, float(qy) / (1.0 - c))
                    if likelihood >= floor:
                        out.append((likelihood, pos, rank, y))
            alive *= kept
    out.sort(key=lambda t: (-t[0], t[1], t[2]))
    return [Outcome(pos, y, lk) for lk, pos, _, y in out]


def plan(
    ranked: Sequence[Outcome],
    planned: set[tuple[int, int]],
    prepared: int,
    budget: BranchBudget,
    room: int,
) -> list[Outcome]:
    """The outcomes to prepare now, likeliest first: of ``ranked`` (:func:`outcomes`), those
    not ``planned`` already and at least ``budget.floor`` likely, while fewer than
    ``budget.kept`` are ``prepared`` and at most ``room`` of them (what the drafter may step
    now)."""
    out: list[Outcome] = []
    for o in ranked:
        if len(out) >= room or prepared + len(out) >= budget.kept or o.likelihood < budget.floor:
            break
        if (o.pos, o.token) not in planned:
            out.append(o)
    return out


def coverage(ranked: Sequence[Outcome], prepared: set[tuple[int, int]]) -> float:
    """The chance that the next rejection's correction has a branch: Σ L over the outcomes
    ``prepared``, over Σ L (1 when there is no outcome)."""
    total = sum(o.likelihood for o in ranked)
    if total <= 0.0:
        return 1.0
    return sum(o.likelihood for o in ranked if (o.pos, o.token) in prepared) / total
