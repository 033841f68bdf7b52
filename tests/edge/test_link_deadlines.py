"""Every wait on the edge has a deadline: a verifier that answers pings but never sends a Verdict
is left and the session rebuilt; a restart is outlasted at the default settings (retry by time,
not by count); failures that waiting cannot clear fail at once, with their cause."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from aiohttp import web

from cloud_verifier.engine.targets import TorchTarget
from cloud_verifier.session.core import VerifierCore
from cloud_verifier.session.events import Send
from cloud_verifier.session.limits import SessionLimits, TargetInfo
from edge_agent.link.connection import LinkRefused, LinkSettings, WebSocketTransport
from edge_agent.model.drafter import Drafter
from edge_agent.runtime.agent import AgentEvent, EdgeAgent, RetryPolicy, SessionFailed
from edge_agent.runtime.service import retry_policy
from edge_agent.runtime.settings import EdgeSettings
from edge_agent.session.generation import Generation
from edge_agent.session.pipeline import DraftPlan, Pipeline
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.retry import GiveUp, Outage, WaitCause
from edge_agent.session.transport import LinkClosed, Transport
from shared.maths.sampling import SamplingParams
from shared.runtime.models import LoadedModel
from shared.wire.codec import encode
from shared.wire.messages import SUBPROTOCOL, Fingerprint
from testkit.harness import target_greedy
from tests.edge_helpers import TOKEN, Servers, edge_settings
from tests.mux_server import OneStream
from tests.verifiers import serve_verifier, session_url

PROMPT = [1, 10, 20, 30, 40]
GREEDY = PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(0.0))


def stalling_app(fp: Fingerprint) -> web.Application:
    """A verifier that completes the handshake, answers pings and /health, and never sends a
    Verdict (its model is stuck, say)."""

    async def session(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=(SUBPROTOCOL,), heartbeat=None)
        await ws.prepare(request)
        stream = OneStream(ws)
        await stream.start(fp)
        core = VerifierCore(TargetInfo(fp, fp.vocab_size), SessionLimits(), "stuck")
        async for data in stream.frames():
            for ev in core.receive(data):
                if isinstance(ev, Send):
                    await stream.send(encode(ev.msg, core.ctx))
        return ws

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    app = web.Application()
    app.router.add_get("/v1/session", session)
    app.router.add_get("/health", health)
    return app


async def serve(aiohttp_server: Any, target: LoadedModel, **kw: Any) -> str:
    server = await serve_verifier(aiohttp_server, lambda: TorchTarget(target), auth=[TOKEN], **kw)
    return session_url(server)


def get_json(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def agent(draft: LoadedModel, url: str, retry: RetryPolicy) -> EdgeAgent:
    link = LinkSettings(url=url, token=TOKEN, heartbeat_s=0, connect_timeout_s=2.0)

    async def connect() -> Transport:
        return await WebSocketTransport.connect(link)

    return EdgeAgent(Drafter(draft), draft.fingerprint, connect, retry=retry)


class Swallow:
    """A transport that delivers nothing after the Welcome: from the edge's side, exactly a
    verifier that never sends a Verdict (pings are answered below this layer)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.frames = 0

    async def send(self, data: bytes) -> None:
        await self.inner.send(data)

    async def recv(self) -> bytes:
        self.frames += 1
        if self.frames > 1:  # the Welcome passes
            await asyncio.Event().wait()
        return await self.inner.recv()

    async def close(self) -> None:
        await self.inner.close()


# ---------------------------------------------------------------------- the verdict deadline


async def test_a_stalled_session_is_rebuilt_and_the_text_is_unchanged(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    url = await serve(aiohttp_server, target)
    a = agent(draft, url, RetryPolicy(backoff_initial_s=0.01, verdict_timeout_s=0.3))
    inner = a.connect
    calls = 0

    async def first_stalls() -> Transport:
        nonlocal calls
        calls += 1
        t = await inner()
        return Swallow(t) if calls == 1 else t

    failures: list[SessionFailed] = []
    a.connect = first_stalls

    def on_event(ev: AgentEvent) -> None:
        if isinstance(ev, SessionFailed):
            failures.append(ev)

    try:
        t0 = time.monotonic()
        run = a.generate(PROMPT, GREEDY, max_tokens=24, on_event=on_event)
        gen = await asyncio.wait_for(run, 30)
    finally:
        a.close()
    assert gen.generated == target_greedy(target, PROMPT, 24)
    assert calls == 2 and len(failures) == 1 and failures[0].cause == WaitCause.STALLED
    assert "stalled" in failures[0].detail and time.monotonic() - t0 < 15


async def test_a_verifier_that_never_verifies_fails_after_one_rebuild(
    aiohttp_server: Any, draft: LoadedModel
) -> None:
    server = await aiohttp_server(stalling_app(draft.fingerprint))
    url = session_url(server)
    retry = RetryPolicy(
        backoff_initial_s=0.05, backoff_max_s=0.1, verdict_timeout_s=0.3, deadline_s=1.5
    )
    a = agent(draft, url, retry)
    try:
        t0 = time.monotonic()
        with pytest.raises(LinkClosed, match="the verifier is stalled: 2 sessions"):
            await asyncio.wait_for(a.generate(PROMPT, GREEDY, max_tokens=8), 30)
        assert time.monotonic() - t0 < 3  # two verdict deadlines (0.3 s) and a backoff
    finally:
        a.close()


def test_the_verdict_deadline_follows_the_measured_rounds() -> None:
    """Floor first; then 4 × the slowest recent round when that is longer."""
    pipe = Pipeline(
        Generation([1], 100), GREEDY, np.random.default_rng(0), gamma=2, deterministic_draft=True
    )
    assert pipe.verdict_deadline(10.0) is None
    plan = DraftPlan(0, [1], 2, True)
    b = pipe.push(plan, [2, 3], [np.eye(8)[2], np.eye(8)[3]], now=100.0)
    assert pipe.verdict_deadline(10.0) == 110.0
    pipe.commit_round(b, 2, now=103.0)  # a 3 s round: deadlines stretch to 12 s
    pipe.push(DraftPlan(0, [1, 2, 3], 2, True), [4, 5], [np.eye(8)[4]] * 2, now=200.0)
    assert pipe.verdict_deadline(10.0) == 212.0


# ------------------------------------------------------------------------------ retry by time


def test_the_default_settings_outlast_a_verifier_restart() -> None:
    """A restart takes ~7 s: the daemon's default policy keeps retrying well past it, then gives
    up by time, naming the last cause."""
    policy = retry_policy(EdgeSettings(verifier="ws://v:1/v1/session"))
    outage = Outage(policy)
    t = 0.0
    while t <= 30.0:  # failed sessions every 0.5 s for 30 s: no give-up
        outage.failed(t, progressed=False, cause="connection refused")
        t += 0.5
    with pytest.raises(GiveUp, match=r"deadline 60 s.*last: connection refused"):
        outage.failed(61.0, progressed=False, cause="connection refused")


async def test_give_up_names_the_last_cause_even_when_it_has_no_message(
    aiohttp_server: Any, draft: LoadedModel
) -> None:
    """A verifier that accepts the WebSocket but never says it is ready: connection time-outs,
    named in the give-up."""

    async def mute(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=(SUBPROTOCOL,))
        await ws.prepare(request)
        async for _ in ws:
            pass
        return ws

    app = web.Application()
    app.router.add_get("/v1/session", mute)
    server = await aiohttp_server(app)
    url = session_url(server)
    retry = RetryPolicy(
        backoff_initial_s=0.05, backoff_max_s=0.1, handshake_timeout_s=0.2, deadline_s=0.8
    )
    a = agent(draft, url, retry)
    try:
        with pytest.raises(LinkClosed, match=r"last: verifier at .* was not ready within 2 s"):
            await asyncio.wait_for(a.generate(PROMPT, GREEDY, max_tokens=4), 30)
    finally:
        a.close()


async def test_a_full_verifier_is_reported_as_full(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    # No admission line: connections are bounded by max_sessions alone, and the holder's
    # connection takes the only one.
    url = await serve(aiohttp_server, target, max_sessions=1, admission_queue=0)
    holder = await WebSocketTransport.connect(LinkSettings(url=url, token=TOKEN, heartbeat_s=0))
    # A full verifier is busy, not down: its refusals (503 with Retry-After) count against
    # busy_deadline_s, and the give-up names the reason it gave.
    retry = RetryPolicy(
        backoff_initial_s=0.05, backoff_max_s=0.1, deadline_s=0.5, busy_deadline_s=0.5
    )
    a = agent(draft, url, retry)
    try:
        with pytest.raises(LinkClosed, match=r"stayed busy .* session limit \(busy\)"):
            await asyncio.wait_for(a.generate(PROMPT, GREEDY, max_tokens=4), 30)
    finally:
        a.close()
        await holder.close()


async def test_failures_that_waiting_cannot_clear_fail_at_once(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    url = await serve(aiohttp_server, target)
    slow_policy = RetryPolicy(backoff_initial_s=1.0, deadline_s=60.0)
    for bad, match in (
        (url.replace("/v1/session", "/v2/wrong"), "404"),
        ("ws://no-such-host.invalid/v1/session", "cannot resolve"),
    ):
        a = agent(draft, bad, slow_policy)
        try:
            t0 = time.monotonic()
            with pytest.raises(LinkRefused, match=match):
                await asyncio.wait_for(a.generate(PROMPT, GREEDY, max_tokens=4), 30)
            assert time.monotonic() - t0 < 5, bad  # no retries
        finally:
            a.close()


# ------------------------------------------------------------------------------ the daemon


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("deadline_servers"))
    yield s
    s.close()


def test_the_daemon_shows_a_stalled_link_and_frees_its_queue(
    servers: Servers, draft: LoadedModel, tiny_draft_dir: Path
) -> None:
    async def start() -> str:
        runner = web.AppRunner(stalling_app(draft.fingerprint), access_log=None)
        return await servers._start(runner)

    stuck = servers.lt.run(start()).replace("http://", "ws://") + "/v1/session"
    settings = edge_settings(
        tiny_draft_dir, stuck, servers.token_file, verdict_timeout=0.3, link_down_deadline=2.0
    )
    base, _ = servers.edge(settings)
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model="tiny", prompt="t1", max_tokens=4)
    assert e.value.status_code == 503 and time.monotonic() - t0 < 10
    status, body = get_json(base + "/health")
    assert status == 503 and body["link"]["state"] == "stalled", body
    assert "stalled" in str(body["link"])
    # The queue is free again: the next request is served (and fails the same bounded way).
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError):
        c.completions.create(model="tiny", prompt="t2", max_tokens=4)
    assert time.monotonic() - t0 < 10
    assert get_json(base + "/health")[1]["link"]["state"] == "stalled"
