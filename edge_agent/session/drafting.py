"""What a core's driver may ask of its drafting (:class:`DraftingCore`): the
:class:`~edge_agent.session.pipeline.Pipeline`'s drafting rules, its prepared outcomes and
hedges, behind the single-verifier core and the federated one, which both derive from it. No
I/O, no clock, no model.

Invariant: a driver talks to a core only through these methods and the core's events; it never
holds the pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edge_agent.session.branches import Branch, Growing, HedgePlan, PendingBatch, PredraftPlan
from edge_agent.session.events import Count, EdgeEvent
from edge_agent.session.generation import Generation
from edge_agent.session.pipeline import DraftPlan, Pipeline
from edge_agent.session.pipeline_config import PipelineConfig


class DraftingCore:
    """What a core's driver may ask of its drafting
    (:class:`~edge_agent.session.core.SingleCore`, the federated core): the :class:`Pipeline`'s
    rules, behind the core, so that a driver talks to a core only through its methods and events
    (it never holds the pipeline)."""

    cfg: PipelineConfig
    pipe: Pipeline

    @property
    def gen(self) -> Generation:
        return self.pipe.gen

    @property
    def rng(self) -> np.random.Generator:
        """The generation's randomness (the drafter draws from it too, in order)."""
        return self.pipe.rng

    def may_draft(self) -> bool:
        return self.pipe.may_draft()

    def plan(self) -> DraftPlan | None:
        return self.pipe.plan()

    def current(self, plan: DraftPlan, draft: Sequence[int] = ()) -> bool:
        return self.pipe.current(plan, draft)

    def wants_more(self, plan: DraftPlan, draft: Sequence[int], prob: float = 1.0) -> bool:
        return self.pipe.wants_more(plan, draft, prob)

    def on_draft_step(self, seconds: float) -> None:
        self.pipe.on_draft_step(seconds)

    def start_batch(self) -> tuple[DraftPlan, Branch]:
        """The next batch's plan and what it starts from: the prepared branch that continues it
        (:meth:`~edge_agent.session.branches.BranchBook.take_branch`; what taking it counts goes
        into the generation's stats), else nothing drafted yet. Only while :meth:`may_draft` is
        true (there is a plan)."""
        plan = self.plan()
        assert plan is not None
        ready, counts = self.pipe.book.take_branch(plan)
        for count in counts:
            self.gen.stats.apply(count)
        return plan, ready or Branch(list(plan.context), [], [], [])

    def hedge_plan(self) -> HedgePlan | None:
        return self.pipe.book.hedge_plan()

    def hedge_current(self, hp: HedgePlan) -> bool:
        return self.pipe.book.hedge_current(hp)

    def branch_room(self) -> int:
        """Outcomes that may still be prepared (PipelineConfig.predraft) besides those prepared
        (kept or growing)."""
        book = self.pipe.book
        return self.cfg.predraft - len(book.branches) - len(book.growing)

    def plan_branches(self, budget: int, pending: PendingBatch | None = None) -> list[Growing]:
        """Up to ``budget`` outcomes to prepare now, likeliest first
        (:meth:`~edge_agent.session.branches.BranchBook.predraft_plans`; ``pending``: the batch
        being drafted, whose positions may fork too); they grow in the book."""
        book = self.pipe.book
        book.predraft_plans(budget, pending)
        return [g for g in book.growing if not g.draft][:budget]

    def branch_rows(self, room: int, pending: PendingBatch | None = None) -> list[Growing]:
        """The branches to step now, at most ``room`` (beside a batch being drafted,
        ``pending``, or alone while the pipeline is full): new outcomes planned where the
        budget allows, then every branch still growing, the oldest (likeliest when planned)
        first."""
        if room <= 0 or not self.cfg.predraft:
            return []
        open_ = [g for g in self.pipe.book.growing if self.branch_open(g)]
        if len(open_) < room:
            self.plan_branches(room - len(open_), pending)
        return [g for g in self.pipe.book.growing if self.branch_open(g)][:room]

    def predraft_current(self, pp: PredraftPlan, draft: Sequence[int] = ()) -> bool:
        return self.pipe.book.predraft_current(pp, draft)

    def branch_open(self, g: Growing) -> bool:
        """May ``g`` grow by another token: short of its length, not ended by an
        end-of-sequence id, and its context still open (:meth:`predraft_current`)."""
        return (
            len(g.draft) < g.pp.max_tokens
            and not (g.draft and g.draft[-1] in self.gen.eos_ids)
            and self.pipe.book.predraft_current(g.pp, g.draft)
        )

    def grew(self, g: Growing) -> list[EdgeEvent]:
        """``g`` grew by a token (its driver added it): what that sends (token trees:
        :meth:`~edge_agent.session.core.SingleCore.tree_branch`), and, once it has stopped
        growing, its keeping (its counts go into the generation's stats)."""
        if self.branch_open(g):
            return []
        if g in self.pipe.book.growing:
            for count in self.pipe.book.add_branch(g):
                self.gen.stats.apply(count)
        return []

    def settle_branches(self) -> None:
        """Keep every branch that has stopped growing (its counts into the stats)."""
        for g in [g for g in self.pipe.book.growing if g.draft and not self.branch_open(g)]:
            for count in self.pipe.book.add_branch(g):
                self.gen.stats.apply(count)

    def add_branch(self, g: Growing) -> list[Count]:
        """Keep what was drafted for ``g.pp``
        (:meth:`~edge_agent.session.branches.BranchBook.add_branch`)."""
        return self.pipe.book.add_branch(g)

    def verdict_deadline(self, floor_s: float) -> float | None:
        return self.pipe.verdict_deadline(floor_s)

    def overdue(self, now: float, deadline: float) -> str:
        return self.pipe.overdue(now, deadline)
