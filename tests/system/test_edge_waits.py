"""Every wait on the edge has one bound the operator sets (issue 38, probes 4, 5 and 8).

* A verifier that crash-loops, answering "loading" 503s with Retry-After and refusing
  connections in turn: the API request ends within ``verifier_wait`` with a 503, its
  ``Retry-After`` and the text so far; a streaming request has its headers at once, SSE
  keep-alives while it waits, then the text, an error event and ``[DONE]``; ``/health`` says
  busy or down, never up.
* A verifier whose context is smaller than the draft's: a generation that reaches it ends with
  ``finish_reason`` "length" and the target's text; a longer prompt is a 400 naming both limits;
  no reconnect loop.
* A streaming client that stops reading loses its own generation within ``write_timeout``,
  /health says the slots are saturated meanwhile, and the next request is served.

Servers run in the test's event loop on 127.0.0.1; the crash loop is a small asyncio server
that can also pass connections through to a real verifier until it "crashes".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from cloud_verifier.engine.targets import TorchTarget
from edge_agent.daemon.server import STATE, ServerState, build_app, make_listener, make_runner
from edge_agent.link.connection import LinkSettings, WebSocketTransport
from edge_agent.model.drafter import Drafter
from edge_agent.runtime.agent import EdgeAgent
from edge_agent.runtime.service import EdgeService
from edge_agent.session.opening import ContextExceeded
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.transport import Transport
from shared.maths.sampling import SamplingParams
from shared.runtime.models import LoadedModel
from shared.service.status import ServiceStatus
from testkit.harness import target_greedy
from tests.edge_helpers import TOKEN, SlowTarget, edge_settings
from tests.verifiers import serve_verifier, session_url
from tests.waits import until

#: The bound the tests set (verifier_wait), and the slack a loaded 2-core machine gets on it.
WAIT_S = 3.0
SLACK_S = 2.5
GREEDY = PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(0.0))

_LOADING = json.dumps({"status": "loading", "reason": "loading the model"}).encode()
_LOADING_REPLY = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nX-Wanspec-Refusal: loading\r\n"
    b"Content-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: " + str(len(_LOADING)).encode() + b"\r\n\r\n" + _LOADING
)


class CrashLoop:
    """A verifier's address. Until :meth:`crash` (with an ``upstream``), connections pass
    through to a real verifier; after it (or from the start, without one), phases of
    ``period`` s in turn: every request answered 503 "loading" with ``Retry-After: 1`` (as a
    restarting verifier does), then the port closed (connections refused)."""

    def __init__(self, upstream: tuple[str, int] | None = None, period: float = 0.4) -> None:
        self.upstream = upstream
        self.period = period
        self.crashed = upstream is None
        self.port = 0
        self.refusing = False
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()
        self._toggler: asyncio.Task[None] | None = None
        self.phases = 0

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/session"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.crashed:
            self._toggler = asyncio.create_task(self._toggle())

    def crash(self) -> None:
        """From now on: loading, refused, loading, ... (open connections cut at once)."""
        self.crashed = True
        for w in list(self._pipes):
            w.transport.abort()
        self._toggler = asyncio.create_task(self._toggle())

    async def _toggle(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            self.phases += 1
            if self._server is not None:  # loading → refused
                self._server.close()
                self._server = None
                self.refusing = True
            else:  # refused → loading
                self._server = await asyncio.start_server(
                    self._serve, "127.0.0.1", self.port, reuse_address=True
                )
                self.refusing = False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if not self.crashed and self.upstream is not None:
                await self._pipe(reader, writer)
                return
            with contextlib.suppress(asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                await reader.readuntil(b"\r\n\r\n")
                writer.write(_LOADING_REPLY)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self.upstream is not None
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self._pipes.update((writer, up_writer))

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        try:
            await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
        finally:
            self._pipes.difference_update((writer, up_writer))
            up_writer.transport.abort()

    async def close(self) -> None:
        if self._toggler is not None:
            self._toggler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._toggler
        for w in list(self._pipes):
            w.transport.abort()
        if self._server is not None:
            self._server.close()


@asynccontextmanager
async def edge_api(s: Any, sndbuf: int | None = None) -> AsyncIterator[tuple[ServerState, str]]:
    """The edge API as ``serve`` runs it (guarded listener, runner), its draft loaded. With
    ``sndbuf``: on a plain socket whose connections get that kernel send buffer (no
    autotuning: a client that stops reading blocks the writes after a few KiB, as over a WAN
    a slow or stuck one does)."""
    app = build_app(EdgeService(s))
    runner = make_runner(app, access_log=None)
    if sndbuf is not None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)  # (accepted ones inherit)
        sock.bind(("127.0.0.1", 0))
        await runner.setup()
        site = web.SockSite(runner, sock)
        try:
            await site.start()
            host, port = sock.getsockname()[:2]
            state = app[STATE]
            await until(lambda: state.status == ServiceStatus.READY, 60.0, "draft loaded")
            yield state, f"http://{host}:{port}"
        finally:
            await runner.cleanup()
        return
    listener = make_listener(app, "127.0.0.1", 0)
    await listener.bind()
    await runner.setup()
    try:
        await listener.start(runner)
        host, port = listener.addresses[0]
        state = app[STATE]
        await until(lambda: state.status == ServiceStatus.READY, 60.0, "draft loaded")
        yield state, f"http://{host}:{port}"
    finally:
        listener.close()
        await runner.cleanup()
        await listener.wait_closed()


def waits_settings(draft_dir: Path, url: str, token: Path | None, **kw: Any) -> Any:
    """The daemon's settings for these tests: the one bound small, fail-fast off (so the bound
    alone decides), quick probes and keep-alives."""
    base: dict[str, Any] = {
        "link_down_deadline": None,
        "verifier_wait": WAIT_S,
        "link_down_fail_fast": 0.0,
        "probe_interval": 0.2,
        "stream_keepalive": 0.3,
    }
    return edge_settings(draft_dir, url, token, **{**base, **kw})


async def health_poller(base: str, seen: list[tuple[int, str, str]], stop: asyncio.Event) -> None:
    """/health every 0.1 s until ``stop``: (status code, status, overall availability)."""
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            async with http.get(base + "/health") as r:
                body = await r.json()
                seen.append((r.status, body["status"], body["link"]["availability"]))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)


async def read_sse(
    resp: aiohttp.ClientResponse, start: bytes = b""
) -> tuple[list[str], list[dict[str, Any]], bytes]:
    """A whole event stream (``start``: what was read of it already): the texts of its
    chunks, its error events, the raw bytes."""
    raw = start + await resp.content.read()
    texts: list[str] = []
    errors: list[dict[str, Any]] = []
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            errors.append(event["error"])
        for choice in event.get("choices", []):
            text = choice.get("text") or choice.get("delta", {}).get("content")
            if text:
                texts.append(text)
    return texts, errors, raw


# ---------------------------------------------------------------------------- probe 4


async def test_a_crash_looping_verifier_ends_each_request_within_verifier_wait(
    tiny_draft_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Loading 503s (Retry-After 1) and refused connections in turn: each request ends within
    verifier_wait with a 503 and Retry-After (it waited over 200 s); a streaming request has
    its headers at once, keep-alives, then an error event and [DONE]; /health never says up
    (it did on 3 of 21 polls), and says busy and down in turn; a WARNING line when the wait
    starts and one when it gives up."""
    loop = CrashLoop(period=0.4)
    await loop.start()
    caplog.set_level(logging.WARNING)
    polls: list[tuple[int, str, str]] = []
    stop = asyncio.Event()
    try:
        async with edge_api(waits_settings(tiny_draft_dir, loop.url, None)) as (_, base):
            poller = asyncio.create_task(health_poller(base, polls, stop))
            timeout = aiohttp.ClientTimeout(total=WAIT_S + 20)
            body = {"model": "tiny", "prompt": "t1", "max_tokens": 4}
            async with aiohttp.ClientSession(timeout=timeout) as http:
                t0 = time.monotonic()
                async with http.post(base + "/v1/completions", json=body) as r:
                    took = time.monotonic() - t0
                    answer = await r.json()
                    assert r.status == 503, answer
                    assert int(r.headers["Retry-After"]) >= 1, r.headers
                assert WAIT_S - 0.5 <= took <= WAIT_S + SLACK_S, took
                error = answer["error"]
                assert error["code"] == "verifier_unavailable" and error["retry_after"] >= 1
                assert f"verifier_wait = {WAIT_S:g} s" in error["message"], error
                assert (
                    answer["choices"][0]["text"] == "" and answer["usage"]["completion_tokens"] == 0
                )

                t0 = time.monotonic()
                async with http.post(base + "/v1/completions", json={**body, "stream": True}) as r:
                    head_after = time.monotonic() - t0
                    assert r.status == 200 and r.content_type == "text/event-stream"
                    texts, errors, raw = await read_sse(r)
                    took = time.monotonic() - t0
            assert head_after < 1.0, head_after  # the headers at once, while it waits
            assert b": keep-alive\n\n" in raw and raw.rstrip().endswith(b"data: [DONE]")
            assert texts == [] and len(errors) == 1, raw
            assert errors[0]["code"] == "verifier_unavailable" and errors[0]["retry_after"] >= 1
            assert WAIT_S - 0.5 <= took <= WAIT_S + SLACK_S, took
            # /health, polled all along: 503 busy or down, never up.
            await until(lambda: {a for _, _, a in polls} >= {"busy", "down"}, 10.0, "both seen")
            stop.set()
            await poller
    finally:
        stop.set()
        await loop.close()
    assert loop.phases >= 4  # the fake did alternate
    assert all(code == 503 for code, _, _ in polls), polls
    assert {status for _, status, _ in polls} <= {"busy", "unavailable"}, polls
    assert {a for _, _, a in polls} <= {"busy", "down"}, polls
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("waiting for a verifier") for m in warnings), warnings
    gave_up = [m for m in warnings if m.startswith("request failed")]
    assert len(gave_up) == 2 and all("Retry-After" in m for m in gave_up), gave_up


async def test_the_text_so_far_comes_with_the_503(
    aiohttp_server: Any, target: LoadedModel, tiny_draft_dir: Path, tmp_path: Path
) -> None:
    """A verifier that serves, then crash-loops mid-generation: a streaming request gets the
    target's text up to there, then the error event; a non-streaming one gets a 503 with
    Retry-After whose body carries that text in the endpoint's shape."""
    server = await serve_verifier(
        aiohttp_server, lambda: SlowTarget(TorchTarget(target), 0.03), auth=[TOKEN]
    )
    real = session_url(server)
    host, port = real.removeprefix("ws://").split("/")[0].split(":")
    loop = CrashLoop(upstream=(host, int(port)))
    await loop.start()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    s = waits_settings(tiny_draft_dir, loop.url, token_file, max_tokens=300)
    prompt = [1, 10, 20, 30, 40]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 300, "ignore_eos": True}
    try:
        async with edge_api(s) as (_, base):
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                whole = asyncio.create_task(_post(http, base, body))
                async with http.post(base + "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status == 200
                    seen = b""
                    while seen.count(b'"text": "') < 5:  # some text has come
                        more = await r.content.readany()
                        assert more, f"the stream ended before any text: {seen!r}"
                        seen += more
                    loop.crash()
                    t0 = time.monotonic()
                    texts, errors, raw = await read_sse(r, seen)
                    took = time.monotonic() - t0
                status, headers, answer = await whole
    finally:
        await loop.close()
    assert len(errors) == 1 and errors[0]["code"] == "verifier_unavailable", raw
    assert raw.rstrip().endswith(b"data: [DONE]") and took <= WAIT_S + SLACK_S + 2.0, took
    want = target.tokenizer.decode(target_greedy(target, prompt, 300), skip_special_tokens=True)
    streamed = "".join(texts)
    assert streamed and want.startswith(streamed), (streamed, want)
    assert status == 503 and int(headers["Retry-After"]) >= 1, answer
    text = answer["choices"][0]["text"]
    assert answer["choices"][0]["finish_reason"] is None
    assert answer["usage"]["completion_tokens"] > 0 and text and want.startswith(text), answer
    assert answer["error"]["code"] == "verifier_unavailable"
    assert answer["wanspec"]["tokens"] == answer["usage"]["completion_tokens"]


async def _post(
    http: aiohttp.ClientSession, base: str, body: dict[str, Any]
) -> tuple[int, Any, Any]:
    async with http.post(base + "/v1/completions", json=body) as r:
        return r.status, r.headers, await r.json()


# ---------------------------------------------------------------------------- probe 5

#: The small verifier's context: prompt and completion together (the draft's is 512).
SMALL_CONTEXT = 24


@pytest.fixture
async def small_verifier(aiohttp_server: Any, target: LoadedModel) -> str:
    """A verifier whose sessions hold SMALL_CONTEXT tokens (its Ready and Welcome say so)."""
    server = await serve_verifier(
        aiohttp_server, lambda: TorchTarget(target), auth=[TOKEN], max_context=SMALL_CONTEXT
    )
    return session_url(server)


async def test_the_verifiers_context_ends_a_generation_with_length_and_its_text(
    small_verifier: str, target: LoadedModel, draft: LoadedModel
) -> None:
    """The agent alone (a cold session): a generation asked for more than the verifier holds
    ends at its context with "length" and the target's text, on one session (it re-prefilled 35
    times and lost the text); a prompt that fills the context fails at once, not retried."""
    link = LinkSettings(url=small_verifier, token=TOKEN, heartbeat_s=0)
    sessions = 0

    async def connect() -> Transport:
        nonlocal sessions
        sessions += 1
        return await WebSocketTransport.connect(link)

    agent = EdgeAgent(Drafter(draft), draft.fingerprint, connect)
    prompt = [1, 10, 20, 30, 40]
    try:
        gen = await asyncio.wait_for(agent.generate(prompt, GREEDY, max_tokens=100), 60)
        assert gen.finish_reason == "length" and len(gen.committed) == SMALL_CONTEXT
        assert gen.generated == target_greedy(target, prompt, SMALL_CONTEXT - len(prompt))
        assert sessions == 1 and gen.stats.reconnects == 0
        t0 = time.monotonic()
        with pytest.raises(ContextExceeded, match="24 tokens; the verifier's context is 24"):
            await asyncio.wait_for(agent.generate([1] * 24, GREEDY, max_tokens=4), 30)
        assert sessions == 2 and time.monotonic() - t0 < 5
    finally:
        agent.close()


async def test_the_daemon_answers_length_at_the_verifiers_context_and_400_past_it(
    small_verifier: str, target: LoadedModel, tiny_draft_dir: Path, tmp_path: Path
) -> None:
    """Through the API: a completion without max_tokens ends at the verifier's context
    ("length", the target's text, no reconnect; it got a 503 after 64 s and no text); from then
    on the edge knows that context, and a prompt past it, or max_tokens past it, is a 400 naming
    both limits, before any work and before any stream header (it was a 503 after 62 s)."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    s = waits_settings(tiny_draft_dir, small_verifier, token_file, max_tokens=200)
    prompt = [1, 10, 20, 30, 40]
    async with edge_api(s) as (state, base):
        svc = state.service
        await until(lambda: svc.links[0].max_context is not None, 10.0, "the Ready")
        # the connection's Ready announces the sessions' limit (the setting, not the model's
        # 512), so the first request on the link already knows it
        assert svc.links[0].max_context == SMALL_CONTEXT
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            body = {"model": "tiny", "prompt": prompt, "ignore_eos": True}
            t0 = time.monotonic()
            async with http.post(base + "/v1/completions", json=body) as r:
                answer = await r.json()
            assert r.status == 200 and time.monotonic() - t0 < 20, answer
            choice = answer["choices"][0]
            assert choice["finish_reason"] == "length"
            assert answer["usage"]["completion_tokens"] == SMALL_CONTEXT - len(prompt)
            want = target_greedy(target, prompt, SMALL_CONTEXT - len(prompt))
            assert answer["wanspec"]["token_ids"] == want and answer["wanspec"]["reconnects"] == 0
            assert svc.links[0].max_context == SMALL_CONTEXT
            assert svc.context_limit().tokens == SMALL_CONTEXT
            for extra in ({}, {"stream": True}):
                long = {"model": "tiny", "prompt": [1] * 30, **extra}
                async with http.post(base + "/v1/completions", json=long) as r:
                    answer = await r.json(content_type=None)
                assert r.status == 400 and r.content_type == "application/json", answer
                assert answer["error"]["code"] == "context_length_exceeded"
                assert answer["error"]["message"] == (
                    "the prompt has 30 tokens; the context is 24 (the draft's 512, the "
                    "verifier's 24)"
                )
            over = {"model": "tiny", "prompt": prompt, "max_tokens": 50}
            async with http.post(base + "/v1/completions", json=over) as r:
                answer = await r.json()
            assert r.status == 400 and "the verifier's 24" in answer["error"]["message"]
        # The verifier was never marked down for any of it.
        assert svc.monitor.availability == "up"


# ---------------------------------------------------------------------------- probe 8


async def test_a_client_that_stops_reading_loses_its_generation_and_holds_nobody(
    aiohttp_server: Any, target: LoadedModel, tiny_draft_dir: Path, tmp_path: Path
) -> None:
    """One place (max_concurrent 1); a streaming chat with top_logprobs 20 whose client never
    reads: /health says the slots are saturated (503, not 200) while it holds the place, it is
    dropped within write_timeout of its write blocking (its generation cancelled), and a short
    request behind it is served."""
    server = await serve_verifier(aiohttp_server, lambda: TorchTarget(target), auth=[TOKEN])
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    write_timeout = 3.0
    s = waits_settings(
        tiny_draft_dir,
        session_url(server),
        token_file,
        max_concurrent=1,
        write_timeout=write_timeout,
        stream_keepalive=0.5,
        max_tokens=480,
    )
    async with edge_api(s, sndbuf=4096) as (state, base):
        host, port = base.removeprefix("http://").split(":")
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "t1"}],
            "max_tokens": 480,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,
        }
        payload = json.dumps(body).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never reads
        stuck.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(stuck, (host, int(port)))
        await loop.sock_sendall(stuck, head + payload)
        metrics = state.service.metrics
        try:
            seen: list[tuple[int, str]] = []

            async def saturated() -> bool:
                async with aiohttp.ClientSession() as http, http.get(base + "/health") as r:
                    seen.append((r.status, (await r.json())["status"]))
                return seen[-1] == (503, "saturated")

            await until(saturated, 30.0, "/health says saturated")
            assert all(code == 200 or status == "saturated" for code, status in seen), seen
            t0 = time.monotonic()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                short = {"model": "tiny", "prompt": "t1", "max_tokens": 4, "ignore_eos": True}
                async with http.post(base + "/v1/completions", json=short) as r:
                    answer = await r.json()
            waited = time.monotonic() - t0
            assert r.status == 200 and answer["usage"]["completion_tokens"] == 4, answer
            assert waited <= write_timeout + SLACK_S, waited
            assert metrics.generations.get(outcome="cancelled") == 1  # the stuck one, dropped
            await until(_health_ok(base), 10.0, "/health 200 again")
        finally:
            stuck.close()


def _health_ok(base: str) -> Any:
    async def ok() -> bool:
        async with aiohttp.ClientSession() as http, http.get(base + "/health") as r:
            return r.status == 200

    return ok
