"""The seam between the pipeline and the network (httpx-style): a transport moves whole frames.

The pipeline only ever calls :meth:`Transport.send` and :meth:`Transport.recv`; the WebSocket link
(:mod:`edge_agent.link`) and the in-memory pair used by tests implement the same protocol.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class LinkClosed(ConnectionError):
    """The connection to the verifier is gone (the caller may reconnect and resume)."""


class Transport(Protocol):
    async def send(self, data: bytes) -> None: ...

    async def recv(self) -> bytes:
        """The next frame; raises :class:`LinkClosed` when the connection is gone."""
        ...

    async def close(self) -> None: ...


class MemoryTransport:
    """One end of an in-memory duplex pipe of frames (see :func:`memory_pair`)."""

    _CLOSED = b""

    def __init__(self, inbox: asyncio.Queue[bytes], outbox: asyncio.Queue[bytes]) -> None:
        self._inbox = inbox
        self._outbox = outbox
        self.closed = False
        self.sent: list[bytes] = []

    async def send(self, data: bytes) -> None:
        if self.closed:
            raise LinkClosed("transport closed")
        if not data:
            raise ValueError("empty frame")
        self.sent.append(data)
        await self._outbox.put(data)

    async def recv(self) -> bytes:
        if self.closed:
            raise LinkClosed("transport closed")
        data = await self._inbox.get()
        if data == self._CLOSED:
            self.closed = True
            raise LinkClosed("peer closed")
        return data

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self._outbox.put(self._CLOSED)


def memory_pair() -> tuple[MemoryTransport, MemoryTransport]:
    """Two connected ends: what one sends, the other receives, in order."""
    a: asyncio.Queue[bytes] = asyncio.Queue()
    b: asyncio.Queue[bytes] = asyncio.Queue()
    return MemoryTransport(a, b), MemoryTransport(b, a)
