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

from edge_agent.session.branches import Branch, Growing, HedgePlan, PredraftPlan
from edge_agent.session.events import Count
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
        """Outcomes that may still be prepared (PipelineConfig.predraft) besides those kept."""
        return self.cfg.predraft - len(self.pipe.book.branches)

    def predraft_plan(self) -> PredraftPlan | None:
        return self.pipe.book.predraft_plan()

    def predraft_current(self, pp: PredraftPlan, draft: Sequence[int] = ()) -> bool:
        return self.pipe.book.predraft_current(pp, draft)

    def plan_branches(self, budget: int) -> list[Growing]:
        """Up to ``budget`` outcomes to prepare now, likeliest first (:meth:`predraft_plan`)."""
        out: list[Growing] = []
        while len(out) < budget and (pp := self.pipe.book.predraft_plan()) is not None:
            out.append(Growing(pp))
        return out

    def branch_open(self, g: Growing) -> bool:
        """May ``g`` grow by another token: short of its length, not ended by an
        end-of-sequence id, and its context still open (:meth:`predraft_current`)."""
        return (
            len(g.draft) < g.pp.max_tokens
            and not (g.draft and g.draft[-1] in self.gen.eos_ids)
            and self.pipe.book.predraft_current(g.pp, g.draft)
        )

    def add_branch(self, g: Growing) -> list[Count]:
        """Keep what was drafted for ``g.pp``
        (:meth:`~edge_agent.session.branches.BranchBook.add_branch`)."""
        return self.pipe.book.add_branch(g)

    def verdict_deadline(self, floor_s: float) -> float | None:
        return self.pipe.verdict_deadline(floor_s)

    def overdue(self, now: float, deadline: float) -> str:
        return self.pipe.overdue(now, deadline)
