"""The WebSocket link to a verifier (aiohttp client): a :class:`Connection` carries many
sessions, each a :class:`StreamTransport` (:mod:`shared.wire.mux`); a warm link keeps one
connection open between requests (:mod:`edge_agent.link.warm`)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from edge_agent.session.transport import LinkClosed
from edge_agent.session.transport import VerifierBusy as VerifierBusy
from shared.errors import ErrorCode, WanspecError
from shared.wire.messages import PROTOCOL_VERSION, SUBPROTOCOL, Welcome
from shared.wire.mux import (
    MAX_PREFIX,
    ClientMux,
    Data,
    End,
    MuxError,
    Ready,
    WindowUpdate,
    encode_control,
    frame,
)


class TokenRefused(WanspecError, PermissionError):
    """The verifier refused the token (HTTP 401/403): reconnecting will not help."""


class LinkRefused(WanspecError, RuntimeError):
    """A failure that waiting cannot clear (no such host, no WebSocket endpoint at that path):
    not retried, the message names the cause."""


#: The verifier's header naming why it refused a session (cloud_verifier.daemon.routes).
REFUSAL_HEADER = "X-Wanspec-Refusal"
#: Retry-After values past this are taken as this (seconds): a far date is not a plan.
MAX_RETRY_AFTER_S = 300.0


def retry_after_s(value: str | None) -> float | None:
    """Retry-After in seconds (delta-seconds only; an HTTP date or junk: None)."""
    if value is None or not value.strip().isdigit():
        return None
    return min(float(value.strip()), MAX_RETRY_AFTER_S)


class UntrustedCertificateError(LinkRefused):
    """The verifier's TLS certificate failed verification (not retried: pass its CA, e.g. with
    ``ssl=ssl.create_default_context(cafile=...)``, or reach it by a name its certificate
    holds). A refusal of the link, not of the token: nothing about the token is known yet."""


@dataclass(frozen=True)
class LinkSettings:
    url: str  # ws://host:port/v1/session or wss://...
    token: str
    heartbeat_s: float = 10.0  # ping interval; no pong within half of it closes the link
    connect_timeout_s: float = 10.0
    max_frame: int = 4 << 20
    ssl: ssl.SSLContext | bool = True  # True: verify the server certificate (default)


class Connection:
    """One WebSocket to a verifier carrying many sessions (:mod:`shared.wire.mux`): it reads
    every message in one task it owns and hands each stream's frames to its
    :class:`StreamTransport`; when the WebSocket goes (closed, a missed pong, a broken rule),
    every stream on it ends with :class:`LinkClosed`."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        ws: aiohttp.ClientWebSocketResponse[bool],
        mux: ClientMux,
        url: str,
    ) -> None:
        self._session = session
        self._ws = ws
        self.mux = mux
        self.url = url
        self._streams: dict[int, StreamTransport] = {}
        self._send_lock = asyncio.Lock()
        self.closed = asyncio.Event()
        self.why = ""
        self._reader = asyncio.ensure_future(self._read_loop())

    @property
    def ready(self) -> Ready:
        assert self.mux.ready is not None  # connect() waited for it
        return self.mux.ready

    @classmethod
    async def connect(cls, settings: LinkSettings) -> Connection:
        """Open the WebSocket and wait for the verifier's Ready (both within
        ``connect_timeout_s``)."""
        session, ws = await _upgrade(settings)
        mux = ClientMux()
        try:
            msg = await asyncio.wait_for(ws.receive(), settings.connect_timeout_s)
            if msg.type != aiohttp.WSMsgType.BINARY:
                raise LinkClosed(f"verifier at {settings.url} closed before it was ready")
            events = mux.receive(msg.data)
            if not events or not isinstance(events[0], Ready):
                raise LinkClosed(f"verifier at {settings.url} did not start with Ready")
        except asyncio.TimeoutError:
            await _drop(session, ws)
            raise LinkClosed(
                f"verifier at {settings.url} was not ready within {settings.connect_timeout_s:g} s"
            ) from None
        except MuxError as e:
            await _drop(session, ws)
            raise LinkClosed(f"verifier at {settings.url}: {e}") from e
        except BaseException:
            await _drop(session, ws)
            raise
        return cls(session, ws, mux, settings.url)

    def open_stream(self, *, owns_connection: bool = False) -> StreamTransport:
        """A new session's stream (no round trip: its first frame, the Hello, opens it)."""
        if self.closed.is_set():
            raise LinkClosed(f"connection to {self.url} closed: {self.why}")
        if self.mux.full:
            raise VerifierBusy(
                f"verifier at {self.url}: {self.ready.max_streams} sessions are open on this "
                "connection (its max_streams)",
                ErrorCode.BUSY,
                1.0,
            )
        sid = self.mux.open()
        st = StreamTransport(self, sid, owns_connection)
        self._streams[sid] = st
        return st

    async def send(self, data: bytes) -> None:
        if self.closed.is_set() or self._ws.closed:
            raise LinkClosed(f"connection closed: {self.why or 'closed'}")
        try:
            async with self._send_lock:
                await self._ws.send_bytes(data)
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as e:
            raise LinkClosed(f"send failed: {e}") from e

    def forget(self, sid: int) -> None:
        self._streams.pop(sid, None)

    async def _read_loop(self) -> None:
        why = "closed"
        try:
            while True:
                msg = await self._ws.receive()
                if msg.type != aiohttp.WSMsgType.BINARY:
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        why = "the verifier sent a text frame; wanspec frames are binary"
                        await self._ws.close(code=aiohttp.WSCloseCode.UNSUPPORTED_DATA)
                        return
                    extra = msg.extra or msg.data
                    reason = f" ({extra})" if extra else ""
                    why = f"{msg.type.name}{reason} code={self._ws.close_code}"
                    return
                for ev in self.mux.receive(msg.data):
                    if isinstance(ev, Data):
                        st = self._streams.get(ev.stream)
                        if st is not None:
                            st.deliver(ev.payload)
                    elif isinstance(ev, WindowUpdate):
                        st = self._streams.get(ev.stream)
                        if st is not None:
                            st.credited()
                    elif isinstance(ev, End):
                        st = self._streams.pop(ev.stream, None)
                        if st is not None:
                            st.finish(f"verifier ended the session ({ev.code}: {ev.reason})")
        except MuxError as e:
            why = f"the verifier broke the stream rules: {e}"
            with contextlib.suppress(Exception):
                await self._ws.close(code=aiohttp.WSCloseCode.POLICY_VIOLATION)
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as e:
            why = f"receive failed: {e}"
        finally:
            self.why = why
            self.closed.set()
            for st in list(self._streams.values()):
                st.finish(f"connection closed: {why}")
            self._streams.clear()

    async def close(self) -> None:
        """Close the WebSocket (every stream on it ends) and await the reader."""
        try:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._ws.close(), 2.0)
        finally:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            await self._session.close()


#: Frames one stream may hold unread on the edge (the reader never blocks on one session: a
#: verifier that floods a stream past it has that stream ended).
MAX_STREAM_BACKLOG = 4096


class StreamTransport:
    """One verifier session: a stream on a :class:`Connection`, as a Transport. ``welcome``
    is the Welcome the session will get (from the connection's Ready), so a new session can run
    from its first frame; ``close`` ends the stream without waiting for anything."""

    def __init__(self, conn: Connection, sid: int, owns_connection: bool = False) -> None:
        self.conn = conn
        self.sid = sid
        self._owns = owns_connection
        self._inbox: deque[bytes] = deque()
        self._changed = asyncio.Event()
        self._ended: str | None = None

    @property
    def welcome(self) -> Welcome:
        return self.conn.ready.welcome()

    def deliver(self, data: bytes) -> None:
        if len(self._inbox) >= MAX_STREAM_BACKLOG:
            self.finish(f"{MAX_STREAM_BACKLOG} frames unread: the verifier floods this session")
            return
        self._inbox.append(data)
        self._changed.set()

    def credited(self) -> None:
        self._changed.set()

    def finish(self, why: str) -> None:
        if self._ended is None:
            self._ended = why
        self._changed.set()

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def send(self, data: bytes) -> None:
        # Waits for the stream's window only: a session whose verifier reads slowly holds
        # itself up, never the others (their frames go on the same connection meanwhile).
        while self._ended is None and not self.conn.mux.may_send(self.sid, len(data)):
            await self._wait()
        if self._ended is not None:
            raise LinkClosed(self._ended)
        self.conn.mux.sent(self.sid, len(data))
        await self.conn.send(frame(self.sid, data))

    async def recv(self) -> bytes:
        while not self._inbox:
            if self._ended is not None:
                raise LinkClosed(self._ended)
            await self._wait()
        return self._inbox.popleft()

    async def close(self) -> None:
        """End the session (the verifier releases it: no resumption); no round trip."""
        self.finish("closed")
        self.conn.forget(self.sid)
        if self.conn.mux.end(self.sid):
            with contextlib.suppress(LinkClosed):
                await self.conn.send(encode_control(End(self.sid)))
        if self._owns:
            await self.conn.close()


class WebSocketTransport:
    """A cold session: a connection of its own with one stream on it (tools, tests, probes).
    The daemon keeps a :class:`~edge_agent.link.warm.WarmLink` instead."""

    @staticmethod
    async def connect(settings: LinkSettings) -> StreamTransport:
        conn = await Connection.connect(settings)
        return conn.open_stream(owns_connection=True)


async def _drop(session: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse[bool]) -> None:
    with contextlib.suppress(Exception):
        await ws.close()
    await session.close()


async def _upgrade(
    settings: LinkSettings,
) -> tuple[aiohttp.ClientSession, aiohttp.ClientWebSocketResponse[bool]]:
    """TCP (TLS), and the WebSocket upgrade; refusals mapped to the errors above."""
    # sock_read bounds the wait for the upgrade response (a stalled or black-holed link);
    # aiohttp lifts it once the WebSocket is open (the heartbeat watches the link then).
    timeout = aiohttp.ClientTimeout(
        total=None,
        sock_connect=settings.connect_timeout_s,
        sock_read=settings.connect_timeout_s,
    )
    session = aiohttp.ClientSession(timeout=timeout)
    try:
        ws = await session.ws_connect(
            settings.url,
            protocols=(SUBPROTOCOL,),
            headers={"Authorization": f"Bearer {settings.token}"},
            heartbeat=settings.heartbeat_s or None,  # 0 = no heartbeat
            max_msg_size=settings.max_frame + MAX_PREFIX,
            ssl=settings.ssl,
            compress=0,
        )
    except aiohttp.WSServerHandshakeError as e:
        await session.close()
        if e.status in (401, 403):
            raise TokenRefused(f"verifier at {settings.url} refused the token ({e.status})") from e
        headers: Mapping[str, str] = e.headers or {}
        # The verifier's reason, an ErrorCode value (a newer verifier's may be one this edge
        # does not know: it is shown as it came).
        reason = str(headers.get(REFUSAL_HEADER, "")).strip()[:64]
        after = retry_after_s(headers.get("Retry-After"))
        if e.status in (429, 503):
            why = reason or (ErrorCode.TOKEN_LIMIT if e.status == 429 else ErrorCode.UNAVAILABLE)
            message = f"verifier at {settings.url} {refusal_text(why, e.status)}"
            if after is not None:
                raise VerifierBusy(f"{message}; retry after {after:g} s", why, after) from e
            raise LinkClosed(message) from e
        if 400 <= e.status < 500:
            if reason == ErrorCode.SUBPROTOCOL:
                raise LinkRefused(
                    f"verifier at {settings.url} does not speak {SUBPROTOCOL} "
                    f"(protocol {PROTOCOL_VERSION}) ({e.status}): it runs another version "
                    "of wanspec; upgrade it or this edge so that both match"
                ) from e
            raise LinkRefused(
                f"verifier at {settings.url} answered {e.status} {e.message}: "
                "is the URL's path right (…/v1/session)?"
            ) from e
        raise LinkClosed(f"handshake with {settings.url} failed: {e.status} {e.message}") from e
    except aiohttp.ClientConnectorDNSError as e:
        await session.close()
        raise LinkRefused(f"cannot resolve the verifier's host in {settings.url}: {e}") from e
    except aiohttp.ClientConnectorCertificateError as e:
        await session.close()
        raise UntrustedCertificateError(
            f"verifier at {settings.url}: TLS certificate not trusted ({e.certificate_error}); "
            "give the edge the CA that signed it (ca_file), or connect by a host name the "
            "certificate holds"
        ) from e
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        await session.close()
        raise LinkClosed(f"cannot reach verifier at {settings.url}: {e}") from e
    except BaseException:
        await session.close()
        raise
    if ws.protocol != SUBPROTOCOL:
        await _drop(session, ws)
        raise LinkRefused(
            f"verifier at {settings.url} does not speak {SUBPROTOCOL} (protocol "
            f"{PROTOCOL_VERSION}): it runs another version of wanspec"
        )
    return session, ws


#: How a busy verifier's refusal reads, by its reason.
_REFUSAL_TEXT: dict[str, str] = {
    ErrorCode.OVERLOADED: "is overloaded (its admission line is full: admission_queue)",
    ErrorCode.KV_FULL: "has no free KV cache page (kv_full)",
    ErrorCode.BUSY: "holds its session limit (busy)",
    ErrorCode.LOADING: "is still loading its model",
    ErrorCode.STOPPING: "is draining or shutting down",
    ErrorCode.TOKEN_LIMIT: "holds this token's session limit (429)",
}


def refusal_text(why: str, status: int = 503) -> str:
    """How a busy verifier's refusal reads, by its reason (an ErrorCode value, or one this
    edge does not know)."""
    return _REFUSAL_TEXT.get(why, f"refused the session ({status} {why})")
