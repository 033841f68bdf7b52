"""The drafting and commit rules every edge session shares (:class:`Pipeline`), composed by the
single-verifier :class:`~edge_agent.session.core.SingleCore` and by the federated core
(:mod:`edge_agent.session.federation_core`): no I/O, no clock, no model.

It holds which text to draft from (the committed ids plus every in-flight draft, the *tail*),
when drafting may go on (fewer than D batches in flight, none in stop-and-wait, no recovered
token pending, room left), the batches in flight with their γ and depth (the
:class:`~edge_agent.session.controller.Controller`'s), the verdict deadline, and the one commit
path of a round: *accepted* tokens, then a *recovered* token on a rejection (discarding every
batch behind it and bumping the epoch) or a *bonus* token. The pre-drafted branches and the
hedges are its :class:`~edge_agent.session.branches.BranchBook`'s.

Invariant: accepting tokens moves them from the tail to ``committed`` and leaves
``committed + tail`` unchanged, so only a rejection (epoch bump) voids drafting in progress; a
driver checks :meth:`Pipeline.current` after every draft step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from edge_agent.session.branches import BranchBook, Rival
from edge_agent.session.controller import Controller, ControllerLimits
from edge_agent.session.events import Count, Counter, GenerationEvent, RejectionGap, Round, Tally
from edge_agent.session.generation import Generation, TokenSource
from edge_agent.session.opening import DesyncError, fit_context
from edge_agent.session.pipeline_config import Mode, PipelineConfig, max_inflight
from shared.maths.sampling import Probs
from shared.wire.messages import MAX_BUDGET, FederatedReply, Progress

#: The verdict deadline grows by this many seconds per fixed token in the head batch (a first
#: round carries the prompt, whose prefill takes time before any Progress can say so).
PREFILL_ALLOWANCE_S: Final = 0.01


@dataclass(frozen=True)
class DraftPlan:
    """What the drafter may do now: extend ``context`` by up to ``max_tokens`` tokens (stopping
    after an end-of-sequence id) while the pipeline's epoch is still ``epoch``."""

    epoch: int
    context: list[int]
    max_tokens: int
    deterministic: bool
    version: int = 0  # the pipeline's version when planned (see Pipeline.version)


@dataclass
class Batch:
    """A batch in flight, with what the edge needs to recover a rejection at any position."""

    epoch: int
    draft: list[int]
    q_rows: list[Probs]  # [γ][V]: the distribution each draft token was drawn from
    #: Per draft token, the draft's rival and confidence (hedging; may be empty).
    rivals: list[Rival] = field(default_factory=list)
    #: Position of draft[0] in the text: the end of the committed text and the tail when it
    #: was pushed (Pipeline.push).
    start: int = 0
    #: Co-generation: a verifier token at ``start + doomed_at`` differs from the draft there, so
    #: this batch's Verdict is a rejection at that offset, known in advance (-1: not doomed).
    doomed_at: int = -1
    #: Per verifier link (index → its batch number for this batch).
    seqs: dict[int, int] = field(default_factory=dict)
    #: Federated rounds: the replies received so far, per link.
    replies: dict[int, FederatedReply] = field(default_factory=dict)
    sent_at: float = 0.0
    #: Fixed tokens its Propose carried (the prompt of a first round): prefill time.
    fixed: int = 0

    @property
    def live(self) -> list[int]:
        """The draft tokens that may still be accepted (all, or those before a doomed one)."""
        return self.draft if self.doomed_at < 0 else self.draft[: self.doomed_at]


class Pipeline:
    """The drafting and commit rules every edge session shares (module docstring)."""

    def __init__(
        self,
        gen: Generation,
        cfg: PipelineConfig,
        rng: np.random.Generator,
        *,
        gamma: int,
        deterministic_draft: bool,
        max_gamma: int | None = None,
    ) -> None:
        """``gamma``: the draft length (the start value with ``cfg.auto_gamma``); ``max_gamma``:
        the verifier's limit on it."""
        self.gen = gen
        self.cfg = cfg
        self.rng = rng
        self.deterministic_draft = deterministic_draft
        limit = max_gamma or 64
        pipelined = cfg.mode == Mode.PIPELINED
        self.controller = Controller(
            ControllerLimits(
                gamma0=gamma,
                depth0=cfg.effective_depth,
                max_gamma=min(cfg.max_gamma, limit),
                max_depth=cfg.max_depth if pipelined else 1,
                adapt_gamma=cfg.auto_gamma,
                adapt_depth=cfg.auto_depth and pipelined,
                cogen=cfg.cogen,
            )
        )
        self.epoch = 0
        #: Bumped whenever the text to draft from changes other than by accepting the tail
        #: (a rejection, a co-generated token past the tail): voids drafting in progress.
        self.version = 0
        self.inflight: deque[Batch] = deque()
        #: True while a recovered token is not yet known: drafting would use a text without it.
        self.recovering = False
        #: Rationing: the draft tokens of a round the verifier last said it verifies whole
        #: (Verdict.budget; MAX_BUDGET: no bound): no batch is drafted longer.
        self.budget = MAX_BUDGET
        self._last_verdict_at: float | None = None
        #: Seconds from sending a batch to its verdict, recent rounds (RTT + queueing + T_v).
        self.latencies: deque[float] = deque(maxlen=16)
        #: The last Progress frame: when it came and the verifier's estimate of the time left.
        self.progress_at: float | None = None
        self.progress_eta_s = 0.0
        #: When the last rejection came (None: the batch after it has been sent).
        self.rejected_at: float | None = None
        #: The prepared outcomes and the hedges: their one owner, which reads this pipeline.
        self.book = BranchBook(self)
        #: What happened since the last :meth:`news`, in order: what the commits tell the
        #: consumer, what the steps report for the statistics.
        self._news: list[GenerationEvent | Tally] = []

    def news(self) -> list[GenerationEvent | Tally]:
        """The Committed / Finished and :data:`~edge_agent.session.events.Tally` events since
        the last call (its owner returns them first among a call's events), and forget them."""
        out, self._news = self._news, []
        return out

    def count(self, counter: Counter, n: int = 1) -> None:
        """Report ``n`` more of ``counter`` (the driver counts it in the generation's stats)."""
        self._news.append(Count(counter, n))

    def commit(self, ids: Sequence[int], source: TokenSource) -> None:
        """Commit ``ids`` (:meth:`Generation.commit`), keeping what the consumer is told."""
        self._news += self.gen.commit(ids, source)

    def fit_context(self, max_context: int) -> None:
        """:func:`~edge_agent.session.opening.fit_context`, keeping what the consumer is told."""
        self._news += fit_context(self.gen, max_context)

    @property
    def gamma(self) -> int:
        """The draft length of the next batch (fixed, or the controller's choice)."""
        return self.controller.gamma

    @property
    def depth(self) -> int:
        """Batches in flight at most (1 in stop-and-wait)."""
        return self.controller.depth

    @property
    def tail(self) -> list[int]:
        """Draft tokens in flight past the committed text, in order (they extend
        ``committed``; with co-generation, the head of the in-flight drafts may already be
        committed)."""
        c = len(self.gen.committed)
        out: list[int] = []
        for b in self.inflight:
            out += b.live[max(0, c - b.start) :]
        return out

    def _room(self) -> int:
        """Tokens the drafter may still add after the tail (0 after an end-of-sequence id)."""
        tail = self.tail
        if any(t in self.gen.eos_ids for t in tail):
            return 0
        return self.gen.room - len(tail)

    def may_draft(self) -> bool:
        if self.gen.done or self.recovering:
            return False
        if self.cfg.mode == Mode.STOP_AND_WAIT and self.inflight:
            return False
        # Decided batches still wait for their Verdicts: bounded too (batch numbers are 7-bit).
        if len(self.inflight) >= max_inflight(self.depth):
            return False
        return self.open_batches() < self.depth and self._room() > 0

    def open_batches(self) -> int:
        """Batches in flight with drafts still undecided: one whose every live draft is already
        committed (co-generated tokens agreed with it, or it is doomed) only waits for its
        Verdict and holds no place in the pipeline."""
        c = len(self.gen.committed)
        return sum(1 for b in self.inflight if b.start + len(b.live) > c)

    def plan(self) -> DraftPlan | None:
        if not self.may_draft():
            return None
        return DraftPlan(
            epoch=self.epoch,
            context=self.gen.committed + self.tail,
            max_tokens=min(self.gamma, self.budget, self._room()),
            deterministic=self.deterministic_draft,
            version=self.version,
        )

    def current(self, plan: DraftPlan, draft: Sequence[int] = ()) -> bool:
        """Drafting along ``plan`` (``draft`` so far) is still worth it: no rejection or rebase
        since, not done, and any tokens committed past the plan's context since (co-generated)
        agree with ``draft`` and do not outrun it."""
        if plan.version != self.version or self.gen.done:
            return False
        n, c = len(plan.context), len(self.gen.committed)
        if c <= n:
            return True
        return c <= n + len(draft) and list(draft[: c - n]) == self.gen.committed[n:c]

    def wants_more(self, plan: DraftPlan, draft: Sequence[int], prob: float = 1.0) -> bool:
        """Draft another token after ``draft``? ``prob``: the draft's probability of its last
        token; where it falls low the controller may cut the batch early (adaptive γ)."""
        if not self.current(plan, draft) or len(draft) >= plan.max_tokens:
            return False
        if draft and self.controller.should_cut(len(draft), prob):
            return False
        return not draft or draft[-1] not in self.gen.eos_ids

    # ------------------------------------------------------------ rounds

    def on_rejection(self, now: float) -> None:
        """A rejection (or a co-generated token that dooms a batch) at ``now``: its gap runs
        until the next batch is sent."""
        if self.rejected_at is None:
            self.rejected_at = now

    def push(
        self,
        plan: DraftPlan,
        draft: list[int],
        q_rows: list[Probs],
        now: float,
        rivals: Sequence[Rival] = (),
    ) -> Batch:
        start = len(self.gen.committed) + len(self.tail)
        b = Batch(plan.epoch, draft, q_rows, list(rivals), start=start, sent_at=now)
        self.inflight.append(b)
        self.count(Counter.PROPOSES_SENT)
        self.book.settle_late(hit=False)
        if self.rejected_at is not None:
            self._news.append(RejectionGap(max(0.0, now - self.rejected_at)))
            self.rejected_at = None
        return b

    def verdict_deadline(self, floor_s: float, factor: float = 4.0) -> float | None:
        """When the head batch's verdict is overdue (None: nothing in flight).

        Busy is not dead: the deadline runs from the later of the batch's sending and the last
        Progress frame since, each with its allowance. From the sending: ``floor_s`` (or
        ``factor`` times the slowest recent round, when longer) plus the prefill allowance of
        its fixed tokens. From a Progress frame: ``floor_s`` (or ``factor`` times the time the
        verifier expects the work still takes). A verifier whose engine moves sends one at
        least every few seconds, so only one that stopped progressing (or a path that swallows
        frames) reaches the deadline."""
        if not self.inflight:
            return None
        head = self.inflight[0]
        slowest = max(self.latencies, default=0.0)
        deadline = head.sent_at + max(floor_s, factor * slowest) + PREFILL_ALLOWANCE_S * head.fixed
        if self.progress_at is not None and self.progress_at >= head.sent_at:
            deadline = max(deadline, self.progress_at + max(floor_s, factor * self.progress_eta_s))
        return deadline

    def overdue(self, now: float, deadline: float) -> str:
        """Why the head batch passed ``deadline`` (:meth:`verdict_deadline`) at ``now``."""
        head = self.inflight[0]
        slowest = max(self.latencies, default=0.0)
        return (
            f"no Verdict for a batch sent {now - head.sent_at:.1f} s ago (deadline "
            f"{deadline - head.sent_at:.1f} s; slowest recent round {slowest:.2f} s): "
            "the verifier is stalled"
        )

    def on_draft_step(self, seconds: float) -> None:
        """One draft step took ``seconds`` on the model (the controller's T_d)."""
        self.controller.on_draft_step(seconds)

    def on_progress(self, p: Progress, now: float) -> None:
        """A Progress frame at ``now``: the verifier's engine is moving this session's work."""
        self.count(Counter.PROGRESS_FRAMES)
        self.progress_at = now
        self.progress_eta_s = p.eta_ms / 1000.0

    def push_credit(self, now: float) -> Batch:
        """A credit (cloud-only sessions): an empty batch at the committed end."""
        b = Batch(self.epoch, [], [], start=len(self.gen.committed), sent_at=now)
        self.inflight.append(b)
        return b

    def commit_round(
        self, b: Batch, accepted: int, now: float, verified: int | None = None
    ) -> None:
        """The head batch ``b`` was decided at ``now``: count it, commit its accepted prefix.
        ``verified``: the draft tokens the verifier decided (fewer than the batch's when the
        verifier's ration cut it: the rest were never judged)."""
        assert self.inflight and self.inflight[0] is b
        self.inflight.popleft()
        latency = max(0.0, now - b.sent_at)
        self.latencies.append(latency)
        if not b.draft:
            return  # a credit: no round of drafting
        last = self._last_verdict_at
        if last is not None and b.sent_at <= last:
            # b was in flight when the previous verdict came: the gap is the verifier's time
            self.controller.on_service(now - last)
        self._last_verdict_at = now
        gamma = len(b.draft) if verified is None else verified
        # γ and D in effect for this round (before the controller moves them for the next).
        self._news.append(Round(gamma, accepted, self.gamma, self.depth))
        if gamma:
            self.controller.on_verdict(gamma, accepted, latency)
            self.book.observe(b.rivals, gamma, accepted)
        self.commit_at(b.start, b.draft[:accepted], TokenSource.EDGE_DRAFT)

    def commit_at(self, start: int, tokens: Sequence[int], source: TokenSource) -> None:
        """Commit ``tokens`` as the text from position ``start``: positions already committed
        (co-generated tokens) must hold the same tokens."""
        c = len(self.gen.committed)
        skip = min(len(tokens), max(0, c - start))
        if start > c:
            raise DesyncError(f"tokens for position {start}, but {c} are committed")
        if list(tokens[:skip]) != self.gen.committed[start : start + skip]:
            raise DesyncError(f"tokens at {start} differ from the committed text")
        self.commit(tokens[skip:], source)

    def discard_inflight(self, keep: Batch | None = None) -> None:
        """Every batch in flight (behind ``keep``, when given) was drafted from a token that is
        now void: they go, and a new epoch begins. The one place the epoch moves."""
        batches = tokens = 0
        while self.inflight and self.inflight[-1] is not keep:
            batches += 1
            tokens += len(self.inflight.pop().draft)
        if batches:
            self.count(Counter.DISCARDED_BATCHES, batches)
            self.count(Counter.DISCARDED_TOKENS, tokens)
        self.epoch += 1
        self.version += 1

    def commit_recovered(self, token: int) -> None:
        self.count(Counter.RECOVERED_TOKENS)
        self.commit([token], TokenSource.CORRECTION)

    def commit_bonus(self, token: int, pos: int) -> None:
        if self.gen.done:
            return
        if pos >= len(self.gen.committed):  # not co-generated already
            self.count(Counter.BONUS_TOKENS)
        self.commit_at(pos, [token], TokenSource.BONUS)
