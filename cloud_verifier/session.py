"""One verification session: the state machine behind one WebSocket (no sockets in here).

State (DESIGN.md, README "Cloud verifier"): the target's KV cache for this session, ``epoch``
(bumped on every rejection and set by Rollback), ``expected_seq`` (the next Propose's batch
number, modulo 128) and ``next_pos`` (where the next Propose of the current epoch must start).

Invariant: ``next_pos == seq.length`` (the cache holds exactly the tokens the edge has been told
are verified) whenever no job of this session is running.

:meth:`Session.handle` takes one frame and returns the frames to send back; it raises
:class:`SessionFatal` when the session must close. Model work runs on the engine's worker.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
from aiohttp import WSCloseCode

from cloud_verifier.engine import Engine, Sequence
from cloud_verifier.stats import VerifierMetrics
from shared import compression
from shared.protocol import (
    SEQ_MODULUS,
    Candidates,
    CorrectionMode,
    Error,
    FederatedReply,
    Hello,
    Message,
    Propose,
    ProtocolError,
    ReplyMode,
    Resample,
    Rollback,
    SparseDist,
    Verdict,
    Welcome,
    WireContext,
    decode,
    encode,
)
from shared.rejection import Decision, draw_candidates, verify_batch
from shared.sampling import Probs, transform

log = logging.getLogger(__name__)

#: Error codes that count as bad frames (towards ``max_bad_frames``).
BAD_CODES: Final = (
    "bad_frame",
    "bad_seq",
    "bad_epoch",
    "bad_pos",
    "bad_rollback",
    "bad_resample",
)


@dataclass(frozen=True)
class SessionLimits:
    max_gamma: int = 16
    max_fixed: int = 8192
    max_context: int = 8192
    max_frame: int = 1 << 20
    max_k: int = 1024
    max_bad_frames: int = 16
    max_resamples: int = 64


class SessionFatal(Exception):
    """The session must end: send ``error`` (fatal), then close with ``close_code``."""

    def __init__(self, error: Error, close_code: int = WSCloseCode.POLICY_VIOLATION) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error
        self.close_code = close_code


@dataclass
class _PendingResample:
    """The last rejection in candidates mode: what a matching Resample draws from."""

    epoch: int
    pos: int
    p_row: Probs  # [V]
    rejected: int
    used: int = 0


@dataclass(frozen=True)
class _VerdictOut:
    decision: Decision
    p_row: Probs | None  # [V] p at the rejected position (candidates mode only)
    forward_s: float
    job_s: float


@dataclass(frozen=True)
class _FederatedOut:
    dists: tuple[SparseDist, ...]
    p_draft: npt.NDArray[np.float32]  # [γ]
    l1: npt.NDArray[np.float32]  # [γ+1, 2]
    forward_s: float
    job_s: float


def handshake(
    data: bytes | str,
    engine: Engine,
    limits: SessionLimits,
    metrics: VerifierMetrics,
) -> Session:
    """Validate the first frame (Hello) and create the session. Raises :class:`SessionFatal`."""
    try:
        msg = decode(data)  # type: ignore[arg-type]  # a str frame is refused by decode
    except ProtocolError as e:
        metrics.sessions_refused.inc(reason="handshake")
        raise SessionFatal(Error("bad_handshake", f"expected Hello: {e}", fatal=True)) from None
    if not isinstance(msg, Hello):
        metrics.sessions_refused.inc(reason="handshake")
        raise SessionFatal(
            Error("bad_handshake", f"expected Hello first, got {type(msg).__name__}", fatal=True)
        )
    target = engine.require_target()
    reason = msg.fingerprint.compatible_with(target.fingerprint)
    if reason is not None:
        metrics.sessions_refused.inc(reason="fingerprint")
        raise SessionFatal(Error("fingerprint_mismatch", reason, fatal=True))
    if msg.k > limits.max_k or msg.m > limits.max_k:
        metrics.sessions_refused.inc(reason="handshake")
        raise SessionFatal(
            Error(
                "bad_hello",
                f"k = {msg.k} / m = {msg.m} exceed this verifier's limit {limits.max_k}",
                fatal=True,
            )
        )
    return Session(engine, msg, limits, metrics)


class Session:
    """See the module docstring. Create with :func:`handshake`."""

    def __init__(
        self, engine: Engine, hello: Hello, limits: SessionLimits, metrics: VerifierMetrics
    ) -> None:
        target = engine.require_target()
        self.engine = engine
        self.hello = hello
        self.metrics = metrics
        self.session_id = uuid.uuid4().hex[:16]
        self.max_context = min(limits.max_context, target.max_length or limits.max_context)
        self.limits = limits
        self.ctx = WireContext(
            vocab_size=target.vocab_size,
            max_gamma=limits.max_gamma,
            max_fixed=limits.max_fixed,
            max_k=limits.max_k,
            max_frame=limits.max_frame,
            draft_probs=hello.correction != CorrectionMode.GREEDY_DRAFT,
        )
        self.welcome = Welcome(
            fingerprint=target.fingerprint,
            session_id=self.session_id,
            max_gamma=limits.max_gamma,
            max_fixed=limits.max_fixed,
            max_context=self.max_context,
            max_frame=limits.max_frame,
        )
        self.seq: Sequence = engine.new_sequence()
        self.epoch = 0
        self.expected_seq = 0
        self.next_pos = 0
        self.rng = np.random.default_rng(hello.seed)
        self.bad_frames = 0
        self._pending: _PendingResample | None = None

    # ------------------------------------------------------------------ frames

    def encode(self, msg: Message) -> bytes:
        return encode(msg, self.ctx)

    async def handle(self, data: bytes | str) -> list[Message]:
        """Process one frame from the edge; return the replies (possibly none)."""
        try:
            msg = decode(data, self.ctx)  # type: ignore[arg-type]  # str is refused by decode
        except ProtocolError as e:
            return self._bad("bad_frame", str(e))
        if isinstance(msg, Propose):
            return await self._propose(msg)
        if isinstance(msg, Rollback):
            return await self._rollback(msg)
        if isinstance(msg, Resample):
            return self._resample(msg)
        if isinstance(msg, Error):
            log.info("session %s: edge reports %s: %s", self.session_id, msg.code, msg.message)
            if msg.fatal:
                raise SessionFatal(
                    Error("closing", f"edge error {msg.code}", fatal=True), WSCloseCode.OK
                )
            return []
        return self._bad("bad_frame", f"type: {type(msg).__name__} is not valid from the edge")

    def _bad(self, code: str, message: str) -> list[Message]:
        self.metrics.bad_frames.inc()
        self.bad_frames += 1
        if self.bad_frames >= self.limits.max_bad_frames:
            raise SessionFatal(
                Error(
                    "too_many_bad_frames",
                    f"{self.bad_frames} bad frames in this session (last: {code}: {message})",
                    fatal=True,
                )
            )
        return [Error(code, message, fatal=False)]

    # ------------------------------------------------------------------ Propose

    async def _propose(self, p: Propose) -> list[Message]:
        if p.seq != self.expected_seq:
            return self._bad("bad_seq", f"seq {p.seq}, expected {self.expected_seq}")
        self.expected_seq = (p.seq + 1) % SEQ_MODULUS
        if p.epoch < self.epoch:
            self.metrics.stale_dropped.inc()  # sent before the edge saw a rejection: no work
            return []
        if p.epoch > self.epoch:
            return self._bad("bad_epoch", f"epoch {p.epoch} is ahead of the session's {self.epoch}")
        f, g = len(p.fixed), len(p.draft)
        if p.pos != self.next_pos:
            return self._bad("bad_pos", f"pos {p.pos}, expected {self.next_pos}")
        if self.next_pos == 0 and f == 0:
            return self._bad("bad_pos", "pos 0 needs at least one fixed token (the prompt)")
        if p.pos + f + g > self.max_context:
            return [
                Error(
                    "context_full",
                    f"{p.pos} + {f} fixed + {g} draft tokens exceed the context limit "
                    f"{self.max_context}; start a new session",
                    fatal=False,
                )
            ]
        self._pending = None
        want_bonus = p.want_bonus or self.hello.bonus
        federated = self.hello.reply_mode == ReplyMode.FEDERATED
        try:
            if federated:
                fout, queued = await self.engine.call(lambda: self._federated_job(p))
                out: _VerdictOut | _FederatedOut = fout
            else:
                out, queued = await self.engine.call(lambda: self._verdict_job(p, want_bonus))
        except Exception as e:
            return self._model_error(e)
        m = self.metrics
        m.model_forwards.inc()
        m.fixed_tokens.inc(f)
        m.queue_seconds.observe(queued)
        m.forward_seconds.observe(out.forward_s)
        m.verify_seconds.observe(out.job_s)
        if isinstance(out, _FederatedOut):
            self.next_pos = p.pos + f + g
            m.federated_rounds.inc()
            return [FederatedReply(p.epoch, p.seq, out.dists, out.p_draft, out.l1)]
        d = out.decision
        n = d.accepted
        m.num_drafts.inc()
        m.num_draft_tokens.inc(g)
        m.num_accepted_tokens.inc(n)
        for i in range(n):
            m.accepted_per_pos.inc(position=str(i))
        if n < g:
            # Rejection: the cache was cropped to the accepted prefix; in-flight batches are stale.
            self.next_pos = p.pos + f + n
            self.epoch += 1
            if d.sparse is not None:
                m.corrections.inc(kind="sparse")
            elif d.candidates is not None:
                m.corrections.inc(kind="candidates")
            else:
                m.corrections.inc(kind="token")
            if d.candidates is not None and out.p_row is not None:
                self._pending = _PendingResample(
                    self.epoch, self.next_pos, out.p_row, int(p.draft[n])
                )
        else:
            self.next_pos = p.pos + f + g  # a bonus token is committed by the edge, sent as fixed
            if d.bonus is not None:
                m.bonus_tokens.inc()
        return [
            Verdict(
                epoch=p.epoch,
                seq=p.seq,
                accepted=n,
                sparse=d.sparse,
                candidates=d.candidates,
                token=d.token,
                bonus=d.bonus,
            )
        ]

    def _model_error(self, e: Exception) -> list[Message]:
        log.warning("session %s: model error", self.session_id, exc_info=e)
        msg = f"{type(e).__name__}: {e}"
        if self.seq.length != self.next_pos:  # the cache could not be restored
            raise SessionFatal(
                Error("model_error", msg + "; rebuild the session", fatal=True),
                WSCloseCode.INTERNAL_ERROR,
            )
        return [Error("model_error", msg, fatal=False)]

    def _rows(self, p: Propose) -> tuple[npt.NDArray[np.float32], float]:
        """Run the target over fixed + draft (worker thread). Returns the γ+1 logit rows
        [γ+1, V] (row i scores draft[i], row γ is the bonus position) and the forward time."""
        f, g = len(p.fixed), len(p.draft)
        tokens = [*p.fixed.tolist(), *p.draft.tolist()]
        # F = 0: draft[0] is scored by the logits after the last cached token.
        prev = self.seq.last_logits()[None] if f == 0 else None  # [1, V]
        t0 = time.perf_counter()
        logits = self.seq.extend(tokens, last_rows=g if f == 0 else g + 1)  # [γ or γ+1, V]
        forward_s = time.perf_counter() - t0
        rows = logits if prev is None else np.concatenate([prev, logits])
        return rows, forward_s

    def _restore(self, start: int) -> None:
        """After a failed job, crop the cache back to ``start`` tokens (best effort)."""
        if self.seq.length > start:
            with contextlib.suppress(Exception):
                self.seq.crop(start)

    def _verdict_job(self, p: Propose, want_bonus: bool) -> _VerdictOut:
        t0 = time.perf_counter()
        h = self.hello
        start = self.seq.length
        try:
            rows, forward_s = self._rows(p)
            probs = transform(rows, h.sampling)  # [γ+1, V] float64
            d = verify_batch(
                probs,
                p.draft,
                p.q,
                greedy=h.sampling.greedy,
                correction=h.correction,
                rng=self.rng,
                k=h.k,
                eps_target=h.eps_target,
                m=h.m,
                want_bonus=want_bonus,
            )
            p_row = None
            if d.accepted < len(p.draft):
                self.seq.crop(start + len(p.fixed) + d.accepted)
                if d.candidates is not None:
                    p_row = probs[d.accepted].copy()
        except BaseException:
            self._restore(start)
            raise
        return _VerdictOut(d, p_row, forward_s, time.perf_counter() - t0)

    def _federated_job(self, p: Propose) -> _FederatedOut:
        t0 = time.perf_counter()
        h = self.hello
        start = self.seq.length
        try:
            rows, forward_s = self._rows(p)
            probs = transform(rows, h.sampling)  # [γ+1, V] float64
            vocab = probs.shape[1]
            dists = tuple(compression.compress(row, h.k, h.eps_target) for row in probs)
            p_draft = probs[np.arange(len(p.draft)), p.draft].astype(np.float32)  # [γ]
            l1 = np.array(
                [
                    [
                        compression.l1(compression.reconstruct(d, vocab, how), row)
                        for how in compression.RECONSTRUCTIONS
                    ]
                    for d, row in zip(dists, probs, strict=True)
                ],
                dtype=np.float32,
            )  # [γ+1, 2]: ‖A − p‖₁, ‖B − p‖₁
        except BaseException:
            self._restore(start)
            raise
        return _FederatedOut(dists, p_draft, l1, forward_s, time.perf_counter() - t0)

    # ------------------------------------------------------------------ Rollback, Resample

    async def _rollback(self, r: Rollback) -> list[Message]:
        if r.epoch <= self.epoch:
            return self._bad("bad_rollback", f"epoch {r.epoch} is not after {self.epoch}")
        if not 0 <= r.pos <= min(self.next_pos, self.seq.length):
            return self._bad("bad_rollback", f"pos {r.pos} outside [0, {self.next_pos}]")
        try:
            await self.engine.call(lambda: self.seq.crop(r.pos))
        except Exception as e:
            return self._model_error(e)
        self.epoch = r.epoch
        self.next_pos = r.pos
        self._pending = None
        self.metrics.rollbacks.inc()
        return []

    def _resample(self, r: Resample) -> list[Message]:
        pr = self._pending
        if pr is None or (r.epoch, r.pos) != (pr.epoch, pr.pos):
            want = "none pending" if pr is None else f"pending: epoch {pr.epoch}, pos {pr.pos}"
            return self._bad(
                "bad_resample", f"no correction at epoch {r.epoch}, pos {r.pos} ({want})"
            )
        if pr.used >= self.limits.max_resamples:
            return self._bad(
                "bad_resample",
                f"more than {self.limits.max_resamples} resamples for the correction at {r.pos}",
            )
        pr.used += 1
        self.metrics.resamples.inc()
        cands = draw_candidates(pr.p_row, pr.rejected, self.hello.m, self.rng)
        return [Candidates(pr.epoch, pr.pos, cands)]
