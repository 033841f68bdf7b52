"""The connection and its streams: serving one upgraded WebSocket, which carries an edge's sessions
as streams (:mod:`shared.wire.mux`). It sends the Ready frame, reads the connection's messages,
answers its pings, holds pings and control frames to the connection's frame budget and hands each
stream's frames to its session; a stream that opens is admitted, put in the admission line or
refused (:mod:`cloud_verifier.daemon.admission`). Invariants: each session runs in a task owned
by its connection (``Connection.tasks``), awaited (cancelled past ``close_timeout``) when the
connection ends; every stream sees its end before the connection is done (kept for resumption
unless its edge ended it); a stream's task, as it ends, gives back what it held (its place in
line or its admission) and lets the next waiting session start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiohttp import WSCloseCode, WSMsgType

from cloud_verifier.daemon.admission import (
    admit,
    line_refusal,
    must_wait,
    pump_line,
    session_refusal,
)
from cloud_verifier.daemon.parking import resumes_kept
from cloud_verifier.daemon.session_loop import ENDED, run_session
from cloud_verifier.daemon.state import (
    LOG_NAME,
    Connection,
    SlowReader,
    Stream,
    VerifierState,
    send_error,
)
from cloud_verifier.session.admission import Ticket
from cloud_verifier.session.limits import context_limit
from shared.errors import ErrorCode
from shared.wire.messages import Error
from shared.wire.mux import (
    Data,
    End,
    MuxError,
    MuxEvent,
    Opened,
    Overflow,
    Ready,
    Refused,
    encode_control,
)

log = logging.getLogger(LOG_NAME)


async def serve_connection(conn: Connection, tenant: str) -> None:
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
            if msg.type in ENDED:
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


async def _rate_limited(conn: Connection) -> None:
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


async def _await_sessions(conn: Connection) -> None:
    """Let the sessions see their end and park (bounded: then they are cancelled)."""
    if not conn.tasks:
        return
    _, pending = await asyncio.wait(set(conn.tasks), timeout=conn.state.settings.close_timeout)
    for t in pending:
        t.cancel()
    for t in list(conn.tasks):
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


async def _on_mux_event(conn: Connection, tenant: str, ev: MuxEvent) -> None:
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
        resuming = resumes_kept(state, ev.payload, tenant)
        refusal = session_refusal(state, tenant, resuming=resuming)
        ticket: Ticket | None = None
        if refusal is None and not resuming:
            cause = None if state.line else must_wait(state, tenant)
            if state.line or cause is not None:
                refusal = line_refusal(state, tenant, cause)
                if refusal is None:
                    ticket = state.line.join(tenant, time.monotonic())
        if refusal is not None:
            await _refuse_stream(conn, ev.stream, refusal)
            return
        st = conn.streams[ev.stream] = Stream(conn, ev.stream)
        if ticket is None:
            admit(state, st, tenant)
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
        await send_error(conn, ev.stream, err)
        await conn.end(ev.stream, WSCloseCode.POLICY_VIOLATION, "flow_control")


async def _refuse_stream(conn: Connection, stream: int, err: Error) -> None:
    """A new session refused: its Error (with Retry-After) and the stream's End."""
    state = conn.state
    state.metrics.sessions_refused.inc(reason=err.code)
    state.refusal_log.log(log, logging.INFO, "refused a session: %s (%s)", err.code, err.message)
    await send_error(conn, stream, err)
    await conn.end(stream, WSCloseCode.TRY_AGAIN_LATER, err.code)


async def _stream_task(st: Stream, tenant: str) -> None:
    conn, state = st.conn, st.conn.state
    try:
        await run_session(st, state, tenant)
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
        pump_line(state)  # a slot (or a place in line) is free: the next session's turn may come


def _count_in(state: VerifierState, data: bytes | str) -> None:
    state.metrics.frames_received.inc()
    state.metrics.bytes_received.inc(len(data) if isinstance(data, bytes) else len(data.encode()))
