"""The verifier's service tells the truth about its engine and its sessions (issue 38, items 1,
3, 6 and the dead engine):

* the systemd watchdog is fed from the engine's own health (its beat), never from a call that
  queues behind its work: a long step is progress, a step stalled past the bound is not, a dead
  engine never is;
* a dead engine is seen: /health 503 with its error, open sessions fail with a fatal Error,
  new connections are refused 503 (no Retry-After: down, not busy);
* a resuming edge is never refused as busy or overloaded; sessions kept for resumption count
  against the per-token session cap; a session lost before its prefill ran keeps nothing, and
  its queued model work is dropped with its connection.

Every verifier here is the null target (no model), some with a forward the test holds or
breaks; waits are bounded (tests.waits)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import WSCloseCode, WSMsgType

from cloud_verifier.daemon.app import build_app, make_runner
from cloud_verifier.daemon.auth import Authenticator
from cloud_verifier.daemon.lifecycle import Watchdog, WatchdogVerdict
from cloud_verifier.daemon.routes import REFUSAL_HEADER
from cloud_verifier.daemon.settings import VerifierSettings
from cloud_verifier.daemon.state import STATE, VerifierState
from cloud_verifier.engine.engine import EngineHealth
from cloud_verifier.engine.targets import NullTarget, Target
from shared.errors import ErrorCode
from shared.maths.sampling import SamplingParams
from shared.runtime.batched_lm import Row
from shared.service.http_guard import Listener
from shared.service.sdnotify import Notifier
from shared.wire.codec import decode, encode
from shared.wire.messages import (
    SUBPROTOCOL,
    Error,
    Fingerprint,
    Hello,
    Propose,
    Resume,
    Verdict,
    Welcome,
)
from shared.wire.mux import frame, split
from testkit.net.stream_ws import StreamWS
from testkit.probe import ProbeClient, auth_headers
from tests.verifiers import ready
from tests.waits import until

TOKEN = "truth-token"
OTHER = "other-token"
FP = Fingerprint("null", 64, "null")
GREEDY = SamplingParams(0.0)
PROMPT = list(range(1, 21))  # 20 tokens: two pages of 16


def propose(fixed: Sequence[int], pos: int = 0, draft: Sequence[int] = (5,)) -> Propose:
    """The first Propose of a session (seq 0) at ``pos``."""
    return Propose(
        0,
        0,
        pos,
        np.array(draft, np.int64),
        np.ones(len(draft), np.float32),
        fixed=np.array(fixed, np.int64),
    )


class EngineKilled(BaseException):
    """Not an Exception: escapes the engine's step handling and ends its thread."""


class HeldTarget(NullTarget):
    """The null target; once ``armed``, each forward records its rows (start, tokens), then
    either waits for ``gate`` (held) or raises :class:`EngineKilled` (``kill``)."""

    def __init__(self) -> None:
        super().__init__(64)
        self.armed = False
        self.kill = False
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.rows: list[tuple[int, int]] = []

    def forward(self, rows: Sequence[Row]) -> Any:
        if self.armed:
            self.rows += [(r.start, len(r.ids)) for r in rows]
            self.entered.set()
            if self.kill:
                raise EngineKilled("the test killed the engine's thread")
            self.gate.wait(30)
        return super().forward(rows)


class NotifySocket:
    """A fake ``$NOTIFY_SOCKET`` (abstract namespace): every datagram, with when it came."""

    def __init__(self) -> None:
        self.name = f"@wanspec-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name[1:])
        self.sock.setblocking(False)
        self.got: list[tuple[float, str]] = []
        self._task: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await loop.sock_recv(self.sock, 4096)
            self.got.append((time.monotonic(), data.decode()))

    def start(self) -> None:
        self._task = asyncio.create_task(self._read())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.sock.close()

    def pings(self, since: float = 0.0, until_t: float = float("inf")) -> list[float]:
        return [t for t, m in self.got if "WATCHDOG=1" in m and since <= t < until_t]


@asynccontextmanager
async def serving(
    target: Target, *, notifier: Notifier | None = None, **settings: Any
) -> AsyncIterator[tuple[VerifierState, str]]:
    """The verifier as ``serve`` runs it (runner, guarded listener) on ``target``; once ready,
    its state and http:// base URL."""
    settings.setdefault("heartbeat", 0.0)
    app = build_app(
        VerifierSettings(model="null:64", **settings),
        auth=Authenticator([TOKEN, OTHER]),
        loader=lambda: target,
        notifier=notifier,
    )
    state = app[STATE]
    listener = Listener(state.guard, "127.0.0.1", 0)
    await listener.bind()
    runner = make_runner(app)
    await runner.setup()
    try:
        await listener.start(runner)
        await ready(app)
        host, port = listener.addresses[0]
        yield state, f"http://{host}:{port}"
    finally:
        target_gate = getattr(target, "gate", None)
        if target_gate is not None:
            target_gate.set()  # a held forward must not hold the shutdown up
        listener.close()
        await runner.cleanup()
        await listener.wait_closed()


async def connect(http: aiohttp.ClientSession, url: str, token: str = TOKEN) -> StreamWS:
    return StreamWS(
        await http.ws_connect(
            url + "/v1/session", headers=auth_headers(token), protocols=(SUBPROTOCOL,)
        )
    )


async def session(
    http: aiohttp.ClientSession, url: str, hello: Hello | None = None, token: str = TOKEN
) -> ProbeClient:
    pc = ProbeClient(await connect(http, url, token))
    await pc.hello(hello or Hello(FP, GREEDY))
    return pc


async def refusal(http: aiohttp.ClientSession, url: str, token: str = TOKEN) -> Any:
    """The WSServerHandshakeError of a refused connection (fails if it is accepted)."""
    with pytest.raises(aiohttp.WSServerHandshakeError) as e:
        ws = await connect(http, url, token)
        await ws.ws.close()
    return e.value


def key(state: VerifierState, token: str = TOKEN) -> str:
    """The token's key, as the verifier counts its sessions."""
    k = state.auth.identify(f"Bearer {token}")
    assert k is not None
    return k


def kept_of(state: VerifierState, token: str = TOKEN) -> int:
    return sum(1 for p in state.parked.values() if p.tenant == key(state, token))


async def fatal_error(pc: ProbeClient) -> tuple[Error | None, Any]:
    """The session's frames until its stream ends: the last fatal Error, and how it ended."""
    err: Error | None = None
    while True:
        msg = await pc.ws.receive(timeout=5)
        if msg.type != WSMsgType.BINARY:
            return err, msg
        frame = decode(msg.data, pc.ctx)
        if isinstance(frame, Error) and frame.fatal:
            err = frame


def lose(pc: ProbeClient) -> None:
    """Cut the connection without a close frame (a network blip)."""
    conn = pc.ws.ws._response.connection
    assert conn is not None and conn.transport is not None
    conn.transport.abort()


async def kept_session(
    http: aiohttp.ClientSession, url: str, state: VerifierState, token: str = TOKEN
) -> str:
    """A resumable session of ``token`` that ran its prompt, then lost its connection: its
    resume token, once it is kept."""
    pc = await session(http, url, Hello(FP, GREEDY, resumable=True), token)
    resume = pc.welcome.resume if pc.welcome is not None else None
    assert resume
    await pc.send(propose(PROMPT))
    assert isinstance(await pc.recv(), Verdict)
    lose(pc)
    await until(lambda: resume in state.parked, 5.0, "the lost session kept")
    return resume


# ------------------------------------------------------------------------------ 1. the watchdog


def _health(alive: bool = True, stalled: bool = False) -> EngineHealth:
    return EngineHealth(alive, stalled, None if alive else "it died", 0.0)


def test_the_watchdog_rule() -> None:
    """Fed while alive; fed while stalled for up to the bound, then not; fed again once the
    step finishes (the bound restarts); never fed once dead."""
    dog = Watchdog(stall_bound_s=30.0)
    assert dog.judge(_health(), 0.0) == WatchdogVerdict.FEED
    assert dog.judge(_health(stalled=True), 10.0) == WatchdogVerdict.STALLED
    assert dog.judge(_health(stalled=True), 40.0) == WatchdogVerdict.STALLED
    assert dog.judge(_health(stalled=True), 40.5) == WatchdogVerdict.STALLED_TOO_LONG
    assert dog.judge(_health(), 41.0) == WatchdogVerdict.FEED and dog.stalled_since is None
    assert dog.judge(_health(stalled=True), 50.0) == WatchdogVerdict.STALLED
    assert dog.judge(_health(alive=False), 51.0) == WatchdogVerdict.DEAD


async def test_the_watchdog_is_fed_through_a_long_step_and_starved_past_its_stall_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 38, item 1: the watchdog pinged the engine with a call, which queued behind the
    running work (no WATCHDOG=1 for 120 s during one 8,000-token prompt). Now it reads the
    engine's health: through a step the test holds, WATCHDOG=1 keeps coming every interval
    (0.1 s here) until the step has stalled (stall_timeout 1 s: it has run 8 times its estimate
    and 1 s) for the bound (stall_timeout more); then none, with an ERROR line; once the step
    ends, WATCHDOG=1 again."""
    caplog.set_level(logging.INFO, logger="cloud_verifier")
    target = HeldTarget()
    notify = NotifySocket()
    notify.start()
    notifier = Notifier(notify.name, watchdog_usec=300_000)  # WATCHDOG=1 every 0.1 s
    try:
        async with (
            serving(target, notifier=notifier, stall_timeout=1.0) as (state, url),
            aiohttp.ClientSession() as http,
        ):
            pc = await session(http, url)
            target.armed = True
            t0 = time.monotonic()
            await pc.send(propose(PROMPT))
            await until(target.entered.is_set, 5.0, "the step started")
            await until(lambda: state.engine.health().stalled, 5.0, "the step stalled")
            stalled_at = time.monotonic()
            # Fed all along up to the stall, and for the bound (1 s) after it.
            await until(
                lambda: any("no more WATCHDOG=1" in r.getMessage() for r in caplog.records),
                5.0,
                "the watchdog gave up",
            )
            starved_at = time.monotonic()
            assert 0.9 <= starved_at - stalled_at <= 2.0, starved_at - stalled_at
            fed = notify.pings(t0, starved_at - 0.3)
            gaps = np.diff([t0, *fed, starved_at - 0.3])
            assert len(fed) >= 8 and gaps.max() < 0.5, gaps
            await asyncio.sleep(0.5)  # five intervals: no WATCHDOG=1
            assert not notify.pings(starved_at + 0.15, time.monotonic())
            target.armed = False
            target.gate.set()  # the step ends: progress again
            assert isinstance(await pc.recv(), Verdict)
            resumed = time.monotonic()
            await until(lambda: bool(notify.pings(resumed)), 2.0, "WATCHDOG=1 again")
            await pc.ws.close()
    finally:
        await notify.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("stalled for over 1 s" in m for m in errors), errors
    assert not any("did not answer" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------ 2. a dead engine


async def test_a_dead_engine_is_seen_by_health_sessions_new_connections_and_the_watchdog(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The engine's thread dies (a forward raises what no step handler catches): within a
    bound, /health answers 503 naming the error, the session whose work killed it and an
    idle session each get a fatal Error (internal) and their connection closes (1011), a new
    connection is refused 503 ``failed`` without Retry-After (down, not busy: the edge counts
    it as down), and the watchdog stops, with ERROR lines."""
    caplog.set_level(logging.INFO, logger="cloud_verifier")
    target = HeldTarget()
    notify = NotifySocket()
    notify.start()
    notifier = Notifier(notify.name, watchdog_usec=300_000)
    try:
        async with (
            serving(target, notifier=notifier) as (state, url),
            aiohttp.ClientSession() as http,
        ):
            idle = await session(http, url)
            busy = await session(http, url)
            async with http.get(url + "/health") as r:
                body = await r.json()
                assert r.status == 200 and body["engine"]["alive"] is True, body
            await until(lambda: bool(notify.pings()), 2.0, "WATCHDOG=1")
            target.armed = target.kill = True
            t0 = time.monotonic()
            await busy.send(propose(PROMPT))
            for pc in (busy, idle):
                err, msg = await fatal_error(pc)
                assert err is not None and err.code == "internal", err
                assert "EngineKilled" in err.message and "restarted" in err.message, err
                # The stream's End, then the connection's close, both 1011.
                assert msg.type == WSMsgType.CLOSE and msg.data == 1011, msg
                while (msg := await pc.ws.ws.receive(timeout=5)).type == WSMsgType.BINARY:
                    pass
                assert msg.type == WSMsgType.CLOSE and msg.data == WSCloseCode.INTERNAL_ERROR
            failed_in = time.monotonic() - t0
            assert failed_in < 3.0, failed_in
            async with http.get(url + "/health") as r:
                body = await r.json()
            assert r.status == 503 and body["status"] == "failed", body
            assert "EngineKilled" in body["reason"] and body["engine"]["alive"] is False
            e = await refusal(http, url)
            assert e.status == 503 and e.headers[REFUSAL_HEADER] == ErrorCode.INTERNAL
            assert "Retry-After" not in e.headers
            dead_at = time.monotonic()
            await asyncio.sleep(0.4)
            assert not notify.pings(dead_at)
            assert state.metrics.sessions_refused.get(reason=ErrorCode.INTERNAL) == 1
    finally:
        await notify.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("open session(s) are closed" in m and "EngineKilled" in m for m in errors)
    assert any(m.startswith("watchdog:") and "no more WATCHDOG=1" in m for m in errors), errors


# ------------------------------------------------------------------ 3. a resuming edge is admitted


async def test_a_resuming_edge_is_not_refused_as_overloaded_or_busy() -> None:
    """Issue 38, item 3: a resuming edge holds its slot and pages already. While admission
    refuses new sessions (no admission line, so a session that must wait is refused for its
    cause: overloaded, the queue delay reads 42 s; busy, every connection of max_sessions is
    taken), the edge of a kept session
    reconnects and resumes it; a new session is still refused, and so is another token
    presenting the resume token."""
    async with (
        serving(HeldTarget(), max_sessions=2, max_queue_delay=5.0, admission_queue=0) as (
            state,
            url,
        ),
        aiohttp.ClientSession() as http,
    ):
        token = await kept_session(http, url, state)
        live = await session(http, url)  # one live session, one warm idle connection:
        warm = await connect(http, url)  # every connection of max_sessions is taken
        await warm.wait_ready(5)
        e = await refusal(http, url, OTHER)
        assert e.status == 503 and e.headers[REFUSAL_HEADER] == "busy"
        state.engine.queue_delay_s = lambda: 42.0  # type: ignore[method-assign]
        resume = Hello(FP, GREEDY, resume=Resume(token, len(PROMPT)), resumable=True)
        back = await session(http, url, resume)
        assert back.welcome is not None and back.welcome.resumed is not None
        assert back.welcome.resumed.length == len(PROMPT)
        assert state.metrics.sessions_resumed.get() == 1 and not state.parked
        e = await refusal(http, url)  # a new session: refused, the verifier is full
        assert e.status == 503 and e.headers[REFUSAL_HEADER] == "busy"
        await warm.ws.close()
        await live.ws.close()
        await until(lambda: state.connections == 1)
        e = await refusal(http, url)  # with room for a connection: overloaded
        assert e.status == 503 and e.headers[REFUSAL_HEADER] == "overloaded"
        await back.send(propose([], len(PROMPT), [7]))  # it goes on where it was
        assert isinstance(await back.recv(), Verdict)
        await back.ws.close()


async def test_a_resume_stream_on_an_open_connection_skips_the_busy_rules() -> None:
    """The same at the stream level: on one kept-open connection (the edge's warm link), while
    the queue delay reads 42 s behind a served session and there is no admission line, a new
    stream is refused with an ``overloaded`` Error carrying Retry-After, and a stream whose
    Hello resumes a kept session of this token is admitted."""
    async with (
        serving(HeldTarget(), max_queue_delay=5.0, admission_queue=0) as (state, url),
        aiohttp.ClientSession() as http,
    ):
        token = await kept_session(http, url, state)
        live = await session(http, url)  # served: a deep queue now makes a new session wait
        ws = await connect(http, url)  # the edge's warm link, open before the queue grew
        await ws.wait_ready(5)
        state.engine.queue_delay_s = lambda: 42.0  # type: ignore[method-assign]
        await ws.send_bytes(encode(Hello(FP, GREEDY)))  # stream 1: a new session
        err = await ProbeClient(ws).recv_as(Error)
        assert err.code == "overloaded" and err.fatal, err
        assert err.retry_after is not None and 1 <= err.retry_after <= 60, err
        resume = Hello(FP, GREEDY, resume=Resume(token, len(PROMPT)), resumable=True)
        await ws.ws.send_bytes(frame(2, encode(resume)))  # stream 2: the resume
        while True:
            msg = await ws.ws.receive(timeout=5)
            assert msg.type == WSMsgType.BINARY, msg
            stream, payload = split(msg.data)
            if stream == 2:
                break
        welcome = decode(payload)
        assert isinstance(welcome, Welcome) and welcome.resumed is not None, welcome
        assert state.metrics.sessions_resumed.get() == 1 and not state.parked
        await ws.ws.close()
        await live.ws.close()


# ------------------------------------------------------------- 6. kept sessions and the caps


async def test_kept_sessions_count_against_the_per_token_cap() -> None:
    """Issue 38, item 6: one token that opens a session, loses its connection, and does it
    again (at most one live connection) kept 42-46 sessions for resumption against a cap of
    32. Kept sessions count with live ones against max_sessions_per_token: a new session of
    the token drops the token's oldest kept one (reason ``token``), never another token's, so
    live + kept never passes the cap; a token whose live sessions fill the cap is refused."""
    async with (
        serving(HeldTarget(), max_sessions_per_token=3, kv_cache_tokens=4096) as (state, url),
        aiohttp.ClientSession() as http,
    ):
        other = await kept_session(http, url, state, OTHER)  # another token's, kept all along
        for _ in range(8):
            await kept_session(http, url, state)
            assert kept_of(state) + state.token_streams.get(key(state), 0) <= 3
        assert kept_of(state) == 3 and other in state.parked
        assert state.metrics.parked_dropped.get(reason="token") == 5
        # Three live sessions of the token: its kept ones made room; a fourth is refused.
        lives = [await session(http, url) for _ in range(3)]
        assert kept_of(state) == 0 and state.token_streams[key(state)] == 3
        e = await refusal(http, url)
        assert e.status == 429 and e.headers[REFUSAL_HEADER] == "token_limit"
        assert other in state.parked and kept_of(state, OTHER) == 1
        for pc in lives:
            await pc.ws.close()


async def test_a_session_lost_before_its_prefill_keeps_nothing_and_its_work_is_dropped() -> None:
    """Issue 38, items 3 and 6: a session was kept (at 0 pages) before its prefill ran, and the
    prefill still ran for the dead connection. Here the engine is held in another session's
    step while a resumable session's 40-token prompt waits; its connection is cut: the task
    awaiting its model work is cancelled at once, nothing is kept (no page was cached), and
    once the engine is released its prompt is never forwarded."""
    target = HeldTarget()
    async with serving(target) as (state, url), aiohttp.ClientSession() as http:
        cancelled: list[object] = []
        queued: list[object] = []
        run = state.engine.run

        async def watched(slot: Any, work: Any) -> Any:
            queued.append(slot)
            try:
                return await run(slot, work)
            except asyncio.CancelledError:
                cancelled.append(slot)
                raise

        state.engine.run = watched  # type: ignore[method-assign]
        holder = await session(http, url)
        victim = await session(http, url, Hello(FP, GREEDY, resumable=True))
        target.armed = True
        await holder.send(propose([1, 2, 3]))
        await until(target.entered.is_set, 5.0, "the holder's step started")
        long_prompt = list(range(1, 41))
        await victim.send(propose(long_prompt))
        victim_slot = next(
            live.slot for live in state.sessions.values() if live.core.hello.resumable
        )
        await until(lambda: victim_slot in queued, 5.0, "the victim's prompt queued")
        t0 = time.monotonic()
        lose(victim)
        await until(lambda: victim_slot in cancelled, 3.0, "the victim's model work cancelled")
        assert time.monotonic() - t0 < 3.0
        await until(lambda: len(state.sessions) == 1, 3.0, "the victim's session over")
        assert not state.parked  # nothing cached: nothing kept
        target.gate.set()
        assert isinstance(await holder.recv(), Verdict)
        await until(lambda: state.engine.health().beat_age_s == 0.0, 5.0, "the engine idle")
        await asyncio.sleep(0.2)
        assert all(n < len(long_prompt) for _, n in target.rows), target.rows
        assert state.metrics.parked_dropped.get(reason="budget") == 0
        await holder.ws.close()
