"""The cloud verifier over real WebSockets (aiohttp_client) with tiny random Llama targets."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import WSCloseCode, WSMsgType, web
from aiohttp.test_utils import TestClient

from cloud_verifier.daemon.app import build_app
from cloud_verifier.daemon.auth import Authenticator
from cloud_verifier.daemon.limits import engine_limits
from cloud_verifier.daemon.settings import VerifierSettings
from cloud_verifier.daemon.state import STATE, VerifierState
from cloud_verifier.engine.engine import Engine
from cloud_verifier.engine.targets import Target, TorchTarget
from cloud_verifier.engine.work import FailureKind
from shared.errors import ErrorCode
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams, transform
from shared.runtime.models import load_model
from shared.wire.codec import decode, encode
from shared.wire.messages import (
    SUBPROTOCOL,
    Candidates,
    Error,
    FederatedReply,
    Hello,
    Message,
    Propose,
    ReplyMode,
    Resample,
    Rollback,
    Verdict,
)
from shared.wire.packing import WireContext
from testkit.net.stream_ws import StreamWS
from testkit.probe import Driver, ProbeClient, auth_headers, replies_match
from testkit.tiny_models import build_tiny_model
from tests.verifiers import ready
from tests.waits import until

TOKEN = "test-token-0123456789"
GREEDY = SamplingParams(temperature=0.0)
AiohttpClient = Callable[..., Awaitable[TestClient[Any, Any]]]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> TorchTarget:
    return TorchTarget(load_model(str(tiny_model_dir)))


@pytest.fixture(scope="module")
def other_vocab_target(tmp_path_factory: pytest.TempPathFactory) -> TorchTarget:
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny80"), vocab_size=80, seed=3)
    return TorchTarget(load_model(str(folder)))


class Service:
    def __init__(self, client: TestClient[Any, Any], engine: Engine) -> None:
        self.client = client
        self.engine = engine
        self.state: VerifierState = client.app[STATE]  # type: ignore[index]

    @property
    def metrics(self) -> Any:
        return self.state.metrics

    async def connect(self, token: str | None = TOKEN) -> aiohttp.ClientWebSocketResponse:
        headers = auth_headers(token) if token is not None else {}
        return StreamWS(
            await self.client.ws_connect("/v1/session", headers=headers, protocols=(SUBPROTOCOL,))
        )

    async def open(self, hello: Hello) -> ProbeClient:
        pc = ProbeClient(await self.connect())
        await pc.hello(hello)
        return pc

    def server_session(self, pc: ProbeClient) -> Any:
        assert pc.welcome is not None
        return self.state.sessions[pc.welcome.session_id]


async def start(
    aiohttp_client: AiohttpClient,
    target: Target,
    loader: Callable[[], Target] | None = None,
    *,
    wait: bool = True,
    **overrides: Any,
) -> Service:
    settings = VerifierSettings(model="tiny", heartbeat=0.0, **overrides)
    engine = Engine(engine_limits(settings))
    app = build_app(
        settings,
        auth=Authenticator([TOKEN]),
        engine=engine,
        loader=loader or (lambda: target),
    )
    svc = Service(await aiohttp_client(app), engine)
    if wait:
        await ready(app)
    return svc


def hello_for(target: Target, **kw: Any) -> Hello:
    kw.setdefault("sampling", GREEDY)
    kw.setdefault("seed", 1)
    return Hello(fingerprint=target.fingerprint, **kw)


def propose(
    epoch: int, seq: int, pos: int, draft: list[int], fixed: list[int] | None = None, **kw: Any
) -> Propose:
    q = kw.pop("q", [1.0] * len(draft))
    return Propose(
        epoch=epoch,
        seq=seq,
        pos=pos,
        draft=np.array(draft, np.int64),
        q=np.array(q, np.float32),
        fixed=np.array(fixed or [], np.int64),
        **kw,
    )


def full_logits(target: TorchTarget, ids: list[int]) -> np.ndarray:
    """Reference: one uncached forward over the whole sequence. [len(ids), V]"""
    with torch.inference_mode():
        out = target.loaded.model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float().numpy()


def greedy_reference(
    target: TorchTarget, committed: list[int], fixed: list[int], draft: list[int]
) -> tuple[int, int]:
    """(accepted, correction or bonus) by direct argmax over committed + fixed + draft."""
    logits = full_logits(target, committed + fixed + draft)
    base = len(committed) + len(fixed)
    for i, x in enumerate(draft):
        best = int(np.argmax(logits[base - 1 + i]))
        if x != best:
            return i, best
    return len(draft), int(np.argmax(logits[-1]))


def greedy_continuation(target: TorchTarget, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(np.argmax(full_logits(target, out)[-1])))
    return out[len(ids) :]


# ----------------------------------------------------------------------------- verification


async def test_greedy_verdicts_equal_direct_argmax(
    aiohttp_client: AiohttpClient, target: TorchTarget
) -> None:
    svc = await start(aiohttp_client, target)
    pc = await svc.open(hello_for(target, bonus=True))
    rng = np.random.default_rng(0)
    committed: list[int] = []
    fixed = [5, 9, 17, 23, 40, 11]
    epoch, pos = 0, 0
    outcomes = set()
    for seq in range(8):
        gamma = int(rng.integers(1, 6))
        draft = greedy_continuation(target, committed + fixed, gamma)
        if rng.random() < 0.6:  # corrupt one position: a rejection there
            j = int(rng.integers(0, gamma))
            draft[j] = (draft[j] + 1 + int(rng.integers(0, 60))) % 64
        n_ref, tok_ref = greedy_reference(target, committed, fixed, draft)
        await pc.send(propose(epoch, seq, pos, draft, fixed))
        v = await pc.recv_as(Verdict)
        assert (v.epoch, v.seq, v.accepted) == (epoch, seq, n_ref)
        if n_ref < gamma:
            assert v.token == tok_ref and v.bonus is None and v.sparse is None
            epoch += 1
        else:
            assert v.bonus == tok_ref and v.token is None
        outcomes.add(n_ref < gamma)
        committed += fixed + draft[:n_ref]
        pos = len(committed)
        fixed = [tok_ref]
        assert svc.server_session(pc).slot.length == len(committed)
    assert outcomes == {True, False}
    m = svc.metrics
    assert m.num_drafts.get() == 8
    assert m.bonus_tokens.get() + m.corrections.get(kind="token") == 8
    # The verifier's busy time: the engine's seconds in steps, followed at each scrape.
    text = await (await svc.client.get("/metrics")).text()
    busy = float(re.search(r"^wanspec_engine_busy_seconds_total (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
    assert 0 < busy <= svc.engine.busy_seconds()


async def test_rejection_crops_and_stale_proposes_cost_nothing(
    aiohttp_client: AiohttpClient, target: TorchTarget
) -> None:
    svc = await start(aiohttp_client, target)
    pc = await svc.open(hello_for(target))
    prompt = [7, 8, 9, 10]
    good = greedy_continuation(target, prompt, 4)
    draft = [good[0], (good[1] + 5) % 64, good[2], good[3]]
    await pc.send(propose(0, 0, 0, draft, prompt))
    v = await pc.recv_as(Verdict)
    assert v.accepted == 1 and v.token == good[1]
    sess = svc.server_session(pc)
    assert sess.slot.length == len(prompt) + 1 == sess.core.next_pos and sess.core.epoch == 1

    # Two batches the edge pipelined before it saw the rejection: dropped, no forward, no reply.
    forwards = svc.engine.forwards
    await pc.send(propose(0, 1, len(prompt) + 4, [3, 4]))
    await pc.send(propose(0, 2, len(prompt) + 6, [5, 6]))
    committed = [*prompt, good[0]]
    nxt = greedy_continuation(target, [*committed, good[1]], 3)
    await pc.send(propose(1, 3, len(committed), nxt, [good[1]]))
    v2 = await pc.recv_as(Verdict)  # the first reply is the new epoch's verdict
    assert (v2.epoch, v2.seq, v2.accepted) == (1, 3, 3)
    assert svc.engine.forwards == forwards + 1
    assert svc.metrics.stale_dropped.get() == 2

    # An explicit rollback (e.g. a new request on the same session), then F = 0 from the cache.
    committed += [good[1], *nxt]
    await pc.send(Rollback(epoch=5, pos=3))
    draft = greedy_continuation(target, committed[:3], 2)
    draft[1] = (draft[1] + 1) % 64
    n_ref, tok_ref = greedy_reference(target, committed[:3], [], draft)
    await pc.send(propose(5, 4, 3, draft))
    v3 = await pc.recv_as(Verdict)
    assert (v3.epoch, v3.accepted, v3.token) == (5, n_ref, tok_ref) and n_ref == 1
    assert sess.slot.length == 4 and sess.core.epoch == 6

    # Bad rollbacks: not a newer epoch; beyond the verified prefix.
    await pc.send(Rollback(epoch=6, pos=1))
    assert (await pc.recv_as(Error)).code == "bad_rollback"
    await pc.send(Rollback(epoch=7, pos=5))
    assert (await pc.recv_as(Error)).code == "bad_rollback"
    assert sess.slot.length == 4


async def _play(driver: Driver, rounds: int) -> list[Message]:
    for _ in range(rounds):
        await driver.round()
    return driver.history


async def test_interleaved_sessions_equal_each_alone(
    aiohttp_client: AiohttpClient, target: TorchTarget
) -> None:
    """Batched forwards answer as lone ones. (With rationing on, two sessions would share a
    priced step that may cut their drafts by load, which a lone session never sees: the law
    stays p, the samples differ; tests/system/test_rationing_e2e.py checks that path.)"""
    svc = await start(aiohttp_client, target, ration=False)
    setups = [
        (hello_for(target, sampling=SamplingParams(0.9), seed=11, k=6), 21, [4, 5, 6]),
        (
            hello_for(
                target, sampling=SamplingParams(1.2, top_k=20), seed=12, m=4,
                correction=CorrectionMode.CANDIDATES,
            ),
            22,
            [30, 31, 32, 33, 34],
        ),
    ]  # fmt: skip

    async def driver(i: int) -> Driver:
        hello, seed, prompt = setups[i]
        d = Driver(await svc.open(hello), 64, 4, np.random.default_rng(seed), q_lo=0.005, q_hi=0.3)
        d.fixed = list(prompt)
        return d

    alone = [await _play(await driver(i), 12) for i in range(2)]
    a, b = await driver(0), await driver(1)
    together = await asyncio.gather(_play(a, 12), _play(b, 12))
    for solo, mixed in zip(alone, together, strict=True):
        assert len(solo) == len(mixed) == 12
        for x, y in zip(solo, mixed, strict=True):
            assert replies_match(x, y), (x, y)
    kinds = {type(m).__name__ for h in alone for m in h}
    assert kinds == {"Verdict"}
    assert any(m.accepted < 4 for m in alone[0])  # type: ignore[attr-defined]
    assert any(m.candidates is not None for m in alone[1])  # type: ignore[attr-defined]


async def test_federated_replies(aiohttp_client: AiohttpClient, target: TorchTarget) -> None:
    svc = await start(aiohttp_client, target)
    sampling = SamplingParams(temperature=0.8)
    pc = await svc.open(hello_for(target, sampling=sampling, reply_mode=ReplyMode.FEDERATED, k=5))
    prompt, draft = [4, 9, 16, 25], [36, 49, 2]
    await pc.send(propose(0, 0, 0, draft, prompt, q=[0.1, 0.2, 0.3]))
    r = await pc.recv_as(FederatedReply)
    p = transform(full_logits(target, prompt + draft)[len(prompt) - 1 :], sampling)  # [γ+1, V]
    assert (r.epoch, r.seq) == (0, 0) and len(r.dists) == len(draft) + 1
    np.testing.assert_allclose(r.p_draft, p[np.arange(3), draft], rtol=1e-5)
    assert r.l1 is not None
    for j, d in enumerate(r.dists):
        assert len(d.ids) == 5
        np.testing.assert_array_equal(d.ids, np.argsort(-p[j], kind="stable")[:5])
        np.testing.assert_allclose(d.probs, p[j, d.ids], rtol=1e-5)
        np.testing.assert_allclose(r.l1[j, 0], 2 * d.eps, atol=1e-5)  # A: exactly 2ε
        assert r.l1[j, 1] <= 2 * d.eps + 1e-5  # B: at most 2ε
    # Every token is kept; the edge rolls back what it rejects, then goes on from the cache.
    assert svc.server_session(pc).core.next_pos == 7
    await pc.send(Rollback(epoch=1, pos=5))
    await pc.send(propose(1, 1, 5, [7, 8]))
    r2 = await pc.recv_as(FederatedReply)
    p2 = transform(full_logits(target, [*prompt, 36, 7, 8])[4:], sampling)
    np.testing.assert_allclose(r2.p_draft, p2[np.arange(2), [7, 8]], rtol=1e-5)
    assert svc.metrics.federated_rounds.get() == 2 and svc.metrics.num_drafts.get() == 0


async def test_resample_candidates(aiohttp_client: AiohttpClient, target: TorchTarget) -> None:
    svc = await start(aiohttp_client, target, max_resamples=2)
    sampling = SamplingParams(temperature=1.0)
    hello = hello_for(target, sampling=sampling, correction=CorrectionMode.CANDIDATES, m=6)
    pc = await svc.open(hello)
    prompt = [4, 5, 6]
    p0 = transform(full_logits(target, prompt)[-1], sampling)
    worst = int(np.argmin(p0))  # q = 1 and p(x) tiny: rejected w.p. 1 − p(x)
    await pc.send(propose(0, 0, 0, [worst], prompt))
    v = await pc.recv_as(Verdict)
    assert v.accepted == 0 and v.candidates is not None and len(v.candidates.ids) == 6
    for _ in range(2):
        await pc.send(Resample(epoch=1, pos=3))
        c = await pc.recv_as(Candidates)
        assert (c.epoch, c.pos, len(c.candidates.ids)) == (1, 3, 6)
        assert worst not in c.candidates.ids.tolist()
        np.testing.assert_allclose(c.candidates.probs, p0[c.candidates.ids], rtol=1e-5)
    await pc.send(Resample(epoch=1, pos=3))
    assert "more than 2 resamples" in (await pc.recv_as(Error)).message
    await pc.send(Resample(epoch=1, pos=2))
    assert (await pc.recv_as(Error)).code == "bad_resample"


# ----------------------------------------------------------------------------- refusals


async def test_auth_refused_before_upgrade(
    aiohttp_client: AiohttpClient, target: TorchTarget
) -> None:
    svc = await start(aiohttp_client, target)
    for token in (None, "wrong-token"):
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await svc.connect(token)
        assert e.value.status == 401
    resp = await svc.client.get("/v1/session", headers={"Authorization": "Basic abc"})
    assert resp.status == 401 and "Bearer" in resp.headers["WWW-Authenticate"]
    with pytest.raises(aiohttp.WSServerHandshakeError) as e:  # right token, no subprotocol
        StreamWS(await svc.client.ws_connect("/v1/session", headers=auth_headers(TOKEN)))
    assert e.value.status == 400
    assert svc.state.sessions == {} and svc.state.connections == 0
    assert svc.metrics.sessions_refused.get(reason=ErrorCode.UNAUTHORIZED) == 3
    assert svc.metrics.sessions.get() == 0 and svc.engine.forwards == 0


async def test_fingerprint_mismatch(
    aiohttp_client: AiohttpClient, target: TorchTarget, other_vocab_target: TorchTarget
) -> None:
    svc = await start(aiohttp_client, target)
    ws = await svc.connect()
    await ws.send_bytes(encode(hello_for(other_vocab_target)))
    pc = ProbeClient(ws)
    err = await pc.recv_as(Error)
    assert err.code == "fingerprint_mismatch" and err.fatal
    assert "vocabulary size differs" in err.message and "80" in err.message
    msg = await ws.receive()
    assert msg.type == WSMsgType.CLOSE and msg.data == WSCloseCode.POLICY_VIOLATION
    assert svc.state.sessions == {}


async def test_max_sessions_and_health_while_loading(
    aiohttp_client: AiohttpClient, target: TorchTarget
) -> None:
    gate = threading.Event()

    def slow_loader() -> Target:
        gate.wait(10)
        return target

    # admission_queue 0: no line, so a session past max_sessions is refused before the upgrade.
    svc = await start(
        aiohttp_client, target, slow_loader, wait=False, max_sessions=1, admission_queue=0
    )
    resp = await svc.client.get("/health")
    assert resp.status == 503 and (await resp.json())["status"] == "loading"
    with pytest.raises(aiohttp.WSServerHandshakeError) as e:
        await svc.connect()
    assert e.value.status == 503
    gate.set()
    await ready(svc.state)
    resp = await svc.client.get("/health")
    assert resp.status == 200 and (await resp.json())["vocab_size"] == 64
    await svc.open(hello_for(target))
    with pytest.raises(aiohttp.WSServerHandshakeError) as e:
        await svc.connect()
    assert e.value.status == 503
    assert svc.metrics.sessions_refused.get(reason="busy") == 1
    text = await (await svc.client.get("/metrics")).text()
    assert "wanspec_sessions_active 1\n" in text
    assert 'wanspec_sessions_refused_total{reason="loading"} 1' in text


#: A KV pool of 2 pages of 8 tokens that one session may hold whole (the shares are tested
#: on their own).
TWO_PAGES: dict[str, Any] = {
    "kv_cache_tokens": 16,
    "kv_page_size": 8,
    "kv_session_share": 1.0,
    "kv_token_share": 1.0,
}


async def test_kv_cache_full_answers_503_and_is_in_metrics(
    aiohttp_client: AiohttpClient, target: TorchTarget
) -> None:
    """The KV pool (2 pages of 8 tokens) is the bound: a session's context is capped at the
    pool (context_full), a session that finds no free page gets a model error (its cache
    untouched), and while no page is free new sessions get 503 before the upgrade (no
    admission line here: admission_queue 0); /metrics and /health show the pool."""
    svc = await start(aiohttp_client, target, **TWO_PAGES, admission_queue=0)
    pc, other = await svc.open(hello_for(target)), await svc.open(hello_for(target))
    await pc.send(propose(0, 0, 0, [8, 9], list(range(4, 24))))  # 22 tokens > 16
    assert (await pc.recv_as(Error)).code == "context_full"
    await pc.send(propose(0, 1, 0, [8], list(range(4, 14))))  # 11 tokens: both pages
    assert isinstance(await pc.recv(), Verdict)
    await other.send(propose(0, 0, 0, [8], [4, 5]))
    err = await other.recv_as(Error)
    assert err.code == "model_error" and not err.fatal
    assert svc.metrics.model_errors.get(kind=FailureKind.OUT_OF_PAGES) == 1
    assert svc.server_session(other).slot.length == 0
    assert svc.engine.pages_free == 0
    with pytest.raises(aiohttp.WSServerHandshakeError) as e:
        await svc.connect()
    assert e.value.status == 503
    assert svc.metrics.sessions_refused.get(reason="kv_full") == 1
    text = await (await svc.client.get("/metrics")).text()
    per_token = target.kv_bytes_per_token()
    assert f"wanspec_kv_cache_bytes_total {16 * per_token}\n" in text
    assert f"wanspec_kv_cache_bytes_used {16 * per_token}\n" in text
    assert "wanspec_kv_cache_pages_used 2\n" in text
    health = await (await svc.client.get("/health")).json()
    assert health["kv_cache"] == {"pages_used": 2, "pages_total": 2}
    await pc.send(Rollback(epoch=3, pos=0))  # a rollback frees the pages: sessions come in
    await until(lambda: svc.engine.pages_free == 2, 5.0, "the rollback's pages freed")
    await svc.open(hello_for(target))


async def test_a_session_waits_in_line_while_the_kv_pool_is_full(
    aiohttp_client: AiohttpClient, target: TorchTarget
) -> None:
    """Busy is not dead: while no page is free a new session is upgraded and waits in the
    admission line, told its place by Progress frames, and starts (a Welcome) once a rollback
    frees the pages; nothing is refused."""
    svc = await start(aiohttp_client, target, **TWO_PAGES, progress_interval=0.05)
    pc = await svc.open(hello_for(target))
    await pc.send(propose(0, 0, 0, [8], list(range(4, 14))))  # 11 tokens: both pages
    assert isinstance(await pc.recv(), Verdict)
    assert svc.engine.pages_free == 0
    waiting = ProbeClient(await svc.connect())
    hello = asyncio.ensure_future(waiting.hello(hello_for(target, progress=True), timeout=5.0))
    try:
        await until(lambda: len(svc.state.line) == 1, 5.0, "the session in line")
        await until(lambda: bool(waiting.queued), 5.0, "a Progress frame with its place")
        assert not hello.done()
        # A rollback to the start (an epoch past the verdict's) frees the pages: it starts.
        await pc.send(Rollback(epoch=3, pos=0))
        welcome = await asyncio.wait_for(hello, 10.0)
    finally:
        hello.cancel()
    assert welcome.session_id and len(svc.state.line) == 0
    assert svc.metrics.sessions_queued.get() == 1
    assert svc.metrics.sessions_refused.get(reason="kv_full") == 0


async def test_a_flood_while_its_work_runs_closes_only_that_session(
    aiohttp_client: AiohttpClient, target: TorchTarget
) -> None:
    """Frames that arrive while a session's forward runs are read ahead (at most READ_AHEAD) and
    handled after it, in order: its verdict first, then each garbage frame is a bad frame until
    max_bad_frames closes the session. The engine, its slot and another session are unharmed."""
    from bench.net.verifier import PaddedTarget

    svc = await start(aiohttp_client, target, lambda: PaddedTarget(target, 300.0), max_bad_frames=8)
    other = Driver(await svc.open(hello_for(target)), 64, 3, np.random.default_rng(0))
    other.fixed = [4, 5, 6]
    pc = await svc.open(hello_for(target))
    await pc.send(propose(0, 0, 0, [8, 9], [4, 5]))
    for _ in range(40):  # while its forward (300 ms) runs
        await pc.ws.send_bytes(b"\xc1 not msgpack")
    assert isinstance(await pc.recv(), Verdict)
    codes = []
    while True:
        msg = await pc.ws.receive(timeout=10)
        if msg.type != WSMsgType.BINARY:
            break
        codes.append(decode(msg.data, WireContext(vocab_size=64)).code)  # type: ignore[union-attr]
    assert codes == ["bad_frame"] * 7 + ["too_many_bad_frames"], codes
    assert msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING)
    assert isinstance(await other.round(), Verdict)  # the engine serves the other session
    await until(lambda: len(svc.state.sessions) <= 1, 10.0, "the flooding session closed")
    assert len(svc.state.sessions) == 1
    assert svc.engine.slots_used == 1 and svc.engine.worker_alive()


async def test_bad_frames_stay_in_their_session(
    aiohttp_client: AiohttpClient, target: TorchTarget
) -> None:
    svc = await start(aiohttp_client, target, max_frame=8192, max_bad_frames=12, max_context=64)
    healthy = Driver(
        await svc.open(hello_for(target)), 64, 3, np.random.default_rng(0), q_lo=0.5, q_hi=1
    )
    healthy.fixed = [4, 5, 6, 7]
    ctx = WireContext(vocab_size=64, coarse_q=True)  # a greedy session's: q in four bits

    async def healthy_round() -> None:
        assert isinstance(await healthy.round(), Verdict)  # raises on an Error

    pc = await svc.open(hello_for(target))
    ws = pc.ws

    async def expect(code: str, fragment: str = "") -> None:
        err = await pc.recv_as(Error)
        assert err.code == code and not err.fatal and fragment in err.message, err
        await healthy_round()

    await ws.send_bytes(b"\xc1\x00garbage")
    await expect("bad_frame", "frame")
    await ws.send_str("hello")
    await expect("bad_frame", "msgpack")  # (text on a stream: bytes that are not a frame)
    await ws.send_bytes(encode(propose(0, 0, 0, [70], [4]), ctx))
    await expect("bad_frame", "draft.ids")
    await ws.send_bytes(encode(hello_for(target)))
    await expect("bad_frame", "Hello")
    await pc.send(propose(0, 5, 0, [8], [4]))
    await expect("bad_seq", "expected 0")
    await pc.send(propose(0, 0, 0, [8]))
    await expect("bad_pos", "fixed")
    await pc.send(propose(3, 1, 0, [8], [4]))
    await expect("bad_epoch", "ahead")
    await pc.send(propose(0, 2, 9, [8], [4]))
    await expect("bad_pos", "expected 0")
    await pc.send(propose(0, 3, 0, [8] * 4, [4] * 61))
    err = await pc.recv_as(Error)
    assert err.code == "context_full" and not err.fatal
    # After all that, the session still verifies (seq 4 is next).
    await pc.send(propose(0, 4, 0, [8], [4]))
    assert isinstance(await pc.recv(), Verdict)
    assert svc.metrics.bad_frames.get() == 8

    # Refused before Hello: a hot frame first closes that connection only.
    ws2 = await svc.connect()
    await ws2.send_bytes(encode(propose(0, 0, 0, [8], [4]), ctx))
    err = await ProbeClient(ws2).recv_as(Error)
    assert err.code == "bad_handshake" and err.fatal
    assert (await ws2.receive()).data == WSCloseCode.POLICY_VIOLATION
    await healthy_round()

    # An oversized frame: aiohttp closes that session with MESSAGE_TOO_BIG.
    await ws.send_bytes(b"\x00" * 9000)
    msg = await ws.receive()
    assert msg.type == WSMsgType.CLOSE and msg.data == WSCloseCode.MESSAGE_TOO_BIG
    await healthy_round()

    # Too many bad frames: closed with a reason.
    pc3 = await svc.open(hello_for(target))
    for _ in range(11):
        await pc3.ws.send_bytes(b"\x01")
        assert (await pc3.recv_as(Error)).code == "bad_frame"
    await pc3.ws.send_bytes(b"\x01")
    err = await pc3.recv_as(Error)
    assert err.code == "too_many_bad_frames" and err.fatal
    close = await pc3.ws.receive()
    assert close.data == WSCloseCode.POLICY_VIOLATION and "too_many_bad_frames" in close.extra
    await healthy_round()
    assert len(svc.state.sessions) == 1


async def test_model_error_is_reported_to_that_session_only(
    aiohttp_client: AiohttpClient, target: TorchTarget
) -> None:
    svc = await start(aiohttp_client, target)
    pc = await svc.open(hello_for(target))
    sess = svc.server_session(pc)
    runner = svc.engine.require_runner()
    real = runner._decide

    def broken(planned: list[Any], probs: Any) -> Any:
        # the forward ran, then deciding fails for this session: its cache must be restored
        if any(p.slot is sess.slot for p in planned):
            raise RuntimeError("boom")
        return real(planned, probs)

    runner._decide = broken  # type: ignore[method-assign]
    await pc.send(propose(0, 0, 0, [8, 9], [4, 5]))
    err = await pc.recv_as(Error)
    assert err.code == "model_error" and not err.fatal and "boom" in err.message
    assert sess.slot.length == 0
    runner._decide = real  # type: ignore[method-assign]
    await pc.send(propose(0, 1, 0, [8, 9], [4, 5]))
    assert isinstance(await pc.recv(), Verdict)


async def test_shutdown_closes_sessions_going_away(
    aiohttp_client: AiohttpClient, target: TorchTarget
) -> None:
    settings = VerifierSettings(model="tiny", heartbeat=0.0)
    app = build_app(settings, auth=Authenticator([TOKEN]), loader=lambda: target)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    state = await ready(app)
    async with aiohttp.ClientSession() as http:
        ws = StreamWS(
            await http.ws_connect(
                f"http://127.0.0.1:{port}/v1/session",
                headers=auth_headers(TOKEN),
                protocols=(SUBPROTOCOL,),
            )
        )
        await ProbeClient(ws).hello(hello_for(target))
        cleanup = asyncio.create_task(runner.cleanup())
        msg = await ws.receive(timeout=5)
        assert msg.type == WSMsgType.CLOSE and msg.data == WSCloseCode.GOING_AWAY
        await ws.close()
        await asyncio.wait_for(cleanup, 10)
    assert state.sessions == {} and state.status == "stopping"
