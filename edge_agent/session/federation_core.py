"""Federated verification (SpecFed) at the edge as a synchronous state machine: no I/O, no clock.

It composes the :class:`~edge_agent.session.pipeline.Pipeline` with one
:class:`~edge_agent.session.wire_state.WireState` per member (worker). Each batch goes to
the members that are *in step*; each answers with a
:class:`~shared.wire.messages.FederatedReply` and, while its work waits or runs,
:class:`~shared.wire.messages.Progress` frames. The edge decides
(:func:`edge_agent.session.aggregation.decide`) against the weighted aggregate of the replies it
has.
Every feed returns :mod:`edge_agent.session.events` to carry out; ``now`` is always passed in.

Busy is not dead, and slow is not dead either. Two separate rules (see
docs/how-it-works/federation.md):

* **Liveness** (per member, the single verifier's rule): a member with work outstanding is
  dead once it has been silent past ``max(liveness_s, 4 × its slowest recent round)`` since its
  oldest outstanding Propose or its last reply (plus the prefill allowance of that Propose's
  fixed tokens), or past ``max(liveness_s, 4 × eta)`` since its last Progress frame. Only a
  dead member (or one that errs or sends a frame that does not fit) is dropped
  (:class:`~edge_agent.session.events.Drop`); its driver reconnects it with backoff.
* **Progress** (per round): a round is decided once every in-step member it was sent to has
  replied, or, after the first reply came at ``t1``, at
  ``sent + max(deadline_s, WAIT_FACTOR × (t1 − sent))``. Until some member replies a round
  waits as long as anyone it was sent to is alive: no round deadline is shorter than a live
  member's speed unless another member answered. An in-step member that misses the round is
  *left out*: it keeps its session (its queued work finishes), is sent no more batches but a
  probe when it has none outstanding, and is *readmitted* as soon as a reply of its comes
  within ``READMIT_FRACTION`` of the wait bound (``max(deadline_s, WAIT_FACTOR × the fastest
  in-step member's median round)``) with no other Propose of its unanswered (caught up: it is
  sent the next D batches, not D more on top of those it owes). A failed probe spaces the next
  by its own round time.

Member states:

======= ===================================== ================================================
state   input                                 effect
======= ===================================== ================================================
DOWN    ``link_up``, before any round was     → LIVE (every member that connects in time
        decided or with no member LIVE        starts in step)
DOWN    ``link_up``, otherwise                → BEHIND (probed with the next batch)
LIVE    a batch is sent                       Propose (fixed: the text it has not seen)
LIVE    the round passed its wait bound       → BEHIND (left out; counted, not dropped)
        without its reply
BEHIND  a batch is sent, nothing outstanding  Propose (a probe), at most one at a time
        and its probe is due
BEHIND  its last reply owed, within the       → LIVE (counted as a rejoin)
        readmission bound
BEHIND  its last reply owed, slower than that next probe no sooner than that round time
LIVE,   FederatedReply for a batch in flight  filed for that batch's decision (a BEHIND
BEHIND                                        member's too: nobody waits for it, but a reply
                                              in time counts)
LIVE,   Progress / reply to a decided batch   its liveness and speed are updated
BEHIND
LIVE,   Error, other frame, wrong γ, silent   → DOWN; :class:`Drop`
BEHIND  past its liveness bound
any     ``link_down``                         → DOWN
======= ===================================== ================================================

Whenever no member is LIVE, every connected member becomes LIVE: the federation never waits
for nobody.

Invariants. Frames of one link are handled by its verifier in order and federated sessions never
see a stale epoch, so every Propose gets exactly one FederatedReply (or an Error): a member's
``outstanding`` table is exact. A member's verifier text agrees with the edge's committed text
and in-flight drafts on its first ``verifier_len`` tokens; a Propose carries as fixed tokens
whatever lies between that and the batch's start (committed or in flight), so a member joins or
rejoins at any batch. On a rejection (or a void round) every member holding tokens past the
kept length gets a Rollback (new epoch, kept length) *before* any Propose of the new epoch:
both come out of this core in order, and the driver writes each link's frames in that order.

Exactness: a round's target is the weighted aggregate of the members whose replies it has
(weights renormalised over them). Who is present depends on arrival times alone, never on a
reply's contents, and is fixed before the round's randomness is drawn, so each round is exact
for the aggregate of its members; the compression bounds are measured over them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

import numpy as np

from edge_agent.session import aggregation
from edge_agent.session.drafting import DraftingCore
from edge_agent.session.events import (
    Counter,
    Drop,
    EdgeEvent,
    FedCount,
    FedCounter,
    FedTally,
    Measured,
    Send,
)
from edge_agent.session.federation_members import (
    LIVENESS_FACTOR,
    Sent,
    Worker,
    WorkerParams,
    WorkerState,
)
from edge_agent.session.generation import Generation
from edge_agent.session.opening import DesyncError, VerifierError
from edge_agent.session.pipeline import Batch, DraftPlan, Pipeline
from edge_agent.session.pipeline_config import Mode, PipelineConfig
from edge_agent.session.wire_state import WireState
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import Probs, SamplingParams
from shared.wire.messages import (
    FederatedReply,
    Fingerprint,
    Hello,
    Progress,
    ReplyMode,
    Rollback,
    Welcome,
)
from shared.wire.packing import ProtocolError, WireContext

#: Once one verifier has answered a round, the least time the round waits for the others that
#: keep up (the ``round_deadline`` setting's default).
ROUND_DEADLINE_S: Final = 1.0

log = logging.getLogger("wanspec.federation")

#: Once a member has answered a round, the round waits for the other in-step members up to this
#: multiple of that first answer's round time (or ``deadline_s``, when longer).
WAIT_FACTOR: Final = 4.0
#: A left-out member is readmitted when one of its rounds takes at most this fraction of the
#: wait bound (hysteresis: a member at the bound does not flap in and out).
READMIT_FRACTION: Final = 0.5


class FederatedCore(DraftingCore):
    """One generation verified by a federation of workers (module docstring)."""

    def __init__(
        self,
        gen: Generation,
        cfg: PipelineConfig,
        rng: np.random.Generator,
        fingerprint: Fingerprint,
        workers: Sequence[WorkerParams],
        *,
        deadline_s: float = ROUND_DEADLINE_S,
        liveness_s: float = 10.0,
        seed: int | None = None,
    ) -> None:
        """``deadline_s``: the least time a round waits, once a member has answered it, for the
        other in-step members (module docstring); ``liveness_s``: the floor of a member's
        liveness bound (the single verifier's verdict deadline floor)."""
        if not workers:
            raise ValueError("a federation needs at least one worker")
        if not (deadline_s > 0 and liveness_s > 0):
            raise ValueError("deadline_s and liveness_s must be positive")
        self.cfg = cfg
        self.fingerprint = fingerprint
        # Workers never see q: the edge decides. Draft greedily only for greedy decoding.
        self.pipe = Pipeline(
            gen, cfg, rng, gamma=cfg.gamma, deterministic_draft=cfg.sampling.greedy
        )
        self.workers = [Worker(p, i) for i, p in enumerate(workers)]
        self.deadline_s = deadline_s
        self.liveness_s = liveness_s
        self.seed = seed
        #: What happened to the federation since it was last returned (every call that feeds
        #: the core returns it, after the pipeline's news).
        self._fed_news: list[FedTally] = []
        #: Since when no worker has been connected (None while one is).
        self.none_up_since: float | None = 0.0
        self.rounds_decided = 0
        #: When each in-flight batch got its first reply: id(batch) → (batch, time). Entries
        #: leave with their batch (:meth:`_forget_decided`), so an id is never reused here.
        self._first_reply: dict[int, tuple[Batch, float]] = {}

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
            progress=True,  # busy is not dead: liveness follows the verifier's Progress
        )

    # ------------------------------------------------------------------ links

    def link_up(self, index: int, welcome: Welcome, now: float) -> list[EdgeEvent]:
        """Worker ``index`` completed its handshake: in step at the start (or when nobody is),
        else probed with the next batch. The generation is bounded by every member's context
        (:func:`~edge_agent.session.opening.fit_context`: it ends with "length" at the smallest,
        the Finished returned; a prompt past it raises ContextExceeded, answered 400)."""
        self.pipe.fit_context(welcome.max_context)
        w = self.workers[index]
        ctx = WireContext(
            vocab_size=self.fingerprint.vocab_size,
            max_gamma=welcome.max_gamma,
            max_fixed=welcome.max_fixed,
            max_frame=welcome.max_frame,
            draft_probs=False,
        )
        w.wire = WireState(ctx)
        w.outstanding.clear()
        w.rounds.clear()
        w.replied_at = w.progress_at = None
        w.answered = 0
        w.probe_at = now
        self.none_up_since = None
        if self.rounds_decided == 0 or not self.live():
            self._enter_step(w)
        else:
            w.state = WorkerState.BEHIND
        return self._news()

    def ctx(self, index: int) -> WireContext:
        """Worker ``index``'s WireContext while its link is up: the driver encodes the core's
        Sends to it with this one."""
        link = self.workers[index].wire
        if link is None:
            raise ValueError(f"worker {index}'s link is down")
        return link.ctx

    def link_down(self, index: int, why: str, now: float) -> list[EdgeEvent]:
        """Worker ``index``'s link is gone: what that reports (a drop, counted once; none if
        it was down already)."""
        w = self.workers[index]
        if w.state == WorkerState.DOWN:
            return []
        log.warning("worker %s dropped: %s", w.params.name, why)
        self._fed_count(FedCounter.WORKER_DROPS)
        w.state, w.wire = WorkerState.DOWN, None
        w.outstanding.clear()
        for b in self.pipe.inflight:  # its next session owes these nothing
            b.seqs.pop(index, None)
        if not any(x.connected for x in self.workers):
            self.none_up_since = now
        self._keep_someone_in_step()
        out: list[EdgeEvent] = [*self._fed_news]  # (the pipeline's news: its feed's to return)
        self._fed_news = []
        return out

    def _news(self) -> list[EdgeEvent]:
        """The pipeline's news, then the federation's, since the last call."""
        out: list[EdgeEvent] = [*self.pipe.news(), *self._fed_news]
        self._fed_news = []
        return out

    def _fed_count(self, counter: FedCounter) -> None:
        self._fed_news.append(FedCount(counter))

    def _enter_step(self, w: Worker) -> None:
        w.state = WorkerState.LIVE
        w.joins += 1
        if w.joins > 1:
            self._fed_count(FedCounter.WORKER_REJOINS)

    def _keep_someone_in_step(self, answered: Sequence[int] = ()) -> None:
        """With no member LIVE, those of ``answered`` (the members that answered the round just
        decided) are, or else every connected one: the federation never waits for nobody."""
        if self.live():
            return
        behind = [w for w in self.workers if w.state == WorkerState.BEHIND]
        for w in [w for w in behind if w.index in answered] or behind:
            self._enter_step(w)

    def live(self) -> list[Worker]:
        return [w for w in self.workers if w.state == WorkerState.LIVE]

    def all_connected(self) -> bool:
        return all(w.connected for w in self.workers)

    # ------------------------------------------------------------------ drafting

    def may_draft(self) -> bool:
        return bool(self.live()) and self.pipe.may_draft()

    def propose(
        self, plan: DraftPlan, draft: list[int], q_rows: list[Probs], now: float
    ) -> list[EdgeEvent]:
        """Send a drafted batch to every LIVE member, and as a probe to every BEHIND member
        that has nothing outstanding and whose probe is due; nothing if ``plan`` is void."""
        if not draft or not self.live() or not self.pipe.current(plan):
            return []
        text = [*self.gen.committed, *self.pipe.tail]  # what the batch continues
        b = self.pipe.push(plan, draft, q_rows, now)
        assert b.start == len(text)
        out = self._news()
        for w in self.workers:
            probe = w.state == WorkerState.BEHIND and not w.outstanding and now >= w.probe_at
            if not (w.state == WorkerState.LIVE or probe):
                continue
            assert w.wire is not None and w.wire.verifier_len <= len(text)
            fixed = len(text) - w.wire.verifier_len
            msg = w.wire.propose(text, b, w.index, with_q=False)
            w.outstanding[b.seqs[w.index]] = Sent(now, fixed)
            if probe:
                out.append(FedCount(FedCounter.PROBES))
            out.append(Send(msg, w.index))
        return out

    # ------------------------------------------------------------------ replies

    def receive(self, index: int, data: bytes, now: float) -> list[EdgeEvent]:
        """One frame from worker ``index``."""
        events = self._receive(index, data, now)
        return [*self._news(), *events]

    def _receive(self, index: int, data: bytes, now: float) -> list[EdgeEvent]:
        w = self.workers[index]
        if not w.connected or w.wire is None:
            return []  # a frame that raced the drop
        self.pipe.count(Counter.DOWNLINK_BYTES, len(data))
        try:
            msg = w.wire.decode(data)
        except (ProtocolError, VerifierError) as e:
            return self._drop(w, str(e), now)
        if isinstance(msg, Progress):
            self.pipe.count(Counter.PROGRESS_FRAMES)
            w.progress_at, w.progress_eta_s = now, msg.eta_ms / 1000.0
            return []
        if not isinstance(msg, FederatedReply):
            return self._drop(w, f"unexpected {type(msg).__name__}", now)
        sent = w.outstanding.pop(msg.seq, None)
        if sent is None:
            return self._drop(w, f"a reply to batch {msg.seq}, which it was not sent", now)
        w.rounds.append(max(0.0, now - sent.at))
        w.replied_at = now
        w.answered += 1
        for b in self.pipe.inflight:
            if b.seqs.get(index) == msg.seq and w.wire.epoch == msg.epoch:
                if len(msg.p_draft) != len(b.draft):
                    return self._drop(w, "replied for a different γ", now)
                b.replies[index] = msg
                self._first_reply.setdefault(id(b), (b, now))
                break
        # (else: a reply to a decided or discarded batch: its work only tells the speed)
        if w.state == WorkerState.BEHIND:
            self._maybe_readmit(w, now - sent.at, now)
        return []

    def _maybe_readmit(self, w: Worker, round_s: float, now: float) -> None:
        """A left-out member's reply took ``round_s``. Once it has caught up (that was the last
        Propose it owed): back in step if ``round_s`` is within the readmission bound, else its
        next probe no sooner than ``round_s`` from now.

        Bound: a member in step owes at most 2·D − 1 Proposes (D − 1 discarded by a rejection
        it answered the head of, plus the D in flight); a left-out one no more than it owed
        when left out, or one probe. A member in step is sent every new batch, so one
        readmitted while it still owed Proposes would get D more on top of them: it waits until
        its queue is empty, and a fast reply before that only says that it is catching up (its
        last reply, queueing included, decides)."""
        if w.outstanding:
            return
        bound = READMIT_FRACTION * self.wait_bound(exclude=w)
        if round_s <= bound:
            log.info(
                "worker %s keeps up again (%.2f s a round, bound %.2f s): back in step",
                w.params.name, round_s, bound,
            )  # fmt: skip
            self._enter_step(w)
        else:
            w.probe_at = now + round_s  # at most half its time on probes

    def _drop(self, w: Worker, why: str, now: float) -> list[EdgeEvent]:
        return [*self.link_down(w.index, why, now), Drop(w.index, why)]

    # ------------------------------------------------------------------ rounds

    def wait_bound(self, exclude: Worker | None = None) -> float:
        """How long rounds wait for a member now: ``deadline_s``, or WAIT_FACTOR × the fastest
        in-step member's median round when longer (the readmission yardstick)."""
        paces = [p for w in self.live() if w is not exclude and (p := w.pace()) is not None]
        return max(self.deadline_s, WAIT_FACTOR * min(paces, default=0.0))

    def _round_deadline(self, b: Batch) -> float | None:
        """When batch ``b`` stops waiting for in-step members (None: nobody has answered it,
        so it waits on liveness alone)."""
        first = self._first_reply.get(id(b))
        if first is None:
            return None
        return b.sent_at + max(self.deadline_s, WAIT_FACTOR * (first[1] - b.sent_at))

    def _owed(self, b: Batch) -> list[Worker]:
        """Connected members that were sent ``b`` and have not answered it."""
        return [self.workers[i] for i in b.seqs if i not in b.replies]

    def _head_ready(self, now: float) -> bool:
        if not self.pipe.inflight:
            return False
        b = self.pipe.inflight[0]
        owed = self._owed(b)
        if not b.replies:
            return not owed  # void once nobody can answer it any more
        if all(w.state != WorkerState.LIVE for w in owed):
            return True
        deadline = self._round_deadline(b)
        return deadline is not None and now >= deadline

    def _stalled(self, now: float) -> list[Worker]:
        out = []
        for w in self.workers:
            d = w.liveness_deadline(self.liveness_s) if w.connected else None
            if d is not None and now >= d:
                out.append(w)
        return out

    def round_ready(self, now: float) -> bool:
        """Something is due at ``now``: a silent member to drop, or the head batch to decide
        (every in-step member it was sent replied, or its wait is over)."""
        return bool(self._stalled(now)) or self._head_ready(now)

    def wake_at(self) -> float | None:
        """The next time :meth:`round_ready` may turn true with no frame arriving: the head's
        wait bound or a member's liveness deadline (None: only a frame can change anything)."""
        times = [d for w in self.workers if (d := w.liveness_deadline(self.liveness_s)) is not None]
        if self.pipe.inflight:
            b = self.pipe.inflight[0]
            d = self._round_deadline(b)
            if d is not None and any(w.state == WorkerState.LIVE for w in self._owed(b)):
                times.append(d)
        return min(times, default=None)

    def decide(self, now: float) -> list[EdgeEvent]:
        """Carry out what is due at ``now`` (call when :meth:`round_ready`): drop members silent
        past their liveness bound, then decide every head batch that is ready."""
        out: list[EdgeEvent] = []
        for w in self._stalled(now):
            oldest = next(iter(w.outstanding.values()))
            heard = max(t for t in (oldest.at, w.replied_at, w.progress_at) if t is not None)
            why = (
                f"silent for {now - heard:.1f} s with {len(w.outstanding)} Propose(s) "
                f"unanswered: the verifier is stalled (liveness bound: max({self.liveness_s:g} "
                f"s, {LIVENESS_FACTOR:g} × its slowest round or its own estimate of the rest))"
            )
            out += self._drop(w, why, now)
        while self._head_ready(now):
            out += self._decide_head(now)
        return [*self._news(), *out]

    def _decide_head(self, now: float) -> list[EdgeEvent]:
        pipe = self.pipe
        b = pipe.inflight[0]
        if not b.replies:
            # Nobody answered and nobody can: the batch is void; drafting restarts from the
            # committed ids.
            pipe.discard_inflight()
            self._forget_decided()
            return self._rollback_all(len(self.gen.committed))
        for w in self._owed(b):
            if w.state == WorkerState.LIVE:  # slow, not dead: left out, session kept
                w.state = WorkerState.BEHIND
                w.probe_at = now
                self._fed_count(FedCounter.LEFT_OUT)
                log.info(
                    "worker %s left out of the rounds: no reply %.2f s after sending (wait "
                    "bound %.2f s); it keeps its session and is probed",
                    w.params.name, now - b.sent_at, (self._round_deadline(b) or now) - b.sent_at,
                )  # fmt: skip
        self._keep_someone_in_step(answered=list(b.replies))
        rejected = self._decide(b, now)
        self.rounds_decided += 1
        self._forget_decided()
        if rejected:  # crop every member to the accepted prefix (before the recovered token)
            return self._rollback_all(len(self.gen.committed) - 1)
        return []

    def _forget_decided(self) -> None:
        inflight = {id(b) for b in self.pipe.inflight}
        self._first_reply = {k: v for k, v in self._first_reply.items() if k in inflight}

    def _rollback_all(self, keep: int) -> list[EdgeEvent]:
        """Every member whose verifier holds tokens past ``keep`` keeps ``keep`` and enters a
        new epoch (one that holds none has nothing to undo: no frame)."""
        out: list[EdgeEvent] = []
        for w in self.workers:
            if w.wire is None or w.wire.verifier_len <= keep:
                continue
            w.wire.epoch += 1
            w.wire.verifier_len = keep
            out.append(Send(Rollback(w.wire.epoch, keep), w.index))
        return out

    def _decide(self, b: Batch, now: float) -> bool:
        """Aggregate the replies, commit; True on a rejection."""
        pipe = self.pipe
        idx = sorted(b.replies)
        if len(idx) < len(self.workers):
            self._fed_count(FedCounter.ROUNDS_WITH_MISSING_WORKERS)
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
            eps = tuple(zip(idx, m.eps, strict=True))
            self._fed_news.append(Measured(eps, m.bias_bound, m.bias_upper, len(m.violations)))
            for v in m.violations:
                log.error("compression bound violated (a bug): %s", v)
        pipe.commit_round(b, d.accepted, now)
        if d.rejected:
            if d.token is None:
                raise DesyncError("a federated rejection without a recovered token")
            pipe.count(Counter.REJECTIONS)
            pipe.on_rejection(now)
            pipe.discard_inflight()
            pipe.commit_recovered(d.token)
            return True
        if d.token is not None:
            pipe.commit_bonus(d.token, len(pipe.gen.committed))
        return False
