"""Federated verification (SpecFed) over several verifier links, pipelined like single mode.

The drafter and the bounded in-flight queue are those of :class:`SpeculativeSession`; what
changes is the round: each Propose is broadcast to every *live* worker (each with its own session
state: sequence numbers, epoch, cache length), each answers with a :class:`FederatedReply`, and
the edge decides (:func:`shared.federated.decide`) once every worker that was sent the batch has
replied, or the round's deadline has passed. A worker that misses the deadline, errs or drops is
taken out of the round (the remaining weights are renormalised, and this is counted), its link
is closed, and a background task reconnects it; it rejoins at the next *boundary* (nothing in
flight: right after a rejection or between batches), when its first Propose carries every
committed id as fixed tokens, so its target re-prefills. Nothing committed is ever lost.

On a rejection the edge tells each live worker where the accepted prefix ends with a Rollback
(new epoch, kept length), so their caches crop and their queued Proposes of the old epoch are
dropped unprocessed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from edge_agent.agent import handshake
from edge_agent.drafter import Drafter
from edge_agent.pipeline import (
    STOP_AND_WAIT,
    Batch,
    DesyncError,
    Generation,
    PipelineConfig,
    SpeculativeSession,
    VerifierError,
)
from edge_agent.tasks import ModelWorker, run_until_first_done
from edge_agent.transport import LinkClosed, Transport
from shared.federated import decide
from shared.protocol import (
    SEQ_MODULUS,
    CorrectionMode,
    Error,
    FederatedReply,
    Fingerprint,
    Hello,
    Propose,
    ProtocolError,
    ReplyMode,
    Rollback,
    WireContext,
    decode,
    encode,
)
from shared.sampling import Probs, SamplingParams

log = logging.getLogger("wanspec.federation")

LIVE, DOWN, READY = "live", "down", "ready"


@dataclass(frozen=True)
class WorkerSpec:
    """One verifier of the federation."""

    name: str
    connect: Callable[[], Awaitable[Transport]]
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
class WorkerLink:
    spec: WorkerSpec
    index: int
    state: str = DOWN
    transport: Transport | None = None
    ctx: WireContext | None = None
    epoch: int = 0
    next_seq: int = 0
    verifier_len: int = 0
    joins: int = 0  # times it became live (more than one: it was re-synced)


@dataclass
class FedBatch(Batch):
    seqs: dict[int, int] = field(default_factory=dict)  # worker index → its seq for this batch
    replies: dict[int, FederatedReply] = field(default_factory=dict)
    sent_at: float = 0.0


class FederatedSession(SpeculativeSession):
    """One generation verified by a federation of workers."""

    def __init__(
        self,
        gen: Generation,
        drafter: Drafter,
        worker: ModelWorker,
        workers: list[WorkerSpec],
        fingerprint: Fingerprint,
        config: PipelineConfig,
        rng: np.random.Generator,
        *,
        deadline_s: float = 5.0,
        reconnect_s: float = 0.5,
        no_worker_timeout_s: float = 30.0,
        seed: int | None = None,
    ) -> None:
        ctx = WireContext(vocab_size=fingerprint.vocab_size, draft_probs=False)
        super().__init__(gen, drafter, worker, _NoTransport(), ctx, config, rng)
        if not workers:
            raise ValueError("a federation needs at least one worker")
        self.links = [WorkerLink(spec, i) for i, spec in enumerate(workers)]
        self.fingerprint = fingerprint
        self.deadline_s = deadline_s
        self.reconnect_s = reconnect_s
        self.no_worker_timeout_s = no_worker_timeout_s
        self.seed = seed
        self.fed = FederationStats(eps_sum=[0.0] * len(workers))
        self._jitter = random.Random(seed)
        self._tasks: dict[int, asyncio.Task[None]] = {}

    @property
    def deterministic_draft(self) -> bool:
        # Workers never see q: the edge decides. Draft greedily only for greedy decoding.
        return self.cfg.sampling.greedy

    def hello(self, link: WorkerLink) -> Hello:
        s = self.cfg.sampling
        # Greedy decoding takes the argmax of the aggregate of the workers' *softmax*
        # distributions, so workers send T = 1 rows then.
        sampling = SamplingParams(1.0) if s.greedy else s
        session_seed = None if self.seed is None else (self.seed * 7919 + link.index) % 2**63
        return Hello(
            fingerprint=self.fingerprint,
            sampling=sampling,
            reply_mode=ReplyMode.FEDERATED,
            correction=CorrectionMode.GREEDY_DRAFT,  # no q on the wire: the edge decides
            k=link.spec.k,
            eps_target=link.spec.eps_target,
            seed=session_seed,
        )

    # ------------------------------------------------------------------ links

    async def _connect(self, link: WorkerLink) -> None:
        transport = await link.spec.connect()
        try:
            hello = self.hello(link)
            welcome = await handshake(transport, hello, timeout_s=30.0)
        except BaseException:
            await transport.close()
            raise
        link.transport = transport
        link.ctx = WireContext(
            vocab_size=self.fingerprint.vocab_size,
            max_gamma=welcome.max_gamma,
            max_fixed=welcome.max_fixed,
            max_frame=welcome.max_frame,
            draft_probs=False,
        )
        link.epoch, link.next_seq, link.verifier_len = 0, 0, 0
        link.state = READY

    async def _drop(self, link: WorkerLink, why: str) -> None:
        if link.state == DOWN:
            return
        log.warning("worker %s dropped: %s", link.spec.name, why)
        self.fed.worker_drops += 1
        link.state = DOWN
        transport, link.transport = link.transport, None
        if transport is not None:
            with contextlib.suppress(Exception):
                await transport.close()
        await self._notify()

    async def _link_loop(self, link: WorkerLink) -> None:
        """Owns one worker: (re)connect with backoff, then read its replies until it drops."""
        attempt = 0
        while not self.gen.done:
            if link.state == DOWN:
                try:
                    await self._connect(link)
                    attempt = 0
                    await self._notify()
                except (LinkClosed, OSError, asyncio.TimeoutError, DesyncError, VerifierError) as e:
                    attempt += 1
                    delay = min(5.0, self.reconnect_s * 2 ** min(attempt, 6))
                    log.info("worker %s unavailable (%s); retry in %.1fs", link.spec.name, e, delay)
                    await asyncio.sleep(self._jitter.uniform(delay / 2, delay))
                    continue
            transport = link.transport
            assert transport is not None and link.ctx is not None
            try:
                data = await transport.recv()
                self.gen.stats.downlink_bytes += len(data)
                msg = decode(data, link.ctx)
            except (LinkClosed, ProtocolError) as e:
                await self._drop(link, str(e))
                continue
            if isinstance(msg, Error):
                await self._drop(link, f"{msg.code}: {msg.message}")
                continue
            if not isinstance(msg, FederatedReply):
                await self._drop(link, f"unexpected {type(msg).__name__}")
                continue
            self._file_reply(link, msg)
            await self._notify()

    def _file_reply(self, link: WorkerLink, r: FederatedReply) -> None:
        for b in self.inflight:
            assert isinstance(b, FedBatch)
            if b.seqs.get(link.index) == r.seq and link.epoch == r.epoch:
                if len(r.p_draft) != len(b.draft):
                    log.error("worker %s replied for a different γ", link.spec.name)
                    return
                b.replies[link.index] = r
                return
        # A reply to a batch discarded by a rejection: its work is void.

    # ------------------------------------------------------------------ rounds

    async def run(self) -> None:
        if self.gen.done:
            return
        for link in self.links:
            self._tasks[link.index] = asyncio.ensure_future(self._link_loop(link))
        try:
            # Start with every worker that connects within a round deadline, so the first
            # rounds are not decided by whichever worker happened to answer first.
            async with self._changed:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        self._changed.wait_for(
                            lambda: all(x.state != DOWN for x in self.links)
                        ),
                        self.deadline_s,
                    )
            await run_until_first_done(self._draft_loop(), self._decide_loop())
        finally:
            for t in self._tasks.values():
                t.cancel()
            for t in self._tasks.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            for link in self.links:
                if link.transport is not None:
                    with contextlib.suppress(Exception):
                        await link.transport.close()
                link.transport, link.state = None, DOWN

    def _live(self) -> list[WorkerLink]:
        return [link for link in self.links if link.state == LIVE]

    async def _wait_for_room(self) -> None:
        # Workers that reconnected join at a boundary: nothing in flight.
        if not self.inflight:
            for link in self.links:
                if link.state == READY:
                    self._join(link)
        if not self._live():
            t0 = time.monotonic()

            def any_worker() -> bool:
                return self.gen.done or any(x.state != DOWN for x in self.links)

            async with self._changed:
                try:
                    await asyncio.wait_for(
                        self._changed.wait_for(any_worker), self.no_worker_timeout_s
                    )
                except asyncio.TimeoutError:
                    raise LinkClosed(
                        f"no verifier reachable for {time.monotonic() - t0:.0f} s"
                    ) from None
            for link in self.links:
                if link.state == READY and not self.inflight:
                    self._join(link)
        await super()._wait_for_room()

    def _join(self, link: WorkerLink) -> None:
        """A connected worker becomes live (only at a boundary: nothing in flight)."""
        link.state = LIVE
        link.joins += 1
        if link.joins > 1:
            self.fed.worker_rejoins += 1

    async def _send_batch(self, draft: list[int], q_rows: list[Probs]) -> None:
        live = self._live()
        if not live:
            return  # the next _wait_for_room waits for a worker
        b = FedBatch(self.epoch, 0, len(self.gen.committed) + len(self.tail), [], draft, q_rows)
        b.sent_at = time.monotonic()
        self.inflight.append(b)
        frames: list[tuple[WorkerLink, bytes]] = []
        for link in live:
            assert link.ctx is not None
            pos = link.verifier_len
            fixed = self.gen.committed[pos:]
            msg = Propose(
                epoch=link.epoch,
                seq=link.next_seq,
                pos=pos,
                draft=np.array(draft, np.int64),
                q=np.ones(len(draft), np.float32),
                fixed=np.array(fixed, np.int64),
            )
            b.seqs[link.index] = link.next_seq
            link.next_seq = (link.next_seq + 1) % SEQ_MODULUS
            link.verifier_len = pos + len(fixed) + len(draft)
            frames.append((link, encode(msg, link.ctx)))
        self.gen.stats.proposes_sent += 1
        for link, data in frames:
            self.gen.stats.uplink_bytes += len(data)
            try:
                assert link.transport is not None
                await link.transport.send(data)
            except (LinkClosed, AssertionError) as e:
                await self._drop(link, f"send failed: {e}")

    def _round_ready(self, b: FedBatch) -> bool:
        waiting = [i for i in b.seqs if i not in b.replies and self.links[i].state == LIVE]
        return not waiting

    async def _decide_loop(self) -> None:
        while not self.gen.done:
            async with self._changed:
                await self._changed.wait_for(lambda: self.gen.done or bool(self.inflight))
            if self.gen.done:
                return
            b = self.inflight[0]
            assert isinstance(b, FedBatch)
            remaining = self.deadline_s - (time.monotonic() - b.sent_at)
            if not self._round_ready(b) and remaining > 0:
                await self._await_round(b, remaining)
            if self.inflight and self.inflight[0] is not b:
                continue
            for i in list(b.seqs):
                if i not in b.replies:
                    await self._drop(self.links[i], "missed the round deadline")
            if not b.replies:
                # Nobody answered: the batch is void; drafting restarts from the committed ids.
                self._discard_inflight()
            else:
                self._decide(b)
            if self.epoch != b.epoch:  # a rejection (or a void round): crop every worker
                # The drafter waits meanwhile: each worker must see its Rollback before any
                # Propose of the new epoch.
                self._recovering = True
                try:
                    await self._rollback_all(
                        len(self.gen.committed) - (0 if not b.replies else 1)
                    )
                finally:
                    self._recovering = False
            await self._notify()

    async def _await_round(self, b: FedBatch, timeout_s: float) -> None:
        """Until every live worker sent ``b`` has replied, or the deadline."""
        async with self._changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._round_ready(b)), timeout_s
                )

    def _discard_inflight(self) -> None:
        self.gen.stats.discarded_batches += len(self.inflight)
        self.gen.stats.discarded_tokens += sum(len(x.draft) for x in self.inflight)
        self.inflight.clear()
        self.epoch += 1

    async def _rollback_all(self, keep: int) -> None:
        """Tell every live worker to keep ``keep`` tokens and enter a new epoch. Awaited before
        any further Propose, so each worker sees the Rollback first."""
        for link in self._live():
            link.epoch += 1
            link.verifier_len = min(link.verifier_len, keep)
            assert link.ctx is not None and link.transport is not None
            data = encode(Rollback(link.epoch, link.verifier_len), link.ctx)
            self.gen.stats.uplink_bytes += len(data)
            try:
                await link.transport.send(data)
            except LinkClosed as e:
                await self._drop(link, f"send failed: {e}")

    def _decide(self, b: FedBatch) -> None:
        st, fed = self.gen.stats, self.fed
        self.inflight.popleft()
        idx = sorted(b.replies)
        if len(idx) < len(b.seqs) or len(idx) < len(self.links):
            fed.rounds_with_missing_workers += 1
        weights = [self.links[i].spec.weight for i in idx]
        # As in single mode, only stop-and-wait takes bonus tokens: a pipelined edge has
        # already drafted past the batch.
        want_bonus = self.cfg.mode == STOP_AND_WAIT
        d = decide(
            [b.replies[i] for i in idx],
            weights,
            b.draft,
            b.q_rows,
            vocab_size=self.fingerprint.vocab_size,
            greedy=self.cfg.sampling.greedy,
            rng=self.rng,
            how=self.cfg.reconstruction,
            want_bonus=want_bonus,
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
        gamma = len(b.draft)
        st.rounds += 1
        st.draft_tokens += gamma
        st.accepted_tokens += d.accepted
        st.count_accepted(d.accepted, gamma)
        self.gen.commit(b.draft[: d.accepted])
        if d.rejected:
            assert d.token is not None
            st.rejections += 1
            self._discard_inflight()
            st.recovered_tokens += 1
            self.gen.commit([d.token])
        elif d.token is not None and not self.gen.done:
            st.bonus_tokens += 1
            self.gen.commit([d.token])


class _NoTransport:
    """Placeholder: a federated session talks through its worker links."""

    async def send(self, data: bytes) -> None:
        raise RuntimeError("federated sessions send through worker links")

    async def recv(self) -> bytes:
        raise RuntimeError("federated sessions receive through worker links")

    async def close(self) -> None:
        return None


async def generate_federated(
    drafter: Drafter,
    model_worker: ModelWorker,
    fingerprint: Fingerprint,
    workers: list[WorkerSpec],
    prompt: list[int],
    cfg: PipelineConfig,
    *,
    max_new_tokens: int,
    eos_ids: list[int] | tuple[int, ...] = (),
    seed: int | None = None,
    on_commit: Callable[[list[int]], None] | None = None,
    deadline_s: float = 5.0,
    no_worker_timeout_s: float = 30.0,
) -> tuple[Generation, FederationStats]:
    """One federated generation; raises LinkClosed when no worker is reachable for too long."""
    gen = Generation(prompt, max_new_tokens, eos_ids, on_commit)
    session = FederatedSession(
        gen,
        drafter,
        model_worker,
        workers,
        fingerprint,
        cfg,
        np.random.default_rng(seed),
        deadline_s=deadline_s,
        no_worker_timeout_s=no_worker_timeout_s,
        seed=seed,
    )
    await session.run()
    return gen, session.fed
