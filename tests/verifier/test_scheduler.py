"""The engine's scheduler as pure functions over queues (no torch, no threads, no clock)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cloud_verifier.engine.scheduler import (
    DECODE_FIXED,
    MIN_PREFILL,
    BatchLimits,
    Kind,
    Pages,
    Queued,
    Row,
    RunningStep,
    StepPlan,
    fair_shares,
    group_rows,
    model_drafts_allowed,
    plan_step,
    queue_eta,
    should_gather,
)
from cloud_verifier.engine.step_times import StallRule, StepTimes

pytestmark = pytest.mark.fast

CALL, CHEAP = Queued(Kind.CALL), Queued(Kind.CHEAP)


def fwd(fixed: int, decide: int = 5, tenant: str = "") -> Queued:
    return Queued(Kind.FORWARD, fixed, decide, tenant)


def cogen(fixed: int = 0, decide: int = 1) -> Queued:
    return Queued(Kind.COGEN, fixed, decide)


LIM = BatchLimits(max_sessions=3, max_tokens=100, prefill_chunk=0, prefill_share=0.0)


def rows(plan: StepPlan) -> list[tuple[int, int, int]]:
    return [(r.index, r.chunk, r.tokens) for r in plan.rows]


@pytest.mark.parametrize(
    "queue,expect",
    [
        ([], []),
        # rounds whole, in queue order
        ([fwd(3), fwd(4)], [(0, 3, 8), (1, 4, 9)]),
        # at most max_sessions rows: the fourth waits for the next step
        ([fwd(0)] * 4, [(0, 0, 5), (1, 0, 5), (2, 0, 5)]),
        # tokens within max_tokens (the oldest always fits)
        ([fwd(60), fwd(50), fwd(10)], [(0, 60, 65), (2, 10, 15)]),
        # co-generation is decode work like a round: in the step by its session's weight,
        # then in arrival order (pace), rows listed rounds first
        ([cogen(), fwd(0), fwd(0)], [(1, 0, 5), (2, 0, 5), (0, 0, 1)]),
        # alone, a co-generation always runs
        ([cogen(0, 200)], [(0, 0, 200)]),
    ],
)
def test_rounds(queue: list[Queued], expect: list[tuple[int, int, int]]) -> None:
    assert rows(plan_step(queue, LIM)) == expect


def test_cogen_without_room_is_skipped() -> None:
    # sessions alike: arrival order, the co-generation queued last finds no room
    plan = plan_step([fwd(0), fwd(0), fwd(0), cogen()], LIM)
    assert plan.skipped == (3,) and [r.index for r in plan.rows] == [0, 1, 2]
    # queued first, it takes its room and the last round waits for the next step
    plan = plan_step([cogen(), fwd(0), fwd(0), fwd(0)], LIM)
    assert plan.skipped == () and sorted(r.index for r in plan.rows) == [0, 1, 2]
    assert 3 not in plan.taken
    # a co-generation for a session behind its rate goes before rounds of sessions ahead
    late = replace(cogen(), weight=2.0)
    plan = plan_step([fwd(0), fwd(0), fwd(0), late], LIM)
    assert plan.skipped == () and sorted(r.index for r in plan.rows) == [0, 1, 3]


def test_calls_run_before_the_step_whatever_is_queued() -> None:
    # A call behind a long prefill and rounds is still planned now, before the step.
    queue = [fwd(8000, tenant="a"), fwd(2), CHEAP, fwd(3000, tenant="b"), CALL, fwd(1), CALL]
    plan = plan_step(queue, BatchLimits(8, 4096, 512, prefill_share=0.0), active_sessions=4)
    assert plan.calls == (4, 6)
    assert plan.cheap == (2,)
    assert plan.taken == frozenset({0, 1, 2, 3, 4, 5, 6})


def test_a_long_prompt_never_holds_back_a_round() -> None:
    """Rounds first, whole; the prefill gets the chunk budget (others are open) and its row is
    not padding theirs: they run in separate forwards when that costs less."""
    lim = BatchLimits(8, 4096, 512, prefill_share=0.0)
    queue = [fwd(8000, tenant="a")] + [fwd(2, tenant="h")] * 3
    plan = plan_step(queue, lim, active_sessions=4, overhead_tokens=10)
    assert rows(plan)[:3] == [(1, 2, 7), (2, 2, 7), (3, 2, 7)]
    assert rows(plan)[3] == (0, 512, 512)  # a chunk: no decision
    assert not plan.rows[3].decides and plan.rows[0].decides
    assert plan.forwards == 2 and plan.tokens == 3 * 7 + 512
    assert not plan.model_drafts


def test_a_lone_prefill_takes_the_whole_step() -> None:
    lim = BatchLimits(8, 4096, 512, prefill_share=0.0)
    plan = plan_step([fwd(8000)], lim, active_sessions=1)
    assert rows(plan) == [(0, 4096, 4096)]
    # its last chunk carries the draft and decides
    plan = plan_step([fwd(3000)], lim, active_sessions=1)
    assert rows(plan) == [(0, 3000, 3005)] and plan.rows[0].decides


def test_prefill_budget_is_shared_fairly_between_tenants() -> None:
    """Eight sessions of one tenant against one of another: half the budget each; within the
    attacker, oldest first."""
    lim = BatchLimits(16, 4096, 512, prefill_share=0.0)
    queue = [fwd(1500, tenant="attacker")] * 8 + [fwd(1500, tenant="honest")]
    plan = plan_step(queue, lim, active_sessions=12)
    got: dict[str, int] = {}
    for r in plan.rows:
        got[queue[r.index].tenant] = got.get(queue[r.index].tenant, 0) + r.chunk
    assert got == {"attacker": 256, "honest": 256}
    assert [r.index for r in plan.rows] == [0, 8]


def test_fair_shares_is_max_min_fair() -> None:
    assert fair_shares({"a": 1000, "b": 1000}, 512) == {"a": 256, "b": 256}
    assert fair_shares({"a": 100, "b": 1000}, 512) == {"a": 100, "b": 412}
    assert fair_shares({"a": 10, "b": 10}, 512) == {"a": 10, "b": 10}
    assert fair_shares({"a": 5, "b": 5, "c": 5}, 4) == {"a": 2, "b": 1, "c": 1}
    assert fair_shares({}, 100) == {}


def test_rounds_leave_the_prefill_at_least_its_floor() -> None:
    lim = BatchLimits(8, 64, 512, prefill_share=0.0)
    queue = [fwd(DECODE_FIXED, 0), fwd(2000, tenant="a")]
    plan = plan_step(queue, lim, active_sessions=3)
    assert rows(plan) == [(0, DECODE_FIXED, DECODE_FIXED), (1, MIN_PREFILL, MIN_PREFILL)]


def test_group_rows_splits_only_where_padding_costs_more_than_a_forward() -> None:
    assert group_rows([], [], 10) == 0
    assert group_rows([9, 3, 17], [], 0) == 1  # rounds always share one forward
    # A GPU (a forward costs like 2000 tokens): one forward.
    assert group_rows([7, 7], [512], 2000) == 1
    # A CPU (a forward costs like 30 tokens): the chunk alone.
    assert group_rows([7, 7], [512], 30) == 2
    assert group_rows([9], [20], 30) == 1
    assert group_rows([7, 7], [512], float("inf")) == 1  # nothing measured yet


def simulate(
    queue: list[Queued], lim: BatchLimits, steps: int, active_sessions: int
) -> list[StepPlan]:
    """Steps of the scheduler with the engine's bookkeeping: a round decided is queued again
    (its session's next round), a chunk goes back with its fixed tokens reduced; a prefill that
    decided starts over (the attacker loops its prompt)."""
    plans = []
    q = list(queue)
    for _ in range(steps):
        plan = plan_step(q, lim, active_sessions, overhead_tokens=20)
        plans.append(plan)
        by_index: dict[int, Row] = {r.index: r for r in plan.rows}
        nxt: list[Queued] = []
        for i, item in enumerate(q):
            r = by_index.get(i)
            if r is None or r.decides:
                nxt.append(item)  # not served, or served and back with its next round / loop
            else:
                nxt.append(replace(item, fixed=item.fixed - r.chunk))
        q = nxt
    return plans


def test_every_round_is_served_every_step_beside_looping_long_prompts() -> None:
    """Four honest sessions beside eight of one tenant looping 8,000-token prompts: every
    honest round is in every step, and no step computes more than the rounds and one chunk
    budget."""
    lim = BatchLimits(16, 4096, 512, prefill_share=0.0)
    honest = [fwd(2, 9, "h")] * 4
    attack = [fwd(8000, 1, "a")] * 8
    plans = simulate(attack + honest, lim, steps=40, active_sessions=12)
    for plan in plans:
        served = {r.index for r in plan.rows if r.decides and r.index >= 8}
        assert served == {8, 9, 10, 11}
        assert sum(r.tokens for r in plan.rows) <= 4 * 11 + 512
    # ... and the attacker still progresses: a chunk budget a step
    assert all(sum(r.tokens for r in p.rows if r.index < 8) == 512 for p in plans)


def test_two_tenants_long_prompts_progress_at_the_same_rate() -> None:
    lim = BatchLimits(16, 4096, 512, prefill_share=0.0)
    queue = [fwd(6000, 1, "a")] * 6 + [fwd(6000, 1, "b")]
    plans = simulate(queue, lim, steps=10, active_sessions=10)
    a = sum(r.chunk for p in plans for r in p.rows if r.index < 6)
    b = sum(r.chunk for p in plans for r in p.rows if r.index == 6)
    assert a == b == 10 * 256


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
    assert queue_eta(None, 0.0, [], times, LIM, rule, queued=False) == (0.0, False)
    run = RunningStep(started=100.0, tokens=110, slots=frozenset({1}))
    eta, stalled = queue_eta(run, 100.5, [], times, LIM, rule, queued=False)
    assert eta == pytest.approx(0.7) and not stalled
    # a round submitted now behind four rounds of 10 tokens: two more steps of 3 rows at most
    queue = [fwd(5)] * 4
    eta, _ = queue_eta(run, 100.5, queue, times, LIM, rule)
    assert eta == pytest.approx(0.7 + 2 * (0.1 + 0.01 * 30))
    assert queue_eta(run, 160.5, [], times, LIM, rule, queued=False) == (0.0, True)


def test_queue_eta_counts_a_prefill_in_chunks_not_as_its_age() -> None:
    times = StepTimes()
    times.anchor(10, 0.2)
    times.anchor(110, 1.2)
    lim = BatchLimits(8, 4096, 100, prefill_share=0.0)
    rule = StallRule()
    queue = [fwd(8000, 1, "a")]
    # a new round waits one step: nothing but the prefill's chunk ahead of it
    eta, _ = queue_eta(None, 0.0, queue, times, lim, rule)
    assert eta == pytest.approx(0.1 + 0.01 * 100)
    # the prefill itself: 81 chunks of 100
    eta, _ = queue_eta(None, 0.0, queue, times, lim, rule, until=0)
    assert eta == pytest.approx(81 * (0.1 + 0.01 * 100))


def test_model_drafts_only_in_steps_without_edge_drafted_work() -> None:
    assert model_drafts_allowed(0)
    assert not model_drafts_allowed(1) and not model_drafts_allowed(64)
    assert plan_step([cogen()], LIM).model_drafts
    assert not plan_step([cogen(), fwd(0)], LIM).model_drafts


def test_the_plan_names_each_rows_pages_and_cuts_a_chunk_to_the_pages_there_are() -> None:
    """The KV manager's figures (tokens cached, pages held, pages free): rounds take their pages
    first; a prefill's chunk is cut to what is left (whole pages), and planned as it is when not
    a page is left, so that it fails at once instead of waiting without bound."""
    lim = BatchLimits(8, 4096, 512, prefill_share=0.0)
    rnd = Queued(Kind.FORWARD, 2, 9, "h", cached=30, held=2)  # 30 + 11 tokens: one page more
    long = Queued(Kind.FORWARD, 2000, 1, "a", cached=0, held=0)
    plan = plan_step([rnd, long], lim, active_sessions=2, pages=Pages(free=6, size=16))
    assert [(r.index, r.tokens, r.pages) for r in plan.rows] == [(0, 11, 1), (1, 80, 5)]
    plan = plan_step([rnd, long], lim, active_sessions=2, pages=Pages(free=1, size=16))
    assert [(r.index, r.tokens, r.pages) for r in plan.rows] == [(0, 11, 1), (1, 512, 32)]
    plan = plan_step([rnd, long], lim, active_sessions=2)  # no page figures: none named
    assert [(r.index, r.tokens, r.pages) for r in plan.rows] == [(0, 11, 0), (1, 512, 0)]


def test_beside_other_tenants_rounds_a_prefill_earns_its_share_of_their_step_time() -> None:
    """Deficit round robin by time (Sarathi-Serve's stall-free budget, on average): one
    tenant's prompt earns prefill_share (a quarter) of the step time a + b·k·m of the other
    tenants' rounds each step, and spends it on a chunk once that buys 16 tokens. With a/b = 40
    and four rounds of 11 (84 a step), 21 a step: the chunk (its cache past twice theirs, a
    forward of its own: 40 + p) comes every third step, 63 − 40 = 23 tokens; no step grows by
    more than the rounds' own. Sixty-four rounds: 0.25 · 744 = 186 a step, 146 tokens each."""
    lim = BatchLimits(16, 4096, 512, prefill_share=0.25)
    honest = [fwd(2, 9, "h")] * 4
    credit: dict[str, float] = {}
    got = []
    for _ in range(9):
        plan = plan_step(
            [fwd(8000, 1, "a"), *honest], lim, active_sessions=5, overhead_tokens=40, credit=credit
        )
        credit = dict(plan.credit)
        got.append(sum(r.tokens for r in plan.rows if r.index == 0))
        assert plan.forwards == (2 if got[-1] else 1)
    assert got == [0, 0, 23] * 3
    many = [fwd(2, 9, "h")] * 64
    lim64 = BatchLimits(80, 8192, 512, prefill_share=0.25)
    plan = plan_step([fwd(8000, 1, "a"), *many], lim64, active_sessions=65, overhead_tokens=40)
    assert [(r.index, r.tokens) for r in plan.rows if r.index == 0] == [(0, 146)]
    # no round of the others queued yet: a typical step's shape stands for theirs
    plan = plan_step(
        [fwd(8000, 1, "a")],
        lim64,
        65,
        40,
        typical_rounds={"h": 704},
        typical_shape=(64, 11, 11),
    )
    assert rows(plan) == [(0, 146, 146)]
    # beside its own tenant's rounds only, the chunk; alone on the engine, the room
    own = [fwd(2, 9, "a")] * 4
    plan = plan_step([fwd(8000, 1, "a"), *own], lim, active_sessions=5, overhead_tokens=40)
    assert [(r.index, r.tokens) for r in plan.rows if r.index == 0] == [(0, 512)]
    plan = plan_step([fwd(8000, 1, "a")], lim, active_sessions=1, overhead_tokens=40)
    assert rows(plan) == [(0, 4096, 4096)]
    # the honest tenant's own prompt beside the held one: the budget is its
    plan = plan_step(
        [fwd(8000, 1, "a"), fwd(300, 1, "h"), *honest], lim, active_sessions=6, overhead_tokens=40
    )
    assert [(r.index, r.tokens) for r in plan.rows if r.index < 2] == [(1, 301)]
    # the share off, or nothing measured yet: the chunk alone bounds it
    off = BatchLimits(16, 4096, 512, prefill_share=0.0)
    plan = plan_step([fwd(8000, 1, "a"), *honest], off, active_sessions=5, overhead_tokens=40)
    assert [(r.index, r.tokens) for r in plan.rows if r.index == 0] == [(0, 512)]
    plan = plan_step([fwd(8000, 1, "a"), *honest], lim, 5, overhead_tokens=float("inf"))
    assert [(r.index, r.tokens) for r in plan.rows if r.index == 0] == [(0, 512)]


def test_a_held_prompt_always_moves() -> None:
    """However small the others' rounds against a forward's overhead, savings reach the price
    of a 16-token chunk: the prompt moves, slowly."""
    lim = BatchLimits(16, 4096, 512, prefill_share=0.25)
    credit: dict[str, float] = {}
    got = []
    for _ in range(12):
        plan = plan_step(
            [fwd(8000, 1, "a")],
            lim,
            2,
            1.0,
            typical_rounds={"h": 10},
            typical_shape=(1, 10, 10),
            credit=credit,
        )
        credit = dict(plan.credit)
        got.append(sum(r.tokens for r in plan.rows))
    assert MIN_PREFILL in got and all(g in (0, MIN_PREFILL) for g in got)


def test_a_share_above_one_buys_chunks_larger_than_the_rounds_step() -> None:
    """On a GPU a forward's overhead dwarfs a few rounds (a/b = 2000 beside 16 rounds of 9):
    at a share of 0.25 a prompt apart from them saves four steps for a 144-token chunk (one
    rounds' step: the step at most doubles); an operator who sets prefill_share = 2 lets a
    step grow threefold, for a 2 · 2144 − 2000 = 2288-token budget, cut to the chunk (512)."""
    honest = [fwd(2, 7, "h")] * 16
    for share, want in ((0.25, [0, 0, 0, 144]), (2.0, [512, 512, 512, 512])):
        lim = BatchLimits(32, 8192, 512, prefill_share=share)
        credit: dict[str, float] = {}
        got = []
        for _ in range(4):
            plan = plan_step(
                [fwd(8000, 1, "a"), *honest],
                lim,
                active_sessions=17,
                overhead_tokens=2000,
                credit=credit,
            )
            credit = dict(plan.credit)
            got.append(sum(r.tokens for r in plan.rows if r.index == 0))
        assert got == want, (share, got)
