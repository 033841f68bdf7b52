"""The verifier's side of one session as a synchronous state machine: no I/O, no clock, no model.

h11-style: the driver feeds it frames (:meth:`VerifierCore.receive`) and the results of the model
work it asked for (:meth:`VerifierCore.work_done`); each call returns the events to act on, in
order: frames to :class:`Send`, model :class:`Run` requests, a :class:`Close`, and
:class:`Note`\\ s for metrics and logs. The same object serves the aiohttp handler, the fuzzer's
oracle and unit tests that need no sockets and no event loop.

State: ``epoch`` (bumped on every rejection, set by Rollback), ``expected_seq`` (the
next Propose's batch number, modulo 128), ``next_pos`` (where the next Propose of the current
epoch must start) and ``cache_len`` (tokens the target's KV cache holds once the running work is
done). Invariant while no work runs: ``next_pos == cache_len``.

State table (``state`` × input → effect):

=========== ============================ =====================================================
state       input                        effect
=========== ============================ =====================================================
HELLO       Hello, compatible            → OPEN; Send(Welcome)
HELLO       Hello with ``resume``        → RESUMING; :class:`Adopt` (the driver looks the lost
                                         session up and answers :meth:`~VerifierCore.adopted`)
RESUMING    adopted(tokens or None)      → OPEN; Send(Welcome) with ``resumed`` (or without:
                                         a new, empty session)
HELLO       anything else / incompatible Close(bad_handshake | fingerprint_mismatch | bad_hello)
OPEN, BUSY  frames past the rate limit   Close(rate_limited) (``max_frame_rate``, a token
                                         bucket of ``frame_burst``)
OPEN        undecodable frame            Send(Error bad_frame) (counts towards max_bad_frames)
OPEN        Propose, seq ≠ expected      bad_seq
OPEN        Propose, epoch < epoch       dropped unprocessed (stale: sent before a rejection);
                                         beyond ``max_stale_per_epoch`` a bad frame
OPEN        Propose, epoch > epoch       bad_epoch
OPEN        Propose, pos ≠ next_pos      bad_pos (also pos 0 without fixed tokens)
OPEN        Propose past max_context     Send(Error context_full), not fatal
OPEN        Propose, valid               → BUSY; Run(Verify | Federate); a Verify takes the
                                         queued Proposes that continue it (coalesced, one
                                         Verdict each; see ``_coalesce``)
OPEN        Rollback, valid              → BUSY; Run(Crop)
OPEN        Rollback, epoch/pos invalid  bad_rollback
OPEN        Resample, matches pending    → BUSY; Run(Draw) (at most max_resamples times)
OPEN        Resample, otherwise          bad_resample
OPEN        Hedge, co-generation on      kept (the last ``max_hedges``); used when the text
                                         reaches it (``_maybe_cogen``); without co-generation
                                         bad_hedge
OPEN        Error (fatal)                Close(closing, OK)
OPEN        Error (not fatal)            Note(EDGE_ERROR), counts as a bad frame (no reply)
OPEN        ``expire(now)`` past the     Close(idle_timeout): no model work for
            idle deadline                ``idle_timeout_s`` frees the slot
BUSY        Hedge                        kept at once, as when OPEN (a Propose queued before
                                         it carries it as a tree branch: ``_branches``)
BUSY        any other frame              decoded and queued (bounded by ``max_queued``)
BUSY        work_done(result)            → OPEN; reply (Verdict, FederatedReply, Candidates)
                                         or Error model_error; queued frames are then handled
BUSY        report(progress) due, not    Send(Progress) (Hello.progress; at most one per
            stalled                      ``progress_interval_s``, the first once the work has
                                         waited that long)
any         max_bad_frames reached       Close(too_many_bad_frames)
CLOSED      anything                     nothing
=========== ============================ =====================================================

Stale work never reaches the model: a Propose is checked when it is *handled* (after every
earlier frame's work is done), so one queued behind a rejection is already of an old epoch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import astuple, dataclass, replace
from typing import Final

import numpy as np
import numpy.typing as npt

from cloud_verifier.engine.work import (
    NO_IDS,
    NO_PROBS,
    Branch,
    BranchTaken,
    CoGenerate,
    Crop,
    Cropped,
    Draw,
    Drawn,
    Failed,
    Federate,
    Federated,
    Result,
    Skipped,
    Verified,
    Verify,
    Work,
    WorkProgress,
    batch_ends,
    cache_after,
    deferred,
)
from cloud_verifier.session.acceptance import Acceptance
from cloud_verifier.session.cloud_draft import (
    CloudDraft,
    DraftAcceptance,
    DraftLength,
    ngram_draft,
    tail_draft,
)
from shared.enums import TextEnum
from shared.errors import ErrorCode
from shared.maths.rejection import CorrectionMode
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
    Resumed,
    Rollback,
    Verdict,
    Welcome,
    text_digest,
)
from shared.wire.packing import ProtocolError, WireContext

#: WebSocket close codes the core asks for (RFC 6455).
CLOSE_OK: Final = 1000
CLOSE_POLICY_VIOLATION: Final = 1008
CLOSE_INTERNAL_ERROR: Final = 1011
_U32_MAX: Final = 2**32 - 1


class CoreState(TextEnum):
    HELLO = "hello"
    RESUMING = "resuming"  # waiting for the driver to adopt a lost session (Adopt)
    OPEN = "open"
    BUSY = "busy"
    CLOSED = "closed"


class NoteKind(TextEnum):
    OPENED = "opened"
    REFUSED = "refused"  # detail: the Error code (bad_handshake, bad_hello, ...)
    STALE = "stale"  # a Propose of an old epoch dropped unprocessed
    BAD_FRAME = "bad_frame"
    EDGE_ERROR = "edge_error"  # detail: the edge's Error code and message
    MODEL_ERROR = "model_error"
    IDLE = "idle"  # closed for want of work


@dataclass(frozen=True)
class SessionLimits:
    """One session's bounds, filled from the settings (``cloud_verifier.daemon.limits.limits_from``)
    but for the protocol's own (``max_queued``, ``max_stale_per_epoch``, ``max_hedges``); the
    defaults are the settings' defaults (tests/verifier/test_limits_derived.py holds them
    equal)."""

    max_gamma: int = 16
    max_fixed: int = 8192
    max_context: int = 8192
    max_frame: int = 1 << 20
    max_k: int = 1024
    max_bad_frames: int = 16
    max_resamples: int = 64
    #: Frames decoded while model work runs, waiting their turn (a flood beyond is refused).
    max_queued: int = 256
    #: Seconds an open session may go without model work (no valid Propose, Rollback or
    #: Resample) before it is closed and its slot freed; 0 = never.
    idle_timeout_s: float = 60.0
    #: Stale Proposes (of an old epoch) accepted per epoch: an honest edge has at most its
    #: in-flight depth (< 128) of them after a rejection; every one beyond is a bad frame.
    max_stale_per_epoch: int = SEQ_MODULUS
    #: Coalescing: Proposes queued behind the one being started that continue it (same epoch,
    #: next position, no fixed tokens) join its forward, up to this many draft tokens in all;
    #: 0 = off.
    max_coalesced: int = 64
    #: Co-generation (when the Hello asks for it): tokens the verifier may decode on its own
    #: beyond the end of the last Propose it received (a silent edge holds at most this much
    #: model work); 0 = never co-generate.
    max_cogen_ahead: int = 64
    #: Hedges (side drafts for likely rejection points) kept per session, the newest.
    max_hedges: int = 8
    #: Token trees: a Verify also verifies, in the same forward (a tree row), the hedges that
    #: fork inside its draft, up to this many tree tokens in all (each branch's token and its
    #: draft); 0 = off (hedges then wait for co-generation after the rejection). Only where the
    #: verifier draws corrections itself (greedy sampling or the greedy-draft mode) and no
    #: log-probabilities are asked for; set to 0 where the model side cannot move keys
    #: (tensor parallelism).
    max_tree_tokens: int = 32
    #: Cloud-side speculation in co-generation (no matching hedge): the verifier's own draft,
    #: at most ``cloud_draft_tokens`` tokens, verified in the co-generation forward. Sources
    #: without a model (:mod:`cloud_verifier.session.cloud_draft`), tried in the order tail, ngram;
    #: then, with ``cloud_model``, the model side's draft model.
    cloud_draft: frozenset[CloudDraft] = frozenset({CloudDraft.NGRAM})
    cloud_model: bool = False
    cloud_draft_tokens: int = 8
    cloud_draft_length: DraftLength = DraftLength.AUTO
    #: Frames a session may send per second, sustained, and in a burst (a token bucket over
    #: the ``now`` passed in); past it the session is closed (rate_limited). 0 = no limit.
    max_frame_rate: float = 1000.0
    frame_burst: int = 2000
    #: Progress frames (Hello.progress): at most one per this many seconds, the first once the
    #: session's model work has waited this long.
    progress_interval_s: float = 1.0


@dataclass(frozen=True)
class TokenCounts:
    """Tokens the verifier committed on its own in a session (or the difference of two such
    counts): the one count, kept by the core; the daemon's metrics add what each result
    added."""

    cogen: int = 0  # co-generated tokens (each a draft token accepted, or a recovered / bonus)
    hedge: int = 0  # of those, hedge draft tokens accepted (co-generated in one forward)
    cloud_draft: int = 0  # of those, the verifier's own draft tokens accepted (cloud_draft)
    tree: int = 0  # tree-branch draft tokens accepted (in the forward of their chain)

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass(frozen=True)
class TargetInfo:
    """What the core needs to know of the target model."""

    fingerprint: Fingerprint
    vocab_size: int
    max_length: int | None = None  # the model's own context limit, if any


# ------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Send:
    msg: Message


@dataclass(frozen=True)
class Run:
    work: Work


@dataclass(frozen=True)
class Close:
    """Send ``error`` (unless ``code`` is OK), then close the WebSocket with ``code``."""

    error: Error
    code: int = CLOSE_POLICY_VIOLATION


@dataclass(frozen=True)
class Note:
    kind: NoteKind
    detail: str = ""


@dataclass(frozen=True)
class Adopt:
    """Find the lost session named ``token`` (of this session's tenant: the driver checks),
    keep at most the first ``length`` tokens of its cache, and answer
    :meth:`VerifierCore.adopted` with them (None: not found, expired or not this tenant's)."""

    token: str
    length: int


Event = Send | Run | Close | Note | Adopt


def _logprobs_at(lp: Logprobs | None, pos: int) -> list[Event]:
    """The Logprobs frame of a result (Hello.logprobs), placed at ``pos``; none if not asked."""
    return [] if lp is None else [Send(replace(lp, pos=pos))]


def _reported(
    cache_len: int | None,
    work: Verify | Federate | CoGenerate | Crop,
    n: int = 0,
    branch: BranchTaken | None = None,
) -> int:
    """The cache length a result reports (the model side owns it), or the rule's."""
    return cache_after(work, n, branch) if cache_len is None else cache_len


def context_limit(limits: SessionLimits, engine_limit: int | None) -> int:
    """Tokens one session may hold: the ``max_context`` setting, capped by what the engine
    gives a session (the model's limit and its share of the KV pool). The Welcome and the
    connection's Ready announce it; the core refuses a Propose past it (``context_full``)."""
    return min(limits.max_context, engine_limit or limits.max_context)


@dataclass
class _Pending:
    """The last rejection in candidates mode: what a matching Resample draws from."""

    epoch: int
    pos: int
    used: int = 0


class VerifierCore:
    """One session's rules (module docstring). ``session_id`` comes from the driver."""

    def __init__(
        self,
        target: TargetInfo,
        limits: SessionLimits,
        session_id: str,
        resume_token: str | None = None,
    ) -> None:
        """``resume_token``: the secret the Welcome gives for resuming this session if its
        connection is lost (None: the driver keeps no lost sessions)."""
        self.target = target
        self.limits = limits
        self.session_id = session_id
        self.resume_token = resume_token
        self.state = CoreState.HELLO
        self.hello: Hello | None = None
        self.ctx: WireContext | None = None
        self.max_context = context_limit(limits, target.max_length)
        self.epoch = 0
        self.expected_seq = 0
        self.next_pos = 0
        self.cache_len = 0
        self.bad_frames = 0
        self._pending: _Pending | None = None
        self._stale_in_epoch = 0
        self._active_at = 0.0  # the last time model work started or ended (``now`` passed in)
        self._running: Work | None = None
        self._queue: deque[Message | ProtocolError] = deque()
        self.cogen = False  # negotiated in the Hello
        #: The committed text as the verifier knows it (positions 0..len-1). Invariants:
        #: ``next_pos <= len(text)``, ``cache_len <= len(text)``, and the cache holds
        #: ``text[:cache_len]``. It runs ahead of ``next_pos`` by a token the verifier chose
        #: itself (a recovered or bonus token, which the edge sends back as a fixed token) and
        #: by co-generated tokens.
        self.text: list[int] = []
        #: The edge has committed a token the verifier does not know (a recovered token it drew
        #: itself, topk / candidates modes): no co-generation until it arrives as a fixed token.
        self.edge_ahead = False
        self.tokens = TokenCounts()  # what the verifier committed on its own
        self._cogen_paused = False
        self._proposed_end = 0  # end of the last Propose received (co-generation bound)
        self._edge_drafts = False  # the last Propose carried a draft (not a credit)
        #: Side drafts from the edge (Hedge frames), newest last; matched against the text.
        self._hedges: deque[Hedge] = deque(maxlen=limits.max_hedges)
        self._cloud_off = False  # a cloud draft's work failed: this session co-generates without
        self._model_alpha = DraftAcceptance()  # its model drafts' acceptance (cloud_draft_length)
        #: The edge's drafts' measured acceptance (rationing's survival estimates).
        self._acceptance = Acceptance()
        #: The draft budget the edge was last told (Verdict.budget; it starts unbounded).
        self.budget = MAX_BUDGET
        #: Batches the ration deferred to a later step (queued again).
        self.deferred = 0
        #: The rest of the last rejected draft: (its position, its tokens) (cloud_draft tail).
        self._tail: tuple[int, list[int]] | None = None
        self._bucket = float(limits.frame_burst)  # frame-rate tokens left
        self._bucket_at: float | None = None
        self._now = 0.0  # the ``now`` of the input being handled
        self._work_at = 0.0  # when the running work started (Progress timing)
        self._progress_at = 0.0  # when the last Progress was sent
        self.resumed = 0  # tokens of a lost session's cache this session started from

    # ------------------------------------------------------------------ inputs

    def receive(self, data: bytes | str, now: float = 0.0) -> list[Event]:
        """One frame from the edge, received at ``now`` (monotonic seconds)."""
        if self.state == CoreState.CLOSED:
            return []
        self._now = now
        if self.state == CoreState.HELLO:
            self._active_at = now
            return self._handshake(data)
        if not self._take_token(now):
            self._close()
            rate, burst = self.limits.max_frame_rate, self.limits.frame_burst
            return [
                Note(NoteKind.BAD_FRAME, "rate_limited"),
                Close(
                    Error(
                        ErrorCode.RATE_LIMITED,
                        f"more than {rate:g} frames a second (burst {burst}) from this session",
                        fatal=True,
                    )
                ),
            ]
        assert self.ctx is not None
        msg: Message | ProtocolError
        try:
            if not isinstance(data, bytes):
                raise ProtocolError("frame", f"expected binary data, got {type(data).__name__}")
            msg = decode(data, self.ctx)
        except ProtocolError as e:
            msg = e
        self._cogen_paused = False
        if self.state == CoreState.BUSY and isinstance(msg, Hedge):
            # Kept at once, not queued (it needs no model work, and is matched against the
            # text, never trusted): a Propose queued before it may then carry it as a branch.
            return self._hedge(msg)
        if self.state in (CoreState.BUSY, CoreState.RESUMING):
            if len(self._queue) >= self.limits.max_queued:
                return self._bad(
                    ErrorCode.QUEUE_FULL, f"more than {self.limits.max_queued} frames queued"
                )
            self._queue.append(msg)
            return []
        out = self._handle(msg, now)
        return out + self._maybe_cogen()

    def work_done(self, result: Result, now: float = 0.0) -> list[Event]:
        """The result of the :class:`Run` this core asked for last, at ``now``."""
        work = self._running
        if work is None or self.state != CoreState.BUSY:
            raise RuntimeError("work_done without work running")
        self._now = now
        self._running = None
        if not isinstance(work, CoGenerate):  # co-generation is not the edge's activity
            self._active_at = now
        self.state = CoreState.OPEN
        out = self._apply(work, result)
        while self.state == CoreState.OPEN and self._queue:
            out += self._handle(self._queue.popleft(), now)
        return out + self._maybe_cogen()

    def _take_token(self, now: float) -> bool:
        """The frame-rate bucket: refill by the time since the last frame, take one."""
        rate = self.limits.max_frame_rate
        if rate <= 0:
            return True
        if self._bucket_at is not None:
            refill = max(0.0, now - self._bucket_at) * rate
            self._bucket = min(float(self.limits.frame_burst), self._bucket + refill)
        self._bucket_at = now
        if self._bucket < 1.0:
            return False
        self._bucket -= 1.0
        return True

    def progress_due(self) -> float | None:
        """When the driver should next :meth:`report` the running work's progress (None: no
        work runs, or the edge did not ask for Progress frames)."""
        if self.state != CoreState.BUSY or self.hello is None or not self.hello.progress:
            return None
        return max(self._work_at, self._progress_at) + self.limits.progress_interval_s

    def report(self, p: WorkProgress, now: float) -> list[Event]:
        """The engine's word on the running work at ``now``: a Progress frame when one is due
        and the engine is not stalled (a stalled engine's sessions hear nothing, so their edges
        leave after their own deadline)."""
        due = self.progress_due()
        if due is None or now < due or p.stalled:
            return []
        self._progress_at = now
        eta_ms = min(_U32_MAX, max(0, round(p.eta_s * 1000)))
        return [Send(Progress(p.steps % (_U32_MAX + 1), p.ahead, eta_ms, p.running))]

    def adopted(self, tokens: Sequence[int] | None) -> list[Event]:
        """The driver's answer to :class:`Adopt`: the kept tokens of the lost session's cache
        (the slot the driver hands this session holds exactly these), or None for a new,
        empty session. Sends the Welcome."""
        if self.state != CoreState.RESUMING:
            raise RuntimeError("adopted() without an Adopt pending")
        resumed = None
        if tokens is not None:
            self.text = list(tokens)
            self.cache_len = self.next_pos = self._proposed_end = len(self.text)
            self.resumed = len(self.text)
            resumed = Resumed(len(self.text), text_digest(self.text))
        self.state = CoreState.OPEN
        out: list[Event] = [Note(NoteKind.OPENED), Send(self._welcome(resumed))]
        while self.state == CoreState.OPEN and self._queue:
            out += self._handle(self._queue.popleft(), self._now)
        return out + self._maybe_cogen()

    def admitted(self, now: float) -> None:
        """The session's turn in the verifier's admission line came at ``now``: its idle clock
        starts then (time spent waiting in line is not idleness)."""
        self._active_at = max(self._active_at, now)

    def idle_deadline(self) -> float | None:
        """When an open session with no model work is closed (None: not now, or never)."""
        if self.state != CoreState.OPEN or self.limits.idle_timeout_s <= 0:
            return None
        return self._active_at + self.limits.idle_timeout_s

    def expire(self, now: float) -> list[Event]:
        """Close the session if it has been idle past its deadline (the driver calls this when
        the deadline passes with no frame)."""
        deadline = self.idle_deadline()
        if deadline is None or now < deadline:
            return []
        self._close()
        t = self.limits.idle_timeout_s
        return [
            Note(NoteKind.IDLE),
            Close(
                Error(
                    ErrorCode.IDLE_TIMEOUT,
                    f"no Propose for {t:g} s (idle_timeout); the session's slot is freed",
                    fatal=True,
                )
            ),
        ]

    @property
    def running(self) -> Work | None:
        return self._running

    @property
    def queued(self) -> int:
        """Frames received while work runs, not handled yet."""
        return len(self._queue)

    @property
    def closed(self) -> bool:
        return self.state == CoreState.CLOSED

    # ------------------------------------------------------------------ handshake

    def _refuse(self, code: ErrorCode, message: str) -> list[Event]:
        """The Hello refused: the session closes; the refusal's reason is the Error's code."""
        self.state = CoreState.CLOSED
        return [Note(NoteKind.REFUSED, code), Close(Error(code, message, fatal=True))]

    def _handshake(self, data: bytes | str) -> list[Event]:
        try:
            if not isinstance(data, bytes):
                raise ProtocolError("frame", f"expected binary data, got {type(data).__name__}")
            msg = decode(data)
        except ProtocolError as e:
            return self._refuse(ErrorCode.BAD_HANDSHAKE, f"expected Hello: {e}")
        if not isinstance(msg, Hello):
            return self._refuse(
                ErrorCode.BAD_HANDSHAKE, f"expected Hello first, got {type(msg).__name__}"
            )
        t, lim = self.target, self.limits
        reason = msg.fingerprint.compatible_with(t.fingerprint)
        if reason is not None:
            return self._refuse(ErrorCode.FINGERPRINT_MISMATCH, reason)
        if msg.k > lim.max_k or msg.m > lim.max_k:
            return self._refuse(
                ErrorCode.BAD_HELLO,
                f"k = {msg.k} / m = {msg.m} exceed this verifier's limit {lim.max_k}",
            )
        if msg.logprobs is not None and msg.reply_mode == ReplyMode.FEDERATED:
            return self._refuse(
                ErrorCode.BAD_HELLO,
                "logprobs: a federated session gets distributions, not log-probabilities",
            )
        self.hello = msg
        self.ctx = WireContext(
            vocab_size=t.vocab_size,
            max_gamma=lim.max_gamma,
            max_fixed=lim.max_fixed,
            max_k=lim.max_k,
            max_frame=lim.max_frame,
            draft_probs=msg.correction != CorrectionMode.GREEDY_DRAFT,
            coarse_q=msg.sampling.greedy,
        )
        self.cogen = msg.cogen_end > 0 and msg.reply_mode == ReplyMode.VERDICT
        if msg.resume is not None:
            self.state = CoreState.RESUMING
            return [Adopt(msg.resume.token, msg.resume.length)]
        self.state = CoreState.OPEN
        return [Note(NoteKind.OPENED), Send(self._welcome(None))]

    def _welcome(self, resumed: Resumed | None) -> Welcome:
        lim = self.limits
        return Welcome(
            fingerprint=self.target.fingerprint,
            session_id=self.session_id,
            max_gamma=lim.max_gamma,
            max_fixed=lim.max_fixed,
            max_context=self.max_context,
            max_frame=lim.max_frame,
            resume=self.resume_token if self.hello is not None and self.hello.resumable else None,
            resumed=resumed,
        )

    # ------------------------------------------------------------------ frames

    def _handle(self, msg: Message | ProtocolError, now: float) -> list[Event]:
        if isinstance(msg, ProtocolError):
            return self._bad(ErrorCode.BAD_FRAME, str(msg))
        if isinstance(msg, Propose):
            out = self._propose(msg)
        elif isinstance(msg, Rollback):
            out = self._rollback(msg)
        elif isinstance(msg, Resample):
            out = self._resample(msg)
        elif isinstance(msg, Hedge):
            return self._hedge(msg)
        elif isinstance(msg, Error):
            note = Note(NoteKind.EDGE_ERROR, f"{msg.code}: {msg.message}")
            if msg.fatal:
                self._close()
                return [
                    note,
                    Close(Error(ErrorCode.CLOSING, f"edge error {msg.code}", fatal=True), CLOSE_OK),
                ]
            # The edge never needs to send one: each counts, and gets no reply (no echo).
            return [note, *self._bad(ErrorCode.EDGE_ERROR, msg.code, reply=False)]
        else:
            return self._bad(
                ErrorCode.BAD_FRAME, f"type: {type(msg).__name__} is not valid from the edge"
            )
        if self.state == CoreState.BUSY:
            self._active_at = now
        return out

    def _close(self) -> None:
        self.state = CoreState.CLOSED
        self._queue.clear()

    def _bad(self, code: ErrorCode, message: str, *, reply: bool = True) -> list[Event]:
        self.bad_frames += 1
        note = Note(NoteKind.BAD_FRAME, code)
        if self.bad_frames >= self.limits.max_bad_frames:
            self._close()
            return [
                note,
                Close(
                    Error(
                        ErrorCode.TOO_MANY_BAD_FRAMES,
                        f"{self.bad_frames} bad frames in this session (last: {code}: {message})",
                        fatal=True,
                    )
                ),
            ]
        return [note, Send(Error(code, message, fatal=False))] if reply else [note]

    def _start(self, work: Work) -> list[Event]:
        self.state = CoreState.BUSY
        self._running = work
        self._work_at = self._now
        return [Run(work)]

    def _propose(self, p: Propose) -> list[Event]:
        if p.seq != self.expected_seq:
            return self._bad(ErrorCode.BAD_SEQ, f"seq {p.seq}, expected {self.expected_seq}")
        self.expected_seq = (p.seq + 1) % SEQ_MODULUS
        if p.epoch < self.epoch:
            # Sent before the edge saw a rejection: no work. An honest edge has at most its
            # in-flight depth of these per rejection.
            self._stale_in_epoch += 1
            if self._stale_in_epoch > self.limits.max_stale_per_epoch:
                return self._bad(
                    ErrorCode.STALE_FLOOD,
                    f"more than {self.limits.max_stale_per_epoch} Proposes of old epochs "
                    f"since epoch {self.epoch} began",
                )
            return [Note(NoteKind.STALE)]
        if p.epoch > self.epoch:
            return self._bad(
                ErrorCode.BAD_EPOCH, f"epoch {p.epoch} is ahead of the session's {self.epoch}"
            )
        f, g = len(p.fixed), len(p.draft)
        known = len(self.text)
        if self.cogen and not self.next_pos <= p.pos <= known:
            # The edge starts where it last knew the verifier to be; co-generated tokens may
            # have moved the verifier on since.
            return self._bad(ErrorCode.BAD_POS, f"pos {p.pos} outside [{self.next_pos}, {known}]")
        if not self.cogen and p.pos != self.next_pos:
            return self._bad(ErrorCode.BAD_POS, f"pos {p.pos}, expected {self.next_pos}")
        if self.next_pos == 0 and f == 0:
            return self._bad(ErrorCode.BAD_POS, "pos 0 needs at least one fixed token (the prompt)")
        assert self.hello is not None
        if g == 0 and self.hello.reply_mode == ReplyMode.FEDERATED:
            return self._bad(ErrorCode.BAD_FRAME, "a federated Propose needs draft tokens")
        if p.pos + f + g > self.max_context:
            return [
                Send(
                    Error(
                        ErrorCode.CONTEXT_FULL,
                        f"{p.pos} + {f} fixed + {g} draft tokens exceed the context limit "
                        f"{self.max_context}; start a new session",
                        fatal=False,
                    )
                )
            ]
        assert self.hello is not None
        self._pending = None
        self._proposed_end = p.pos + f + g
        self._edge_drafts = g > 0
        if self.hello.reply_mode == ReplyMode.FEDERATED:
            return self._start(Federate(p))
        return self._match(p)

    def _match(self, p: Propose) -> list[Event]:
        """A valid Propose of this epoch against the known text: tokens at known positions are
        compared with it (a fixed token that differs is a bad frame; a draft token that differs
        is a *rejection* there at no model cost, its correction the known token, which the edge
        already has); the rest is verified by the model (:class:`Verify`)."""
        assert self.hello is not None
        f, g, known = len(p.fixed), len(p.draft), len(self.text)
        over = known - p.pos  # positions of this Propose the verifier already knows (>= 0)
        nf = min(f, over)
        if nf and p.fixed[:nf].tolist() != self.text[p.pos : p.pos + nf]:
            return self._bad(
                ErrorCode.BAD_POS, f"fixed tokens at {p.pos} differ from the committed text"
            )
        nd = min(g, max(0, over - f))
        base = p.pos + f
        for i in range(nd):
            if int(p.draft[i]) != self.text[base + i]:
                # Exact: the known token was sampled from p (co-generated, or the verifier's own
                # recovered / bonus token) before this draft token was looked at.
                self.next_pos = base + i
                self._new_epoch()
                self._tail = (base + i + 1, p.draft[i + 1 :].tolist())
                return [Send(Verdict(p.epoch, p.seq, accepted=i, token=self.text[base + i]))]
        want_bonus = p.want_bonus or self.hello.bonus
        # Every position of this Propose is known (its fixed tokens too): no model work.
        if nd == g and known >= base and (not want_bonus or known > base + g):
            self.next_pos = base + g
            bonus = self.text[base + g] if want_bonus else None
            return [Send(Verdict(p.epoch, p.seq, accepted=g, bonus=bonus))]
        if over > 0 or self.cache_len < p.pos:
            # Start at the cache's end: feed the known tokens it lacks as fixed tokens (every
            # known position of this Propose matched), then the new fixed tokens and the draft
            # tokens past the known text. (cache_len <= p.pos + nf + nd: that is known, or
            # less when the Propose ends inside the known text.)
            fixed = self.text[self.cache_len : p.pos + nf + nd] + p.fixed[nf:].tolist()
            p = Propose(
                epoch=p.epoch,
                seq=p.seq,
                pos=self.cache_len,
                draft=p.draft[nd:],
                q=p.q[nd:],
                fixed=np.array(fixed, np.int64),
                want_bonus=p.want_bonus,
            )
        more = self._coalesce(p)
        branches = self._branches(p, more)
        # Rationing: each draft token's survival, from the draft's probabilities of the tokens
        # before it and this session's measured acceptance (never a tree's row: not cut).
        q = [float(x) for s in (p, *more) for x in s.q.tolist()]
        survival = () if branches else self._acceptance.survival(q)
        return self._start(
            Verify(
                p,
                (more[-1] if more else p).want_bonus or self.hello.bonus,
                more,
                matched=nd,
                branches=branches,
                survival=survival,
                mean_token=self._acceptance.token(self._acceptance.q_mean),
                promised=self.budget,
            )
        )

    def _branches(self, p: Propose, more: Sequence[Propose]) -> tuple[Branch, ...]:
        """The hedges that fork inside this forward's draft (newest first, one per position
        and token, none that agrees with the draft token it replaces), as tree branches within
        ``max_tree_tokens`` and the context. Only where the verifier draws the recovered token
        itself (else a branch could never open) and sends no log-probabilities."""
        assert self.hello is not None
        budget = self.limits.max_tree_tokens
        h = self.hello
        if not (
            budget > 0
            and self._hedges
            and h.logprobs is None
            and (h.sampling.greedy or h.correction == CorrectionMode.GREEDY_DRAFT)
        ):
            return ()
        draft = [int(t) for s in (p, *more) for t in s.draft.tolist()]
        base = p.pos + len(p.fixed)
        end = base + len(draft)  # where the tree's layout starts
        out: list[Branch] = []
        seen: set[tuple[int, int]] = set()
        for hg in reversed(self._hedges):
            at = hg.pos - base
            if not 0 <= at < len(draft) or hg.token == draft[at] or (at, hg.token) in seen:
                continue
            room = min(budget - 1, self.max_context - end - 1)
            if room < 0:
                break
            seen.add((at, hg.token))
            out.append(Branch(at, hg.token, hg.draft[:room].astype(np.int64)))
            budget -= 1 + len(out[-1].draft)
            end += 1 + len(out[-1].draft)
        return tuple(out)

    def _new_epoch(self) -> None:
        """A rejection: every batch the edge sent behind the rejected one is now stale."""
        self.epoch += 1
        self._stale_in_epoch = 0

    def _maybe_cogen(self) -> list[Event]:
        """Co-generation: with no valid draft of this session queued, decode the next token."""
        if not (
            self.cogen
            and self.state == CoreState.OPEN
            and not self._queue
            and not self.edge_ahead
            and not self._cogen_paused
            and self.text
        ):
            return []
        assert self.hello is not None
        known = len(self.text)
        if known >= min(self.hello.cogen_end, self.max_context):
            return []
        ahead = self.limits.max_cogen_ahead - (known - self._proposed_end)
        if ahead <= 0:
            return []
        fixed = np.array(self.text[self.cache_len :], np.int64)
        # A hedge's continuation may be verified in the same forward (bonus after it): at most
        # ``ahead`` tokens in all, within the co-generation bound and the context.
        room = min(ahead, min(self.hello.cogen_end, self.max_context) - known) - 1
        draft, q = self._hedge_draft(known, room)
        if len(draft) or self._cloud_off or room <= 0:
            return self._start(CoGenerate(self.cache_len, fixed, draft, q))
        # Rationing: the verifier's own drafts obey the budget its scheduler set (under load a
        # short draft, the GPU's time going to the edges' drafts first).
        n = min(room, self.limits.cloud_draft_tokens, self.budget)
        ids = self._own_draft(n)
        if ids:
            draft, q = np.array(ids, np.int64), np.ones(len(ids), np.float32)
            return self._start(CoGenerate(self.cache_len, fixed, draft, q, cloud=True))
        model = n if self.limits.cloud_model else 0
        alpha = (
            self._model_alpha.alpha
            if model and self.limits.cloud_draft_length == DraftLength.AUTO
            else None
        )
        return self._start(
            CoGenerate(
                self.cache_len, fixed, cloud=model > 0, model_tokens=model, model_alpha=alpha
            )
        )

    def _own_draft(self, n: int) -> list[int]:
        """Up to ``n`` draft tokens of the verifier's own without a model (tail, then ngram);
        empty: none of them has one."""
        sources = self.limits.cloud_draft
        ids = tail_draft(self._tail, self.text, n) if CloudDraft.TAIL in sources else []
        if not ids and CloudDraft.NGRAM in sources:
            ids = ngram_draft(self.text, n)
        return ids

    def _hedge(self, h: Hedge) -> list[Event]:
        """Keep a side draft (no reply, no model work)."""
        if not self.cogen:
            return self._bad(ErrorCode.BAD_HEDGE, "hedges need co-generation (Hello.cogen_end > 0)")
        if h.pos == 0 or h.pos + 1 + len(h.draft) > self.max_context:
            return self._bad(
                ErrorCode.BAD_HEDGE,
                f"hedge at {h.pos} with {len(h.draft)} tokens outside [1, {self.max_context})",
            )
        self._hedges.append(h)
        return []

    def _hedge_draft(
        self, known: int, room: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """The draft tokens of the newest hedge that agrees with the text and continues past
        it (at most ``room``): empty if none.

        Exact: a hedge is drafted greedily (q a point mass) by the draft model after the text
        up to its position (the match checks it), before the verifier drew anything past
        ``known``; CoGenerate verifies it by the greedy-draft rule."""
        assert self.hello is not None
        if room <= 0:
            return NO_IDS, NO_PROBS
        for h in reversed(self._hedges):
            ids = [h.token, *h.draft.tolist()]
            k = known - h.pos  # hedge tokens already in the text
            if 0 < k < len(ids) and self.text[h.pos : known] == ids[:k]:
                draft = h.draft[k - 1 : k - 1 + room]
                # A point mass whatever the frame's q says: the greedy-draft rule recovers from
                # p without x, which is exact only for q(x) = 1.
                return draft, np.ones(len(draft), np.float32)
        return NO_IDS, NO_PROBS

    def _coalesce(self, p: Propose) -> tuple[Propose, ...]:
        """The queued Proposes that continue ``p`` and may share its forward: the head of the
        queue while each is the expected seq of this epoch, starts where the last ends, has no
        fixed tokens and its predecessor asked for no bonus (a bonus comes back as a fixed
        token), within ``max_coalesced`` draft tokens and the context. Taking them here is
        handling them: their seq numbers are consumed, in order."""
        assert self.hello is not None
        if self.limits.max_coalesced <= 0 or self.hello.bonus:
            return ()
        more: list[Propose] = []
        last, total = p, len(p.draft)
        end = p.pos + len(p.fixed) + len(p.draft)
        while self._queue:
            nxt = self._queue[0]
            if not (
                isinstance(nxt, Propose)
                and not last.want_bonus
                and nxt.seq == self.expected_seq
                and nxt.epoch == self.epoch
                and nxt.pos == end
                and len(nxt.fixed) == 0
                and total + len(nxt.draft) <= self.limits.max_coalesced
                and end + len(nxt.draft) <= self.max_context
            ):
                break
            self._queue.popleft()
            self.expected_seq = (nxt.seq + 1) % SEQ_MODULUS
            more.append(nxt)
            last, total, end = nxt, total + len(nxt.draft), end + len(nxt.draft)
        return tuple(more)

    def _rollback(self, r: Rollback) -> list[Event]:
        if r.epoch <= self.epoch:
            return self._bad(ErrorCode.BAD_ROLLBACK, f"epoch {r.epoch} is not after {self.epoch}")
        if not 0 <= r.pos <= self.next_pos:
            return self._bad(ErrorCode.BAD_ROLLBACK, f"pos {r.pos} outside [0, {self.next_pos}]")
        self.epoch = r.epoch
        self._stale_in_epoch = 0
        self.next_pos = r.pos
        del self.text[r.pos :]
        self.edge_ahead = False
        self._pending = None
        self._hedges.clear()
        self._tail = None
        return self._start(Crop(r.pos))

    def _resample(self, r: Resample) -> list[Event]:
        pr = self._pending
        if pr is None or (r.epoch, r.pos) != (pr.epoch, pr.pos):
            want = "none pending" if pr is None else f"pending: epoch {pr.epoch}, pos {pr.pos}"
            return self._bad(
                ErrorCode.BAD_RESAMPLE, f"no correction at epoch {r.epoch}, pos {r.pos} ({want})"
            )
        if pr.used >= self.limits.max_resamples:
            return self._bad(
                ErrorCode.BAD_RESAMPLE,
                f"more than {self.limits.max_resamples} resamples for the correction at {r.pos}",
            )
        pr.used += 1
        assert self.hello is not None
        return self._start(Draw(pr.epoch, pr.pos, self.hello.m))

    # ------------------------------------------------------------------ results

    def _apply(self, work: Work, result: Result) -> list[Event]:
        if isinstance(result, Failed):
            return self._failed(work, result)
        if isinstance(work, Verify) and isinstance(result, Verified):
            return self._verified(work, result)
        if isinstance(work, CoGenerate) and isinstance(result, Verified):
            return self._cogen_done(work, result)
        if isinstance(work, CoGenerate) and isinstance(result, Skipped):
            # An edge that drafts sends its next batch soon: co-generation waits for it rather
            # than queue again ahead of it. A credit (cloud-only) sends nothing until tokens
            # arrive: its co-generation queues again at once (paused, it would never resume).
            self._cogen_paused = self._edge_drafts
            return []
        if isinstance(work, Federate) and isinstance(result, Federated):
            p = work.propose
            self.next_pos = self.cache_len = _reported(result.cache_len, work)
            self.text[p.pos :] = [*p.fixed.tolist(), *p.draft.tolist()]
            return [Send(FederatedReply(p.epoch, p.seq, result.dists, result.p_draft, result.l1))]
        if isinstance(work, Crop) and isinstance(result, Cropped):
            self.cache_len = _reported(result.cache_len, work)
            return []
        if isinstance(work, Draw) and isinstance(result, Drawn):
            return [
                *_logprobs_at(result.logprobs, work.pos),
                Send(Candidates(work.epoch, work.pos, result.candidates)),
            ]
        raise TypeError(f"{type(result).__name__} is not the result of {type(work).__name__}")

    def _verified(self, work: Verify, result: Verified) -> list[Event]:
        """One Verdict per segment: every segment before the one holding the end of the
        accepted prefix is fully accepted (no correction, no bonus); that one carries the
        decision's correction or bonus; the segments behind a rejection get nothing (they
        are of an old epoch now, as if they had been queued and dropped)."""
        p, d = work.propose, result.decision
        # Rationing verified the first ``g`` draft tokens only (engine.work.rationed): at a
        # batch's end the batches behind are deferred (queued again, as they came, if these
        # are accepted whole); inside the first batch a cut: a full acceptance of those is
        # followed by the bonus token, and the rest of the draft is void (a new epoch).
        g, n = (len(work.draft) if result.cut is None else result.cut), d.accepted
        later = deferred(work, g)
        cut = g < len(work.draft) and not later
        segments = work.segments
        if later:
            ends = batch_ends(work)
            segments, behind = segments[: ends.index(g) + 1], segments[ends.index(g) + 1 :]
        else:
            behind = ()
        self._acceptance.observe(work.q[:g].tolist(), n)
        self.text[p.pos :] = [*p.fixed.tolist(), *work.draft[:n].tolist()]
        # (before the verdicts: the edge has them when it commits the tokens)
        out: list[Event] = _logprobs_at(result.logprobs, len(self.text) - n)
        self.edge_ahead = False
        # The model side cropped the cache to the accepted prefix on a rejection (to the
        # recovered token and the accepted tokens of the branch it opened, if any).
        br = result.branch
        branch = work.branches[br.index] if br is not None else None
        opened: list[int] = []  # the branch's accepted tokens, then its recovered / bonus one
        if br is not None and branch is not None:
            if not (n < g and branch.opened_by(d)):
                raise TypeError("a branch taken where the recovered token does not open it")
            last = br.decision.token if br.decision.token is not None else br.decision.bonus
            if last is None:
                raise TypeError("a taken branch's decision carries no token")
            opened = [*branch.draft[: br.decision.accepted].tolist(), last]
        # Cached beyond the chain's accepted prefix: the recovered token and the accepted
        # branch tokens (as many as ``opened`` holds).
        taken = len(opened)
        self.cache_len = _reported(result.cache_len, work, n, br)
        self.next_pos = self.cache_len - taken
        if n < g:
            # Rejection: every batch the edge sent behind this one is now of an old epoch.
            self._new_epoch()
            self._tail = None if taken else (self.next_pos + 1, work.draft[n + 1 :].tolist())
            if result.kept_row:
                self._pending = _Pending(self.epoch, self.next_pos)
            if d.token is not None:
                self.text.append(d.token)  # the verifier's own recovered token
            else:
                self.edge_ahead = True  # the edge draws it
        elif d.bonus is not None:
            # A bonus token is committed by the edge and comes back as a fixed token.
            self.text.append(d.bonus)
            if cut:
                self._new_epoch()
                self._tail = (self.next_pos + 1, work.draft[n + 1 :].tolist())
        elif cut:
            raise TypeError("a cut draft decided without its bonus token")
        told = result.budget if result.budget is not None and result.budget != self.budget else None
        if told is not None:
            self.budget = told
        left = n + work.matched
        for i, s in enumerate(segments):
            gs = len(s.draft) + (work.matched if i == 0 else 0)
            # (only the first segment carries fixed tokens: the prefix cache's share of them)
            cached = result.cached if i == 0 and result.cached else None
            if left >= gs and i < len(segments) - 1:
                out.append(Send(Verdict(epoch=s.epoch, seq=s.seq, accepted=gs, cached=cached)))
                left -= gs
                continue
            verdict = Verdict(
                epoch=s.epoch,
                seq=s.seq,
                accepted=left,
                sparse=d.sparse,
                candidates=d.candidates,
                token=d.token,
                bonus=d.bonus,
                cached=cached,
                budget=told,
            )
            out.append(Send(verdict))
            out += [Note(NoteKind.STALE)] * (len(segments) - 1 - i)
            break
        if behind and n == g:
            # Deferred behind an accepted whole: queued again, first, as they came.
            self._queue.extendleft(reversed(behind))
            self.expected_seq = behind[0].seq
            self.deferred += len(behind)
        else:
            out += [Note(NoteKind.STALE)] * len(behind)
        if opened:
            # The branch the recovered token opened, decided in the same forward: its tokens
            # are the verifier's, sent like co-generated ones (after the Verdict, which
            # commits the recovered token they follow).
            pos = len(self.text)
            self.text += opened
            self.tokens += TokenCounts(tree=len(opened) - 1)
            out += [Send(Generated(self.epoch, pos + i, t)) for i, t in enumerate(opened)]
        return out

    def _cogen_done(self, work: CoGenerate, result: Verified) -> list[Event]:
        """Co-generated tokens: the hedge's *accepted* prefix (if any), then the *recovered* or
        *bonus* token, each drawn after the known text (law p, whatever the edge drafts for
        these positions later). One Generated frame each."""
        if result.budget is not None:
            self.budget = result.budget
        d = result.decision
        draft = work.draft if result.drafted is None else result.drafted
        token = d.token if d.accepted < len(draft) else d.bonus
        if token is None:
            raise TypeError("a CoGenerate's result carries no token")
        self.cache_len = _reported(result.cache_len, work, d.accepted)
        tokens = [*draft[: d.accepted].tolist(), token]
        pos = len(self.text)
        self.text += tokens
        cloud = d.accepted if work.cloud else 0  # the accepted draft's: a hedge's, or our own
        self.tokens += TokenCounts(cogen=len(tokens), hedge=d.accepted - cloud, cloud_draft=cloud)
        if work.model_tokens:
            if len(draft):
                self._model_alpha.observe(len(draft), d.accepted)
            else:
                self._model_alpha.fade()
        own = work.cloud  # the accepted draft tokens are the verifier's own
        return [
            *_logprobs_at(result.logprobs, pos),
            *(
                Send(Generated(self.epoch, pos + i, t, cloud=own and i < d.accepted))
                for i, t in enumerate(tokens)
            ),
        ]

    def _failed(self, work: Work, result: Failed) -> list[Event]:
        why = f"{result.kind}: {result.message}"  # the kind, then what it says to a person
        note = Note(NoteKind.MODEL_ERROR, why)
        expected = self.cache_len  # the engine restores the cache to its length before the work
        self.cache_len = result.cache_len
        if isinstance(work, CoGenerate) and result.cache_len == expected:
            if work.cloud and not self._cloud_off:
                # The draft's extra tokens may not fit the session's KV share: co-generation
                # goes on without cloud drafts in this session.
                self._cloud_off = True
                return [note, *self._maybe_cogen()]
            self._cogen_paused = True  # the edge asked for nothing: no error frame
            return [note]
        if result.cache_len != expected:  # the cache could not be restored
            self._close()
            return [
                note,
                Close(
                    Error(ErrorCode.MODEL_ERROR, why + "; rebuild the session", fatal=True),
                    CLOSE_INTERNAL_ERROR,
                ),
            ]
        return [note, Send(Error(ErrorCode.MODEL_ERROR, why, fatal=False))]
