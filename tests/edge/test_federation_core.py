"""The federation's member rules (:class:`edge_agent.session.federation_core.FederatedCore`) as pure
functions over event sequences: one case per row of its state table, plus rounds, the wait
bound, liveness and Rollbacks. No sockets, no event loop, no sleeps; time is passed in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cloud_verifier.engine.work import Work
from cloud_verifier.session.core import VerifierCore
from cloud_verifier.session.events import Close, Run
from cloud_verifier.session.events import Event as VerifierEvent
from cloud_verifier.session.events import Send as VSend
from cloud_verifier.session.limits import SessionLimits, TargetInfo
from edge_agent.session.events import (
    Committed,
    Count,
    Drop,
    EdgeEvent,
    FedCount,
    Measured,
    RejectionGap,
    Round,
    Send,
)
from edge_agent.session.federation_core import WAIT_FACTOR, FederatedCore
from edge_agent.session.federation_members import (
    LIVENESS_FACTOR,
    FederationStats,
    WorkerParams,
    WorkerState,
)
from edge_agent.session.generation import Generation
from edge_agent.session.opening import ContextExceeded
from edge_agent.session.pipeline import DraftPlan
from edge_agent.session.pipeline_config import PipelineConfig
from shared.maths.compression import SparseDist
from shared.maths.sampling import Probs, SamplingParams
from shared.wire.codec import decode, encode
from shared.wire.messages import (
    Error,
    FederatedReply,
    Fingerprint,
    Progress,
    Propose,
    Rollback,
    Verdict,
    Welcome,
)
from tests.fake_model import FakeTargetModel, greedy_law

pytestmark = pytest.mark.fast

V = 16
FP = Fingerprint("t", V, "test")
WELCOME = Welcome(FP, "s", max_gamma=8, max_fixed=1024, max_context=4096, max_frame=1 << 20)
LIVE, BEHIND, DOWN = WorkerState.LIVE, WorkerState.BEHIND, WorkerState.DOWN


class CountingCore(FederatedCore):
    """A FederatedCore whose federation events are counted in ``fed`` (as the federated driver
    counts them) and left out of what its calls return."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fed = FederationStats(eps_sum=[0.0] * len(self.workers))

    def _counted(self, events: list[EdgeEvent]) -> list[EdgeEvent]:
        out: list[EdgeEvent] = []
        for e in events:
            if isinstance(e, (FedCount, Measured)):
                self.fed.apply(e)
            else:
                out.append(e)
        return out

    def link_up(self, index: int, welcome: Welcome, now: float) -> list[EdgeEvent]:
        return self._counted(super().link_up(index, welcome, now))

    def link_down(self, index: int, why: str, now: float) -> list[EdgeEvent]:
        return self._counted(super().link_down(index, why, now))

    def propose(
        self, plan: DraftPlan, draft: list[int], q_rows: list[Probs], now: float
    ) -> list[EdgeEvent]:
        return self._counted(super().propose(plan, draft, q_rows, now))

    def receive(self, index: int, data: bytes, now: float) -> list[EdgeEvent]:
        return self._counted(super().receive(index, data, now))

    def decide(self, now: float) -> list[EdgeEvent]:
        return self._counted(super().decide(now))


def core(
    workers: int = 2,
    deadline_s: float = 1.0,
    liveness_s: float = 10.0,
    depth: int = 2,
    max_new: int = 10,
) -> CountingCore:
    cfg = PipelineConfig(gamma=2, depth=depth, sampling=SamplingParams(0.0))
    return CountingCore(
        Generation([1], max_new),
        cfg,
        np.random.default_rng(0),
        FP,
        [WorkerParams(f"w{i}") for i in range(workers)],
        deadline_s=deadline_s,
        liveness_s=liveness_s,
    )


def acts(c: FederatedCore, events: list[EdgeEvent]) -> list[EdgeEvent]:
    """``events`` less the tallies, which are counted in the generation's stats (as the
    driver counts them)."""
    out: list[EdgeEvent] = []
    for e in events:
        if isinstance(e, (Count, Round, RejectionGap)):
            c.gen.stats.apply(e)
        else:
            out.append(e)
    return out


def draft(c: FederatedCore, tokens: list[int], now: float = 0.0) -> list[Send]:
    plan = c.pipe.plan()
    assert plan is not None
    out = acts(c, c.propose(plan, tokens, [np.eye(V)[x] for x in tokens], now))
    assert all(isinstance(o, Send) for o in out)
    return out  # type: ignore[return-value]


def frame(c: FederatedCore, f: Send) -> object:
    """The frame ``f`` carries, through its link's codec (as the driver writes it)."""
    return decode(encode(f.msg, c.ctx(f.link)), c.ctx(f.link))


def reply_to(c: FederatedCore, f: Send, greedy: list[int]) -> bytes:
    """A worker's reply whose greedy token at each position is ``greedy[j]``."""
    w = c.workers[f.link]
    assert w.wire is not None
    p = frame(c, f)
    assert isinstance(p, Propose)
    dists = tuple(SparseDist(np.array([t]), np.ones(1, np.float32)) for t in greedy)
    p_draft = np.array([float(x == t) for x, t in zip(p.draft, greedy, strict=False)], np.float32)
    return encode(FederatedReply(p.epoch, p.seq, dists, p_draft), w.wire.ctx)


def progress(c: FederatedCore, i: int, eta_s: float) -> bytes:
    w = c.workers[i]
    assert w.wire is not None
    return encode(Progress(steps=1, ahead=0, eta_ms=round(eta_s * 1000)), w.wire.ctx)


def states(c: FederatedCore) -> list[WorkerState]:
    return [w.state for w in c.workers]


def up(c: FederatedCore, now: float = 0.0) -> None:
    for i in range(len(c.workers)):
        c.link_up(i, WELCOME, now)


def test_members_connected_before_the_first_decision_start_in_step() -> None:
    c = core()
    assert states(c) == [DOWN, DOWN] and not c.may_draft()
    c.link_up(0, WELCOME, 0.0)
    assert states(c) == [LIVE, DOWN] and c.none_up_since is None and c.may_draft()
    (f,) = draft(c, [2, 3])
    c.link_up(1, WELCOME, 0.1)  # a batch is in flight, but no round was decided yet
    assert states(c) == [LIVE, LIVE]
    assert c.hello(1).progress  # its liveness follows the verifier's Progress frames
    # It owes the head nothing (it was not sent it): the head is decided on worker 0 alone.
    c.receive(0, reply_to(c, f, [2, 3, 4]), 0.2)
    assert c.round_ready(0.2)
    c.decide(0.2)
    # Its first Propose carries every committed id, so its target prefills them.
    frames = draft(c, [4, 5], 0.3)
    p = frame(c, frames[1])
    assert isinstance(p, Propose) and p.pos == 0 and p.fixed.tolist() == [1, 2, 3]


def test_a_member_joining_mid_pipeline_gets_the_in_flight_drafts_as_fixed_tokens() -> None:
    c = core(workers=2)
    c.link_up(0, WELCOME, 0.0)
    (a,) = draft(c, [2, 3], 0.0)
    c.link_up(1, WELCOME, 0.0)
    _, f1 = draft(c, [4, 5], 0.1)  # batch a (2, 3) is still undecided
    p = frame(c, f1)
    assert isinstance(p, Propose) and (p.pos, p.fixed.tolist(), p.draft.tolist()) == (
        0,
        [1, 2, 3],
        [4, 5],
    )
    # a rejection inside a rolls worker 1 back too: it holds a's drafts as fixed tokens
    c.receive(0, reply_to(c, a, [2, 9, 9]), 0.2)
    out = c.decide(0.2)
    assert [(o.link, frame(c, o)) for o in out if isinstance(o, Send)] == [
        (0, Rollback(1, 2)),
        (1, Rollback(1, 2)),
    ]


def test_a_rejection_rolls_every_member_back_before_the_next_propose() -> None:
    c = core()
    up(c)
    frames = draft(c, [2, 3])
    for f in frames:
        c.receive(f.link, reply_to(c, f, [2, 9, 9]), 0.1)
    out = c.decide(0.1)
    assert c.gen.generated == [2, 9]  # 2 accepted, 3 rejected → 9
    rollbacks = [frame(c, o) for o in out if isinstance(o, Send)]
    assert rollbacks == [Rollback(1, 2), Rollback(1, 2)]  # keep [1, 2]: before the recovered 9
    frames = draft(c, [10])
    p = frame(c, frames[0])
    assert isinstance(p, Propose) and (p.epoch, p.pos, p.fixed.tolist()) == (1, 2, [9])


def test_replies_to_discarded_batches_are_ignored() -> None:
    c = core(workers=1)
    up(c)
    (a,) = draft(c, [2, 3])
    (b,) = draft(c, [4, 5])
    c.receive(0, reply_to(c, a, [2, 7, 7]), 0.1)
    c.decide(0.1)  # rejects: b is discarded
    assert not c.pipe.inflight
    assert acts(c, c.receive(0, reply_to(c, b, [4, 5, 6]), 0.2)) == []
    assert states(c) == [LIVE] and not c.workers[0].outstanding


def test_error_wrong_frames_and_wrong_gamma_drop_the_worker() -> None:
    for bad in ("error", "verdict", "gamma", "unsent"):
        c = core(workers=1)
        up(c)
        (f,) = draft(c, [2, 3])
        ctx = c.workers[0].wire.ctx  # type: ignore[union-attr]
        data = {
            "error": encode(Error("boom", "x")),
            "verdict": encode(Verdict(0, 0, 2), ctx),
            "gamma": reply_to(c, f, [2]),  # one draft position instead of two
            "unsent": encode(
                FederatedReply(0, 5, (SparseDist(np.array([1]), np.ones(1, np.float32)),) * 3,
                               np.ones(2, np.float32)), ctx),
        }[bad]  # fmt: skip
        out = acts(c, c.receive(0, data, 0.1))
        assert len(out) == 1 and isinstance(out[0], Drop), bad
        assert states(c) == [DOWN] and c.fed.worker_drops == 1
        assert c.none_up_since == 0.1


def test_a_slow_member_is_left_out_not_dropped_and_rounds_go_at_the_fast_pace() -> None:
    """Worker 1 takes 15 s a forward, worker 0 0.1 s: after one wait of the floor, every round
    is decided on worker 0's reply alone; worker 1 keeps its session while it reports
    progress, gets one probe at a time, and is never dropped."""
    c = core(deadline_s=1.0, max_new=2000, depth=1)
    up(c)
    f0, f1 = draft(c, [2, 3], 0.0)
    c.receive(0, reply_to(c, f0, [2, 3, 4]), 0.1)
    # One member answered: the round waits for the other up to max(1, 4 × 0.1) = 1 s.
    assert not c.round_ready(0.5) and c.wake_at() == 1.0
    assert c.round_ready(1.0)
    assert acts(c, c.decide(1.0)) == [Committed((2, 3))]  # no Drop: left out, nothing to send
    assert states(c) == [LIVE, BEHIND] and c.fed.left_out == 1 and c.gen.generated == [2, 3]
    # The slow verifier works through its Proposes one at a time, 15 s each, and sends a
    # Progress frame every second meanwhile.
    queue, done_at = [f1], 15.0
    now, rounds = 1.0, 0
    while now < 60.0:
        frames = draft(c, [4, 5], now)
        assert frames[0].link == 0 and len(c.workers[1].outstanding) <= 1
        for f in frames[1:]:  # a probe: one at a time
            if not queue:
                done_at = now + 15.0
            queue.append(f)
        c.receive(0, reply_to(c, frames[0], [4, 5, 6]), now + 0.1)
        for t in np.arange(np.ceil(now), now + 0.1):
            if queue:
                assert acts(c, c.receive(1, progress(c, 1, done_at - t), float(t))) == []
        now = round(now + 0.1, 6)
        if queue and now >= done_at:
            c.receive(1, reply_to(c, queue.pop(0), [0, 0, 0]), done_at)
            done_at += 15.0
        assert c.round_ready(now)  # nothing waits for the left-out member
        assert not [e for e in c.decide(now) if isinstance(e, Drop)]
        rounds += 1
    assert c.fed.worker_drops == 0 and states(c) == [LIVE, BEHIND]
    assert rounds >= 500  # ten rounds a second, not one per 15 s
    # Its first reply (15 s after sending) spaces the probe 15 s more: one at 30 s, answered
    # at 45 s, so the next is due at 60 s; it spends at most half its time on probes.
    assert c.fed.probes == 1 and c.fed.worker_rejoins == 0
    assert abs(c.workers[1].probe_at - 60.0) < 0.2


def test_a_left_out_member_that_keeps_up_again_is_readmitted() -> None:
    c = core(deadline_s=1.0, max_new=100, depth=1)
    up(c)
    f0, f1 = draft(c, [2, 3], 0.0)
    c.receive(0, reply_to(c, f0, [2, 3, 4]), 0.1)
    c.decide(1.0)
    assert states(c) == [LIVE, BEHIND]
    # Its queued work answers at 15 s (too slow to be readmitted: 15 s > ½ × 1 s) ...
    (g0,) = draft(c, [4, 5], 1.0)  # it still has f1 outstanding: no probe
    c.receive(0, reply_to(c, g0, [4, 5, 6]), 1.1)
    c.decide(1.1)
    c.receive(1, reply_to(c, f1, [2, 3, 4]), 15.0)
    assert states(c) == [LIVE, BEHIND] and c.workers[1].probe_at == 30.0  # spaced by 15 s
    (h0,) = draft(c, [6, 7], 16.0)  # its probe is not due yet
    c.receive(0, reply_to(c, h0, [6, 7, 8]), 16.1)
    c.decide(16.1)
    # ... its verifier is fast again: the next probe comes back in 0.2 s and it is back in step.
    probe = draft(c, [8, 9], 30.0)
    assert [f.link for f in probe] == [0, 1] and c.fed.probes == 1
    c.receive(1, reply_to(c, probe[1], [8, 9, 10]), 30.2)
    assert states(c) == [LIVE, LIVE] and c.fed.worker_rejoins == 1
    c.receive(0, reply_to(c, probe[0], [8, 9, 10]), 30.1)
    c.decide(30.2)
    assert c.fed.rounds_with_missing_workers == 3  # the three rounds without it
    # In step again: waited for in every round.
    both = draft(c, [10, 11], 31.0)
    c.receive(0, reply_to(c, both[0], [10, 11, 12]), 31.1)
    assert not c.round_ready(31.2)
    c.receive(1, reply_to(c, both[1], [10, 11, 12]), 31.3)
    assert c.round_ready(31.3)


def accept_all(c: FederatedCore, f: Send) -> bytes:
    """A reply that accepts every draft token of ``f`` (and proposes 0 after them)."""
    p = frame(c, f)
    assert isinstance(p, Propose)
    return reply_to(c, f, [*p.draft.tolist(), 0])


def test_a_round_waits_for_a_member_within_the_wait_bound() -> None:
    """A member 3× slower than the fastest is in step: its rounds are slower, nobody is left
    out (WAIT_FACTOR × 0.1 s = 0.4 s > 0.3 s; the floor here is below both)."""
    c = core(deadline_s=0.05, max_new=20)
    up(c)
    for r in range(5):
        t = float(r)
        f0, f1 = draft(c, [2, 3], t)
        c.receive(0, accept_all(c, f0), t + 0.1)
        assert not c.round_ready(t + 0.25)
        assert c.wake_at() == pytest.approx(t + WAIT_FACTOR * 0.1)
        c.receive(1, accept_all(c, f1), t + 0.3)
        assert c.round_ready(t + 0.3)
        c.decide(t + 0.3)
    assert c.fed.left_out == 0 and c.fed.rounds_with_missing_workers == 0
    assert len(c.gen.generated) == 10


def test_a_round_nobody_answered_waits_while_its_members_report_progress() -> None:
    """No round deadline is shorter than a live member's speed unless another answered."""
    c = core(workers=1, liveness_s=10.0)
    up(c)
    draft(c, [2, 3], 0.0)
    for t in range(1, 120):
        assert acts(c, c.receive(0, progress(c, 0, 15.0), float(t))) == []
        assert not c.round_ready(float(t) + 0.5)
    assert states(c) == [LIVE] and c.fed.worker_drops == 0
    assert c.wake_at() == 119.0 + LIVENESS_FACTOR * 15.0


def test_a_silent_member_is_dropped_after_its_liveness_bound() -> None:
    c = core(workers=2, liveness_s=10.0)
    up(c)
    f0, _ = draft(c, [2, 3], 0.0)
    c.receive(0, reply_to(c, f0, [2, 3, 4]), 0.1)
    c.decide(1.0)  # worker 1 left out (not dropped) ...
    assert states(c) == [LIVE, BEHIND]
    # ... and silent: dead once 10 s (+ the prefill allowance of its 1 fixed token) passed.
    deadline = c.workers[1].liveness_deadline(10.0)
    assert deadline is not None and abs(deadline - 10.01) < 1e-9
    (g0,) = draft(c, [4, 5], 2.0)
    c.receive(0, reply_to(c, g0, [4, 5, 6]), 2.1)
    c.decide(2.1)
    assert not c.round_ready(10.0)
    assert c.round_ready(10.01)
    out = acts(c, c.decide(10.01))
    assert len(out) == 1 and isinstance(out[0], Drop) and "stalled" in out[0].why
    assert states(c) == [LIVE, DOWN] and c.fed.worker_drops == 1


def test_a_reconnected_member_is_probed_not_waited_for() -> None:
    c = core(deadline_s=1.0)
    up(c)
    f0, f1 = draft(c, [2, 3], 0.0)
    c.receive(0, reply_to(c, f0, [2, 3, 4]), 0.1)
    c.receive(1, reply_to(c, f1, [2, 3, 4]), 0.1)
    c.decide(0.1)
    c.link_down(1, "lost", 0.5)
    c.link_up(1, WELCOME, 0.6)
    assert states(c) == [LIVE, BEHIND]  # rounds have been decided: on probation
    frames = draft(c, [4, 5], 1.0)
    assert [f.link for f in frames] == [0, 1]  # its probe re-prefills the committed text
    p = frame(c, frames[1])
    assert isinstance(p, Propose) and (p.pos, p.fixed.tolist()) == (0, [1, 2, 3])
    c.receive(0, reply_to(c, frames[0], [4, 5, 6]), 1.1)
    assert c.round_ready(1.1)  # not waited for
    c.receive(1, reply_to(c, frames[1], [4, 5, 6]), 1.2)  # but in time: it counts ...
    assert states(c) == [LIVE, LIVE]  # ... and it keeps up (0.2 s ≤ ½ × 1 s)
    c.decide(1.2)
    assert c.fed.rounds_with_missing_workers == 0 and c.fed.worker_rejoins == 1


def test_with_the_in_step_member_gone_the_left_out_one_carries_on() -> None:
    c = core(deadline_s=1.0, liveness_s=10.0)
    up(c)
    f0, f1 = draft(c, [2, 3], 0.0)
    c.receive(0, reply_to(c, f0, [2, 3, 4]), 0.1)
    c.decide(1.0)
    assert states(c) == [LIVE, BEHIND]
    out: list[EdgeEvent] = []
    c.link_down(0, "lost", 2.0)
    assert states(c) == [DOWN, LIVE]  # nobody left in step: the slow one is
    (g,) = draft(c, [4, 5], 2.0)
    assert g.link == 1
    c.receive(1, reply_to(c, f1, [2, 3, 4]), 5.0)
    assert not c.round_ready(5.0)  # waits for it, however slow, while it is alive
    c.receive(1, reply_to(c, g, [4, 5, 6]), 9.0)
    assert c.round_ready(9.0)
    out += acts(c, c.decide(9.0))
    assert c.gen.generated == [2, 3, 4, 5] and out == [Committed((4, 5))]


def test_when_the_fast_member_slows_down_the_members_swap_roles() -> None:
    c = core(deadline_s=1.0, max_new=100, depth=1)
    up(c)
    f0, f1 = draft(c, [2, 3], 0.0)
    c.receive(0, reply_to(c, f0, [2, 3, 4]), 0.1)
    c.decide(1.0)
    c.receive(1, reply_to(c, f1, [2, 3, 4]), 15.0)  # slow: its next probe at 30 s
    assert states(c) == [LIVE, BEHIND]
    _, g1 = draft(c, [4, 5], 30.0)  # worker 0 has become slow; worker 1 is fast now
    c.receive(1, reply_to(c, g1, [4, 5, 6]), 30.1)
    assert states(c) == [LIVE, LIVE]  # 0.1 s ≤ ½ × max(1, 4 × 0.1 s): readmitted
    assert not c.round_ready(30.9) and c.round_ready(31.0)
    assert acts(c, c.decide(31.0)) == [Committed((4, 5))]
    assert states(c) == [BEHIND, LIVE] and c.gen.generated == [2, 3, 4, 5]
    assert c.fed.left_out == 2 and c.fed.worker_drops == 0 and c.fed.worker_rejoins == 1


def test_a_round_nobody_can_answer_is_void_and_restarts_from_the_committed_ids() -> None:
    c = core(workers=1)
    up(c)
    draft(c, [2, 3], 0.0)
    out = acts(c, c.decide(10.02))  # silent past its liveness bound: dropped; the round is void
    assert [type(e) for e in out] == [Drop]
    assert c.gen.generated == [] and c.pipe.epoch == 1 and not c.pipe.inflight


def test_link_down_is_counted_once() -> None:
    c = core(workers=1)
    up(c)
    c.link_down(0, "lost", 1.0)
    assert c.link_down(0, "again", 2.0) == []  # down already: nothing more to count
    assert c.fed.worker_drops == 1 and c.none_up_since == 1.0
    assert c.receive(0, b"late", 3.0) == []  # a frame that raced the drop


# --------------------------------------------------------------------- against real verifiers


def _target_next(text: list[int]) -> int:
    """The target's greedy token after ``text`` (every member's: their aggregate's argmax)."""
    return (text[-1] * 7 + len(text)) % V


class _Member:
    """One member's verifier: a real VerifierCore and a fake model whose every forward takes
    ``speed`` seconds (the simulation's clock), reporting Progress each second meanwhile."""

    def __init__(self, c: FederatedCore, i: int) -> None:
        self.core = VerifierCore(TargetInfo(FP, V), SessionLimits(max_gamma=8), f"s{i}")
        self.model = FakeTargetModel(greedy_law(_target_next, V))
        self.work: Work | None = None
        self.done_at = 0.0
        self.replies: list[bytes] = []
        (w,) = self.act(self.core.receive(encode(c.hello(i))), 0.0, 0.0)
        welcome = decode(w)
        assert isinstance(welcome, Welcome)
        c.link_up(i, welcome, 0.0)

    def act(self, events: Sequence[VerifierEvent], now: float, speed: float) -> list[bytes]:
        out = []
        for ev in events:
            assert not isinstance(ev, Close), f"an honest edge made a verifier close: {ev}"
            if isinstance(ev, VSend):
                assert not isinstance(ev.msg, Error), ev.msg
                out.append(encode(ev.msg, self.core.ctx))
            elif isinstance(ev, Run):
                assert self.work is None
                self.work, self.done_at = ev.work, now + speed
        return out

    def finish(self, now: float, speed: float) -> list[bytes]:
        work, self.work = self.work, None
        assert work is not None
        return self.act(self.core.work_done(self.model.run(work, self.core)), now, speed)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    phases=st.lists(
        st.tuples(st.floats(1.0, 40.0), st.lists(st.sampled_from([0.05, 0.3, 3.0, 15.0]),
                                                 min_size=3, max_size=3)),
        min_size=1, max_size=4,
    ),
    hits=st.lists(st.booleans(), min_size=1, max_size=12),
    workers=st.integers(2, 3),
    depth=st.integers(1, 3),
)  # fmt: skip
# A left-out member readmitted by a reply while it still owed 4 Proposes was sent 3 new ones
# (7 > 2·D): it is readmitted only once it has caught up.
@example(
    phases=[(1.0, [3.0, 3.0, 0.05]), (15.0, [15.0, 15.0, 0.05]), (1.0, [0.3, 3.0, 0.05])],
    hits=[False],
    workers=2,
    depth=3,
)
def test_members_of_any_speed_against_real_verifiers(
    phases: list[tuple[float, list[float]]], hits: list[bool], workers: int, depth: int
) -> None:
    """Members whose forwards take 0.05–15 s, changing speed as hypothesis says, each
    reporting Progress while it works: the text is the target's, no verifier ever sees a frame
    it refuses (joining, probing, rollbacks of left-out members), nobody is dropped, a member
    never has more than 2·D Proposes unanswered, and no round waits
    for a member once another answered past the wait bound (WAIT_FACTOR × the first answer,
    or the floor)."""
    n = 60
    c = core(workers=workers, deadline_s=1.0, depth=depth, max_new=n)
    c.pipe.gen.committed[:] = [1, 2]
    c.pipe.gen.prompt_len = 2
    members = [_Member(c, i) for i in range(workers)]
    inbox: list[list[bytes]] = [[] for _ in range(workers)]  # edge → member, not yet handled
    now, drafted = 0.0, 0
    ends = np.cumsum([p[0] for p in phases])

    def speeds() -> list[float]:
        i = int(np.searchsorted(ends, now, side="right"))
        return phases[min(i, len(phases) - 1)][1]

    while not c.gen.done:
        assert now < 10_000, "the generation does not progress"
        # the edge drafts while it may
        while c.may_draft():
            plan = c.pipe.plan()
            assert plan is not None
            draft: list[int] = []
            while c.pipe.wants_more(plan, draft):
                t = _target_next([*plan.context, *draft])
                draft.append(t if hits[drafted % len(hits)] else (t + 1) % V)
                drafted += 1
            for e in acts(c, c.propose(plan, draft, [np.eye(V)[x] for x in draft], now)):
                assert isinstance(e, Send)
                inbox[e.link].append(encode(e.msg, c.ctx(e.link)))
        # members take frames while idle; model work finishes on time
        for i, m in enumerate(members):
            while True:
                if m.work is not None and now >= m.done_at:
                    m.replies += m.finish(now, speeds()[i])
                elif inbox[i] and m.work is None:
                    m.replies += m.act(m.core.receive(inbox[i].pop(0)), now, speeds()[i])
                else:
                    break
            # Its queue: at most D − 1 batches discarded by a rejection it answered the head
            # of, plus D new ones (a left-out member gets nothing more but one probe).
            assert len(c.workers[i].outstanding) <= 2 * depth
            for r in m.replies:
                assert not [e for e in c.receive(i, r, now) if isinstance(e, Drop)]
            m.replies.clear()
            if m.work is not None and now == np.floor(now):
                eta = round((m.done_at - now) * 1000)
                c.receive(i, encode(Progress(1, 0, eta), m.core.ctx), now)
        if c.pipe.inflight:
            b = c.pipe.inflight[0]
            first = c._first_reply.get(id(b))
            if first is not None and c.round_ready(now):
                waited = now - b.sent_at
                assert waited <= max(1.0, WAIT_FACTOR * (first[1] - b.sent_at)) + 0.05 + 1e-9
        if c.round_ready(now):
            for e in c.decide(now):
                assert not isinstance(e, Drop), e
                if isinstance(e, Send):
                    inbox[e.link].append(encode(e.msg, c.ctx(e.link)))
            continue
        # the next event: a forward ends, a Progress tick, a deadline (0.05 s steps at most)
        nxt = [m.done_at for m in members if m.work is not None]
        nxt += [np.floor(now) + 1.0, now + 0.05]
        if (w := c.wake_at()) is not None:
            nxt.append(max(w, now))
        now = max(now, min(nxt))
    expected = [1, 2]
    for _ in range(n):
        expected.append(_target_next(expected))
    assert c.gen.generated == expected[2:]
    assert c.fed.worker_drops == 0


def test_the_generation_is_bounded_by_the_smallest_members_context() -> None:
    """A member whose Welcome says a context of 8 tokens ends the generation with "length" at
    8 (prompt 1 + 7 new), never a Propose past it; a prompt that fills it is refused."""
    c = core(max_new=100)
    small = Welcome(FP, "s", max_gamma=8, max_fixed=1024, max_context=8, max_frame=1 << 20)
    c.link_up(0, WELCOME, 0.0)
    c.link_up(1, small, 0.0)
    assert c.gen.max_tokens == 7
    tight = FederatedCore(
        Generation([1] * 8, 4),
        PipelineConfig(gamma=2, depth=1, sampling=SamplingParams(0.0)),
        np.random.default_rng(0),
        FP,
        [WorkerParams("w0")],
    )
    with pytest.raises(ContextExceeded, match="the prompt has 8 tokens"):
        tight.link_up(0, small, 0.0)
