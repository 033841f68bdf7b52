"""The edge's side of a session as synchronous state machines: no I/O, no clock, no model.

Two pieces, composed by the single-verifier :class:`SingleCore` here and by the federated core
(:mod:`shared.federation_core`):

* :class:`Pipeline` holds the rules every edge session shares: which text to draft from (the
  committed ids plus every in-flight draft, the *tail*), when drafting may go on (fewer than D
  batches in flight, none in stop-and-wait, no recovered token pending, room left), and the one
  commit path of a round: *accepted* tokens, then a *recovered* token on a rejection (discarding
  every batch behind it and bumping the epoch) or a *bonus* token.
* :class:`VerifierLink` holds one verifier session's wire state: its epoch, the next batch
  number, and ``verifier_len``, the length of the verifier's cache once every Propose sent is
  processed and accepted; the next Propose starts there, carrying ``committed[verifier_len:]``
  as fixed tokens (the prompt, a recovered or a bonus token).

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
========== ===================================== =============================================
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from shared.enums import TextEnum
from shared.generation import Generation
from shared.pipeline_config import Mode, PipelineConfig
from shared.protocol import (
    SEQ_MODULUS,
    Candidates,
    CorrectionMode,
    Error,
    FederatedReply,
    Fingerprint,
    Hello,
    Message,
    Propose,
    ProtocolError,
    ReplyMode,
    Resample,
    Verdict,
    Welcome,
    WireContext,
    decode,
    encode,
)
from shared.rejection import Decision, recover, try_candidates
from shared.sampling import Probs

#: Error codes after which reconnecting cannot help.
FATAL_CODES: Final = frozenset({"fingerprint_mismatch", "unauthorized", "bad_hello", "unsupported"})

#: The Verdict field that carries a correction, per negotiated (wire) correction mode.
_CORRECTION_FIELD: Final = {
    CorrectionMode.TOPK: "sparse",
    CorrectionMode.CANDIDATES: "candidates",
    CorrectionMode.GREEDY_DRAFT: "token",
}


class VerifierError(RuntimeError):
    """The verifier sent an Error frame. ``fatal`` ones end the session."""

    def __init__(self, code: str, message: str, fatal: bool) -> None:
        super().__init__(f"verifier error {code}: {message}")
        self.code = code
        self.fatal = fatal


class DesyncError(RuntimeError):
    """A frame that does not match the session's state (the session must be rebuilt)."""


class HandshakeError(RuntimeError):
    """The verifier refused the session (e.g. a different tokenizer). Not retried."""


class EdgeState(TextEnum):
    RUNNING = "running"
    RECOVERING = "recovering"  # a rejection's recovered token waits for more candidates
    DONE = "done"


# ------------------------------------------------------------------------------ handshake


def hello_for(
    fingerprint: Fingerprint, cfg: PipelineConfig, seed: int | None, *, k: int = 10
) -> Hello:
    """The Hello of a single-verifier session (the verifier decides: PicoSpec)."""
    return Hello(
        fingerprint=fingerprint,
        sampling=cfg.sampling,
        reply_mode=ReplyMode.VERDICT,
        correction=cfg.wire_correction,
        k=k,
        bonus=cfg.mode == Mode.STOP_AND_WAIT,
        seed=seed,
    )


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
        if msg.code in FATAL_CODES:
            raise HandshakeError(f"verifier refused the session: {msg.message}")
        raise VerifierError(msg.code, msg.message, msg.fatal)
    if not isinstance(msg, Welcome):
        raise DesyncError(f"expected Welcome, got {type(msg).__name__}")
    reason = hello.fingerprint.compatible_with(msg.fingerprint)
    if reason is not None:
        raise HandshakeError(f"verifier model is incompatible: {reason}")
    return msg


def wire_context(hello: Hello, welcome: Welcome) -> WireContext:
    """The session's WireContext on the edge, from the limits the verifier announced."""
    return WireContext(
        vocab_size=hello.fingerprint.vocab_size,
        max_gamma=welcome.max_gamma,
        max_fixed=welcome.max_fixed,
        max_frame=welcome.max_frame,
        draft_probs=hello.correction != CorrectionMode.GREEDY_DRAFT,
    )


# ------------------------------------------------------------------------------ pipeline


@dataclass(frozen=True)
class DraftPlan:
    """What the drafter may do now: extend ``context`` by up to ``max_tokens`` tokens (stopping
    after an end-of-sequence id) while the pipeline's epoch is still ``epoch``."""

    epoch: int
    context: list[int]
    max_tokens: int
    deterministic: bool


@dataclass
class Batch:
    """A batch in flight, with what the edge needs to recover a rejection at any position."""

    epoch: int
    draft: list[int]
    q_rows: list[Probs]  # [γ][V]: the distribution each draft token was drawn from
    #: Per verifier link (index → its batch number for this batch).
    seqs: dict[int, int] = field(default_factory=dict)
    #: Federated rounds: the replies received so far, per link.
    replies: dict[int, FederatedReply] = field(default_factory=dict)
    sent_at: float = 0.0


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
    ) -> None:
        self.gen = gen
        self.cfg = cfg
        self.rng = rng
        self.gamma = gamma
        self.deterministic_draft = deterministic_draft
        self.epoch = 0
        self.inflight: deque[Batch] = deque()
        #: True while a recovered token is not yet known: drafting would use a text without it.
        self.recovering = False
        #: Seconds from sending a batch to its verdict, recent rounds (RTT + queueing + T_v).
        self.latencies: deque[float] = deque(maxlen=16)

    @property
    def tail(self) -> list[int]:
        """Draft tokens in flight, in order (they extend ``committed``)."""
        return [x for b in self.inflight for x in b.draft]

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
        return len(self.inflight) < self.cfg.effective_depth and self._room() > 0

    def plan(self) -> DraftPlan | None:
        if not self.may_draft():
            return None
        return DraftPlan(
            epoch=self.epoch,
            context=self.gen.committed + self.tail,
            max_tokens=min(self.gamma, self._room()),
            deterministic=self.deterministic_draft,
        )

    def current(self, plan: DraftPlan) -> bool:
        """Drafting along ``plan`` is still worth it (no rejection since, not done)."""
        return plan.epoch == self.epoch and not self.gen.done

    def wants_more(self, plan: DraftPlan, draft: Sequence[int]) -> bool:
        """Draft another token after ``draft``?"""
        if not self.current(plan) or len(draft) >= plan.max_tokens:
            return False
        return not draft or draft[-1] not in self.gen.eos_ids

    def push(self, plan: DraftPlan, draft: list[int], q_rows: list[Probs], now: float) -> Batch:
        b = Batch(plan.epoch, draft, q_rows, sent_at=now)
        self.inflight.append(b)
        self.gen.stats.proposes_sent += 1
        return b

    def verdict_deadline(self, floor_s: float, factor: float = 4.0) -> float | None:
        """When the head batch's verdict is overdue: ``floor_s``, or ``factor`` times the
        slowest recent round when that is longer, after it was sent (None: nothing in flight)."""
        if not self.inflight:
            return None
        slowest = max(self.latencies, default=0.0)
        return self.inflight[0].sent_at + max(floor_s, factor * slowest)

    def commit_round(self, b: Batch, accepted: int, now: float) -> None:
        """The head batch ``b`` was decided at ``now``: count it, commit its accepted prefix."""
        st = self.gen.stats
        assert self.inflight and self.inflight[0] is b
        self.inflight.popleft()
        self.latencies.append(max(0.0, now - b.sent_at))
        gamma = len(b.draft)
        st.rounds += 1
        st.draft_tokens += gamma
        st.accepted_tokens += accepted
        st.count_accepted(accepted, gamma)
        self.gen.commit(b.draft[:accepted])

    def discard_inflight(self) -> None:
        """Every batch in flight was drafted from a token that is now void: a new epoch."""
        st = self.gen.stats
        st.discarded_batches += len(self.inflight)
        st.discarded_tokens += sum(len(x.draft) for x in self.inflight)
        self.inflight.clear()
        self.epoch += 1

    def commit_recovered(self, token: int) -> None:
        self.gen.stats.recovered_tokens += 1
        self.gen.commit([token])

    def commit_bonus(self, token: int) -> None:
        if not self.gen.done:
            self.gen.stats.bonus_tokens += 1
            self.gen.commit([token])


# ------------------------------------------------------------------------------ one link


@dataclass
class VerifierLink:
    """One verifier session's wire state (module docstring)."""

    ctx: WireContext
    epoch: int = 0
    next_seq: int = 0
    verifier_len: int = 0  # a new session's verifier cache is empty

    def propose(self, committed: Sequence[int], b: Batch, index: int, with_q: bool) -> bytes:
        """The Propose of batch ``b`` for this link (registered under ``index``)."""
        pos = self.verifier_len
        fixed = list(committed[pos:])
        seq = self.next_seq
        b.seqs[index] = seq
        self.verifier_len = pos + len(fixed) + len(b.draft)
        self.next_seq = (seq + 1) % SEQ_MODULUS
        q = (
            np.array([q[x] for x, q in zip(b.draft, b.q_rows, strict=True)], np.float32)
            if with_q
            else np.ones(len(b.draft), np.float32)
        )
        msg = Propose(
            epoch=self.epoch,
            seq=seq,
            pos=pos,
            draft=np.array(b.draft, np.int64),
            q=q,
            fixed=np.array(fixed, np.int64),
        )
        return encode(msg, self.ctx)

    def decode(self, data: bytes) -> Message:
        """A frame from this verifier; Error frames raise :class:`VerifierError`."""
        msg = decode(data, self.ctx)
        if isinstance(msg, Error):
            raise VerifierError(msg.code, msg.message, msg.fatal)
        return msg


class SingleCore:
    """One generation over one verifier session that decides (PicoSpec). See the state table in
    the module docstring. ``propose`` and ``receive`` return the frames to send, in order."""

    LINK: Final = 0

    def __init__(
        self,
        gen: Generation,
        cfg: PipelineConfig,
        rng: np.random.Generator,
        hello: Hello,
        welcome: Welcome,
    ) -> None:
        self.cfg = cfg
        self.pipe = Pipeline(
            gen,
            cfg,
            rng,
            gamma=min(cfg.gamma, welcome.max_gamma),
            deterministic_draft=cfg.deterministic_draft,
        )
        self.link = VerifierLink(wire_context(hello, welcome))
        # The kind negotiated in the Hello; a greedy target always sends the token itself.
        self._correction_field = (
            "token" if hello.sampling.greedy else _CORRECTION_FIELD[hello.correction]
        )
        self._resample: tuple[int, Probs] | None = None  # (pos, q) of the pending correction

    @property
    def gen(self) -> Generation:
        return self.pipe.gen

    @property
    def state(self) -> EdgeState:
        if self.gen.done:
            return EdgeState.DONE
        return EdgeState.RECOVERING if self.pipe.recovering else EdgeState.RUNNING

    # ---------------------------------------------------------------- drafting

    def may_draft(self) -> bool:
        return self.pipe.may_draft()

    def propose(
        self, plan: DraftPlan, draft: list[int], q_rows: list[Probs], now: float = 0.0
    ) -> list[bytes]:
        """Register a drafted batch and return its Propose; nothing if ``plan`` is void."""
        if not draft or not self.pipe.current(plan):
            return []
        b = self.pipe.push(plan, draft, q_rows, now)
        data = self.link.propose(self.gen.committed, b, self.LINK, self.link.ctx.draft_probs)
        self.gen.stats.uplink_bytes += len(data)
        return [data]

    # ---------------------------------------------------------------- frames

    def receive(self, data: bytes, now: float = 0.0) -> list[bytes]:
        """One frame from the verifier, received at ``now``. Raises VerifierError /
        DesyncError / ProtocolError."""
        self.gen.stats.downlink_bytes += len(data)
        msg = self.link.decode(data)
        if isinstance(msg, Verdict) and not self.pipe.recovering:
            return self._verdict(msg, len(data), now)
        if isinstance(msg, Candidates) and self._resample is not None:
            return self._candidates(msg)
        raise DesyncError(f"unexpected {type(msg).__name__} in state {self.state}")

    def _verdict(self, v: Verdict, size: int, now: float) -> list[bytes]:
        pipe, st = self.pipe, self.gen.stats
        if not pipe.inflight:
            raise DesyncError(f"Verdict seq {v.seq} with nothing in flight")
        b = pipe.inflight[0]
        if (v.seq, v.epoch) != (b.seqs[self.LINK], b.epoch):
            raise DesyncError(
                f"Verdict for seq {v.seq}/epoch {v.epoch}, expected "
                f"{b.seqs[self.LINK]}/{b.epoch}"
            )
        gamma = len(b.draft)
        if v.accepted > gamma:
            raise DesyncError(f"Verdict accepts {v.accepted} of {gamma} draft tokens")
        decision = Decision(v.accepted, v.sparse, v.candidates, v.token, v.bonus)
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
        if decision.rejected:
            st.rejections += 1
            st.downlink_rejection_bytes += size
            pipe.discard_inflight()
            # The verifier cropped its cache to the accepted prefix and entered the next epoch.
            self.link.epoch += 1
            self.link.verifier_len = len(self.gen.committed)
            q = b.q_rows[v.accepted]
            token = recover(decision, q, pipe.rng, reconstruction=self.cfg.reconstruction)
            if token is None:
                return self._ask_resample(q)
            pipe.commit_recovered(token)
        elif v.bonus is not None:
            self.link.verifier_len = len(self.gen.committed)
            pipe.commit_bonus(v.bonus)
        return []

    def _ask_resample(self, q: Probs) -> list[bytes]:
        """Every candidate failed: ask for more (drafting waits for the recovered token)."""
        pos = self.link.verifier_len
        self._resample = (pos, q)
        self.pipe.recovering = True
        self.gen.stats.resamples += 1
        data = encode(Resample(self.link.epoch, pos), self.link.ctx)
        self.gen.stats.uplink_bytes += len(data)
        return [data]

    def _candidates(self, c: Candidates) -> list[bytes]:
        assert self._resample is not None
        pos, q = self._resample
        if (c.epoch, c.pos) != (self.link.epoch, pos):
            raise DesyncError(
                f"Candidates for epoch {c.epoch}, pos {c.pos}; expected "
                f"{self.link.epoch}, {pos}"
            )
        token = try_candidates(c.candidates, q, self.pipe.rng)
        if token is None:
            return self._ask_resample(q)
        self._resample = None
        self.pipe.recovering = False
        self.pipe.commit_recovered(token)
        return []
