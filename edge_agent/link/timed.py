"""A transport that measures its session's first round trip (its first frame out to its first
frame back: on a warm link, Hello → Welcome, the network's RTT plus the verifier's turn-around).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from edge_agent.session.transport import Transport, announced_welcome
from shared.wire.messages import Welcome


class TimedTransport:
    """A Transport that reports its first round trip (Hello → Welcome) as the link's RTT."""

    def __init__(self, inner: Transport, on_rtt: Callable[[float], None]) -> None:
        self.inner = inner
        self._on_rtt = on_rtt
        self._sent_at: float | None = None
        self._measured = False

    async def send(self, data: bytes) -> None:
        if self._sent_at is None:
            self._sent_at = time.perf_counter()
        await self.inner.send(data)

    async def recv(self) -> bytes:
        data = await self.inner.recv()
        if not self._measured and self._sent_at is not None:
            self._measured = True
            self._on_rtt(time.perf_counter() - self._sent_at)
        return data

    @property
    def welcome(self) -> Welcome | None:
        return announced_welcome(self.inner)

    async def close(self) -> None:
        await self.inner.close()
