"""What every part of the verifier service shares: :class:`VerifierState` (one per application,
under the :data:`STATE` key), the records it keeps (an open session, :class:`LiveSession`; a lost
one kept for resumption, :class:`Parked`) and the connection objects it holds: :class:`Connection`,
an upgraded WebSocket with its streams' rules (:class:`~shared.wire.mux.ServerMux`), and
:class:`Stream`, one session's view of its stream. Invariants: the state is reached only
through ``app[STATE]`` or an object that holds it (no module keeps any of it); every send to a
peer is bounded in time (``send_timeout``) and in the bytes it leaves queued
(``max_send_buffer``): past either the peer is a :class:`SlowReader`; every close is bounded in
time (``close_timeout``, then a transport with unread bytes is aborted); nothing here starts a
background task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import WSCloseCode, WSMessage, WSMsgType, web

from cloud_verifier.daemon.auth import Authenticator
from cloud_verifier.daemon.metrics import VerifierMetrics
from cloud_verifier.daemon.settings import VerifierSettings
from cloud_verifier.engine.engine import Engine
from cloud_verifier.engine.kv_manager import KVManager, Slot
from cloud_verifier.engine.targets import Target
from cloud_verifier.session.admission import AdmissionLine, Ticket
from cloud_verifier.session.core import VerifierCore
from cloud_verifier.session.limits import SessionLimits
from shared.errors import WanspecError
from shared.service.http_guard import ConnectionGuard
from shared.service.ratelog import LogLimiter
from shared.service.sdnotify import Notifier
from shared.service.status import ServiceStatus
from shared.wire.codec import encode
from shared.wire.messages import Error, Message
from shared.wire.mux import End, ServerMux, encode_control, frame, stream_window

#: The name of the logger of the service's own lines, one for all its parts (the name its lines
#: carry, and that a log configuration filters on).
LOG_NAME = "cloud_verifier.daemon.app"

log = logging.getLogger(LOG_NAME)


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
    refusal_log: LogLimiter = field(default_factory=LogLimiter)
    #: Set whenever ``status`` changes (serve() waits on it).
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Lost sessions kept for resumption, by resume token, oldest first. Invariant (between
    #: admissions): per token key, live streams plus kept sessions are at most
    #: max_sessions_per_token; the kept ones' pages (counted now, not when they were kept) at
    #: most resume_pages_share of the pool, checked at each park and each reap.
    parked: OrderedDict[str, Parked] = field(default_factory=OrderedDict)
    #: Upgraded connections (to fail their sessions when the engine dies).
    conns: set[Connection] = field(default_factory=set)
    #: The engine's thread was found dead (once; ``_engine_died`` acted on it).
    engine_dead: bool = False
    #: Sessions waiting for their turn to start (the admission line), and each one's stream.
    line: AdmissionLine = field(default_factory=lambda: AdmissionLine(0, 1))
    waiting: dict[Ticket, Stream] = field(default_factory=dict)

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
    logs: LogLimiter = field(default_factory=LogLimiter)


# ---------------------------------------------------------------------------- connection objects


def close_reason(text: str) -> bytes:
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


async def close_websocket(
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


class Connection:
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
        self.streams: dict[int, Stream] = {}
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
        await close_websocket(self.ws, self.transport, self.state, code, close_reason(reason))

    async def slow_reader(self, e: SlowReader) -> None:
        self.state.metrics.slow_readers.inc()
        log.warning("closing a connection that does not read: %s", e)
        await self.close(WSCloseCode.POLICY_VIOLATION, f"slow_reader: {e}")
        _abort(self.transport)


#: A session's inbound queue: its frames, then (once it is over) how it ended.
_Inbox = asyncio.Queue[WSMessage]


class Stream:
    """One session on a connection, as the session loop sees its peer: frames in order (from
    the connection's reader), a send that prefixes its stream id, a close that ends only it."""

    def __init__(self, conn: Connection, stream: int) -> None:
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


async def send_error(conn: Connection, stream: int, err: Error) -> None:
    conn.state.metrics.errors_sent.inc(code=err.code)
    with contextlib.suppress(ConnectionError):
        await conn.send(frame(stream, encode(err)))


async def send_message(
    peer: Stream, state: VerifierState, msg: Message, core: VerifierCore
) -> None:
    if isinstance(msg, Error):
        state.metrics.errors_sent.inc(code=msg.code)
    await peer.send(encode(msg) if core.ctx is None else encode(msg, core.ctx))
