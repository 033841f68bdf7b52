"""The aiohttp application: ``/v1/session`` (WebSocket), ``/health``, ``/metrics``.

Tasks and their owners: the model load, the systemd watchdog and the token-file poll each run in
a task created and cancelled-and-awaited by a cleanup context; session handlers are aiohttp's
request tasks, and ``on_shutdown`` closes their WebSockets with GOING_AWAY so they end. Closing
the sessions of a revoked token runs in tasks kept in ``VerifierState.closers``.

Serve it with :func:`make_runner` and a :class:`~shared.service.http_guard.Listener` (as
``cloud-verifier serve`` does): that adds the header-read timeout and the caps on connections that
have not reached a handler yet (``state.guard``; the middleware tells it when a request starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import secrets
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Final, TypeVar

from aiohttp import WSCloseCode, WSMessage, WSMsgType, hdrs, web

from cloud_verifier.daemon.auth import Authenticator
from cloud_verifier.daemon.metrics import VerifierMetrics
from cloud_verifier.daemon.settings import VerifierSettings
from cloud_verifier.engine.draft_model import load_draft_target
from cloud_verifier.engine.engine import (
    Engine,
    EngineHealth,
    EngineLimits,
    Outcome,
)
from cloud_verifier.engine.kv_manager import KVManager, NoFreeSlot, Slot
from cloud_verifier.engine.step_times import StallRule
from cloud_verifier.engine.targets import Target, compiles, load_target
from cloud_verifier.engine.work import (
    CoGenerate,
    Crop,
    Draw,
    Failed,
    FailureKind,
    Federate,
    Skipped,
    Verified,
    Verify,
    Work,
    batch_ends,
    deferred,
)
from cloud_verifier.session.admission import AdmissionLine, Ticket
from cloud_verifier.session.cloud_draft import parse_cloud_drafts
from cloud_verifier.session.core import (
    CLOSE_OK,
    Adopt,
    Close,
    Event,
    Note,
    NoteKind,
    Run,
    Send,
    SessionLimits,
    TargetInfo,
    TokenCounts,
    VerifierCore,
    context_limit,
)
from cloud_verifier.session.tenancy import PrefixCache
from shared.errors import ErrorCode, WanspecError
from shared.runtime.device import DeviceUnavailable
from shared.service.http_guard import ConnectionGuard, http_logger
from shared.service.metrics import CONTENT_TYPE
from shared.service.ratelog import LogLimiter
from shared.service.sdnotify import Notifier
from shared.service.status import ServiceStatus
from shared.wire.codec import decode, encode
from shared.wire.messages import (
    SUBPROTOCOL,
    Error,
    FederatedReply,
    Hello,
    Message,
    Progress,
    Verdict,
)
from shared.wire.mux import (
    MAX_PREFIX,
    OLD_SUBPROTOCOLS,
    Data,
    End,
    MuxError,
    MuxEvent,
    Opened,
    Overflow,
    Ready,
    Refused,
    ServerMux,
    encode_control,
    frame,
    old_protocol_message,
    stream_window,
)
from shared.wire.packing import ProtocolError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger(__name__)

FIRST = asyncio.FIRST_COMPLETED
#: Frames read ahead while a session's model work runs (an honest pipelined edge has its depth
#: D of Proposes in flight; a flood waits in the socket instead of in memory).
READ_AHEAD = 16
#: The header that names why a session request was refused (an edge cannot read the body of a
#: refused WebSocket upgrade): loading, stopping, busy, overloaded, kv_full, token_limit, ...
REFUSAL_HEADER = "X-Wanspec-Refusal"
#: The logger of the verifier's aiohttp request handlers (:func:`make_runner`): a malformed
#: request (aiohttp answers it 400 itself) is a rate-limited INFO line without a traceback,
#: not an ERROR with one (:func:`shared.service.http_guard.http_logger`).
HTTP_LOG = http_logger("cloud_verifier.http")
#: How often lost sessions past their grace period are dropped, and the kept ones' pages are
#: checked against their budget (seconds).
REAP_INTERVAL_S = 1.0
#: How often the engine's health is read for its death (seconds): /health, new sessions and
#: the handlers read it on their own too, so this bounds only how soon idle sessions learn it.
ENGINE_CHECK_S = 0.25


@dataclass(eq=False)
class Parked:
    """A session whose connection was lost, kept for its edge to resume: its engine slot (the
    KV cache), whose bearer token it was, and until when it is kept (monotonic seconds)."""

    slot: Slot
    tenant: str
    until: float

    @property
    def pages(self) -> int:
        return KVManager.pages_held(self.slot)


@dataclass
class VerifierState:
    """Everything the handlers share (one per app)."""

    settings: VerifierSettings
    engine: Engine
    auth: Authenticator
    metrics: VerifierMetrics
    limits: SessionLimits
    loader: Callable[[], Target]
    #: The cloud draft model's loader (cloud_draft_model), None without one.
    draft_loader: Callable[[Target], Target] | None
    notifier: Notifier
    guard: ConnectionGuard
    status: ServiceStatus = ServiceStatus.LOADING
    reason: str = "loading the model"
    sessions: dict[str, LiveSession] = field(default_factory=dict)
    websockets: dict[web.WebSocketResponse, asyncio.BaseTransport | None] = field(
        default_factory=dict
    )
    #: Upgraded or upgrading connections: at most max_sessions + admission_queue (each
    #: carries a session, live or waiting, while it is of use).
    connections: int = 0
    #: Connections per token key (``Authenticator.identify``), against max_sessions_per_token.
    per_token: dict[str, int] = field(default_factory=dict)
    #: Sessions (streams) admitted and not yet over, against max_sessions, and per token key,
    #: against max_sessions_per_token.
    streams: int = 0
    token_streams: dict[str, int] = field(default_factory=dict)
    #: The token key of each upgraded WebSocket (to close a revoked token's sessions).
    ws_token: dict[web.WebSocketResponse, str] = field(default_factory=dict)
    #: Tasks closing the sessions of revoked tokens.
    closers: set[asyncio.Task[None]] = field(default_factory=set)
    #: Refused session requests are logged at most 5 times a minute.
    refusal_log: LogLimiter = field(default_factory=lambda: LogLimiter(burst=5, interval=60.0))
    #: Set whenever ``status`` changes (serve() waits on it).
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Lost sessions kept for resumption, by resume token, oldest first. Invariant (between
    #: admissions): per token key, live streams plus kept sessions are at most
    #: max_sessions_per_token; the kept ones' pages (counted now, not when they were kept) at
    #: most resume_pages_share of the pool, checked at each park and each reap.
    parked: OrderedDict[str, Parked] = field(default_factory=OrderedDict)
    #: Upgraded connections (to fail their sessions when the engine dies).
    conns: set[_Conn] = field(default_factory=set)
    #: The engine's thread was found dead (once; ``_engine_died`` acted on it).
    engine_dead: bool = False
    #: Sessions waiting for their turn to start (the admission line), and each one's stream.
    line: AdmissionLine = field(default_factory=lambda: AdmissionLine(0, 1))
    waiting: dict[Ticket, _Stream] = field(default_factory=dict)

    def set_status(self, status: ServiceStatus, reason: str) -> None:
        self.status, self.reason = status, reason
        self.changed.set()


STATE = web.AppKey("wanspec_state", VerifierState)


@dataclass
class LiveSession:
    """An open session: its rules (the core), its model side (the engine's slot: cache, RNG)
    and its log budget (per-frame events a peer can cause at will are logged at most 5 times a
    minute)."""

    core: VerifierCore
    slot: Slot
    logs: LogLimiter = field(default_factory=lambda: LogLimiter(burst=5, interval=60.0))


def prefix_cache(settings: VerifierSettings) -> PrefixCache:
    """The prefix cache's namespace: ``auto`` is per tenant, off under tensor parallelism."""
    if settings.prefix_cache == "auto":
        return PrefixCache.TENANT if settings.tp == 1 else PrefixCache.OFF
    return PrefixCache(settings.prefix_cache)


#: How a limit is filled from the settings where it is not the setting of its own name: the
#: setting it is under another name, a function of the settings (a conversion, or a rule across
#: settings), or None (the limit's own bound: no setting names it, its default stands). Every
#: other field is the setting of its name; a field with neither is an AttributeError at start,
#: never a silent default.
Fill = Mapping[str, "str | Callable[[VerifierSettings], object] | None"]

SESSION_FILL: Final[Fill] = {
    "idle_timeout_s": "idle_timeout",
    "max_cogen_ahead": "cogen_ahead",
    "progress_interval_s": "progress_interval",
    "cloud_draft": lambda s: parse_cloud_drafts(s.cloud_draft),
    "cloud_model": lambda s: bool(s.cloud_draft_model),
    # Taking a branch moves keys in the pool: rank 0's alone under tensor parallelism.
    "max_tree_tokens": lambda s: s.tree_tokens if s.tp == 1 else 0,
    "max_queued": None,
    "max_stale_per_epoch": None,
    "max_hedges": None,
}

ENGINE_FILL: Final[Fill] = {
    "slots": "max_sessions",
    "page_size": "kv_page_size",
    "kv_tokens": "kv_cache_tokens",
    "session_share": "kv_session_share",
    "tenant_share": "kv_token_share",
    "batch_wait_s": lambda s: s.batch_wait_ms / 1000.0,
    "stall": lambda s: StallRule(floor_s=s.stall_timeout),
    "prefix_cache": prefix_cache,
}

L = TypeVar("L", bound="DataclassInstance")


def fill(limits: type[L], settings: VerifierSettings, table: Fill) -> L:
    """``limits`` filled from ``settings`` by ``table`` (see :data:`Fill`)."""
    values: dict[str, object] = {}
    for f in dataclasses.fields(limits):
        how = table.get(f.name, f.name)
        if how is not None:
            values[f.name] = getattr(settings, how) if isinstance(how, str) else how(settings)
    return limits(**values)


def limits_from(settings: VerifierSettings) -> SessionLimits:
    return fill(SessionLimits, settings, SESSION_FILL)


def engine_limits(settings: VerifierSettings) -> EngineLimits:
    return fill(EngineLimits, settings, ENGINE_FILL)


def default_draft_loader(settings: VerifierSettings) -> Callable[[Target], Target] | None:
    """Loads ``settings.cloud_draft_model`` beside the target (None: no cloud draft model)."""
    spec = settings.cloud_draft_model
    if not spec:
        return None

    def load(target: Target) -> Target:
        compiled = compiles(settings.compile, str(target.device))
        return load_draft_target(spec, target, compile_forward=compiled)

    return load


def build_app(
    settings: VerifierSettings,
    *,
    auth: Authenticator,
    engine: Engine | None = None,
    loader: Callable[[], Target] | None = None,
    draft_loader: Callable[[Target], Target] | None = None,
    notifier: Notifier | None = None,
    metrics: VerifierMetrics | None = None,
) -> web.Application:
    """The verifier app. ``loader`` (run on the model worker) defaults to loading
    ``settings.model``; pass ``engine`` to observe it (tests count its forwards)."""
    if loader is None:

        def loader() -> Target:
            return load_target(
                settings.model,
                device=settings.device,
                dtype=settings.dtype,
                compile_forward=settings.compile,
            )

    app = web.Application(middlewares=[_guard_middleware])
    metrics = metrics or VerifierMetrics()
    app[STATE] = VerifierState(
        settings=settings,
        engine=engine or Engine(engine_limits(settings)),
        auth=auth,
        metrics=metrics,
        limits=limits_from(settings),
        loader=loader,
        draft_loader=draft_loader or default_draft_loader(settings),
        notifier=notifier or Notifier(None),
        guard=ConnectionGuard(
            header_timeout=settings.header_timeout,
            max_pending=settings.max_pending_connections,
            max_pending_per_address=settings.max_pending_per_address,
            metrics=metrics.http,
        ),
    )
    app[STATE].line = AdmissionLine(settings.admission_queue, settings.admission_queue_per_token)
    metrics.slots_total.set(settings.max_sessions)
    app.router.add_get("/v1/session", session_handler)
    app.router.add_get("/health", health_handler)
    app.router.add_get("/metrics", metrics_handler)
    app.cleanup_ctx.append(_engine_ctx)
    app.cleanup_ctx.append(_watchdog_ctx)
    app.cleanup_ctx.append(_token_ctx)
    app.cleanup_ctx.append(_parked_ctx)
    app.on_shutdown.append(_close_sessions)
    return app


def make_runner(app: web.Application) -> web.AppRunner:
    """The runner ``serve`` uses: no access log, aiohttp's request errors through
    :data:`HTTP_LOG` (malformed requests: rate-limited INFO lines)."""
    settings = app[STATE].settings
    return web.AppRunner(
        app,
        shutdown_timeout=settings.shutdown_timeout,
        access_log=None,
        logger=HTTP_LOG,
        # The guard closes connections idle between requests after header_timeout; this is
        # only aiohttp's own (hour-long by default) backstop.
        keepalive_timeout=max(75.0, settings.header_timeout),
    )


@web.middleware
async def _guard_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Headers complete: the connection is no longer pending (see ``http_guard``). A header
    value that is not ASCII is refused here (400), whatever the path: nothing this service reads
    may contain one, and aiohttp passes such bytes on as surrogates."""
    state = request.app[STATE]
    state.guard.request_started(request.transport)
    try:
        bad = _non_ascii_header(request)
        if bad is not None:
            if request.path == "/v1/session":
                _refuse(state, ErrorCode.BAD_HEADER, web.HTTPBadRequest(), request)
            raise web.HTTPBadRequest(text=f"header {bad} is not ASCII\n")
        return await handler(request)
    finally:
        state.guard.request_finished(request.transport)


def _non_ascii_header(request: web.Request) -> str | None:
    """The (quoted) name of the first header whose value is not ASCII, or None."""
    for name, value in request.headers.items():
        if not value.isascii():
            return ascii(name)
    return None


# ---------------------------------------------------------------------------- background tasks


async def _load_model(state: VerifierState) -> None:
    spec = state.settings.model
    state.notifier.notify(f"STATUS=loading model {spec}")
    log.info("loading model %s", spec)
    t0 = time.perf_counter()
    try:
        target = await state.engine.load(state.loader, draft_loader=state.draft_loader)
    except Exception as e:
        # A missing CUDA device is a configuration problem: its message says it all.
        log.error(
            "model %s failed to load: %s", spec, e, exc_info=not isinstance(e, DeviceUnavailable)
        )
        state.notifier.notify(f"STATUS=model failed to load: {e}")
        state.set_status(ServiceStatus.FAILED, f"model {spec} failed to load: {e}")
        return
    state.metrics.model_ready.set(1)
    mem = state.engine.memory()
    state.metrics.kv_bytes_total.set(mem["bytes_total"])
    state.metrics.kv_pages_total.set(mem["pages_total"])
    log.info(
        "model ready in %.1f s (warmed up): %s; KV cache %d tokens, %.1f MiB",
        time.perf_counter() - t0,
        target.description,
        mem["pages_total"] * state.settings.kv_page_size,
        mem["bytes_total"] / 2**20,
    )
    state.set_status(ServiceStatus.READY, f"serving {target.description}")


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    """Owns the model worker, the background load (the port listens while it runs) and the
    task that watches the engine for its death."""
    state = app[STATE]
    tasks = [
        asyncio.create_task(_load_model(state), name="wanspec-load-model"),
        asyncio.create_task(_engine_monitor(state), name="wanspec-engine-monitor"),
    ]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        state.engine.shutdown()


# ---------------------------------------------------------------------------- the engine's health


def _engine_failure(state: VerifierState) -> str | None:
    """Why the engine can serve no more (its thread died), or None. A shutdown is no failure:
    while the service stops, its engine's end is expected."""
    h = state.engine.health()
    if h.alive or state.status == ServiceStatus.STOPPING:
        return None
    return h.error or "the model engine stopped"


def _check_engine(state: VerifierState) -> bool:
    """Read the engine's health; the first time it is found dead, act on it (see
    :func:`_engine_died`). True while it can serve."""
    why = _engine_failure(state)
    if why is None:
        return True
    if not state.engine_dead:
        _engine_died(state, why)
    return False


def _engine_died(state: VerifierState, why: str) -> None:
    """The engine's thread died: /health answers 503 with ``why``, new sessions are refused
    (503, no Retry-After: it is down, not busy), every open session gets a fatal Error and its
    connection is closed (1011), and the watchdog stops (systemd restarts the service)."""
    state.engine_dead = True
    state.set_status(ServiceStatus.FAILED, why)
    state.metrics.model_ready.set(0)
    state.notifier.notify(f"STATUS=failed: {why}")
    log.error(
        "%s: /health answers 503, %d open session(s) are closed, new ones refused; "
        "restart the service (under systemd's watchdog it is restarted)",
        why,
        state.streams,
    )
    err = Error(
        ErrorCode.INTERNAL,
        f"the verifier failed ({why}); it must be restarted",
        fatal=True,
    )
    task = asyncio.get_running_loop().create_task(_fail_connections(state, err))
    state.closers.add(task)
    task.add_done_callback(state.closers.discard)


async def _fail_connections(state: VerifierState, err: Error) -> None:
    """Tell every open session ``err`` (fatal; nothing is kept for resumption) and close every
    connection (1011), each within close_timeout."""

    async def fail(conn: _Conn) -> None:
        for st in list(conn.streams.values()):
            st.ended_here = True  # not lost: nothing is kept for an engine that is gone
            await _tell(conn, st.stream, err)
            await conn.end(st.stream, WSCloseCode.INTERNAL_ERROR, err.code)
            st.finish(WSCloseCode.INTERNAL_ERROR, err.message)
        await conn.close(WSCloseCode.INTERNAL_ERROR, f"{err.code}: {err.message}")

    await asyncio.gather(*(fail(c) for c in list(state.conns)), return_exceptions=True)


async def _engine_monitor(state: VerifierState) -> None:
    """Read the engine's health every ``ENGINE_CHECK_S`` s (no call: nothing queues behind
    work), so that its death is acted on within that bound even with no request coming in."""
    while _check_engine(state):
        await asyncio.sleep(ENGINE_CHECK_S)


class WatchdogVerdict(Enum):
    """What the systemd watchdog does with one reading of the engine's health."""

    FEED = "feed"  # alive, its running step (if any) within its estimate: WATCHDOG=1
    STALLED = "stalled"  # a step has stalled, for less than the bound: still WATCHDOG=1
    STALLED_TOO_LONG = "stalled_too_long"  # stalled past the bound: no WATCHDOG=1
    DEAD = "dead"  # the engine's thread died: no WATCHDOG=1


@dataclass
class Watchdog:
    """Whether to send WATCHDOG=1, from :meth:`Engine.health` (pure: the time is given).

    The engine's own beat is the evidence, never a call that would queue behind its work: a
    long prefill is progress. A step the engine calls stalled (it has run ``StallRule``'s 8
    times its estimate and at least ``stall_timeout``) may still finish, so it is fed for
    ``stall_bound_s`` more seconds; then not, and systemd restarts the service
    ``WatchdogSec`` later. A dead engine is never fed.

    Invariant: ``stalled_since`` is set exactly while the last reading said stalled."""

    stall_bound_s: float
    stalled_since: float | None = None

    def judge(self, health: EngineHealth, now: float) -> WatchdogVerdict:
        if not health.alive:
            return WatchdogVerdict.DEAD
        if not health.stalled:
            self.stalled_since = None
            return WatchdogVerdict.FEED
        if self.stalled_since is None:
            self.stalled_since = now
        if now - self.stalled_since > self.stall_bound_s:
            return WatchdogVerdict.STALLED_TOO_LONG
        return WatchdogVerdict.STALLED


#: Verdicts that send WATCHDOG=1.
_FED = (WatchdogVerdict.FEED, WatchdogVerdict.STALLED)


async def _watchdog(state: VerifierState, interval: float) -> None:
    """WATCHDOG=1 every ``interval`` s while :class:`Watchdog` says the engine progresses;
    each change of its verdict is logged once (a dead or long-stalled engine at ERROR)."""
    dog = Watchdog(stall_bound_s=state.settings.stall_timeout)
    last = WatchdogVerdict.FEED
    while True:
        health = state.engine.health()
        verdict = dog.judge(health, time.monotonic())
        if verdict in _FED:
            state.notifier.notify("WATCHDOG=1")
        if verdict != last and state.status != ServiceStatus.STOPPING:
            _log_watchdog(verdict, health, dog.stall_bound_s)
        last = verdict
        await asyncio.sleep(interval)


def _log_watchdog(verdict: WatchdogVerdict, health: EngineHealth, bound: float) -> None:
    if verdict == WatchdogVerdict.DEAD:
        log.error(
            "watchdog: %s: no more WATCHDOG=1 (systemd restarts the service)",
            health.error or "the model engine stopped",
        )
    elif verdict == WatchdogVerdict.STALLED_TOO_LONG:
        log.error(
            "watchdog: the engine's step has made no progress for %.0f s (stalled for over "
            "%.0f s): no more WATCHDOG=1 (systemd restarts the service)",
            health.beat_age_s,
            bound,
        )
    elif verdict == WatchdogVerdict.STALLED:
        log.warning(
            "watchdog: the engine's step has stalled (%.0f s without progress); WATCHDOG=1 "
            "goes on for up to %.0f s more",
            health.beat_age_s,
            bound,
        )
    else:
        log.info("watchdog: the engine progresses again")


async def _watchdog_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    interval = state.notifier.watchdog_interval
    task = None
    if interval is not None:
        task = asyncio.create_task(_watchdog(state, interval), name="wanspec-watchdog")
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _poll_tokens(state: VerifierState, interval: float) -> None:
    """Re-read the token file every ``interval`` s even with no request coming in, so a revoked
    token's sessions are closed and a broken file is reported within ``interval``."""
    while True:
        await asyncio.sleep(interval)
        state.auth.refresh()
        _token_metrics(state)


async def _token_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    interval = state.settings.token_reload_interval

    def revoked(keys: frozenset[str]) -> None:
        _revoke(state, keys)

    state.auth.on_revoke(revoked)
    task = None
    if state.auth.enabled and state.auth.token_file is not None and interval > 0:
        task = asyncio.create_task(_poll_tokens(state, interval), name="wanspec-token-poll")
    try:
        yield
    finally:
        state.auth.on_revoke(revoked, remove=True)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for closer in list(state.closers):
            closer.cancel()
        await asyncio.gather(*state.closers, return_exceptions=True)


def reload_tokens(state: VerifierState, why: str) -> None:
    """Re-read the token file now (SIGHUP); revoked tokens' sessions are closed."""
    if not state.auth.enabled or state.auth.token_file is None:
        log.info("%s: no token file to re-read", why)
        return
    changed = state.auth.refresh(force=True)
    _token_metrics(state)
    log.info(
        "%s: token file re-read: %d token(s)%s%s",
        why,
        state.auth.count,
        "" if changed else ", unchanged",
        f"; PROBLEM: {state.auth.error}" if state.auth.error else "",
    )


def _token_metrics(state: VerifierState) -> None:
    auth, m = state.auth, state.metrics
    m.tokens_configured.set(auth.count if auth.enabled else 0)
    m.token_file_ok.set(0 if auth.error else 1)
    m.token_reloads.follow(auth.reloads)
    m.token_file_errors.follow(auth.errors)


def _revoke(state: VerifierState, keys: frozenset[str]) -> None:
    """Tokens were removed from the token file: close their sessions (1008, token_revoked)."""
    doomed = [(ws, t) for ws, t in state.websockets.items() if state.ws_token.get(ws) in keys]
    log.info(
        "token(s) %s removed from the token file: closing %d open session(s)",
        ", ".join(sorted(keys)),
        len(doomed),
    )
    reason = _close_reason("token_revoked: this session's bearer token is no longer accepted")
    for ws, transport in doomed:
        state.metrics.sessions_revoked.inc()
        task = asyncio.get_running_loop().create_task(
            _close(ws, transport, state, WSCloseCode.POLICY_VIOLATION, reason)
        )
        state.closers.add(task)
        task.add_done_callback(state.closers.discard)


async def drain(state: VerifierState, timeout_s: float, poll_s: float = 0.1) -> None:
    """Drain before shutting down (``drain_timeout``): /health answers 503 and new sessions are
    refused from now on, while open sessions go on, until none is left or ``timeout_s`` passes.
    A balancer health-checking /health stops routing here within its check interval.

    An edge keeps one connection for all its sessions, and a balancer routes connections, not
    sessions: a connection that carries no session (at once, or once its last one ends) is
    closed (going away, "draining"), so that its edge reconnects through the balancer to
    another replica instead of meeting refusals here until the drain ends."""
    if timeout_s <= 0:
        return
    state.set_status(ServiceStatus.STOPPING, "draining: no new sessions")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    log.info("draining: %d session(s) open, up to %.3g s", state.streams, timeout_s)
    while True:
        for conn in [c for c in state.conns if not c.streams]:
            state.conns.discard(conn)
            task = loop.create_task(conn.close(WSCloseCode.GOING_AWAY, "draining"))
            state.closers.add(task)
            task.add_done_callback(state.closers.discard)
        if not state.streams or (left := deadline - loop.time()) <= 0:
            break
        await asyncio.sleep(min(poll_s, left))
    log.info("drained: %d session(s) left to close", state.streams)


# ---------------------------------------------------------------------------- lost sessions


def _unpark(state: VerifierState, token: str, reason: str | None) -> Parked | None:
    """Take a lost session out of the parking; with ``reason`` its slot is released too (the
    KV pages go back to the pool)."""
    parked = state.parked.pop(token, None)
    if parked is not None and reason is not None:
        state.engine.release(parked.slot)
        state.metrics.parked_dropped.inc(reason=reason)
    state.metrics.parked.set(len(state.parked))
    return parked


def _park(state: VerifierState, token: str, slot: Slot, tenant: str) -> bool:
    """Keep a lost session's slot for ``resume_grace`` seconds, within the page budget (the
    oldest are dropped to make room). False when it cannot be kept (the caller releases it):
    its slot holds no page (its prefill never ran: there is nothing to resume), or more than
    the whole budget.

    The caller has cancelled the session's model work (its task awaiting ``Engine.run``), so
    nothing more is queued for it; a step already running for it may still add pages, which
    the budget counts at the next reap (:func:`_fit_budget`)."""
    s = state.settings
    if s.resume_grace <= 0 or state.status != ServiceStatus.READY:
        return False
    pages = KVManager.pages_held(slot)
    if pages == 0 or pages > _parked_budget(state):
        return False
    state.parked[token] = Parked(slot, tenant, time.monotonic() + s.resume_grace)
    _fit_budget(state)  # the new one is the newest: dropped last, and it fits alone
    state.metrics.parked.set(len(state.parked))
    return True


def _parked_budget(state: VerifierState) -> int:
    """KV pages the sessions kept for resumption may hold together (resume_pages_share)."""
    return int(state.engine.memory()["pages_total"] * state.settings.resume_pages_share)


def _fit_budget(state: VerifierState) -> None:
    """Drop the oldest kept sessions while the pages they hold now pass their budget."""
    budget = _parked_budget(state)
    while state.parked and sum(p.pages for p in state.parked.values()) > budget:
        _unpark(state, next(iter(state.parked)), "budget")


def _kept(state: VerifierState, key: str) -> int:
    """Sessions kept for resumption of token key ``key``."""
    return sum(1 for p in state.parked.values() if p.tenant == key)


def _resumes(state: VerifierState, payload: bytes, tenant: str) -> bool:
    """Whether a stream's first frame is a Hello resuming a session kept for ``tenant``, within
    its grace (decoded here for admission; the session's core decodes and checks it again)."""
    try:
        hello = decode(payload)
    except ProtocolError:
        return False
    if not isinstance(hello, Hello) or hello.resume is None:
        return False
    parked = state.parked.get(hello.resume.token)
    return (
        parked is not None
        and parked.until > time.monotonic()
        and secrets.compare_digest(parked.tenant, tenant)
    )


def _make_room(state: VerifierState) -> bool:
    """A new session needs a slot or pages: drop the oldest lost session (False: none)."""
    if not state.parked:
        return False
    _unpark(state, next(iter(state.parked)), "pressure")
    return True


def _reap(state: VerifierState, now: float) -> None:
    for token in [t for t, p in state.parked.items() if p.until <= now]:
        _unpark(state, token, "expired")
    _fit_budget(state)


async def _parked_ctx(app: web.Application) -> AsyncIterator[None]:
    """Owns the task that drops lost sessions past their grace period; at the end, every
    kept one is released."""
    state = app[STATE]

    async def reaper() -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            _reap(state, time.monotonic())

    task = asyncio.create_task(reaper(), name="wanspec-parked-reaper")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for token in list(state.parked):
            _unpark(state, token, "expired")


async def _close_sessions(app: web.Application) -> None:
    state = app[STATE]
    state.set_status(ServiceStatus.STOPPING, "shutting down")
    sockets = list(state.websockets.items())
    if sockets:
        log.info("closing %d session(s)", len(sockets))
    await asyncio.gather(
        *(
            _close(ws, transport, state, WSCloseCode.GOING_AWAY, b"server shutdown")
            for ws, transport in sockets
        ),
        return_exceptions=True,
    )


# ---------------------------------------------------------------------------- HTTP handlers


def _json(status: int, body: dict[str, object], **headers: str) -> web.Response:
    return web.Response(
        status=status, text=json.dumps(body), content_type="application/json", headers=headers
    )


async def health_handler(request: web.Request) -> web.Response:
    """200 while ready, 503 otherwise (loading, stopping, failed: the model did not load, or
    the engine's thread died, ``reason`` says why). ``engine``: its health as the watchdog
    reads it; ``slots``: session slots held / max_sessions (all held: new sessions get 503
    although the service is healthy); ``pending_connections``: connections whose request has
    not reached a handler; ``token_file``: ``ok`` or what is wrong with it (the previous
    tokens are kept meanwhile)."""
    state = request.app[STATE]
    health = state.engine.health()
    _check_engine(state)
    body: dict[str, object] = {"status": state.status, "reason": state.reason}
    body["engine"] = {
        "alive": health.alive,
        "stalled": health.stalled,
        "error": health.error,
        "beat_age_s": round(health.beat_age_s, 3),
    }
    body["slots"] = {"used": state.connections, "total": state.settings.max_sessions}
    body["pending_connections"] = state.guard.pending
    mem = state.engine.memory()
    body["kv_cache"] = {"pages_used": mem["pages_used"], "pages_total": mem["pages_total"]}
    # Whether sessions need a bearer token (an edge without one can say so before its first
    # request fails); which tokens is never said.
    body["auth"] = state.auth.enabled
    if state.auth.enabled and state.auth.token_file is not None:
        body["token_file"] = state.auth.error or "ok"
    if state.status != ServiceStatus.READY:
        return _json(503, body)
    target = state.engine.require_target()
    body.update(
        model=target.fingerprint.model_name,
        vocab_size=target.vocab_size,
        sessions=len(state.sessions),
    )
    return _json(200, body)


async def metrics_handler(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.metrics.sessions_active.set(len(state.sessions))
    state.metrics.slots_used.set(state.connections)
    mem = state.engine.memory()
    state.metrics.kv_bytes_used.set(mem["bytes_used"])
    state.metrics.kv_pages_used.set(mem["pages_used"])
    state.metrics.prefix_cached_pages.set(mem["pages_cached"])
    state.metrics.prefix_hit_tokens.follow(mem["prefix_hit_tokens"])  # the engine owns them
    state.metrics.prefix_evictions.follow(mem["prefix_evictions"])
    state.metrics.busy_seconds.follow(state.engine.busy_seconds())  # the engine owns it
    _token_metrics(state)
    body = state.metrics.render().encode()
    return web.Response(body=body, headers={hdrs.CONTENT_TYPE: CONTENT_TYPE})


def _refuse(
    state: VerifierState,
    reason: ErrorCode,
    exc: web.HTTPException,
    request: web.Request | None = None,
) -> web.HTTPException:
    """Count and (rate-limited) log a refused session request; the refusal names its reason
    in the ``X-Wanspec-Refusal`` header."""
    state.metrics.sessions_refused.inc(reason=reason)
    exc.headers[REFUSAL_HEADER] = reason
    if request is not None:
        state.refusal_log.log(
            log,
            logging.INFO,
            "refused a session request from %s: %s (HTTP %d)",
            request.remote,
            reason,
            exc.status,
        )
    return exc


def _status_code(status: ServiceStatus) -> ErrorCode:
    """Why a verifier that is not ready refuses a session (on HTTP and on a stream alike):
    it failed (down: no Retry-After), or it is loading or stopping (busy: come back)."""
    if status == ServiceStatus.FAILED:
        return ErrorCode.INTERNAL
    return ErrorCode.STOPPING if status == ServiceStatus.STOPPING else ErrorCode.LOADING


def _upgrade_requested(request: web.Request) -> bool:
    return "websocket" in request.headers.get(hdrs.UPGRADE, "").lower()


def _offered(request: web.Request) -> list[str]:
    offered = request.headers.getall(hdrs.SEC_WEBSOCKET_PROTOCOL, ())
    return [p.strip() for value in offered for p in value.split(",") if p.strip()]


def _offers_subprotocol(request: web.Request) -> bool:
    return SUBPROTOCOL in _offered(request)


def _wrong_subprotocol(request: web.Request) -> web.HTTPException:
    """400 for a client without this protocol's subprotocol; one that offers an earlier
    version is told both versions."""
    old = [p for p in _offered(request) if p in OLD_SUBPROTOCOLS]
    text = (
        old_protocol_message(old[0])
        if old
        else f"the WebSocket subprotocol {SUBPROTOCOL} is required"
    )
    return web.HTTPBadRequest(text=text + "\n")


async def session_handler(request: web.Request) -> web.StreamResponse:
    """Authenticate, check capacity and subprotocol, then upgrade and serve one connection:
    its sessions (streams, :mod:`shared.wire.mux`) until it closes."""
    state = request.app[STATE]
    s = state.settings
    # Nothing is created before the token checks out.
    if len(request.headers.getall(hdrs.AUTHORIZATION, ())) > 1:
        raise _refuse(
            state,
            ErrorCode.UNAUTHORIZED,
            web.HTTPBadRequest(text="more than one Authorization header\n"),
            request,
        )
    key = state.auth.identify(request.headers.get(hdrs.AUTHORIZATION))
    if key is None:
        raise _refuse(
            state,
            ErrorCode.UNAUTHORIZED,
            web.HTTPUnauthorized(
                text="missing or wrong bearer token\n",
                headers={hdrs.WWW_AUTHENTICATE: 'Bearer realm="wanspec"'},
            ),
            request,
        )
    _check_engine(state)
    if state.status != ServiceStatus.READY:
        # Loading or draining: busy, come back (Retry-After). Failed (the model did not load,
        # or the engine died): down, no Retry-After, so an edge counts it as down.
        failed = state.status == ServiceStatus.FAILED
        raise _refuse(
            state,
            _status_code(state.status),
            web.HTTPServiceUnavailable(
                text=json.dumps({"status": state.status, "reason": state.reason}),
                content_type="application/json",
                headers={} if failed else {hdrs.RETRY_AFTER: "5"},
            ),
            request if failed else None,
        )
    # Connections are bounded like sessions (each carries one at least, while it is of use).
    if s.max_sessions_per_token and state.per_token.get(key, 0) >= s.max_sessions_per_token:
        raise _refuse(
            state,
            ErrorCode.TOKEN_LIMIT,
            web.HTTPTooManyRequests(
                text=f"this token already holds {s.max_sessions_per_token} connections "
                "(max_sessions_per_token)\n",
                headers={hdrs.RETRY_AFTER: "1"},
            ),
        )
    # A token with sessions kept for resumption may be reconnecting to resume them: its
    # connection is not refused as busy (beyond max_sessions, by at most the kept sessions)
    # nor overloaded; each stream it opens is admitted on its own (a resume always).
    kept = _kept(state, key)
    refusal = None
    cause = None if kept else _must_wait(state, key, make_room=False)
    if cause is not None:
        refusal = _line_refusal(state, key, cause)
    if refusal is not None:
        # No session could start here now, nor wait in line (a full line: overloaded, before
        # the connection limit, which a full line reaches too): say so before the upgrade,
        # as to a busy HTTP API.
        raise _refuse(
            state,
            ErrorCode(refusal.code),
            web.HTTPServiceUnavailable(
                text=refusal.message + "\n",
                headers={hdrs.RETRY_AFTER: str(math.ceil(refusal.retry_after or 1))},
            ),
            request if refusal.code == ErrorCode.OVERLOADED else None,
        )
    room = s.max_sessions + s.admission_queue + (len(state.parked) if kept else 0)
    if state.connections >= room:
        raise _refuse(
            state,
            ErrorCode.BUSY,
            web.HTTPServiceUnavailable(
                text=f"connection limit {room} reached (max_sessions + admission_queue)\n",
                headers={hdrs.RETRY_AFTER: "1"},
            ),
        )
    ws = web.WebSocketResponse(
        protocols=(SUBPROTOCOL,),
        max_msg_size=s.max_frame + MAX_PREFIX,
        timeout=s.close_timeout,
        heartbeat=s.heartbeat or None,
        autoping=False,  # pings are answered by _serve_connection, within the frame budget
        compress=False,  # frames are tens of bytes; deflate would only add latency
    )
    if not _upgrade_requested(request):
        raise _refuse(
            state,
            ErrorCode.NOT_WEBSOCKET,
            web.HTTPUpgradeRequired(
                text="/v1/session is a WebSocket endpoint: send Upgrade: websocket\n",
                headers={hdrs.UPGRADE: "websocket", hdrs.CONNECTION: "Upgrade"},
            ),
        )
    if not _offers_subprotocol(request):  # (before aiohttp, which logs a warning for it)
        raise _refuse(state, ErrorCode.SUBPROTOCOL, _wrong_subprotocol(request))
    try:
        ready = ws.can_prepare(request)
    except (UnicodeError, ValueError):
        # Header bytes that are not ASCII: aiohttp cannot quote them in its 400 (UnicodeError)
        # nor base64-decode such a Sec-WebSocket-Key (ValueError).
        raise _refuse(
            state,
            ErrorCode.BAD_UPGRADE,
            web.HTTPBadRequest(text="malformed WebSocket upgrade headers\n"),
        ) from None
    if not ready.ok:
        raise _refuse(
            state,
            ErrorCode.BAD_UPGRADE,
            web.HTTPBadRequest(text="malformed WebSocket upgrade (version or key)\n"),
        )
    if ready.protocol != SUBPROTOCOL:
        raise _refuse(state, ErrorCode.SUBPROTOCOL, _wrong_subprotocol(request))
    state.connections += 1
    state.per_token[key] = state.per_token.get(key, 0) + 1
    conn: _Conn | None = None
    try:
        await ws.prepare(request)
        state.websockets[ws] = request.transport
        state.ws_token[ws] = key
        conn = _Conn(ws, request.transport, state)
        state.conns.add(conn)
        await _serve_connection(conn, key)
    finally:
        if conn is not None:
            state.conns.discard(conn)
        state.connections -= 1
        state.per_token[key] -= 1
        if not state.per_token[key]:
            del state.per_token[key]
        state.websockets.pop(ws, None)
        state.ws_token.pop(ws, None)
    return ws


def _refusal(state: VerifierState, key: str, *, resuming: bool = False) -> Error | None:
    """Why a new session of token ``key`` is refused now, whatever the load (a fatal Error:
    with Retry-After the service is loading or stopping, busy not down; without one it
    failed), or None: it may start, or wait in the admission line for its turn.

    ``resuming``: its Hello resumes a session kept for this token (:func:`_resumes`); that
    session holds its slot and pages already, so it is refused only when the service is not
    ready. The per-token cap counts the token's live and waiting sessions (a quota, not a
    wait: 429-like ``token_limit``)."""
    s = state.settings
    _check_engine(state)
    if state.status == ServiceStatus.FAILED:
        return Error(_status_code(state.status), f"the verifier failed: {state.reason}", True)
    if state.status != ServiceStatus.READY:
        code = _status_code(state.status)
        # Stopping: draining, its edges' connections closing; behind a balancer another
        # replica takes the session at once, so come back soon. Loading: a while.
        after = 1.0 if state.status == ServiceStatus.STOPPING else 5.0
        return Error(code, f"the verifier is {state.status}: {state.reason}", True, after)
    if resuming:
        return None
    cap = s.max_sessions_per_token
    live = state.token_streams.get(key, 0) + state.line.of(key)
    if cap and live >= cap:
        return Error(
            ErrorCode.TOKEN_LIMIT,
            f"this token already holds {cap} sessions (max_sessions_per_token)",
            True,
            1.0,
        )
    return None


def _must_wait(state: VerifierState, key: str, *, make_room: bool = True) -> Error | None:
    """Why a session of token ``key`` that may start (:func:`_refusal`) cannot start now, or
    None: every session slot is taken, the KV pool is full, or the engine's queue is past
    ``max_queue_delay`` while other sessions are served (a lone session is always admitted: a
    slow step is not overload). The Error is the reason it waits in line, and what it is
    refused with if the line is full.

    ``make_room``: sessions kept for resumption may be dropped to admit it (the token's own
    first: they count against max_sessions_per_token); False checks without dropping any
    (before the upgrade, when which session comes is not known yet)."""
    s = state.settings
    cap = s.max_sessions_per_token
    live = state.token_streams.get(key, 0)
    if cap and make_room:
        # Its own kept sessions make room, oldest first: live + kept stays within the cap.
        while live + _kept(state, key) >= cap and _kept(state, key):
            _unpark(state, next(t for t, p in state.parked.items() if p.tenant == key), "token")
    if state.streams >= s.max_sessions:
        return Error(ErrorCode.BUSY, f"session limit {s.max_sessions} reached", True, 1.0)
    if state.engine.pages_free == 0 and not (_make_room(state) if make_room else state.parked):
        return Error(
            ErrorCode.KV_FULL,
            "the KV cache is full (every page is held by a session)",
            True,
            1.0,
        )
    if s.max_queue_delay > 0 and state.streams > 0:
        delay = state.engine.queue_delay_s()
        state.metrics.queue_delay.set(delay)
        if delay > s.max_queue_delay:
            return Error(
                ErrorCode.OVERLOADED,
                f"overloaded: the model queue is {delay:.1f} s deep "
                f"(max_queue_delay {s.max_queue_delay:g} s)",
                True,
                float(max(1, min(60, math.ceil(delay)))),
            )
    return None


def _line_refusal(state: VerifierState, key: str, cause: Error | None) -> Error | None:
    """The refusal of a session of token ``key`` that must wait (``cause``: why; None: it
    waits behind the sessions in line) when the admission line has no room for it, or None:
    with no line (``admission_queue`` 0) the cause itself (``busy``, ``kv_full``,
    ``overloaded``), else 503 ``overloaded`` naming the bound, Retry-After about when the
    line's last place starts."""
    line = state.line
    if line.capacity == 0:
        return cause
    full = line.full_for(key)
    if full is None:
        return None
    eta = line.eta_s(len(line), max(1, state.streams))
    after = float(max(1, min(60, math.ceil(eta))))
    return Error(ErrorCode.OVERLOADED, f"overloaded: {full}", True, after)


def _admit(state: VerifierState, st: _Stream, tenant: str) -> None:
    """``st``'s session starts: it counts against max_sessions and its token's cap."""
    st.admitted_at = time.monotonic()
    state.streams += 1
    state.token_streams[tenant] = state.token_streams.get(tenant, 0) + 1


def _pump(state: VerifierState) -> None:
    """Start waiting sessions, in the line's order, while the next one can start (called
    whenever a session ends, one joins, or a waiting one's Progress is due). The head that
    cannot start holds the line: nobody overtakes it."""
    line = state.line
    while line and state.status == ServiceStatus.READY:
        head = line.order(state.token_streams)[0]
        if _must_wait(state, head.tenant) is not None:
            break
        line.start(head)
        st = state.waiting.pop(head)
        st.ticket = None
        _admit(state, st, head.tenant)
        state.metrics.admission_wait.observe(max(0.0, time.monotonic() - head.at))
        st.wake()
    if state.status != ServiceStatus.READY:
        for st in state.waiting.values():
            st.wake()  # each sees the status and is refused
    state.metrics.admission_waiting.set(len(line))


async def _wait_turn(peer: _Stream, state: VerifierState, core: VerifierCore) -> bool:
    """Wait in the admission line until this session's turn comes (True), its stream ends, or
    the service stops (False: it was told why). Every ``progress_interval`` s the line is
    looked at again and, if the edge asked for them, a Progress frame tells it its place
    (``ahead``: sessions that start before it), the engine's steps (it moves) and the
    expected wait."""
    s = state.settings
    hello = core.hello
    assert hello is not None
    while True:
        _pump(state)
        if peer.ticket is None and peer.admitted_at is not None:
            core.admitted(time.monotonic())
            return True
        if peer.close_code is not None:
            return False
        err = _refusal(state, "", resuming=True)  # the service's status
        if err is not None or peer.ticket is None:
            err = err or Error(ErrorCode.INTERNAL, "left the admission line", True)
            await _send_msg(peer, state, err, core)
            await peer.close(WSCloseCode.TRY_AGAIN_LATER, err.code)
            return False
        if hello.progress:
            place = state.line.place(peer.ticket, state.token_streams)
            eta = state.line.eta_s(place, state.streams)
            eta_ms = min(2**32 - 1, round(1000 * eta))
            steps = state.engine.steps % 2**32
            await _send_msg(peer, state, Progress(steps, place, eta_ms, False), core)
            state.metrics.progress_frames.inc()
        peer.turn = asyncio.get_running_loop().create_future()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(peer.turn), s.progress_interval)


# ---------------------------------------------------------------------------- a connection


def _close_reason(text: str) -> bytes:
    """A close reason fits in 123 bytes (RFC 6455); cut on a character boundary."""
    raw = text.encode("utf-8")
    return raw if len(raw) <= 123 else raw[:120].decode("utf-8", "ignore").encode() + b"..."


@dataclass
class FrameBudget:
    """A token bucket of ``rate`` frames a second and ``burst`` at once (``rate`` 0: no limit),
    over the frames of a connection that no session counts: WebSocket pings and pongs, stream
    opens and control frames (a session's own frames are its core's ``max_frame_rate``)."""

    rate: float
    burst: int
    left: float = field(init=False)  # tokens left, in [0, burst]
    at: float | None = field(default=None, init=False)  # last refill (monotonic seconds)

    def __post_init__(self) -> None:
        self.left = float(self.burst)

    def take(self, now: float) -> bool:
        """Take one token at ``now``; False when none is left (the frame is over budget)."""
        if self.rate <= 0:
            return True
        if self.at is not None:
            self.left = min(float(self.burst), self.left + max(0.0, now - self.at) * self.rate)
        self.at = now
        if self.left < 1.0:
            return False
        self.left -= 1.0
        return True


class SlowReader(WanspecError):
    """The peer does not read what it is sent: its connection is closed to keep memory
    bounded."""


def _buffered(transport: asyncio.BaseTransport | None) -> int:
    """Bytes queued for the peer (a closing transport still holds them until they are sent)."""
    if isinstance(transport, asyncio.WriteTransport):
        return transport.get_write_buffer_size()
    return 0


def _abort(transport: asyncio.BaseTransport | None) -> None:
    if isinstance(transport, asyncio.WriteTransport):
        transport.abort()


async def _close(
    ws: web.WebSocketResponse,
    transport: asyncio.BaseTransport | None,
    state: VerifierState,
    code: int,
    reason: bytes,
) -> None:
    """Close with ``code``/``reason``, bounded in time whatever the peer does: the close frame is
    queued without waiting for the send buffer to drain, the peer's close reply is awaited for
    ``close_timeout``; a peer that has not read its buffer by then is cut (abort)."""
    try:
        await asyncio.wait_for(
            ws.close(code=code, message=reason, drain=False), state.settings.close_timeout + 1.0
        )
    except (asyncio.TimeoutError, ConnectionError) as e:
        log.info("close (%d) did not complete: %s", code, type(e).__name__)
    if _buffered(transport):
        _abort(transport)  # unread bytes would otherwise be held until TCP gives up


class _Conn:
    """One upgraded connection: the WebSocket, the TCP transport under it (for its send
    buffer), its streams' rules (:class:`~shared.wire.mux.ServerMux`) and its sessions."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        transport: asyncio.BaseTransport | None,
        state: VerifierState,
    ) -> None:
        s = state.settings
        self.ws, self.transport, self.state = ws, transport, state
        self.mux = ServerMux(s.max_streams, stream_window(s.stream_window, s.max_frame))
        self.streams: dict[int, _Stream] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        #: Pings, pongs and frames no session counts, against max_frame_rate / frame_burst.
        self.budget = FrameBudget(s.max_frame_rate, s.frame_burst)

    async def send(self, data: bytes) -> None:
        """One message, within ``send_timeout``; a peer that reads nothing, or lets more than
        ``max_send_buffer`` bytes queue, is a SlowReader (its connection is closed)."""
        s = self.state.settings
        try:
            await asyncio.wait_for(self.ws.send_bytes(data), s.send_timeout)
        except asyncio.TimeoutError:
            raise SlowReader(f"the peer read nothing for {s.send_timeout:g} s") from None
        buffered = _buffered(self.transport)
        if buffered > s.max_send_buffer:
            raise SlowReader(
                f"{buffered} unread bytes queued (max_send_buffer {s.max_send_buffer})"
            )
        self.state.metrics.bytes_sent.inc(len(data))
        self.state.metrics.frames_sent.inc()

    async def pong(self, data: bytes) -> None:
        """Answer a ping, within ``send_timeout`` (a peer that reads nothing is a SlowReader)."""
        s = self.state.settings
        try:
            await asyncio.wait_for(self.ws.pong(data), s.send_timeout)
        except asyncio.TimeoutError:
            raise SlowReader(f"the peer read nothing for {s.send_timeout:g} s") from None

    async def end(self, stream: int, code: int, reason: str) -> None:
        """End ``stream`` from this side (nothing if it is over already)."""
        if self.mux.end(stream):
            with contextlib.suppress(ConnectionError):
                await self.send(encode_control(End(stream, code, reason[:200])))

    async def close(self, code: int, reason: str) -> None:
        await _close(self.ws, self.transport, self.state, code, _close_reason(reason))

    async def slow_reader(self, e: SlowReader) -> None:
        self.state.metrics.slow_readers.inc()
        log.warning("closing a connection that does not read: %s", e)
        await self.close(WSCloseCode.POLICY_VIOLATION, f"slow_reader: {e}")
        _abort(self.transport)


#: A session's inbound queue: its frames, then (once it is over) how it ended.
_Inbox = asyncio.Queue[WSMessage]


class _Stream:
    """One session on a connection, as the session loop sees its peer: frames in order (from
    the connection's reader), a send that prefixes its stream id, a close that ends only it."""

    def __init__(self, conn: _Conn, stream: int) -> None:
        self.conn, self.stream = conn, stream
        self.inbox: _Inbox = asyncio.Queue()
        #: How the peer ended it (an End's code, or ABNORMAL_CLOSURE when the connection went);
        #: None while open.
        self.close_code: int | None = None
        self.ended_here = False
        #: Its place in the admission line while it waits (None: admitted, or never waited).
        self.ticket: Ticket | None = None
        #: When its session was admitted (monotonic seconds; None: not yet).
        self.admitted_at: float | None = None
        #: Set when its turn may have come (admitted, ended, or the service stopped).
        self.turn: asyncio.Future[None] | None = None

    def deliver(self, payload: bytes) -> None:
        self.inbox.put_nowait(WSMessage(WSMsgType.BINARY, payload, None))

    def wake(self) -> None:
        if self.turn is not None and not self.turn.done():
            self.turn.set_result(None)

    def finish(self, code: int, reason: str = "") -> None:
        """The peer ended it (or the connection is gone): the session loop sees a close."""
        if self.close_code is None:
            self.close_code = code
            self.inbox.put_nowait(WSMessage(WSMsgType.CLOSED, code, reason))
            self.wake()

    @property
    def lost(self) -> bool:
        """Ended by the connection's loss or an edge's abnormal End, not a normal end: the
        session is kept for resumption (a normal End, 1000, means the edge is done)."""
        return (
            not self.ended_here
            and self.close_code is not None
            and self.close_code != WSCloseCode.OK
        )

    async def receive(self) -> WSMessage:
        msg = await self.inbox.get()
        if msg.type == WSMsgType.BINARY:
            update = self.conn.mux.consumed(self.stream, len(msg.data))
            if update is not None:
                await self.conn.send(encode_control(update))
        return msg

    async def send(self, data: bytes) -> None:
        await self.conn.send(frame(self.stream, data))

    async def close(self, code: int, reason: str) -> None:
        self.ended_here = True
        await self.conn.end(self.stream, code, reason)


async def _serve_connection(conn: _Conn, tenant: str) -> None:
    """Read the connection's messages and hand each stream's frames to its session, each a task
    owned here; on the way out (the peer closed, a connection-level fault, shutdown) every
    session sees its stream end (kept for resumption unless its edge ended it) and is awaited."""
    state, ws = conn.state, conn.ws
    s = state.settings
    target = state.engine.require_target()
    await conn.send(
        encode_control(
            Ready(
                target.fingerprint,
                max_gamma=s.max_gamma,
                max_fixed=s.max_fixed,
                max_context=context_limit(state.limits, state.engine.max_context),
                max_frame=s.max_frame,
                max_streams=s.max_streams,
                window=conn.mux.window,
            )
        )
    )
    try:
        while True:
            msg = await ws.receive()
            if msg.type in _ENDED:
                return
            if msg.type == WSMsgType.ERROR:
                # e.g. a frame over max_frame: aiohttp has closed the socket with a code already.
                state.metrics.bad_frames.inc()
                log.info("connection: transport error %s", ws.exception())
                return
            if msg.type in (WSMsgType.PING, WSMsgType.PONG):
                # Answered here, not by aiohttp (autoping off), so that they count.
                if not conn.budget.take(time.monotonic()):
                    await _rate_limited(conn)
                    return
                if msg.type == WSMsgType.PING:
                    await conn.pong(msg.data)
                continue
            if msg.type not in (WSMsgType.BINARY, WSMsgType.TEXT):
                continue
            _count_in(state, msg.data)
            try:
                if msg.type == WSMsgType.TEXT:
                    raise MuxError("a text message (wanspec frames are binary)")
                events = conn.mux.receive(msg.data)
            except MuxError as e:
                state.metrics.bad_frames.inc()
                log.info("closing a connection that broke the stream rules: %s", e)
                await conn.close(WSCloseCode.POLICY_VIOLATION, f"bad_frame: {e}")
                return
            # A session's frames are its core's to count (max_frame_rate per session); the
            # rest (control frames, stream opens, frames crossing an End) the connection's.
            ours = not any(isinstance(ev, Data) for ev in events)
            if ours and not conn.budget.take(time.monotonic()):
                await _rate_limited(conn)
                return
            for ev in events:
                await _on_mux_event(conn, tenant, ev)
    except SlowReader as e:
        await conn.slow_reader(e)
    finally:
        for st in conn.streams.values():
            st.finish(WSCloseCode.ABNORMAL_CLOSURE, "connection lost")
        await _await_sessions(conn)


async def _rate_limited(conn: _Conn) -> None:
    """Close a connection whose pings, pongs or control frames passed its frame budget."""
    b, state = conn.budget, conn.state
    state.metrics.connections_rate_limited.inc()
    state.refusal_log.log(
        log,
        logging.INFO,
        "closing a connection past %g pings and control frames a second (burst %d)",
        b.rate,
        b.burst,
    )
    await conn.close(
        WSCloseCode.POLICY_VIOLATION,
        f"rate_limited: over {b.rate:g} pings and control frames a second (burst {b.burst})",
    )


async def _await_sessions(conn: _Conn) -> None:
    """Let the sessions see their end and park (bounded: then they are cancelled)."""
    if not conn.tasks:
        return
    _, pending = await asyncio.wait(set(conn.tasks), timeout=conn.state.settings.close_timeout)
    for t in pending:
        t.cancel()
    for t in list(conn.tasks):
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


async def _on_mux_event(conn: _Conn, tenant: str, ev: MuxEvent) -> None:
    state = conn.state
    if isinstance(ev, Data):
        conn.streams[ev.stream].deliver(ev.payload)
    elif isinstance(ev, End):
        st = conn.streams.get(ev.stream)
        if st is not None:
            st.finish(ev.code, ev.reason)
    elif isinstance(ev, Opened):
        # Busy waits in line: a session that may start but cannot now (slots, pages, a deep
        # queue behind other sessions) joins the admission line, behind any already there;
        # it is refused only by the service's status, its token's cap or a full line.
        resuming = _resumes(state, ev.payload, tenant)
        refusal = _refusal(state, tenant, resuming=resuming)
        ticket: Ticket | None = None
        if refusal is None and not resuming:
            cause = None if state.line else _must_wait(state, tenant)
            if state.line or cause is not None:
                refusal = _line_refusal(state, tenant, cause)
                if refusal is None:
                    ticket = state.line.join(tenant, time.monotonic())
        if refusal is not None:
            await _refuse_stream(conn, ev.stream, refusal)
            return
        st = conn.streams[ev.stream] = _Stream(conn, ev.stream)
        if ticket is None:
            _admit(state, st, tenant)
        else:
            st.ticket = ticket
            state.waiting[ticket] = st
            state.metrics.sessions_queued.inc()
            state.metrics.admission_waiting.set(len(state.line))
        st.deliver(ev.payload)
        task = asyncio.create_task(_stream_task(st, tenant), name=f"wanspec-stream-{ev.stream}")
        conn.tasks.add(task)
        task.add_done_callback(conn.tasks.discard)
    elif isinstance(ev, Refused):
        err = Error(
            ErrorCode.BUSY,
            f"{state.settings.max_streams} sessions are open on this connection (max_streams)",
            True,
            1.0,
        )
        await _refuse_stream(conn, ev.stream, err)
    elif isinstance(ev, Overflow):
        st = conn.streams[ev.stream]
        st.ended_here = True
        st.finish(WSCloseCode.POLICY_VIOLATION, "flow control")
        state.metrics.bad_frames.inc()
        err = Error(
            ErrorCode.FLOW_CONTROL,
            f"{ev.queued} bytes sent past this session's window of {conn.mux.window}",
            True,
        )
        await _tell(conn, ev.stream, err)
        await conn.end(ev.stream, WSCloseCode.POLICY_VIOLATION, "flow_control")


async def _tell(conn: _Conn, stream: int, err: Error) -> None:
    conn.state.metrics.errors_sent.inc(code=err.code)
    with contextlib.suppress(ConnectionError):
        await conn.send(frame(stream, encode(err)))


async def _refuse_stream(conn: _Conn, stream: int, err: Error) -> None:
    """A new session refused: its Error (with Retry-After) and the stream's End."""
    state = conn.state
    state.metrics.sessions_refused.inc(reason=err.code)
    state.refusal_log.log(log, logging.INFO, "refused a session: %s (%s)", err.code, err.message)
    await _tell(conn, stream, err)
    await conn.end(stream, WSCloseCode.TRY_AGAIN_LATER, err.code)


async def _stream_task(st: _Stream, tenant: str) -> None:
    conn, state = st.conn, st.conn.state
    try:
        await _run_session(st, state, tenant)
    except SlowReader as e:
        await conn.slow_reader(e)
    except ConnectionError:
        pass
    finally:
        if st.ticket is not None:  # it never got its turn
            state.line.leave(st.ticket)
            state.waiting.pop(st.ticket, None)
            st.ticket = None
        elif st.admitted_at is not None:
            state.streams -= 1
            state.token_streams[tenant] -= 1
            if not state.token_streams[tenant]:
                del state.token_streams[tenant]
            state.line.served(time.monotonic() - st.admitted_at)
        conn.streams.pop(st.stream, None)
        conn.mux.end(st.stream)
        _pump(state)  # a slot (or a place in line) is free: the next session's turn may come


# ---------------------------------------------------------------------------- the session loop


async def _send_msg(peer: _Stream, state: VerifierState, msg: Message, core: VerifierCore) -> None:
    if isinstance(msg, Error):
        state.metrics.errors_sent.inc(code=msg.code)
    await peer.send(encode(msg) if core.ctx is None else encode(msg, core.ctx))


async def _fatal(peer: _Stream, state: VerifierState, close: Close, core: VerifierCore) -> None:
    """Tell the peer why (unless the close is a normal one), then end the session's stream."""
    with contextlib.suppress(ConnectionError):
        if close.code != CLOSE_OK:
            await _send_msg(peer, state, close.error, core)
    await peer.close(close.code, f"{close.error.code}: {close.error.message}")


def _count_in(state: VerifierState, data: bytes | str) -> None:
    state.metrics.frames_received.inc()
    state.metrics.bytes_received.inc(len(data) if isinstance(data, bytes) else len(data.encode()))


def _new_core(state: VerifierState, resume_token: str | None = None) -> VerifierCore:
    target = state.engine.require_target()
    info = TargetInfo(target.fingerprint, target.vocab_size, state.engine.max_context)
    return VerifierCore(info, state.limits, uuid.uuid4().hex[:16], resume_token)


def _clip(text: str, n: int = 200) -> str:
    """Peer-chosen text for a log line: quoted (no control characters) and bounded."""
    return repr(text if len(text) <= n else text[:n] + "...")


def _note(state: VerifierState, core: VerifierCore, n: Note, logs: LogLimiter | None) -> None:
    """Count a note; log the ones worth a line, within the session's log budget (a peer can
    cause edge errors and model errors once per frame)."""
    m = state.metrics
    if n.kind == NoteKind.REFUSED:
        m.sessions_refused.inc(reason=n.detail)
    elif n.kind == NoteKind.STALE:
        m.stale_dropped.inc()
    elif n.kind == NoteKind.BAD_FRAME:
        m.bad_frames.inc()
    elif n.kind == NoteKind.IDLE:
        m.idle_closed.inc()
    elif n.kind == NoteKind.EDGE_ERROR and logs is not None:
        logs.log(log, logging.INFO, "session %s: edge reports %s", core.session_id, _clip(n.detail))
    elif n.kind == NoteKind.MODEL_ERROR and logs is not None:
        logs.log(log, logging.WARNING, "session %s: model error: %s", core.session_id, n.detail)


def _count_work(state: VerifierState, work: Work, outcome: Outcome) -> None:
    m = state.metrics
    result, timing = outcome.result, outcome.timing
    m.queue_seconds.observe(outcome.queued_s)
    if isinstance(result, Failed):
        m.model_errors.inc(kind=result.kind)
    if isinstance(work, CoGenerate):
        if isinstance(result, Verified):
            if work.cloud:
                drafted = work.draft if result.drafted is None else result.drafted
                m.cloud_draft_proposed.inc(len(drafted))
            if result.withheld is not None:
                m.cloud_drafts_withheld.inc(reason=result.withheld.value)
        elif isinstance(result, Skipped):
            m.cogen_skipped.inc()
    if isinstance(work, Verify) and isinstance(result, Verified) and result.cut is not None:
        ends = batch_ends(work)
        if deferred(work, result.cut):
            m.draft_deferred_batches.inc(len(ends) - ends.index(result.cut) - 1)
        else:
            m.draft_cut_rounds.inc()
            m.draft_cut_tokens.inc(len(work.draft) - result.cut)
    if isinstance(work, Verify) and work.branches and isinstance(result, Verified):
        m.tree_branches.inc(len(work.branches))
        if result.branch is not None:
            m.tree_branches_opened.inc()
    if isinstance(work, (Verify, Federate, CoGenerate)) and timing is not None:
        f = len(work.fixed)
        m.model_forwards.inc()
        m.fixed_tokens.inc(f)
        m.forward_seconds.observe(timing.forward_s)
        m.verify_seconds.observe(timing.job_s)
        m.batch_sessions.observe(timing.batch)
    if isinstance(work, Federate) and not isinstance(result, Failed):
        m.federated_rounds.inc()
    elif isinstance(work, Verify) and isinstance(result, Verified):
        m.coalesced.inc(len(work.more))
        d, g = result.decision, len(work.draft)
        m.num_drafts.inc()
        m.num_draft_tokens.inc(g)
        m.num_accepted_tokens.inc(d.accepted)
        for i in range(d.accepted):
            m.accepted_per_pos.inc(position=str(i))
        if d.accepted < g:
            kind = "sparse" if d.sparse is not None else "candidates" if d.candidates else "token"
            m.corrections.inc(kind=kind)
        elif d.bonus is not None:
            m.bonus_tokens.inc()
    elif isinstance(work, Crop) and not isinstance(result, Failed):
        m.rollbacks.inc()
    elif isinstance(work, Draw):
        m.resamples.inc()


async def _run_work(state: VerifierState, live: LiveSession, work: Work) -> list[Event]:
    """Hand one model request of the core to the engine (batched with other sessions' work);
    feed the result back."""
    try:
        outcome = await state.engine.run(live.slot, work)
    except Exception as e:  # the engine itself failed (shut down, or its thread died)
        if _check_engine(state) and live.logs.allow():
            log.warning("session %s: engine error", live.core.session_id, exc_info=e)
        failed = Failed(f"{type(e).__name__}: {e}", live.slot.length, FailureKind.ENGINE)
        outcome = Outcome(failed, None, 0.0)
    _count_work(state, work, outcome)
    if live.core.closed:  # closed meanwhile (e.g. too many bad frames): nothing to resume
        return []
    before = live.core.tokens
    events = live.core.work_done(outcome.result, time.monotonic())
    _count_tokens(state.metrics, live.core.tokens - before)
    return events


def _count_tokens(m: VerifierMetrics, added: TokenCounts) -> None:
    """The tokens a result added to its session's count (the core's, the one owner)."""
    m.cogen_tokens.inc(added.cogen)
    m.hedge_tokens.inc(added.hedge)
    m.cloud_draft_tokens.inc(added.cloud_draft)
    m.tree_tokens.inc(added.tree)


async def _act(
    peer: _Stream, state: VerifierState, live: LiveSession, events: list[Event], t0: float
) -> Work | None:
    """Carry out the core's events in order: notes, sends, a close. Returns the model work the
    core asked for (at most one: it is BUSY until its result), for the caller to start."""
    core = live.core
    work: Work | None = None
    for ev in events:
        if isinstance(ev, Note):
            _note(state, core, ev, live.logs)
        elif isinstance(ev, Send):
            await _send_msg(peer, state, ev.msg, core)
            if isinstance(ev.msg, (Verdict, FederatedReply)):
                state.metrics.round_seconds.observe(time.perf_counter() - t0)
            elif isinstance(ev.msg, Progress):
                state.metrics.progress_frames.inc()
        elif isinstance(ev, Run):
            assert work is None, "the core asks for one model request at a time"
            work = ev.work
        elif isinstance(ev, Close):
            log.info("session %s closed: %s: %s", core.session_id, ev.error.code, ev.error.message)
            await _fatal(peer, state, ev, core)
            return None
    return work


async def _next_frame(peer: _Stream, core: VerifierCore) -> WSMessage | None:
    """The next message from the peer, or None once the core's idle deadline has passed (the
    connection's pings never count as a session's activity)."""
    while True:
        deadline = core.idle_deadline()
        if deadline is None:
            return await peer.receive()
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        with contextlib.suppress(asyncio.TimeoutError):
            # A message that arrives as the deadline passes stays queued in the reader.
            if sys.version_info >= (3, 11):
                async with asyncio.timeout(left):  # no extra task per frame
                    return await peer.receive()
            return await asyncio.wait_for(peer.receive(), left)


_ENDED = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)


async def _cancel(task: asyncio.Task[Any] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _session_loop(
    peer: _Stream, state: VerifierState, live: LiveSession, events: list[Event]
) -> None:
    """Read frames and run the session's model work at the same time.

    Frames that arrive while model work runs go to the core at once, up to ``READ_AHEAD`` of
    them (it queues them, and Proposes that continue the running one are coalesced into the
    next forward; beyond that the frames wait in the socket, and TCP holds the peer back); the model
    work is a task whose result goes back to the core. Owns both tasks, the model work in
    flight (at most one) and the pending read, and cancels and awaits them on the way out. The
    read waits with the core's idle deadline, so it is restarted when the core goes from BUSY
    (no deadline) to OPEN. While model work waits or runs, the engine's word on it goes to the
    core when a Progress frame is due."""
    core = live.core
    work: asyncio.Task[list[Event]] | None = None
    read: asyncio.Task[WSMessage | None] | None = None
    t0 = started = time.perf_counter()
    try:
        while True:
            asked = await _act(peer, state, live, events, t0)
            events = []
            if core.closed:
                return
            if asked is not None:
                work = asyncio.create_task(_run_work(state, live, asked))
                started = time.perf_counter()
            if read is None and (work is None or core.queued < READ_AHEAD):
                read = asyncio.create_task(_next_frame(peer, core))
            due = core.progress_due() if work is not None else None
            timeout = None if due is None else max(0.0, due - time.monotonic())
            done, _ = await asyncio.wait(
                [t for t in (read, work) if t is not None], timeout=timeout, return_when=FIRST
            )
            if not done:  # a Progress frame is due
                report = state.engine.progress(live.slot)
                if report.stalled and live.logs.allow():
                    log.warning(
                        "session %s: the engine's running step has stalled (estimate %.1f s)",
                        core.session_id,
                        report.eta_s,
                    )
                events = core.report(report, time.monotonic())
                continue
            if work is not None and work.done():
                events, work, t0 = work.result(), None, started
                if read is not None and core.running is None and not read.done():
                    await _cancel(read)  # OPEN again: the read's idle deadline starts now
                    read = None
                continue  # act on the result before the next frame
            if read is None or not read.done():
                continue
            msg, read = read.result(), None
            if msg is None:  # idle past its deadline: the core closes it (idle_timeout)
                events, t0 = core.expire(time.monotonic()), time.perf_counter()
                continue
            if msg.type in _ENDED:
                return
            t0 = time.perf_counter()
            events = core.receive(msg.data, time.monotonic())
    finally:
        await _cancel(work)
        await _cancel(read)


def _open_slot(state: VerifierState, hello: Hello, tenant: str) -> Slot:
    """A new slot; a lost session kept for resumption gives up its own if none is free."""
    while True:
        try:
            return state.engine.open(hello, tenant)
        except NoFreeSlot:
            if not _make_room(state):
                raise


async def _adopt(
    state: VerifierState, ask: Adopt, hello: Hello, tenant: str
) -> tuple[Slot, list[int]] | None:
    """The lost session ``ask`` names, if it is kept and of this tenant: its slot, handed to
    the new session with its cache cut to what the edge has committed, and the tokens kept."""
    parked = state.parked.get(ask.token)
    if parked is None:
        state.metrics.resume_misses.inc(reason="unknown")
        return None
    if not secrets.compare_digest(parked.tenant, tenant):
        # Never across tenants; the session stays kept for its own edge.
        state.metrics.resume_misses.inc(reason="tenant")
        return None
    _unpark(state, ask.token, None)
    slot = parked.slot
    try:
        tokens = await state.engine.call(lambda: state.engine.adopt(slot, hello, ask.length))
    except Exception as e:
        log.info("resuming a lost session failed (%s): a new session instead", e)
        state.engine.release(slot)
        state.metrics.resume_misses.inc(reason="failed")
        return None
    state.metrics.sessions_resumed.inc()
    state.metrics.resumed_tokens.inc(len(tokens))
    return slot, tokens


async def _run_session(peer: _Stream, state: VerifierState, tenant: str = "") -> None:
    s = state.settings
    token = secrets.token_hex(16) if s.resume_grace > 0 else None
    core = _new_core(state, token)
    try:
        first = await asyncio.wait_for(peer.receive(), s.handshake_timeout)
    except asyncio.TimeoutError:
        err = Error(ErrorCode.BAD_HANDSHAKE, f"no Hello within {s.handshake_timeout} s", fatal=True)
        state.metrics.sessions_refused.inc(reason=err.code)
        await _fatal(peer, state, Close(err), core)
        return
    if first.type != WSMsgType.BINARY:
        return  # ended before saying anything
    events = core.receive(first.data, time.monotonic())
    if core.closed or core.hello is None:
        for ev in events:
            if isinstance(ev, Note):
                _note(state, core, ev, None)
            elif isinstance(ev, Close):
                await _fatal(peer, state, ev, core)
        return
    if peer.ticket is not None and not await _wait_turn(peer, state, core):
        return  # ended, or refused by the service's status, while it waited in line
    slot: Slot | None = None
    ask = next((ev for ev in events if isinstance(ev, Adopt)), None)
    if ask is not None:
        adopted = await _adopt(state, ask, core.hello, tenant)
        slot = None if adopted is None else adopted[0]
        events = core.adopted(None if adopted is None else adopted[1])
    if slot is None:
        slot = _open_slot(state, core.hello, tenant)
    live = LiveSession(core, slot)
    state.sessions[core.session_id] = live
    state.metrics.sessions.inc()
    state.metrics.sessions_active.set(len(state.sessions))
    h = core.hello
    log.info(
        "session %s open (%s, %s, %s%s)",
        core.session_id,
        h.reply_mode,
        h.correction,
        h.sampling,
        f", resumed {core.resumed} tokens" if core.resumed else "",
    )
    # Kept for resumption when the connection was lost (or the edge ended the stream
    # abnormally), not when the edge ended it normally (End 1000: it is done) or this side
    # ended it (a slow reader, an internal error, or the core's own close).
    ours = False
    try:
        await _session_loop(peer, state, live, events)
    except SlowReader as e:
        ours = True
        await peer.conn.slow_reader(e)
    except ConnectionError:
        log.info("session %s: connection lost", core.session_id)
    except Exception as e:
        ours = True
        log.exception("session %s: internal error", core.session_id)
        err = Error(
            ErrorCode.INTERNAL,
            f"internal error ({type(e).__name__}); see the verifier's log",
            fatal=True,
        )
        await _fatal(peer, state, Close(err, WSCloseCode.INTERNAL_ERROR), core)
    finally:
        del state.sessions[core.session_id]
        lost = not ours and not core.closed and peer.lost
        lost = lost and core.hello.resumable  # an edge that cannot resume gets nothing kept
        kept = lost and token is not None and _park(state, token, slot, tenant)
        if not kept:
            state.engine.release(live.slot)
        state.metrics.sessions_active.set(len(state.sessions))
        live.logs.flush(log, logging.INFO, f"session {core.session_id}")
        how = "lost (kept for resumption)" if kept else "ended"
        log.info("session %s %s", core.session_id, how)
