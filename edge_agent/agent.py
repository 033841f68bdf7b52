"""The edge agent: one draft model, its verifier link(s), generations that survive lost links.

:meth:`EdgeAgent.run` runs one generation. With one verifier it connects (Hello/Welcome with the
fingerprint check), runs a :class:`~shared.edge_core.SingleCore` over the link
(:func:`~edge_agent.pipeline.run_single`) and, when the link drops or desynchronises, reconnects
with the :class:`~shared.retry.RetryPolicy` backoff and resumes from the committed ids (the new
session's first Propose carries them all as fixed tokens, so the verifier re-prefills). With a
federation it hands the generation to :func:`~edge_agent.federation.run_federated`, which
reconnects each worker by the same policy. Committed text is never lost or duplicated: only the
:class:`~shared.generation.Generation` holds it, and a session only ever appends to it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from edge_agent.drafter import Drafter
from edge_agent.federation import WorkerSpec, run_federated
from edge_agent.link import AuthError
from edge_agent.pipeline import VerdictTimeout, handshake, run_single
from edge_agent.tasks import ModelWorker
from edge_agent.transport import LinkClosed, Transport
from shared.edge_core import (
    FATAL_CODES,
    DesyncError,
    HandshakeError,
    SingleCore,
    VerifierError,
    hello_for,
)
from shared.generation import Generation
from shared.pipeline_config import PipelineConfig
from shared.protocol import Fingerprint, Hello, ProtocolError
from shared.retry import GiveUp, LinkDownPolicy, Outage, RetryPolicy

__all__ = ["Connect", "EdgeAgent", "HandshakeError", "RetryPolicy"]

log = logging.getLogger("wanspec.edge")

Connect = Callable[[], Awaitable[Transport]]


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
        on_session_failed: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``federation``: two or more verifiers that all verify every draft (SpecFed mode,
        :mod:`edge_agent.federation`); ``connect`` is then unused. ``on_session_failed`` hears
        of every session that fails and is retried (a stalled or lost link)."""
        self.drafter = drafter
        self.fingerprint = fingerprint
        self.connect = connect
        self.retry = retry or RetryPolicy()
        self.worker = worker or ModelWorker("draft-model")
        self._owns_worker = worker is None
        self.federation = list(federation)
        self.round_deadline_s = round_deadline_s
        self.on_session_failed = on_session_failed

    def close(self) -> None:
        if self._owns_worker:
            self.worker.close()

    def hello(self, cfg: PipelineConfig, seed: int | None, end: int = 0) -> Hello:
        """``end``: the position the generation stops at, at the latest (co-generation)."""
        return hello_for(self.fingerprint, cfg, seed, end=end)

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
            await run_federated(
                gen,
                cfg,
                rng,
                drafter=self.drafter,
                worker=self.worker,
                fingerprint=self.fingerprint,
                workers=self.federation,
                retry=self.retry,
                deadline_s=self.round_deadline_s,
                seed=seed,
            )
            return
        jitter = random.Random(seed)
        outage = Outage(self.retry)
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
                hello = self.hello(cfg, vseed, len(gen.committed) + gen.room)
                welcome = await handshake(transport, hello, self.retry.handshake_timeout_s)
                if len(gen.committed) > welcome.max_fixed:
                    raise HandshakeError(
                        f"{len(gen.committed)} committed tokens exceed the verifier's limit of "
                        f"{welcome.max_fixed} fixed tokens per Propose"
                    )
                core = SingleCore(gen, cfg, rng, hello, welcome)
                await run_single(
                    core,
                    self.drafter,
                    self.worker,
                    transport,
                    verdict_timeout_s=self.retry.verdict_timeout_s,
                )
            except AuthError:
                raise  # PermissionError is an OSError, but retrying a refused token is pointless
            except (LinkClosed, DesyncError, ProtocolError, asyncio.TimeoutError, OSError) as e:
                await self._failed(gen, cfg, rng, outage, jitter, e, committed_before)
            except VerifierError as e:
                if e.fatal and e.code in FATAL_CODES:
                    raise
                await self._failed(gen, cfg, rng, outage, jitter, e, committed_before)
            finally:
                if transport is not None:
                    await transport.close()

    async def _failed(
        self,
        gen: Generation,
        cfg: PipelineConfig,
        rng: np.random.Generator,
        outage: Outage,
        jitter: random.Random,
        err: BaseException,
        committed_before: int,
    ) -> None:
        """A session failed: count it, give up by the policy, else pause before the next."""
        gen.stats.reconnects += 1
        if self.on_session_failed is not None:
            self.on_session_failed(err)
        try:
            attempt = outage.failed(
                time.monotonic(),
                progressed=len(gen.committed) > committed_before,
                cause=str(err) or type(err).__name__,
                stalled=isinstance(err, VerdictTimeout),
            )
        except GiveUp as e:
            raise LinkClosed(str(e)) from err
        log.warning("verifier session lost (%s); reconnecting (attempt %d)", err, attempt)
        await self._pause(gen, cfg, rng, self.retry.delay(attempt, jitter))

    async def _pause(
        self, gen: Generation, cfg: PipelineConfig, rng: np.random.Generator, delay: float
    ) -> None:
        """Between reconnection attempts: wait, or (draft_only) generate with the draft alone."""
        if self.retry.link_down != LinkDownPolicy.DRAFT_ONLY:
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
