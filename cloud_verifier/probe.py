"""A minimal verifier client: the wire side of the edge, stop-and-wait, for tests and benchmarks.

:class:`ProbeClient` wraps an aiohttp client WebSocket; :class:`Driver` plays rounds against a
session, following the session rules (epoch, seq, pos, a correction or bonus committed as the
next Propose's fixed token). The real edge agent lives in ``edge_agent``; this is deliberately
small and keeps no draft model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from aiohttp import ClientWebSocketResponse, WSMsgType

from shared.protocol import (
    SEQ_MODULUS,
    CorrectionMode,
    Error,
    FederatedReply,
    Hello,
    Message,
    Propose,
    Verdict,
    Welcome,
    WireContext,
    decode,
    encode,
)

M = TypeVar("M", bound=Message)


def auth_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class ProbeClient:
    """Frames over one session WebSocket (``ws`` already connected with the subprotocol)."""

    def __init__(self, ws: ClientWebSocketResponse[Any]) -> None:
        self.ws = ws
        self.ctx: WireContext | None = None
        self.welcome: Welcome | None = None

    async def hello(self, hello: Hello) -> Welcome:
        await self.ws.send_bytes(encode(hello))
        msg = await self.recv()
        if not isinstance(msg, Welcome):
            raise RuntimeError(f"expected Welcome, got {msg}")
        self.welcome = msg
        self.ctx = WireContext(
            vocab_size=msg.fingerprint.vocab_size,
            max_gamma=msg.max_gamma,
            max_fixed=msg.max_fixed,
            max_k=1 << 20,
            max_frame=1 << 30,
            draft_probs=hello.correction != CorrectionMode.GREEDY_DRAFT,
        )
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
    that acceptance lengths vary (the verifier accepts x w.p. min(1, p(x)/q))."""

    client: ProbeClient
    vocab_size: int
    gamma: int
    rng: np.random.Generator
    q_lo: float = 1e-7
    q_hi: float = 1e-3
    epoch: int = 0
    seq: int = 0
    pos: int = 0
    fixed: list[int] = field(default_factory=list)
    history: list[Message] = field(default_factory=list)

    def next_propose(self) -> Propose:
        draft = self.rng.integers(4, self.vocab_size, self.gamma)
        q = np.exp(self.rng.uniform(np.log(self.q_lo), np.log(self.q_hi), self.gamma))
        return Propose(
            epoch=self.epoch,
            seq=self.seq,
            pos=self.pos,
            draft=draft.astype(np.int64),
            q=q.astype(np.float32),
            fixed=np.array(self.fixed, np.int64),
        )

    def apply(self, p: Propose, reply: Message) -> None:
        """Advance the edge-side state from the reply to ``p``."""
        self.history.append(reply)
        self.seq = (p.seq + 1) % SEQ_MODULUS
        start = p.pos + len(p.fixed)
        if isinstance(reply, Verdict):
            n = reply.accepted
            self.pos = start + n
            if n < len(p.draft):
                self.epoch += 1
                if reply.token is not None:
                    corr = reply.token
                elif reply.sparse is not None:
                    corr = int(reply.sparse.ids[0])
                elif reply.candidates is not None:
                    corr = int(reply.candidates.ids[0])
                else:
                    raise AssertionError(f"rejection without a correction: {reply}")
                self.fixed = [corr]
            else:
                self.fixed = [] if reply.bonus is None else [reply.bonus]
        elif isinstance(reply, FederatedReply):
            self.pos = start + len(p.draft)
            self.fixed = []
        elif isinstance(reply, Error):
            raise RuntimeError(f"verifier error {reply.code}: {reply.message}")
        else:
            raise AssertionError(f"unexpected reply {reply}")

    async def round(self) -> Message:
        p = self.next_propose()
        await self.client.send(p)
        reply = await self.client.recv()
        self.apply(p, reply)
        return reply
