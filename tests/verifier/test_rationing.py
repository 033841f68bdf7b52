"""Rationing speculation as pure functions: survival estimates that never read the token they
decide about, a step's ration of draft slots by survival against its price, the budget each
session is told, and the scheduler planning prefill before speculative tokens."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from cloud_verifier.engine.rationing import MAX_AHEAD, Round, ration
from cloud_verifier.engine.scheduler import BatchLimits, Kind, Queued, plan_step
from cloud_verifier.session.acceptance import Acceptance

pytestmark = pytest.mark.fast

LIMITS = BatchLimits(max_sessions=64, max_tokens=4096, prefill_chunk=256, prefill_share=0.0)


def verify(survival: tuple[float, ...], fixed: int = 1, tenant: str = "") -> Queued:
    """A Verify round of len(survival) draft tokens whose tail may be cut."""
    return Queued(Kind.FORWARD, fixed, len(survival) + 1, tenant, survival=survival, mean_token=0.7)


def chain(alpha: float, n: int, a: float = 0.7) -> tuple[float, ...]:
    return tuple(alpha * a**i for i in range(n))


def test_survival_reads_only_the_tokens_before_each_slot() -> None:
    acc = Acceptance()
    # s_i must not depend on q_i: changing the last token's q changes no survival.
    assert acc.survival([0.9, 0.5, 0.1]) == acc.survival([0.9, 0.5, 0.99])
    s = acc.survival([0.9, 0.2, 0.9, 0.9])
    assert s[0] == pytest.approx(acc.alpha)
    assert all(a >= b for a, b in itertools.pairwise(s))
    # An unsure token lowers the survival of everything behind it.
    sure, unsure = acc.survival([0.95, 0.9, 0.9]), acc.survival([0.05, 0.9, 0.9])
    assert unsure[1] < sure[1] and unsure[2] < sure[2]


def test_acceptance_is_measured() -> None:
    acc = Acceptance()
    for _ in range(200):
        acc.observe([0.8, 0.8, 0.8, 0.8], 1)  # one accepted, the second rejected
    assert acc.alpha == pytest.approx(0.5, abs=0.02)
    assert acc.q_mean == pytest.approx(0.8, abs=0.02)
    assert acc.token(0.8) == pytest.approx(0.5, abs=0.02)


def test_an_idle_verifier_verifies_whole_drafts() -> None:
    # A GPU-like step: a forward's overhead is worth hundreds of tokens.
    rounds = [Round(k, 3, chain(0.7, 8)) for k in range(2)]
    r = ration(rounds, 0, 0.0, overhead=400.0, room=4096)
    assert dict(r.keep) == {0: 8, 1: 8}
    # unmeasured: not priced at all
    assert dict(ration(rounds, 0, 0.0, float("inf"), 4096).keep) == {0: 8, 1: 8}


def test_a_loaded_step_cuts_the_least_likely_tails_first() -> None:
    confident = Round(0, 3, chain(0.9, 8, 0.9))
    unsure = Round(1, 3, chain(0.6, 8, 0.4))
    crowd = [Round(k, 3, chain(0.7, 8)) for k in range(2, 40)]
    r = ration([confident, unsure, *crowd], 0, 0.0, overhead=20.0, room=4096)
    assert r.price > 0
    assert 1 <= r.keep[1] < r.keep[0] <= 8
    # every slot kept is worth its price, every slot cut is not
    for rd in (confident, unsure, *crowd):
        k = r.keep[rd.key]
        assert all(s >= r.price * 0.999 for s in rd.survival[1:k])
        assert all(s <= r.price * 1.001 for s in rd.survival[k:])
    # the first draft slot is never cut
    assert min(r.keep.values()) >= 1


def test_the_room_bounds_the_slots_in_survival_order() -> None:
    a, b = Round(0, 3, chain(0.9, 6, 0.9)), Round(1, 3, chain(0.5, 6, 0.5))
    r = ration([a, b], 0, 0.0, overhead=float("inf"), room=6 + 4)
    assert r.keep[0] + r.keep[1] == 2 + 4
    assert r.keep[0] == 5 and r.keep[1] == 1


def test_the_budget_follows_the_price() -> None:
    rd = Round(0, 3, chain(0.7, 4))
    idle = ration([rd], 0, 0.0, overhead=float("inf"), room=4096)
    assert idle.budget(rd, 0.7) == MAX_AHEAD
    cut = ration([rd, *(Round(k, 3, chain(0.7, 4)) for k in range(1, 60))], 0, 0.0, 5.0, 4096)
    k = cut.keep[0]
    assert k < 4 and cut.budget(rd, 0.7) == k
    # a whole draft at a modest price: told how far a longer one would still pay
    mid = ration([rd, Round(1, 3, chain(0.7, 4))], 0, 0.0, overhead=30.0, room=4096)
    assert mid.keep[0] == 4
    assert 4 < mid.budget(rd, 0.7) < MAX_AHEAD


def test_prefill_is_planned_before_speculative_tokens_past_the_budget() -> None:
    limits = BatchLimits(max_sessions=64, max_tokens=64, prefill_chunk=32, prefill_share=0.0)
    rounds = [verify(chain(0.8, 8, 0.8)) for _ in range(6)]  # 6 × (1 + 9) = 60 tokens whole
    prompt = Queued(Kind.FORWARD, 500, 1, "b")
    plan = plan_step([*rounds, prompt], limits, active_sessions=7, overhead_tokens=float("inf"))
    chunk = next(r for r in plan.rows if r.index == 6)
    assert chunk.tokens == 32  # the prompt's whole chunk
    cut = [r for r in plan.rows if r.index < 6]
    assert len(cut) == 6 and all(r.cut is not None for r in cut)
    assert sum(r.tokens for r in plan.rows) <= 64
    # without the prompt the rounds are whole
    plan = plan_step(rounds, limits, active_sessions=6, overhead_tokens=float("inf"))
    assert all(r.cut is None and r.tokens == 10 for r in plan.rows)


def test_a_lone_session_is_never_cut() -> None:
    plan = plan_step([verify(chain(0.3, 8, 0.2))], LIMITS, active_sessions=1, overhead_tokens=1.0)
    (row,) = plan.rows
    assert row.cut is None and row.tokens == 10 and row.budget == MAX_AHEAD


def test_the_plan_cuts_under_load_and_tells_the_budget() -> None:
    queue = [verify(chain(0.7, 8)) for _ in range(48)]
    plan = plan_step(queue, LIMITS, active_sessions=48, overhead_tokens=16.0)
    assert plan.price > 0
    assert all(r.cut is not None and 1 <= r.cut < 8 for r in plan.rows)
    assert all(r.budget == r.cut for r in plan.rows)
    assert all(r.tokens == 1 + 1 + r.cut for r in plan.rows if r.cut is not None)
    # rows without survival (federated, trees, old clients) are never cut
    plain = Queued(Kind.FORWARD, 1, 9)
    plan = plan_step([*queue, plain], LIMITS, active_sessions=49, overhead_tokens=16.0)
    last = next(r for r in plan.rows if r.index == 48)
    assert last.cut is None and last.tokens == 10 and last.budget is None


def test_the_verifiers_own_drafts_are_held_to_the_budget_under_load() -> None:
    """A co-generation's cloud draft (hybrid) is told a budget from the same price: short
    under load, unbounded on an idle verifier."""
    hybrid = Queued(Kind.COGEN, 0, 1, survival=tuple(0.5 ** (i + 1) for i in range(8)))
    hybrid = replace(hybrid, mean_token=0.5)
    queue = [verify(chain(0.7, 8)) for _ in range(48)]
    plan = plan_step([*queue, hybrid], LIMITS, active_sessions=49, overhead_tokens=16.0)
    row = next(r for r in plan.rows if r.index == 48)
    assert row.budget is not None and row.budget < 8 and row.cut is None
    (alone,) = plan_step([hybrid], LIMITS, active_sessions=1, overhead_tokens=16.0).rows
    assert alone.budget == MAX_AHEAD
