"""The warm link (protocol v2): sessions multiplexed on one kept-open connection.

* Round trips are counted, not timed: over the WAN emulator (``trace``), the first token of a new
  session on a warm link is one round trip after the request (its Hello and first Propose leave
  in one flight); a cold start adds only the WebSocket upgrade (and TCP's handshake, which the
  emulator holds for one RTT).
* Isolation: of the sessions on one connection, one that floods (past its frame rate, past its
  window) is ended alone; the others' text is the target's, with no reconnection.
* A dropped connection resumes every session it carried (kept caches: no prefill), text
  unchanged; a verifier restart is outlasted by the link's background reconnection.
* A peer of the old protocol is refused with a message naming both versions.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import numpy as np
import pytest

from cloud_verifier.daemon.state import STATE, VerifierState
from cloud_verifier.engine.targets import TorchTarget
from edge_agent.link.connection import Connection, LinkSettings, StreamTransport, WebSocketTransport
from edge_agent.link.warm import WarmLink
from edge_agent.model.batching import BatchingWorker
from edge_agent.model.drafter import Drafter
from edge_agent.model.tasks import ModelWorker
from edge_agent.runtime.agent import EdgeAgent, RetryPolicy
from edge_agent.session.events import Committed, GenerationEvent
from edge_agent.session.opening import wire_context
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.transport import LinkClosed, Transport
from shared.errors import ErrorCode
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams
from shared.runtime.models import LoadedModel
from shared.wire.codec import decode, encode
from shared.wire.messages import PROTOCOL_VERSION, SUBPROTOCOL, Error, Hello, Propose, Welcome
from shared.wire.mux import frame
from testkit.harness import target_greedy
from testkit.net.wanem import Crossing, LinkConfig, WanEmulator, round_trips
from tests.stats import sequential_chi_square
from tests.system.test_edge_e2e import target_rows
from tests.verifiers import ready, serve_verifier, session_url, verifier_app

TOKEN = "warm-token-0123456789abcdef"
PROMPT = [1, 10, 20, 30, 40]
GREEDY = PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(0.0))


async def serve(aiohttp_server: Any, target: LoadedModel, **kw: Any) -> tuple[Any, VerifierState]:
    server = await serve_verifier(aiohttp_server, lambda: TorchTarget(target), auth=[TOKEN], **kw)
    return server, server.app[STATE]


def link_settings(url: str) -> LinkSettings:
    return LinkSettings(url=url, token=TOKEN, heartbeat_s=0)


def agent_on(draft: LoadedModel, connect: Any) -> EdgeAgent:
    retry = RetryPolicy(backoff_initial_s=0.01, backoff_max_s=0.05, deadline_s=20.0)
    return EdgeAgent(Drafter(draft), draft.fingerprint, connect, retry=retry)


def streams_of(conn: Connection) -> Any:
    """An agent's ``connect``: a new stream on ``conn`` each time."""

    async def connect() -> Transport:
        return conn.open_stream()

    return connect


def emulator_url(emu: WanEmulator) -> str:
    return f"ws://127.0.0.1:{emu.port}/v1/session"


# ------------------------------------------------------------------------------ round trips


async def test_the_first_token_costs_one_round_trip_on_a_warm_link(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    server, _ = await serve(aiohttp_server, target)
    upstream = ("127.0.0.1", server.port)
    link = LinkConfig(rtt_ms=200, bandwidth_bps=None)
    async with WanEmulator(upstream, link, trace=True) as emu:
        assert emu.crossings is not None
        loop = asyncio.get_running_loop()
        warm = WarmLink(link_settings(emulator_url(emu)))
        warm.start()
        agent = agent_on(draft, warm.stream)
        first: list[float] = []

        def on_event(ev: GenerationEvent) -> None:
            if isinstance(ev, Committed) and not first:
                first.append(loop.time())

        try:
            await agent.generate(PROMPT, GREEDY, max_tokens=4)  # warms the link
            assert warm.connects == 1
            conn_id = emu.crossings[0].conn
            for prompt in ([1, 5, 9], [1, 50, 51, 52]):
                first.clear()
                t0 = loop.time()
                gen = await agent.generate(prompt, GREEDY, max_tokens=16, on_event=on_event)
                assert gen.generated == target_greedy(target, prompt, 16)
                assert round_trips(emu.crossings, conn_id, t0, first[0]) == 1.0
            assert warm.connects == 1  # every session rode the same connection

            # Cold: a connection of its own costs the upgrade (and TCP's handshake) besides.
            cold = agent_on(
                draft, lambda: WebSocketTransport.connect(link_settings(emulator_url(emu)))
            )
            first.clear()
            t0 = loop.time()
            await cold.generate(PROMPT, GREEDY, max_tokens=8, on_event=on_event)
            cold.close()
            cold_id = max(c.conn for c in emu.crossings)
            assert cold_id != conn_id
            assert round_trips(emu.crossings, cold_id, t0, first[0]) == 2.0  # + TCP's one
        finally:
            agent.close()
            await warm.close()


def test_round_trips_follow_the_critical_path() -> None:
    """The counter itself: a chain of waits counts, traffic that waited for nothing does not."""
    c = [
        Crossing(1, "up", 0.0, 0.1, 10),  # the upgrade request
        Crossing(1, "down", 0.1, 0.2, 10),  # its answer
        Crossing(1, "up", 0.2, 0.3, 10),  # the Hello, sent on that answer
        Crossing(1, "up", 0.25, 0.35, 10),  # a Propose that waited for nothing more
        Crossing(1, "down", 0.35, 0.45, 10),  # the first token
        Crossing(2, "down", 0.0, 0.4, 10),  # another connection
    ]
    assert round_trips(c, 1, 0.0, 0.45) == 2.0
    assert round_trips(c, 1, 0.2, 0.45) == 1.0
    assert round_trips(c, 1, 0.0, 0.05) == 0.0


# ------------------------------------------------------------------------------ isolation


async def _open_raw(conn: Connection, fp: Any, **hello: Any) -> StreamTransport:
    st = conn.open_stream()
    await st.send(encode(Hello(fingerprint=fp, sampling=SamplingParams(0.0), **hello)))
    return st


async def _until_closed(st: Transport) -> list[Any]:
    """The frames a session gets until its stream ends (decoded where they decode alone)."""
    out: list[Any] = []
    try:
        while True:
            data = await asyncio.wait_for(st.recv(), 30)
            try:
                out.append(decode(data))
            except Exception:
                out.append(data)
    except LinkClosed as e:
        out.append(e)
    return out


@pytest.mark.parametrize("flood", ["rate", "window", "bad_frames"])
async def test_a_flooding_session_ends_alone(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel, flood: str
) -> None:
    server, _ = await serve(
        aiohttp_server,
        target,
        max_frame_rate=400.0,
        frame_burst=200,
        max_frame=4096,
        stream_window=8192,
        max_bad_frames=16 if flood == "bad_frames" else 100_000,
    )
    conn = await Connection.connect(link_settings(session_url(server)))
    try:
        honest = [agent_on(draft, streams_of(conn)) for _ in range(3)]
        prompts = [PROMPT, [1, 3, 5], [1, 9]]
        bad = await _open_raw(conn, target.fingerprint)
        junk = encode(Error("x", "y" * 40))

        async def hostile() -> list[Any]:
            with contextlib.suppress(LinkClosed):
                if flood == "window":
                    # three frames at once, flow control ignored: 11.7 kB past an 8 kB window
                    big = encode(Error("x", "y" * 3900))
                    await conn.send(frame(bad.sid, big))
                    await conn.send(frame(bad.sid, big))
                    await conn.send(frame(bad.sid, big))
                elif flood == "rate":
                    for _ in range(2000):
                        await bad.send(junk)
                else:
                    for _ in range(100):
                        await bad.send(b"\xc1 not a frame")
            return await _until_closed(bad)

        results = await asyncio.gather(
            hostile(),
            *(a.generate(p, GREEDY, max_tokens=24) for a, p in zip(honest, prompts, strict=True)),
        )
        got = results[0]
        assert isinstance(got[-1], LinkClosed), got[-3:]
        errors = [m.code for m in got if isinstance(m, Error)]
        want = {
            "rate": ErrorCode.RATE_LIMITED,
            "window": ErrorCode.FLOW_CONTROL,
            "bad_frames": ErrorCode.TOO_MANY_BAD_FRAMES,
        }[flood]
        assert want in errors, errors
        for p, gen in zip(prompts, results[1:], strict=True):
            assert gen.generated == target_greedy(target, p, 24)
            assert gen.stats.reconnects == 0 and gen.stats.busy_refusals == 0
        assert not conn.closed.is_set()
        for a in honest:
            a.close()
    finally:
        await conn.close()


async def test_a_session_past_its_kv_share_is_refused_alone(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    """The KV shares stay per session on a shared connection: a session whose prompt is past
    its share gets its error; three others on the connection go on, exact."""
    server, _ = await serve(
        aiohttp_server,
        target,
        kv_cache_tokens=512,
        kv_page_size=16,
        kv_session_share=0.25,  # 128 tokens a session
        kv_token_share=1.0,
    )
    conn = await Connection.connect(link_settings(session_url(server)))
    try:
        hog = await _open_raw(conn, target.fingerprint)
        ctx = wire_context(Hello(fingerprint=target.fingerprint), conn.ready.welcome())
        big = np.array([1, *range(2, 62)] * 4, np.int64)  # 244 tokens: past 128
        none = np.zeros(0, np.int64)
        await hog.send(encode(Propose(0, 0, 0, none, np.zeros(0, np.float32), big, True), ctx))
        honest = [agent_on(draft, streams_of(conn)) for _ in range(3)]
        prompts = [PROMPT, [1, 3, 5], [1, 9]]
        gens = await asyncio.gather(
            *(a.generate(p, GREEDY, max_tokens=24) for a, p in zip(honest, prompts, strict=True))
        )
        replies = [decode(await asyncio.wait_for(hog.recv(), 30)) for _ in range(2)]
        assert isinstance(replies[0], Welcome)  # then its refusal (the session stays open)
        err = replies[1]
        assert isinstance(err, Error) and err.code in ("context_full", "model_error"), err
        for p, gen in zip(prompts, gens, strict=True):
            assert gen.generated == target_greedy(target, p, 24)
            assert gen.stats.reconnects == 0
        for a in honest:
            a.close()
        await hog.close()
    finally:
        await conn.close()


async def test_a_session_that_stops_reading_holds_nobody(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    """A session whose edge never reads its frames: they wait in its own stream's inbox (up to
    its bound); the other sessions on the connection read theirs meanwhile."""
    server, _ = await serve(aiohttp_server, target)
    conn = await Connection.connect(link_settings(session_url(server)))
    try:
        mute = await _open_raw(conn, target.fingerprint, cogen_end=64)
        ctx_fixed = np.array(PROMPT, np.int64)
        ctx = wire_context(Hello(fingerprint=target.fingerprint), conn.ready.welcome())
        await mute.send(
            encode(
                Propose(0, 0, 0, np.zeros(0, np.int64), np.zeros(0, np.float32), ctx_fixed, True),
                ctx,
            )
        )
        honest = [agent_on(draft, streams_of(conn)) for _ in range(2)]
        gens = await asyncio.gather(
            *(
                a.generate(p, GREEDY, max_tokens=24)
                for a, p in zip(honest, ([1, 3, 5], PROMPT), strict=True)
            )
        )
        for p, gen in zip(([1, 3, 5], PROMPT), gens, strict=True):
            assert gen.generated == target_greedy(target, p, 24)
        for a in honest:
            a.close()
        await mute.close()
    finally:
        await conn.close()


# ------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("correction", [CorrectionMode.CANDIDATES, CorrectionMode.GREEDY_DRAFT])
async def test_sampled_sessions_multiplexed_on_one_link_keep_the_target_law(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel, correction: CorrectionMode
) -> None:
    """Four sampled generations at once on one warm link, their draft steps batched on one
    drafter (the daemon's concurrency): every emitted token is a draw from the target's p_t
    (the chi-square of tests/system/test_edge_e2e.py over all of them)."""
    server, _ = await serve(aiohttp_server, target)
    warm = WarmLink(link_settings(session_url(server)))
    warm.start()
    drafter = Drafter(draft)
    inner = ModelWorker("draft")
    batching = BatchingWorker(inner, drafter, 4)
    agent = EdgeAgent(drafter, draft.fingerprint, warm.stream, worker=batching)
    params = SamplingParams(1.0)
    prompts = [[1, 5 + i, 9 + 2 * i] for i in range(8)]
    toks: list[int] = []
    rows = []
    try:
        for wave in (prompts[:4], prompts[4:]):
            cfg = PipelineConfig(gamma=3, depth=2, sampling=params, correction=correction)
            gens = await asyncio.gather(
                *(agent.generate(p, cfg, max_tokens=150, seed=300 + i) for i, p in enumerate(wave))
            )
            for p, gen in zip(wave, gens, strict=True):
                toks += gen.generated
                rows.append(target_rows(target, p, gen.generated, params))
    finally:
        agent.close()
        await batching.aclose()
        inner.close()
        await warm.close()
    assert warm.connects == 1 and batching.rows > batching.batches  # shared link and forwards
    pv = sequential_chi_square(np.array(toks), np.concatenate(rows))
    assert pv > 1e-4, f"{correction}: chi-square p-value {pv:.2e} over {len(toks)} tokens"


# ------------------------------------------------------------------------------ resumption


async def test_a_dropped_connection_resumes_every_session(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    server, state = await serve(aiohttp_server, target, cogen_ahead=0)
    upstream = ("127.0.0.1", server.port)
    async with WanEmulator(upstream, LinkConfig(rtt_ms=20, bandwidth_bps=None)) as emu:
        warm = WarmLink(link_settings(emulator_url(emu)), backoff_initial_s=0.01)
        warm.start()
        agents = [agent_on(draft, warm.stream) for _ in range(3)]
        prompts = [PROMPT, [1, 3, 5], [1, 9, 17, 33]]
        n = 48
        committed = [0, 0, 0]
        dropped = asyncio.Event()

        def counter(i: int) -> Any:
            def on_event(ev: GenerationEvent) -> None:
                if not isinstance(ev, Committed):
                    return
                committed[i] += len(ev.ids)
                if all(c >= 12 for c in committed) and not dropped.is_set():
                    dropped.set()
                    emu.drop_all()

            return on_event

        try:
            gens = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        a.generate(p, GREEDY, max_tokens=n, on_event=counter(i))
                        for i, (a, p) in enumerate(zip(agents, prompts, strict=True))
                    )
                ),
                120,
            )
        finally:
            for a in agents:
                a.close()
            await warm.close()
    assert dropped.is_set() and warm.connects == 2
    for p, gen in zip(prompts, gens, strict=True):
        assert gen.generated == target_greedy(target, p, n)
        assert gen.stats.reconnects == 1
        # resumed from the verifier's kept cache: no prefill of the committed text again
        assert gen.stats.resumed_tokens > len(p)
    assert state.metrics.sessions_resumed.get() >= 3


async def test_the_warm_link_outlasts_a_verifier_restart(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    server, _ = await serve(aiohttp_server, target)
    port = server.port
    warm = WarmLink(link_settings(session_url(server)), backoff_initial_s=0.02, backoff_max_s=0.1)
    warm.start()
    agent = agent_on(draft, warm.stream)
    try:
        gen = await agent.generate(PROMPT, GREEDY, max_tokens=8)
        assert gen.generated == target_greedy(target, PROMPT, 8)
        await server.close()
        app = verifier_app(lambda: TorchTarget(target), auth=[TOKEN])
        await aiohttp_server(app, port=port)  # a new process state, same address
        await ready(app)
        for _ in range(200):
            if warm.up and warm.connects == 2:
                break
            await asyncio.sleep(0.05)
        assert warm.up and warm.connects == 2  # reconnected in the background
        gen = await agent.generate([1, 3, 5], GREEDY, max_tokens=16)
        assert gen.generated == target_greedy(target, [1, 3, 5], 16)
        assert gen.stats.reconnects == 0
    finally:
        agent.close()
        await warm.close()


# ------------------------------------------------------------------------------ versions


async def test_an_old_protocol_peer_is_refused_naming_both_versions(
    aiohttp_server: Any, target: LoadedModel
) -> None:
    server, _ = await serve(aiohttp_server, target)
    headers = {
        "Authorization": f"Bearer {TOKEN}",
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Protocol": "wanspec.v1",
    }
    url = session_url(server).replace("ws://", "http://")
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as r:
        body = await r.text()
    assert r.status == 400
    assert "wanspec.v1" in body and SUBPROTOCOL in body and str(PROTOCOL_VERSION) in body
