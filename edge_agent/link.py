"""The WebSocket link to a verifier (aiohttp client), as a Transport."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from edge_agent.transport import LinkClosed
from shared.errors import WanspecError
from shared.wire.protocol import SUBPROTOCOL


class TokenRefused(WanspecError, PermissionError):
    """The verifier refused the token (HTTP 401/403): reconnecting will not help."""


class LinkRefused(WanspecError, RuntimeError):
    """A failure that waiting cannot clear (no such host, no WebSocket endpoint at that path):
    not retried, the message names the cause."""


class VerifierBusy(LinkClosed):
    """The verifier refused a new session because it is busy (HTTP 503 or 429 with
    Retry-After): it is alive, so the edge waits at least ``retry_after`` seconds (plus its own
    jitter) and is not counting it as down. ``reason``: the verifier's X-Wanspec-Refusal
    (overloaded, kv_full, busy, loading, stopping, token_limit, ...)."""

    def __init__(self, message: str, reason: str, retry_after: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


#: The verifier's header naming why it refused a session (cloud_verifier.app).
REFUSAL_HEADER = "X-Wanspec-Refusal"
#: Retry-After values past this are taken as this (seconds): a far date is not a plan.
MAX_RETRY_AFTER_S = 300.0


def retry_after_s(value: str | None) -> float | None:
    """Retry-After in seconds (delta-seconds only; an HTTP date or junk: None)."""
    if value is None or not value.strip().isdigit():
        return None
    return min(float(value.strip()), MAX_RETRY_AFTER_S)


class UntrustedCertificateError(TokenRefused):
    """The verifier's TLS certificate failed verification (not retried: pass its CA, e.g. with
    ``ssl=ssl.create_default_context(cafile=...)``)."""


@dataclass(frozen=True)
class LinkSettings:
    url: str  # ws://host:port/v1/session or wss://...
    token: str
    heartbeat_s: float = 10.0  # ping interval; no pong within half of it closes the link
    connect_timeout_s: float = 10.0
    max_frame: int = 4 << 20
    ssl: ssl.SSLContext | bool = True  # True: verify the server certificate (default)


class WebSocketTransport:
    """One verifier session over one WebSocket."""

    def __init__(
        self, session: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse[bool]
    ) -> None:
        self._session = session
        self._ws = ws

    @classmethod
    async def connect(cls, settings: LinkSettings) -> WebSocketTransport:
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
                max_msg_size=settings.max_frame,
                ssl=settings.ssl,
                compress=0,
            )
        except aiohttp.WSServerHandshakeError as e:
            await session.close()
            if e.status in (401, 403):
                raise TokenRefused(
                    f"verifier at {settings.url} refused the token ({e.status})"
                ) from e
            headers: Mapping[str, str] = e.headers or {}
            reason = str(headers.get(REFUSAL_HEADER, "")).strip()[:64]
            after = retry_after_s(headers.get("Retry-After"))
            if e.status in (429, 503):
                why = reason or ("token_limit" if e.status == 429 else "unavailable")
                text = {
                    "overloaded": "is overloaded (its model queue is past max_queue_delay)",
                    "kv_full": "has no free KV cache page (kv_full)",
                    "busy": "holds its session limit (busy)",
                    "loading": "is still loading its model",
                    "stopping": "is draining or shutting down",
                    "token_limit": "holds this token's session limit (429)",
                }.get(why, f"refused the session ({e.status} {why})")
                message = f"verifier at {settings.url} {text}"
                if after is not None:
                    raise VerifierBusy(f"{message}; retry after {after:g} s", why, after) from e
                raise LinkClosed(message) from e
            if 400 <= e.status < 500:
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
                "give the edge the verifier's CA certificate"
            ) from e
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            await session.close()
            raise LinkClosed(f"cannot reach verifier at {settings.url}: {e}") from e
        except BaseException:
            await session.close()
            raise
        if ws.protocol != SUBPROTOCOL:
            await ws.close()
            await session.close()
            raise LinkClosed(f"verifier at {settings.url} does not speak {SUBPROTOCOL}")
        return cls(session, ws)

    async def send(self, data: bytes) -> None:
        if self._ws.closed:
            raise LinkClosed("connection closed")
        try:
            await self._ws.send_bytes(data)
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as e:
            raise LinkClosed(f"send failed: {e}") from e

    async def recv(self) -> bytes:
        try:
            msg = await self._ws.receive()
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as e:
            raise LinkClosed(f"receive failed: {e}") from e
        if msg.type == aiohttp.WSMsgType.BINARY:
            data: bytes = msg.data
            return data
        if msg.type == aiohttp.WSMsgType.TEXT:
            raise LinkClosed("verifier sent a text frame; wanspec frames are binary")
        reason = f" ({msg.extra or msg.data})" if (msg.extra or msg.data) else ""
        code = self._ws.close_code
        raise LinkClosed(f"connection closed: {msg.type.name}{reason} code={code}")

    async def close(self) -> None:
        try:
            await self._ws.close()
        finally:
            await self._session.close()
