"""Busy is not dead (issue 21): a loaded verifier slows edges down and never fails them.

Pure rules first (no sockets, no sleeps): the verifier core's Progress frames, its frame-rate
bucket and the resumption handshake; the edge's verdict deadline; the retry policy for busy
refusals; the engine's step-time model. Then the same against a live in-process verifier with a
tiny model: Progress while a slow forward runs, admission control (503 ``overloaded`` with
Retry-After while open sessions go on), resumption of a lost session without a prefill (and
never across tenants), the KV shares, frame floods; and end to end through the edge agent: a
verifier slower than the edge's verdict floor gives the exact text with no reconnect, and a
dropped connection resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import numpy as np
import pytest

from cloud_verifier.daemon.app import build_app
from cloud_verifier.daemon.auth import Authenticator
from cloud_verifier.daemon.routes import REFUSAL_HEADER
from cloud_verifier.daemon.settings import VerifierSettings
from cloud_verifier.daemon.state import STATE, VerifierState
from cloud_verifier.engine.step_times import StallRule, StepTimes
from cloud_verifier.engine.targets import TorchTarget
from cloud_verifier.engine.work import FailureKind, Verify, WorkProgress
from cloud_verifier.session.core import VerifierCore
from cloud_verifier.session.events import Adopt, Close, CoreState, Run, Send
from cloud_verifier.session.limits import SessionLimits, TargetInfo
from edge_agent.link.connection import LinkSettings, VerifierBusy, WebSocketTransport, retry_after_s
from edge_agent.model.drafter import Drafter
from edge_agent.runtime.agent import EdgeAgent, RetryPolicy
from edge_agent.session.events import Count
from edge_agent.session.generation import Generation, TokenSource
from edge_agent.session.opening import DesyncError, resumed_length
from edge_agent.session.pipeline import PREFILL_ALLOWANCE_S, Pipeline
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.retry import GiveUp, Outage
from edge_agent.session.transport import LinkClosed, Transport
from shared.maths.sampling import SamplingParams
from shared.runtime.models import LoadedModel
from shared.wire.codec import encode
from shared.wire.messages import (
    SUBPROTOCOL,
    Error,
    Fingerprint,
    Hedge,
    Hello,
    Progress,
    Propose,
    Resume,
    Resumed,
    Rollback,
    Verdict,
    Welcome,
    text_digest,
)
from testkit.harness import target_greedy
from testkit.net.stream_ws import StreamWS
from testkit.probe import ProbeClient, auth_headers
from tests.edge_helpers import SlowTarget

TOKEN = "busy-test-token-0123456789"
OTHER = "busy-test-other-0123456789"
PROMPT = [1, 10, 20, 30, 40]
GREEDY = SamplingParams(temperature=0.0)
FP = Fingerprint("tok", 64, "tiny")


# ------------------------------------------------------------------------ pure: verifier core


def core(**limits: Any) -> VerifierCore:
    return VerifierCore(TargetInfo(FP, 64), SessionLimits(**limits), "s", resume_token="r" * 32)


def propose(seq: int, pos: int, draft: list[int], fixed: list[int] | None = None) -> Propose:
    return Propose(
        epoch=0,
        seq=seq,
        pos=pos,
        draft=np.array(draft, np.int64),
        q=np.ones(len(draft), np.float32),
        fixed=np.array(fixed or [], np.int64),
    )


def opened(c: VerifierCore, **hello: Any) -> Welcome:
    events = c.receive(encode(Hello(FP, GREEDY, **hello)), 0.0)
    welcome = next(e.msg for e in events if isinstance(e, Send))
    assert isinstance(welcome, Welcome)
    return welcome


def sent(events: list[Any]) -> list[Any]:
    return [e.msg for e in events if isinstance(e, Send)]


def test_progress_is_due_after_an_interval_and_never_while_stalled() -> None:
    c = core(progress_interval_s=1.0)
    welcome = opened(c, progress=True, resumable=True)
    assert welcome.resume == "r" * 32 and welcome.resumed is None
    assert opened(core()).resume is None  # an edge that cannot resume gets no token
    assert c.progress_due() is None  # no work
    events = c.receive(encode(propose(0, 0, [5, 6], PROMPT), c.ctx), 10.0)
    assert any(isinstance(e, Run) for e in events) and c.progress_due() == 11.0
    report = WorkProgress(steps=7, ahead=2, running=False, eta_s=3.5)
    assert c.report(report, 10.5) == []  # not due yet
    (p,) = sent(c.report(report, 11.0))
    assert p == Progress(steps=7, ahead=2, eta_ms=3500, running=False)
    assert c.progress_due() == 12.0 and c.report(report, 11.5) == []
    stalled = WorkProgress(steps=7, ahead=0, running=True, eta_s=0.0, stalled=True)
    assert c.report(stalled, 20.0) == []  # a stalled engine's sessions hear nothing
    (p,) = sent(c.report(WorkProgress(2**32 + 3, 0, True, 0.2), 20.0))
    assert p == Progress(steps=3, ahead=0, eta_ms=200, running=True)


def test_no_progress_frames_unless_the_edge_asked() -> None:
    c = core(progress_interval_s=1.0)
    opened(c)
    c.receive(encode(propose(0, 0, [5], PROMPT), c.ctx), 0.0)
    assert c.progress_due() is None and c.report(WorkProgress(1, 0, True, 1.0), 100.0) == []


def test_frame_rate_bucket_closes_a_flood_and_spares_a_steady_sender() -> None:
    c = core(max_frame_rate=10.0, frame_burst=5, max_bad_frames=10_000)
    opened(c)
    hedge = encode(Hedge(3, 4, np.array([5]), np.ones(1, np.float32)), c.ctx)
    for i in range(50):  # 10 a second: never past the rate
        assert not any(isinstance(e, Close) for e in c.receive(hedge, 1.0 + i * 0.1))
    flood = [c.receive(hedge, 10.0) for _ in range(6)]
    assert not any(isinstance(e, Close) for ev in flood[:5] for e in ev)
    (close,) = [e for e in flood[5] if isinstance(e, Close)]
    assert close.error.code == "rate_limited" and close.error.fatal and c.closed


def test_resume_handshake_adopts_the_kept_tokens() -> None:
    c = core()
    events = c.receive(encode(Hello(FP, GREEDY, resume=Resume("t" * 32, 9))), 0.0)
    assert events == [Adopt("t" * 32, 9)] and c.state == CoreState.RESUMING
    kept = [*PROMPT, 7, 8]
    (welcome,) = sent(c.adopted(kept))
    assert welcome.resumed == Resumed(len(kept), text_digest(kept))
    assert (c.cache_len, c.next_pos, c.text, c.resumed) == (7, 7, kept, 7)
    # The next Propose starts at the end of the kept cache, without fixed tokens.
    (run,) = [
        e for e in c.receive(encode(propose(0, 7, [9, 10]), c.ctx), 1.0) if isinstance(e, Run)
    ]
    assert isinstance(run.work, Verify) and run.work.start == 7 and len(run.work.fixed) == 0
    fresh = core()
    fresh.receive(encode(Hello(FP, GREEDY, resume=Resume("x", 3))), 0.0)
    (welcome,) = sent(fresh.adopted(None))
    assert welcome.resumed is None and fresh.cache_len == 0


# ------------------------------------------------------------------------ pure: edge and retry


def pipeline() -> Pipeline:
    gen = Generation(PROMPT, 8)
    return Pipeline(
        gen,
        PipelineConfig(gamma=2, depth=2, sampling=GREEDY),
        np.random.default_rng(0),
        gamma=2,
        deterministic_draft=True,
    )


def test_verdict_deadline_follows_progress_and_the_prompt_length() -> None:
    pipe = pipeline()
    plan = pipe.plan()
    assert plan is not None
    b = pipe.push(plan, [3, 4], [np.ones(64, np.float32) / 64] * 2, now=100.0)
    b.fixed = 300  # a first round: the prompt's prefill is allowed for
    floor = 10.0
    first = pipe.verdict_deadline(floor)
    assert first == pytest.approx(100.0 + floor + 300 * PREFILL_ALLOWANCE_S)
    # Progress frames move the deadline: each gives floor (or 4 × the verifier's estimate).
    pipe.on_progress(Progress(steps=1, ahead=3, eta_ms=20_000), now=112.0)
    assert pipe.verdict_deadline(floor) == pytest.approx(112.0 + 4 * 20.0)
    pipe.on_progress(Progress(steps=2, ahead=0, eta_ms=100, running=True), now=190.0)
    assert pipe.verdict_deadline(floor) == pytest.approx(190.0 + floor)
    # the pipeline reports the frames it saw (Count events); its driver counts them
    for event in pipe.news():
        if isinstance(event, Count):
            pipe.gen.stats.apply(event)
    assert pipe.gen.stats.progress_frames == 2


def test_a_resumed_cache_must_hold_the_committed_text() -> None:
    gen = Generation(PROMPT, 8)
    gen.commit([7, 8], TokenSource.EDGE_DRAFT)
    w = Welcome(FP, "s", 4, 100, 100, 4096)
    assert resumed_length(gen, w) == 0
    ok = Welcome(FP, "s", 4, 100, 100, 4096, resumed=Resumed(6, text_digest([*PROMPT, 7])))
    assert resumed_length(gen, ok) == 6
    for bad in (Resumed(6, text_digest([*PROMPT, 9])), Resumed(9, 0)):
        with pytest.raises(DesyncError):
            resumed_length(gen, Welcome(FP, "s", 4, 100, 100, 4096, resumed=bad))


def test_busy_refusals_wait_retry_after_with_jitter_and_count_against_the_one_bound() -> None:
    """Busy is not down (its Retry-After is honoured, the give-up names it), but both count
    against one bound (issue 38: a busy refusal used to restart the down clock)."""
    policy = RetryPolicy(deadline_s=60.0, backoff_max_s=2.0)
    rng = random.Random(0)
    delays = [policy.delay(1, rng, retry_after=4.0) for _ in range(200)]
    assert all(4.0 <= d <= 6.0 for d in delays) and max(delays) - min(delays) > 1.0
    outage = Outage(policy)
    for t in range(0, 60, 5):  # 55 s of busy refusals: within the bound
        outage.failed(float(t), progressed=False, cause="busy", busy=True)
    outage.failed(57.0, progressed=False, cause="connection refused")  # no clock restarted
    with pytest.raises(GiveUp, match="no verifier made progress for 60 s") as e:
        outage.failed(60.0, progressed=False, cause="connection refused")
    assert e.value.retry_after == 2  # the backoff's ceiling: the last failure was not busy
    busy = Outage(policy)
    busy.failed(0.0, progressed=False, cause="overloaded", busy=True, retry_after=7.5)
    with pytest.raises(GiveUp, match="stayed busy for 61 s") as e:
        busy.failed(61.0, progressed=False, cause="overloaded", busy=True, retry_after=7.5)
    assert e.value.retry_after == 8  # the verifier's own Retry-After, in whole seconds
    assert retry_after_s("7") == 7.0 and retry_after_s("Wed, 21 Oct 2015") is None
    assert retry_after_s("99999") == 300.0 and retry_after_s(None) is None


def test_step_times_fit_a_line_and_judge_stalls() -> None:
    t = StepTimes()
    assert t.estimate(100) == 0.0 and not t.known
    t.anchor(8, 0.018)
    t.anchor(128, 0.258)  # 2 ms + 2 ms per token
    assert t.estimate(300) == pytest.approx(0.602)
    rule = StallRule(factor=8.0, floor_s=30.0)
    assert not t.stalled(300, 29.0, rule) and t.stalled(300, 31.0, rule)
    padded = StepTimes()  # every forward padded to 15 s, whatever its size
    padded.anchor(8, 15.0)
    padded.anchor(128, 15.0)
    assert padded.estimate(4000) == pytest.approx(15.0)
    assert not padded.stalled(4000, 100.0, rule) and padded.stalled(4000, 121.0, rule)


# ------------------------------------------------------------------------ a live verifier


class Verifier:
    """A verifier app on a loopback port (the aiohttp_server fixture's)."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.state: VerifierState = server.app[STATE]
        self.url = str(server.make_url("/v1/session")).replace("http://", "ws://")
        self.http = aiohttp.ClientSession()

    async def open(self, hello: Hello, token: str = TOKEN) -> ProbeClient:
        ws = StreamWS(
            await self.http.ws_connect(
                self.url, headers=auth_headers(token), protocols=(SUBPROTOCOL,), heartbeat=None
            )
        )
        pc = ProbeClient(ws)
        await pc.hello(hello)
        return pc

    async def until(self, ready: Callable[[], bool], timeout: float = 20.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not ready():
            assert loop.time() < deadline, "condition not met in time"
            await asyncio.sleep(0.01)


@pytest.fixture
async def serve(aiohttp_server: Any, target: LoadedModel) -> AsyncIterator[Callable[..., Any]]:
    made: list[Verifier] = []

    async def start(slow_s: float = 0.0, **kw: Any) -> Verifier:
        kw.setdefault("heartbeat", 0.0)
        torch_target = TorchTarget(target)
        app = build_app(
            VerifierSettings(model="tiny", **kw),
            auth=Authenticator([TOKEN, OTHER]),
            loader=lambda: SlowTarget(torch_target, slow_s) if slow_s else torch_target,
        )
        v = Verifier(await aiohttp_server(app))
        made.append(v)
        await v.until(lambda: v.state.status == "ready", 60.0)
        return v

    yield start
    for v in made:
        await v.http.close()


def hello(target: LoadedModel, **kw: Any) -> Hello:
    return Hello(target.fingerprint, GREEDY, seed=1, cogen_end=0, **kw)


def prompt_propose(seq: int, draft: list[int]) -> Propose:
    return propose(seq, 0, draft, PROMPT)


async def test_progress_frames_arrive_while_a_slow_forward_runs(
    serve: Callable[..., Any], target: LoadedModel
) -> None:
    v = await serve(slow_s=0.8, progress_interval=0.2)
    pc = await v.open(hello(target, progress=True))
    await pc.send(prompt_propose(0, [3, 4]))
    frames = []
    while not isinstance(frame := await pc.recv(timeout=30), Verdict):
        frames.append(frame)
    assert frames and all(isinstance(f, Progress) for f in frames)
    assert v.state.metrics.progress_frames.get() == len(frames)
    quiet = await v.open(hello(target))  # did not ask: no Progress frames
    await quiet.send(prompt_propose(0, [3, 4]))
    assert isinstance(await quiet.recv(timeout=30), Verdict)


async def test_a_session_that_cannot_start_waits_in_line_told_its_place(
    serve: Callable[..., Any], target: LoadedModel
) -> None:
    """Busy waits in line (issue 48): behind a session being served, with the model queue
    past max_queue_delay, a new session is not refused but queued, told its place and the
    expected wait in Progress frames, and started when the served one ends."""
    v = await serve(max_queue_delay=5.0, progress_interval=0.1)
    m = v.state.metrics
    pc = await v.open(hello(target))
    v.state.engine.queue_delay_s = lambda: 42.0  # type: ignore[method-assign]
    waiting = asyncio.ensure_future(v.open(hello(target, progress=True)))
    await v.until(lambda: len(v.state.line) == 1 and m.progress_frames.get() >= 2)
    assert m.sessions_queued.get() == 1 and m.admission_waiting.get() == 1
    assert m.sessions_refused.get(reason="overloaded") == 0 and not waiting.done()
    await pc.send(prompt_propose(0, [3, 4]))  # the open session goes on
    assert isinstance(await pc.recv(timeout=30), Verdict)
    await pc.ws.close()  # its end is the waiting one's turn
    queued = await asyncio.wait_for(waiting, 30)
    assert queued.queued and all(p.ahead == 0 and p.eta_ms > 0 for p in queued.queued)
    assert not v.state.line and m.admission_wait.count() == 1
    await queued.send(prompt_propose(0, [3, 4]))  # a lone session is served, however deep
    assert isinstance(await queued.recv(timeout=30), Verdict)


async def test_a_lone_session_on_a_slow_verifier_is_admitted(
    serve: Callable[..., Any], target: LoadedModel
) -> None:
    """A slow step is not overload: with nobody else served, a queue past max_queue_delay
    admits the session at once (it was refused 503 ``overloaded`` at 7246e6d)."""
    v = await serve(max_queue_delay=5.0)
    v.state.engine.queue_delay_s = lambda: 42.0  # type: ignore[method-assign]
    pc = await v.open(hello(target, progress=True))
    assert pc.welcome is not None and not pc.queued and not v.state.line
    assert v.state.metrics.sessions_queued.get() == 0


async def test_a_full_line_refuses_at_once_with_retry_after(
    serve: Callable[..., Any], target: LoadedModel
) -> None:
    """503 ``overloaded`` with Retry-After is for a full admission line (its declared bound),
    before the upgrade; the sessions in line and the served one are not harmed."""
    v = await serve(max_sessions=1, admission_queue=1, progress_interval=0.1)
    pc = await v.open(hello(target))
    waiting = asyncio.ensure_future(v.open(hello(target, progress=True)))
    await v.until(lambda: len(v.state.line) == 1)
    with pytest.raises(aiohttp.WSServerHandshakeError) as e:
        await v.open(hello(target))
    assert e.value.status == 503 and e.value.headers is not None
    assert e.value.headers[REFUSAL_HEADER] == "overloaded"
    assert 1 <= int(e.value.headers["Retry-After"]) <= 60
    assert v.state.metrics.sessions_refused.get(reason="overloaded") == 1
    # The edge names the refusal and takes its Retry-After.
    link = LinkSettings(url=v.url, token=TOKEN, heartbeat_s=0)
    with pytest.raises(VerifierBusy, match="admission line is full") as busy:
        await WebSocketTransport.connect(link)
    assert busy.value.reason == "overloaded" and busy.value.retry_after is not None
    await pc.send(prompt_propose(0, [3, 4]))  # the served session goes on
    assert isinstance(await pc.recv(timeout=30), Verdict)
    await pc.ws.close()
    assert (await asyncio.wait_for(waiting, 30)).welcome is not None


async def test_the_line_is_fair_between_tokens_and_ordered_within_one(
    serve: Callable[..., Any], target: LoadedModel
) -> None:
    """Three sessions of one token then one of another wait behind a served session: the
    other token's starts second, not last; the first token's start in arrival order (issue
    48)."""
    v = await serve(max_sessions=1, progress_interval=0.1)
    first = await v.open(hello(target))
    started: list[str] = []
    sessions: dict[str, ProbeClient] = {}

    async def arrive(name: str, token: str) -> None:
        sessions[name] = await v.open(hello(target, progress=True), token=token)
        started.append(name)

    tasks = []
    for name, token in (("a1", TOKEN), ("a2", TOKEN), ("a3", TOKEN), ("b1", OTHER)):
        tasks.append(asyncio.ensure_future(arrive(name, token)))
        n = len(tasks)
        await v.until(lambda n=n: len(v.state.line) == n)  # type: ignore[misc]
    await first.ws.close()
    for i in range(4):  # each started session ends in turn: the next one's turn
        await v.until(lambda i=i: len(started) == i + 1)
        await sessions[started[i]].ws.close()
    assert started == ["a1", "b1", "a2", "a3"]


async def _lose(pc: ProbeClient) -> None:
    """Cut the connection without a close frame (a network blip)."""
    conn = pc.ws.ws._response.connection
    assert conn is not None and conn.transport is not None
    conn.transport.abort()


async def test_a_lost_session_resumes_without_a_prefill_and_never_across_tenants(
    serve: Callable[..., Any], target: LoadedModel
) -> None:
    v = await serve()
    m = v.state.metrics
    want = target_greedy(target, PROMPT, 4)
    plain = await v.open(hello(target))  # cannot resume: nothing is kept when it is lost
    assert plain.welcome is not None and plain.welcome.resume is None
    await _lose(plain)
    await v.until(
        lambda: plain.welcome is not None and plain.welcome.session_id not in v.state.sessions
    )
    assert not v.state.parked
    pc = await v.open(hello(target, progress=True, resumable=True))
    assert pc.welcome is not None and pc.welcome.resume
    await pc.send(prompt_propose(0, want[:2]))
    assert (await pc.recv_as(Verdict)).accepted == 2
    fixed_before = m.fixed_tokens.get()
    await _lose(pc)
    await v.until(lambda: len(v.state.parked) == 1)
    committed = [*PROMPT, *want[:2]]
    resume = Resume(pc.welcome.resume, len(committed))
    # Another tenant presenting the token gets a new, empty session; the kept one stays.
    thief = await v.open(hello(target, resume=resume), token=OTHER)
    assert thief.welcome is not None and thief.welcome.resumed is None
    assert m.resume_misses.get(reason="tenant") == 1 and len(v.state.parked) == 1
    back = await v.open(hello(target, resume=resume, resumable=True))
    assert back.welcome is not None
    assert back.welcome.resumed == Resumed(len(committed), text_digest(committed))
    assert m.sessions_resumed.get() == 1 and not v.state.parked
    await back.send(propose(0, len(committed), want[2:4]))
    assert (await back.recv_as(Verdict)).accepted == 2
    assert m.fixed_tokens.get() == fixed_before  # nothing was prefilled again
    # A normal close (the edge is done) keeps nothing.
    await back.ws.close()
    await v.until(
        lambda: back.welcome is not None and back.welcome.session_id not in v.state.sessions
    )
    assert not v.state.parked


async def test_kv_shares_bound_a_session_and_a_tenant(
    serve: Callable[..., Any], target: LoadedModel
) -> None:
    v = await serve(kv_cache_tokens=64, kv_page_size=8, kv_session_share=0.5, kv_token_share=0.75)
    a = await v.open(hello(target))
    assert a.welcome is not None and a.welcome.max_context == 32  # half of 64 tokens
    await a.send(propose(0, 0, [3], list(range(1, 31))))  # 31 tokens: 4 pages
    assert isinstance(await a.recv(timeout=30), Verdict)
    b = await v.open(hello(target))  # same token: 2 of its 6 pages left
    await b.send(propose(0, 0, [3], list(range(1, 20))))  # 20 tokens: 3 pages
    err = await b.recv_as(Error, timeout=30)
    assert err.code == "model_error" and not err.fatal
    assert v.state.metrics.model_errors.get(kind=FailureKind.KV_QUOTA) == 1
    c = await v.open(hello(target), token=OTHER)  # another tenant is not held back
    await c.send(propose(0, 0, [3], list(range(1, 20))))
    assert isinstance(await c.recv(timeout=30), Verdict)


async def test_a_frame_flood_closes_only_its_session(
    serve: Callable[..., Any], target: LoadedModel
) -> None:
    """Valid frames are rate-limited too: a flood of Rollbacks (each one engine work) closes
    that session with rate_limited; another session is served as before."""
    v = await serve(max_frame_rate=100.0, frame_burst=200)
    flood = await v.open(hello(target))
    calm = await v.open(hello(target))
    await flood.send(prompt_propose(0, [3]))
    assert isinstance(await flood.recv(timeout=30), Verdict)
    with contextlib.suppress(ConnectionError):
        for epoch in range(10, 3000):  # (past any epoch a rejection entered)
            await flood.ws.send_bytes(encode(Rollback(epoch, len(PROMPT)), flood.ctx))
    replies: list[Any] = []
    with contextlib.suppress(ConnectionError):
        while True:
            replies.append(await flood.recv(timeout=30))
    assert [m.code for m in replies if isinstance(m, Error)] == ["rate_limited"]
    assert v.state.metrics.errors_sent.get(code="rate_limited") == 1
    await calm.send(prompt_propose(0, [3]))
    assert isinstance(await calm.recv(timeout=30), Verdict)


# ------------------------------------------------------------------------ end to end


def agent(draft: LoadedModel, url: str, retry: RetryPolicy, wrap: Any = None) -> EdgeAgent:
    link = LinkSettings(url=url, token=TOKEN, heartbeat_s=0, connect_timeout_s=5.0)

    async def connect() -> Transport:
        t: Transport = await WebSocketTransport.connect(link)
        return t if wrap is None else wrap(t)

    return EdgeAgent(Drafter(draft), draft.fingerprint, connect, retry=retry)


CFG = PipelineConfig(gamma=3, depth=2, sampling=GREEDY, cogen=False)


async def test_a_verifier_slower_than_the_verdict_floor_gives_the_text_without_reconnects(
    serve: Callable[..., Any], target: LoadedModel, draft: LoadedModel
) -> None:
    """Every forward takes 1.2 s, the edge's verdict floor is 0.5 s: Progress frames keep the
    session; the negative control (no Progress: progress_interval longer than any round)
    leaves the verifier as stalled."""
    v = await serve(slow_s=1.2, progress_interval=0.2)
    retry = RetryPolicy(verdict_timeout_s=0.5, deadline_s=5.0, stall_rebuilds=0)
    a = agent(draft, v.url, retry)
    try:
        gen = await asyncio.wait_for(a.generate(PROMPT, CFG, max_tokens=6), 120)
    finally:
        a.close()
    assert gen.generated == target_greedy(target, PROMPT, 6)
    assert gen.stats.reconnects == 0 and gen.stats.progress_frames > 0
    quiet = await serve(slow_s=1.2, progress_interval=60.0)
    a = agent(draft, quiet.url, retry)
    try:
        with pytest.raises(LinkClosed, match="stalled"):
            await asyncio.wait_for(a.generate(PROMPT, CFG, max_tokens=6), 60)
    finally:
        a.close()


class CutAfter:
    """A transport that loses its connection (no close frame) after ``n`` frames received."""

    cuts = 0

    def __init__(self, inner: Transport, n: int) -> None:
        self.inner, self.n, self.seen = inner, n, 0

    async def send(self, data: bytes) -> None:
        await self.inner.send(data)

    async def recv(self) -> bytes:
        self.seen += 1
        if self.seen > self.n and CutAfter.cuts == 0:
            CutAfter.cuts += 1
            ws = self.inner.conn._ws
            ws._response.connection.transport.abort()
            raise LinkClosed("connection lost (test)")
        return await self.inner.recv()

    async def close(self) -> None:
        await self.inner.close()


async def test_the_agent_resumes_a_dropped_session_without_a_prefill(
    serve: Callable[..., Any], target: LoadedModel, draft: LoadedModel
) -> None:
    """The same generation, its connection cut at the same point, against a verifier that keeps
    lost sessions and one that does not (resume_grace 0): the same exact text; with resumption
    the reconnect prefills nothing it had (the prompt and everything committed are not sent
    again as fixed tokens)."""
    fixed: dict[bool, float] = {}
    for keep in (True, False):
        v = await serve(resume_grace=30.0 if keep else 0.0)
        retry = RetryPolicy(backoff_initial_s=0.2, backoff_max_s=0.4, deadline_s=10.0)
        CutAfter.cuts = 0
        a = agent(draft, v.url, retry, wrap=lambda t: CutAfter(t, 3))
        try:
            gen = await asyncio.wait_for(a.generate(PROMPT, CFG, max_tokens=12), 120)
        finally:
            a.close()
        assert gen.generated == target_greedy(target, PROMPT, 12)
        m = v.state.metrics
        assert CutAfter.cuts == 1 and gen.stats.reconnects == 1
        assert m.sessions_resumed.get() == (1 if keep else 0)
        assert (gen.stats.resumed_tokens >= len(PROMPT)) == keep
        fixed[keep] = m.fixed_tokens.get()
    assert fixed[False] - fixed[True] >= len(PROMPT)


async def test_every_refusal_names_its_reason_in_a_header(
    serve: Callable[..., Any], target: LoadedModel
) -> None:
    """An edge cannot read the body of a refused upgrade: the reason is a header."""
    v = await serve(max_sessions=1, admission_queue=0)  # no line: refused for its cause
    held = await v.open(hello(target))
    headers = {
        **auth_headers(TOKEN),
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Protocol": SUBPROTOCOL,
    }
    async with v.http.get(v.url.replace("ws://", "http://"), headers=headers) as r:
        assert r.status == 503 and r.headers[REFUSAL_HEADER] == "busy"
    async with v.http.get(v.url.replace("ws://", "http://")) as r:
        assert r.status == 401 and r.headers[REFUSAL_HEADER] == "unauthorized"
    await held.ws.close()
