"""The engine's scheduler as pure functions over queues (no torch, no threads, no clock)."""

from __future__ import annotations

import pytest

from cloud_verifier.scheduler import (
    BatchLimits,
    Kind,
    Queued,
    RunningStep,
    StepPlan,
    model_drafts_allowed,
    plan_step,
    prefill_chunk,
    queue_eta,
    row_tokens,
    should_gather,
)
from cloud_verifier.step_times import StallRule, StepTimes

CALL, CHEAP = Queued(Kind.CALL), Queued(Kind.CHEAP)


def fwd(tokens: int) -> Queued:
    return Queued(Kind.FORWARD, tokens)


def cogen(tokens: int = 1) -> Queued:
    return Queued(Kind.COGEN, tokens)


LIM = BatchLimits(max_sessions=3, max_tokens=100)


@pytest.mark.parametrize(
    "queue,plan",
    [
        ([], StepPlan(0, (), (), (), 0)),
        # calls first, then the step's work in queue order
        ([CALL, fwd(5), CHEAP, fwd(7)], StepPlan(4, (0,), (1, 2, 3), (), 14)),
        # a call after work ends the prefix: it runs between steps
        ([fwd(5), CALL, fwd(7)], StepPlan(1, (), (0,), (), 5)),
        # at most max_sessions rows: the fourth waits for the next step
        ([fwd(5), fwd(5), fwd(5), fwd(5)], StepPlan(3, (), (0, 1, 2), (), 15)),
        # padded tokens (rows × longest) within max_tokens: 3 × 40 > 100
        ([fwd(40), fwd(10), fwd(40)], StepPlan(2, (), (0, 1), (), 80)),
        # the oldest forward always fits, however long
        ([fwd(500), fwd(5)], StepPlan(1, (), (0,), (), 500)),
        # cheap work behind a forward that does not fit waits too (order is kept)
        ([fwd(90), fwd(20), CHEAP], StepPlan(1, (), (0,), (), 90)),
        # co-generation joins in the room left, after the drafts to verify
        ([cogen(), fwd(5), fwd(5)], StepPlan(3, (), (1, 2, 0), (), 15)),
        # ... and is answered Skipped when there is none
        ([cogen(), fwd(5), fwd(5), fwd(5)], StepPlan(4, (), (1, 2, 3), (0,), 15)),
        ([fwd(60), cogen(60)], StepPlan(2, (), (0,), (1,), 60)),
        # alone, a co-generation always runs
        ([cogen(200)], StepPlan(1, (), (0,), (), 200)),
    ],
)
def test_plan_step(queue: list[Queued], plan: StepPlan) -> None:
    assert plan_step(queue, LIM) == plan


def test_every_taken_entry_is_answered_once() -> None:
    queue = [CALL, cogen(), fwd(30), CHEAP, cogen(), fwd(30), fwd(30), CALL, fwd(5)]
    plan = plan_step(queue, LIM)
    answered = sorted([*plan.calls, *plan.batch, *plan.skipped])
    assert answered == list(range(plan.taken))


def test_gather_waits_only_while_open_sessions_may_still_join() -> None:
    assert not should_gather([], 4, LIM)
    assert not should_gather([CALL, CHEAP], 4, LIM)  # no forward: nothing to wait for
    assert should_gather([fwd(5)], 2, LIM)  # the other session's Propose is on its way
    assert not should_gather([fwd(5), cogen()], 2, LIM)  # every open session has one
    assert not should_gather([fwd(5)], 1, LIM)  # a lone session never waits
    assert not should_gather([fwd(5)] * 3, 8, LIM)  # a full step


def test_queue_eta_and_stall() -> None:
    times = StepTimes()
    times.anchor(10, 0.2)
    times.anchor(110, 1.2)  # 0.1 s + 10 ms per token
    rule = StallRule(factor=8.0, floor_s=60.0)
    assert queue_eta(None, 0.0, [], times, LIM, rule) == (0.0, False)
    run = RunningStep(started=100.0, tokens=110, slots=frozenset({1}))
    eta, stalled = queue_eta(run, 100.5, [], times, LIM, rule)
    assert eta == pytest.approx(0.7) and not stalled
    # four forwards of 10 tokens behind it: two more steps of 3 rows at most
    eta, _ = queue_eta(run, 100.5, [10] * 4, times, LIM, rule)
    assert eta == pytest.approx(0.7 + 2 * 0.1 + 0.01 * 40)
    assert queue_eta(run, 160.5, [], times, LIM, rule) == (0.0, True)


def test_model_drafts_only_in_steps_without_edge_drafted_work() -> None:
    assert model_drafts_allowed(0)
    assert not model_drafts_allowed(1) and not model_drafts_allowed(64)


def test_a_long_prefill_is_taken_in_chunks_of_the_budget() -> None:
    assert prefill_chunk(1000, 256) == 256  # a chunk, no decision
    assert prefill_chunk(256, 256) == 256  # fits: all of it, with the draft
    assert prefill_chunk(1000, 0) == 1000  # no chunking
    assert row_tokens(1000, 4, 256) == 256
    assert row_tokens(200, 4, 256) == 205  # fixed + draft + the row scoring draft[0]
    assert row_tokens(0, 4, 256) == 5
    # The scheduler sees the chunk: a long prompt and three short rounds share a step whose
    # padded size is 4 rows of the chunk, not of the prompt.
    queue = [Queued(Kind.FORWARD, row_tokens(4000, 4, 256))] + [Queued(Kind.FORWARD, 5)] * 3
    plan = plan_step(queue, BatchLimits(max_sessions=8, max_tokens=4096))
    assert plan.batch == (0, 1, 2, 3) and plan.padded_tokens == 4 * 256
