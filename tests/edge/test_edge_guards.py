"""``edge-agent serve`` against hostile or unlucky input: half-sent requests (the verifier's
connection guard, shared), request values that used to answer 500, a verifier known to be down,
a verifier that refuses sessions, and /health probes that race the verifier's keep-alive cut.

Servers run in the test's event loop on 127.0.0.1 (the edge API as ``serve`` runs it: guarded
listener, runner); the verifier is the null target or a stub; timeouts shrink through settings.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import numpy as np
import pytest
from aiohttp import web

from edge_agent.daemon.api_errors import ApiError
from edge_agent.daemon.api_request import MAX_JSON_DEPTH, decode_body, parse_sampling, parse_seed
from edge_agent.daemon.server import STATE, ServerState, build_app, make_listener, make_runner
from edge_agent.runtime.metrics import EdgeMetrics
from edge_agent.runtime.monitor import LinkMonitor, VerifierLinkState
from edge_agent.runtime.service import EdgeService
from edge_agent.runtime.settings import EdgeSettings, load_edge_settings
from shared.maths.sampling import MIN_TEMPERATURE, SamplingParams, sample, transform
from shared.service.config import ConfigError
from shared.service.status import ServiceStatus
from shared.wire.codec import decode, encode
from shared.wire.messages import Fingerprint, Hello
from shared.wire.packing import ProtocolError
from tests.verifiers import guarded_verifier
from tests.waits import closed_within, until

HALF_SENT = b"POST /v1/chat/completions HTTP/1.1\r\nHo"


def dead_url() -> str:
    """A ws:// URL where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"ws://127.0.0.1:{s.getsockname()[1]}/v1/session"


def settings(draft: Path, verifier: str, **overrides: Any) -> EdgeSettings:
    base: dict[str, Any] = {
        "verifier": verifier,
        "draft": str(draft),
        "device": "cpu",
        "model_id": "tiny",
        "probe_interval": 0.3,
        "max_tokens": 4,
    }
    return EdgeSettings(**{**base, **overrides})


@asynccontextmanager
async def edge_api(s: EdgeSettings) -> AsyncIterator[tuple[ServerState, str]]:
    """The edge API as ``serve`` runs it (guarded listener, runner); yields state and base URL."""
    app = build_app(EdgeService(s))
    listener = make_listener(app, "127.0.0.1", 0)
    await listener.bind()
    runner = make_runner(app, access_log=None)
    await runner.setup()
    try:
        await listener.start(runner)
        host, port = listener.addresses[0]
        yield app[STATE], f"http://{host}:{port}"
    finally:
        listener.close()
        await runner.cleanup()
        await listener.wait_closed()


async def ready(state: ServerState) -> None:
    await until(lambda: state.status == ServiceStatus.READY, 60.0, "draft loaded")


async def post(url: str, body: bytes, timeout: float = 30.0) -> tuple[int, Any]:
    to = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=to) as http, http.post(url, data=body) as r:
        return r.status, await r.json(content_type=None)


def needs_loopback_alias(address: str) -> None:
    try:
        with socket.socket() as probe:
            probe.bind((address, 0))
    except OSError as e:  # pragma: no cover - a loopback without 127.0.0.x aliases
        pytest.skip(f"cannot use {address} as a source address: {e}")


# ---------------------------------------------------------------------------- 1. the guard


async def test_half_sent_requests_are_cut_and_capped(tiny_draft_dir: Path) -> None:
    """7 half-sent requests from one address: 4 (max_pending_per_address) are held and cut with
    a 408 after header_timeout, 3 get 503 at once; 2 more from a second address fill
    max_pending_connections, so a third address is refused too; /health keeps answering."""
    for address in ("127.0.0.2", "127.0.0.3", "127.0.0.4"):
        needs_loopback_alias(address)
    s = settings(
        tiny_draft_dir,
        dead_url(),
        header_timeout=1.6,
        max_pending_per_address=4,
        max_pending_connections=6,
    )
    assert EdgeSettings().header_timeout == 10.0
    async with edge_api(s) as (state, base):
        port = int(base.rsplit(":", 1)[1])
        t0 = time.monotonic()
        conns = []
        for address in ["127.0.0.2"] * 7 + ["127.0.0.3"] * 2:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(address, 0)
            )
            writer.write(HALF_SENT)
            conns.append((reader, writer))
        answers = await asyncio.gather(*(closed_within(r, 0.2) for r, _ in conns))
        refused = [a for a in answers if a is not None]
        assert len(refused) == 3 and all(a.startswith(b"HTTP/1.1 503") for a in refused), answers
        assert state.guard.per_address == {"127.0.0.2": 4, "127.0.0.3": 2}
        # The table is full (6) and nobody has waited min_age yet: a new address is refused.
        young, young_w = await asyncio.open_connection(
            "127.0.0.1", port, local_addr=("127.0.0.4", 0)
        )
        answer = await closed_within(young, 0.2)
        if answer is None and time.monotonic() - t0 >= state.guard.min_age:  # pragma: no cover
            pytest.skip("this machine took longer than min_age to open 10 connections")
        assert (answer or b"").startswith(b"HTTP/1.1 503"), answer
        young_w.close()
        assert state.guard.refused == {"max_pending_per_address": 3, "max_pending_connections": 1}
        # Past min_age (0.8 s) a new client evicts the oldest and is served.
        # (t0 is before the first connect: a margin for the accept of the oldest one)
        margin = 0.25
        await until(
            lambda: time.monotonic() - t0 > state.guard.min_age + margin, 2.0, "min_age passed"
        )
        async with aiohttp.ClientSession() as http, http.get(base + "/health") as r:
            body = await r.json()
        assert r.status in (200, 503) and body["pending_connections"] == 5, body
        # The rest are cut after header_timeout with a 408.
        held = [r for (r, _), a in zip(conns, answers, strict=True) if a is None]
        cut = await asyncio.gather(*(closed_within(r, 3.0) for r in held))
        assert sorted(c[:12] for c in cut if c) == [b"HTTP/1.1 408"] * 5 + [b"HTTP/1.1 503"], cut
        assert time.monotonic() - t0 < 3.0
        for _, w in conns:
            w.close()
        await until(lambda: state.guard.pending == 0, 2.0, "no pending connections")
        text = state.service.metrics.render()
    assert "wanspec_edge_http_header_timeouts_total 5\n" in text
    assert "wanspec_edge_http_pending_evicted_total 1\n" in text
    assert 'wanspec_edge_http_connections_refused_total{reason="max_pending_per_address"} 3' in text


# ---------------------------------------------------------------------------- 2. 4xx, never 500


def test_values_that_broke_generation_are_refused() -> None:
    """A negative seed (numpy refuses it), a temperature too small to divide by, JSON nested
    too deep: 400s naming the problem, from the pure parsers."""
    with pytest.raises(ApiError) as e:
        parse_seed({"seed": -1})
    assert (e.value.status, e.value.param) == (400, "seed")
    with pytest.raises(ApiError) as e:
        parse_sampling({"temperature": 5e-324})
    assert (e.value.status, e.value.param) == (400, "temperature")
    assert "at least 0.0001" in e.value.message
    assert parse_sampling({"temperature": MIN_TEMPERATURE}).temperature == MIN_TEMPERATURE
    assert parse_sampling({"temperature": 0}).temperature == 0.0
    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        raw = b'{"model": ' + b"[" * depth + b"]" * depth + b"}"
        with pytest.raises(ApiError) as e:
            decode_body(raw)
        assert e.value.status == 400 and "levels deep" in e.value.message, depth
    ok = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert decode_body(ok)["a"] is not None
    # A lone surrogate escape is valid JSON but no text: refused naming the top-level field
    # (strings, object keys, at any depth); a valid pair is one character.
    for raw, field in (
        (rb'{"prompt": "a\ud800"}', "prompt"),
        (rb'{"messages": [{"role": "user", "content": [{"text": "\udfff"}]}]}', "messages"),
        (rb'{"wanspec": {"\ud800": 1}}', "wanspec"),
        (rb'{"x": 1, "stop": ["\ude00\ud83d"]}', "stop"),
    ):
        with pytest.raises(ApiError) as e:
            decode_body(raw)
        assert (e.value.status, e.value.param, e.value.code) == (400, field, "invalid_json"), raw
        assert "lone UTF-16 surrogate" in e.value.message
    assert decode_body(rb'{"prompt": "\ud83d\ude00"}')["prompt"] == "\U0001f600"
    # The same bounds for the daemon's defaults.
    with pytest.raises(ConfigError, match="temperature"):
        EdgeSettings(temperature=1e-300)
    with pytest.raises(ConfigError, match="seed"):
        load_edge_settings(env={"WANSPEC_EDGE_SEED": "-1"})


def test_the_smallest_temperature_still_samples() -> None:
    """At MIN_TEMPERATURE the transform stays finite for logits far apart (float64); below the
    minimum (what broke: no mass) SamplingParams itself refuses it, and so does the wire."""
    logits = np.array([-1e4, 0.0, 3.0, 3.0 + 1e-3, 1e3])
    p = transform(logits, SamplingParams(MIN_TEMPERATURE))
    assert np.isfinite(p).all() and p.sum() == pytest.approx(1.0)
    assert sample(p, np.random.default_rng(0)) == 4
    with pytest.raises(ValueError, match="temperature must be 0"):
        SamplingParams(5e-324)
    hello = msgpack.unpackb(encode(Hello(Fingerprint("t", 8, "m"))), strict_map_key=False)
    hello["sampling"]["temperature"] = 5e-324
    with pytest.raises(ProtocolError, match=r"sampling\.temperature"):
        decode(msgpack.packb(hello))


async def test_the_api_answers_400_where_it_answered_500(tiny_draft_dir: Path) -> None:
    async with edge_api(settings(tiny_draft_dir, dead_url())) as (state, base):
        await ready(state)
        url = base + "/v1/completions"
        deep = b'{"model": "tiny", "prompt": "t1", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        status, body = await post(url, deep)
        assert status == 400 and "levels deep" in body["error"]["message"], body
        for field, value in (("seed", -1), ("temperature", 5e-324), ("prompt", "\ud800")):
            req = {"model": "tiny", "prompt": "t1", "max_tokens": 2, field: value}
            status, body = await post(url, json.dumps(req).encode())
            assert status == 400 and body["error"]["param"] == field, body
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "\udfff"}]}
        status, body = await post(base + "/v1/chat/completions", json.dumps(chat).encode())
        assert status == 400 and body["error"]["param"] == "messages", body
        assert state.service.metrics.requests.get(endpoint="/v1/completions", code="500") == 0


# ---------------------------------------------------------------------------- 3. fail fast


async def test_a_known_down_link_fails_fast_with_one_line(
    tiny_draft_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No verifier listens, fallback none: once the probes say down, a request gets its 503
    after about link_down_fail_fast (not link_down_deadline, 60 s), with one WARNING line of
    the service naming why; the 503's message carries the link's own error."""
    assert EdgeSettings().link_down_fail_fast == 3.0
    url = dead_url()
    s = settings(tiny_draft_dir, url, link_down_fail_fast=1.0, link_down_deadline=60.0)
    async with edge_api(s) as (state, base):
        await ready(state)
        svc = state.service
        await until(lambda: svc.monitor.state == VerifierLinkState.DOWN, 10.0, "link down")
        _, agent = svc.require()
        policy = svc.fail_fast_policy(agent)
        assert policy is not None and policy.deadline_s == 1.0
        caplog.clear()
        caplog.set_level(logging.WARNING, logger="wanspec.edge.service")
        t0 = time.monotonic()
        req = {"model": "tiny", "prompt": "t1", "max_tokens": 2}
        status, body = await post(base + "/v1/completions", json.dumps(req).encode(), 20.0)
        took = time.monotonic() - t0
        assert status == 503 and body["error"]["code"] == "verifier_unavailable", body
        assert took < 5.0, took
        message = body["error"]["message"]
        assert "link_down_fail_fast" in message and url in message, message
        lines = [r for r in caplog.records if r.name == "wanspec.edge.service"]
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING, lines
        # A link that is up (or unknown) keeps the full deadline.
        svc.monitor.mark(url, True)
        assert svc.fail_fast_policy(agent) is None


# ---------------------------------------------------------------------------- 5. refusals


async def test_a_verifier_refusal_reaches_the_503_message(tiny_draft_dir: Path) -> None:
    """A verifier that refuses every session before the upgrade (503 with X-Wanspec-Refusal, as
    when its KV pool is full): the API's 503 carries the link's error, the reason by name."""

    async def refuse(request: web.Request) -> web.Response:
        return web.Response(status=503, text="kv_full\n", headers={"X-Wanspec-Refusal": "kv_full"})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    stub = web.Application()
    stub.router.add_get("/v1/session", refuse)
    stub.router.add_get("/health", health)
    runner = web.AppRunner(stub, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        url = f"ws://{host}:{port}/v1/session"
        s = settings(tiny_draft_dir, url, link_down_deadline=0.3, link_down_fail_fast=0.0)
        async with edge_api(s) as (state, base):
            await ready(state)
            req = {"model": "tiny", "prompt": "t1", "max_tokens": 2}
            status, body = await post(base + "/v1/completions", json.dumps(req).encode())
    finally:
        await runner.cleanup()
    assert status == 503 and body["error"]["code"] == "verifier_unavailable", body
    message = body["error"]["message"]
    assert url in message and "kv_full" in message, message  # the refusal, by name


# ---------------------------------------------------------------------------- 4. probes


@asynccontextmanager
async def null_verifier(**overrides: Any) -> AsyncIterator[str]:
    """The verifier as ``serve`` runs it (guarded listener), null target; yields its ws:// URL."""
    async with guarded_verifier(["t"], **overrides) as (_, base):
        yield base.replace("http://", "ws://", 1) + "/v1/session"


async def watch_probes(url: str, interval: float, probes: int) -> list[VerifierLinkState]:
    """Run a LinkMonitor on ``url`` until it has probed ``probes`` times; its state changes."""
    metrics = EdgeMetrics()
    monitor = LinkMonitor(EdgeSettings(verifier=url, probe_interval=interval), metrics)
    seen: list[VerifierLinkState] = []
    monitor.changed = lambda: seen.append(monitor.links[0].state)
    task = asyncio.create_task(monitor.run())
    try:
        await until(lambda: metrics.rtt.count(kind="probe") >= probes, 10.0, f"{probes} probes")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    return seen


async def test_a_probe_never_reuses_a_connection_the_verifier_may_have_cut() -> None:
    """The race lost, every time: a verifier that answers one request per connection and
    treats a later one on it as arriving after its idle cut (408 and close, as the guard does
    when its timer fires first). Probes on fresh connections never see that."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b'Content-Length: 19\r\n\r\n{"status": "ready"}'
            )
            await reader.readuntil(b"\r\n\r\n")  # a second request: after the cut
            writer.write(b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed it: the fresh-connection case
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        seen = await watch_probes(f"ws://127.0.0.1:{port}/v1/session", 0.2, 4)
    finally:
        server.close()
        await server.wait_closed()
    assert seen == [VerifierLinkState.UP], seen


async def test_health_probes_do_not_flap_on_the_real_verifier() -> None:
    """The verifier closes idle connections after header_timeout; probing every header_timeout
    over a window of 8 cuts never reads the healthy verifier as down."""
    cut = 0.2
    async with null_verifier(header_timeout=cut) as url:
        seen = await watch_probes(url, cut, 8)
    assert seen == [VerifierLinkState.UP], seen
