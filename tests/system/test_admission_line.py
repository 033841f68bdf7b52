"""Busy is not dead, again (issue 48): a slow or loaded verifier serves every request slowly
and in order; only a full admission line (its declared bound) refuses one.

Live verifiers with a tiny model whose forwards are padded (``SlowTarget``), edges of the
edge's own agent (the single-verifier session, plain WebSocket: Hello, then Progress frames
while in line, then the Welcome) and the edge daemon (its warm link: the Hello leaves with the
first Propose). Each edge's ``verifier_wait`` (``RetryPolicy.deadline_s``) and handshake
timeout are far shorter than the waits in line: they bound what makes no progress, and a wait
in line, told its place every ``progress_interval``, is progress.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from cloud_verifier.daemon.state import STATE, VerifierState
from cloud_verifier.engine.targets import TorchTarget
from edge_agent.link.connection import LinkSettings, WebSocketTransport
from edge_agent.model.drafter import Drafter
from edge_agent.runtime.agent import EdgeAgent
from edge_agent.session.generation import Generation
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.retry import RetryPolicy
from edge_agent.session.transport import Transport
from shared.maths.sampling import SamplingParams
from shared.runtime.models import LoadedModel
from shared.wire.codec import peek_type
from shared.wire.messages import MsgType
from testkit.harness import target_greedy
from tests.edge_helpers import TOKEN, SlowTarget
from tests.system.test_edge_waits import edge_api, read_sse, waits_settings
from tests.verifiers import serve_verifier, session_url
from tests.waits import until

CFG = PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(0.0), cogen=False)
#: Far shorter than any wait in line here: it must not be what ends one.
NO_PROGRESS_S = 2.0


def prompt(i: int) -> list[int]:
    return [1, 10 + i, 20, 30 + i, 40]


class Watched:
    """A transport that notes when its session's Welcome came (its admission)."""

    def __init__(self, inner: Transport, welcomed: Callable[[], None]) -> None:
        self.inner = inner
        self.welcomed = welcomed
        self.seen = False

    async def send(self, data: bytes) -> None:
        await self.inner.send(data)

    async def recv(self) -> bytes:
        data = await self.inner.recv()
        if not self.seen and peek_type(data) == MsgType.WELCOME:
            self.seen = True
            self.welcomed()
        return data

    async def close(self) -> None:
        await self.inner.close()


def edge(draft: LoadedModel, url: str, welcomed: Callable[[], None]) -> EdgeAgent:
    link = LinkSettings(url=url, token=TOKEN, heartbeat_s=0, connect_timeout_s=5.0)

    async def connect() -> Transport:
        return Watched(await WebSocketTransport.connect(link), welcomed)

    retry = RetryPolicy(
        deadline_s=NO_PROGRESS_S, handshake_timeout_s=NO_PROGRESS_S, verdict_timeout_s=5.0
    )
    return EdgeAgent(Drafter(draft), draft.fingerprint, connect, retry=retry)


async def line_up(
    state: VerifierState, draft: LoadedModel, url: str, n: int, tokens: int
) -> tuple[list[Generation], list[int]]:
    """``n`` edges, each arriving once the one before is admitted or waits in line: their
    generations, and the order in which they were admitted (their Welcomes)."""
    admitted: list[int] = []
    agents = []
    runs = []
    for i in range(n):
        a = edge(draft, url, lambda i=i: admitted.append(i))  # type: ignore[misc]
        agents.append(a)
        runs.append(asyncio.ensure_future(a.generate(prompt(i), CFG, max_tokens=tokens, seed=i)))
        await until(lambda i=i: state.streams + len(state.line) == i + 1, 30.0, "arrived")
    try:
        gens = await asyncio.wait_for(asyncio.gather(*runs), 300)
    finally:
        for a in agents:
            a.close()
    return list(gens), admitted


async def test_a_lone_request_and_two_behind_it_on_a_slow_verifier(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    """Forwards padded to 1.2 s, one session at a time: the lone request gets the target's
    exact greedy text; a second and a third wait in line (told their place, far past the
    edge's 2 s bound on no progress) and complete, exact, in arrival order."""
    server = await serve_verifier(
        aiohttp_server,
        lambda: SlowTarget(TorchTarget(target), 1.2),
        auth=[TOKEN],
        max_sessions=1,
        progress_interval=0.2,
    )
    state: VerifierState = server.app[STATE]
    gens, admitted = await line_up(state, draft, session_url(server), 3, 4)
    assert admitted == [0, 1, 2]
    for i, g in enumerate(gens):
        assert g.generated == target_greedy(target, prompt(i), 4), i
        assert g.stats.reconnects == 0 and g.stats.busy_refusals == 0, g.stats
    assert gens[0].stats.admission_wait_s == 0.0
    assert gens[1].stats.admission_wait_s > NO_PROGRESS_S, gens[1].stats
    assert gens[2].stats.admission_wait_s > gens[1].stats.admission_wait_s
    m = state.metrics
    assert m.sessions_queued.get() == 2 and m.admission_wait.count() == 2
    assert m.sessions_refused.get(reason="overloaded") == 0


async def test_eight_edges_on_a_small_verifier_all_complete_in_arrival_order(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    """Eight edges, two session slots and a deep model queue (max_queue_delay 0.01 s: past it
    whenever a forward runs): six or seven wait in line; every one gets the target's exact
    greedy text, none fails, and the order of admission is the order of arrival (at 7246e6d 5
    of 8 gave up after verifier_wait)."""
    server = await serve_verifier(
        aiohttp_server,
        lambda: SlowTarget(TorchTarget(target), 0.4),
        auth=[TOKEN],
        max_sessions=2,
        max_queue_delay=0.01,
        progress_interval=0.2,
    )
    state: VerifierState = server.app[STATE]
    gens, admitted = await line_up(state, draft, session_url(server), 8, 6)
    assert admitted == list(range(8))
    for i, g in enumerate(gens):
        assert g.generated == target_greedy(target, prompt(i), 6), i
        assert g.stats.reconnects == 0 and g.stats.busy_refusals == 0, g.stats
    assert 6 <= state.metrics.sessions_queued.get() <= 7  # (the second, if a forward ran)
    assert not state.line and state.streams == 0


async def test_six_requests_through_one_daemon_on_ten_second_forwards(
    aiohttp_server: Any, target: LoadedModel, tiny_draft_dir: Path, tmp_path: Path
) -> None:
    """Six requests at once through one edge daemon (four generation slots) on a verifier
    whose forwards take 10 s: two wait for a slot far past verifier_wait (2 s), and all six
    get the target's exact greedy text; the streaming ones keep their SSE keep-alives
    meanwhile."""
    server = await serve_verifier(
        aiohttp_server,
        lambda: SlowTarget(TorchTarget(target), 10.0),
        auth=[TOKEN],
        progress_interval=0.5,
    )
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    s = waits_settings(
        tiny_draft_dir,
        session_url(server),
        token_file,
        verifier_wait=NO_PROGRESS_S,
        max_concurrent=4,
        stream_keepalive=1.0,
    )
    n = 3

    async def ask(http: aiohttp.ClientSession, base: str, i: int) -> tuple[str, bytes]:
        body = {"model": "tiny", "prompt": prompt(i), "max_tokens": n, "ignore_eos": True}
        if i % 2:
            body["stream"] = True
            async with http.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                texts, errors, raw = await read_sse(r)
                assert not errors, raw
                return "".join(texts), raw
        async with http.post(base + "/v1/completions", json=body) as r:
            answer = await r.json()
            assert r.status == 200, answer
            return answer["choices"][0]["text"], json.dumps(answer).encode()

    async with edge_api(s) as (edge_state, base):
        timeout = aiohttp.ClientTimeout(total=400)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            t0 = time.monotonic()
            asks = []
            for i in range(6):  # in this order: the last two wait for a slot
                asks.append(asyncio.ensure_future(ask(http, base, i)))
                q = edge_state.service.queue
                await until(lambda i=i, q=q: q.active + q.waiting == i + 1, 30.0, "in")  # type: ignore[misc]
            answers = await asyncio.gather(*asks)
            took = time.monotonic() - t0
    assert took > 2 * 10.0, took  # the waits were long, and none ended a request
    for i, (text, raw) in enumerate(answers):
        want = target.tokenizer.decode(
            target_greedy(target, prompt(i), n), skip_special_tokens=True
        )
        assert text == want, (i, text, want)
        if i % 2:
            assert b": keep-alive\n\n" in raw, raw
