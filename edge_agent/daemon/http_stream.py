"""What the edge daemon's HTTP APIs (OpenAI's and Ollama's) share to read a request and write a
streamed answer: the JSON body within ``client_max_size``, writes each within a deadline, the
wait for the next event that keeps a quiet stream open, and the end of a streamed body."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from edge_agent.daemon.api_request import decode_body

__all__ = ["Writer", "finish_stream", "next_event", "read_body"]

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


async def finish_stream(out: Writer, lines: Awaitable[None], who: str, log: logging.Logger) -> None:
    """Write a streamed body (``lines``, ending with its last line: OpenAI's ``[DONE]``,
        Ollama's done or error line), then end it. A client that goes away (or reads nothing)
        before the last line is a drop (INFO; leaving cancels the generation); one that closes once
        it has the last line, as the REPL and many clients do, dropped nothing: the failed end of
        the chunked body is only a DEBUG line. ``who``: the stream, as the lines ``log`` writes name
    it."""
    try:
        await lines
    except (ConnectionError, asyncio.TimeoutError) as e:
        log.info("client of %s dropped: %s", who, type(e).__name__)
        return
    try:
        await out.resp.write_eof()
    except (ConnectionError, asyncio.TimeoutError) as e:
        log.debug("client of %s closed at the end: %s", who, type(e).__name__)
