"""Outcome pre-drafting and hedging at the edge: what a drafter prepares besides the next batch,
and :class:`BranchBook`, the one owner of what is prepared. No I/O, no clock, no model.

At each draft step the draft's runner-up tokens (:class:`Rival`) say where a rejection would
likely go. *Hedges* (PipelineConfig.hedge) draft on after the rival of an unsure draft token and
go to a verifier that co-generates; *prepared outcomes* (PipelineConfig.predraft) draft a
:class:`Branch` after a likely correction, the next batch should the committed text become its
context. The :class:`~edge_agent.session.pipeline.Pipeline` owns one :class:`BranchBook` and
delegates to it; the book reads the pipeline's text, batches in flight and version
(:class:`PipelineView`: this module sits below the pipeline's) and reports its counts through
it.

Invariants: a mark (a position hedged, an outcome planned) holds for one pipeline version only
(:class:`VersionMarks`: a rejection or a rebase voids what was planned on the text before it);
at most ``cfg.predraft`` branches are kept, each while the committed text may still become its
context and draft.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, Protocol, TypeVar

from edge_agent.session.events import Count, Counter
from edge_agent.session.generation import Generation
from edge_agent.session.pipeline_config import PipelineConfig
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
    """What the book reads of a batch in flight (:class:`~edge_agent.session.pipeline.Batch`)."""

    start: int
    draft: list[int]
    rivals: list[Rival]

    @property
    def live(self) -> list[int]: ...


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
        #: Prepared outcomes (PipelineConfig.predraft), at most cfg.predraft of them.
        self.branches: list[Branch] = []
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

    def predraft_plan(self) -> PredraftPlan | None:
        """The outcome to prepare next, or None: of the (position, alternative) pairs of the
        undecided draft tokens in flight with no branch yet, the likeliest to be the first
        correction, with the draft standing in for the target: the confidences c_j for
        acceptance and q_i(y) for the correction, c_1 ⋯ c_{i−1} · q_i(y) (marked planned now);
        while fewer than ``cfg.predraft`` branches are kept and there is room after it.

        Exact (why a branch may be sent as an ordinary batch): its tokens are drawn from q
        after its own context with randomness the verifier never sees, before the verdict at
        ``pos`` is known; it is used only when the committed text turns out to be that context,
        an event that does not depend on the branch's draws. Given that event, the branch is
        distributed as a batch drafted after the verdict would be, and it is verified like one
        with the q rows it was drawn from."""
        pipe = self.pipe
        cfg = pipe.cfg
        if not cfg.predraft or pipe.gen.done:
            return None
        self.prune()
        if len(self.branches) >= cfg.predraft:
            return None
        predrafted = self._predrafted.at(pipe.version)
        c = len(pipe.gen.committed)
        best: tuple[float, int, int] | None = None  # (likelihood, pos, alternative)
        alive = 1.0  # the chance that every undecided token before this one is accepted
        for b in pipe.inflight:
            for i, r in enumerate(b.rivals[: len(b.live)]):
                pos = b.start + i
                if pos < c:
                    continue
                before, alive = alive, alive * r.conf
                if r.conf >= 1.0:
                    continue
                for y, qy in r.alternatives():
                    if y == b.draft[i] or (pos, y) in predrafted:
                        continue
                    if best is None or before * qy > best[0]:
                        best = (before * qy, pos, y)
        if best is None:
            return None
        _, pos, token = best
        predrafted.add((pos, token))
        room = pipe.gen.room - (pos + 1 - c)
        if room <= 0 or token in pipe.gen.eos_ids:
            return None
        text = pipe.gen.committed + pipe.tail
        return PredraftPlan(
            pos,
            token,
            text[:pos],
            min(pipe.gamma, pipe.budget, room),
            deterministic=pipe.deterministic_draft,
        )

    def predraft_current(self, pp: PredraftPlan, draft: Sequence[int] = ()) -> bool:
        """Is preparing ``pp`` (``draft`` so far) still worth it: the committed text may still
        become its context, and the session is not done."""
        return not self.pipe.gen.done and self._open_to([*pp.context, pp.token, *draft])

    def add_branch(self, g: Growing) -> list[Count]:
        """Keep the branch drafted for ``g.pp`` (if it is still open and has tokens); returns
        what it counts (a branch prepared, and its tokens, whether or not the budget keeps
        it)."""
        pp, draft = g.pp, g.draft
        if not draft or not self.predraft_current(pp, draft):
            return []
        counts = [Count(Counter.PREDRAFT_BRANCHES), Count(Counter.PREDRAFT_TOKENS, len(draft))]
        self.prune()
        if len(self.branches) < self.pipe.cfg.predraft:
            ctx = [*pp.context, pp.token]
            self.branches.append(Branch(ctx, list(draft), list(g.q_rows), list(g.rivals), g.prob))
        return counts

    def take_branch(self, plan: PlanView) -> tuple[Branch | None, list[Count]]:
        """The prepared branch that continues ``plan``'s context, cut to what the plan still
        needs (its head may already be committed: co-generated tokens that agree with it),
        removed from those kept (None if none does), and what taking it counts (a hit and the
        tokens it carries)."""
        self.prune()
        ctx = plan.context
        for i, br in enumerate(self.branches):
            n = len(br.context)
            k = len(ctx) - n  # branch tokens the plan's context already holds
            if k < 0 or k >= len(br.draft) or ctx[:n] != br.context:
                continue
            if ctx[n:] != br.draft[:k]:
                continue
            del self.branches[i]
            self._late_branch = False  # a branch still growing at its rejection: a hit after all
            end = k + plan.max_tokens
            out = Branch(ctx, br.draft[k:end], br.q_rows[k:end], br.rivals[k:end], br.prob)
            return out, [
                Count(Counter.PREDRAFT_HITS),
                Count(Counter.PREDRAFT_USED_TOKENS, len(out.draft)),
            ]
        return None, []

    def classify_miss(self, b: BatchView, at: int, token: int) -> None:
        """Outcome pre-drafting: ``token`` corrects the draft at ``b.start + at`` (called before
        the batches behind it go, while the version that planned branches holds). If no kept
        branch starts with it (one that does is taken, and counted, by :meth:`take_branch`),
        count why: the correction was not among the draft's known alternatives there
        (``Rival.alternatives``); it was, but ``cfg.predraft`` branches were already kept (the
        cap); it was, with room, but its branch was not planned or not finished in time."""
        if not self.pipe.cfg.predraft:
            return
        pos = b.start + at
        ctx = [*self.pipe.gen.committed[:pos], token]
        self.settle_late(hit=False)
        if any(br.context == ctx for br in self.branches):
            return
        rival = b.rivals[at] if at < len(b.rivals) else NO_RIVAL
        known = rival is not NO_RIVAL and any(y == token for y, _ in rival.alternatives())
        if not known:
            self.pipe.count(Counter.PREDRAFT_MISS_NOT_ALTERNATIVE)
        elif (pos, token) in self._predrafted.at(self.pipe.version):
            # Planned, still being drafted: the next push says whether it came in time.
            self._late_branch = True
        elif len(self.branches) >= self.pipe.cfg.predraft:
            self.pipe.count(Counter.PREDRAFT_MISS_CAP)
        else:
            self.pipe.count(Counter.PREDRAFT_MISS_TIME)

    def settle_late(self, *, hit: bool) -> None:
        """The branch a rejection waited for (:meth:`classify_miss`) was taken (``hit``) or
        not: in the second case the rejection counts as a miss for time."""
        if self._late_branch and not hit:
            self.pipe.count(Counter.PREDRAFT_MISS_TIME)
        self._late_branch = False
