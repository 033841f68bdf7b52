"""The verifier serves first the sessions furthest behind the rate they are owed, as pure
functions: a session's weight from its attained rate, the scheduler's order of a step's
decode work (rounds and co-generations alike), the ration's slots by weighted survival, the
budget each session is told, and the bound on how long a session's batches may be deferred."""

from __future__ import annotations

import pytest

from cloud_verifier.engine.rationing import Round, ration
from cloud_verifier.engine.scheduler import BatchLimits, Kind, Queued, by_priority, plan_step
from cloud_verifier.engine.work import DEFER_BOUND, MAX_WEIGHT, MIN_WEIGHT
from cloud_verifier.session.pace import PaceMeter, pace_weight

pytestmark = pytest.mark.fast

LIMITS = BatchLimits(max_sessions=64, max_tokens=4096, prefill_chunk=256, prefill_share=0.0)
#: A GPU-like step: a forward's overhead is worth hundreds of tokens.
OVERHEAD = 400.0


def chain(alpha: float, n: int, a: float = 0.7) -> tuple[float, ...]:
    return tuple(alpha * a**i for i in range(n))


def verify(survival: tuple[float, ...], weight: float = 1.0, waited: int = 0) -> Queued:
    """A Verify round of len(survival) draft tokens whose tail may be cut."""
    return Queued(
        Kind.FORWARD,
        1,
        len(survival) + 1,
        survival=survival,
        mean_token=0.7,
        weight=weight,
        waited=waited,
    )


def cogen(weight: float = 1.0) -> Queued:
    return Queued(Kind.COGEN, 1, 1, weight=weight)


def test_a_session_weighs_by_how_far_below_its_rate_it_is() -> None:
    assert pace_weight(5.0, 5.0) == 1.0
    assert pace_weight(2.5, 5.0) == MAX_WEIGHT  # half the rate: (2)² = 4
    assert pace_weight(10.0, 5.0) == MIN_WEIGHT  # twice the rate: 1/4
    assert pace_weight(4.0, 5.0) > pace_weight(4.5, 5.0) > 1.0 > pace_weight(6.0, 5.0)
    assert pace_weight(0.0, 5.0) == MAX_WEIGHT  # nothing yet: its first token is due
    assert pace_weight(0.0, 0.0) == pace_weight(100.0, 0.0) == 1.0  # no service level


def test_the_meter_reads_the_rate_since_the_first_round() -> None:
    m = PaceMeter(5.0)
    assert m.attained(3.0, 100) == 0.0 and m.weight(3.0, 100) == MAX_WEIGHT
    m.start(10.0, 40)  # the prompt, 40 tokens, came at t = 10
    m.start(11.0, 50)  # only the first round starts the clock
    assert m.attained(12.0, 50) == pytest.approx(5.0)  # 10 tokens in 2 s
    assert m.weight(12.0, 50) == pytest.approx(1.0)
    assert m.weight(14.0, 50) == pytest.approx(pace_weight(2.5, 5.0))


def test_a_session_behind_its_rate_is_served_before_one_ahead() -> None:
    # One row a step: the behind session's round goes first though it came second.
    one = BatchLimits(max_sessions=1, max_tokens=4096, prefill_chunk=256, prefill_share=0.0)
    ahead, behind = verify(chain(0.8, 4), weight=0.5), verify(chain(0.8, 4), weight=3.0)
    plan = plan_step([ahead, behind], one, active_sessions=2, overhead_tokens=OVERHEAD)
    assert [r.index for r in plan.rows] == [1]
    # equal weights: arrival order
    plan = plan_step([ahead, ahead], one, active_sessions=2, overhead_tokens=OVERHEAD)
    assert [r.index for r in plan.rows] == [0]


def test_every_kind_of_session_follows_one_rule() -> None:
    # A co-generation (a session waiting on its edge, or a cloud-only one) behind its rate
    # takes the room before an edge's round ahead of its rate, and the other way round.
    one = BatchLimits(max_sessions=1, max_tokens=4096, prefill_chunk=256, prefill_share=0.0)
    plan = plan_step([verify(chain(0.8, 4), weight=0.5), cogen(weight=3.0)], one, 2, OVERHEAD)
    assert [r.index for r in plan.rows] == [1] and 0 not in plan.taken  # the round waits
    plan = plan_step([verify(chain(0.8, 4), weight=3.0), cogen(weight=0.5)], one, 2, OVERHEAD)
    assert [r.index for r in plan.rows] == [0] and plan.skipped == (1,)
    queue = [cogen(1.0), verify(chain(0.8, 2), 2.0), cogen(4.0), verify(chain(0.8, 2), 0.25)]
    assert by_priority(queue) == [2, 1, 0, 3]


def test_the_room_goes_first_to_the_sessions_furthest_behind() -> None:
    # Two rounds alike but for their weight, a step with room for a few slots past their
    # promises: the behind session's slots are verified first.
    rounds = [
        Round(0, 2, chain(0.8, 8), weight=0.5),
        Round(1, 2, chain(0.8, 8), weight=2.0),
    ]
    r = ration(rounds, 0, 0.0, OVERHEAD, room=2 * 3 + 6)
    assert r.keep[1] > r.keep[0]
    # equal weights: an even split of the same room
    even = [Round(0, 2, chain(0.8, 8)), Round(1, 2, chain(0.8, 8))]
    r = ration(even, 0, 0.0, OVERHEAD, room=2 * 3 + 6)
    assert abs(r.keep[0] - r.keep[1]) <= 1


def test_a_loaded_step_cuts_the_ahead_sessions_tails_and_tells_budgets_by_weight() -> None:
    # Many sessions on a step priced by its load: a session behind its rate keeps slots an
    # equal draft of a session ahead of it loses, and is told a longer budget.
    behind, ahead = chain(0.9, 12, 0.85), chain(0.9, 12, 0.85)
    rounds = [Round(0, 2, behind, weight=3.0)] + [
        Round(k, 2, ahead, weight=0.5) for k in range(1, 40)
    ]
    r = ration(rounds, 0, 0.0, overhead=40.0, room=4096)
    assert r.price > 0
    assert r.keep[0] > r.keep[1]
    assert r.budget(rounds[0], 0.85) > r.budget(rounds[1], 0.85)


def test_a_deferred_session_is_served_within_its_bound() -> None:
    """A session far ahead of its rate, beside many behind it on a step with little room: its
    batches are deferred (the ration leaves them out) at most ``DEFER_BOUND`` steps in a row;
    then its round is served whole, first. The core counts the steps (``Verify.waited``)."""
    tight = BatchLimits(
        max_sessions=64, max_tokens=4096, prefill_chunk=256, prefill_share=0.0, ration_share=0.02
    )
    mine = (3, 6, 9)  # three batches of 3 tokens, coalesced
    others = [
        Queued(Kind.FORWARD, 1, 10, survival=chain(0.95, 9, 0.95), mean_token=0.9, weight=4.0)
        for _ in range(20)
    ]
    served_whole = None
    for step in range(DEFER_BOUND + 2):
        waited = step  # deferred in every step before this one
        me = Queued(
            Kind.FORWARD,
            1,
            10,
            survival=chain(0.6, 9, 0.6),
            mean_token=0.6,
            ends=mine,
            promised=3,
            weight=MIN_WEIGHT,
            waited=waited,
        )
        plan = plan_step([me, *others], tight, active_sessions=21, overhead_tokens=OVERHEAD)
        row = next(r for r in plan.rows if r.index == 0)
        if row.cut is None:
            served_whole = step
            break
        assert row.cut in mine[:-1]  # deferred at a batch's end, never cut inside its promise
    assert served_whole is not None and served_whole <= DEFER_BOUND
    # at the bound, it goes first too
    behind = [verify(chain(0.95, 9), weight=3.0) for _ in range(5)]
    starved = verify(chain(0.6, 9), weight=MIN_WEIGHT, waited=DEFER_BOUND)
    assert by_priority([*behind, starved])[0] == len(behind)
