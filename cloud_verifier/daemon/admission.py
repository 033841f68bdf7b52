"""Admission and tenancy: whether and when a session may start. A new session is refused by the
service's status (loading, stopping, failed), its bearer token's cap (``max_sessions_per_token``)
or a full admission line; one that may start but cannot now (slots, KV pages, a deep model queue)
waits in the line (:class:`~cloud_verifier.session.admission.AdmissionLine`), told its place by
Progress frames, and is started in the line's order by :func:`pump_line`. The tenants' bearer tokens
live here too: the token file's poll and reload, and the closing of a revoked token's sessions.
Invariants: ``state.streams`` and ``state.token_streams`` count the admitted sessions not yet
over (raised by :func:`admit` alone); a waiting session holds a ticket and its stream in
``state.waiting`` until it is admitted or leaves; the line's head is never overtaken; live plus
kept sessions of a token stay within its cap (its own kept ones are dropped first); the token
poll task is owned by :func:`token_ctx`, which also cancels and awaits ``state.closers`` at the
end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator

from aiohttp import WSCloseCode, web

from cloud_verifier.daemon.lifecycle import check_engine
from cloud_verifier.daemon.parking import drop_oldest_kept, kept_count, unpark
from cloud_verifier.daemon.state import (
    LOG_NAME,
    STATE,
    Stream,
    VerifierState,
    close_reason,
    close_websocket,
    send_message,
)
from cloud_verifier.session.core import VerifierCore
from shared.errors import ErrorCode
from shared.service.status import ServiceStatus
from shared.wire.messages import Error, Progress

log = logging.getLogger(LOG_NAME)


def not_ready_code(status: ServiceStatus) -> ErrorCode:
    """Why a verifier that is not ready refuses a session (on HTTP and on a stream alike):
    it failed (down: no Retry-After), or it is loading or stopping (busy: come back)."""
    if status == ServiceStatus.FAILED:
        return ErrorCode.INTERNAL
    return ErrorCode.STOPPING if status == ServiceStatus.STOPPING else ErrorCode.LOADING


def session_refusal(state: VerifierState, key: str, *, resuming: bool = False) -> Error | None:
    """Why a new session of token ``key`` is refused now, whatever the load (a fatal Error:
    with Retry-After the service is loading or stopping, busy not down; without one it
    failed), or None: it may start, or wait in the admission line for its turn.

    ``resuming``: its Hello resumes a session kept for this token (:func:`resumes_kept`); that
    session holds its slot and pages already, so it is refused only when the service is not
    ready. The per-token cap counts the token's live and waiting sessions (a quota, not a
    wait: 429-like ``token_limit``)."""
    s = state.settings
    check_engine(state)
    if state.status == ServiceStatus.FAILED:
        return Error(not_ready_code(state.status), f"the verifier failed: {state.reason}", True)
    if state.status != ServiceStatus.READY:
        code = not_ready_code(state.status)
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


def must_wait(state: VerifierState, key: str, *, make_room: bool = True) -> Error | None:
    """Why a session of token ``key`` that may start (:func:`session_refusal`) cannot start now, or
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
        while live + kept_count(state, key) >= cap and kept_count(state, key):
            unpark(state, next(t for t, p in state.parked.items() if p.tenant == key), "token")
    if state.streams >= s.max_sessions:
        return Error(ErrorCode.BUSY, f"session limit {s.max_sessions} reached", True, 1.0)
    if state.engine.pages_free == 0 and not (
        drop_oldest_kept(state) if make_room else state.parked
    ):
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


def line_refusal(state: VerifierState, key: str, cause: Error | None) -> Error | None:
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


def admit(state: VerifierState, st: Stream, tenant: str) -> None:
    """``st``'s session starts: it counts against max_sessions and its token's cap."""
    st.admitted_at = time.monotonic()
    state.streams += 1
    state.token_streams[tenant] = state.token_streams.get(tenant, 0) + 1


def pump_line(state: VerifierState) -> None:
    """Start waiting sessions, in the line's order, while the next one can start (called
    whenever a session ends, one joins, or a waiting one's Progress is due). The head that
    cannot start holds the line: nobody overtakes it."""
    line = state.line
    while line and state.status == ServiceStatus.READY:
        head = line.order(state.token_streams)[0]
        if must_wait(state, head.tenant) is not None:
            break
        line.start(head)
        st = state.waiting.pop(head)
        st.ticket = None
        admit(state, st, head.tenant)
        state.metrics.admission_wait.observe(max(0.0, time.monotonic() - head.at))
        st.wake()
    if state.status != ServiceStatus.READY:
        for st in state.waiting.values():
            st.wake()  # each sees the status and is refused
    state.metrics.admission_waiting.set(len(line))


async def wait_turn(peer: Stream, state: VerifierState, core: VerifierCore) -> bool:
    """Wait in the admission line until this session's turn comes (True), its stream ends, or
    the service stops (False: it was told why). Every ``progress_interval`` s the line is
    looked at again and, if the edge asked for them, a Progress frame tells it its place
    (``ahead``: sessions that start before it), the engine's steps (it moves) and the
    expected wait."""
    s = state.settings
    hello = core.hello
    assert hello is not None
    while True:
        pump_line(state)
        if peer.ticket is None and peer.admitted_at is not None:
            core.admitted(time.monotonic())
            return True
        if peer.close_code is not None:
            return False
        err = session_refusal(state, "", resuming=True)  # the service's status
        if err is not None or peer.ticket is None:
            err = err or Error(ErrorCode.INTERNAL, "left the admission line", True)
            await send_message(peer, state, err, core)
            await peer.close(WSCloseCode.TRY_AGAIN_LATER, err.code)
            return False
        if hello.progress:
            place = state.line.place(peer.ticket, state.token_streams)
            eta = state.line.eta_s(place, state.streams)
            eta_ms = min(2**32 - 1, round(1000 * eta))
            steps = state.engine.steps % 2**32
            await send_message(peer, state, Progress(steps, place, eta_ms, False), core)
            state.metrics.progress_frames.inc()
        peer.turn = asyncio.get_running_loop().create_future()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(peer.turn), s.progress_interval)


# ---------------------------------------------------------------------------- the tenants' tokens


async def _poll_tokens(state: VerifierState, interval: float) -> None:
    """Re-read the token file every ``interval`` s even with no request coming in, so a revoked
    token's sessions are closed and a broken file is reported within ``interval``."""
    while True:
        await asyncio.sleep(interval)
        state.auth.refresh()
        update_token_metrics(state)


async def token_ctx(app: web.Application) -> AsyncIterator[None]:
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
    update_token_metrics(state)
    log.info(
        "%s: token file re-read: %d token(s)%s%s",
        why,
        state.auth.count,
        "" if changed else ", unchanged",
        f"; PROBLEM: {state.auth.error}" if state.auth.error else "",
    )


def update_token_metrics(state: VerifierState) -> None:
    auth, m = state.auth, state.metrics
    m.tokens_configured.set(auth.count if auth.enabled else 0)
    m.token_file_ok.set(0 if auth.error else 1)
    m.token_reloads.follow(auth.reloads)
    m.token_file_errors.follow(auth.errors)


def _revoke(state: VerifierState, keys: frozenset[str]) -> None:
    """Tokens were removed from the token file: close the connections they authenticated, and
    with them every session they carry (1008, token_revoked)."""
    doomed = [(ws, t) for ws, t in state.websockets.items() if state.ws_token.get(ws) in keys]
    n = len(doomed)
    log.info(
        "%s %s removed from the token file: closing %d %s that used %s",
        "token" if len(keys) == 1 else "tokens",
        ", ".join(sorted(keys)),
        n,
        "connection" if n == 1 else "connections",
        "it" if len(keys) == 1 else "them",
    )
    reason = close_reason("token_revoked: this session's bearer token is no longer accepted")
    for ws, transport in doomed:
        state.metrics.sessions_revoked.inc()
        task = asyncio.get_running_loop().create_task(
            close_websocket(ws, transport, state, WSCloseCode.POLICY_VIOLATION, reason)
        )
        state.closers.add(task)
        task.add_done_callback(state.closers.discard)
