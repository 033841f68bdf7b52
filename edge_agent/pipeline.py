"""The edge pipeline over one verifier session: draft, send, keep drafting; commit on verdicts.

Two tasks with one owner (:meth:`SpeculativeSession.run`):

* the **drafter** drafts γ tokens from the end of the speculative tail (committed tokens + every
  in-flight draft), sends a Propose, pushes the batch into the in-flight queue and drafts on. When
  D batches are in flight it waits (backpressure). In stop-and-wait mode it waits for the queue
  to empty instead, and every verdict carries a bonus token on full acceptance.
* the **receiver** pops the head batch for each Verdict, commits its *accepted* tokens and, on a
  rejection, the *recovered* token drawn at the edge from the correction (or, on full acceptance
  with a bonus, the *bonus* token); on a rejection it also discards every batch behind the
  rejected one and bumps the epoch, which makes the drafter drop its partial batch.

Invariant (single mode): the verifier's cache, once every in-flight Propose is processed and
accepted, holds ``verifier_len`` tokens, and the next Propose starts there with
``committed[verifier_len:]`` as its fixed tokens (the prompt, a recovered or a bonus token).
``committed + tail`` is the sequence the drafter extends; accepting tokens moves them from the
tail to ``committed`` and leaves that sequence unchanged, so only a rejection (epoch bump)
invalidates drafting work in progress.

The committed ids in :class:`Generation` are the one source of truth: a new session (after a
reconnect) resumes from them with no loss and no duplicate.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_agent.drafter import Drafter
from edge_agent.tasks import ModelWorker, run_until_first_done
from edge_agent.transport import Transport
from shared.pipeline_config import Mode, PipelineConfig
from shared.protocol import (
    SEQ_MODULUS,
    Candidates,
    CorrectionMode,
    Error,
    Propose,
    Resample,
    Verdict,
    WireContext,
    decode,
    encode,
)
from shared.rejection import Decision, recover, try_candidates
from shared.sampling import Probs

#: The Verdict field that carries a correction, per negotiated (wire) correction mode.
_CORRECTION_FIELD = {
    CorrectionMode.TOPK: "sparse",
    CorrectionMode.CANDIDATES: "candidates",
    CorrectionMode.GREEDY_DRAFT: "token",
}

PIPELINED = Mode.PIPELINED
STOP_AND_WAIT = Mode.STOP_AND_WAIT
MODES = Mode.choices()


class VerifierError(RuntimeError):
    """The verifier sent an Error frame. ``fatal`` ones end the generation."""

    def __init__(self, code: str, message: str, fatal: bool) -> None:
        super().__init__(f"verifier error {code}: {message}")
        self.code = code
        self.fatal = fatal


class DesyncError(RuntimeError):
    """A frame that does not match the pipeline's state (the session must be rebuilt)."""


@dataclass
class Stats:
    """Counters of one generation, across sessions (reconnects)."""

    rounds: int = 0  # verdicts received
    draft_tokens: int = 0  # draft tokens verified (in verdicts received)
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    rejections: int = 0
    recovered_tokens: int = 0
    bonus_tokens: int = 0
    discarded_batches: int = 0
    discarded_tokens: int = 0
    resamples: int = 0
    proposes_sent: int = 0
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    downlink_rejection_bytes: int = 0
    reconnects: int = 0
    drafter_wait_s: float = 0.0  # time the drafter sat idle (queue full / stop-and-wait)

    def count_accepted(self, n: int, gamma: int) -> None:
        if len(self.accepted_per_position) < gamma:
            self.accepted_per_position += [0] * (gamma - len(self.accepted_per_position))
        for i in range(n):
            self.accepted_per_position[i] += 1


class Generation:
    """One request's committed ids (prompt + generated), the source of truth.

    ``on_commit`` is called with each batch of newly committed generated ids, in order.
    """

    def __init__(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        on_commit: Callable[[list[int]], None] | None = None,
    ) -> None:
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.committed: list[int] = [int(t) for t in prompt]
        self.prompt_len = len(self.committed)
        self.max_new_tokens = max_new_tokens
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.on_commit = on_commit
        self.done = False
        self.finish_reason: str | None = None
        self.stats = Stats()
        #: [start, end) spans of ``generated`` that no verifier checked (draft-only fallback).
        self.unverified: list[tuple[int, int]] = []
        #: Federated mode only: the federation's measurements (edge_agent.federation).
        self.federation: Any = None

    @property
    def generated(self) -> list[int]:
        return self.committed[self.prompt_len :]

    @property
    def room(self) -> int:
        """How many more tokens may be generated."""
        return self.max_new_tokens - (len(self.committed) - self.prompt_len)

    @property
    def unverified_tokens(self) -> int:
        return sum(b - a for a, b in self.unverified)

    def commit(self, ids: Sequence[int], *, verified: bool = True) -> None:
        """Append ids, stopping at an end-of-sequence id or the token limit.

        ``verified=False`` marks them as the draft's own (link-down fallback): they are
        committed like any other, and recorded in :attr:`unverified`.
        """
        start = len(self.generated)
        new: list[int] = []
        for t in ids:
            if self.done:
                break
            self.committed.append(int(t))
            new.append(int(t))
            if int(t) in self.eos_ids:
                self.done, self.finish_reason = True, "stop"
            elif self.room <= 0:
                self.done, self.finish_reason = True, "length"
        if new and not verified:
            end = start + len(new)
            if self.unverified and self.unverified[-1][1] == start:
                self.unverified[-1] = (self.unverified[-1][0], end)
            else:
                self.unverified.append((start, end))
        if new and self.on_commit is not None:
            self.on_commit(new)

    def finish(self, reason: str) -> None:
        self.done, self.finish_reason = True, reason


@dataclass
class Batch:
    """A Propose in flight, with what the edge needs to recover a rejection at any position."""

    epoch: int
    seq: int
    pos: int
    fixed: list[int]
    draft: list[int]
    q_rows: list[Probs]  # [γ][V]: the distribution each draft token was drawn from


class SpeculativeSession:
    """Runs the pipeline of one generation over one established verifier session."""

    def __init__(
        self,
        gen: Generation,
        drafter: Drafter,
        worker: ModelWorker,
        transport: Transport,
        ctx: WireContext,
        config: PipelineConfig,
        rng: np.random.Generator,
        *,
        max_gamma: int | None = None,
    ) -> None:
        self.gen = gen
        self.drafter = drafter
        self.worker = worker
        self.transport = transport
        self.ctx = ctx
        self.cfg = config
        self.rng = rng
        self.gamma = min(config.gamma, max_gamma or config.gamma)
        self.epoch = 0
        self.next_seq = 0
        self.verifier_len = 0  # a new session's verifier cache is empty
        self.inflight: deque[Batch] = deque()
        self._changed = asyncio.Condition()
        # True while a rejection's recovered token is not yet known (a Resample round trip):
        # drafting must wait, since it would draft from a text without that token.
        self._recovering = False

    # ---------------------------------------------------------------- derived state

    @property
    def deterministic_draft(self) -> bool:
        """Draft the argmax (q one-hot) instead of sampling q."""
        return self.cfg.deterministic_draft

    @property
    def tail(self) -> list[int]:
        """Draft tokens in flight, in order (they extend ``committed``)."""
        return [x for b in self.inflight for x in b.draft]

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ---------------------------------------------------------------- tasks

    async def run(self) -> None:
        """Until the generation is done. Raises LinkClosed / VerifierError / DesyncError."""
        if self.gen.done:
            return
        await run_until_first_done(self._draft_loop(), self._receive_loop())

    def _can_draft(self, extra: int) -> bool:
        tail = self.tail
        if any(t in self.gen.eos_ids for t in tail):
            return False
        return len(tail) + extra < self.gen.room

    async def _wait_for_room(self) -> None:
        depth = self.cfg.effective_depth
        stop_and_wait = self.cfg.mode == STOP_AND_WAIT

        def ready() -> bool:
            if self.gen.done:
                return True
            if self._recovering:
                return False
            if stop_and_wait and self.inflight:
                return False
            return len(self.inflight) < depth and self._can_draft(0)

        if ready():
            return
        t0 = time.perf_counter()
        async with self._changed:
            await self._changed.wait_for(ready)
        self.gen.stats.drafter_wait_s += time.perf_counter() - t0

    async def _draft_loop(self) -> None:
        cfg = self.cfg
        while not self.gen.done:
            await self._wait_for_room()
            if self.gen.done:
                return
            epoch = self.epoch
            draft: list[int] = []
            q_rows: list[Probs] = []
            while len(draft) < self.gamma and self._can_draft(len(draft)):
                seq = self.gen.committed + self.tail + draft
                x, q = await self.worker.run(
                    self.drafter.draft,
                    seq,
                    cfg.sampling,
                    self.rng,
                    deterministic=self.deterministic_draft,
                )
                if self.epoch != epoch or self.gen.done:
                    break  # a rejection arrived meanwhile: this partial batch is void
                draft.append(x)
                q_rows.append(q)
                if x in self.gen.eos_ids:
                    break
            if self.epoch != epoch or self.gen.done or not draft:
                continue
            await self._send_batch(draft, q_rows)

    async def _send_batch(self, draft: list[int], q_rows: list[Probs]) -> None:
        # No await between reading the state and registering the batch: the receiver cannot
        # interleave, so pos/fixed are consistent with the in-flight queue.
        pos = self.verifier_len
        fixed = self.gen.committed[pos:]
        batch = Batch(self.epoch, self.next_seq, pos, fixed, draft, q_rows)
        self.inflight.append(batch)
        self.verifier_len = pos + len(fixed) + len(draft)
        self.next_seq = (self.next_seq + 1) % SEQ_MODULUS
        msg = Propose(
            epoch=batch.epoch,
            seq=batch.seq,
            pos=pos,
            draft=np.array(draft, np.int64),
            q=np.array([q[x] for x, q in zip(draft, q_rows, strict=True)], np.float32),
            fixed=np.array(fixed, np.int64),
        )
        data = encode(msg, self.ctx)
        self.gen.stats.proposes_sent += 1
        self.gen.stats.uplink_bytes += len(data)
        await self.transport.send(data)

    async def _recv(self) -> Any:
        data = await self.transport.recv()
        self.gen.stats.downlink_bytes += len(data)
        msg = decode(data, self.ctx)
        if isinstance(msg, Error):
            raise VerifierError(msg.code, msg.message, msg.fatal)
        return msg, len(data)

    async def _receive_loop(self) -> None:
        while not self.gen.done:
            msg, size = await self._recv()
            if not isinstance(msg, Verdict):
                raise DesyncError(f"expected a Verdict, got {type(msg).__name__}")
            await self._on_verdict(msg, size)
            await self._notify()

    async def _on_verdict(self, v: Verdict, size: int) -> None:
        st = self.gen.stats
        if not self.inflight:
            raise DesyncError(f"Verdict seq {v.seq} with nothing in flight")
        b = self.inflight[0]
        if (v.seq, v.epoch) != (b.seq, b.epoch):
            raise DesyncError(
                f"Verdict for seq {v.seq}/epoch {v.epoch}, expected {b.seq}/{b.epoch}"
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
        kind = _CORRECTION_FIELD[self.cfg.wire_correction]
        if decision.rejected and getattr(v, kind) is None:
            raise DesyncError(f"a correction other than {kind!r}, which this session uses")
        self.inflight.popleft()
        st.rounds += 1
        st.draft_tokens += gamma
        st.accepted_tokens += v.accepted
        st.count_accepted(v.accepted, gamma)
        self.gen.commit(b.draft[: v.accepted])
        if decision.rejected:
            st.rejections += 1
            st.downlink_rejection_bytes += size
            # Every batch behind the rejected one was drafted from a token that is now void.
            st.discarded_batches += len(self.inflight)
            st.discarded_tokens += sum(len(x.draft) for x in self.inflight)
            self.inflight.clear()
            self.epoch += 1
            self.verifier_len = len(self.gen.committed)
            self._recovering = True
            try:
                token = await self._recover(decision, b.q_rows[v.accepted])
            finally:
                self._recovering = False
            st.recovered_tokens += 1
            self.gen.commit([token])
        elif v.bonus is not None:
            if self.inflight:
                raise DesyncError("a bonus token while batches are in flight")
            self.verifier_len = len(self.gen.committed)
            if not self.gen.done:
                st.bonus_tokens += 1
                self.gen.commit([v.bonus])

    async def _recover(self, decision: Decision, q: Probs) -> int:
        """The recovered token; in candidates mode may ask for more candidates (Resample)."""
        token = recover(decision, q, self.rng, reconstruction=self.cfg.reconstruction)
        pos = self.verifier_len
        while token is None:
            self.gen.stats.resamples += 1
            data = encode(Resample(self.epoch, pos), self.ctx)
            self.gen.stats.uplink_bytes += len(data)
            await self.transport.send(data)
            msg, _ = await self._recv()
            if not isinstance(msg, Candidates) or (msg.epoch, msg.pos) != (self.epoch, pos):
                raise DesyncError(f"expected Candidates for position {pos}, got {msg!r}")
            token = try_candidates(msg.candidates, q, self.rng)
        return token
