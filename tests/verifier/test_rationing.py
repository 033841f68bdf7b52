"""Rationing speculation as pure functions: survival estimates that never read the token they
decide about, a step's ration of draft slots by survival against its price, the budget each
session is told, and the scheduler planning prefill before speculative tokens."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from cloud_verifier.engine.rationing import MAX_AHEAD, Round, ration
from cloud_verifier.engine.scheduler import BatchLimits, Kind, Queued, plan_step
from cloud_verifier.engine.work import Verify, batch_ends, deferred, rationed
from shared.maths.acceptance import Acceptance
from shared.wire.messages import Propose

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
    rounds = [Round(k, 2, chain(0.7, 8)) for k in range(2)]
    r = ration(rounds, 0, 0.0, overhead=400.0, room=4096)
    assert dict(r.keep) == {0: 8, 1: 8}
    # unmeasured: not priced at all
    assert dict(ration(rounds, 0, 0.0, float("inf"), 4096).keep) == {0: 8, 1: 8}


def test_a_loaded_step_leaves_out_the_least_likely_tails_first() -> None:
    confident = Round(0, 2, chain(0.9, 8, 0.9))
    unsure = Round(1, 2, chain(0.6, 8, 0.4))
    crowd = [Round(k, 2, chain(0.7, 8)) for k in range(2, 40)]
    r = ration([confident, unsure, *crowd], 0, 0.0, overhead=20.0, room=4096)
    assert r.price > 0
    assert 1 <= r.keep[1] < r.keep[0] <= 8
    # every slot kept is worth its price, every slot left out is not
    for rd in (confident, unsure, *crowd):
        k = r.keep[rd.key]
        assert all(s >= r.price * 0.999 for s in rd.survival[1:k])
        assert all(s <= r.price * 1.001 for s in rd.survival[k:])
    # the first draft slot is never left out
    assert min(r.keep.values()) >= 1


def test_the_room_bounds_the_slots_in_survival_order() -> None:
    a, b = Round(0, 2, chain(0.9, 6, 0.9)), Round(1, 2, chain(0.5, 6, 0.5))
    r = ration([a, b], 0, 0.0, overhead=float("inf"), room=6 + 4)
    assert r.keep[0] + r.keep[1] == 2 + 4
    assert r.keep[0] == 5 and r.keep[1] == 1
    # the clearing price: the best slot left out
    assert r.price == pytest.approx(a.survival[5])


@pytest.mark.parametrize("share", [0.1, 0.5, 2.0])
def test_speculation_adds_at_most_its_share_of_a_forwards_overhead(share: float) -> None:
    """Slots past the mandatory part add at most share · a/b tokens to a step, however cheap
    each token is against the overhead: a loaded step stays short."""
    rounds = [Round(k, 2, chain(0.95, 12, 0.95)) for k in range(30)]
    r = ration(rounds, 100, 0.0, overhead=200.0, room=4096, share=share)
    extra = sum(r.keep[k] - 1 for k in r.keep)
    assert extra <= share * 200.0
    # the room is used (up to a slot a round), or every slot fits
    assert extra >= min(share * 200.0 - len(rounds), 30 * 11)
    left_out = [rd.survival[r.keep[rd.key]] for rd in rounds if r.keep[rd.key] < 12]
    assert r.price >= max(left_out, default=0.0)


def test_the_slots_promised_are_never_left_out() -> None:
    """A round's first batch up to the budget its session was told is mandatory: a step
    keeps its promise however loaded (a price that moved since does not cut it)."""
    promised = Round(0, 2, chain(0.5, 6, 0.5), ends=(4, 6), sure=3)
    crowd = [Round(k, 2, chain(0.7, 6)) for k in range(1, 40)]
    r = ration([promised, *crowd], 0, 0.0, overhead=5.0, room=4096, share=0.1)
    assert r.keep[0] == 3 and promised.mandatory == 3 and promised.base == 5
    # never past the first batch, however large the promise
    assert Round(0, 2, chain(0.9, 6), ends=(2, 6), sure=5).mandatory == 2


def test_a_ration_past_the_first_batch_stops_at_a_batch_end() -> None:
    """Coalesced batches (ends 3, 6, 9): a ration ending inside the second or third batch
    verifies whole batches only, the rest deferred (snapped back); inside the first, a cut."""
    rd = Round(0, 2, chain(0.9, 9, 0.9), ends=(3, 6, 9))
    assert [rd.snap(k) for k in range(1, 10)] == [1, 2, 3, 3, 3, 6, 6, 6, 9]
    other = Round(1, 2, chain(0.2, 9, 0.2), ends=(9,))
    r = ration([rd, other], 0, 0.0, overhead=float("inf"), room=2 + 3 + 2 + 1 + 4)
    assert r.keep[0] == 6  # 3 + 4 slots fit: snapped to the second batch's end


def test_the_budget_follows_the_price() -> None:
    rd = Round(0, 2, chain(0.7, 4))
    idle = ration([rd], 0, 0.0, overhead=float("inf"), room=4096)
    assert idle.budget(rd, 0.7) == MAX_AHEAD
    crowd = [rd, *(Round(k, 2, chain(0.7, 4)) for k in range(1, 60))]
    cut = ration(crowd, 0, 0.0, 5.0, 4096)
    k = cut.keep[0]
    assert k < 4 and cut.budget(rd, 0.7) == k
    # a whole draft at a modest price: told how far a longer one would still pay
    mid = ration([rd, Round(1, 2, chain(0.7, 4))], 0, 0.0, overhead=30.0, room=4096)
    assert mid.keep[0] == 4
    assert 4 < mid.budget(rd, 0.7) < MAX_AHEAD
    # the room binds: told the slots above the best one left out
    tight = ration(crowd, 0, 0.0, overhead=1000.0, room=4096, share=0.05)
    assert tight.budget(rd, 0.7) == sum(1 for s in rd.survival if s > tight.price) >= 1


def test_a_rationed_verify_defers_whole_batches_and_cuts_only_inside_the_first() -> None:
    """engine.work.rationed: at a batch's end past the first, the kept batches are decided as
    they came (no bonus: a batch follows them); inside the first, a cut with a bonus."""
    ps = [
        Propose(0, s, pos, np.arange(pos, pos + 3), np.full(3, 0.8, np.float32), want_bonus=False)
        for s, pos in enumerate((4, 7, 10))
    ]
    ps[0] = replace(ps[0], fixed=np.array([1, 2, 3, 4]), pos=0)
    ps[-1] = replace(ps[-1], want_bonus=True)
    w = Verify(ps[0], True, tuple(ps[1:]), survival=chain(0.9, 9, 0.9))
    assert batch_ends(w) == (3, 6, 9)
    later = rationed(w, 6)
    assert deferred(w, 6) and [p.seq for p in later.segments] == [0, 1]
    assert not later.want_bonus and len(later.survival) == 6
    cut = rationed(w, 2)
    assert not deferred(w, 2) and [p.seq for p in cut.segments] == [0] and cut.want_bonus
    assert cut.draft.tolist() == ps[0].draft[:2].tolist()
    assert not deferred(w, 9)


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


def test_a_steps_prefill_takes_the_speculative_share_first() -> None:
    """The prefill chunks a step holds come out of its speculative share: beside a prompt's
    prefill as long as the share, no slot past the promises is added; beside a shorter one,
    what is left of it."""
    rounds = [Round(k, 2, chain(0.95, 12, 0.95)) for k in range(30)]
    free = ration(rounds, 0, 0.0, overhead=200.0, room=4096, share=0.5)
    half = ration(rounds, 60, 0.0, overhead=200.0, room=4096, share=0.5, prefill=60)
    full = ration(rounds, 100, 0.0, overhead=200.0, room=4096, share=0.5, prefill=100)
    extra = [sum(r.keep[k] - 1 for k in r.keep) for r in (free, half, full)]
    assert extra == [100, 40, 0]
    # the scheduler passes its chunks' tokens
    limits = BatchLimits(max_sessions=64, max_tokens=4096, prefill_chunk=512, prefill_share=0.0)
    queue = [verify(chain(0.9, 8, 0.9)) for _ in range(10)]
    alone = plan_step(queue, limits, active_sessions=11, overhead_tokens=100.0)
    beside = plan_step([*queue, Queued(Kind.FORWARD, 200, 1, "b")], limits, 11, 100.0)
    assert sum(r.tokens for r in alone.rows) > 10 * 3
    assert sum(r.tokens for r in beside.rows if r.index < 10) == 10 * 3
