"""Both ends' session cores coupled through an in-memory network, driven by hypothesis-generated
event sequences: drafts, deliveries in either direction, model work completing late, stale and
duplicated frames, dropped connections, federation workers lost and rejoining, round deadlines.
No sockets, no event loop, no sleeps.

The target is a deterministic function of the text (its greedy token), the draft guesses it or
misses as hypothesis decides, and decoding is greedy, so the exact output is known: the
committed text must always be a prefix of the target's own greedy text, and equal to it at the
end. Checked after every event: committed text only grows (never duplicates), epochs are
monotone on both ends, stale work never reaches the model (every verify starts where the
verifier's cache ends, in the verifier's current epoch), and a new session resumes from the
committed ids.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud_verifier.engine.work import Work
from cloud_verifier.session.core import VerifierCore
from cloud_verifier.session.events import Close, Run, Send
from cloud_verifier.session.limits import SessionLimits, TargetInfo
from edge_agent.session.core import SingleCore
from edge_agent.session.events import Drop
from edge_agent.session.events import Send as EdgeSend
from edge_agent.session.federation_core import FederatedCore
from edge_agent.session.federation_members import WorkerParams
from edge_agent.session.generation import Generation
from edge_agent.session.opening import DesyncError, VerifierError, hello_for
from edge_agent.session.pipeline_config import Mode, PipelineConfig
from shared.maths.sampling import SamplingParams
from shared.wire.codec import decode, encode
from shared.wire.messages import Error, Fingerprint, Propose, Welcome
from shared.wire.packing import ProtocolError
from tests.edge_events import sent
from tests.fake_model import FakeTargetModel, greedy_law

pytestmark = pytest.mark.fast

V = 32
FP = Fingerprint("t", V, "test")
PROMPT = [1, 2]


def target_next(text: list[int]) -> int:
    """The target's greedy token after ``text``."""
    return (text[-1] * 7 + (text[-2] if len(text) > 1 else 0) * 3 + len(text)) % V


def target_text(prompt: list[int], n: int) -> list[int]:
    out = list(prompt)
    for _ in range(n):
        out.append(target_next(out))
    return out[len(prompt) :]


#: The verifier's model side decides exactly against it (greedy sessions) and checks that stale
#: work never reaches it.
TARGET = greedy_law(target_next, V)


@dataclass
class Verifier:
    """One verifier session: its core, its model, the work it is running, its replies."""

    core: VerifierCore
    model: FakeTargetModel = field(default_factory=lambda: FakeTargetModel(TARGET))
    pending: Work | None = None
    last_epoch: int = 0

    def feed(self, events: list[object]) -> list[bytes]:
        """Act on the core's events; returns the encoded replies. Model work waits for
        :meth:`finish` (so frames queue behind it)."""
        out: list[bytes] = []
        for ev in events:
            if isinstance(ev, Send):
                out.append(encode(ev.msg, self.core.ctx))
            elif isinstance(ev, Run):
                assert self.pending is None
                self.pending = ev.work
            elif isinstance(ev, Close):
                out.append(b"")  # the connection closes
        assert self.core.epoch >= self.last_epoch
        self.last_epoch = self.core.epoch
        return out

    def finish(self) -> list[bytes]:
        work, self.pending = self.pending, None
        assert work is not None
        return self.feed(list(self.core.work_done(self.model.run(work, self.core))))


def new_verifier() -> Verifier:
    return Verifier(VerifierCore(TargetInfo(FP, V), SessionLimits(max_gamma=8), "s"))


class Drafter:
    """Guesses the target's token, or misses by one, as hypothesis says."""

    def __init__(self, hits: list[bool]) -> None:
        self.hits = hits
        self.i = 0

    def draft(self, context: list[int]) -> int:
        hit = self.hits[self.i % len(self.hits)]
        self.i += 1
        t = target_next(context)
        return t if hit else (t + 1) % V


def draft_batch(core: SingleCore | FederatedCore, drafter: Drafter) -> tuple[list[int], object]:
    pipe = core.pipe
    plan = pipe.plan()
    assert plan is not None
    draft: list[int] = []
    while pipe.wants_more(plan, draft):
        draft.append(drafter.draft(plan.context + draft))
    q_rows = [np.eye(V)[x] for x in draft]
    return draft, (plan, q_rows)


class Invariants:
    def __init__(self, gen: Generation, n: int) -> None:
        self.gen = gen
        self.expected = target_text(PROMPT, n)
        self.seen = 0

    def check(self) -> None:
        got = self.gen.generated
        assert len(got) >= self.seen, "committed text shrank"
        assert got == self.expected[: len(got)], (got, self.expected)
        self.seen = len(got)


ACTIONS = st.lists(
    st.sampled_from(["draft", "up", "down", "model", "drop", "dup"]),
    min_size=1,
    max_size=120,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=ACTIONS,
    hits=st.lists(st.booleans(), min_size=1, max_size=16),
    gamma=st.integers(1, 4),
    depth=st.integers(1, 4),
    stop_and_wait=st.booleans(),
    cogen=st.booleans(),
)
def test_single_sessions_under_random_events(
    actions: list[str], hits: list[bool], gamma: int, depth: int, stop_and_wait: bool, cogen: bool
) -> None:
    """With co-generation (``cogen``) the verifier decodes whenever it has no valid draft
    queued: at random points of the event sequence ("model" completes its CoGenerate)."""
    mode = Mode.STOP_AND_WAIT if stop_and_wait else Mode.PIPELINED
    cfg = PipelineConfig(gamma=gamma, depth=depth, mode=mode, sampling=SamplingParams(0.0))
    n = 24
    gen = Generation(PROMPT, n)
    inv = Invariants(gen, n)
    drafter = Drafter(hits)
    rng = np.random.default_rng(0)
    state: dict[str, object] = {}
    last_edge_epoch = [0]

    def connect() -> None:
        v = new_verifier()
        hello = hello_for(FP, cfg, 0, end=len(PROMPT) + n if cogen else 0)
        (welcome_data,) = v.feed(list(v.core.receive(encode(hello))))
        welcome = decode(welcome_data)
        assert isinstance(welcome, Welcome)
        state.update(
            v=v,
            edge=SingleCore(gen, cfg, rng, hello, welcome),
            up=deque(),
            down=deque(),
            first=True,
            replayed=False,
        )
        last_edge_epoch[0] = 0

    def edge() -> SingleCore:
        e = state["edge"]
        assert isinstance(e, SingleCore)
        return e

    def uplink() -> deque[bytes]:
        q = state["up"]
        assert isinstance(q, deque)
        return q

    def downlink() -> deque[bytes]:
        q = state["down"]
        assert isinstance(q, deque)
        return q

    def verifier() -> Verifier:
        v = state["v"]
        assert isinstance(v, Verifier)
        return v

    def send_up(frames: list[bytes]) -> None:
        for f in frames:
            if state["first"]:
                # A new session resumes from the committed ids: all of them, as fixed tokens.
                p = decode(f, edge().wire.ctx)
                if isinstance(p, Propose):
                    assert p.pos == 0 and p.fixed.tolist() == gen.committed
                    state["first"] = False
            uplink().append(f)

    def down(frames: list[bytes]) -> bool:
        for f in frames:
            if f == b"":
                return False  # the verifier closed the session
            downlink().append(f)
        return True

    def step(action: str) -> None:
        e, v = edge(), verifier()
        if action == "draft" and e.may_draft():
            draft, (plan, q_rows) = draft_batch(e, drafter)  # type: ignore[misc]
            send_up(sent(e, e.propose(plan, draft, q_rows)))  # type: ignore[arg-type]
        elif action == "up" and uplink():
            if not down(v.feed(list(v.core.receive(uplink().popleft())))):
                assert state["replayed"], "the verifier closed an honest session"
                connect()
        elif action == "model" and v.pending is not None:
            if not down(v.finish()):
                assert state["replayed"], "the verifier closed an honest session"
                connect()
        elif action == "down" and downlink():
            try:
                send_up(sent(e, e.receive(downlink().popleft())))
            except (DesyncError, VerifierError, ProtocolError) as err:
                # Between honest ends only a replayed frame can break a session.
                assert state["replayed"], err
                connect()  # the agent rebuilds the session from the committed ids
        elif action == "drop":
            connect()
        elif action == "dup" and uplink():
            uplink().append(uplink()[0])  # a replayed frame: refused as bad_seq
            state["replayed"] = True
        assert e.pipe.epoch >= last_edge_epoch[0] or state["edge"] is not e
        last_edge_epoch[0] = edge().pipe.epoch
        inv.check()

    connect()
    for a in actions:
        step(a)
        if gen.done:
            break
    # Then let everything flow until the generation is done.
    for _ in range(10_000):
        if gen.done:
            break
        for a in ("model", "up", "down", "draft"):
            step(a)
    assert gen.done and gen.generated == inv.expected


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=st.lists(
        st.sampled_from(["draft", "up", "down", "model", "decide", "lose", "join", "timeout"]),
        min_size=1,
        max_size=150,
    ),
    hits=st.lists(st.booleans(), min_size=1, max_size=16),
    gamma=st.integers(1, 4),
    depth=st.integers(1, 3),
    workers=st.integers(1, 3),
)
def test_federated_sessions_under_random_events(
    actions: list[str], hits: list[bool], gamma: int, depth: int, workers: int
) -> None:
    cfg = PipelineConfig(gamma=gamma, depth=depth, sampling=SamplingParams(0.0))
    n = 20
    gen = Generation(PROMPT, n)
    inv = Invariants(gen, n)
    drafter = Drafter(hits)
    core = FederatedCore(
        gen,
        cfg,
        np.random.default_rng(0),
        FP,
        [WorkerParams(f"w{i}") for i in range(workers)],
        deadline_s=5.0,
    )
    now = [0.0]
    links: dict[int, tuple[Verifier, deque[bytes], deque[bytes]]] = {}

    def join(i: int) -> None:
        v = new_verifier()
        (w,) = v.feed(list(v.core.receive(encode(core.hello(i)))))
        welcome = decode(w)
        assert isinstance(welcome, Welcome)
        links[i] = (v, deque(), deque())
        core.link_up(i, welcome, now[0])

    def emit(outputs: list[object]) -> None:
        for o in outputs:
            if isinstance(o, Drop):
                links.pop(o.link, None)
            elif isinstance(o, EdgeSend) and o.link in links:
                links[o.link][1].append(encode(o.msg, core.ctx(o.link)))

    for i in range(workers):
        join(i)

    def step(action: str, k: int) -> None:
        if action == "draft" and core.may_draft():
            draft, (plan, q_rows) = draft_batch(core, drafter)  # type: ignore[misc]
            emit(core.propose(plan, draft, q_rows, now[0]))  # type: ignore[arg-type]
        elif action in ("up", "down", "model") and links:
            i = sorted(links)[k % len(links)]
            v, up, down = links[i]
            if action == "up" and up:
                frames = v.feed(list(v.core.receive(up.popleft())))
            elif action == "model" and v.pending is not None:
                frames = v.finish()
            elif action == "down" and down:
                emit(core.receive(i, down.popleft(), now[0]))
                frames = []
            else:
                frames = []
            for f in frames:
                assert f != b"", "an honest edge never makes a verifier close"
                assert not isinstance(decode(f, v.core.ctx), Error), decode(f, v.core.ctx)
                down.append(f)
        elif action == "decide" and core.round_ready(now[0]):
            emit(core.decide(now[0]))
        elif action == "lose" and links:
            i = sorted(links)[k % len(links)]
            links.pop(i)
            core.link_down(i, "lost", now[0])
        elif action == "join":
            for i in range(workers):
                if i not in links:
                    join(i)
                    break
        elif action == "timeout":
            now[0] += 10.0  # past every round's deadline
        inv.check()

    for k, a in enumerate(actions):
        step(a, k)
        if gen.done:
            break
    for k in range(20_000):
        if gen.done:
            break
        for a in ("join", "model", "up", "down", "decide", "draft"):
            step(a, k)
    assert gen.done and gen.generated == inv.expected
