"""The edge agent: one draft model, one verifier link, generations that survive lost connections.

:meth:`EdgeAgent.generate` runs one generation: it connects (Hello/Welcome with the fingerprint
check), runs the pipeline (:class:`~edge_agent.pipeline.SpeculativeSession`) and, when the link
drops or desynchronises, reconnects with exponential backoff and resumes from the committed ids
(the new session's first Propose carries them all as fixed tokens, so the verifier re-prefills).
Committed text is never lost or duplicated: only :class:`Generation` holds it, and a session only
ever appends to it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edge_agent.drafter import Drafter
from edge_agent.link import AuthError
from edge_agent.pipeline import (
    STOP_AND_WAIT,
    DesyncError,
    Generation,
    PipelineConfig,
    SpeculativeSession,
    VerifierError,
)
from edge_agent.tasks import ModelWorker
from edge_agent.transport import LinkClosed, Transport

if TYPE_CHECKING:
    from edge_agent.federation import WorkerSpec
from shared.protocol import (
    CorrectionMode,
    Error,
    Fingerprint,
    Hello,
    ProtocolError,
    ReplyMode,
    Welcome,
    WireContext,
    decode,
    encode,
)

log = logging.getLogger("wanspec.edge")

Connect = Callable[[], Awaitable[Transport]]

LINK_DOWN_POLICIES = ("wait", "draft_only")

#: Error codes after which reconnecting cannot help.
FATAL_CODES = frozenset({"fingerprint_mismatch", "unauthorized", "bad_hello", "unsupported"})


@dataclass
class _Outage:
    """Consecutive failed sessions of one generation, and since when."""

    failures: int = 0
    since: float | None = None


class HandshakeError(RuntimeError):
    """The verifier refused the session (e.g. a different tokenizer). Not retried."""


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 1000  # consecutive failed sessions before giving up
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    handshake_timeout_s: float = 30.0
    #: Link-down policy: "wait" retries with backoff, and fails the generation once no session
    #: has made progress for ``deadline_s``; "draft_only" keeps generating with the draft alone
    #: between reconnection attempts (those tokens are flagged unverified) and re-syncs the
    #: verifier from the committed text when it is back.
    link_down: str = "wait"
    deadline_s: float = 60.0

    def __post_init__(self) -> None:
        if self.link_down not in LINK_DOWN_POLICIES:
            raise ValueError(
                f"link_down must be one of {', '.join(LINK_DOWN_POLICIES)}, got {self.link_down!r}"
            )
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {self.deadline_s}")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Exponential backoff with full jitter."""
        cap = min(self.backoff_max_s, self.backoff_initial_s * 2 ** max(0, attempt - 1))
        return rng.uniform(cap / 2, cap)


async def handshake(transport: Transport, hello: Hello, timeout_s: float) -> Welcome:
    """Send Hello, await Welcome. Raises HandshakeError for a refusal the user must act on."""
    await transport.send(encode(hello))
    data = await asyncio.wait_for(transport.recv(), timeout_s)
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


class EdgeAgent:
    """Holds the draft model and its worker; runs generations against a verifier."""

    def __init__(
        self,
        drafter: Drafter,
        fingerprint: Fingerprint,
        connect: Connect,
        *,
        retry: RetryPolicy | None = None,
        worker: ModelWorker | None = None,
        federation: Sequence[WorkerSpec] = (),
        round_deadline_s: float = 5.0,
    ) -> None:
        """``federation``: two or more verifiers that all verify every draft (SpecFed mode,
        :mod:`edge_agent.federation`); ``connect`` is then unused."""
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

    def hello(self, cfg: PipelineConfig, seed: int | None) -> Hello:
        return Hello(
            fingerprint=self.fingerprint,
            sampling=cfg.sampling,
            reply_mode=ReplyMode.VERDICT,
            correction=cfg.wire_correction,
            bonus=cfg.mode == STOP_AND_WAIT,
            seed=seed,
        )

    async def generate(
        self,
        prompt: Sequence[int],
        cfg: PipelineConfig,
        *,
        max_new_tokens: int,
        eos_ids: Sequence[int] = (),
        seed: int | None = None,
        on_commit: Callable[[list[int]], None] | None = None,
    ) -> Generation:
        """Generate until an end-of-sequence id or ``max_new_tokens``; returns the Generation."""
        gen = Generation(prompt, max_new_tokens, eos_ids, on_commit)
        await self.run(gen, cfg, seed=seed)
        return gen

    async def run(self, gen: Generation, cfg: PipelineConfig, *, seed: int | None = None) -> None:
        """Run ``gen`` until it is done. The caller keeps ``gen``: its committed ids and stats
        survive a cancellation, and ``gen.finish(reason)`` (e.g. from ``on_commit``, on a stop
        string) ends the run cleanly after the current verdict."""
        rng = np.random.default_rng(seed)
        if self.federation:
            await self._run_federated(gen, cfg, rng, seed)
            return
        jitter = random.Random(seed)
        outage = _Outage()
        session_no = 0
        while not gen.done:
            # Each session gets its own verifier seed, derived from the generation's seed, so a
            # seeded run is reproducible whatever the reconnects.
            vseed = None if seed is None else (seed * 1_000_003 + session_no) % 2**63
            session_no += 1
            committed_before = len(gen.committed)
            transport: Transport | None = None
            try:
                transport = await self.connect()
                hello = self.hello(cfg, vseed)
                welcome = await handshake(transport, hello, self.retry.handshake_timeout_s)
                ctx = WireContext(
                    vocab_size=self.fingerprint.vocab_size,
                    max_gamma=welcome.max_gamma,
                    max_fixed=welcome.max_fixed,
                    max_frame=welcome.max_frame,
                    draft_probs=hello.correction != CorrectionMode.GREEDY_DRAFT,
                )
                if len(gen.committed) > welcome.max_fixed:
                    raise HandshakeError(
                        f"{len(gen.committed)} committed tokens exceed the verifier's limit of "
                        f"{welcome.max_fixed} fixed tokens per Propose"
                    )
                session = SpeculativeSession(
                    gen,
                    self.drafter,
                    self.worker,
                    transport,
                    ctx,
                    cfg,
                    rng,
                    max_gamma=welcome.max_gamma,
                )
                await session.run()
            except AuthError:
                raise  # PermissionError is an OSError, but retrying a refused token is pointless
            except (LinkClosed, DesyncError, ProtocolError, asyncio.TimeoutError, OSError) as e:
                self._failed(gen, outage, e, committed_before)
                await self._pause(gen, cfg, rng, self.retry.delay(outage.failures, jitter))
            except VerifierError as e:
                if e.fatal and e.code in FATAL_CODES:
                    raise
                self._failed(gen, outage, e, committed_before)
                await self._pause(gen, cfg, rng, self.retry.delay(outage.failures, jitter))
            finally:
                if transport is not None:
                    await transport.close()

    async def _run_federated(
        self, gen: Generation, cfg: PipelineConfig, rng: np.random.Generator, seed: int | None
    ) -> None:
        """SpecFed mode: the federated session reconnects workers itself; it gives up (raises
        LinkClosed) when none has been reachable for the retry deadline."""
        from edge_agent.federation import FederatedSession  # it imports this module

        session = FederatedSession(
            gen,
            self.drafter,
            self.worker,
            self.federation,
            self.fingerprint,
            cfg,
            rng,
            deadline_s=self.round_deadline_s,
            no_worker_timeout_s=self.retry.deadline_s,
            seed=seed,
        )
        gen.federation = session.fed
        await session.run()

    async def _pause(
        self, gen: Generation, cfg: PipelineConfig, rng: np.random.Generator, delay: float
    ) -> None:
        """Between reconnection attempts: wait, or (draft_only) generate with the draft alone."""
        if self.retry.link_down != "draft_only":
            await asyncio.sleep(delay)
            return
        deadline = time.monotonic() + delay
        deterministic = cfg.sampling.greedy
        while not gen.done:
            # The drafter's q is the best local guess; these tokens are flagged unverified.
            x, _ = await self.worker.run(
                self.drafter.draft, gen.committed, cfg.sampling, rng, deterministic=deterministic
            )
            gen.commit([x], verified=False)
            if time.monotonic() >= deadline:
                break

    def _failed(
        self, gen: Generation, outage: _Outage, err: BaseException, committed_before: int
    ) -> None:
        # A session that committed something ends the outage: progress is being made.
        now = time.monotonic()
        if len(gen.committed) > committed_before or outage.since is None:
            outage.failures, outage.since = 0, now
        outage.failures += 1
        gen.stats.reconnects += 1
        log.warning(
            "verifier session lost (%s); reconnecting (attempt %d)", err, outage.failures
        )
        if outage.failures > self.retry.max_attempts:
            raise LinkClosed(
                f"gave up after {outage.failures - 1} failed sessions: {err}"
            ) from err
        down_for = now - outage.since
        if self.retry.link_down == "wait" and down_for > self.retry.deadline_s:
            raise LinkClosed(
                f"no verifier reachable for {down_for:.0f} s (deadline {self.retry.deadline_s:g}"
                f" s); gave up: {err}"
            ) from err
