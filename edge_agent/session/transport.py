"""The seam between the pipeline and the network (httpx-style): a transport moves whole frames.

The drivers only ever call :meth:`Transport.send` and :meth:`Transport.recv`; the WebSocket link
(:mod:`edge_agent.link.connection`) implements it, and tests test the session rules without any
transport
(:mod:`edge_agent.session.core` is pure).
"""

from __future__ import annotations

from typing import Protocol

from shared.errors import WanspecError
from shared.wire.messages import Welcome


class LinkClosed(WanspecError, ConnectionError):
    """The connection to the verifier is gone (the caller may reconnect and resume)."""


class VerifierBusy(LinkClosed):
    """The verifier refused a new session because it is busy (HTTP 503 or 429 with
    Retry-After, or a refusal Error frame with ``retry_after``): it is alive, so the edge waits
    at least ``retry_after`` seconds (plus its own jitter) and is not counting it as down.
    ``reason``: the refusal's code (overloaded, kv_full, busy, loading, stopping,
    token_limit, ...)."""

    def __init__(self, message: str, reason: str, retry_after: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class Transport(Protocol):
    async def send(self, data: bytes) -> None: ...

    async def recv(self) -> bytes:
        """The next frame; raises :class:`LinkClosed` when the connection is gone."""
        ...

    async def close(self) -> None: ...


def announced_welcome(transport: Transport) -> Welcome | None:
    """The Welcome a new session on ``transport`` will get, when its connection announced it
    (protocol v2's Ready, :class:`~edge_agent.link.connection.StreamTransport`): the session may
    then
    run from its first frame, without waiting a round trip for it."""
    welcome = getattr(transport, "welcome", None)
    return welcome if isinstance(welcome, Welcome) else None
