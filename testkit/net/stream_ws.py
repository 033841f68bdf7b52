"""One raw session over a protocol-v2 connection, for probes that write their own frames.

The fuzzers, load generators and tests that speak to a verifier frame by frame (sending
malformed bytes on purpose) see one session as v1 let them see one WebSocket: ``send_bytes``
puts any payload on stream 1, ``receive`` returns that stream's frames as BINARY messages and
its End as a CLOSE message with the End's code; the connection's Ready and window updates are
read and kept (``ready``), and a close of the whole connection comes through as it is.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import aiohttp
from aiohttp import WSMessage, WSMsgType

from shared.wire.mux import End, Ready, WindowUpdate, decode_control, encode_control, frame, split

STREAM = 1


class StreamWS:
    """Stream 1 of ``ws`` (an upgraded aiohttp client WebSocket)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse[Any]) -> None:
        self.ws = ws
        self.ready: Ready | None = None
        #: Bytes the stream's window still allows (``send_bytes`` waits for more, as an edge
        #: does; ``send_unchecked`` does not).
        self.credit = 0
        self._end: End | None = None
        self._held: deque[WSMessage] = deque()

    @property
    def closed(self) -> bool:
        return self._end is not None or self.ws.closed

    @property
    def close_code(self) -> int | None:
        return self._end.code if self._end is not None else self.ws.close_code

    @property
    def protocol(self) -> str | None:
        return self.ws.protocol

    def exception(self) -> BaseException | None:
        return self.ws.exception()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.ws.get_extra_info(name, default)

    async def wait_ready(self, timeout: float) -> Ready:
        """The connection's Ready (read now if it has not come yet)."""
        while self.ready is None:
            msg = await self._next(timeout)
            if msg is not None:
                if msg.type != WSMsgType.BINARY:
                    raise ConnectionError(f"closed before Ready ({msg.type.name})")
                self._held.append(msg)
        return self.ready

    def __aiter__(self) -> StreamWS:
        return self

    async def __anext__(self) -> WSMessage:
        msg = await self.receive()
        if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
            raise StopAsyncIteration
        return msg

    async def send_bytes(self, data: bytes) -> None:
        """Send a session frame within the stream's window, reading (and holding for
        ``receive``) what arrives until the verifier grants room."""
        await self.wait_ready(30.0)
        while self.credit < len(data) and self._end is None:
            msg = await self._next(30.0)
            if msg is not None:
                self._held.append(msg)
                if msg.type != WSMsgType.BINARY:
                    break
        self.credit -= len(data)
        await self.ws.send_bytes(frame(STREAM, data))

    async def send_unchecked(self, data: bytes) -> None:
        """Send a session frame whatever the window (a client that breaks flow control)."""
        await self.ws.send_bytes(frame(STREAM, data))

    async def send_str(self, data: str) -> None:
        """Text as a session frame's bytes (a text message would break the connection's rules,
        not the session's)."""
        await self.ws.send_bytes(frame(STREAM, data.encode()))

    async def receive(self, timeout: float | None = None) -> WSMessage:
        if self._held:
            return self._held.popleft()
        if self._end is not None:
            return WSMessage(WSMsgType.CLOSED, self._end.code, self._end.reason)
        while True:
            msg = await self._next(timeout)
            if msg is not None:
                return msg

    async def _next(self, timeout: float | None) -> WSMessage | None:
        """One message of the connection: this stream's (or a close), else None (a control
        frame, taken in)."""
        msg = await self.ws.receive(timeout)
        if msg.type != WSMsgType.BINARY:
            return msg
        stream, payload = split(msg.data)
        if stream == STREAM:
            return WSMessage(WSMsgType.BINARY, payload, None)
        if stream != 0:
            return None
        ctl = decode_control(payload)
        if isinstance(ctl, Ready):
            self.ready = ctl
            self.credit += ctl.window
        elif isinstance(ctl, WindowUpdate):
            self.credit += ctl.credit
        elif ctl.stream == STREAM:
            self._end = ctl
            return WSMessage(WSMsgType.CLOSE, ctl.code, ctl.reason)
        return None

    async def end(self) -> None:
        """End the session normally (the verifier releases it), the connection stays open."""
        if self._end is None:
            self._end = End(STREAM)
            await self.ws.send_bytes(encode_control(End(STREAM)))

    async def close(self, *, code: int = 1000, message: bytes = b"") -> bool:
        """Close the connection, as v1's close of a session's WebSocket: a normal close (1000)
        ends the session first (released), any other leaves it lost (kept for resumption)."""
        if code == 1000 and not self.ws.closed:
            await self.end()
        return await self.ws.close(code=code, message=message)
