"""The daemon's core, shared by ``edge-agent serve`` (HTTP) and ``edge-agent chat`` (in-process):
one draft model (or, with ``draft = "none"``, the target family's tokenizer alone: cloud-only
speculation), one :class:`~edge_agent.daemon.agent.EdgeAgent`, up to ``max_concurrent`` requests at
once (their draft steps batched, :mod:`edge_agent.model.batching`) and the rest waiting in arrival
order, a warm link to each verifier (:mod:`edge_agent.link.warm`), text streamed as it is committed,
stop strings, metrics.

:meth:`EdgeService.stream` is the whole interface: an async iterator of text pieces ending with
one :class:`Finished`. Leaving the iteration early (a client that disconnects) or cancelling the
consuming task cancels the generation and frees the request's place in the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import logging
import os
import random
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edge_agent.daemon.agent import EdgeAgent, HandshakeError, RetryPolicy, VerifierWaitOver
from edge_agent.daemon.api_request import ContextLimit
from edge_agent.daemon.config import (
    CONFIG_ENV,
    NO_DRAFT,
    EdgeSettings,
    Fallback,
    read_secret_file,
)
from edge_agent.daemon.monitor import EdgeMetrics, LinkMonitor, TimedTransport, VerifierLinkState
from edge_agent.daemon.progress import device_line
from edge_agent.daemon.text import TextStreamer, eos_ids, result_json, ssl_context
from edge_agent.link.connection import (
    LinkRefused,
    LinkSettings,
    TokenRefused,
    VerifierBusy,
)
from edge_agent.link.driver import Consumer, VerdictTimeout
from edge_agent.link.federation import WorkerSpec
from edge_agent.link.warm import LinkLost, ModelMismatch, WarmLink
from edge_agent.model.batching import BatchingWorker
from edge_agent.model.drafter import Drafter
from edge_agent.model.tasks import ModelWorker, run_within
from edge_agent.session.events import Committed, GenerationEvent
from edge_agent.session.generation import Generation, TokenLogprob
from edge_agent.session.opening import ContextExceeded, VerifierError
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.retry import LinkDownPolicy
from edge_agent.session.transport import LinkClosed, Transport
from shared.errors import WanspecError
from shared.runtime.device import resolve_device, resolve_dtype
from shared.runtime.model_spec import SpecKind, parse_model_spec
from shared.runtime.models import (
    LoadedModel,
    LoadedTokenizer,
    load_draft,
    load_model,
    load_tokenizer,
)
from shared.runtime.pairing import mismatch_line
from shared.wire.messages import Welcome

log = logging.getLogger("wanspec.edge.service")

#: The round trips measured by the current request's sessions (each request sets its own).
_RTTS: contextvars.ContextVar[list[float]] = contextvars.ContextVar("wanspec_rtts")


class QueueFull(WanspecError, RuntimeError):
    """Too many requests are waiting (HTTP 429, with ``retry_after`` seconds)."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Partial:
    """What a generation that failed had produced: its text (as far as it was, or would have
    been, streamed), its token counts and statistics."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)


#: The Retry-After of a 503 whose wait gave no better figure (a federation's give-up).
DEFAULT_RETRY_AFTER_S = 5
#: The Retry-After of a 429 (the daemon's line full): a place frees as a generation ends.
QUEUE_RETRY_AFTER_S = 1


class VerifierUnavailable(WanspecError, RuntimeError):
    """No verifier could be used and no fallback is configured (HTTP 503). ``retry_after``:
    whole seconds after which the client may try again (None: retrying will not help, e.g. a
    refused configuration); ``partial``: the text generated before it failed, once the
    stream knows it."""

    def __init__(
        self, message: str, *, retry_after: int | None = None, partial: Partial | None = None
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.partial = partial


class RequestTimeout(VerifierUnavailable):
    """The request's deadline (``request_timeout``, or its own ``wanspec.timeout``) passed
    before its text was done: it waited that long in line (the daemon's, the verifier's) or
    generated that long (HTTP 504, with its text so far)."""


class PromptTooLong(WanspecError, ValueError):
    """The prompt does not fit the context of the verifier (found when its session opened:
    the API answers 400 ``context_length_exceeded``)."""


class FairQueue:
    """At most ``max_active`` holders at a time, the others served first come, first served, up
    to ``max_waiting`` of them (then :class:`QueueFull`).

    A waiter that is cancelled leaves the queue; a slot handed to a waiter that is cancelled at
    that very moment is passed on, never lost."""

    def __init__(self, max_waiting: int, max_active: int = 1) -> None:
        self.max_waiting = max_waiting
        self.max_active = max_active
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.active = 0

    @property
    def busy(self) -> bool:
        """Every slot is held."""
        return self.active >= self.max_active

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    def check(self) -> None:
        """Raise :class:`QueueFull` if a request arriving now would be refused."""
        if (self.busy or self._waiters) and self.waiting >= self.max_waiting:
            raise QueueFull(
                f"{self.waiting} requests are already waiting; try again later",
                retry_after=QUEUE_RETRY_AFTER_S,
            )

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # handed over: the slot stays held
                return
        self.active -= 1

    @contextlib.asynccontextmanager
    async def slot(self, wait_s: float | None = None) -> AsyncIterator[None]:
        """Hold a place; wait for one at most ``wait_s`` seconds (None: no bound), then
        :class:`RequestTimeout` (``wait_s`` is what is left of the request's deadline);
        :class:`QueueFull` at once when the line is full."""
        if self.busy or self._waiters:
            self.check()
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(asyncio.shield(fut), wait_s)
            except BaseException as e:
                if fut.done() and not fut.cancelled():
                    self._release()  # the slot was ours already: pass it on
                else:
                    fut.cancel()
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(fut)
                if isinstance(e, asyncio.TimeoutError):
                    raise RequestTimeout(
                        f"waited {wait_s:g} s for one of the {self.max_active} generations "
                        "(the request's deadline: request_timeout or wanspec.timeout); try "
                        "again later",
                        retry_after=max(1, min(60, round(wait_s or 1))),
                    ) from e
                raise
        else:
            self.active += 1
        try:
            yield
        finally:
            self._release()


@dataclass(eq=False)
class _Slot:
    """A generation holding a place: when it last made progress, by the monotonic clock. Its
    client taking a piece of text is progress; a token committed is too, unless a piece
    waits for the client (``handed``): then only the client can make progress (tokens
    committed for a client that stopped reading help nobody)."""

    last: float
    handed: bool = False

    def committed(self, now: float) -> None:
        if not self.handed:
            self.last = now


class StopScanner:
    """Cuts streamed text at the first stop string, holding back text that might begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets ``hit`` (and drops the rest) when a stop string appears."""
        if self.hit:
            return ""
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending, self.hit = self.pending[:cut], "", True
            return out
        n = max(0, len(self.pending) - self.keep)
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.hit else self.pending), ""
        return out


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


@dataclass(frozen=True)
class Piece:
    """A text increment of a stream; ``tokens``: the generated tokens committed since the last
    piece, with their log-probabilities (requests that asked for them; else empty)."""

    text: str
    tokens: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The end of a stream: what OpenAI's ``usage``/``finish_reason`` and our extension need."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)  # the "wanspec" extension
    #: Every generated token with its log-probabilities (requests that asked; else empty).
    logprobs: tuple[TokenLogprob, ...] = ()


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


def load_draft_model(s: EdgeSettings, report: Callable[[str], None]) -> LoadedModel:
    """The draft (blocking): ``self:`` drafts share the weights of ``draft_base``."""
    import torch

    device = resolve_device(s.device)
    name = resolve_dtype(s.dtype, device, on_cuda="float16")
    dtype = getattr(torch, name)

    def base() -> LoadedModel:
        report(f"loading {s.draft_base} ({device}, {name}) for the self-draft {s.draft}")
        loaded = load_model(s.draft_base, device=device, dtype=dtype)
        report(f"deriving the self-draft {s.draft} (weights shared)")
        return loaded

    if parse_model_spec(s.draft).kind != SpecKind.SELF:
        report(f"loading draft {s.draft} ({device}, {name})")
    return load_draft(s.draft, base, device=device, dtype=dtype)


def loading_line(s: EdgeSettings) -> str:
    """What :meth:`EdgeService.load` is about to load, for a progress display."""
    if s.cloud_only:
        return f"loading the tokenizer of {s.draft_base} (draft none: the verifier drafts)"
    return f"loading the draft {s.draft}"


def pairing_setting(s: EdgeSettings) -> str:
    """The setting to change when the edge's tokenizer does not pair with a target: with
    ``draft = "none"`` the tokenizer is ``draft_base``'s, else ``draft`` (a self-draft too:
    naming a model of the target's family there is the direct fix)."""
    return "draft_base" if s.cloud_only else "draft"


def tokenizer_spec(s: EdgeSettings) -> str:
    """The model whose tokenizer the edge uses: ``draft_base`` for a self-draft or
    ``draft = "none"``, else ``draft``."""
    if s.cloud_only or s.draft.strip().startswith("self:"):
        return s.draft_base
    return s.draft


def settings_place(env: Mapping[str, str]) -> str:
    """Where an operator changes the edge's settings, as a mismatch line names it."""
    configured = env.get(CONFIG_ENV)
    if configured:
        return configured
    return "edge.toml (/etc/wanspec/edge.toml for the systemd unit)"


def load_edge_tokenizer(s: EdgeSettings, report: Callable[[str], None]) -> LoadedTokenizer:
    """``draft = "none"`` (blocking): the tokenizer of ``draft_base`` alone, no weights."""
    report(loading_line(s))
    return load_tokenizer(s.draft_base)


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
        self.link = LinkMonitor(settings, self.metrics, ssl=self._ssl)
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
        self._active: set[_Slot] = set()
        #: One warm link per verifier URL (started by ``load``): requests open sessions on it;
        #: what it sees (up, busy, down) feeds ``self.link``, the state /health reports.
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
            on_session_failed=self._on_session_failed,
            on_welcome=self._on_welcome,
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
                self.link.mark_token_refused(urls[i], str(e))
                raise HandshakeError(str(e)) from e  # reconnecting cannot help
            except VerifierBusy as e:
                self.link.mark_busy(urls[i], str(e), e.retry_after)
                errors.append(str(e))
                busy.append(e)
                continue
            except (LinkClosed, LinkRefused) as e:
                self.link.mark(urls[i], False, str(e))
                errors.append(str(e))
                permanent += isinstance(e, LinkRefused)
                continue
            self._preferred = i
            return TimedTransport(transport, self._on_rtt)
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
                self.link.mark_connected(url)
        elif isinstance(err, LinkLost):
            self.link.mark_lost(url, str(err))
        elif isinstance(err, TokenRefused):
            self.link.mark_token_refused(url, str(err))
        elif isinstance(err, VerifierBusy):
            self.link.mark_busy(url, str(err), err.retry_after)
        else:
            self.link.mark(url, False, str(err) or type(err).__name__)

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
        self.link.mark_incompatible(url, line)
        return line is None

    def _on_welcome(self, welcome: Welcome) -> None:
        """A session's own Welcome: its context bounds the link's (a verifier's Ready may
        announce the model's limit where its sessions get less)."""
        self.links[self._preferred].note_context(welcome.max_context)

    def _on_session_failed(self, err: BaseException) -> None:
        """A verifier session failed (the agent retries): a busy refusal, a stall or a loss
        shows in /health."""
        url = self.settings.verifier_urls[self._preferred]
        if isinstance(err, VerifierBusy):
            self.link.mark_busy(url, str(err), err.retry_after)  # busy is not down
        elif isinstance(err, VerdictTimeout):
            self.link.mark_stalled(url, str(err))
        else:
            self.link.mark(url, False, str(err) or type(err).__name__)

    def _workers(self) -> list[WorkerSpec]:
        """SpecFed mode: one worker per configured verifier, with its weight and top-k size."""
        s = self.settings
        out = []
        triples = zip(s.verifier_urls, s.verifier_weights, s.verifier_k, strict=True)
        for (url, weight, k), warm in zip(triples, self.links, strict=True):

            async def connect(warm: WarmLink = warm) -> Transport:
                return TimedTransport(await warm.stream(), self._on_rtt)

            out.append(WorkerSpec(url, connect, weight=weight, k=k, eps_target=s.eps_target))
        return out

    def _on_rtt(self, seconds: float) -> None:
        rtts = _RTTS.get(None)
        if rtts is not None:  # (the request whose session measured it)
            rtts.append(seconds)
        self.metrics.rtt.observe(seconds, kind="handshake")

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
            or self.link.state != VerifierLinkState.DOWN
        ):
            return None
        return dataclasses.replace(agent.retry, deadline_s=fail_fast)

    async def _run(
        self, gen: Generation, req: GenRequest, on_event: Consumer, deadline: float
    ) -> None:
        """The agent's run; with ``fallback = "draft"`` the agent itself keeps generating with
        the draft alone while no verifier answers (those tokens are flagged unverified). A run
        that fails logs one WARNING line (the 503's message, with the Retry-After it gives),
        unless every verifier's target cannot pair with the draft: that was logged once, when
        the links said so (:meth:`_check_pairing`), and each request's 503 repeats it."""
        _, agent = self.require()
        retry = self.fail_fast_policy(agent)
        run = agent.run(
            gen, seeded(req.pipeline, req.seed), seed=req.seed, retry=retry, on_event=on_event
        )
        try:
            done = await run_within(run, deadline - time.monotonic())
            if done is not None:
                done.result()  # (what the run raised is handled below)
            else:
                budget = self._timeout(req)
                st = gen.stats
                why = (
                    f"the request's deadline of {budget:g} s passed (request_timeout, or the "
                    f"request's wanspec.timeout) after {len(gen.generated)} tokens"
                )
                if st.progress_frames:
                    why += (
                        f"; the verifier was busy, not down ({st.progress_frames} Progress "
                        "frames: this request waited in its admission line or for its model)"
                    )
                log.warning("request failed: %s", why)
                raise RequestTimeout(why, retry_after=DEFAULT_RETRY_AFTER_S)
        except ContextExceeded as e:
            raise PromptTooLong(str(e)) from e
        except (LinkClosed, OSError, HandshakeError, asyncio.TimeoutError) as e:
            after = e.retry_after if isinstance(e, VerifierWaitOver) else None
            url = self.settings.verifier_urls[self._preferred]
            cause = e.__cause__
            # The link's state says what the wait ended on: stalled, busy or down.
            if isinstance(cause, VerdictTimeout) and not self.settings.federated:
                self.link.mark_stalled(url, str(e))
            elif isinstance(cause, VerifierBusy) and isinstance(e, VerifierWaitOver):
                self.link.mark_busy(url, str(cause), cause.retry_after)
            else:
                self.link.mark(None, False, str(e))
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
            elif isinstance(e, VerifierWaitOver):
                bound = agent.retry.deadline_s
                why = f"no verifier could be used within verifier_wait = {bound:g} s"
            else:
                why = "no verifier could be used"
            tail = "" if after is None else f" (Retry-After {after} s)"
            level = logging.DEBUG if mismatched else logging.WARNING
            log.log(level, "request failed: %s: %s%s", why, e, tail)
            raise VerifierUnavailable(f"{why}: {e}", retry_after=after) from e
        if gen.unverified_tokens == 0 and not self.settings.federated:
            self.link.mark(self.settings.verifier_urls[self._preferred], True)
        elif gen.unverified_tokens == 0:
            self.link.mark(None, True)

    async def stream(self, req: GenRequest) -> AsyncGenerator[Piece | Finished, None]:
        """Text pieces as they are committed, then one :class:`Finished`.

        Raises QueueFull (before any text), PromptTooLong, VerifierUnavailable (after the
        text so far, which its ``partial`` holds too), VerifierError.
        """
        loaded, _ = self.require()
        self.metrics.queue_waiting.set(self.queue.waiting + 1)
        # Every wait of the request (a place here, a turn in the verifier's line) and its
        # generation are bounded by its deadline; verifier_wait bounds only what makes no
        # progress (the agent's Outage).
        budget = self._timeout(req)
        deadline = time.monotonic() + budget
        async with self.queue.slot(budget):
            self.metrics.queue_waiting.set(self.queue.waiting)
            self.metrics.busy.set(self.queue.active)
            slot = _Slot(time.monotonic())
            self._active.add(slot)
            pieces: asyncio.Queue[Piece | None] = asyncio.Queue()
            scanner = StopScanner(req.stop)
            eos = () if req.ignore_eos else self.eos
            gen: Generation | None = None
            scored = req.pipeline.logprobs is not None
            reported = 0  # generated tokens handed out with a piece

            def tokens() -> tuple[TokenLogprob, ...]:
                """The tokens committed since the last piece (called as their text is)."""
                nonlocal reported
                if not scored or gen is None:
                    return ()
                n = len(gen.generated)
                out = tuple(gen.token_logprobs(reported, n))
                reported = n
                return out

            def on_text(text: str) -> None:
                out = scanner.feed(text)
                if out:
                    pieces.put_nowait(Piece(out, tokens()))
                if scanner.hit and gen is not None and not gen.done:
                    gen.finish("stop")

            streamer = TextStreamer(loaded.tokenizer, on_text)
            first_at: list[float] = []  # when the first token was committed

            def on_event(event: GenerationEvent) -> None:
                if not isinstance(event, Committed):
                    return  # (the generation's end is the task's)
                now = time.monotonic()
                slot.committed(now)
                if not first_at:
                    first_at.append(now)
                streamer(list(event.ids))

            def rest() -> str:
                """The text committed but not yet handed out (held back for a stop string or
                an unfinished character): all of it goes, the generation being over."""
                return scanner.feed(streamer.text()[streamer.emitted :]) + scanner.flush()

            gen = Generation(req.prompt_ids, req.max_tokens, eos)
            rtts: list[float] = []
            _RTTS.set(rtts)  # (the generation's task inherits it: its sessions report here)
            t0 = time.perf_counter()
            started = time.monotonic()
            task = asyncio.create_task(
                self._run(gen, req, on_event, deadline), name="wanspec-generation"
            )
            task.add_done_callback(lambda _: pieces.put_nowait(None))
            outcome = "cancelled"
            sent: list[str] = []
            try:
                while (piece := await pieces.get()) is not None:
                    sent.append(piece.text)
                    slot.handed = True
                    yield piece
                    slot.handed, slot.last = False, time.monotonic()  # its client took it
                await task  # raises what the generation raised
                outcome = gen.finish_reason or "stop"
                tail = rest()
                if tail:
                    sent.append(tail)
                    yield Piece(tail, tokens())
                wall = time.perf_counter() - t0
                stats = self._stats(gen, wall, req, rtts)
                # What the first token cost from the generation's start, after any wait for a
                # place (on a warm link: one round trip plus the prefill).
                stats["ttft_ms"] = round(1000 * (first_at[0] - started), 2) if first_at else None
                yield Finished(
                    text="".join(sent),
                    finish_reason="stop" if scanner.hit else (gen.finish_reason or "stop"),
                    prompt_tokens=len(req.prompt_ids),
                    completion_tokens=len(gen.generated),
                    stats=stats,
                    logprobs=tuple(gen.token_logprobs(0, len(gen.generated))) if scored else (),
                )
            except VerifierUnavailable as e:
                outcome = "error"
                # The text so far goes out before the error: streamed as its last piece, and
                # with the error for a caller that collects it (a non-streaming answer).
                tail = rest()
                if tail:
                    sent.append(tail)
                    yield Piece(tail, tokens())
                stats = self._stats(gen, time.perf_counter() - t0, req, rtts)
                text = "".join(sent)
                e.partial = Partial(text, len(req.prompt_ids), len(gen.generated), stats)
                raise
            except (QueueFull, PromptTooLong, VerifierError, HandshakeError):
                outcome = "error"
                raise
            except Exception:
                outcome = "error"
                log.exception("generation failed")
                raise
            finally:
                self._active.discard(slot)
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                self.metrics.busy.set(self.queue.active - 1)
                self.metrics.record(gen, time.perf_counter() - t0, outcome)

    def _timeout(self, req: GenRequest) -> float:
        """``req``'s deadline in seconds: its own, else the daemon's request_timeout."""
        return req.timeout_s if req.timeout_s is not None else self.settings.request_timeout

    def _stats(
        self, gen: Generation, wall: float, req: GenRequest, rtts: list[float]
    ) -> dict[str, Any]:
        out = result_json(gen, "", wall, req.pipeline, cloud_only=self.settings.cloud_only)
        del out["text"]
        out["prompt_tokens"] = len(req.prompt_ids)
        out["rtt_ms"] = round(1000 * min(rtts), 2) if rtts else None
        return out
