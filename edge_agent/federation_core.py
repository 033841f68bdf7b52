"""Federated verification (SpecFed) at the edge as a synchronous state machine: no I/O, no clock.

It composes the :class:`~edge_agent.core.Pipeline` with one
:class:`~edge_agent.core.VerifierLink` per worker. Each batch is proposed to every *live*
worker; each answers with a :class:`~shared.wire.protocol.FederatedReply`; the edge decides
(:func:`edge_agent.aggregation.decide`) once every worker that was sent the head batch has replied,
or its round deadline has passed (``now`` is passed in). A worker that misses the deadline, errs or
sends a frame that does not fit is dropped from the round (the remaining weights are
renormalised, and this is counted) and the driver is told to close its link
(:class:`~edge_agent.events.Drop`). Every feed returns :mod:`edge_agent.events` to carry out.

Worker states:

======= ======================================= ==============================================
state   input                                   effect
======= ======================================= ==============================================
DOWN    ``link_up`` (handshake done)            → READY
READY   a boundary (nothing in flight)          → LIVE: its first Propose carries every
                                                committed id, so its target re-prefills
LIVE    FederatedReply for a batch in flight    filed for that batch's decision
LIVE    reply to a discarded batch              ignored (its work is void)
LIVE    Error, other frame, wrong γ, deadline   → DOWN; :class:`Drop`
any     ``link_down``                           → DOWN
======= ======================================= ==============================================

On a rejection (or a round nobody answered) every live worker gets a Rollback (new epoch, kept
length) *before* any Propose of the new epoch: both come out of this core in order, and the
driver writes each link's frames in the order it receives them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from edge_agent import aggregation
from edge_agent.core import Batch, DesyncError, DraftPlan, Pipeline, VerifierError, VerifierLink
from edge_agent.events import Drop, EdgeEvent, Send
from edge_agent.generation import Generation
from edge_agent.pipeline_config import Mode, PipelineConfig
from shared.enums import TextEnum
from shared.maths.sampling import Probs
from shared.wire.params import SamplingParams
from shared.wire.protocol import (
    CorrectionMode,
    FederatedReply,
    Fingerprint,
    Hello,
    ProtocolError,
    ReplyMode,
    Rollback,
    Welcome,
    WireContext,
    encode,
)

log = logging.getLogger("wanspec.federation")


class WorkerState(TextEnum):
    DOWN = "down"
    READY = "ready"  # connected, joins at the next boundary
    LIVE = "live"


@dataclass(frozen=True)
class WorkerParams:
    """One worker's place in the federation: its name, weight and top-k."""

    name: str
    weight: float = 1.0
    k: int = 10
    eps_target: float = 0.0

    def __post_init__(self) -> None:
        if not (self.weight > 0 and np.isfinite(self.weight)):
            raise ValueError(f"worker {self.name}: weight must be positive, got {self.weight}")
        if self.k < 1:
            raise ValueError(f"worker {self.name}: k must be >= 1, got {self.k}")
        if not 0.0 <= self.eps_target < 1.0:
            raise ValueError(f"worker {self.name}: eps_target must be in [0, 1)")


@dataclass
class FederationStats:
    rounds_with_missing_workers: int = 0
    worker_drops: int = 0
    worker_rejoins: int = 0
    bound_violations: int = 0
    positions_measured: int = 0
    eps_sum: list[float] = field(default_factory=list)  # per worker
    bias_bound_sum: float = 0.0
    bias_upper_sum: float = 0.0
    bias_upper_count: int = 0

    def mean_eps(self) -> list[float]:
        n = max(1, self.positions_measured)
        return [e / n for e in self.eps_sum]


@dataclass
class Worker:
    params: WorkerParams
    index: int
    state: WorkerState = WorkerState.DOWN
    link: VerifierLink | None = None
    joins: int = 0  # times it became live (more than one: it was re-synced)


class FederatedCore:
    """One generation verified by a federation of workers (module docstring)."""

    def __init__(
        self,
        gen: Generation,
        cfg: PipelineConfig,
        rng: np.random.Generator,
        fingerprint: Fingerprint,
        workers: Sequence[WorkerParams],
        *,
        deadline_s: float = 5.0,
        seed: int | None = None,
    ) -> None:
        if not workers:
            raise ValueError("a federation needs at least one worker")
        self.cfg = cfg
        self.fingerprint = fingerprint
        # Workers never see q: the edge decides. Draft greedily only for greedy decoding.
        self.pipe = Pipeline(
            gen, cfg, rng, gamma=cfg.gamma, deterministic_draft=cfg.sampling.greedy
        )
        self.workers = [Worker(p, i) for i, p in enumerate(workers)]
        self.deadline_s = deadline_s
        self.seed = seed
        self.fed = FederationStats(eps_sum=[0.0] * len(workers))
        #: Since when no worker has been connected (None while one is).
        self.none_up_since: float | None = 0.0

    @property
    def gen(self) -> Generation:
        return self.pipe.gen

    def hello(self, index: int) -> Hello:
        s = self.cfg.sampling
        # Greedy decoding takes the argmax of the aggregate of the workers' *softmax*
        # distributions, so workers send T = 1 rows then.
        sampling = SamplingParams(1.0) if s.greedy else s
        session_seed = None if self.seed is None else (self.seed * 7919 + index) % 2**63
        p = self.workers[index].params
        return Hello(
            fingerprint=self.fingerprint,
            sampling=sampling,
            reply_mode=ReplyMode.FEDERATED,
            correction=CorrectionMode.GREEDY_DRAFT,  # no q on the wire: the edge decides
            k=p.k,
            eps_target=p.eps_target,
            seed=session_seed,
        )

    # ------------------------------------------------------------------ links

    def link_up(self, index: int, welcome: Welcome, now: float) -> None:
        """Worker ``index`` completed its handshake: it joins at the next boundary."""
        w = self.workers[index]
        ctx = WireContext(
            vocab_size=self.fingerprint.vocab_size,
            max_gamma=welcome.max_gamma,
            max_fixed=welcome.max_fixed,
            max_frame=welcome.max_frame,
            draft_probs=False,
        )
        w.link, w.state = VerifierLink(ctx), WorkerState.READY
        self.none_up_since = None
        self._join_at_boundary()

    def link_down(self, index: int, why: str, now: float) -> bool:
        """Worker ``index``'s link is gone. True if it was up (counted as a drop)."""
        w = self.workers[index]
        if w.state == WorkerState.DOWN:
            return False
        log.warning("worker %s dropped: %s", w.params.name, why)
        self.fed.worker_drops += 1
        w.state, w.link = WorkerState.DOWN, None
        if all(x.state == WorkerState.DOWN for x in self.workers):
            self.none_up_since = now
        return True

    def _join_at_boundary(self) -> None:
        if self.pipe.inflight:
            return
        for w in self.workers:
            if w.state == WorkerState.READY:
                w.state = WorkerState.LIVE
                w.joins += 1
                if w.joins > 1:
                    self.fed.worker_rejoins += 1

    def live(self) -> list[Worker]:
        return [w for w in self.workers if w.state == WorkerState.LIVE]

    def all_connected(self) -> bool:
        return all(w.state != WorkerState.DOWN for w in self.workers)

    # ------------------------------------------------------------------ drafting

    def may_draft(self) -> bool:
        return bool(self.live()) and self.pipe.may_draft()

    def propose(
        self, plan: DraftPlan, draft: list[int], q_rows: list[Probs], now: float
    ) -> list[EdgeEvent]:
        """Broadcast a drafted batch to every live worker; nothing if ``plan`` is void."""
        live = self.live()
        if not draft or not live or not self.pipe.current(plan):
            return []
        b = self.pipe.push(plan, draft, q_rows, now)
        out: list[EdgeEvent] = []
        for w in live:
            assert w.link is not None
            data = w.link.propose(self.gen.committed, b, w.index, with_q=False)
            self.gen.stats.uplink_bytes += len(data)
            out.append(Send(data, w.index))
        return out

    # ------------------------------------------------------------------ replies

    def receive(self, index: int, data: bytes, now: float) -> list[EdgeEvent]:
        """One frame from worker ``index``."""
        w = self.workers[index]
        if w.state == WorkerState.DOWN or w.link is None:
            return []  # a frame that raced the drop
        self.gen.stats.downlink_bytes += len(data)
        try:
            msg = w.link.decode(data)
        except (ProtocolError, VerifierError) as e:
            return self._drop(w, str(e), now)
        if not isinstance(msg, FederatedReply):
            return self._drop(w, f"unexpected {type(msg).__name__}", now)
        for b in self.pipe.inflight:
            if b.seqs.get(index) == msg.seq and w.link.epoch == msg.epoch:
                if len(msg.p_draft) != len(b.draft):
                    return self._drop(w, "replied for a different γ", now)
                b.replies[index] = msg
                return []
        return []  # a reply to a batch discarded by a rejection: its work is void

    def _drop(self, w: Worker, why: str, now: float) -> list[EdgeEvent]:
        self.link_down(w.index, why, now)
        return [Drop(w.index, why)]

    # ------------------------------------------------------------------ rounds

    def head_deadline(self) -> float | None:
        """When the head batch must be decided, answered or not (None: nothing in flight)."""
        if not self.pipe.inflight:
            return None
        return self.pipe.inflight[0].sent_at + self.deadline_s

    def round_ready(self, now: float) -> bool:
        """The head batch can be decided: every live worker sent it replied, or time is up."""
        if not self.pipe.inflight:
            return False
        b = self.pipe.inflight[0]
        waiting = [
            i for i in b.seqs if i not in b.replies and self.workers[i].state == WorkerState.LIVE
        ]
        return not waiting or now >= b.sent_at + self.deadline_s

    def decide(self, now: float) -> list[EdgeEvent]:
        """Decide the head batch (call when :meth:`round_ready`)."""
        pipe = self.pipe
        b = pipe.inflight[0]
        out: list[EdgeEvent] = []
        for i in list(b.seqs):
            if i not in b.replies:
                w = self.workers[i]
                # Only a LIVE worker was waited for (round_ready): one that was dropped since
                # this batch was sent and has reconnected (READY) owes it nothing.
                if w.state == WorkerState.LIVE:
                    self.link_down(i, "missed the round deadline", now)
                    out.append(Drop(i, "missed the round deadline"))
        if not b.replies:
            # Nobody answered: the batch is void; drafting restarts from the committed ids.
            pipe.discard_inflight()
            return out + self._rollback_all(len(self.gen.committed))
        rejected = self._decide(b, now)
        if rejected:  # crop every worker to the accepted prefix (before the recovered token)
            out += self._rollback_all(len(self.gen.committed) - 1)
        self._join_at_boundary()
        return out

    def _rollback_all(self, keep: int) -> list[EdgeEvent]:
        """Every live worker keeps ``keep`` tokens and enters a new epoch."""
        out: list[EdgeEvent] = []
        for w in self.live():
            assert w.link is not None
            w.link.epoch += 1
            w.link.verifier_len = min(w.link.verifier_len, keep)
            data = encode(Rollback(w.link.epoch, w.link.verifier_len), w.link.ctx)
            self.gen.stats.uplink_bytes += len(data)
            out.append(Send(data, w.index))
        self._join_at_boundary()
        return out

    def _decide(self, b: Batch, now: float) -> bool:
        """Aggregate the replies, commit; True on a rejection."""
        pipe, st, fed = self.pipe, self.gen.stats, self.fed
        idx = sorted(b.replies)
        if len(idx) < len(b.seqs) or len(idx) < len(self.workers):
            fed.rounds_with_missing_workers += 1
        weights = [self.workers[i].params.weight for i in idx]
        # As in single mode, only stop-and-wait takes bonus tokens: a pipelined edge has
        # already drafted past the batch.
        d = aggregation.decide(
            [b.replies[i] for i in idx],
            weights,
            b.draft,
            b.q_rows,
            vocab_size=self.fingerprint.vocab_size,
            greedy=self.cfg.sampling.greedy,
            rng=pipe.rng,
            how=self.cfg.reconstruction,
            want_bonus=self.cfg.mode == Mode.STOP_AND_WAIT,
        )
        for m in d.measures:
            fed.positions_measured += 1
            for i, e in zip(idx, m.eps, strict=True):
                fed.eps_sum[i] += e
            fed.bias_bound_sum += m.bias_bound
            if m.bias_upper is not None:
                fed.bias_upper_sum += m.bias_upper
                fed.bias_upper_count += 1
            for v in m.violations:
                fed.bound_violations += 1
                log.error("compression bound violated (a bug): %s", v)
        pipe.commit_round(b, d.accepted, now)
        if d.rejected:
            if d.token is None:
                raise DesyncError("a federated rejection without a recovered token")
            st.rejections += 1
            pipe.on_rejection(now)
            pipe.discard_inflight()
            pipe.commit_recovered(d.token)
            return True
        if d.token is not None:
            pipe.commit_bonus(d.token, len(pipe.gen.committed))
        return False
