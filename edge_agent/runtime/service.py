"""The edge's runtime, shared by every front door (``edge-agent serve``'s HTTP APIs, the
``chat`` REPL, the CLI): one draft model (or, with ``draft = "none"``, the target family's
tokenizer alone: cloud-only speculation), one :class:`~edge_agent.runtime.agent.EdgeAgent`, up
to ``max_concurrent`` requests at once (their draft steps batched,
:mod:`edge_agent.model.batching`) and the rest waiting in arrival order
(:mod:`edge_agent.runtime.queue`), a warm link to each verifier (:mod:`edge_agent.link.warm`),
text streamed as it is committed, stop strings, metrics.

:meth:`EdgeService.stream` is the whole interface: one stream of typed events per request
(:mod:`edge_agent.runtime.events`), ending with one :class:`Finished` or one :class:`Failed`.
Leaving the iteration early (a client that disconnects) or cancelling the consuming task cancels
the generation and frees the request's place in the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import random
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from edge_agent.link.connection import LinkRefused, LinkSettings, TokenRefused, VerifierBusy
from edge_agent.link.federation import WorkerSpec
from edge_agent.link.tls import ssl_context
from edge_agent.link.warm import LinkLost, ModelMismatch, WarmLink
from edge_agent.model.batching import BatchingWorker
from edge_agent.model.drafter import Drafter
from edge_agent.model.tasks import ModelWorker, run_within
from edge_agent.runtime.agent import (
    AgentEvent,
    EdgeAgent,
    Ended,
    HandshakeError,
    RetryPolicy,
    Run,
    SessionFailed,
    VerifierWaitOver,
    Welcomed,
)
from edge_agent.runtime.context import ContextLimit
from edge_agent.runtime.events import (
    Failed,
    FailureKind,
    Finished,
    Partial,
    Piece,
    RoundTrip,
    RuntimeEvent,
    Waiting,
)
from edge_agent.runtime.loading import (
    device_line,
    load_draft_model,
    load_edge_tokenizer,
    pairing_setting,
    settings_place,
)
from edge_agent.runtime.metrics import EdgeMetrics
from edge_agent.runtime.monitor import LinkMonitor, VerifierLinkState
from edge_agent.runtime.queue import FairQueue, QueueFull, RequestTimeout, Slot
from edge_agent.runtime.report import result_json
from edge_agent.runtime.settings import NO_DRAFT, EdgeSettings, Fallback, read_secret_file
from edge_agent.runtime.text import StopScanner, TextStreamer, eos_ids
from edge_agent.session.events import Committed, TokenLogprob
from edge_agent.session.generation import Summary
from edge_agent.session.opening import ContextExceeded, VerifierError
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.retry import LinkDownPolicy, WaitCause
from edge_agent.session.transport import LinkClosed, Transport
from shared.errors import WanspecError
from shared.runtime.models import LoadedModel, LoadedTokenizer
from shared.runtime.pairing import mismatch_line

log = logging.getLogger("wanspec.edge.service")

#: The Retry-After of a 503 whose wait gave no better figure (a federation's give-up).
DEFAULT_RETRY_AFTER_S = 5


class VerifierUnavailable(WanspecError, RuntimeError):
    """No verifier could be used and no fallback is configured (HTTP 503). ``retry_after``:
    whole seconds after which the client may try again (None: retrying will not help, e.g. a
    refused configuration)."""

    def __init__(self, message: str, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PromptTooLong(WanspecError, ValueError):
    """The prompt does not fit the context of the verifier (found when its session opened:
    the API answers 400 ``context_length_exceeded``)."""


def seeded(cfg: PipelineConfig, seed: int | None) -> PipelineConfig:
    """A sampled request with a seed draws its random numbers in an order that does not
    depend on timing where it can: no co-generation (the verifier would draw for tokens of its
    own whenever no batch is queued) and no pre-drafted branches. With a fixed γ and one batch
    in flight the text is then the same for the same seed; with more in flight, or γ and D
    chosen online, how many batches are drafted before a rejection is timing again, so the
    seed is best effort (as OpenAI's)."""
    if seed is None or cfg.sampling.greedy:
        return cfg
    return dataclasses.replace(cfg, cogen=False, predraft=0, tree=False)


@dataclass(frozen=True)
class GenRequest:
    prompt_ids: list[int]
    pipeline: PipelineConfig
    max_tokens: int
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    #: The request's deadline in seconds, all waits included (None: request_timeout).
    timeout_s: float | None = None


def retry_policy(s: EdgeSettings) -> RetryPolicy:
    """fallback "none": a request fails (503 with Retry-After) once it has waited
    ``verifier_wait`` seconds for a verifier without progress, whether the verifier was down,
    busy or both in turn (a verifier restart takes a few); "draft": the agent's draft-only
    link-down policy, reconnecting in the background. A batch with no Verdict past its
    deadline (``verdict_timeout`` at least) rebuilds the session."""
    policy = LinkDownPolicy.DRAFT_ONLY if s.fallback == Fallback.DRAFT else LinkDownPolicy.WAIT
    return RetryPolicy(
        link_down=policy, deadline_s=s.verifier_wait, verdict_timeout_s=s.verdict_timeout
    )


class EdgeService:
    """The draft model, the agent, the request queue and the metrics of one process.

    ``loaded`` is what the edge holds of the model family (its tokenizer, vocabulary size and
    fingerprint): the draft model, or with ``draft = "none"`` the tokenizer alone, and then
    ``drafter`` stays None (the agent sends credits; the verifier writes the text)."""

    def __init__(self, settings: EdgeSettings, metrics: EdgeMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or EdgeMetrics()
        #: The TLS context of every connection to a verifier (sessions and probes alike).
        self._ssl = ssl_context(
            str(settings.ca_file) if settings.ca_file else None, settings.insecure_skip_verify
        )
        self.monitor = LinkMonitor(settings, self.metrics, ssl=self._ssl)
        self.queue = FairQueue(settings.max_queue, settings.max_concurrent)
        self.worker = ModelWorker("draft-model")
        self.loaded: LoadedModel | LoadedTokenizer | None = None
        self.agent: EdgeAgent | None = None
        self.drafter: Drafter | None = None
        self.eos: list[int] = []
        self.max_context: int | None = None
        self.batching: BatchingWorker | None = None
        token_file = settings.token_file
        self._token = read_secret_file(token_file, "token_file") if token_file else ""
        self._preferred = 0
        #: The generations holding a place now, each with the time of its last progress.
        self._active: set[Slot] = set()
        #: One warm link per verifier URL (started by ``load``): requests open sessions on it;
        #: what it sees (up, busy, down) feeds ``self.monitor``, the state /health reports.
        self.links = [
            WarmLink(
                LinkSettings(
                    url=url, token=self._token, heartbeat_s=settings.heartbeat, ssl=self._ssl
                ),
                rng=random.Random(),
                observer=functools.partial(self._on_link, url),
            )
            for url in settings.verifier_urls
        ]

    @property
    def ready(self) -> bool:
        return self.agent is not None

    @property
    def has_token(self) -> bool:
        """A bearer token for the verifier is configured (token_file)."""
        return bool(self._token)

    async def load(self, report: Callable[[str], None] = lambda _: None) -> None:
        """Load the draft (or, draft none, the tokenizer) on the model worker (the event loop
        stays free). The links to the verifiers open meanwhile, and are kept warm."""
        for link in self.links:
            link.start()
        t0 = time.perf_counter()
        loaded: LoadedModel | LoadedTokenizer
        if self.settings.cloud_only:
            loaded = await self.worker.run(load_edge_tokenizer, self.settings, report)
            self.eos, self.max_context = eos_ids(loaded), loaded.max_length
            what = f"tokenizer of {loaded.name}"
        else:
            loaded = await self.worker.run(load_draft_model, self.settings, report)
            self.drafter = await self.worker.run(Drafter, loaded)
            self.eos, self.max_context = eos_ids(loaded), self.drafter.lm.max_length
            what = f"draft {loaded.name}"
        self.loaded = loaded
        for url in self.settings.verifier_urls:
            self._check_pairing(url)  # links that came up while the draft loaded
        retry = retry_policy(self.settings)
        worker = self.worker
        if self.drafter is not None and self.settings.max_concurrent > 1:
            # Concurrent generations' draft steps share batched forwards.
            self.batching = BatchingWorker(self.worker, self.drafter, self.settings.max_concurrent)
            worker = self.batching
        self.agent = EdgeAgent(
            self.drafter,
            loaded.fingerprint,
            self._connect,
            retry=retry,
            worker=worker,
            federation=self._workers() if self.settings.federated else (),
            round_deadline_s=self.settings.round_deadline,
        )
        self.metrics.model_ready.set(1)
        report(f"{what} ready in {time.perf_counter() - t0:.1f} s")

    def context_limit(self) -> ContextLimit:
        """The tokens a generation may hold (prompt and completion): the draft's context and
        the smallest the verifiers announced (their connection's Ready; a verifier not yet
        reached is not counted: its session's Welcome bounds the generation then)."""
        known = [link.max_context for link in self.links if link.max_context is not None]
        return ContextLimit(self.max_context, min(known) if known else None)

    def stalled_slots(self, now: float, after_s: float) -> int:
        """Generations holding a place that made no progress (no token committed, no text
        taken by their client) for more than ``after_s`` seconds before ``now``."""
        return sum(1 for slot in self._active if now - slot.last > after_s)

    @property
    def draft_name(self) -> str | None:
        """The draft model's name, ``"none"`` with no draft model; None while loading."""
        if self.settings.cloud_only:
            return NO_DRAFT
        return None if self.loaded is None else self.loaded.name

    def describe(self) -> str:
        """One line: the draft and where it runs, or (draft none) that the verifier drafts."""
        loaded, _ = self.require()
        if isinstance(loaded, LoadedTokenizer):
            return f"no draft model (cloud-only: the verifier drafts); tokenizer of {loaded.name}"
        return device_line(loaded)

    async def close(self) -> None:
        """Close the verifier links (their sessions end) and the model worker."""
        for link in self.links:
            await link.close()
        if self.batching is not None:
            await self.batching.aclose()
        self.worker.close()

    # ------------------------------------------------------------------ the verifier link

    async def _connect(self) -> Transport:
        """A session with the first verifier that answers, starting with the last good one.
        When none does and some refused as busy, a :class:`VerifierBusy` with the shortest
        Retry-After (busy is not down: the agent waits it out)."""
        urls = self.settings.verifier_urls
        errors: list[str] = []
        permanent = 0
        busy: list[VerifierBusy] = []
        for k in range(len(urls)):
            i = (self._preferred + k) % len(urls)
            try:
                transport = await self.links[i].stream()
            except ModelMismatch as e:  # (/health says so already: _check_pairing)
                errors.append(str(e))
                permanent += 1
                continue
            except TokenRefused as e:
                self.monitor.mark_token_refused(urls[i], str(e))
                raise HandshakeError(str(e)) from e  # reconnecting cannot help
            except VerifierBusy as e:
                self.monitor.mark_busy(urls[i], str(e), e.retry_after)
                errors.append(str(e))
                busy.append(e)
                continue
            except (LinkClosed, LinkRefused) as e:
                self.monitor.mark(urls[i], False, str(e))
                errors.append(str(e))
                permanent += isinstance(e, LinkRefused)
                continue
            self._preferred = i
            return transport
        if permanent == len(urls):
            raise HandshakeError("; ".join(errors))  # waiting cannot clear any of them
        if busy:
            soonest = min(busy, key=lambda e: e.retry_after)
            raise VerifierBusy("; ".join(errors), soonest.reason, soonest.retry_after)
        raise LinkClosed("; ".join(errors))

    def _on_link(self, url: str, err: BaseException | None) -> None:
        """What a warm link saw (:data:`~edge_agent.link.warm.LinkObserver`), for /health: a
        connection opened (up, unless a stall or a busy refusal still holds), a lost one
        (down, unless stalled), a busy refusal, a failed attempt (down), a refused token."""
        if err is None:
            if self._check_pairing(url):
                self.monitor.mark_connected(url)
        elif isinstance(err, LinkLost):
            self.monitor.mark_lost(url, str(err))
        elif isinstance(err, TokenRefused):
            self.monitor.mark_token_refused(url, str(err))
        elif isinstance(err, VerifierBusy):
            self.monitor.mark_busy(url, str(err), err.retry_after)
        else:
            self.monitor.mark(url, False, str(err) or type(err).__name__)

    def _check_pairing(self, url: str) -> bool:
        """Compare the target the verifier at ``url`` announced with the edge's draft (once
        both are known): whether they pair. A mismatch is logged once per announced target,
        in one line that says what to change, and the link opens no session (its requests
        fail at once, /health says why) until the verifier announces a target that pairs."""
        link = self.links[self.settings.verifier_urls.index(url)]
        target = link.announced
        if self.loaded is None or target is None:
            return True
        line = mismatch_line(
            self.loaded.fingerprint,
            target,
            target_of=f"{url}'s target",
            setting=pairing_setting(self.settings),
            config=settings_place(os.environ),
        )
        if line is not None and line != link.refusal:
            log.error("%s", line)
        link.refuse(line)
        self.monitor.mark_incompatible(url, line)
        return line is None

    def _on_session_failed(self, failed: SessionFailed) -> None:
        """A verifier session failed (the agent retries): a busy refusal, a stall or a loss
        shows in /health."""
        url = self.settings.verifier_urls[self._preferred]
        if failed.cause == WaitCause.BUSY and failed.retry_after is not None:
            self.monitor.mark_busy(url, failed.detail, failed.retry_after)  # busy is not down
        elif failed.cause == WaitCause.STALLED:
            self.monitor.mark_stalled(url, failed.detail)
        else:
            self.monitor.mark(url, False, failed.detail)

    def _workers(self) -> list[WorkerSpec]:
        """SpecFed mode: one worker per configured verifier, with its weight and top-k size."""
        s = self.settings
        out = []
        triples = zip(s.verifier_urls, s.verifier_weights, s.verifier_k, strict=True)
        for (url, weight, k), warm in zip(triples, self.links, strict=True):
            out.append(WorkerSpec(url, warm.stream, weight=weight, k=k, eps_target=s.eps_target))
        return out

    # ------------------------------------------------------------------ generation

    def require(self) -> tuple[LoadedModel | LoadedTokenizer, EdgeAgent]:
        if self.loaded is None or self.agent is None:
            raise RuntimeError("the draft model is still loading")
        return self.loaded, self.agent

    def fail_fast_policy(self, agent: EdgeAgent) -> RetryPolicy | None:
        """This run's retry policy when it must not wait ``verifier_wait`` for a link known to
        be down: with ``fallback = "none"``, ``link_down_fail_fast`` > 0 and every
        verifier DOWN (by the probes or the last session), the agent's policy with a deadline
        of ``link_down_fail_fast`` s (when shorter); None (the agent's own policy) otherwise. A
        verifier that is back answers the first attempt, so the short deadline only cuts the
        wait for one that is not."""
        fail_fast = self.settings.link_down_fail_fast
        if (
            self.settings.fallback != Fallback.NONE
            or not 0 < fail_fast < agent.retry.deadline_s
            or self.monitor.state != VerifierLinkState.DOWN
        ):
            return None
        return dataclasses.replace(agent.retry, deadline_s=fail_fast)

    def admission(self) -> Failed | None:
        """How a request arriving now would fail at once (the daemon's line is full), or None:
        a front door that must answer before its first byte (an HTTP status) asks first."""
        try:
            self.queue.check()
        except QueueFull as e:
            return Failed(FailureKind.QUEUE_FULL, str(e), e.retry_after)
        return None

    async def _run(
        self,
        run: Run,
        req: GenRequest,
        on_event: Callable[[AgentEvent], None],
        deadline: float,
        ended: Callable[[], Summary | None],
    ) -> None:
        """The agent's run; with ``fallback = "draft"`` the agent itself keeps generating with
        the draft alone while no verifier answers (those tokens are flagged unverified). A run
        that fails raises one of :class:`RequestTimeout`, :class:`PromptTooLong`,
        :class:`VerifierUnavailable`, :class:`VerifierError` and logs one WARNING line (the
        503's message, with the Retry-After it gives), unless every verifier's target cannot
        pair with the draft: that was logged once, when the links said so
        (:meth:`_check_pairing`), and each request's 503 repeats it. ``ended``: the run's
        summary, once it is over."""
        _, agent = self.require()
        retry = self.fail_fast_policy(agent)
        try:
            done = await run_within(run.go(on_event), deadline - time.monotonic())
            if done is not None:
                done.result()  # (what the run raised is handled below)
            else:
                budget = self._timeout(req)
                summary = ended()
                made = 0 if summary is None else len(summary.generated)
                why = (
                    f"the request's deadline of {budget:g} s passed (request_timeout, or the "
                    f"request's wanspec.timeout) after {made} tokens"
                )
                frames = 0 if summary is None else summary.stats.progress_frames
                if frames:
                    why += (
                        f"; the verifier was busy, not down ({frames} Progress "
                        "frames: this request waited in its admission line or for its model)"
                    )
                log.warning("request failed: %s", why)
                raise RequestTimeout(why, retry_after=DEFAULT_RETRY_AFTER_S)
        except ContextExceeded as e:
            raise PromptTooLong(str(e)) from e
        except (LinkClosed, OSError, HandshakeError, asyncio.TimeoutError) as e:
            wait_over = e if isinstance(e, VerifierWaitOver) else None
            after = None if wait_over is None else wait_over.retry_after
            url = self.settings.verifier_urls[self._preferred]
            # The link's state says what the wait ended on: stalled, busy or down.
            cause = None if wait_over is None else wait_over.cause
            if wait_over is not None and cause == WaitCause.STALLED and not self.settings.federated:
                self.monitor.mark_stalled(url, str(e))
            elif wait_over is not None and cause == WaitCause.BUSY:
                busy_after = wait_over.busy_retry_after or float(wait_over.retry_after)
                self.monitor.mark_busy(url, wait_over.detail, busy_after)
            else:
                self.monitor.mark(None, False, str(e))
            if isinstance(e, (LinkClosed, asyncio.TimeoutError)) and after is None:
                after = DEFAULT_RETRY_AFTER_S  # (a refused token or model: retrying won't help)
            mismatched = all(link.refusal is not None for link in self.links)
            if isinstance(e, HandshakeError) and mismatched:
                why = "no verifier could be used"
            elif retry is not None:
                why = (
                    "no verifier could be used (every verifier was already down and fallback "
                    f"is none: gave up after link_down_fail_fast = {retry.deadline_s:g} s)"
                )
            elif wait_over is not None:
                bound = agent.retry.deadline_s
                why = f"no verifier could be used within verifier_wait = {bound:g} s"
            else:
                why = "no verifier could be used"
            tail = "" if after is None else f" (Retry-After {after} s)"
            level = logging.DEBUG if mismatched else logging.WARNING
            log.log(level, "request failed: %s: %s%s", why, e, tail)
            raise VerifierUnavailable(f"{why}: {e}", retry_after=after) from e
        summary = ended()
        if summary is not None and summary.unverified_tokens == 0:
            used = None if self.settings.federated else self.settings.verifier_urls[self._preferred]
            self.monitor.mark(used, True)

    async def stream(self, req: GenRequest) -> AsyncGenerator[RuntimeEvent, None]:
        """The request's events (:mod:`edge_agent.runtime.events`): text pieces as they are
        committed, round trips and waits, then one :class:`Finished` or one :class:`Failed`
        (a full line, before any text; a prompt too long; no verifier, the deadline, after the
        text so far, which its ``partial`` holds too; a verifier's refusal; a bug)."""
        loaded, agent = self.require()
        self.metrics.queue_waiting.set(self.queue.waiting + 1)
        # Every wait of the request (a place here, a turn in the verifier's line) and its
        # generation are bounded by its deadline; verifier_wait bounds only what makes no
        # progress (the agent's Outage).
        budget = self._timeout(req)
        deadline = time.monotonic() + budget
        try:
            async with self.queue.slot(budget):
                async for event in self._generate(req, loaded, agent, deadline):
                    yield event
        except QueueFull as e:
            yield Failed(FailureKind.QUEUE_FULL, str(e), e.retry_after)
        except RequestTimeout as e:  # (the wait for a place: the generation's are events)
            yield Failed(FailureKind.DEADLINE, str(e), e.retry_after)

    async def _generate(
        self,
        req: GenRequest,
        loaded: LoadedModel | LoadedTokenizer,
        agent: EdgeAgent,
        deadline: float,
    ) -> AsyncGenerator[RuntimeEvent, None]:
        """One request holding its place: its run on the agent, the committed ids turned into
        text pieces (cut at a stop string), its end turned into one last event."""
        self.metrics.queue_waiting.set(self.queue.waiting)
        self.metrics.busy.set(self.queue.active)
        slot = Slot(time.monotonic())
        self._active.add(slot)
        events: asyncio.Queue[RuntimeEvent | None] = asyncio.Queue()
        scanner = StopScanner(req.stop)
        eos = () if req.ignore_eos else self.eos
        scored = req.pipeline.logprobs is not None
        pending: list[TokenLogprob] = []  # committed, not yet handed out with a piece
        every: list[TokenLogprob] = []  # every generated token's (scored requests)
        run = agent.start(
            req.prompt_ids,
            seeded(req.pipeline, req.seed),
            max_tokens=req.max_tokens,
            eos_ids=eos,
            seed=req.seed,
            retry=self.fail_fast_policy(agent),
        )
        summary: list[Summary] = []  # the run's, once it is over
        rtts: list[float] = []
        first_at: list[float] = []  # when the first token was committed
        waiting: list[WaitCause] = []  # what the current wait for a verifier meets

        def tokens() -> tuple[TokenLogprob, ...]:
            """The tokens committed since the last piece (called as their text is)."""
            out = tuple(pending)
            pending.clear()
            return out

        def on_text(text: str) -> None:
            out = scanner.feed(text)
            if out:
                events.put_nowait(Piece(out, tokens()))
            if scanner.hit:
                run.stop()

        streamer = TextStreamer(loaded.tokenizer, on_text)

        def on_event(event: AgentEvent) -> None:
            if isinstance(event, Committed):
                now = time.monotonic()
                slot.committed(now)
                if not first_at:
                    first_at.append(now)
                waiting.clear()
                if scored:
                    pending.extend(event.logprobs)
                    every.extend(event.logprobs)
                streamer(list(event.ids))
            elif isinstance(event, RoundTrip):
                rtts.append(event.seconds)
                self.metrics.rtt.observe(event.seconds, kind="handshake")
                events.put_nowait(event)
            elif isinstance(event, SessionFailed):
                self._on_session_failed(event)
                if waiting[-1:] != [event.cause]:
                    waiting[:] = [event.cause]
                    events.put_nowait(Waiting(event.cause, event.detail))
            elif isinstance(event, Welcomed):
                # A session's own Welcome: its context bounds the link's (a verifier's Ready
                # may announce the model's limit where its sessions get less).
                self.links[self._preferred].note_context(event.max_context)
            elif isinstance(event, Ended):
                summary.append(event.summary)
            # (a session's Finished: the generation's end is the task's)

        def ended() -> Summary | None:
            return summary[0] if summary else None

        def rest() -> str:
            """The text committed but not yet handed out (held back for a stop string or
            an unfinished character): all of it goes, the generation being over."""
            return scanner.feed(streamer.text()[streamer.emitted :]) + scanner.flush()

        t0 = time.perf_counter()
        started = time.monotonic()
        task = asyncio.create_task(
            self._run(run, req, on_event, deadline, ended), name="wanspec-generation"
        )
        task.add_done_callback(lambda _: events.put_nowait(None))
        outcome = "cancelled"
        sent: list[str] = []
        try:
            while (event := await events.get()) is not None:
                if isinstance(event, Piece):
                    sent.append(event.text)
                    slot.handed = True
                    yield event
                    slot.handed, slot.last = False, time.monotonic()  # its client took it
                else:
                    yield event
            failure = await self._outcome(task)
            done = ended()
            made = 0 if done is None else len(done.generated)
            tail = rest()
            if tail:
                sent.append(tail)
                yield Piece(tail, tokens())
            stats = self._stats(done, time.perf_counter() - t0, req, rtts)
            if failure is None:
                outcome = (done.finish_reason if done else None) or "stop"
                # What the first token cost from the generation's start, after any wait for
                # a place (on a warm link: one round trip plus the prefill).
                ttft = round(1000 * (first_at[0] - started), 2) if first_at else None
                stats["ttft_ms"] = ttft
                yield Finished(
                    text="".join(sent),
                    finish_reason="stop" if scanner.hit else outcome,
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=made,
                    stats=stats,
                    logprobs=tuple(every),
                )
            else:
                outcome = "error"
                # The text so far goes out before the failure: streamed as its last piece, and
                # with the failure for a caller that collects it (a non-streaming answer).
                if failure.kind in (FailureKind.NO_VERIFIER, FailureKind.DEADLINE):
                    partial = Partial("".join(sent), len(req.prompt_ids), made, stats)
                    failure = dataclasses.replace(failure, partial=partial)
                yield failure
        finally:
            self._active.discard(slot)
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            self.metrics.busy.set(self.queue.active - 1)
            self.metrics.record(ended(), time.perf_counter() - t0, outcome)

    async def _outcome(self, task: asyncio.Task[None]) -> Failed | None:
        """How the run ended: None (finished), or its failure as an event."""
        try:
            await task
        except RequestTimeout as e:
            return Failed(FailureKind.DEADLINE, str(e), e.retry_after)
        except VerifierUnavailable as e:
            return Failed(FailureKind.NO_VERIFIER, str(e), e.retry_after)
        except PromptTooLong as e:
            return Failed(FailureKind.PROMPT_TOO_LONG, str(e))
        except VerifierError as e:
            return Failed(FailureKind.VERIFIER_ERROR, str(e), code=str(e.code))
        except Exception as e:
            log.exception("generation failed")
            return Failed(FailureKind.INTERNAL, f"internal error ({type(e).__name__}: {e})")
        return None

    def _timeout(self, req: GenRequest) -> float:
        """``req``'s deadline in seconds: its own, else the daemon's request_timeout."""
        return req.timeout_s if req.timeout_s is not None else self.settings.request_timeout

    def _stats(
        self, summary: Summary | None, wall: float, req: GenRequest, rtts: list[float]
    ) -> dict[str, Any]:
        if summary is None:  # (a run that never started: nothing to report but the wait)
            return {"prompt_tokens": len(req.prompt_ids), "wall_s": round(wall, 4)}
        out = result_json(summary, "", wall, req.pipeline, cloud_only=self.settings.cloud_only)
        del out["text"]
        out["prompt_tokens"] = len(req.prompt_ids)
        out["rtt_ms"] = round(1000 * min(rtts), 2) if rtts else None
        return out
