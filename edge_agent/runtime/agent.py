"""The edge agent: one draft model, its verifier link(s), generations that survive lost links.

:meth:`EdgeAgent.run` runs one generation. With one verifier it connects (Hello/Welcome with the
fingerprint check), runs a :class:`~edge_agent.session.core.SingleCore` over the link
(:func:`~edge_agent.link.driver.run_single`) and, when the link drops or desynchronises, reconnects
with the :class:`~edge_agent.session.retry.RetryPolicy` backoff and resumes from the committed ids
(the new session's first Propose carries them all as fixed tokens, so the verifier re-prefills).
With a federation it hands the generation to :func:`~edge_agent.link.federation.run_federated`,
which reconnects each worker by the same policy. Committed text is never lost or duplicated: only
the :class:`~edge_agent.session.generation.Generation` holds it, and a session only ever appends
to it.

What the run does reaches its caller as events (:data:`AgentEvent`), in order: the sessions'
:class:`Committed` and :class:`Finished`, each session's first :class:`RoundTrip`, every failed
session (:class:`SessionFailed`, its cause a :class:`WaitCause`), every session's own
:class:`Welcomed`, and last, however the run ends, one :class:`Ended` with the generation's
:class:`Summary`. :class:`Run` is a generation the caller does not hold: it can only stop it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from edge_agent.link.connection import TokenRefused, VerifierBusy
from edge_agent.link.driver import VerdictTimeout, handshake, run_single
from edge_agent.link.federation import WorkerSpec, run_federated
from edge_agent.link.timed import TimedTransport
from edge_agent.model.drafter import DraftModel, DraftRow
from edge_agent.model.tasks import ModelWorker, run_within
from edge_agent.runtime.events import RoundTrip
from edge_agent.session.core import SingleCore
from edge_agent.session.events import Committed, Finished, GenerationEvent
from edge_agent.session.federation_core import ROUND_DEADLINE_S
from edge_agent.session.generation import Generation, Summary, TokenSource
from edge_agent.session.opening import (
    ContextExceeded,
    DesyncError,
    HandshakeError,
    VerifierError,
    fit_context,
    hello_for,
)
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.retry import GiveUp, LinkDownPolicy, Outage, RetryPolicy, WaitCause
from edge_agent.session.transport import LinkClosed, Transport, announced_welcome
from shared.errors import FATAL_CODES, ErrorCode
from shared.wire.codec import encode
from shared.wire.messages import Fingerprint, Hello, Resume
from shared.wire.packing import ProtocolError

__all__ = [
    "AgentEvent",
    "Connect",
    "ContextExceeded",
    "EdgeAgent",
    "Ended",
    "HandshakeError",
    "RetryPolicy",
    "Run",
    "SessionFailed",
    "VerifierWaitOver",
    "Welcomed",
]

#: A connection attempt made at the very end of the wait still gets this long (so the wait's
#: last attempt is a real one): the bound is overrun by at most this much.
MIN_ATTEMPT_S = 0.5


class VerifierWaitOver(LinkClosed):
    """The request waited its whole bound (``RetryPolicy.deadline_s``, the daemon's
    ``verifier_wait``) for a verifier without progress. ``retry_after``: whole seconds after
    which a client may try again; ``waited``: the seconds waited; ``cause``: what the last
    attempt met (busy, down, stalled); ``busy_retry_after``: a busy verifier's own Retry-After
    (seconds), when that is what it met."""

    def __init__(
        self,
        message: str,
        *,
        retry_after: int,
        waited: float,
        cause: WaitCause | None = None,
        detail: str = "",
        busy_retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.waited = waited
        self.cause = cause
        self.detail = detail
        self.busy_retry_after = busy_retry_after


@dataclass(frozen=True)
class SessionFailed:
    """A verifier session came to nothing and the run will try again (or give up):
    ``cause`` what it met, ``detail`` the error's words, ``retry_after`` a busy verifier's
    Retry-After (seconds)."""

    cause: WaitCause
    detail: str
    retry_after: float | None = None


@dataclass(frozen=True)
class Welcomed:
    """A session's own Welcome came (told once the session is over): its context bounds the
    link's (a verifier's Ready may announce the model's limit where its sessions get less)."""

    max_context: int


@dataclass(frozen=True)
class Ended:
    """The run is over, however it ended (finished, failed, cancelled): what it did."""

    summary: Summary


#: Everything a run tells its caller, in order.
AgentEvent = Committed | Finished | RoundTrip | SessionFailed | Welcomed | Ended
Listener = Callable[[AgentEvent], None]


def _resume_token(core: SingleCore | None, known: str | None) -> str | None:
    """The token to resume a failed session with: its Welcome's, once that came."""
    if core is not None and core.resume_token is not None:
        return core.resume_token
    return known


log = logging.getLogger("wanspec.edge")

Connect = Callable[[], Awaitable[Transport]]


class EdgeAgent:
    """Holds the draft model and its worker; runs generations against a verifier. With no
    draft model (``drafter`` None), generations are cloud-only speculative decoding: the
    verifier's co-generation, with its own cloud drafts, writes the text (one verifier, and
    ``PipelineConfig.cogen`` on)."""

    def __init__(
        self,
        drafter: DraftModel | None,
        fingerprint: Fingerprint,
        connect: Connect,
        *,
        retry: RetryPolicy | None = None,
        worker: ModelWorker | None = None,
        federation: Sequence[WorkerSpec] = (),
        round_deadline_s: float = ROUND_DEADLINE_S,
    ) -> None:
        """``federation``: two or more verifiers that all verify every draft (SpecFed mode,
        :mod:`edge_agent.link.federation`); ``connect`` is then unused."""
        if drafter is None and federation:
            raise ValueError("federated verification needs a draft model on the edge")
        self.drafter = drafter
        self.fingerprint = fingerprint
        self.connect = connect
        self.retry = retry or RetryPolicy()
        self.worker = worker or ModelWorker("draft-model")
        self._owns_worker = worker is None
        self.federation = list(federation)
        self.round_deadline_s = round_deadline_s

    def close(self) -> None:
        if self._owns_worker:
            self.worker.close()

    def hello(
        self, cfg: PipelineConfig, seed: int | None, end: int = 0, resume: Resume | None = None
    ) -> Hello:
        """``end``: the position the generation stops at, at the latest (co-generation);
        ``resume``: the lost session to pick up."""
        return hello_for(self.fingerprint, cfg, seed, end=end, resume=resume)

    async def generate(
        self,
        prompt: Sequence[int],
        cfg: PipelineConfig,
        *,
        max_tokens: int,
        eos_ids: Sequence[int] = (),
        seed: int | None = None,
        on_event: Listener | None = None,
    ) -> Generation:
        """Generate until an end-of-sequence id or ``max_tokens``; returns the Generation
        (the Python API's; a caller that streams uses :class:`Run`). ``on_event``: as
        :meth:`run`'s."""
        gen = _generation(prompt, cfg, max_tokens, eos_ids)
        await self.run(gen, cfg, seed=seed, on_event=on_event)
        return gen

    def start(
        self,
        prompt: Sequence[int],
        cfg: PipelineConfig,
        *,
        max_tokens: int,
        eos_ids: Sequence[int] = (),
        seed: int | None = None,
        retry: RetryPolicy | None = None,
    ) -> Run:
        """A generation to run (:meth:`Run.go`) and to stop, whose state stays the agent's."""
        return Run(self, _generation(prompt, cfg, max_tokens, eos_ids), cfg, seed, retry)

    async def run(
        self,
        gen: Generation,
        cfg: PipelineConfig,
        *,
        seed: int | None = None,
        retry: RetryPolicy | None = None,
        on_event: Listener | None = None,
    ) -> None:
        """Run ``gen`` until it is done: its committed ids and stats survive a cancellation,
        and ``gen.finish(reason)`` (:meth:`Run.stop`) ends the run cleanly after the current
        verdict. ``retry``: this run's policy instead of the agent's (e.g. a short deadline
        while the link is known to be down). ``on_event`` is handed every :data:`AgentEvent`
        of the run but :class:`Ended` (:meth:`Run.go`'s), in order: the Committed and Finished
        events of the sessions and of the draft-only fallback among them."""
        policy = retry or self.retry
        tell = _Teller(on_event)
        rng = np.random.default_rng(seed)
        if self.drafter is None and not cfg.cogen:
            raise ValueError("with no draft model the verifier writes the text: cogen must be on")
        cached_prefix = getattr(self.drafter, "cached_prefix", None)
        if cached_prefix is not None and not gen.generated:
            # (on the model worker: the draft's cache is the worker's)
            reused = await self.worker.run(cached_prefix, gen.committed)
            gen.stats.draft_prompt_cached_tokens = int(reused)
        if self.federation:
            assert self.drafter is not None  # __init__
            await run_federated(
                gen,
                cfg,
                rng,
                drafter=self.drafter,
                worker=self.worker,
                fingerprint=self.fingerprint,
                workers=[_timed(spec, tell) for spec in self.federation],
                retry=policy,
                deadline_s=self.round_deadline_s,
                seed=seed,
                on_event=on_event,
            )
            return
        jitter = random.Random(seed)
        outage = Outage(policy)  # the one bound on waiting for a verifier
        session_no = 0
        #: The last session's resume token, while resuming it may help (a lost connection).
        resume_token: str | None = None
        while not gen.done:
            # Each session gets its own verifier seed, derived from the generation's seed, so a
            # seeded run is reproducible whatever the reconnects.
            vseed = None if seed is None else (seed * 1_000_003 + session_no) % 2**63
            session_no += 1
            committed_before = len(gen.committed)
            began = _now()
            transport: Transport | None = None
            core: SingleCore | None = None
            try:
                transport = TimedTransport(await self._connect(outage, policy), tell.rtt)
                resume = None
                if resume_token is not None:
                    resume = Resume(resume_token, len(gen.committed))
                resume_token = None
                welcome = None if resume is not None else announced_welcome(transport)
                provisional = welcome is not None
                if welcome is not None:
                    # The connection's Ready says the verifier's context: the generation
                    # stops there ("length"), before its Hello names where it ends.
                    tell(fit_context(gen, welcome.max_context))
                    if gen.done:
                        return
                hello = self.hello(cfg, vseed, gen.end, resume)
                if welcome is None:
                    timeout = policy.handshake_timeout_s
                    if policy.link_down == LinkDownPolicy.WAIT and outage.waiting:
                        timeout = min(timeout, max(MIN_ATTEMPT_S, outage.remaining(_now())))
                    welcome = await handshake(transport, hello, timeout, gen.stats)
                    resume_token = welcome.resume
                    tell(fit_context(gen, welcome.max_context))
                    if gen.done:
                        return
                else:
                    # Zero round trips: the Hello leaves with the first Propose; the session's
                    # own Welcome (or its refusal) is its first frame back.
                    await transport.send(encode(hello))
                if len(gen.committed) > welcome.max_fixed:
                    raise HandshakeError(
                        f"{len(gen.committed)} committed tokens exceed the verifier's limit of "
                        f"{welcome.max_fixed} fixed tokens per Propose"
                    )
                core = SingleCore(gen, cfg, rng, hello, welcome, provisional=provisional)
                await run_single(
                    core,
                    self.drafter,
                    self.worker,
                    transport,
                    verdict_timeout_s=policy.verdict_timeout_s,
                    on_event=on_event,
                )
            except TokenRefused:
                raise  # PermissionError is an OSError, but retrying a refused token is pointless
            except (DesyncError, ProtocolError, VerdictTimeout) as e:
                resume_token = None  # that session is not to be trusted or is stuck
                await self._failed(
                    gen, cfg, rng, outage, jitter, e, committed_before, _unopened(core, began), tell
                )
            except (LinkClosed, asyncio.TimeoutError, OSError) as e:
                resume_token = _resume_token(core, resume_token)
                await self._failed(
                    gen, cfg, rng, outage, jitter, e, committed_before, _unopened(core, began), tell
                )
            except VerifierError as e:
                if e.fatal and e.code in FATAL_CODES:
                    raise
                if e.code == ErrorCode.CONTEXT_FULL:
                    # fit_context keeps every frame within the verifier's context; should one
                    # pass it anyway, the text ends there: a new session would only be
                    # refused again (a reconnect loop that loses the text).
                    log.warning("the verifier's context is full (%s): the text ends here", e)
                    tell([gen.finish("length")])
                    return
                resume_token = _resume_token(core, resume_token)
                await self._failed(
                    gen, cfg, rng, outage, jitter, e, committed_before, _unopened(core, began), tell
                )
            finally:
                if transport is not None:
                    await transport.close()
                if core is not None and core.welcome is not None:
                    tell.one(Welcomed(core.welcome.max_context))

    async def _connect(self, outage: Outage, policy: RetryPolicy) -> Transport:
        """A session's transport. During a wait (under ``wait``), within what is left of its
        bound (at least :data:`MIN_ATTEMPT_S`): past it, a LinkClosed saying so. The first
        attempt is bounded by the link's own timeouts (``connect_timeout_s``)."""
        if policy.link_down != LinkDownPolicy.WAIT or not outage.waiting:
            return await self.connect()
        left = max(MIN_ATTEMPT_S, outage.remaining(_now()))
        done = await run_within(self.connect(), left)
        if done is None:
            raise LinkClosed(
                f"no connection to a verifier within the {left:.1f} s left of the wait"
            )
        return done.result()

    async def _failed(
        self,
        gen: Generation,
        cfg: PipelineConfig,
        rng: np.random.Generator,
        outage: Outage,
        jitter: random.Random,
        err: BaseException,
        committed_before: int,
        began: float | None,
        tell: _Teller,
    ) -> None:
        """A session failed: count it, give up by the policy, else pause before the next.

        One WARNING line when a wait for a verifier starts (the first failure since the run
        started or last made progress), one INFO line whenever what it meets changes (busy ↔
        down), DEBUG for the attempts between; the give-up is the caller's WARNING line. A
        busy verifier's refusal waits its Retry-After (jittered): busy is not down, but both
        count against the one bound."""
        busy = err if isinstance(err, VerifierBusy) else None
        if busy is None:
            gen.stats.reconnects += 1
        else:
            gen.stats.busy_refusals += 1
        progressed = len(gen.committed) > committed_before
        first = not outage.waiting or progressed
        before = outage.last
        now = _now()
        try:
            attempt = outage.failed(
                now,
                progressed=progressed,
                cause=str(err) or type(err).__name__,
                stalled=isinstance(err, VerdictTimeout),
                busy=busy is not None,
                retry_after=None if busy is None else busy.retry_after,
                began=began,
            )
        except GiveUp as e:
            raise VerifierWaitOver(
                str(e),
                retry_after=e.retry_after,
                waited=e.waited,
                cause=outage.last,
                detail=str(err),
                busy_retry_after=None if busy is None else busy.retry_after,
            ) from err
        policy = outage.policy
        delay = outage.pause(attempt, jitter, now)
        kind = outage.last
        assert kind is not None  # (outage.failed set it)
        tell.one(SessionFailed(kind, str(err), None if busy is None else busy.retry_after))
        if first:
            if policy.link_down == LinkDownPolicy.DRAFT_ONLY and self.drafter is not None:
                log.warning(
                    "no verifier (%s: %s); generating with the draft alone meanwhile", kind, err
                )
            else:
                log.warning(
                    "waiting for a verifier (%s: %s); giving up after %g s without progress",
                    kind,
                    err,
                    policy.deadline_s,
                )
        elif kind != before and kind in (WaitCause.BUSY, WaitCause.DOWN):
            log.info(
                "still waiting for a verifier, %.0f s of %g s: now %s (%s)",
                outage.waited(now),
                policy.deadline_s,
                kind,
                err,
            )
        else:
            log.debug(
                "verifier session failed (%s); next attempt %d in %.1f s", err, attempt, delay
            )
        await self._pause(gen, cfg, rng, policy, delay, tell)

    async def _pause(
        self,
        gen: Generation,
        cfg: PipelineConfig,
        rng: np.random.Generator,
        policy: RetryPolicy,
        delay: float,
        tell: _Teller,
    ) -> None:
        """Between reconnection attempts: wait, or (draft_only) generate with the draft alone
        (its commits are ``tell``'s, as a session's are its driver's)."""
        if policy.link_down != LinkDownPolicy.DRAFT_ONLY or self.drafter is None:
            await asyncio.sleep(delay)
            return
        deadline = time.monotonic() + delay
        deterministic = cfg.sampling.greedy
        while not gen.done:
            # The drafter's q is the best local guess; these tokens are flagged unverified.
            row = DraftRow(gen.committed, cfg.sampling, rng, deterministic)
            step = await self.worker.run(self.drafter.draft, row)
            tell(gen.commit([step.token], TokenSource.LOCAL_DRAFT))
            if time.monotonic() >= deadline:
                break


class Run:
    """One generation started by :meth:`EdgeAgent.start`. Its caller runs it (:meth:`go`),
    hears of it only through the events, and may stop it (a stop string in the text); the
    generation itself stays the agent's."""

    def __init__(
        self,
        agent: EdgeAgent,
        gen: Generation,
        cfg: PipelineConfig,
        seed: int | None,
        retry: RetryPolicy | None,
    ) -> None:
        self._agent, self._gen, self._cfg = agent, gen, cfg
        self._seed, self._retry = seed, retry

    def stop(self, reason: str = "stop") -> None:
        """End the generation after the current verdict (its text is cut where it stopped)."""
        if not self._gen.done:
            self._gen.finish(reason)

    async def go(self, on_event: Listener) -> None:
        """Run it to its end; ``on_event`` hears every :data:`AgentEvent`, the last an
        :class:`Ended`, told however the run ends (before what it raises propagates)."""
        try:
            await self._agent.run(
                self._gen, self._cfg, seed=self._seed, retry=self._retry, on_event=on_event
            )
        finally:
            on_event(Ended(self._gen.summary()))


class _Teller:
    """Hands events the agent itself produces (outside a session) to its listener."""

    def __init__(self, on_event: Listener | None) -> None:
        self.on_event = on_event

    def __call__(self, events: Sequence[GenerationEvent]) -> None:
        for event in events:
            self.one(event)

    def one(self, event: AgentEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def rtt(self, seconds: float) -> None:
        self.one(RoundTrip(seconds))


def _generation(
    prompt: Sequence[int], cfg: PipelineConfig, max_tokens: int, eos_ids: Sequence[int]
) -> Generation:
    """A new generation of ``prompt``, scored (its commits carry log-probabilities) exactly when
    ``cfg`` asks the verifier for them."""
    return Generation(prompt, max_tokens, eos_ids, scored=cfg.logprobs is not None)


def _timed(spec: WorkerSpec, tell: _Teller) -> WorkerSpec:
    """A federation member whose sessions report their first round trip to ``tell``."""
    inner = spec.connect

    async def connect() -> Transport:
        return TimedTransport(await inner(), tell.rtt)

    return replace(spec, connect=connect)


def _now() -> float:
    return time.monotonic()


def _unopened(core: SingleCore | None, began: float) -> float | None:
    """``began`` (when the session attempt began) if the session never opened (no Welcome
    came): its time was spent waiting for a verifier; None for one that opened."""
    return began if core is None or core.welcome is None else None
