"""Baseline (1): cloud-only autoregressive decoding, streamed to the edge over the same link.

A small aiohttp service in its own process, on the same target model as the verifier. The edge
sends one request frame (msgpack: prompt ids as little-endian uint32 bytes, max_new_tokens,
eos ids); the service decodes token by token and sends each id as its own 4-byte frame as soon
as it exists (what a streaming cloud API does), then closes; or, with ``keep``, sends an empty
frame and waits for the next request on the same connection (a kept-alive API). ``--pad-ms``
pads each step to a given time (the device-regime emulation).

    python -m bench.ar_server --model default --port 8701 --token-file TOKEN [--pad-ms 146]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from aiohttp import WSMsgType, web

from cloud_verifier.daemon.auth import Authenticator
from edge_agent.model.lm import CausalLM
from shared.runtime.models import load_model

log = logging.getLogger("wanspec.ar")

STATE = web.AppKey("ar_state", dict)
MAX_REQUEST = 1 << 20


def _decode_request(data: bytes) -> tuple[list[int], int, set[int], bool]:
    try:
        m = msgpack.unpackb(data, raw=False, max_bin_len=MAX_REQUEST, max_array_len=64)
        prompt = np.frombuffer(m["prompt"], "<u4").astype(np.int64).tolist()
        n = int(m["max_new_tokens"])
        eos = {int(t) for t in m.get("eos", [])}
        keep = bool(m.get("keep", False))
    except Exception as e:
        raise ValueError(f"bad request: {e}") from e
    if not prompt or not 1 <= n <= 1 << 16:
        raise ValueError("bad request: empty prompt or max_new_tokens out of range")
    return prompt, n, eos, keep


def encode_request(
    prompt: list[int], max_new_tokens: int, eos: list[int], *, keep: bool = False
) -> bytes:
    """A request; ``keep``: the connection stays open for the next one (a kept-alive cloud API:
    the reply ends with an empty frame instead of the close)."""
    out = msgpack.packb(
        {
            "prompt": np.asarray(prompt, "<u4").tobytes(),
            "max_new_tokens": max_new_tokens,
            "eos": eos,
            "keep": keep,
        },
        use_bin_type=True,
    )
    assert isinstance(out, bytes)
    return out


def build_app(loaded: Any, auth: Authenticator, pad_ms: float) -> web.Application:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ar-model")
    app = web.Application()
    app[STATE] = {"loaded": loaded, "auth": auth, "pad_s": pad_ms / 1000.0, "pool": pool}
    app.router.add_get("/v1/generate", _handler)

    async def _close(app: web.Application) -> None:
        pool.shutdown(wait=True, cancel_futures=True)

    app.on_cleanup.append(_close)
    return app


def _step(lm: CausalLM, ids: list[int], pad_s: float) -> int:
    """One padded decode step on the model worker: the next greedy token."""
    t0 = time.perf_counter()
    tok = int(lm.extend(ids)[-1].argmax())
    rest = pad_s - (time.perf_counter() - t0)
    if rest > 0:
        time.sleep(rest)
    return tok


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
            prompt, n, eos, keep = _decode_request(msg.data)
        except ValueError as e:
            await ws.close(message=str(e).encode()[:120])
            return ws
        lm = CausalLM(st["loaded"])
        feed = prompt
        for _ in range(n):
            tok = await loop.run_in_executor(st["pool"], _step, lm, feed, st["pad_s"])
            await ws.send_bytes(np.array([tok], "<u4").tobytes())
            if tok in eos:
                break
            feed = [tok]
        if not keep:
            await ws.close()
            return ws
        await ws.send_bytes(b"")  # the end of this reply; the connection stays open


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ar_server")
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
