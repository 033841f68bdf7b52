"""Load held: many concurrent edge sessions on one verifier process stay correct and bounded
(the reduced ``python -m bench load``); a client that stops reading is cut off after a bounded
wait instead of holding its session and memory; shutdown is bounded even with such a client."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import WSCloseCode

from bench.studies.load import LoadConfig, run
from cloud_verifier.daemon.lifecycle import close_connections
from cloud_verifier.daemon.state import STATE, _buffered
from cloud_verifier.engine.targets import NullTarget
from shared.maths.sampling import SamplingParams
from shared.wire.codec import encode
from shared.wire.messages import SUBPROTOCOL, Fingerprint, Hello, Propose, ReplyMode
from testkit.net.stream_ws import StreamWS
from testkit.probe import Driver, ProbeClient, auth_headers
from tests.verifiers import ready, verifier_app
from tests.waits import until

BIG_V = 49152
FP = Fingerprint("null", BIG_V, "null")


async def test_reduced_load_run(tmp_path: Path) -> None:
    cfg = LoadConfig(sessions=16, seconds=5.0, prompts=8, max_new_tokens=24, tokens=2)
    rep = await run(cfg, tmp_path)
    assert rep.errors == [] and rep.wrong == 0 and rep.reconnects == 0
    assert rep.generations >= cfg.sessions  # every session finished at least one text
    assert rep.concurrent_sessions["max"] >= cfg.sessions * 3 // 4
    grew = rep.rss_mib["last_quarter_max"] - rep.rss_mib["first_quarter_max"]
    assert grew <= cfg.rss_slack_mib, rep.rss_mib
    assert rep.ok(cfg)


async def start(aiohttp_client: Any, **settings: Any) -> Any:
    app = verifier_app(
        lambda: NullTarget(BIG_V),
        auth=["slow-token", "honest-token"],
        model=f"null:{BIG_V}",
        **settings,
    )
    client = await aiohttp_client(app)
    await ready(app)
    return client


async def stop_reading(client: Any) -> aiohttp.ClientWebSocketResponse:
    """A federated session whose replies are ~100 KB each (top-1024 of 17 rows), with a tiny
    receive buffer, that sends Proposes and never reads."""
    ws = StreamWS(
        await client.ws_connect(
            "/v1/session", headers=auth_headers("slow-token"), protocols=(SUBPROTOCOL,)
        )
    )
    sock = ws.get_extra_info("socket")
    if isinstance(sock, socket.socket):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    probe = ProbeClient(ws)
    await probe.hello(
        Hello(FP, SamplingParams(1.0), reply_mode=ReplyMode.FEDERATED, k=1024, seed=1)
    )
    rng = np.random.default_rng(0)
    pos, gamma = 0, 16
    for _ in range(300):
        fixed = np.array([1], np.int64) if pos == 0 else np.zeros(0, np.int64)
        draft = rng.integers(4, BIG_V, gamma)
        p = Propose(0, _ % 128, pos, draft, np.full(gamma, 0.5, np.float32), fixed)
        pos += len(fixed) + gamma
        try:
            await ws.send_bytes(encode(p, probe.ctx))
        except ConnectionError:
            break
    return ws


async def blocked(state: Any) -> None:
    """Until every socket buffer towards the slow reader is full: its handler waits to send."""
    deadline = time.monotonic() + 20
    while not any(_buffered(t) for t in state.websockets.values()):
        assert time.monotonic() < deadline, "the send buffer never filled"
        await asyncio.sleep(0.05)


async def honest_rounds(client: Any, n: int) -> float:
    """n stop-and-wait rounds of another session; returns the slowest round (s)."""
    ws = StreamWS(
        await client.ws_connect(
            "/v1/session", headers=auth_headers("honest-token"), protocols=(SUBPROTOCOL,)
        )
    )
    probe = ProbeClient(ws)
    await probe.hello(Hello(FP, SamplingParams(0.0), seed=2))
    driver = Driver(probe, BIG_V, 4, np.random.default_rng(1))
    driver.fixed = [1, 2]
    slowest = 0.0
    for _ in range(n):
        t0 = time.perf_counter()
        await driver.round()
        slowest = max(slowest, time.perf_counter() - t0)
    await ws.close()
    return slowest


async def test_a_slow_reader_is_disconnected(aiohttp_client: Any) -> None:
    client = await start(aiohttp_client, send_timeout=1.0, close_timeout=0.5, max_k=1024)
    state = client.app[STATE]
    ws = await stop_reading(client)
    t0 = time.monotonic()
    slowest = await honest_rounds(client, 20)  # meanwhile, others are served as usual
    assert slowest < 2.0
    await until(lambda: not state.sessions, 10.0, "the session that does not read closed")
    assert time.monotonic() - t0 < 6.0
    assert "wanspec_slow_readers_total 1" in state.metrics.render()
    assert not state.websockets and state.connections == 0 and state.per_token == {}
    with contextlib.suppress(Exception):
        await ws.close()


async def test_shutdown_is_bounded_with_a_client_that_does_not_read(aiohttp_client: Any) -> None:
    """GOING_AWAY to every session, even one whose buffers are full: the close is queued without
    waiting for the buffer to drain, and the connection is cut after close_timeout."""
    client = await start(aiohttp_client, send_timeout=60.0, close_timeout=0.5, max_k=1024)
    state = client.app[STATE]
    ws = await stop_reading(client)
    await blocked(state)
    other = StreamWS(
        await client.ws_connect(
            "/v1/session", headers=auth_headers("honest-token"), protocols=(SUBPROTOCOL,)
        )
    )
    await ProbeClient(other).hello(Hello(FP, SamplingParams(0.0)))
    t0 = time.monotonic()
    await asyncio.wait_for(close_connections(client.app), 10.0)  # unbounded before: a hang
    assert time.monotonic() - t0 < 0.5 + 1.0 + 1.0
    msg = await other.receive(timeout=5)
    assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == WSCloseCode.GOING_AWAY
    await other.close()
    await until(lambda: not state.sessions, 5.0, "every session closed")
    with contextlib.suppress(Exception):
        await ws.close()
