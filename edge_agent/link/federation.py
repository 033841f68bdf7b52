"""The asyncio side of federated verification (SpecFed): one link task per worker, the drafter
and the round decider, all feeding one :class:`~edge_agent.session.federation_core.FederatedCore`.

Tasks and their owner (:func:`run_federated`): each worker's link task connects (with the same
:class:`~edge_agent.session.retry.RetryPolicy` backoff and handshake timeout as the single-verifier
agent,
honouring a busy verifier's Retry-After), tells the core, then reads frames into it and writes
the frames the core addressed to it until the link fails or the core drops it (a dead or
misbehaving member: a slow one is left out of rounds by the core, never dropped); then it backs
off and reconnects. The decider wakes whenever the core's state changes or its next deadline
(a round's wait bound, a member's liveness bound) passes, and carries out what is due. The
generation fails with :class:`LinkClosed` once no worker has been connected for the retry
deadline. Nothing committed is ever lost: a worker that rejoins re-prefills from the committed
ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from edge_agent.link.connection import LinkRefused, TokenRefused
from edge_agent.link.driver import Consumer, Outbox, Signal, draft_loop, handshake
from edge_agent.model.drafter import DraftModel
from edge_agent.model.tasks import ModelWorker, cancel_all, run_until_first_done
from edge_agent.session.branches import Rival
from edge_agent.session.events import (
    Committed,
    Count,
    Drop,
    EdgeEvent,
    Fail,
    FedCount,
    Finished,
    Measured,
    RejectionGap,
    Round,
    Send,
)
from edge_agent.session.federation_core import ROUND_DEADLINE_S, FederatedCore
from edge_agent.session.federation_members import FederationStats, WorkerParams
from edge_agent.session.generation import Generation
from edge_agent.session.opening import DesyncError, HandshakeError, VerifierError
from edge_agent.session.pipeline import DraftPlan
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.retry import RetryPolicy
from edge_agent.session.transport import LinkClosed, Transport, VerifierBusy
from shared.maths.sampling import Probs
from shared.wire.messages import Fingerprint
from shared.wire.packing import ProtocolError

log = logging.getLogger("wanspec.federation")


@dataclass(frozen=True)
class WorkerSpec:
    """One verifier of the federation: how to reach it and its place in the aggregate."""

    name: str
    connect: Callable[[], Awaitable[Transport]]
    weight: float = 1.0
    k: int = 10
    eps_target: float = 0.0

    @property
    def params(self) -> WorkerParams:
        return WorkerParams(self.name, self.weight, self.k, self.eps_target)

    def __post_init__(self) -> None:
        self.params  # noqa: B018  # validates weight, k and eps_target now


class _Federation:
    """The tasks of one federated generation around its core."""

    def __init__(
        self,
        core: FederatedCore,
        specs: Sequence[WorkerSpec],
        drafter: DraftModel,
        worker: ModelWorker,
        retry: RetryPolicy,
        seed: int | None,
        on_event: Consumer | None,
    ) -> None:
        self.core = core
        #: The federation's measurements, counted from the core's events.
        self.fed = FederationStats(eps_sum=[0.0] * len(core.workers))
        self.on_event = on_event
        self.specs = list(specs)
        self.drafter = drafter
        self.worker = worker
        self.retry = retry
        self.signal = Signal()
        self.io: dict[int, Outbox] = {}
        self._jitter = random.Random(seed)
        #: The last reason each worker was unavailable (named when the generation gives up).
        self.causes: dict[int, str] = {}
        self.gave_up: set[int] = set()  # workers whose failure waiting cannot clear

    def _emit(self, events: list[EdgeEvent]) -> None:
        for event in events:
            if isinstance(event, (Committed, Finished)):
                if self.on_event is not None:
                    self.on_event(event)
                continue
            if isinstance(event, (Count, Round, RejectionGap)):
                self.core.gen.stats.apply(event)
                continue
            if isinstance(event, (FedCount, Measured)):
                self.fed.apply(event)
                continue
            if isinstance(event, Fail):  # the federated core drops workers instead
                raise AssertionError(f"{event} from the federated core")
            io = self.io.get(event.link)
            if io is None:
                continue  # the link went down meanwhile: its worker re-syncs when it rejoins
            if isinstance(event, Drop):
                io.drop(event.why)
            elif isinstance(event, Send):
                try:
                    io.write(event.msg)
                except LinkClosed as e:
                    self._emit(self.core.link_down(event.link, str(e), time.monotonic()))
                    io.drop(str(e))
        self.signal.notify()

    def _submit(
        self, plan: DraftPlan, draft: list[int], q_rows: list[Probs], rivals: list[Rival]
    ) -> None:
        """Hand a drafted batch to the core (federated rounds take no hedges: ``rivals``
        are not used)."""
        self._emit(self.core.propose(plan, draft, q_rows, time.monotonic()))

    async def _link(self, index: int) -> None:
        """Owns worker ``index``'s connection: (re)connect with backoff, then serve it."""
        spec, core = self.specs[index], self.core
        attempt = 0
        while not core.gen.done:
            try:
                transport = await spec.connect()
            except (TokenRefused, LinkRefused) as e:
                self._give_up_on(spec, index, e)
                return
            except (LinkClosed, OSError, asyncio.TimeoutError) as e:
                attempt += 1
                await self._backoff(spec, index, attempt, e)
                continue
            try:
                hello = core.hello(index)
                welcome = await handshake(transport, hello, self.retry.handshake_timeout_s)
            except HandshakeError as e:
                await transport.close()
                self._give_up_on(spec, index, e)
                return
            except (LinkClosed, OSError, asyncio.TimeoutError, DesyncError, VerifierError) as e:
                await transport.close()
                attempt += 1
                await self._backoff(spec, index, attempt, e)
                continue
            except BaseException:
                await transport.close()
                raise
            news = core.link_up(index, welcome, time.monotonic())
            io = Outbox(
                transport, core.ctx(index), core.gen.stats, max_queued=core.cfg.send_queue_bound
            )
            self.io[index] = io
            self._emit(news)
            why = "dropped"
            try:
                await run_until_first_done(self._read(index, io), io.writer(), io.until_dropped())
                why = io.why  # the core dropped it (a missed deadline, a bad frame, ...)
            except (LinkClosed, ProtocolError) as e:
                why = str(e) or type(e).__name__
            finally:
                self.causes[index] = why
                self.io.pop(index, None)
                if not core.gen.done:  # the end of the generation is no drop
                    self._emit(core.link_down(index, why, time.monotonic()))
                self.signal.notify()
                with contextlib.suppress(Exception):
                    await transport.close()
            # Never reconnect at once: a session that answered something starts the backoff
            # afresh, one that answered nothing (it erred or stalled at once) backs off further.
            attempt = 1 if core.workers[index].answered else attempt + 1
            if not core.gen.done:
                await self._backoff(spec, index, attempt, LinkClosed(why))

    def _give_up_on(self, spec: WorkerSpec, index: int, err: BaseException) -> None:
        """A failure that waiting cannot clear: this worker stays down for the generation."""
        self.causes[index] = f"{err} (not retried)"
        self.gave_up.add(index)
        log.error("worker %s: %s; not retrying it", spec.name, err)
        self.signal.notify()

    async def _backoff(
        self, spec: WorkerSpec, index: int, attempt: int, err: BaseException
    ) -> None:
        self.causes[index] = str(err) or type(err).__name__
        busy = err.retry_after if isinstance(err, VerifierBusy) else None
        delay = self.retry.delay(attempt, self._jitter, busy)
        log.info("worker %s unavailable (%s); retry in %.1fs", spec.name, err, delay)
        await asyncio.sleep(delay)

    async def _read(self, index: int, io: Outbox) -> None:
        while True:
            data = await io.transport.recv()
            self._emit(self.core.receive(index, data, time.monotonic()))

    async def _decide_loop(self) -> None:
        """Carry out what the core says is due (a round to decide, a silent member to drop),
        waking on every change of its state and at its next deadline."""
        core = self.core
        while not core.gen.done:
            if core.round_ready(time.monotonic()):
                self._emit(core.decide(time.monotonic()))
                await asyncio.sleep(0)  # let the writers and the drafter run
                continue
            wake = core.wake_at()
            timeout = None if wake is None else max(0.0, wake - time.monotonic())

            def changed(wake: float | None = wake) -> bool:
                # A new head, a first reply or a new frame moves the next deadline: wait anew.
                return core.gen.done or core.wake_at() != wake or core.round_ready(time.monotonic())

            with contextlib.suppress(asyncio.TimeoutError):
                await self.signal.wait_for(changed, timeout)

    async def _watch_workers(self) -> None:
        """Fail the generation once no worker has been connected for the retry deadline."""
        core = self.core
        while not core.gen.done:
            if len(self.gave_up) == len(self.specs):
                causes = "; ".join(f"{self.specs[i].name}: {c}" for i, c in self.causes.items())
                raise HandshakeError(f"no verifier can be used: {causes}")
            since = core.none_up_since
            if since is None:
                await self.signal.wait_for(
                    lambda: (
                        core.gen.done
                        or core.none_up_since is not None
                        or len(self.gave_up) == len(self.specs)
                    )
                )
                continue
            left = since + self.retry.deadline_s - time.monotonic()
            if left <= 0:
                causes = "; ".join(
                    f"{self.specs[i].name}: {c}" for i, c in sorted(self.causes.items())
                )
                raise LinkClosed(
                    f"no verifier reachable for {time.monotonic() - since:.0f} s "
                    f"(deadline {self.retry.deadline_s:g} s); last: {causes or 'none answered'}"
                )

            def changed(since: float = since) -> bool:
                return core.none_up_since != since

            def changed_or_hopeless(since: float = since) -> bool:
                return changed(since) or len(self.gave_up) == len(self.specs)

            with contextlib.suppress(asyncio.TimeoutError):
                await self.signal.wait_for(changed_or_hopeless, left)

    async def run(self) -> None:
        core = self.core
        if core.gen.done:
            return
        core.none_up_since = time.monotonic()
        links = [asyncio.ensure_future(self._link(i)) for i in range(len(self.specs))]
        try:
            # Start with every worker that connects within a round's least wait, so the first
            # rounds are not decided by whichever worker happened to answer first (every
            # member connected before the first decision starts in step).
            with contextlib.suppress(asyncio.TimeoutError):
                await self.signal.wait_for(core.all_connected, core.deadline_s)
            await run_until_first_done(
                draft_loop(core, self.drafter, self.worker, self.signal, self._submit),
                self._decide_loop(),
                self._watch_workers(),
            )
        finally:
            await cancel_all(links)


async def run_federated(
    gen: Generation,
    cfg: PipelineConfig,
    rng: np.random.Generator,
    *,
    drafter: DraftModel,
    worker: ModelWorker,
    fingerprint: Fingerprint,
    workers: Sequence[WorkerSpec],
    retry: RetryPolicy,
    deadline_s: float = ROUND_DEADLINE_S,
    seed: int | None = None,
    on_event: Consumer | None = None,
) -> FederationStats:
    """Run ``gen`` verified by ``workers`` until done; returns the federation's measurements
    (also set on ``gen.federation`` as soon as the run starts).

    ``deadline_s``: the least time a round waits, once one member has answered it, for the
    other in-step members (it waits up to max(this, 4 × that first answer's round time));
    a member that misses it is left out of the rounds, not dropped
    (:mod:`edge_agent.session.federation_core`). A member is dead, and dropped, only when silent
    past
    the liveness bound whose floor is ``retry.verdict_timeout_s``, as a single verifier is.
    ``on_event`` is handed the generation's Committed and Finished events as they come."""
    core = FederatedCore(
        gen,
        cfg,
        rng,
        fingerprint,
        [w.params for w in workers],
        deadline_s=deadline_s,
        liveness_s=retry.verdict_timeout_s,
        seed=seed,
    )
    federation = _Federation(core, workers, drafter, worker, retry, seed, on_event)
    gen.federation = federation.fed
    await federation.run()
    return federation.fed


async def generate_federated(
    drafter: DraftModel,
    model_worker: ModelWorker,
    fingerprint: Fingerprint,
    workers: list[WorkerSpec],
    prompt: list[int],
    cfg: PipelineConfig,
    *,
    max_tokens: int,
    eos_ids: list[int] | tuple[int, ...] = (),
    seed: int | None = None,
    on_event: Consumer | None = None,
    deadline_s: float = ROUND_DEADLINE_S,
    no_worker_timeout_s: float = 30.0,
    liveness_s: float = 10.0,
) -> tuple[Generation, FederationStats]:
    """One federated generation; raises LinkClosed when no worker is reachable for too long.
    ``deadline_s`` and ``liveness_s``: see :func:`run_federated` (``liveness_s`` is the
    retry policy's ``verdict_timeout_s``)."""
    gen = Generation(prompt, max_tokens, eos_ids)
    fed = await run_federated(
        gen,
        cfg,
        np.random.default_rng(seed),
        drafter=drafter,
        worker=model_worker,
        fingerprint=fingerprint,
        workers=workers,
        retry=RetryPolicy(
            backoff_initial_s=0.5, deadline_s=no_worker_timeout_s, verdict_timeout_s=liveness_s
        ),
        deadline_s=deadline_s,
        seed=seed,
        on_event=on_event,
    )
    return gen, fed
