"""The drafting every edge core shares (:class:`DraftingCore`, the base of the single-verifier
core and the federated one): starting a batch from a prepared branch, planning, growing and
keeping the branches. No I/O, no clock, no model.

Invariant: a driver changes a core's state only through the core's methods (these, and each
core's own) and carries out the events they return; it reads the drafting facts (the plan, the
verdict deadline, hedge and branch plans) from their owners, the core's
:class:`~edge_agent.session.pipeline.Pipeline` (``core.pipe``) and its
:class:`~edge_agent.session.branches.BranchBook` (``core.pipe.book``), with no layer between.
"""

from __future__ import annotations

import numpy as np

from edge_agent.session.branches import Branch, Growing, PendingBatch
from edge_agent.session.events import EdgeEvent
from edge_agent.session.generation import Generation
from edge_agent.session.pipeline import DraftPlan, Pipeline
from edge_agent.session.pipeline_config import PipelineConfig


class DraftingCore:
    """The drafting both cores share (:class:`~edge_agent.session.core.SingleCore`, the
    federated core): what changes the pipeline's branches goes through here (module
    docstring)."""

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
        """Whether a batch may be drafted now (each core adds its own state to the
        pipeline's rule)."""
        return self.pipe.may_draft()

    def on_draft_step(self, seconds: float) -> None:
        self.pipe.on_draft_step(seconds)

    def start_batch(self) -> tuple[DraftPlan, Branch]:
        """The next batch's plan and what it starts from: the prepared branch that continues it
        (:meth:`~edge_agent.session.branches.BranchBook.take_branch`; what taking it counts goes
        into the generation's stats), else nothing drafted yet. Only while :meth:`may_draft` is
        true (there is a plan)."""
        plan = self.pipe.plan()
        assert plan is not None
        ready, counts = self.pipe.book.take_branch(plan)
        for count in counts:
            self.gen.stats.apply(count)
        return plan, ready or Branch(list(plan.context), [], [], [])

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
