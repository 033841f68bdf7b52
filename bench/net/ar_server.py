"""Baseline (1): cloud-only autoregressive decoding, streamed to the edge over the same link.

A small aiohttp service in its own process, on the same target model as the verifier. The edge
sends one request frame (msgpack: prompt ids as little-endian uint32 bytes, max_new_tokens,
eos ids); the service decodes token by token and sends each id as its own 4-byte frame as soon
as it exists (what a streaming cloud API does), then closes; or, with ``keep``, sends an empty
frame and waits for the next request on the same connection (a kept-alive API). With
``report``, that end frame carries the reply's busy seconds instead (little-endian float64: the
model worker's time in this reply's steps, the prefill step included, pads included), so a
benchmark prices ``ar``'s GPU time as it measures the verifier's. ``--pad-ms`` pads each step
to a given time (the device-regime emulation). :class:`ArClient` is the edge's side of a
kept-alive connection.

    python -m bench.net.ar_server --model default --port 8701 --token-file TOKEN [--pad-ms 146]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import WSMsgType, web

from bench.lib.ar_wire import BUSY_FRAME, MAX_REQUEST, TOKEN_FRAME, decode_request, encode_request
from cloud_verifier.daemon.auth import Authenticator
from edge_agent.model.lm import CausalLM
from shared.runtime.models import load_model

log = logging.getLogger("wanspec.ar")

STATE = web.AppKey("ar_state", dict)


def build_app(loaded: Any, auth: Authenticator, pad_ms: float) -> web.Application:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ar-model")
    app = web.Application()
    app[STATE] = {"loaded": loaded, "auth": auth, "pad_s": pad_ms / 1000.0, "pool": pool}
    app.router.add_get("/v1/generate", _handler)

    async def _close(app: web.Application) -> None:
        pool.shutdown(wait=True, cancel_futures=True)

    app.on_cleanup.append(_close)
    return app


def _step(lm: CausalLM, ids: list[int], pad_s: float) -> tuple[int, float]:
    """One padded decode step on the model worker (the first one is the prefill): the next
    greedy token and the step's seconds, pad included."""
    t0 = time.perf_counter()
    tok = int(lm.extend(ids)[-1].argmax())
    rest = pad_s - (time.perf_counter() - t0)
    if rest > 0:
        time.sleep(rest)
    return tok, time.perf_counter() - t0


async def _handler(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    if not st["auth"].check(request.headers.get("Authorization")):
        raise web.HTTPUnauthorized(text="bad or missing bearer token")
    ws = web.WebSocketResponse(max_msg_size=MAX_REQUEST)
    await ws.prepare(request)
    loop = asyncio.get_running_loop()
    while True:
        msg = await ws.receive()
        if msg.type != WSMsgType.BINARY:
            await ws.close(message=b"expected one binary request frame")
            return ws
        try:
            req = decode_request(msg.data)
        except ValueError as e:
            await ws.close(message=str(e).encode()[:120])
            return ws
        lm = CausalLM(st["loaded"])
        feed = req.prompt
        busy = 0.0
        for _ in range(req.max_new_tokens):
            tok, spent = await loop.run_in_executor(st["pool"], _step, lm, feed, st["pad_s"])
            busy += spent
            await ws.send_bytes(np.array([tok], "<u4").tobytes())
            if tok in req.eos:
                break
            feed = [tok]
        if not req.keep:
            await ws.close()
            return ws
        # The end of this reply; the connection stays open.
        await ws.send_bytes(np.array([busy], "<f8").tobytes() if req.report else b"")


@dataclass
class ArReply:
    """One reply of the AR service, as the edge saw it (``perf_counter`` seconds)."""

    sent_at: float  # the request left
    stamps: list[float] = field(default_factory=list)  # each token's arrival
    ids: list[int] = field(default_factory=list)
    down_bytes: int = 0  # token frames' payload
    busy_s: float | None = None  # the service's reported busy seconds (with ``report``)
    ended_at: float = 0.0  # the end frame's arrival


class ArClient:
    """A kept-alive connection to the AR service (``/v1/generate``, through an emulator or
    not): one WebSocket opened by :meth:`open` and reused by every :meth:`request` until
    :meth:`close`, so a request pays no TCP or WebSocket handshake. Each wait has
    ``timeout_s``."""

    def __init__(self, url: str, token: str | None, *, timeout_s: float = 600.0) -> None:
        self.url = url
        self.token = token
        self.timeout_s = timeout_s
        self.http: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse[Any] | None = None
        #: Connections opened (one while the service keeps it).
        self.connects = 0

    async def open(self) -> None:
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.ws = await self.http.ws_connect(self.url, headers=headers, heartbeat=None)
        self.connects += 1

    async def __aenter__(self) -> ArClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(self, prompt: list[int], n: int, eos: list[int]) -> ArReply:
        """One reply of at most ``n`` tokens (ends early at an ``eos`` id), with its busy time."""
        if self.ws is None or self.ws.closed:
            await self.close()
            await self.open()
        assert self.ws is not None
        reply = ArReply(time.perf_counter())
        await self.ws.send_bytes(encode_request(prompt, n, eos, keep=True, report=True))
        while True:
            msg = await self.ws.receive(timeout=self.timeout_s)
            now = time.perf_counter()
            if msg.type != WSMsgType.BINARY:
                raise RuntimeError(f"AR service closed the connection mid-reply: {msg.type.name}")
            if len(msg.data) == BUSY_FRAME:
                reply.busy_s = float(np.frombuffer(msg.data, "<f8")[0])
                reply.ended_at = now
                return reply
            if len(msg.data) != TOKEN_FRAME:
                raise RuntimeError(f"AR service sent a {len(msg.data)}-byte frame")
            reply.stamps.append(now)
            reply.ids.append(int(np.frombuffer(msg.data, "<u4")[0]))
            reply.down_bytes += len(msg.data)

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
            self.ws = None
        if self.http is not None:
            await self.http.close()
            self.http = None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.net.ar_server")
    p.add_argument("--model", default="default")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--token-file", type=Path, required=True)
    p.add_argument("--pad-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    loaded = load_model(args.model)
    app = build_app(loaded, Authenticator(token_file=args.token_file), args.pad_ms)
    web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
