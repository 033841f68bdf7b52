"""A minimal verifier client for tests and benchmarks: stop-and-wait rounds of random drafts.

:class:`ProbeClient` wraps an aiohttp client WebSocket; :class:`Driver` plays rounds against a
session through the edge's own session core (:class:`edge_agent.session.core.SingleCore`; in
federated
mode the same :class:`~edge_agent.session.pipeline.Pipeline` and
:class:`~edge_agent.session.wire_state.WireState`,
accepting every draft since a probe has no aggregate to decide with). It keeps no draft model:
drafts are random ids with q drawn log-uniform.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
from aiohttp import WSMsgType

from edge_agent.session.core import SingleCore
from edge_agent.session.events import Fail, Send
from edge_agent.session.generation import Generation
from edge_agent.session.opening import wire_context
from edge_agent.session.pipeline import Pipeline
from edge_agent.session.pipeline_config import Mode, PipelineConfig
from edge_agent.session.wire_state import WireState
from shared.wire.codec import decode, encode, message_equal
from shared.wire.messages import (
    Error,
    FederatedReply,
    Hello,
    Message,
    Progress,
    ReplyMode,
    Welcome,
)
from shared.wire.packing import WireContext
from testkit.net.stream_ws import StreamWS

M = TypeVar("M", bound=Message)


def replies_match(a: Message, b: Message) -> bool:
    """Equal replies, but for probabilities within float32 rounding: a session's logits in a
    batched forward differ from its logits alone (or in another batch) in the last bits."""
    return message_equal(a, b, rtol=1e-4, atol=1e-7)


def auth_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class ProbeClient:
    """Frames over one session WebSocket (``ws`` already connected with the subprotocol)."""

    def __init__(self, ws: StreamWS) -> None:
        self.ws = ws
        self.ctx: WireContext | None = None
        self.welcome: Welcome | None = None
        self.sent_hello: Hello | None = None
        #: Progress frames before the Welcome: the session waited in the admission line.
        self.queued: list[Progress] = []

    async def hello(self, hello: Hello, timeout: float | None = 30.0) -> Welcome:
        """Send ``hello`` and await its Welcome; Progress frames before it (the session waits
        in the verifier's admission line) are kept in :attr:`queued`, each restarting the
        ``timeout``."""
        await self.ws.send_bytes(encode(hello))
        while isinstance(msg := await self.recv(timeout), Progress):
            self.queued.append(msg)
        if not isinstance(msg, Welcome):
            raise RuntimeError(f"expected Welcome, got {msg}")
        self.welcome = msg
        self.sent_hello = hello
        # The edge's context of the session, but that a probe reads a frame of any size.
        self.ctx = replace(wire_context(hello, msg), max_frame=1 << 30)
        return msg

    async def send(self, msg: Message) -> int:
        data = encode(msg, self.ctx)
        await self.ws.send_bytes(data)
        return len(data)

    async def recv(self, timeout: float | None = 30.0) -> Message:
        m = await self.ws.receive(timeout=timeout)
        if m.type != WSMsgType.BINARY:
            raise ConnectionError(f"no frame: {m.type.name} {m.data!r} {m.extra!r}")
        return decode(m.data, self.ctx)

    async def recv_as(self, kind: type[M], timeout: float | None = 30.0) -> M:
        msg = await self.recv(timeout)
        if not isinstance(msg, kind):
            raise AssertionError(f"expected {kind.__name__}, got {msg}")
        return msg


@dataclass
class Driver:
    """Stop-and-wait rounds with random drafts. ``q`` is drawn log-uniform in [q_lo, q_hi] so
    that acceptance lengths vary (the verifier accepts x w.p. min(1, p(x)/q)). ``fixed`` is the
    prompt (set it before the first round)."""

    client: ProbeClient
    vocab_size: int
    gamma: int
    rng: np.random.Generator
    q_lo: float = 1e-7
    q_hi: float = 1e-3
    fixed: list[int] = field(default_factory=list)
    history: list[Message] = field(default_factory=list)
    last_round_trip_s: float = 0.0
    _core: SingleCore | None = None
    _pipe: Pipeline | None = None
    _link: WireState | None = None

    @property
    def pos(self) -> int:
        """Tokens the verifier's cache holds (after the last round)."""
        return 0 if self._link is None else self._link.verifier_len

    def _start(self) -> tuple[Pipeline, WireState]:
        hello, welcome = self.client.sent_hello, self.client.welcome
        assert hello is not None and welcome is not None, "call ProbeClient.hello first"
        cfg = PipelineConfig(
            gamma=min(self.gamma, welcome.max_gamma),
            depth=1,
            mode=Mode.STOP_AND_WAIT,
            sampling=hello.sampling,
            correction=hello.correction,
        )
        gen = Generation(self.fixed or [0], 1 << 40)
        if hello.reply_mode == ReplyMode.FEDERATED:
            self._pipe = Pipeline(gen, cfg, self.rng, gamma=cfg.gamma, deterministic_draft=False)
            self._link = WireState(wire_context(hello, welcome))
        else:
            self._core = SingleCore(gen, cfg, self.rng, hello, welcome)
            self._pipe, self._link = self._core.pipe, self._core.wire
        return self._pipe, self._link

    async def round(self) -> Message:
        pipe, link = (self._pipe, self._link) if self._pipe and self._link else self._start()
        plan = pipe.plan()
        assert plan is not None, "a stop-and-wait probe has nothing in flight between rounds"
        draft = self.rng.integers(4, self.vocab_size, self.gamma).tolist()
        q = np.exp(self.rng.uniform(np.log(self.q_lo), np.log(self.q_hi), self.gamma))
        q_rows = []
        for x, qx in zip(draft, q, strict=True):
            row = np.zeros(self.vocab_size)
            row[x] = qx
            q_rows.append(row)
        if self._core is not None:
            events = self._core.propose(plan, draft, q_rows)
            frames = [encode(e.msg, link.ctx) for e in events if isinstance(e, Send)]
        else:
            b = pipe.push(plan, draft, q_rows, 0.0)
            frames = [
                encode(link.propose(pipe.gen.committed, b, 0, link.ctx.draft_probs), link.ctx)
            ]
        t0 = time.perf_counter()
        for f in frames:
            await self.client.ws.send_bytes(f)
        m = await self.client.ws.receive(timeout=30.0)
        self.last_round_trip_s = time.perf_counter() - t0  # the wire and the verifier alone
        if m.type != WSMsgType.BINARY:
            raise ConnectionError(f"no frame: {m.type.name} {m.data!r} {m.extra!r}")
        reply = decode(m.data, link.ctx)
        self.history.append(reply)
        if isinstance(reply, Error):
            raise RuntimeError(f"verifier error {reply.code}: {reply.message}")
        if self._core is not None:
            for e in self._core.receive(m.data):  # a Resample: never, q(y) = 0 off the draft
                if isinstance(e, Fail):
                    raise e.error
                if isinstance(e, Send):
                    await self.client.ws.send_bytes(encode(e.msg, link.ctx))
        elif isinstance(reply, FederatedReply):
            pipe.commit_round(pipe.inflight[0], len(draft), 0.0)
        else:
            raise AssertionError(f"unexpected reply {reply}")
        return reply


class CloudOnlyDriver:
    """A cloud-only session (no draft model: :meth:`edge_agent.session.core.SingleCore.credit`): the
    prompt goes up in a credit, the verifier writes the text by co-generation with its own
    drafts, and a credit follows every few tokens. ``hello`` must ask for co-generation
    (:func:`edge_agent.session.opening.hello_for` with ``end``)."""

    def __init__(self, client: ProbeClient, prompt: list[int], max_new: int) -> None:
        hello, welcome = client.sent_hello, client.welcome
        assert hello is not None and welcome is not None, "call ProbeClient.hello first"
        assert hello.cogen_end > 0, "a cloud-only session needs co-generation"
        self.client = client
        cfg = PipelineConfig(sampling=hello.sampling, correction=hello.correction, cogen=True)
        self.gen = Generation(prompt, max_new)
        self.core = SingleCore(self.gen, cfg, np.random.default_rng(0), hello, welcome)

    async def _send(self, events: list[Any]) -> None:
        for e in events:
            if isinstance(e, Fail):
                raise e.error
            if isinstance(e, Send):
                await self.client.ws.send_bytes(encode(e.msg, self.core.ctx))

    async def run(self, until: float, min_tokens: int = 0) -> None:
        """Until ``until`` (perf_counter) and at least ``min_tokens`` generated, or the end."""
        while not self.gen.done and (
            time.perf_counter() < until or len(self.gen.generated) < min_tokens
        ):
            if self.core.wants_credit():
                await self._send(self.core.credit(time.perf_counter()))
            m = await self.client.ws.receive(timeout=60.0)
            if m.type != WSMsgType.BINARY:
                raise ConnectionError(f"no frame: {m.type.name} {m.data!r} {m.extra!r}")
            await self._send(self.core.receive(m.data, time.perf_counter()))
