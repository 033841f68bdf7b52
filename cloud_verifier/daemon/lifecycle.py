"""The service's life: the model's load in the background (the port listens meanwhile; /health
says loading), the watch on the engine's thread (its death fails every open session and leaves
the service FAILED), the systemd watchdog, the drain before a shutdown and the shutdown's close
of every connection (and so of every session). Invariants: each background task (the load, the
engine monitor, the watchdog) is created and cancelled-and-awaited by one cleanup context
(:func:`engine_ctx`, :func:`watchdog_ctx`); the tasks that close connections (a dead engine's,
a drain's) are kept in ``VerifierState.closers`` (which the token context cancels and awaits at
the end); the engine's death is acted on once (``engine_dead``), and never while the service
stops, when its end is expected; the watchdog is fed from the engine's own beat, never from a
call that would queue behind its work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import Enum

from aiohttp import WSCloseCode, web

from cloud_verifier.daemon.state import (
    LOG_NAME,
    STATE,
    Connection,
    VerifierState,
    close_websocket,
    send_error,
)
from cloud_verifier.engine.engine import EngineHealth
from shared.errors import ErrorCode
from shared.runtime.device import DeviceUnavailable
from shared.service.status import ServiceStatus
from shared.wire.messages import Error

log = logging.getLogger(LOG_NAME)

#: How often the engine's health is read for its death (seconds): /health, new sessions and
#: the handlers read it on their own too, so this bounds only how soon idle sessions learn it.
ENGINE_CHECK_S = 0.25


# ---------------------------------------------------------------------------- the model's load


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


async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
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


def check_engine(state: VerifierState) -> bool:
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

    async def fail(conn: Connection) -> None:
        for st in list(conn.streams.values()):
            st.ended_here = True  # not lost: nothing is kept for an engine that is gone
            await send_error(conn, st.stream, err)
            await conn.end(st.stream, WSCloseCode.INTERNAL_ERROR, err.code)
            st.finish(WSCloseCode.INTERNAL_ERROR, err.message)
        await conn.close(WSCloseCode.INTERNAL_ERROR, f"{err.code}: {err.message}")

    await asyncio.gather(*(fail(c) for c in list(state.conns)), return_exceptions=True)


async def _engine_monitor(state: VerifierState) -> None:
    """Read the engine's health every ``ENGINE_CHECK_S`` s (no call: nothing queues behind
    work), so that its death is acted on within that bound even with no request coming in."""
    while check_engine(state):
        await asyncio.sleep(ENGINE_CHECK_S)


# ---------------------------------------------------------------------------- the watchdog


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


async def watchdog_ctx(app: web.Application) -> AsyncIterator[None]:
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


# ---------------------------------------------------------------------------- drain and shutdown


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


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


async def close_connections(app: web.Application) -> None:
    """At shutdown: close every upgraded connection (going away), whatever sessions it carries.
    An edge keeps its connection open between sessions (a warm link), so the line says how many
    connections are closed and, apart, how many sessions they cut: open (admitted) and waiting
    in the admission line."""
    state = app[STATE]
    state.set_status(ServiceStatus.STOPPING, "shutting down")
    sockets = list(state.websockets.items())
    if sockets:
        cut = [_count(state.streams, "open session")] if state.streams else []
        if state.waiting:
            cut.append(f"{len(state.waiting)} waiting in line")
        log.info(
            "closing %s (%s)",
            _count(len(sockets), "connection"),
            ", ".join(cut) if cut else "no open session",
        )
    await asyncio.gather(
        *(
            close_websocket(ws, transport, state, WSCloseCode.GOING_AWAY, b"server shutdown")
            for ws, transport in sockets
        ),
        return_exceptions=True,
    )
