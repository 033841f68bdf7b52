"""The edge's side of a session as synchronous state machines: no I/O, no clock, no model.

Two pieces, composed by the single-verifier :class:`SingleCore` here and by the federated core
(:mod:`edge_agent.session.federation_core`):

* :class:`Pipeline` holds the rules every edge session shares: which text to draft from (the
  committed ids plus every in-flight draft, the *tail*), when drafting may go on (fewer than D
  batches in flight, none in stop-and-wait, no recovered token pending, room left), and the one
  commit path of a round: *accepted* tokens, then a *recovered* token on a rejection (discarding
  every batch behind it and bumping the epoch) or a *bonus* token.
* :class:`VerifierLink` holds one verifier session's wire state: its epoch, the next batch
  number, and ``verifier_len``, the length of the verifier's cache once every Propose sent is
  processed and accepted; the next Propose starts there, carrying ``committed[verifier_len:]``
  as fixed tokens (the prompt, a recovered or a bonus token).

Cloud-only speculative decoding (no draft model on the edge): the edge drafts nothing and the
verifier's co-generation (with its own cloud drafts) writes the text. The edge sends *credits*
(:meth:`SingleCore.credit`): empty Proposes at its committed end, the first carrying the prompt
and asking for the prefill's bonus token. Each tells the verifier how far the edge has read, so
its co-generation may run up to its ``max_cogen_ahead`` past it; at most one is in flight, the
next once :data:`CREDIT_EVERY` tokens more have come.

Invariant: accepting tokens moves them from the tail to ``committed`` and leaves
``committed + tail`` unchanged, so only a rejection (epoch bump) voids drafting in progress; a
driver checks :meth:`Pipeline.current` after every draft step.

:class:`SingleCore` state table (frames from the verifier):

========== ===================================== =============================================
state      input                                 effect
========== ===================================== =============================================
RUNNING    Verdict for the head batch, all       commit the accepted tokens (and a bonus)
           accepted
RUNNING    Verdict for the head batch, rejected  commit accepted + recovered; discard the
           with the negotiated correction        batches behind, epoch + 1; or, when every
                                                 candidate fails, Resample → RECOVERING
RECOVERING Candidates for (epoch, pos)           commit a candidate → RUNNING, or Resample
any        Verdict for another batch, a missing  :class:`DesyncError` (rebuild the session)
           or foreign correction, a bonus with
           batches in flight; other frames
any        Error frame                           :class:`VerifierError`
FAILED     anything                              the same failure again
========== ===================================== =============================================

Every call returns :mod:`edge_agent.session.events`: the messages to send
(:class:`~edge_agent.session.events.Send`, encoded by the driver with :attr:`SingleCore.ctx`)
and, where the table says an error, a :class:`~edge_agent.session.events.Fail` carrying it (state
FAILED).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Generic, NoReturn, TypeVar

import numpy as np

from edge_agent.session.controller import Controller, ControllerLimits
from edge_agent.session.events import (
    Count,
    Counter,
    EdgeEvent,
    Fail,
    GenerationEvent,
    RejectionGap,
    Round,
    Send,
    Tally,
)
from edge_agent.session.generation import Generation, TokenSource
from edge_agent.session.pipeline_config import Mode, PipelineConfig, max_inflight
from edge_agent.session.transport import VerifierBusy
from shared.enums import TextEnum
from shared.errors import FATAL_CODES, WanspecError
from shared.maths.rejection import CorrectionMode, Decision, recover, try_candidates
from shared.maths.sampling import Probs
from shared.wire.codec import decode
from shared.wire.messages import (
    MAX_BUDGET,
    SEQ_MODULUS,
    Candidates,
    Error,
    FederatedReply,
    Fingerprint,
    Generated,
    Hedge,
    Hello,
    Logprobs,
    Message,
    Progress,
    Propose,
    ReplyMode,
    Resample,
    Resume,
    Verdict,
    Welcome,
    text_digest,
)
from shared.wire.packing import ProtocolError, WireContext

T = TypeVar("T")

#: The verdict deadline grows by this many seconds per fixed token in the head batch (a first
#: round carries the prompt, whose prefill takes time before any Progress can say so).
PREFILL_ALLOWANCE_S: Final = 0.01


#: Cloud-only sessions: tokens received between credits (the verifier may co-generate its
#: ``max_cogen_ahead`` past the last credit, 64 by default, so it never waits on one).
CREDIT_EVERY: Final = 8


#: The Verdict field that carries a correction, per negotiated (wire) correction mode.
_CORRECTION_FIELD: Final = {
    CorrectionMode.TOPK: "sparse",
    CorrectionMode.CANDIDATES: "candidates",
    CorrectionMode.GREEDY_DRAFT: "token",
}


class VerifierError(WanspecError, RuntimeError):
    """The verifier sent an Error frame. ``fatal`` ones end the session."""

    def __init__(self, code: str, message: str, fatal: bool) -> None:
        super().__init__(f"verifier error {code}: {message}")
        self.code = code
        self.fatal = fatal


class DesyncError(WanspecError, RuntimeError):
    """A frame that does not match the session's state (the session must be rebuilt)."""


class HandshakeError(WanspecError, RuntimeError):
    """The verifier refused the session (e.g. a different tokenizer). Not retried."""


class ContextExceeded(WanspecError, ValueError):
    """The prompt alone fills the verifier's context (``limit`` tokens): no session can hold
    it, so it is not retried (the API answers 400 ``context_length_exceeded``)."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens; the verifier's context is {limit} tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.limit = limit


def fit_context(gen: Generation, max_context: int) -> list[GenerationEvent]:
    """Bound ``gen`` by a verifier's context (its Welcome's or its connection's Ready's
    ``max_context``): after this, prompt + ``max_new_tokens`` ≤ ``max_context``, so no
    Propose, hedge or co-generated token ever passes the verifier's limit, and a generation
    that reaches it ends with ``finish_reason`` "length" and its text (never a refusal that
    would be retried). A text already at the limit (a fail-over to a smaller verifier) ends
    now (the :class:`~edge_agent.session.events.Finished` returned says so). Raises
    :class:`ContextExceeded` when the prompt alone leaves no room."""
    if gen.prompt_len >= max_context:
        raise ContextExceeded(gen.prompt_len, max_context)
    gen.max_new_tokens = min(gen.max_new_tokens, max_context - gen.prompt_len)
    if gen.room <= 0 and not gen.done:
        return [gen.finish("length")]
    return []


class EdgeState(TextEnum):
    RUNNING = "running"
    RECOVERING = "recovering"  # a rejection's recovered token waits for more candidates
    DONE = "done"
    FAILED = "failed"  # the session cannot go on (a Fail event said why)


# ------------------------------------------------------------------------------ handshake


def hello_for(
    fingerprint: Fingerprint,
    cfg: PipelineConfig,
    seed: int | None,
    *,
    k: int = 10,
    end: int = 0,
    resume: Resume | None = None,
) -> Hello:
    """The Hello of a single-verifier session (the verifier decides: PicoSpec). ``end``: the
    position where the generation stops at the latest (prompt + room), the bound of
    co-generation (``cfg.cogen``); ``resume``: the lost session to pick up, if any. It always
    asks for Progress frames (the verdict deadline follows them)."""
    return Hello(
        fingerprint=fingerprint,
        sampling=cfg.sampling,
        reply_mode=ReplyMode.VERDICT,
        correction=cfg.wire_correction,
        k=k,
        bonus=cfg.mode == Mode.STOP_AND_WAIT,
        seed=seed,
        cogen_end=end if cfg.cogen else 0,
        progress=True,
        resume=resume,
        resumable=True,
        logprobs=cfg.logprobs,
    )


def raise_error(msg: Error, *, opening: bool = False) -> NoReturn:
    """An Error frame as the exception it means: a busy verifier's refusal (``retry_after``)
    is :class:`~edge_agent.session.transport.VerifierBusy`; a refusal the user must act on, while
    the
    session is ``opening``, :class:`HandshakeError`; anything else :class:`VerifierError`."""
    if msg.retry_after is not None:
        raise VerifierBusy(
            f"verifier refused the session ({msg.code}): {msg.message}; "
            f"retry after {msg.retry_after:g} s",
            msg.code,
            msg.retry_after,
        )
    if opening and msg.code in FATAL_CODES:
        raise HandshakeError(f"verifier refused the session: {msg.message}")
    raise VerifierError(msg.code, msg.message, msg.fatal)


def check_welcome(hello: Hello, data: bytes) -> Welcome:
    """The verifier's answer to ``hello``: its Welcome, or the reason there is none.

    Raises :class:`HandshakeError` for a refusal the user must act on (not retried),
    :class:`VerifierError` for other Error frames and :class:`DesyncError` for anything else.
    """
    try:
        msg = decode(data)
    except ProtocolError as e:
        raise DesyncError(f"bad handshake reply: {e}") from e
    if isinstance(msg, Error):
        raise_error(msg, opening=True)
    if not isinstance(msg, Welcome):
        raise DesyncError(f"expected Welcome, got {type(msg).__name__}")
    reason = hello.fingerprint.compatible_with(msg.fingerprint)
    if reason is not None:
        raise HandshakeError(f"verifier model is incompatible: {reason}")
    return msg


def queue_progress(data: bytes) -> Progress | None:
    """``data`` as the Progress frame of a session waiting in the verifier's admission line
    (before its Welcome: ``ahead`` sessions start before it, in about ``eta_ms``), or None
    for any other frame (left to :func:`check_welcome`)."""
    try:
        msg = decode(data)
    except ProtocolError:
        return None
    return msg if isinstance(msg, Progress) else None


def wire_context(hello: Hello, welcome: Welcome) -> WireContext:
    """The session's WireContext on the edge, from the limits the verifier announced."""
    return WireContext(
        vocab_size=hello.fingerprint.vocab_size,
        max_gamma=welcome.max_gamma,
        max_fixed=welcome.max_fixed,
        max_frame=welcome.max_frame,
        draft_probs=hello.correction != CorrectionMode.GREEDY_DRAFT,
        coarse_q=hello.sampling.greedy,
    )


# ------------------------------------------------------------------------------ pipeline


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
        #: Positions hedged since the version last changed (one hedge per position).
        self._hedged: VersionMarks[int] = VersionMarks()
        #: Hedges sent, (pos, tokens from pos on), newest last: to count the verifier's hits.
        self.hedges: deque[tuple[int, list[int]]] = deque(maxlen=8)
        #: The last Progress frame: when it came and the verifier's estimate of the time left.
        self.progress_at: float | None = None
        self.progress_eta_s = 0.0
        #: Prepared outcomes (PipelineConfig.predraft), at most cfg.predraft of them.
        self.branches: list[Branch] = []
        #: (pos, token) outcomes planned since the version last changed (each prepared once).
        self._predrafted: VersionMarks[tuple[int, int]] = VersionMarks()
        #: When the last rejection came (None: the batch after it has been sent).
        self.rejected_at: float | None = None
        #: A rejection whose correction had a branch planned but not yet kept: a hit if that
        #: branch is taken for the next batch, else a miss for time (decided at that push).
        self._late_branch = False
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
        """:func:`fit_context`, keeping what the consumer is told."""
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

    def hedge_plan(self) -> HedgePlan | None:
        """The least confident undecided draft token in flight below ``cfg.hedge_below`` that
        has no hedge yet (marked hedged now), or None. Only with co-generation and a
        deterministic draft: the verifier uses a hedge only where it draws corrections itself,
        and drafting a hedge then consumes no randomness."""
        cfg = self.cfg
        if not (cfg.hedge and cfg.cogen and self.deterministic_draft) or self.gen.done:
            return None
        hedged = self._hedged.at(self.version)
        c = len(self.gen.committed)
        best: tuple[float, int, int] | None = None  # (conf, pos, rival)
        for b in self.inflight:
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
        text = self.gen.committed + self.tail
        room = self.gen.room - (pos + 1 - c)
        return HedgePlan(self.version, pos, token, text[:pos], min(cfg.hedge, room))

    def hedge_current(self, hp: HedgePlan) -> bool:
        return hp.version == self.version and not self.gen.done

    # ------------------------------------------------------------ outcome pre-drafting

    def _open_to(self, text: Sequence[int]) -> bool:
        """May the committed text still become ``text`` or run into it (it is a prefix of
        ``text``)? Only the tail after the committed text can still change."""
        c = self.gen.committed
        return len(c) <= len(text) and list(text[: len(c)]) == c

    def _prune_branches(self) -> None:
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
        cfg = self.cfg
        if not cfg.predraft or self.gen.done:
            return None
        self._prune_branches()
        if len(self.branches) >= cfg.predraft:
            return None
        predrafted = self._predrafted.at(self.version)
        c = len(self.gen.committed)
        best: tuple[float, int, int] | None = None  # (likelihood, pos, alternative)
        alive = 1.0  # the chance that every undecided token before this one is accepted
        for b in self.inflight:
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
        room = self.gen.room - (pos + 1 - c)
        if room <= 0 or token in self.gen.eos_ids:
            return None
        text = self.gen.committed + self.tail
        return PredraftPlan(
            pos,
            token,
            text[:pos],
            min(self.gamma, self.budget, room),
            deterministic=self.deterministic_draft,
        )

    def predraft_current(self, pp: PredraftPlan, draft: Sequence[int] = ()) -> bool:
        """Is preparing ``pp`` (``draft`` so far) still worth it: the committed text may still
        become its context, and the session is not done."""
        return not self.gen.done and self._open_to([*pp.context, pp.token, *draft])

    def add_branch(
        self,
        pp: PredraftPlan,
        draft: list[int],
        q_rows: list[Probs],
        rivals: Sequence[Rival],
        prob: float,
    ) -> list[Count]:
        """Keep the branch drafted for ``pp`` (if it is still open and has tokens); returns
        what it counts (a branch prepared, and its tokens, whether or not the budget keeps
        it)."""
        if not draft or not self.predraft_current(pp, draft):
            return []
        counts = [Count(Counter.PREDRAFT_BRANCHES), Count(Counter.PREDRAFT_TOKENS, len(draft))]
        self._prune_branches()
        if len(self.branches) < self.cfg.predraft:
            ctx = [*pp.context, pp.token]
            self.branches.append(Branch(ctx, list(draft), list(q_rows), list(rivals), prob))
        return counts

    def take_branch(self, plan: DraftPlan) -> tuple[Branch | None, list[Count]]:
        """The prepared branch that continues ``plan``'s context, cut to what the plan still
        needs (its head may already be committed: co-generated tokens that agree with it),
        removed from those kept (None if none does), and what taking it counts (a hit and the
        tokens it carries)."""
        self._prune_branches()
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

    def classify_miss(self, b: Batch, at: int, token: int) -> None:
        """Outcome pre-drafting: ``token`` corrects the draft at ``b.start + at`` (called before
        the batches behind it go, while the version that planned branches holds). If no kept
        branch starts with it (one that does is taken, and counted, by :meth:`take_branch`),
        count why: the correction was not among the draft's known alternatives there
        (``Rival.alternatives``); it was, but ``cfg.predraft`` branches were already kept (the
        cap); it was, with room, but its branch was not planned or not finished in time."""
        if not self.cfg.predraft:
            return
        pos = b.start + at
        ctx = [*self.gen.committed[:pos], token]
        self._settle_late(hit=False)
        if any(br.context == ctx for br in self.branches):
            return
        rival = b.rivals[at] if at < len(b.rivals) else NO_RIVAL
        known = rival is not NO_RIVAL and any(y == token for y, _ in rival.alternatives())
        if not known:
            self.count(Counter.PREDRAFT_MISS_NOT_ALTERNATIVE)
        elif (pos, token) in self._predrafted.at(self.version):
            # Planned, still being drafted: the next push says whether it came in time.
            self._late_branch = True
        elif len(self.branches) >= self.cfg.predraft:
            self.count(Counter.PREDRAFT_MISS_CAP)
        else:
            self.count(Counter.PREDRAFT_MISS_TIME)

    def _settle_late(self, *, hit: bool) -> None:
        """The branch a rejection waited for (:meth:`classify_miss`) was taken (``hit``) or
        not: in the second case the rejection counts as a miss for time."""
        if self._late_branch and not hit:
            self.count(Counter.PREDRAFT_MISS_TIME)
        self._late_branch = False

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
        self._settle_late(hit=False)
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


# ------------------------------------------------------------------------------ drafting


class DraftingCore:
    """What a core's driver may ask of its drafting (:class:`SingleCore`, the federated core):
    the :class:`Pipeline`'s rules, behind the core, so that a driver talks to a core only
    through its methods and events (it never holds the pipeline)."""

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

    def take_branch(self, plan: DraftPlan) -> tuple[Branch | None, list[Count]]:
        return self.pipe.take_branch(plan)

    def batch_start(self, plan: DraftPlan) -> tuple[Branch, list[Count]]:
        """What the batch for ``plan`` starts from: the prepared branch that continues it
        (:meth:`Pipeline.take_branch`, and what taking it counts), else nothing drafted yet."""
        ready, counts = self.pipe.take_branch(plan)
        return ready or Branch(list(plan.context), [], [], []), counts

    def hedge_plan(self) -> HedgePlan | None:
        return self.pipe.hedge_plan()

    def hedge_current(self, hp: HedgePlan) -> bool:
        return self.pipe.hedge_current(hp)

    def branch_room(self) -> int:
        """Outcomes that may still be prepared (PipelineConfig.predraft) besides those kept."""
        return self.cfg.predraft - len(self.pipe.branches)

    def predraft_plan(self) -> PredraftPlan | None:
        return self.pipe.predraft_plan()

    def predraft_current(self, pp: PredraftPlan, draft: Sequence[int] = ()) -> bool:
        return self.pipe.predraft_current(pp, draft)

    def plan_branches(self, budget: int) -> list[Growing]:
        """Up to ``budget`` outcomes to prepare now, likeliest first (:meth:`predraft_plan`)."""
        out: list[Growing] = []
        while len(out) < budget and (pp := self.pipe.predraft_plan()) is not None:
            out.append(Growing(pp))
        return out

    def branch_open(self, g: Growing) -> bool:
        """May ``g`` grow by another token: short of its length, not ended by an
        end-of-sequence id, and its context still open (:meth:`predraft_current`)."""
        return (
            len(g.draft) < g.pp.max_tokens
            and not (g.draft and g.draft[-1] in self.gen.eos_ids)
            and self.pipe.predraft_current(g.pp, g.draft)
        )

    def add_branch(self, g: Growing) -> list[Count]:
        """Keep what was drafted for ``g.pp`` (:meth:`Pipeline.add_branch`)."""
        return self.pipe.add_branch(g.pp, g.draft, g.q_rows, g.rivals, g.prob)

    def verdict_deadline(self, floor_s: float) -> float | None:
        return self.pipe.verdict_deadline(floor_s)

    def overdue(self, now: float, deadline: float) -> str:
        return self.pipe.overdue(now, deadline)


# ------------------------------------------------------------------------------ one link


class VerifierLink:
    """One verifier session's wire state (module docstring).

    Its epoch is the pipeline's when the link is the session's only one (``pipe``: one
    session, one epoch, one owner); a federation's worker links keep their own (each worker
    enters an epoch when its Rollback is sent)."""

    def __init__(self, ctx: WireContext, pipe: Pipeline | None = None) -> None:
        self.ctx = ctx
        self.pipe = pipe
        self._epoch = 0
        self.next_seq = 0
        self.verifier_len = 0  # a new session's verifier cache is empty

    @property
    def epoch(self) -> int:
        return self.pipe.epoch if self.pipe is not None else self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        if self.pipe is not None:
            raise AttributeError("this link's epoch is its pipeline's")
        self._epoch = value

    def propose(
        self,
        committed: Sequence[int],
        b: Batch,
        index: int,
        with_q: bool,
        want_bonus: bool = False,
    ) -> Propose:
        """The Propose of batch ``b`` for this link (registered under ``index``)."""
        pos = self.verifier_len
        fixed = list(committed[pos:])
        seq = self.next_seq
        b.seqs[index] = seq
        b.fixed = len(fixed)
        self.verifier_len = pos + len(fixed) + len(b.draft)
        self.next_seq = (seq + 1) % SEQ_MODULUS
        q = (
            np.array([q[x] for x, q in zip(b.draft, b.q_rows, strict=True)], np.float32)
            if with_q
            else np.ones(len(b.draft), np.float32)
        )
        return Propose(
            epoch=self.epoch,
            seq=seq,
            pos=pos,
            draft=np.array(b.draft, np.int64),
            q=q,
            fixed=np.array(fixed, np.int64),
            want_bonus=want_bonus,
        )

    def decode(self, data: bytes) -> Message:
        """A frame from this verifier; Error frames raise (:func:`raise_error`)."""
        msg = decode(data, self.ctx)
        if isinstance(msg, Error):
            raise_error(msg)
        return msg


def resumed_length(gen: Generation, welcome: Welcome) -> int:
    """Where the verifier's cache of a resumed session ends: the next Propose starts there
    (0 for a new session). Raises :class:`DesyncError` unless the kept tokens are exactly the
    edge's committed ones (their digest), so nothing but the committed text is ever reused."""
    r = welcome.resumed
    if r is None:
        return 0
    if r.length > len(gen.committed) or r.digest != text_digest(gen.committed[: r.length]):
        raise DesyncError(f"the resumed session's {r.length} cached tokens are not this text")
    return r.length


def gen_at(gen: Generation, pos: int) -> int | None:
    """The committed token at ``pos``, if any."""
    return gen.committed[pos] if 0 <= pos < len(gen.committed) else None


class SingleCore(DraftingCore):
    """One generation over one verifier session that decides (PicoSpec). See the state table in
    the module docstring. ``propose``, ``hedge`` and ``receive`` return the events to carry out,
    in order (:mod:`edge_agent.session.events`)."""

    LINK: Final = 0

    def __init__(
        self,
        gen: Generation,
        cfg: PipelineConfig,
        rng: np.random.Generator,
        hello: Hello,
        welcome: Welcome,
        *,
        provisional: bool = False,
    ) -> None:
        """``provisional``: ``welcome`` is the one the connection announced (its Ready), and
        the session's own is still to come as its first frame (a session opened in the same
        flight as its first Propose: zero round trips); a new session only."""
        self.cfg = cfg
        self.hello = hello
        #: The session's own Welcome once it has come (None while provisional).
        self.welcome: Welcome | None = None if provisional else welcome
        self.pipe = Pipeline(
            gen,
            cfg,
            rng,
            gamma=min(cfg.gamma, welcome.max_gamma),
            deterministic_draft=cfg.deterministic_draft,
            max_gamma=welcome.max_gamma,
        )
        self.link = VerifierLink(wire_context(hello, welcome), self.pipe)
        self.link.verifier_len = resumed_length(gen, welcome)
        if self.link.verifier_len:  # reported by :meth:`opened`
            self.pipe.count(Counter.RESUMED_TOKENS, self.link.verifier_len)
        # The kind negotiated in the Hello; a greedy target always sends the token itself.
        self._correction_field = (
            "token" if hello.sampling.greedy else _CORRECTION_FIELD[hello.correction]
        )
        self._resample: tuple[int, Probs] | None = None  # (pos, q) of the pending correction
        self._failed: Fail | None = None
        #: When its first Progress before the Welcome came (it waits in the admission line).
        self._queued_at: float | None = None
        self._credited: int | None = None  # the committed length at the last credit

    def opened(self) -> list[EdgeEvent]:
        """What the session's opening reports (the tokens a resumed session's verifier kept):
        its driver carries these out first, before any other call."""
        return [*self.pipe.news()]

    @property
    def ctx(self) -> WireContext:
        """The session's WireContext: the driver encodes the core's Sends with it."""
        return self.link.ctx

    @property
    def resume_token(self) -> str | None:
        """The verifier's token to resume this session with, once its Welcome has come."""
        return None if self.welcome is None else self.welcome.resume

    @property
    def state(self) -> EdgeState:
        if self._failed is not None:
            return EdgeState.FAILED
        if self.gen.done:
            return EdgeState.DONE
        return EdgeState.RECOVERING if self.pipe.recovering else EdgeState.RUNNING

    # ---------------------------------------------------------------- drafting

    def may_draft(self) -> bool:
        return self._failed is None and self.pipe.may_draft()

    def prompt_unsent(self) -> bool:
        """Committed tokens the verifier lacks (a new session's prompt): a drafting edge with
        co-generation sends them at once in a credit (:meth:`credit`), asking for their token."""
        return self.link.verifier_len < len(self.gen.committed)

    def propose(
        self,
        plan: DraftPlan,
        draft: list[int],
        q_rows: list[Probs],
        now: float = 0.0,
        rivals: Sequence[Rival] = (),
    ) -> list[EdgeEvent]:
        """Register a drafted batch and send its Propose; nothing if ``plan`` is void."""
        if self._failed is not None:
            return [self._failed]
        if not draft or not self.pipe.current(plan, draft):
            return []
        # Co-generated tokens committed while this batch was drafted agree with its head:
        # only the rest goes up.
        skip = len(self.gen.committed) - len(plan.context)
        if skip > 0:
            draft, q_rows, rivals = draft[skip:], q_rows[skip:], rivals[skip:]
            if not draft:
                return []
        b = self.pipe.push(plan, draft, q_rows, now, rivals)
        msg = self.link.propose(self.gen.committed, b, self.LINK, self.ctx.draft_probs)
        return [*self.pipe.news(), Send(msg)]

    def wants_credit(self) -> bool:
        """Cloud-only: is a credit due? None in flight, and none sent yet in this session or
        :data:`CREDIT_EVERY` tokens more committed since the last."""
        if self._failed is not None or self.gen.done or self.pipe.inflight:
            return False
        return self._credited is None or len(self.gen.committed) - self._credited >= CREDIT_EVERY

    def credit(self, now: float = 0.0, *, bonus: bool = True) -> list[EdgeEvent]:
        """Send a credit (module docstring): an empty Propose at the committed end; with
        tokens the verifier lacks (the prompt), they go as fixed tokens and the Propose asks
        for the bonus token of their forward (``bonus``; an edge that drafts too sends its
        prompt so before its first batch is drafted, so that the verifier prefills, and its
        forward's token comes back in one round trip, while the edge drafts: taken as a
        co-generated token by :meth:`_verdict`)."""
        if self._failed is not None:
            return [self._failed]
        if not self.cfg.cogen:
            raise ValueError("cloud-only sessions need co-generation (PipelineConfig.cogen)")
        committed = self.gen.committed
        self._credited = len(committed)
        b = self.pipe.push_credit(now)
        fixed = self.link.verifier_len < len(committed)
        return [Send(self.link.propose(committed, b, self.LINK, False, want_bonus=fixed and bonus))]

    def hedge(self, hp: HedgePlan, draft: list[int]) -> list[EdgeEvent]:
        """Send the Hedge frame of ``hp`` with its drafted continuation; nothing if it is void."""
        if self._failed is not None:
            return [self._failed]
        if not draft or not self.pipe.hedge_current(hp):
            return []
        return self._send_hedge(hp.pos, hp.token, draft)

    def tree_branch(self, pp: PredraftPlan, draft: list[int]) -> list[EdgeEvent]:
        """Send a prepared branch (``pp``'s token and ``draft``, drafted so far) as a Hedge
        (PipelineConfig.tree): the verifier verifies it in the forward of the batch it forks
        from, or in co-generation after the rejection. Nothing if trees are off, the verifier
        would not recover tokens itself, or the branch is void."""
        if self._failed is not None:
            return [self._failed]
        cfg, pipe = self.cfg, self.pipe
        if not (cfg.tree and cfg.cogen and pipe.deterministic_draft and draft):
            return []
        if not pipe.predraft_current(pp, draft):
            return []
        return self._send_hedge(pp.pos, pp.token, draft)

    def _send_hedge(self, pos: int, token: int, draft: list[int]) -> list[EdgeEvent]:
        """The Hedge frame for ``token`` at ``pos`` and ``draft`` after it (a point mass: q 1),
        kept to count the verifier's hits."""
        msg = Hedge(pos, token, np.array(draft, np.int64), np.ones(len(draft), np.float32))
        self.pipe.hedges.append((pos, [token, *draft]))
        return [Send(msg)]

    # ---------------------------------------------------------------- frames

    def receive(self, data: bytes, now: float = 0.0) -> list[EdgeEvent]:
        """One frame from the verifier, received at ``now``. An Error frame, a frame that does
        not decode or one that does not fit the session ends it: a :class:`Fail` with the
        VerifierError / ProtocolError / DesyncError."""
        if self._failed is not None:
            return [self._failed]
        try:
            events = self._opening(data, now) if self.welcome is None else self._receive(data, now)
            return [*self.pipe.news(), *events]
        except (
            VerifierError,
            DesyncError,
            ProtocolError,
            HandshakeError,
            VerifierBusy,
            ContextExceeded,
        ) as e:
            self._failed = Fail(e)
            return [*self.pipe.news(), self._failed]

    def _opening(self, data: bytes, now: float) -> list[EdgeEvent]:
        """The first frame of a session opened with its first Propose: its Welcome (checked as
        :func:`check_welcome` does), or the refusal that replaced it. Before it, Progress
        frames while the session waits in the verifier's admission line (its place, the
        expected wait): busy, not dead, they move the verdict deadline as a running round's
        do."""
        self.pipe.count(Counter.DOWNLINK_BYTES, len(data))
        queued = queue_progress(data)
        if queued is not None:
            self.pipe.on_progress(queued, now)
            if self._queued_at is None:
                self._queued_at = now
            return []
        welcome = check_welcome(self.hello, data)
        if self._queued_at is not None:
            self.gen.stats.admission_wait_s += max(0.0, now - self._queued_at)
        if welcome.resumed is not None:
            raise DesyncError("a new session's Welcome says it resumed one")
        ctx = self.link.ctx
        if welcome.max_gamma < ctx.max_gamma or welcome.max_fixed < ctx.max_fixed:
            raise DesyncError("the session's Welcome grants less than its connection's Ready")
        self.pipe.fit_context(welcome.max_context)  # (the Ready's was applied already)
        self.welcome = welcome
        return []

    def _receive(self, data: bytes, now: float) -> list[EdgeEvent]:
        self.pipe.count(Counter.DOWNLINK_BYTES, len(data))
        msg = self.link.decode(data)
        if isinstance(msg, Progress):
            self.pipe.on_progress(msg, now)
            return []
        if isinstance(msg, Logprobs) and self.cfg.logprobs is not None:
            try:
                self.gen.logprobs.note(msg)
            except ValueError as e:
                raise DesyncError(str(e)) from None
            return []
        if isinstance(msg, Verdict) and not self.pipe.recovering:
            return self._verdict(msg, len(data), now)
        if isinstance(msg, Generated) and not self.pipe.recovering:
            return self._commit_cogenerated(msg, now)
        if isinstance(msg, Candidates) and self._resample is not None:
            return self._candidates(msg)
        raise DesyncError(f"unexpected {type(msg).__name__} in state {self.state}")

    def _commit_cogenerated(self, g: Generated, now: float = 0.0) -> list[EdgeEvent]:
        """A co-generated token: commit it and rebase the tail on it. A draft in flight at its
        position that agrees stands; one that differs dooms its batch (the verifier will reject
        it there, at no model cost) and voids every batch behind it, like a rejection."""
        pipe, gen = self.pipe, self.gen
        if gen.done:
            return []
        c = len(gen.committed)
        # The verifier enters an epoch for each doomed batch only when it reaches it.
        epoch = self.link.epoch - sum(1 for b in pipe.inflight if b.doomed_at >= 0)
        if (g.epoch, g.pos) != (epoch, c):
            raise DesyncError(f"Generated for epoch {g.epoch}, pos {g.pos}; expected {epoch}, {c}")
        pipe.count(Counter.COGEN_TOKENS)
        if any(
            0 < c - p < len(ids) and ids[: c - p + 1] == [*gen.committed[p:], g.token]
            for p, ids in pipe.hedges
        ):
            pipe.count(Counter.HEDGE_HITS)
        return self._commit_known(
            g.token, TokenSource.CLOUD_DRAFT if g.cloud else TokenSource.COGENERATED, now
        )

    def _commit_known(self, token: int, source: TokenSource, now: float) -> list[EdgeEvent]:
        """A token the verifier drew at the committed end on its own (co-generated, or the
        prompt credit's bonus) while batches may be in flight: commit it; a draft in flight
        at its position that agrees stands, one that differs dooms its batch."""
        pipe, gen = self.pipe, self.gen
        c = len(gen.committed)
        b = next((b for b in pipe.inflight if b.start <= c < b.start + len(b.live)), None)
        pipe.commit([token], source)
        if b is None:
            # Past every draft in flight: the batch being drafted (if any) goes on while it
            # agrees with the new token (Pipeline.current); the verifier knows the text to here.
            self.link.verifier_len = max(self.link.verifier_len, c + 1)
            return []
        if b.draft[c - b.start] == token:
            return []
        b.doomed_at = c - b.start
        pipe.classify_miss(b, b.doomed_at, token)
        pipe.on_rejection(now)
        # The verifier enters the next epoch when it rejects ``b``, before it reads anything
        # sent from now on; it knows the text up to the new token.
        pipe.discard_inflight(keep=b)
        self.link.verifier_len = c + 1
        return []

    def _verdict(self, v: Verdict, size: int, now: float) -> list[EdgeEvent]:
        pipe = self.pipe
        if not pipe.inflight:
            raise DesyncError(f"Verdict seq {v.seq} with nothing in flight")
        b = pipe.inflight[0]
        if (v.seq, v.epoch) != (b.seqs[self.LINK], b.epoch):
            raise DesyncError(
                f"Verdict for seq {v.seq}/epoch {v.epoch}, expected {b.seqs[self.LINK]}/{b.epoch}"
            )
        gamma = len(b.draft)
        if v.accepted > gamma:
            raise DesyncError(f"Verdict accepts {v.accepted} of {gamma} draft tokens")
        if v.cached:
            pipe.count(Counter.PROMPT_CACHED_TOKENS, v.cached)
        if v.budget is not None:
            pipe.budget = v.budget
        if not b.draft and v.bonus is not None and len(pipe.inflight) > 1:
            # The prompt's credit (sent before the first batch was drafted) answered with its
            # forward's token while the batches drafted meanwhile are in flight: the token was
            # drawn from p before any of their drafts was looked at, exactly as a co-generated
            # one, and is taken as one (TTFT: one round trip and the prefill).
            if v.accepted or b.start != len(self.gen.committed):
                raise DesyncError(f"a credit's Verdict accepts {v.accepted} at {b.start}")
            pipe.commit_round(b, 0, now)
            if self.gen.done:
                return []
            pipe.count(Counter.BONUS_TOKENS)
            return self._commit_known(v.bonus, TokenSource.BONUS, now)
        if b.doomed_at >= 0:
            # The rejection a co-generated token announced: everything is committed already.
            at = b.start + b.doomed_at
            if v.accepted != b.doomed_at or v.token is None or v.token != gen_at(self.gen, at):
                raise DesyncError(f"Verdict for a batch doomed at {at} does not reject it there")
            pipe.commit_round(b, v.accepted, now)
            pipe.count(Counter.REJECTIONS)
            return []
        decision = Decision(v.accepted, v.sparse, v.candidates, v.token, v.bonus)
        if v.accepted < gamma and v.bonus is not None and not decision.rejected:
            return self._cut(b, v.accepted, v.bonus, now)
        # Checked before anything is committed: a rejection carries exactly one correction, of
        # the kind this session negotiated; a full acceptance carries none. (Committing only an
        # accepted prefix would leave every batch behind it drafted from void tokens.)
        if decision.rejected != (v.accepted < gamma):
            raise DesyncError(
                f"Verdict accepts {v.accepted} of {gamma} "
                + ("with a correction" if decision.rejected else "without a correction")
            )
        if decision.rejected and getattr(v, self._correction_field) is None:
            raise DesyncError(
                f"a correction other than {self._correction_field!r}, which this session uses"
            )
        if v.bonus is not None and len(pipe.inflight) > 1:
            raise DesyncError("a bonus token while batches are in flight")
        pipe.commit_round(b, v.accepted, now)
        if self.gen.done:
            return []
        if decision.rejected:
            if len(self.gen.committed) != b.start + v.accepted:
                raise DesyncError("a rejection behind a co-generated token")
            pipe.count(Counter.REJECTIONS)
            pipe.count(Counter.DOWNLINK_REJECTION_BYTES, size)
            q = b.q_rows[v.accepted]
            token = recover(decision, q, pipe.rng, reconstruction=self.cfg.reconstruction)
            if token is not None:
                pipe.classify_miss(b, v.accepted, token)
            pipe.on_rejection(now)
            # The verifier cropped its cache to the accepted prefix and entered the next epoch.
            pipe.discard_inflight()
            self.link.verifier_len = len(self.gen.committed)
            if token is None:
                return self._ask_resample(q)
            pipe.commit_recovered(token)
        elif v.bonus is not None:
            end = b.start + gamma
            self.link.verifier_len = end
            pipe.commit_bonus(v.bonus, end)
        return []

    def _cut(self, b: Batch, accepted: int, bonus: int, now: float) -> list[EdgeEvent]:
        """The verifier's ration verified only the first ``accepted`` draft tokens of ``b``
        (all accepted) and drew ``bonus`` from p after them: commit both; the rest of the
        draft and every batch behind it are void (a new epoch, on both sides)."""
        pipe = self.pipe
        pipe.commit_round(b, accepted, now, verified=accepted)
        pipe.count(Counter.CUT_ROUNDS)
        pipe.count(Counter.CUT_TOKENS, len(b.draft) - accepted)
        if self.gen.done:
            return []
        if len(self.gen.committed) != b.start + accepted:
            raise DesyncError("a cut behind a co-generated token")
        pipe.discard_inflight()
        self.link.verifier_len = b.start + accepted
        pipe.commit_bonus(bonus, b.start + accepted)
        return []

    def _ask_resample(self, q: Probs) -> list[EdgeEvent]:
        """Every candidate failed: ask for more (drafting waits for the recovered token)."""
        pos = self.link.verifier_len
        self._resample = (pos, q)
        self.pipe.recovering = True
        self.pipe.count(Counter.RESAMPLES)
        return [Send(Resample(self.link.epoch, pos))]

    def _candidates(self, c: Candidates) -> list[EdgeEvent]:
        assert self._resample is not None
        pos, q = self._resample
        if (c.epoch, c.pos) != (self.link.epoch, pos):
            raise DesyncError(
                f"Candidates for epoch {c.epoch}, pos {c.pos}; expected {self.link.epoch}, {pos}"
            )
        token = try_candidates(c.candidates, q, self.pipe.rng)
        if token is None:
            return self._ask_resample(q)
        self._resample = None
        self.pipe.recovering = False
        self.pipe.commit_recovered(token)
        return []
