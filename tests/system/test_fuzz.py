"""Bad input never harms others: hostile frames at the verifier and at the edge's link, malformed
HTTP. Hypothesis drives the mutators of ``testkit.fuzz`` over every message type; the committed
corpus (``tests/system/fuzz_corpus/``) is replayed against a live verifier session and a live edge
pipeline; and a reduced ``python -m testkit.fuzz`` run throws hundreds of frames at a real verifier
process and a real edge agent while an honest session checks its verdicts."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import WSMsgType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud_verifier.daemon.state import STATE
from cloud_verifier.engine.targets import TorchTarget
from cloud_verifier.session.limits import SessionLimits
from edge_agent.session.core import SingleCore
from edge_agent.session.generation import Generation
from edge_agent.session.opening import DesyncError, VerifierError, hello_for
from edge_agent.session.pipeline_config import PipelineConfig
from shared.maths.compression import SparseDist
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams
from shared.runtime.models import load_model
from shared.wire.codec import decode, encode
from shared.wire.messages import (
    SUBPROTOCOL,
    Candidates,
    Error,
    FederatedReply,
    Fingerprint,
    Hello,
    Message,
    Propose,
    Resample,
    Rollback,
    Verdict,
    Welcome,
)
from shared.wire.packing import ProtocolError, WireContext
from testkit.fuzz import FuzzConfig, Shadow, corpus_frames, mutate_bytes, mutate_map, run
from testkit.net.stream_ws import StreamWS
from testkit.probe import Driver, ProbeClient, auth_headers
from tests.edge_events import sent
from tests.verifiers import ready, verifier_app

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
V = 64
CTX = WireContext(vocab_size=V, max_gamma=16, max_fixed=64, max_k=32, max_frame=4096)
SD = SparseDist(np.array([5, 9], np.int64), np.array([0.5, 0.25], np.float32))
VALID: list[Message] = [
    Hello(Fingerprint("t", V, "m"), SamplingParams(0.7, top_k=5), k=8, seed=3),
    Welcome(Fingerprint("t", V, "m"), "abc", 8, 64, 512, 4096),
    Propose(2, 5, 40, np.array([5, 6, 7]), np.array([0.5, 0.25, 1.0], np.float32), np.array([9])),
    Verdict(2, 5, 1, sparse=SD),
    Verdict(2, 5, 1, candidates=SD),
    Verdict(2, 5, 1, token=7),
    Verdict(2, 5, 3, bonus=8),
    FederatedReply(2, 5, (SD, SD), np.array([0.5], np.float32), np.zeros((2, 2), np.float32)),
    Rollback(3, 10),
    Resample(3, 10),
    Candidates(3, 10, SD),
    Error("bad_seq", "m", False),
]


def check_decoded(msg: Message, ctx: WireContext) -> None:
    """What the decoder promises about anything it accepts (the verifier relies on it)."""
    ids: list[np.ndarray] = []
    probs: list[np.ndarray] = []
    if isinstance(msg, Propose):
        ids += [msg.draft, msg.fixed]
        probs.append(msg.q)
        assert 1 <= len(msg.draft) <= ctx.max_gamma and len(msg.fixed) <= ctx.max_fixed
        assert 0 <= msg.seq < 128
    for d in [getattr(msg, n, None) for n in ("sparse", "candidates")]:
        if isinstance(d, SparseDist):
            ids.append(d.ids)
            probs.append(d.probs)
    for a in ids:
        assert a.size == 0 or (a.min() >= 0 and a.max() < ctx.vocab_size)
    for p in probs:
        assert np.all(np.isfinite(p)) and np.all(p > 0) and np.all(p <= 1)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(VALID), st.randoms(use_true_random=False), st.booleans())
def test_mutated_frames_decode_or_raise_protocol_error(
    msg: Message, r: random.Random, structured: bool
) -> None:
    frame = encode(msg, CTX)
    _, bad = mutate_map(frame, r, V) if structured else mutate_bytes(frame, r)
    for ctx in (CTX, None):
        try:
            out = decode(bad, ctx)
        except ProtocolError:
            continue
        check_decoded(out, CTX)


@settings(max_examples=200, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(0, 3), st.integers(0, 127))
def test_shadow_never_expects_progress_from_a_bad_frame(
    r: random.Random, epoch: int, seq: int
) -> None:
    """The fuzzer's oracle: a frame it predicts to be refused leaves the session where it was
    (epoch, position); only the expected seq moves past a decoded Propose, as the verifier's
    rules say (every Propose consumes its seq, refused or not)."""
    limits = SessionLimits(16, 64, 512, 4096, max_k=32, max_bad_frames=10**6, max_resamples=4)
    sh = Shadow(limits, V)
    assert sh.ctx == CTX  # the frames below are encoded for it
    sh.start_at(epoch, seq, 7)
    p = Propose(epoch, seq, 7, np.array([5, 6]), np.array([0.5, 0.5], np.float32))
    frame = encode(p, CTX)
    kind, bad = mutate_map(frame, r, V) if r.random() < 0.5 else mutate_bytes(frame, r)
    predicted = sh.predict(bad)
    if predicted.startswith("error:"):
        assert (sh.epoch, sh.pos) == (epoch, 7), kind
        assert sh.seq in (seq, (seq + 1) % 128), kind


# ------------------------------------------------------------------------------ corpus replay


def corpus(target: str) -> list[tuple[str, bytes]]:
    files = sorted(CORPUS.glob(f"{target}-*.bin"))
    assert files, f"no {target} frames in {CORPUS}"
    return [(f.name, f.read_bytes()) for f in files]


def test_corpus_is_current() -> None:
    """The committed corpus is what ``python -m testkit.fuzz --write-corpus`` writes."""
    written = {f"{t}-{n}.bin": f for t, n, f in corpus_frames(0)}
    on_disk = {f.name: f.read_bytes() for f in CORPUS.glob("*.bin")}
    assert on_disk == written


@pytest.fixture(scope="module")
def target(tiny_model_dir: Path) -> TorchTarget:
    return TorchTarget(load_model(str(tiny_model_dir)))


async def test_corpus_against_a_live_session(aiohttp_client: Any, target: TorchTarget) -> None:
    """Each corpus frame, as the first frame of a greedy session, gets the reply the session
    rules predict (an error, nothing, or the close) and the session (if still open) and the
    service keep working for a second, honest session."""
    app = verifier_app(lambda: target, auth=["c-token"], max_k=64)
    client = await aiohttp_client(app)
    await ready(app)
    hello = Hello(target.fingerprint, SamplingParams(0.0), correction=CorrectionMode.GREEDY_DRAFT)
    honest = ProbeClient(
        StreamWS(
            await client.ws_connect(
                "/v1/session", headers=auth_headers("c-token"), protocols=(SUBPROTOCOL,)
            )
        )
    )
    await honest.hello(hello)
    driver = Driver(honest, V, 2, np.random.default_rng(0))
    driver.fixed = [1, 9]
    for name, frame in corpus("verifier"):
        ws = StreamWS(
            await client.ws_connect(
                "/v1/session", headers=auth_headers("c-token"), protocols=(SUBPROTOCOL,)
            )
        )
        welcome = await ProbeClient(ws).hello(hello)
        sh = Shadow(Shadow.limits(welcome, 64, 16, 64), V, correction=hello.correction)
        ctx = sh.ctx
        predicted = sh.predict(frame)
        await ws.send_bytes(frame)
        got: Any = "none"
        if predicted != "none":
            m = await ws.receive(timeout=10)
            got = decode(m.data, ctx) if m.type == WSMsgType.BINARY else "close"
        if predicted.startswith("error:"):
            assert isinstance(got, Error) and got.code == predicted[6:], (name, got)
        elif predicted == "close":
            assert got == "close" or (isinstance(got, Error) and got.fatal), (name, got)
        else:
            assert predicted == "none" or isinstance(got, Verdict), (name, predicted, got)
        await ws.close()
        await driver.round()  # the honest session carries on (an Error reply would raise)
    await honest.ws.close()
    assert app[STATE].status == "ready" and len(driver.history) == len(corpus("verifier"))


@pytest.mark.parametrize("name,frame", corpus("edge"), ids=[n for n, _ in corpus("edge")])
def test_edge_refuses_each_corpus_frame(name: str, frame: bytes) -> None:
    """The reply to the edge's first Propose is hostile: the session core raises an error the
    agent handles (it reconnects or reports), and nothing is committed."""
    cfg = PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(0.0))
    fp = Fingerprint("t", V, "test")
    welcome = Welcome(fp, "s", max_gamma=16, max_fixed=8192, max_context=8192, max_frame=1 << 20)
    gen = Generation([1, 9], 12)
    core = SingleCore(gen, cfg, np.random.default_rng(0), hello_for(fp, cfg, 0), welcome)
    plan = core.pipe.plan()
    assert plan is not None
    draft = [(plan.context[-1] + 1 + i) % V for i in range(plan.max_tokens)]
    assert core.propose(plan, draft, [np.eye(V)[x] for x in draft])
    with pytest.raises((ProtocolError, DesyncError, VerifierError)):
        sent(core, core.receive(frame))
    assert gen.committed == [1, 9], name


# ------------------------------------------------------------------------------ live, reduced


async def test_reduced_fuzz_run(tmp_path: Path) -> None:
    """``python -m testkit.fuzz`` at reduced size: 500 hostile frames at a real verifier process
    (every reply as the session rules predict), 150 at a real edge agent, 60 HTTP requests."""
    cfg = FuzzConfig(frames=500, edge_frames=150, clients=3, http_requests=60, honest_rounds=12)
    rep = await run(cfg, tmp_path)
    assert rep.verifier_frames >= 500 and rep.edge_frames >= 150
    assert rep.mismatch_count == 0, rep.mismatches
    assert rep.hangs == []
    assert rep.honest_replays >= 1 and rep.honest_wrong == 0
    assert rep.honest_max_round_s < 5.0
    assert rep.edge_garbage == [] and rep.edge_crashes == []
    assert rep.edge_text_checked >= 10
    assert rep.http_bad == [] and rep.http_requests == 60
    assert rep.verifier_alive
    # Memory: the verifier's RSS at the end of the run is not drifting away from its start.
    assert rep.rss_kib["last_quarter_max"] - rep.rss_kib["first_quarter_max"] < 64 * 1024
    assert rep.ok()
