"""What the edge daemon's HTTP APIs (OpenAI's and Ollama's) share to read a request and write a
streamed answer: the JSON body within ``client_max_size``, writes each within a deadline, and
the wait for the next event that keeps a quiet stream open."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from edge_agent.daemon.api_request import decode_body

__all__ = ["Writer", "next_event", "read_body"]

E = TypeVar("E")


async def read_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object (``decode_body``'s errors for anything else)."""
    raw = await request.read()  # HTTPRequestEntityTooLarge over client_max_size
    return decode_body(raw)


@dataclass
class Writer:
    """A streaming response's writes, each within ``timeout`` seconds: a client that stops
    reading is dropped (asyncio.TimeoutError), its generation cancelled; the others go on."""

    resp: web.StreamResponse
    timeout: float

    async def write(self, data: bytes) -> None:
        await asyncio.wait_for(self.resp.write(data), self.timeout)


async def next_event(out: Writer, events: AsyncIterator[E], keepalive: float, idle: bytes) -> E:
    """The next event of ``events``; meanwhile ``idle`` is written every ``keepalive`` seconds
    (an SSE comment, or an empty NDJSON chunk: NDJSON has no comments). A wait abandoned by
    cancellation or a failed write cancels the pending read."""
    nxt = asyncio.ensure_future(events.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=keepalive)
            if done:
                return nxt.result()
            await out.write(idle)
    finally:
        if not nxt.done():
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await nxt
