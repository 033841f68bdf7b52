"""The edge's branch planning as pure functions over a draft's confidences and a budget: where a
rejection is likely, which corrections get a branch, how many, and how the session's own
measured acceptance moves it (per-session adaptation); and the book that plans them beside
the batch being drafted."""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.session.branch_plan import BranchBudget, Fork, coverage, outcomes, plan
from edge_agent.session.branches import PendingBatch, Rival
from edge_agent.session.generation import Generation
from edge_agent.session.pipeline import Pipeline
from edge_agent.session.pipeline_config import PipelineConfig
from shared.maths.acceptance import Acceptance
from shared.maths.sampling import SamplingParams

pytestmark = pytest.mark.fast


def rival(conf: float, *alts: tuple[int, float]) -> Rival:
    return Rival(alts[0][0], conf, tuple(alts))


def calibrated(alpha: float) -> Acceptance:
    """A session whose draft tokens of confidence 0.8 were accepted at ``alpha``."""
    acc = Acceptance()
    for k in range(400):
        acc.observe([0.8], 1 if k % 20 < alpha * 20 else 0)
    return acc


def test_outcomes_are_ranked_by_their_chance_to_be_the_first_correction() -> None:
    acc = Acceptance()  # prior: â(c) = c
    fork = Fork(
        10,
        [1, 2, 3],
        [rival(0.9, (7, 0.08)), rival(0.5, (8, 0.3), (9, 0.1)), rival(0.99, (6, 0.01))],
    )
    ranked = outcomes([fork], 10, acc)
    first = ranked[0]
    # position 11 (an unsure token after a sure one) is the likeliest place to be rejected
    assert (first.pos, first.token) == (11, 8)
    lk = {(o.pos, o.token): o.likelihood for o in ranked}
    # L(i, y) = Π_{j<i} â(c_j) · (1 − â(c_i)) · q_i(y) / (1 − c_i), â(c) = c under the prior
    assert lk[(10, 7)] == pytest.approx(0.1 * 0.08 / 0.1)
    assert lk[(11, 8)] == pytest.approx(0.9 * 0.5 * 0.3 / 0.5)
    assert lk[(11, 9)] == pytest.approx(0.9 * 0.5 * 0.1 / 0.5)
    # (no token is taken as certain: â ≤ 0.98)
    assert lk[(12, 6)] == pytest.approx(0.9 * 0.5 * (1 - 0.98) * 0.01 / 0.01)
    # decided positions are no outcome; the drafted token is no correction
    assert all(o.pos >= 11 for o in outcomes([fork], 11, acc))
    same = Fork(0, [5], [rival(0.5, (5, 0.4), (6, 0.1))])
    assert [o.token for o in outcomes([same], 0, acc)] == [6]


def test_planning_spends_within_the_budget_and_never_twice() -> None:
    acc = Acceptance()
    forks = [Fork(0, [1] * 6, [rival(0.6, (7, 0.3), (8, 0.1))] * 6)]
    ranked = outcomes(forks, 0, acc)
    chosen = plan(ranked, set(), 0, BranchBudget(kept=3, floor=0.0), room=8)
    assert len(chosen) == 3 and chosen == ranked[:3]
    # what is planned already is skipped; what is prepared counts against the cap
    again = plan(ranked, {(c.pos, c.token) for c in chosen}, 3, BranchBudget(5, 0.0), room=8)
    assert len(again) == 2 and not {(c.pos, c.token) for c in chosen} & {
        (a.pos, a.token) for a in again
    }
    # the drafter's room bounds it too; the floor leaves the unlikely out
    assert len(plan(ranked, set(), 0, BranchBudget(8, 0.0), room=1)) == 1
    floor = 0.05
    assert all(o.likelihood >= floor for o in plan(ranked, set(), 0, BranchBudget(8, floor), 8))
    with pytest.raises(ValueError):
        BranchBudget(-1)
    with pytest.raises(ValueError):
        BranchBudget(2, floor=1.0)


def test_a_sure_draft_gets_no_branch_and_an_unsure_one_gets_several() -> None:
    acc = Acceptance()
    sure = [Fork(0, [1] * 8, [rival(0.999, (7, 0.0008))] * 8)]
    unsure = [Fork(0, [1] * 8, [rival(0.55, (7, 0.3), (8, 0.1))] * 8)]
    budget = BranchBudget(kept=8, floor=0.02)
    assert plan(outcomes(sure, 0, acc), set(), 0, budget, 8) == []
    assert len(plan(outcomes(unsure, 0, acc), set(), 0, budget, 8)) >= 4


def test_the_sessions_measured_acceptance_moves_where_branches_go() -> None:
    """Per-session adaptation: the same draft confidences, two sessions. Where the target
    accepts the draft less often than its confidence says, a rejection is likelier and comes
    earlier: its first positions' outcomes outweigh the other session's, and its branches
    gather there; where it accepts more often, they reach further down the drafts."""
    forks = [Fork(0, [1] * 8, [rival(0.8, (7, 0.15), (8, 0.04))] * 8)]
    budget = BranchBudget(kept=16, floor=0.03)
    good, poor = calibrated(0.95), calibrated(0.5)
    assert good.alpha > 0.9 and poor.alpha < 0.55
    ranked_good, ranked_poor = outcomes(forks, 0, good), outcomes(forks, 0, poor)
    assert ranked_poor[0].pos == ranked_good[0].pos == 0
    assert ranked_poor[0].likelihood > 2 * ranked_good[0].likelihood
    assert sum(o.likelihood for o in ranked_poor) > sum(o.likelihood for o in ranked_good)
    deepest = max(o.pos for o in plan(ranked_good, set(), 0, budget, 16))
    assert deepest > max(o.pos for o in plan(ranked_poor, set(), 0, budget, 16))


def test_coverage_is_the_likelihood_the_prepared_branches_hold() -> None:
    acc = Acceptance()
    ranked = outcomes([Fork(0, [1, 1], [rival(0.5, (7, 0.4), (8, 0.1))] * 2)], 0, acc)
    assert coverage(ranked, set()) == 0.0
    assert coverage(ranked, {(o.pos, o.token) for o in ranked}) == pytest.approx(1.0)
    top = ranked[0]
    assert coverage(ranked, {(top.pos, top.token)}) == pytest.approx(
        top.likelihood / sum(o.likelihood for o in ranked)
    )
    assert coverage([], set()) == 1.0


def test_the_book_plans_branches_at_the_positions_of_the_batch_being_drafted() -> None:
    """Branches fork inside the batch being drafted (before it is sent), so that they can ride
    with it; each outcome once per pipeline version; the cap counts growing branches."""
    gen = Generation([1, 2, 3], 32)
    cfg = PipelineConfig(predraft=3, tree=True, sampling=SamplingParams(0.0), branch_floor=0.0)
    pipe = Pipeline(gen, cfg, np.random.default_rng(0), gamma=4, deterministic_draft=True)
    pending = PendingBatch(3, [4, 5], [rival(0.6, (9, 0.3)), rival(0.7, (10, 0.2))])
    plans = pipe.book.predraft_plans(8, pending)
    assert [(p.pos, p.token) for p in plans] == [(3, 9), (4, 10)]
    assert plans[0].context == [1, 2, 3] and plans[1].context == [1, 2, 3, 4]
    assert len(pipe.book.growing) == 2
    assert pipe.book.predraft_plans(8, pending) == []  # planned once
    assert pipe.book.coverage(pending) == pytest.approx(1.0)
