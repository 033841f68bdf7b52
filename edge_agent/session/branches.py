"""Outcome pre-drafting and hedging at the edge: what a drafter prepares besides the next batch,
and :class:`BranchBook`, the one owner of what is prepared. No I/O, no clock, no model.

At each draft step the draft's runner-up tokens (:class:`Rival`) say where a rejection would
likely go. *Hedges* (PipelineConfig.hedge) draft on after the rival of an unsure draft token and
go to a verifier that co-generates; *prepared outcomes* (PipelineConfig.predraft) draft a
:class:`Branch` after a likely correction, the next batch should the committed text become its
context: planned where a rejection is likely (:mod:`edge_agent.session.branch_plan`, from the
draft's confidences and the session's measured acceptance, :attr:`BranchBook.acceptance`),
grown a token a draft step beside the batch being drafted (and while the pipeline is full), and
with ``tree`` sent to the verifier as they grow. The
:class:`~edge_agent.session.pipeline.Pipeline` owns one :class:`BranchBook` and delegates to
it; the book reads the pipeline's text, batches in flight and version (:class:`PipelineView`:
this module sits below the pipeline's) and reports its counts through it.

Invariants: a mark (a position hedged, an outcome planned) holds for one pipeline version only
(:class:`VersionMarks`: a rejection or a rebase voids what was planned on the text before it);
at most ``cfg.predraft`` branches are prepared at once (growing or kept), each while the
committed text may still become its context and draft.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, Protocol, TypeVar

from edge_agent.session.branch_plan import BranchBudget, Fork, Outcome, coverage, outcomes, plan
from edge_agent.session.events import Count, Counter
from edge_agent.session.generation import Generation
from edge_agent.session.pipeline_config import PipelineConfig
from shared.maths.acceptance import Acceptance
from shared.maths.sampling import Probs

T = TypeVar("T")


@dataclass(frozen=True)
class Rival:
    """At one draft step: the draft's most likely token other than the one it drafted, and its
    own (temperature-1) probability of the drafted one."""

    token: int
    conf: float
    #: The draft's likeliest tokens other than the drafted one, likeliest first (``token`` is
    #: the first), each with its temperature-1 probability q(y): where outcome pre-drafting
    #: prepares branches. Empty: only ``token`` is known, with the rest of the mass, 1 − conf.
    alts: tuple[tuple[int, float], ...] = ()

    def alternatives(self) -> tuple[tuple[int, float], ...]:
        """(token, q) of each known alternative (``alts``, or ``token`` with 1 − conf)."""
        return self.alts or ((self.token, 1.0 - self.conf),)


#: A step whose rival was not computed: full confidence, never hedged.
NO_RIVAL: Final = Rival(0, 1.0)


@dataclass(frozen=True)
class HedgePlan:
    """A hedge to draft (PipelineConfig.hedge): up to ``max_tokens`` tokens after ``context``
    + ``token`` (the rival of the draft token at ``pos``), while the pipeline's version is
    still ``version``."""

    version: int
    pos: int
    token: int
    context: list[int]
    max_tokens: int


@dataclass(frozen=True)
class PredraftPlan:
    """An outcome to prepare (PipelineConfig.predraft): ``token``, the draft's second choice at
    ``pos``, is the likeliest correction should the draft token there be rejected; draft up to
    ``max_tokens`` tokens after ``context`` (the text before ``pos``) + ``token``, as the next
    batch would be drafted then (``deterministic`` as the pipeline's drafts)."""

    pos: int
    token: int
    context: list[int]
    max_tokens: int
    deterministic: bool


@dataclass
class Branch:
    """A prepared outcome: draft tokens after ``context``, each with the q row it was drawn from
    and its rival; ``prob``: the draft's probability of the last one. Should the committed text
    become ``context`` (and nothing in flight extend it), it is the next batch."""

    context: list[int]
    draft: list[int]
    q_rows: list[Probs]
    rivals: list[Rival]
    prob: float = 1.0


@dataclass(frozen=True)
class PendingBatch:
    """The batch being drafted, as branch planning reads it (its positions may fork before it
    is sent): ``start`` the position of ``draft[0]`` (the end of the text it is drafted
    after), its tokens so far and their rivals."""

    start: int
    draft: Sequence[int]
    rivals: Sequence[Rival]

    @property
    def live(self) -> Sequence[int]:
        return self.draft


@dataclass
class Growing:
    """A branch being drafted for ``pp`` (by a driver): its tokens so far, their q rows and
    rivals, and the draft's probability of the last one."""

    pp: PredraftPlan
    draft: list[int] = field(default_factory=list)
    q_rows: list[Probs] = field(default_factory=list)
    rivals: list[Rival] = field(default_factory=list)
    prob: float = 1.0

    def add(self, token: int, q: Probs, rival: Rival, prob: float) -> None:
        """One more drafted token: its q row, its rival and the draft's probability of it."""
        self.draft.append(token)
        self.q_rows.append(q)
        self.rivals.append(rival)
        self.prob = prob


class VersionMarks(Generic[T]):
    """Marks that hold while the pipeline's version stays: the set of another version is
    empty (a rejection or a rebase voids what was planned on the text before it)."""

    def __init__(self) -> None:
        self._marks: set[T] = set()
        self._version = 0

    def at(self, version: int) -> set[T]:
        """The marks of ``version`` (those of an older one are dropped), to read and add to."""
        if version != self._version:
            self._marks, self._version = set(), version
        return self._marks


class BatchView(Protocol):
    """What the book reads of a batch in flight (:class:`~edge_agent.session.pipeline.Batch`)
    or being drafted (:class:`PendingBatch`)."""

    @property
    def start(self) -> int: ...
    @property
    def draft(self) -> Sequence[int]: ...
    @property
    def rivals(self) -> Sequence[Rival]: ...
    @property
    def live(self) -> Sequence[int]: ...


class PlanView(Protocol):
    """What the book reads of a batch's plan (:class:`~edge_agent.session.pipeline.DraftPlan`)."""

    @property
    def context(self) -> list[int]: ...
    @property
    def max_tokens(self) -> int: ...


class PipelineView(Protocol):
    """What the book reads of its pipeline (:class:`~edge_agent.session.pipeline.Pipeline`,
    which owns these facts) and how it reports a count through it."""

    gen: Generation
    cfg: PipelineConfig
    version: int
    budget: int
    deterministic_draft: bool

    @property
    def inflight(self) -> Iterable[BatchView]: ...
    @property
    def tail(self) -> list[int]: ...
    @property
    def gamma(self) -> int: ...
    def count(self, counter: Counter, n: int = 1) -> None: ...


class BranchBook:
    """The prepared outcomes and the hedges of one pipeline (module docstring): what is kept,
    planned, taken, classified as a hit or a miss, pruned."""

    def __init__(self, pipe: PipelineView) -> None:
        self.pipe = pipe
        #: Positions hedged since the version last changed (one hedge per position).
        self._hedged: VersionMarks[int] = VersionMarks()
        #: Hedges sent, (pos, tokens from pos on), newest last: to count the verifier's hits.
        self.hedges: deque[tuple[int, list[int]]] = deque(maxlen=8)
        #: Prepared outcomes (PipelineConfig.predraft): kept (done growing) and growing, at
        #: most cfg.predraft of them together.
        self.branches: list[Branch] = []
        self.growing: list[Growing] = []
        #: The session's measured acceptance of its draft tokens against their confidences
        #: (where branch planning expects rejections: :mod:`edge_agent.session.branch_plan`).
        self.acceptance = Acceptance()
        self._ranked_key: object = None
        self._ranked_list: list[Outcome] = []
        #: (pos, token) outcomes planned since the version last changed (each prepared once).
        self._predrafted: VersionMarks[tuple[int, int]] = VersionMarks()
        #: A rejection whose correction had a branch planned but not yet kept: a hit if that
        #: branch is taken for the next batch, else a miss for time (decided at that push).
        self._late_branch = False

    # ------------------------------------------------------------ hedging

    def hedge_plan(self) -> HedgePlan | None:
        """The least confident undecided draft token in flight below ``cfg.hedge_below`` that
        has no hedge yet (marked hedged now), or None. Only with co-generation and a
        deterministic draft: the verifier uses a hedge only where it draws corrections itself,
        and drafting a hedge then consumes no randomness."""
        pipe = self.pipe
        cfg = pipe.cfg
        if not (cfg.hedge and cfg.cogen and pipe.deterministic_draft) or pipe.gen.done:
            return None
        hedged = self._hedged.at(pipe.version)
        c = len(pipe.gen.committed)
        best: tuple[float, int, int] | None = None  # (conf, pos, rival)
        for b in pipe.inflight:
            for i, r in enumerate(b.rivals[: len(b.live)]):
                pos = b.start + i
                if pos < c or pos in hedged or r.conf >= cfg.hedge_below:
                    continue
                if best is None or r.conf < best[0]:
                    best = (r.conf, pos, r.token)
        if best is None:
            return None
        _, pos, token = best
        hedged.add(pos)
        text = pipe.gen.committed + pipe.tail
        room = pipe.gen.room - (pos + 1 - c)
        return HedgePlan(pipe.version, pos, token, text[:pos], min(cfg.hedge, room))

    def hedge_current(self, hp: HedgePlan) -> bool:
        return hp.version == self.pipe.version and not self.pipe.gen.done

    def sent_hedge(self, pos: int, tokens: list[int]) -> None:
        """A Hedge frame went out for ``tokens`` from ``pos`` on: kept to count the verifier's
        hits (:meth:`hedge_hit`)."""
        self.hedges.append((pos, tokens))

    def hedge_hit(self, token: int) -> bool:
        """Is ``token``, co-generated at the committed end, the next token of a hedge sent
        whose tokens so far are the committed text from its position on (a hedge hit)?"""
        committed = self.pipe.gen.committed
        c = len(committed)
        return any(
            0 < c - p < len(ids) and ids[: c - p + 1] == [*committed[p:], token]
            for p, ids in self.hedges
        )

    # ------------------------------------------------------------ outcome pre-drafting

    def _open_to(self, text: Sequence[int]) -> bool:
        """May the committed text still become ``text`` or run into it (it is a prefix of
        ``text``)? Only the tail after the committed text can still change."""
        c = self.pipe.gen.committed
        return len(c) <= len(text) and list(text[: len(c)]) == c

    def prune(self) -> None:
        """Drop the branches the committed text has left (it disagrees with their context or
        their draft, or has passed their end)."""
        self.branches = [b for b in self.branches if self._open_to([*b.context, *b.draft])]
        self.growing = [
            g for g in self.growing if self._open_to([*g.pp.context, g.pp.token, *g.draft])
        ]

    def observe(self, rivals: Sequence[Rival], verified: int, accepted: int) -> None:
        """A round's verdict: of a batch whose draft steps had ``rivals``, ``verified`` draft
        tokens were decided and the first ``accepted`` accepted (calibrates :attr:`acceptance`
        with the draft's confidences of the tokens reached)."""
        if len(rivals) >= verified > 0 and all(r is not NO_RIVAL for r in rivals[:verified]):
            self.acceptance.observe([r.conf for r in rivals[:verified]], accepted)

    def _forks(self, pending: BatchView | None) -> list[Fork]:
        pipe = self.pipe
        forks = [Fork(b.start, b.live, b.rivals) for b in pipe.inflight]
        if pending is not None:
            forks.append(Fork(pending.start, pending.draft, pending.rivals))
        return forks

    def _ranked(self, pending: BatchView | None) -> list[Outcome]:
        """The outcomes of the drafts in flight and ``pending``, likeliest first
        (:func:`~edge_agent.session.branch_plan.outcomes`), ranked again only when what they
        read has moved: the pipeline's version, the committed text, the batches in flight,
        the pending batch, the session's acceptance (a verdict moves the committed text)."""
        pipe = self.pipe
        key = (
            pipe.version,
            len(pipe.gen.committed),
            sum(1 for _ in pipe.inflight),
            sum(len(b.live) for b in pipe.inflight),
            (pending.start, len(pending.draft)) if pending is not None else None,
            self.acceptance.alpha,
        )
        if self._ranked_key != key:
            c = len(pipe.gen.committed)
            floor = pipe.cfg.branch_floor
            self._ranked_list = outcomes(self._forks(pending), c, self.acceptance, floor)
            self._ranked_key = key
        return self._ranked_list

    def coverage(self, pending: BatchView | None = None) -> float:
        """The chance that the next rejection's correction has a branch prepared
        (:func:`~edge_agent.session.branch_plan.coverage`)."""
        ranked = outcomes(self._forks(pending), len(self.pipe.gen.committed), self.acceptance)
        prepared = {(len(b.context) - 1, b.context[-1]) for b in self.branches if b.context}
        prepared |= {(g.pp.pos, g.pp.token) for g in self.growing}
        return coverage(ranked, prepared)

    def predraft_plan(self, pending: BatchView | None = None) -> PredraftPlan | None:
        """The likeliest outcome to prepare next, or None (:meth:`predraft_plans` of one)."""
        plans = self.predraft_plans(1, pending)
        return plans[0] if plans else None

    def predraft_plans(self, room: int, pending: BatchView | None = None) -> list[PredraftPlan]:
        """Up to ``room`` outcomes to prepare now, likeliest first, each marked planned (one
        branch per position and correction, per pipeline version): of the outcomes of the
        undecided draft tokens in flight and of ``pending`` (the batch being drafted), those
        :func:`~edge_agent.session.branch_plan.plan` chooses within the budget (``cfg.predraft``
        prepared at once, none below ``cfg.branch_floor``).

        Exact (why a branch may be sent as an ordinary batch): its tokens are drawn from q
        after its own context with randomness the verifier never sees, before the verdict at
        its position is known; it is used only when the committed text turns out to be that
        context, an event that does not depend on the branch's draws. Given that event, the
        branch is distributed as a batch drafted after the verdict would be, and it is verified
        like one with the q rows it was drawn from."""
        pipe = self.pipe
        cfg = pipe.cfg
        if not cfg.predraft or pipe.gen.done or room <= 0:
            return []
        self.prune()
        prepared = len(self.branches) + len(self.growing)
        if prepared >= cfg.predraft:
            return []
        predrafted = self._predrafted.at(pipe.version)
        c = len(pipe.gen.committed)
        ranked = self._ranked(pending)
        budget = BranchBudget(cfg.predraft, cfg.branch_floor)
        text = pipe.gen.committed + pipe.tail + (list(pending.draft) if pending else [])
        out: list[PredraftPlan] = []
        for o in plan(ranked, predrafted, prepared, budget, room):
            predrafted.add((o.pos, o.token))
            left = pipe.gen.room - (o.pos + 1 - c)
            if left <= 0 or o.token in pipe.gen.eos_ids or o.pos > len(text):
                continue
            pp = PredraftPlan(
                o.pos,
                o.token,
                text[: o.pos],
                min(pipe.gamma, pipe.budget, left),
                deterministic=pipe.deterministic_draft,
            )
            out.append(pp)
            self.growing.append(Growing(pp))
        return out

    def predraft_current(self, pp: PredraftPlan, draft: Sequence[int] = ()) -> bool:
        """Is preparing ``pp`` (``draft`` so far) still worth it: the committed text may still
        become its context, and the session is not done."""
        return not self.pipe.gen.done and self._open_to([*pp.context, pp.token, *draft])

    def add_branch(self, g: Growing) -> list[Count]:
        """Keep the branch drafted for ``g.pp`` (if it is still open and has tokens), done
        growing; returns what it counts (a branch prepared, and its tokens)."""
        pp, draft = g.pp, g.draft
        # it grows no more (whoever drafted it: a driver's own Growing for the plan replaces
        # the book's)
        self.growing = [x for x in self.growing if (x.pp.pos, x.pp.token) != (pp.pos, pp.token)]
        if not draft or not self.predraft_current(pp, draft):
            return []
        counts = [Count(Counter.PREDRAFT_BRANCHES), Count(Counter.PREDRAFT_TOKENS, len(draft))]
        self.prune()
        ctx = [*pp.context, pp.token]
        self.branches.append(Branch(ctx, list(draft), list(g.q_rows), list(g.rivals), g.prob))
        return counts

    def take_branch(self, plan: PlanView) -> tuple[Branch | None, list[Count]]:
        """The prepared branch that continues ``plan``'s context, cut to what the plan still
        needs (its head may already be committed: co-generated tokens that agree with it),
        removed from those kept (None if none does), and what taking it counts (the tokens it
        carries; a hit where its rejection found it still growing, :meth:`classify_miss`)."""
        self.prune()
        ctx = plan.context
        # A branch still growing is taken as far as it got (a hit in time after all).
        for g in list(self.growing):
            if g.draft:
                self.branches.append(
                    Branch([*g.pp.context, g.pp.token], list(g.draft), list(g.q_rows),
                           list(g.rivals), g.prob)
                )  # fmt: skip
                self.growing.remove(g)
        for i, br in enumerate(self.branches):
            n = len(br.context)
            k = len(ctx) - n  # branch tokens the plan's context already holds
            if k < 0 or k >= len(br.draft) or ctx[:n] != br.context:
                continue
            if ctx[n:] != br.draft[:k]:
                continue
            del self.branches[i]
            counts = []
            if self._late_branch:  # a branch still growing at its rejection: a hit after all
                counts.append(Count(Counter.PREDRAFT_HITS))
            self._late_branch = False
            end = k + plan.max_tokens
            out = Branch(ctx, br.draft[k:end], br.q_rows[k:end], br.rivals[k:end], br.prob)
            return out, [*counts, Count(Counter.PREDRAFT_USED_TOKENS, len(out.draft))]
        return None, []

    def classify_miss(self, b: BatchView, at: int, token: int) -> None:
        """Outcome pre-drafting: ``token`` corrects the draft at ``b.start + at`` (called before
        the batches behind it go, while the version that planned branches holds). A branch
        that starts with it and holds tokens, kept or still growing, is ready: a hit (whoever
        then uses it: the edge as its next batch, :meth:`take_branch`, or the verifier, which
        had it as a hedge). Otherwise count why: the correction was not among the draft's known
        alternatives there
        (``Rival.alternatives``); it was, but ``cfg.predraft`` branches were already kept (the
        cap); it was, with room, but its branch was not planned (less likely than the floor,
        or no room to step it) or not finished in time."""
        if not self.pipe.cfg.predraft:
            return
        pos = b.start + at
        ctx = [*self.pipe.gen.committed[:pos], token]
        self.settle_late(hit=False)
        ready = [br.context for br in self.branches]
        ready += [[*g.pp.context, g.pp.token] for g in self.growing if g.draft]
        if ctx in ready:
            self.pipe.count(Counter.PREDRAFT_HITS)
            return
        rival = b.rivals[at] if at < len(b.rivals) else NO_RIVAL
        known = rival is not NO_RIVAL and any(y == token for y, _ in rival.alternatives())
        if not known:
            self.pipe.count(Counter.PREDRAFT_MISS_NOT_ALTERNATIVE)
        elif (pos, token) in self._predrafted.at(self.pipe.version):
            # Planned, still being drafted: the next push says whether it came in time.
            self._late_branch = True
        elif len(self.branches) + len(self.growing) >= self.pipe.cfg.predraft:
            self.pipe.count(Counter.PREDRAFT_MISS_CAP)
        else:
            self.pipe.count(Counter.PREDRAFT_MISS_TIME)

    def settle_late(self, *, hit: bool) -> None:
        """The branch a rejection waited for (:meth:`classify_miss`) was taken (``hit``) or
        not: in the second case the rejection counts as a miss for time."""
        if self._late_branch and not hit:
            self.pipe.count(Counter.PREDRAFT_MISS_TIME)
        self._late_branch = False
