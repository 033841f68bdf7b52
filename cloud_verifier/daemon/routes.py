"""The HTTP routes: ``/v1/session`` (the WebSocket upgrade: the bearer token, the service's status,
capacity and the subprotocol are checked before the connection is served), ``/health`` and
``/metrics``, and the middleware that tells the connection guard a request has started.
Invariants: nothing is created for a session request before its token checks out; every refused
session request is counted by its reason and names it in the ``X-Wanspec-Refusal`` header (an
edge cannot read the body of a refused upgrade); ``state.connections``, ``state.per_token``,
``state.websockets`` and ``state.ws_token`` are raised and lowered here alone, around one
connection's life.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from cloud_verifier.daemon.admission import (
    line_refusal,
    must_wait,
    not_ready_code,
    update_token_metrics,
)
from cloud_verifier.daemon.connection import serve_connection
from cloud_verifier.daemon.lifecycle import check_engine
from cloud_verifier.daemon.parking import kept_count
from cloud_verifier.daemon.state import LOG_NAME, STATE, Connection, VerifierState
from shared.errors import ErrorCode
from shared.service.metrics import CONTENT_TYPE
from shared.service.status import ServiceStatus
from shared.wire.messages import SUBPROTOCOL
from shared.wire.mux import MAX_PREFIX, OLD_SUBPROTOCOLS, old_protocol_message

log = logging.getLogger(LOG_NAME)

#: The header that names why a session request was refused (an edge cannot read the body of a
#: refused WebSocket upgrade): loading, stopping, busy, overloaded, kv_full, token_limit, ...
REFUSAL_HEADER = "X-Wanspec-Refusal"


@web.middleware
async def guard_middleware(
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
    check_engine(state)
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
    update_token_metrics(state)
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
    check_engine(state)
    if state.status != ServiceStatus.READY:
        # Loading or draining: busy, come back (Retry-After). Failed (the model did not load,
        # or the engine died): down, no Retry-After, so an edge counts it as down.
        failed = state.status == ServiceStatus.FAILED
        raise _refuse(
            state,
            not_ready_code(state.status),
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
    kept = kept_count(state, key)
    refusal = None
    cause = None if kept else must_wait(state, key, make_room=False)
    if cause is not None:
        refusal = line_refusal(state, key, cause)
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
        autoping=False,  # pings are answered by serve_connection, within the frame budget
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
    conn: Connection | None = None
    try:
        await ws.prepare(request)
        state.websockets[ws] = request.transport
        state.ws_token[ws] = key
        conn = Connection(ws, request.transport, state)
        state.conns.add(conn)
        await serve_connection(conn, key)
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
