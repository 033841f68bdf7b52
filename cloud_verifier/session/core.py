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
                                         Verdict each; see ``proposals.coalesce``)
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
                                         it carries it as a tree branch: ``cogen.branches``)
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

Beside it in ``cloud_verifier/session/``, one job a module: ``events`` (what it returns),
``limits`` (its bounds), ``opening`` (the Hello, reading frames), ``proposals`` (a Propose's way
to the model), ``results`` (what a Verify's result means), ``cogeneration`` (co-generation, its
hedges and cloud drafts: :class:`CoGeneration`) and ``liveness`` (frame rate, idle deadline,
Progress: :class:`Liveness`). The core owns one of each class and applies what they decide.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cloud_verifier.engine.work import (
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
)
from cloud_verifier.session.cogeneration import CoGeneration, TokenCounts
from cloud_verifier.session.events import (
    CLOSE_INTERNAL_ERROR,
    CLOSE_OK,
    Adopt,
    CoreState,
    Event,
    Note,
    NoteKind,
    Run,
    Send,
    closing,
    logprobs_at,
)
from cloud_verifier.session.limits import SessionLimits, TargetInfo, context_limit
from cloud_verifier.session.liveness import Liveness
from cloud_verifier.session.opening import read_frame, read_hello, wire_context
from cloud_verifier.session.pace import PaceMeter
from cloud_verifier.session.proposals import Known, coalesce, match, misplaced
from cloud_verifier.session.results import reported, verified_outcome
from shared.errors import ErrorCode
from shared.maths.acceptance import Acceptance
from shared.wire.messages import (
    MAX_BUDGET,
    SEQ_MODULUS,
    Candidates,
    Error,
    FederatedReply,
    Generated,
    Hedge,
    Hello,
    Message,
    Propose,
    ReplyMode,
    Resample,
    Resumed,
    Rollback,
    Welcome,
    text_digest,
)
from shared.wire.packing import ProtocolError, WireContext


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
        self._running: Work | None = None
        self._queue: deque[Message | ProtocolError] = deque()
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
        self.cogen = CoGeneration(limits)  # negotiated in the Hello (``cogen.on``)
        self.live = Liveness(limits)  # frame rate, idle deadline, Progress timing
        #: The edge's drafts' measured acceptance (rationing's survival estimates).
        self._acceptance = Acceptance()
        #: The draft budget the edge was last told (Verdict.budget; it starts unbounded).
        self.budget = MAX_BUDGET
        #: Batches the ration deferred to a later step (queued again), and in how many steps
        #: in a row (the scheduler serves the round whole at work.DEFER_BOUND).
        self.deferred = 0
        self._waited = 0
        #: The rate this session has attained against the one it is owed (the scheduler's
        #: weight of its work).
        self.pace = PaceMeter(limits.service_rate)
        self._now = 0.0  # the ``now`` of the input being handled
        self.resumed = 0  # tokens of a lost session's cache this session started from

    # ------------------------------------------------------------------ inputs

    def receive(self, data: bytes | str, now: float = 0.0) -> list[Event]:
        """One frame from the edge, received at ``now`` (monotonic seconds)."""
        if self.state == CoreState.CLOSED:
            return []
        self._now = now
        if self.state == CoreState.HELLO:
            self.live.active_at = now
            return self._handshake(data)
        if not self.live.take_token(now):
            self._close()
            return self.live.rate_limited()
        assert self.ctx is not None
        msg = read_frame(data, self.ctx)
        self.cogen.paused = False
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
            self.live.active_at = now
        self.state = CoreState.OPEN
        out = self._apply(work, result)
        while self.state == CoreState.OPEN and self._queue:
            out += self._handle(self._queue.popleft(), now)
        return out + self._maybe_cogen()

    def progress_due(self) -> float | None:
        """When the driver should next :meth:`report` the running work's progress (None: no
        work runs, or the edge did not ask for Progress frames)."""
        if self.state != CoreState.BUSY or self.hello is None or not self.hello.progress:
            return None
        return self.live.progress_due()

    def report(self, p: WorkProgress, now: float) -> list[Event]:
        """The engine's word on the running work at ``now``: a Progress frame when one is due
        and the engine is not stalled (a stalled engine's sessions hear nothing, so their edges
        leave after their own deadline)."""
        due = self.progress_due()
        if due is None or now < due or p.stalled:
            return []
        return [Send(self.live.progress(p, now))]

    def adopted(self, tokens: Sequence[int] | None) -> list[Event]:
        """The driver's answer to :class:`Adopt`: the kept tokens of the lost session's cache
        (the slot the driver hands this session holds exactly these), or None for a new,
        empty session. Sends the Welcome."""
        if self.state != CoreState.RESUMING:
            raise RuntimeError("adopted() without an Adopt pending")
        resumed = None
        if tokens is not None:
            self.text = list(tokens)
            self.cache_len = self.next_pos = self.cogen.proposed_end = len(self.text)
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
        self.live.active_at = max(self.live.active_at, now)

    def idle_deadline(self) -> float | None:
        """When an open session with no model work is closed (None: not now, or never)."""
        return self.live.idle_deadline() if self.state == CoreState.OPEN else None

    def expire(self, now: float) -> list[Event]:
        """Close the session if it has been idle past its deadline (the driver calls this when
        the deadline passes with no frame)."""
        deadline = self.idle_deadline()
        if deadline is None or now < deadline:
            return []
        self._close()
        return self.live.idle_closed()

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

    def _handshake(self, data: bytes | str) -> list[Event]:
        msg = read_hello(data, self.target, self.limits)
        if not isinstance(msg, Hello):
            # The Hello refused: the session closes; the refusal's reason is the Error's code.
            code, message = msg
            self.state = CoreState.CLOSED
            return closing(Note(NoteKind.REFUSED, code), code, message)
        self.hello = msg
        self.ctx = wire_context(msg, self.target, self.limits)
        self.cogen.on = msg.cogen_end > 0 and msg.reply_mode == ReplyMode.VERDICT
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
                return closing(note, ErrorCode.CLOSING, f"edge error {msg.code}", CLOSE_OK)
            # The edge never needs to send one: each counts, and gets no reply (no echo).
            return [note, *self._bad(ErrorCode.EDGE_ERROR, msg.code, reply=False)]
        else:
            return self._bad(
                ErrorCode.BAD_FRAME, f"type: {type(msg).__name__} is not valid from the edge"
            )
        if self.state == CoreState.BUSY:
            self.live.active_at = now
        return out

    def _close(self) -> None:
        self.state = CoreState.CLOSED
        self._queue.clear()

    def _bad(self, code: ErrorCode, message: str, *, reply: bool = True) -> list[Event]:
        self.bad_frames += 1
        note = Note(NoteKind.BAD_FRAME, code)
        if self.bad_frames >= self.limits.max_bad_frames:
            self._close()
            why = f"{self.bad_frames} bad frames in this session (last: {code}: {message})"
            return closing(note, ErrorCode.TOO_MANY_BAD_FRAMES, why)
        return [note, Send(Error(code, message, fatal=False))] if reply else [note]

    def _start(self, work: Work) -> list[Event]:
        self.state = CoreState.BUSY
        self._running = work
        self.live.work_at = self._now
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
        assert self.hello is not None
        federated = self.hello.reply_mode == ReplyMode.FEDERATED
        fault = misplaced(
            p, self.next_pos, len(self.text), self.cogen.on, federated, self.max_context
        )
        if fault is not None:
            code, why = fault
            if code == ErrorCode.CONTEXT_FULL:  # not a bad frame: the session is full
                return [Send(Error(code, why, fatal=False))]
            return self._bad(code, why)
        self._pending = None
        self.cogen.proposed(p)
        self.pace.start(self._now, p.pos + len(p.fixed))
        if federated:
            return self._start(Federate(p))
        return self._match(p)

    def _match(self, p: Propose) -> list[Event]:
        """A valid Propose of this epoch against the known text
        (:func:`~cloud_verifier.session.proposals.match`): a bad frame, a Verdict at no model
        cost, or the rest verified by the model (:class:`Verify`)."""
        assert self.hello is not None
        m = match(p, self.text, self.cache_len, self.hello.bonus)
        if isinstance(m, str):
            return self._bad(ErrorCode.BAD_POS, m)
        if isinstance(m, Known):
            self.next_pos = m.next_pos
            if m.tail is not None:  # a rejection
                self._new_epoch()
                self.cogen.tail = m.tail
            return [Send(m.verdict)]
        p, nd = m.propose, m.matched
        # Coalescing (none where every batch asks a bonus): taking them is handling them.
        limit = 0 if self.hello.bonus else self.limits.max_coalesced
        more = coalesce(p, self._queue, self.expected_seq, self.epoch, limit, self.max_context)
        if more:
            self.expected_seq = (more[-1].seq + 1) % SEQ_MODULUS
        branches = self.cogen.branches(p, more, self.hello, self.max_context)
        # Rationing: each draft token's survival, from the draft's probabilities of the tokens
        # before it and this session's measured acceptance; a tree's branches are priced by
        # what they are expected to add.
        q = [float(x) for s in (p, *more) for x in s.q.tolist()]
        asked = (more[-1] if more else p).want_bonus or self.hello.bonus
        free = not asked and self._free_bonus(more[-1] if more else p)
        acc = self._acceptance
        return self._start(
            Verify(
                p,
                asked or free,
                more,
                matched=nd,
                branches=branches,
                survival=acc.survival(q),
                mean_token=acc.token(acc.q_mean),
                promised=self.budget,
                weight=self.pace.weight(self._now, len(self.text)),
                waited=self._waited,
                tree_value=acc.tree_value(q, [(b.at, len(b.draft)) for b in branches]),
                free_bonus=free,
            )
        )

    def _free_bonus(self, last: Propose) -> bool:
        """Should a Verify whose edge asked no bonus (it has batches in flight behind) decide
        the position after its draft (``last`` its last segment) anyway, as a co-generated
        token, should the draft be accepted whole? Where co-generation may write that position
        (within ``cogen_end``, the context and ``max_cogen_ahead``) and no log-probabilities
        are asked (a Generated frame carries none). Its logits row is in the forward already;
        the edge takes the token as a co-generated one: a batch in flight that agrees stands,
        one that differs is rejected there at no model cost (exact as co-generation is: which
        rule decides that position is fixed before its randomness is drawn)."""
        assert self.hello is not None
        end = last.pos + len(last.fixed) + len(last.draft)
        limit = min(self.hello.cogen_end, self.max_context)
        return (
            len(last.draft) > 0  # a round of drafts (a credit asks for its bonus itself)
            and self.cogen.on
            and self.hello.logprobs is None
            and self.limits.max_cogen_ahead > 0
            and end < limit
        )

    def _new_epoch(self) -> None:
        """A rejection: every batch the edge sent behind the rejected one is now stale."""
        self.epoch += 1
        self._stale_in_epoch = 0

    def _maybe_cogen(self) -> list[Event]:
        """Co-generation: with no valid draft of this session queued, decode the next token
        (:meth:`CoGeneration.next_work`)."""
        if not (self.state == CoreState.OPEN and not self._queue and not self.edge_ahead):
            return []
        assert self.hello is not None
        end = min(self.hello.cogen_end, self.max_context)
        work = self.cogen.next_work(self.text, self.cache_len, self.budget, end)
        if work is None:
            return []
        return self._start(replace(work, weight=self.pace.weight(self._now, len(self.text))))

    def _hedge(self, h: Hedge) -> list[Event]:
        """Keep a side draft (no reply, no model work)."""
        why = self.cogen.keep(h, self.max_context)
        return [] if why is None else self._bad(ErrorCode.BAD_HEDGE, why)

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
        self.cogen.rolled_back()
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
            self.cogen.skipped()
            return []
        if isinstance(work, Federate) and isinstance(result, Federated):
            p = work.propose
            self.next_pos = self.cache_len = reported(result.cache_len, work)
            self.text[p.pos :] = [*p.fixed.tolist(), *p.draft.tolist()]
            return [Send(FederatedReply(p.epoch, p.seq, result.dists, result.p_draft, result.l1))]
        if isinstance(work, Crop) and isinstance(result, Cropped):
            self.cache_len = reported(result.cache_len, work)
            return []
        if isinstance(work, Draw) and isinstance(result, Drawn):
            return [
                *logprobs_at(result.logprobs, work.pos),
                Send(Candidates(work.epoch, work.pos, result.candidates)),
            ]
        raise TypeError(f"{type(result).__name__} is not the result of {type(work).__name__}")

    def _verified(self, work: Verify, result: Verified) -> list[Event]:
        """A Verify's Verdicts, one per segment, and what they commit
        (:func:`~cloud_verifier.session.results.verified_outcome`)."""
        o = verified_outcome(work, result, self.budget)
        self._acceptance.observe(work.q[: o.verified].tolist(), result.decision.accepted)
        d = result.decision
        if work.branches and d.token is not None and d.accepted < o.verified:
            # a rejection where branches forked: did its correction open one (tree or hedge)?
            forked = [b for b in work.branches if b.at == d.accepted]
            if forked:
                self._acceptance.observe_branches(any(b.token == d.token for b in forked))
        self._waited = self._waited + 1 if o.requeue else 0
        self.text[work.propose.pos :] = o.text
        self.edge_ahead = o.edge_ahead
        self.cache_len, self.next_pos = o.cache_len, o.next_pos
        if o.new_epoch:
            self._new_epoch()
            self.cogen.tail = o.tail
        if o.pending:
            self._pending = _Pending(self.epoch, self.next_pos)
        if o.budget is not None:
            self.budget = o.budget
        out = o.frames
        if o.requeue:  # deferred behind an accepted whole: queued again, first, as they came
            self._queue.extendleft(reversed(o.requeue))
            self.expected_seq = o.requeue[0].seq
            self.deferred += len(o.requeue)
        if o.opened:
            # The branch the recovered token opened, decided in the same forward: its tokens
            # are the verifier's, sent like co-generated ones (after the Verdict, which
            # commits the recovered token they follow).
            pos = len(self.text)
            self.text += o.opened
            self.tokens += TokenCounts(tree=len(o.opened) - 1)
            out += [Send(Generated(self.epoch, pos + i, t)) for i, t in enumerate(o.opened)]
        if o.cogenerated is not None:
            # The free bonus (Verify.free_bonus): a co-generated token at the accepted end.
            self.text.append(o.cogenerated)
            self.tokens += TokenCounts(cogen=1)
            out.append(Send(Generated(self.epoch, len(self.text) - 1, o.cogenerated)))
        return out

    def _cogen_done(self, work: CoGenerate, result: Verified) -> list[Event]:
        """Co-generated tokens (:meth:`CoGeneration.done`): one Generated frame each."""
        if result.budget is not None:
            self.budget = result.budget
        tokens, counts = self.cogen.done(work, result)
        accepted = result.decision.accepted
        self.cache_len = reported(result.cache_len, work, accepted)
        pos = len(self.text)
        self.text += tokens
        self.tokens += counts
        own = work.cloud  # the accepted draft tokens are the verifier's own
        return [
            *logprobs_at(result.logprobs, pos),
            *(
                Send(Generated(self.epoch, pos + i, t, cloud=own and i < accepted))
                for i, t in enumerate(tokens)
            ),
        ]

    def _failed(self, work: Work, result: Failed) -> list[Event]:
        why = f"{result.kind}: {result.message}"  # the kind, then what it says to a person
        note = Note(NoteKind.MODEL_ERROR, why)
        expected = self.cache_len  # the engine restores the cache to its length before the work
        self.cache_len = result.cache_len
        if isinstance(work, CoGenerate) and result.cache_len == expected:
            # Tried again at once without cloud drafts, or paused (no error frame).
            return [note, *self._maybe_cogen()] if self.cogen.failed(work) else [note]
        if result.cache_len != expected:  # the cache could not be restored
            self._close()
            return closing(
                note, ErrorCode.MODEL_ERROR, why + "; rebuild the session", CLOSE_INTERNAL_ERROR
            )
        return [note, Send(Error(ErrorCode.MODEL_ERROR, why, fatal=False))]
