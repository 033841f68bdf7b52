"""The federation's worker rules (:class:`edge_agent.federation_core.FederatedCore`) as pure
functions: one case per row of its worker state table, plus rounds, deadlines and Rollbacks.
No sockets, no event loop; time is passed in."""

from __future__ import annotations

import numpy as np

from edge_agent.events import Drop, Send
from edge_agent.federation_core import FederatedCore, WorkerParams, WorkerState
from edge_agent.generation import Generation
from edge_agent.pipeline_config import PipelineConfig
from shared.wire.params import SamplingParams
from shared.wire.protocol import (
    Error,
    FederatedReply,
    Fingerprint,
    Propose,
    Rollback,
    SparseDist,
    Verdict,
    Welcome,
    decode,
    encode,
)

V = 16
FP = Fingerprint("t", V, "test")
WELCOME = Welcome(FP, "s", max_gamma=8, max_fixed=1024, max_context=1024, max_frame=1 << 20)


def core(workers: int = 2, deadline_s: float = 1.0) -> FederatedCore:
    cfg = PipelineConfig(gamma=2, depth=2, sampling=SamplingParams(0.0))
    c = FederatedCore(
        Generation([1], 10),
        cfg,
        np.random.default_rng(0),
        FP,
        [WorkerParams(f"w{i}") for i in range(workers)],
        deadline_s=deadline_s,
    )
    return c


def draft(c: FederatedCore, tokens: list[int], now: float = 0.0) -> list[Send]:
    plan = c.pipe.plan()
    assert plan is not None
    out = c.propose(plan, tokens, [np.eye(V)[x] for x in tokens], now)
    assert all(isinstance(o, Send) for o in out)
    return out  # type: ignore[return-value]


def reply_to(c: FederatedCore, frame: Send, greedy: list[int]) -> bytes:
    """A worker's reply whose greedy token at each position is ``greedy[j]``."""
    w = c.workers[frame.link]
    assert w.link is not None
    p = decode(frame.data, w.link.ctx)
    assert isinstance(p, Propose)
    dists = tuple(SparseDist(np.array([t]), np.ones(1, np.float32)) for t in greedy)
    p_draft = np.array([float(x == t) for x, t in zip(p.draft, greedy, strict=False)], np.float32)
    return encode(FederatedReply(p.epoch, p.seq, dists, p_draft), w.link.ctx)


def test_down_ready_live_only_at_a_boundary() -> None:
    c = core()
    assert [w.state for w in c.workers] == [WorkerState.DOWN] * 2 and not c.may_draft()
    c.link_up(0, WELCOME, 0.0)
    assert c.workers[0].state == WorkerState.LIVE  # nothing in flight: a boundary
    assert c.none_up_since is None and c.may_draft()
    (f,) = draft(c, [2, 3])
    c.link_up(1, WELCOME, 0.1)
    assert c.workers[1].state == WorkerState.READY  # a batch is in flight: it waits
    c.receive(0, reply_to(c, f, [2, 3, 4]), 0.2)
    assert c.round_ready(0.2)
    c.decide(0.2)
    assert c.workers[1].state == WorkerState.LIVE and c.workers[1].joins == 1
    # Its first Propose carries every committed id, so its target re-prefills.
    frames = draft(c, [4, 5])
    p = decode(frames[1].data, c.workers[1].link.ctx)  # type: ignore[union-attr]
    assert isinstance(p, Propose) and p.pos == 0 and p.fixed.tolist() == [1, 2, 3]


def test_a_rejection_rolls_every_live_worker_back_before_the_next_propose() -> None:
    c = core()
    c.link_up(0, WELCOME, 0.0)
    c.link_up(1, WELCOME, 0.0)
    frames = draft(c, [2, 3])
    for f in frames:
        c.receive(f.link, reply_to(c, f, [2, 9, 9]), 0.1)
    out = c.decide(0.1)
    assert c.gen.generated == [2, 9]  # 2 accepted, 3 rejected → 9
    rollbacks = [decode(o.data, c.workers[o.link].link.ctx) for o in out]  # type: ignore[union-attr]
    assert rollbacks == [Rollback(1, 2), Rollback(1, 2)]  # keep [1, 2]: before the recovered 9
    frames = draft(c, [10])
    p = decode(frames[0].data, c.workers[0].link.ctx)  # type: ignore[union-attr]
    assert isinstance(p, Propose) and (p.epoch, p.pos, p.fixed.tolist()) == (1, 2, [9])


def test_replies_to_discarded_batches_are_ignored() -> None:
    c = core(workers=1)
    c.link_up(0, WELCOME, 0.0)
    (a,) = draft(c, [2, 3])
    (b,) = draft(c, [4, 5])
    c.receive(0, reply_to(c, a, [2, 7, 7]), 0.1)
    c.decide(0.1)  # rejects: b is discarded
    assert not c.pipe.inflight
    assert c.receive(0, reply_to(c, b, [4, 5, 6]), 0.2) == []
    assert c.workers[0].state == WorkerState.LIVE


def test_error_wrong_frames_and_wrong_gamma_drop_the_worker() -> None:
    for bad in ("error", "verdict", "gamma"):
        c = core(workers=1)
        c.link_up(0, WELCOME, 0.0)
        (f,) = draft(c, [2, 3])
        ctx = c.workers[0].link.ctx  # type: ignore[union-attr]
        data = {
            "error": encode(Error("boom", "x")),
            "verdict": encode(Verdict(0, 0, 2), ctx),
            "gamma": reply_to(c, f, [2]),  # one draft position instead of two
        }[bad]
        out = c.receive(0, data, 0.1)
        assert len(out) == 1 and isinstance(out[0], Drop), bad
        assert c.workers[0].state == WorkerState.DOWN and c.fed.worker_drops == 1
        assert c.none_up_since == 0.1


def test_the_deadline_drops_silent_workers_and_decides_without_them() -> None:
    c = core(deadline_s=1.0)
    c.link_up(0, WELCOME, 0.0)
    c.link_up(1, WELCOME, 0.0)
    frames = draft(c, [2, 3], now=0.0)
    c.receive(0, reply_to(c, frames[0], [2, 3, 4]), 0.5)
    assert not c.round_ready(0.5) and c.head_deadline() == 1.0
    assert c.round_ready(1.0)
    out = c.decide(1.0)
    assert Drop(1, "missed the round deadline") in out
    assert c.gen.generated == [2, 3] and c.fed.rounds_with_missing_workers == 1


def test_a_round_nobody_answers_is_void_and_restarts_from_the_committed_ids() -> None:
    c = core(workers=1)
    c.link_up(0, WELCOME, 0.0)
    draft(c, [2, 3], now=0.0)
    out = c.decide(5.0)
    assert out == [Drop(0, "missed the round deadline")]
    assert c.gen.generated == [] and c.pipe.epoch == 1 and not c.pipe.inflight


def test_link_down_is_counted_once() -> None:
    c = core(workers=1)
    c.link_up(0, WELCOME, 0.0)
    assert c.link_down(0, "lost", 1.0) and not c.link_down(0, "again", 2.0)
    assert c.fed.worker_drops == 1 and c.none_up_since == 1.0
    assert c.receive(0, b"late", 3.0) == []  # a frame that raced the drop
