"""Connections before they reach a handler: a header-read timeout and caps, enforced before any
authentication work. Both HTTP services use it: the verifier (``cloud_verifier.daemon.app``) and the
edge's local API (``edge_agent.daemon.server``). The service layer of ``shared/``: asyncio and
aiohttp.

aiohttp reads a request's headers with no time limit of its own: a client that sends half a
request line holds its connection (and a file descriptor) until the keep-alive timeout, an hour
by default; enough of them exhaust the process's descriptors and nothing else gets in, /health
included. :class:`ConnectionGuard` wraps the server's protocol factory. A connection is *pending*
from ``connection_made`` until a request reaches the application (its headers are complete:
:meth:`ConnectionGuard.request_started`, called by a middleware), and again once that request is
done and the connection idles in keep-alive. A pending connection

* that has sent nothing is closed silently after ``header_timeout`` seconds (idle in keep-alive
  or never used);
* that has sent part of a request is answered 408 and closed ``header_timeout`` seconds after
  that request's first byte. The clock restarts at the first byte, so a request that arrives as
  the idle limit runs out is served, never answered 408 (its bytes and the timer can be seen in
  the same event-loop iteration, before aiohttp's handler has told the guard that it started).
  A pending connection is so held at most ``2 × header_timeout``;
* counts against ``max_pending_per_address`` per client address: a connection over it is
  answered 503 and closed at once, before a byte of it is parsed;
* counts against ``max_pending`` in all: when the table is full, a new connection evicts the
  oldest pending one if that has waited at least ``min(1 s, header_timeout / 2)`` (an honest
  client sends its headers within a round trip; a slow or half-sent request is what waits), and
  is refused (503) otherwise. Many addresses together cannot lock everyone else out for longer
  than that: they would have to open ``max_pending`` connections per ``min_age`` to keep a new
  client from being admitted.

A WebSocket session is not pending: it is bounded by the service's own limits and timeouts.

:class:`Listener` binds the listening sockets *before* the application starts (a port in use is
an error before the model loads) and serves through the guard. :func:`http_logger` names the
logger given to aiohttp's request handlers: a malformed request (aiohttp answers it 400 itself)
is a rate-limited INFO line without a traceback instead of an ERROR with one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from shared.service.metrics import HttpMetrics
from shared.service.ratelog import LogLimiter

log = logging.getLogger(__name__)

_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nRetry-After: 1\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 29\r\n\r\ntoo many pending connections\n"
)
_TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
    b"Content-Type: text/plain\r\nContent-Length: 34\r\n\r\nrequest headers not sent in time\r\n"
)


def _address(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, (tuple, list)) and peer:
        return str(peer[0])
    return "local"  # a Unix socket, or a peer already gone


@dataclass(eq=False)
class _Conn:
    transport: asyncio.BaseTransport
    address: str
    pending: bool = False
    #: Bytes of a request arrived since it became pending (its timer then runs from the first).
    got_bytes: bool = False
    since: float = 0.0  # loop time it became pending (the eviction order's age)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


@dataclass(eq=False, kw_only=True)
class ConnectionGuard:
    """Counts and times pending connections (module docstring). One per app."""

    header_timeout: float
    max_pending: int
    max_pending_per_address: int
    metrics: HttpMetrics | None = None
    logger: logging.Logger = log
    pending: int = field(default=0, init=False)
    per_address: dict[str, int] = field(default_factory=dict, init=False)
    timeouts: int = field(default=0, init=False)
    evicted: int = field(default=0, init=False)
    refused: dict[str, int] = field(default_factory=dict, init=False)
    _conns: dict[asyncio.BaseTransport, _Conn] = field(default_factory=dict, init=False)
    _order: dict[_Conn, None] = field(default_factory=dict, init=False)  # pending, oldest first
    _refusal_log: LogLimiter = field(default_factory=LogLimiter, init=False)

    @property
    def min_age(self) -> float:
        """A pending connection at least this old is evicted for a new one when all are taken."""
        return min(1.0, self.header_timeout / 2)

    def wrap(self, make: Callable[[], asyncio.BaseProtocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory that guards the protocols ``make`` builds."""

        def build() -> asyncio.Protocol:
            return _GuardedProtocol(self, make)

        return build

    # ------------------------------------------------------------------ the protocol's side

    def admit(self, transport: asyncio.BaseTransport) -> _Conn | None:
        """A new connection: counted and timed, or refused (answered 503 and closed)."""
        address = _address(transport)
        reason = None
        if self.per_address.get(address, 0) >= self.max_pending_per_address:
            reason = "max_pending_per_address"
        elif self.pending >= self.max_pending:
            oldest = next(iter(self._order), None)
            loop = asyncio.get_running_loop()
            if oldest is not None and loop.time() - oldest.since >= self.min_age:
                self._evict(oldest)
            else:
                reason = "max_pending_connections"
        if reason is not None:
            self.refused[reason] = self.refused.get(reason, 0) + 1
            if self.metrics is not None:
                self.metrics.http_refused.inc(reason=reason)
            self._refusal_log.log(
                self.logger,
                logging.WARNING,
                "refused a connection from %s: %s reached",
                address,
                reason,
            )
            if isinstance(transport, asyncio.WriteTransport):
                transport.write(_REFUSED)
            transport.close()
            return None
        conn = _Conn(transport, address)
        self._conns[transport] = conn
        self._pend(conn)
        return conn

    def lost(self, conn: _Conn) -> None:
        self._unpend(conn)
        self._conns.pop(conn.transport, None)

    def received(self, conn: _Conn) -> None:
        """Bytes arrived. The first ones of a pending connection start its request: the 408
        timer restarts from now (idle time before a request is never counted against its
        headers; so a request that arrives as the idle timer fires is served)."""
        if not conn.pending or conn.got_bytes:
            return
        conn.got_bytes = True
        if conn.timer is not None:
            conn.timer.cancel()
        conn.timer = asyncio.get_running_loop().call_later(self.header_timeout, self._expire, conn)

    # ------------------------------------------------------------------ the application's side

    def request_started(self, transport: asyncio.BaseTransport | None) -> None:
        """A request's headers are complete and it reaches the application."""
        conn = self._conns.get(transport) if transport is not None else None
        if conn is not None:
            self._unpend(conn)

    def request_finished(self, transport: asyncio.BaseTransport | None) -> None:
        """The request is handled; a connection kept alive is pending again (for its next
        request's headers)."""
        conn = self._conns.get(transport) if transport is not None else None
        if conn is not None and not conn.transport.is_closing():
            self._pend(conn)

    # ------------------------------------------------------------------ accounting

    def _pend(self, conn: _Conn) -> None:
        if conn.pending:
            return
        loop = asyncio.get_running_loop()
        conn.pending, conn.got_bytes, conn.since = True, False, loop.time()
        self.pending += 1
        self.per_address[conn.address] = self.per_address.get(conn.address, 0) + 1
        self._order[conn] = None
        conn.timer = loop.call_later(self.header_timeout, self._expire, conn)
        self._gauge()

    def _unpend(self, conn: _Conn) -> None:
        if not conn.pending:
            return
        conn.pending = False
        self.pending -= 1
        del self._order[conn]
        left = self.per_address[conn.address] - 1
        if left:
            self.per_address[conn.address] = left
        else:
            del self.per_address[conn.address]
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        self._gauge()

    def _expire(self, conn: _Conn) -> None:
        """``header_timeout`` passed: with nothing sent since the connection became pending
        (idle), or since the first byte of a request whose headers are still incomplete (408)."""
        conn.timer = None
        t = conn.transport
        if not conn.pending or t.is_closing():
            return
        self.timeouts += 1
        if self.metrics is not None:
            self.metrics.header_timeouts.inc()
        if conn.got_bytes and isinstance(t, asyncio.WriteTransport):
            t.write(_TIMED_OUT)
        t.close()  # connection_lost follows and un-counts it

    def _evict(self, conn: _Conn) -> None:
        """Make room: close the oldest pending connection (503), un-counted at once."""
        self._unpend(conn)
        self.evicted += 1
        if self.metrics is not None:
            self.metrics.http_evicted.inc()
        self._refusal_log.log(
            self.logger,
            logging.WARNING,
            "max_pending_connections reached: closed the oldest pending connection (from %s)",
            conn.address,
        )
        t = conn.transport
        if isinstance(t, asyncio.WriteTransport) and not t.is_closing():
            t.write(_REFUSED)
        t.close()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.http_pending.set(self.pending)


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's request handler behind the guard: admitted connections are passed through."""

    def __init__(self, guard: ConnectionGuard, make: Callable[[], asyncio.BaseProtocol]) -> None:
        self._guard = guard
        self._make = make
        self._inner: asyncio.Protocol | None = None
        self._conn: _Conn | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        conn = self._guard.admit(transport)
        if conn is None:
            return
        self._conn = conn
        inner = self._make()
        assert isinstance(inner, asyncio.Protocol)
        self._inner = inner
        inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._conn is not None:
            self._guard.received(self._conn)
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._conn is not None:
            self._guard.lost(self._conn)
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


@dataclass(eq=False)
class Listener:
    """The listening sockets of one runner, bound by :meth:`bind` (which raises ``OSError``,
    e.g. EADDRINUSE) before the runner is set up, serving through ``guard`` from :meth:`start`."""

    guard: ConnectionGuard
    host: str
    port: int
    _: KW_ONLY
    ssl_context: ssl.SSLContext | None = None
    backlog: int = 128
    _server: asyncio.base_events.Server | None = field(default=None, init=False)
    _make: Callable[[], asyncio.BaseProtocol] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._factory = self.guard.wrap(self._handler)

    def _handler(self) -> asyncio.BaseProtocol:
        assert self._make is not None, "Listener.start() not called"
        return self._make()

    async def bind(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._factory,
            self.host,
            self.port,
            ssl=self.ssl_context,
            backlog=self.backlog,
            start_serving=False,
            ssl_handshake_timeout=self.guard.header_timeout if self.ssl_context else None,
        )

    async def start(self, runner: web.BaseRunner) -> None:
        """Serve ``runner`` (set up already) on the bound sockets."""
        if self._server is None:
            await self.bind()
        assert self._server is not None
        server = runner.server
        if server is None:
            raise RuntimeError("call runner.setup() before Listener.start()")
        self._make = server
        await self._server.start_serving()

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """(host, port) of each listening socket."""
        if self._server is None:
            return []
        out: list[tuple[str, int]] = []
        for sock in self._server.sockets:
            name = sock.getsockname()
            out.append((str(name[0]), int(name[1])))
        return out

    def close(self) -> None:
        """Stop accepting (connections already accepted are the runner's to close)."""
        if self._server is not None:
            self._server.close()

    async def wait_closed(self, timeout: float = 1.0) -> None:
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), timeout)


class MalformedRequests(logging.Filter):
    """aiohttp logs every request it cannot parse (a 400 it sends itself) as an ERROR with a
    traceback: hostile clients could fill the log at will. Those become one INFO line each, at
    most 5 a minute; a real error (a 500) keeps its ERROR and traceback."""

    def __init__(self) -> None:
        super().__init__()
        self._limit = LogLimiter()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno < logging.ERROR or not isinstance(exc, HttpProcessingError):
            return True
        if not 400 <= exc.code < 500:
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.INFO):
            return False
        if not self._limit.allow():
            return False
        text = f"{record.getMessage()}: malformed request, answered {exc.code} ({exc.message!r})"
        if self._limit.suppressed:
            text += f" ({self._limit.suppressed} similar line(s) suppressed)"
            self._limit.suppressed = 0
        record.msg, record.args = text, ()
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info, record.exc_text = None, None
        return True


def http_logger(name: str) -> logging.Logger:
    """The logger ``name`` with a :class:`MalformedRequests` filter (added once), for
    ``web.AppRunner(..., logger=...)``."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, MalformedRequests) for f in logger.filters):
        logger.addFilter(MalformedRequests())
    return logger
