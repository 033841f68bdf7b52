"""The seam between the pipeline and the network (httpx-style): a transport moves whole frames.

The drivers only ever call :meth:`Transport.send` and :meth:`Transport.recv`; the WebSocket link
(:mod:`edge_agent.link`) implements it, and tests test the session rules without any transport
(:mod:`edge_agent.core` is pure).
"""

from __future__ import annotations

from typing import Protocol

from shared.errors import WanspecError


class LinkClosed(WanspecError, ConnectionError):
    """The connection to the verifier is gone (the caller may reconnect and resume)."""


class Transport(Protocol):
    async def send(self, data: bytes) -> None: ...

    async def recv(self) -> bytes:
        """The next frame; raises :class:`LinkClosed` when the connection is gone."""
        ...

    async def close(self) -> None: ...
