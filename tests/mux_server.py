"""Fake verifiers for the edge's tests speak protocol v2's connection layer through this: one
session per connection, as v1's fakes served one per WebSocket."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import WSMsgType, web

from cloud_verifier.session.limits import SessionLimits
from shared.wire.messages import Fingerprint
from shared.wire.mux import End, Ready, decode_control, encode_control, frame, split


class OneStream:
    """The first session opened on ``ws`` (a prepared server WebSocket)."""

    def __init__(self, ws: web.WebSocketResponse) -> None:
        self.ws = ws
        self.sid: int | None = None

    async def start(self, fp: Fingerprint) -> None:
        """Send the connection's Ready, with a VerifierCore's default limits."""
        lim = SessionLimits()
        ready = Ready(fp, lim.max_gamma, lim.max_fixed, lim.max_context, lim.max_frame, 4, 1 << 22)
        await self.ws.send_bytes(encode_control(ready))

    async def frames(self) -> AsyncIterator[bytes]:
        """The session's frames, until the edge ends it or the connection closes."""
        async for msg in self.ws:
            if msg.type != WSMsgType.BINARY:
                return
            sid, payload = split(msg.data)
            if sid == 0:
                if isinstance(decode_control(payload), End):
                    return
                continue
            if self.sid is None:
                self.sid = sid
            if sid == self.sid:
                yield payload

    async def send(self, payload: bytes) -> None:
        assert self.sid is not None
        await self.ws.send_bytes(frame(self.sid, payload))
