"""The edge's session rules (:class:`edge_agent.session.core.SingleCore`) as pure functions over
scripted
event sequences: no sockets, no models, no event loop, no sleeps. The test decides every
interleaving (when the drafter runs, when a Verdict arrives), so each sequence below is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from edge_agent.session.branches import Branch, Growing, Rival
from edge_agent.session.core import EdgeState, SingleCore
from edge_agent.session.events import Committed, Count, Counter, Fail, Finished, GenerationEvent
from edge_agent.session.generation import Generation, TokenSource
from edge_agent.session.opening import DesyncError, VerifierError, hello_for
from edge_agent.session.pipeline import DraftPlan
from edge_agent.session.pipeline_config import Mode, PipelineConfig
from shared.maths.compression import SparseDist
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import Probs, SamplingParams
from shared.wire.codec import decode, encode
from shared.wire.messages import (
    MAX_BUDGET,
    Candidates,
    Error,
    Fingerprint,
    Hedge,
    Message,
    Propose,
    Resample,
    Resumed,
    Verdict,
    Welcome,
    text_digest,
)
from tests.edge_events import sent

pytestmark = pytest.mark.fast

V = 16
FP = Fingerprint("t", V, "test")
GREEDY = SamplingParams(temperature=0.0)


def counting_draft(seq: Sequence[int], deterministic: bool) -> tuple[int, Probs]:
    """Drafts (last + 1) mod V; q is a fixed distribution peaked there (or one-hot)."""
    x = (seq[-1] + 1) % V
    q = np.full(V, 0.02)
    q[x] = 1 - 0.02 * (V - 1)
    if deterministic:
        q = np.zeros(V)
        q[x] = 1.0
    return x, q


@dataclass
class Edge:
    """A SingleCore with a synchronous drafter and a log of what it sent."""

    core: SingleCore
    sent: list[Message]
    #: What the core told the consumer (Committed, Finished), in order.
    told: list[GenerationEvent] = field(default_factory=list)

    @property
    def gen(self) -> Generation:
        return self.core.gen

    def draft_batch(self) -> bool:
        """Draft one batch if the core allows it (as the driver's draft loop would)."""
        pipe = self.core.pipe
        plan = pipe.plan()
        if plan is None:
            return False
        draft: list[int] = []
        q_rows: list[Probs] = []
        while pipe.wants_more(plan, draft):
            x, q = counting_draft(plan.context + draft, plan.deterministic)
            draft.append(x)
            q_rows.append(q)
        self._log(sent(self.core, self.core.propose(plan, draft, q_rows)))
        return True

    def fill(self) -> None:
        while self.draft_batch():
            pass

    def _log(self, frames: list[bytes]) -> None:
        self.sent += [decode(f, self.core.ctx) for f in frames]

    def head(self) -> Propose:
        """The Propose of the batch the next Verdict answers."""
        b = self.core.pipe.inflight[0]
        return next(
            m
            for m in self.sent
            if isinstance(m, Propose) and (m.seq, m.epoch) == (b.seqs[0], b.epoch)
        )

    def answer(self, accepted: int, **fields: object) -> None:
        """A Verdict for the head batch (a short last batch accepts what it has)."""
        p = self.head()
        n = min(accepted, len(p.draft))
        v = Verdict(p.epoch, p.seq, n, **fields)  # type: ignore[arg-type]
        events = self.core.receive(encode(v, self.core.ctx))
        self.told += [ev for ev in events if isinstance(ev, (Committed, Finished))]
        self._log(sent(self.core, events))

    def proposes(self) -> list[tuple[int, int, int, list[int], list[int]]]:
        """(epoch, seq, pos, fixed, draft) of every Propose, in order."""
        return [
            (m.epoch, m.seq, m.pos, m.fixed.tolist(), m.draft.tolist())
            for m in self.sent
            if isinstance(m, Propose)
        ]


def edge(cfg: PipelineConfig, max_new: int, eos: Sequence[int] = (), seed: int = 0) -> Edge:
    hello = hello_for(FP, cfg, seed)
    welcome = Welcome(FP, "s", max_gamma=16, max_fixed=1024, max_context=1024, max_frame=1 << 20)
    gen = Generation([0], max_new, eos)
    return Edge(SingleCore(gen, cfg, np.random.default_rng(seed), hello, welcome), [])


def test_the_prompt_credits_token_comes_in_one_round_trip_and_is_taken_as_co_generated() -> None:
    """The prompt goes up alone (a credit asking for its forward's token) before the first
    batch is drafted: the Verdict's token is the first of the reply, and the batches drafted
    meanwhile meet it as they would a co-generated token (agreeing: they stand; differing: the
    first is doomed there, the rest void)."""
    for token in (1, 9):
        e = edge(PipelineConfig(gamma=2, depth=2, sampling=GREEDY), max_new=8)
        e._log(sent(e.core, e.core.credit(0.0)))
        e.fill()  # A [1, 2], B [3, 4], drafted while the prompt was in flight
        assert e.proposes() == [(0, 0, 0, [0], []), (0, 1, 1, [], [1, 2]), (0, 2, 3, [], [3, 4])]
        assert e.sent[0].want_bonus  # type: ignore[attr-defined]
        e.answer(0, bonus=token)
        assert e.gen.committed == [0, token]
        if token == 1:  # agrees with A's head: A and B stand
            assert [b.doomed_at for b in e.core.pipe.inflight] == [-1, -1]
            e.answer(2)
            e.answer(2)
            assert e.gen.committed == [0, 1, 2, 3, 4]
        else:  # A is doomed at its head (the verifier rejects it there), B is void
            assert [b.doomed_at for b in e.core.pipe.inflight] == [0]
            e.answer(0, token=9)
            assert e.gen.committed == [0, 9] and e.core.pipe.epoch == 1
            e.fill()
            assert e.proposes()[-2][:4] == (1, 3, 2, [])  # next batches start after the token
        st = e.gen.stats
        assert st.bonus_tokens == 1 and st.rejections == (token != 1)


def test_pipelined_commits_rollbacks_and_discards() -> None:
    e = edge(PipelineConfig(gamma=2, depth=2, mode=Mode.PIPELINED, sampling=GREEDY), max_new=8)
    e.fill()  # A [1, 2], B [3, 4]: depth 2 reached
    assert not e.core.may_draft()
    e.answer(2)  # A accepted
    e.fill()  # C [5, 6], drafted while B is in flight
    e.answer(1, token=9)  # B: 3 accepted, 4 rejected → 9; C discarded
    assert e.core.pipe.epoch == 1 and not e.core.pipe.inflight
    e.fill()  # D [10, 11] with fixed [9]; E [12, 13]; then no room is left
    e.answer(2)  # D accepted
    e.answer(0, token=7)  # E rejected at once → 7
    e.fill()  # F [8]: the last token allowed
    e.answer(1)
    assert e.proposes() == [
        (0, 0, 0, [0], [1, 2]),
        (0, 1, 3, [], [3, 4]),
        (0, 2, 5, [], [5, 6]),
        (1, 3, 4, [9], [10, 11]),  # after the rejection: the recovered token is a fixed token
        (1, 4, 7, [], [12, 13]),
        (2, 5, 7, [7], [8]),
    ]
    gen = e.gen
    assert gen.generated == [1, 2, 3, 9, 10, 11, 7, 8]
    assert gen.finish_reason == "length" and e.core.state == EdgeState.DONE
    st = gen.stats
    assert (st.rounds, st.rejections, st.discarded_batches, st.discarded_tokens) == (5, 2, 1, 2)
    assert st.accepted_tokens == 2 + 1 + 2 + 0 + 1
    assert st.accepted_per_position == [4, 2]
    assert e.core.pipe.epoch == 2
    assert st.sources[TokenSource.EDGE_DRAFT] == 6 and st.sources[TokenSource.CORRECTION] == 2
    assert sum(st.sources.values()) == len(gen.generated)
    # The consumer is told each commit as it happens, in order, and the end once.
    assert e.told == [
        Committed((1, 2)),
        Committed((3,)),
        Committed((9,)),
        Committed((10, 11)),
        Committed((7,)),
        Committed((8,)),
        Finished("length"),
    ]


@pytest.mark.parametrize("depth", [1, 3])
def test_backpressure_never_exceeds_depth(depth: int) -> None:
    e = edge(PipelineConfig(gamma=1, depth=depth, sampling=GREEDY), max_new=12)
    most = 0
    while not e.gen.done:
        e.fill()
        most = max(most, len(e.core.pipe.inflight))
        e.answer(1)
    assert e.gen.generated == list(range(1, 13))
    assert most == depth
    assert [p[1] for p in e.proposes()] == list(range(12))  # seq numbers consecutive


def test_stop_and_wait_with_bonus_tokens() -> None:
    e = edge(PipelineConfig(gamma=3, mode=Mode.STOP_AND_WAIT, sampling=GREEDY), max_new=9)
    e.fill()
    assert len(e.core.pipe.inflight) == 1 and not e.core.may_draft()
    e.answer(3, bonus=5)
    e.fill()
    e.answer(1, token=0)
    e.fill()
    e.answer(3, bonus=9)
    assert e.proposes() == [
        (0, 0, 0, [0], [1, 2, 3]),
        (0, 1, 4, [5], [6, 7, 8]),  # the bonus token goes up as a fixed token
        (1, 2, 6, [0], [1, 2, 3]),
    ]
    assert e.gen.generated == [1, 2, 3, 5, 6, 0, 1, 2, 3]
    assert e.gen.stats.bonus_tokens == 1  # the last bonus fell past max_tokens
    # Every generated token has one source, counted where it was committed.
    assert e.gen.stats.sources == {
        TokenSource.EDGE_DRAFT: 3 + 1 + 3,
        TokenSource.CORRECTION: 1,
        TokenSource.BONUS: 1,
        TokenSource.COGENERATED: 0,
        TokenSource.CLOUD_DRAFT: 0,
        TokenSource.LOCAL_DRAFT: 0,
    }
    assert (e.gen.stats.gamma_last, e.gen.stats.gamma_sum, e.gen.stats.depth_last) == (3, 9, 1)


def test_eos_stops_drafting_and_generation() -> None:
    e = edge(PipelineConfig(gamma=4, depth=2, sampling=GREEDY), max_new=100, eos=[3])
    e.fill()
    # the drafter stops at the end-of-sequence id: one batch [1, 2, 3], and no more after it
    assert e.proposes() == [(0, 0, 0, [0], [1, 2, 3])]
    e.answer(3)
    assert e.gen.generated == [1, 2, 3] and e.gen.finish_reason == "stop"
    assert e.told == [Committed((1, 2, 3)), Finished("stop")]
    assert not e.core.may_draft()


def test_a_rejection_voids_the_plan_in_progress() -> None:
    e = edge(PipelineConfig(gamma=2, depth=2, sampling=GREEDY), max_new=20)
    e.draft_batch()
    plan = e.core.pipe.plan()
    assert plan is not None and e.core.pipe.current(plan)
    e.answer(0, token=4)  # arrives while the drafter works on ``plan``
    assert not e.core.pipe.current(plan) and not e.core.pipe.wants_more(plan, [])
    x, q = counting_draft(plan.context, True)
    assert e.core.propose(plan, [x], [q]) == []  # the stale batch is never sent


def test_topk_correction_sampled_from_residual() -> None:
    """A sparse correction whose only id with residual mass is 11: the edge must emit 11."""
    e = edge(PipelineConfig(gamma=2, depth=1, sampling=SamplingParams(1.0)), max_new=2)
    # draft q at a rejected position puts 0.7 on x and 0.02 elsewhere; p̂ = {x: 0.5, 11: 0.5}
    e.fill()
    e.answer(1, sparse=SparseDist(np.array([2, 11]), np.array([0.5, 0.5], np.float32)))
    assert e.gen.generated == [1, 11]


def _candidates_edge(depth: int) -> Edge:
    cfg = PipelineConfig(
        gamma=2, depth=depth, sampling=SamplingParams(1.0), correction=CorrectionMode.CANDIDATES
    )
    return edge(cfg, max_new=12)


# q(5) = 0.02 >= p(5) = 0.01: accepted with probability max(0, 1 − q/p) = 0
HOPELESS = SparseDist(np.array([5, 5]), np.array([0.01, 0.01], np.float32))
SURE = SparseDist(np.array([6]), np.array([1.0], np.float32))  # 1 − 0.02/1 = 0.98


def test_candidates_resample_when_all_fail_and_no_drafting_meanwhile() -> None:
    e = _candidates_edge(depth=4)
    e.fill()
    e.answer(0, candidates=HOPELESS)
    assert e.core.state == EdgeState.RECOVERING
    r = e.sent[-1]
    assert isinstance(r, Resample) and (r.epoch, r.pos) == (1, 1)
    # While the Resample round trip is pending, the drafter must not draft from a text that
    # lacks the recovered token.
    assert not e.core.may_draft() and e.core.pipe.plan() is None
    e._log(sent(e.core, e.core.receive(encode(Candidates(1, 1, HOPELESS), e.core.ctx))))
    assert isinstance(e.sent[-1], Resample) and e.gen.stats.resamples == 2
    e._log(sent(e.core, e.core.receive(encode(Candidates(1, 1, SURE), e.core.ctx))))
    assert e.core.state == EdgeState.RUNNING and e.gen.generated == [6]
    e.draft_batch()
    assert e.proposes()[-1][:4] == (1, 4, 1, [6])  # the next Propose carries it as fixed


def test_candidates_for_another_position_is_a_desync() -> None:
    e = _candidates_edge(depth=1)
    e.fill()
    e.answer(0, candidates=HOPELESS)
    with pytest.raises(DesyncError, match="Candidates for epoch 1, pos 7"):
        sent(e.core, e.core.receive(encode(Candidates(1, 7, SURE), e.core.ctx)))


@pytest.mark.parametrize(
    ("verdict", "match"),
    [
        (Verdict(0, 0, 1), "without a correction"),  # 1 of 2 accepted, no correction
        (Verdict(0, 0, 2, token=3), "with a correction"),
        (Verdict(0, 5, 2), "seq 5"),  # seq 5 was never sent
        (Verdict(1, 0, 2), "epoch 1"),
        (Verdict(0, 0, 0, sparse=SparseDist(np.array([1]), np.ones(1, np.float32))), "other"),
    ],
)
def test_verdicts_that_do_not_fit_are_desyncs(verdict: Verdict, match: str) -> None:
    """Nothing is committed from a frame that does not match the session: the batches behind
    it were drafted from the tokens it would leave out."""
    e = edge(PipelineConfig(gamma=2, depth=1, sampling=GREEDY), max_new=10)
    e.fill()
    with pytest.raises(DesyncError, match=match):
        sent(e.core, e.core.receive(encode(verdict, e.core.ctx)))
    assert e.gen.generated == []


def test_verdict_with_nothing_in_flight_and_bonus_behind_batches() -> None:
    e = edge(PipelineConfig(gamma=1, depth=2, sampling=GREEDY), max_new=10)
    with pytest.raises(DesyncError, match="nothing in flight"):
        sent(e.core, e.core.receive(encode(Verdict(0, 0, 1), e.core.ctx)))
    e = edge(PipelineConfig(gamma=1, depth=2, sampling=GREEDY), max_new=10)
    e.fill()
    with pytest.raises(DesyncError, match="bonus token while batches are in flight"):
        sent(e.core, e.core.receive(encode(Verdict(0, 0, 1, bonus=2), e.core.ctx)))


def test_a_failure_is_an_event_and_the_core_stays_failed() -> None:
    """The core raises nothing into its driver: a frame that does not fit the session is a Fail
    event, and every later feed answers the same Fail (nothing is sent, nothing committed)."""
    e = edge(PipelineConfig(gamma=1, depth=2, sampling=GREEDY), max_new=10)
    e.fill()
    committed = list(e.gen.committed)
    frame = encode(Verdict(0, 0, 1, bonus=2), e.core.ctx)
    *tallies, fail = e.core.receive(frame)
    assert tallies == [Count(Counter.DOWNLINK_BYTES, len(frame))]  # it came, all the same
    assert isinstance(fail, Fail) and isinstance(fail.error, DesyncError)
    assert e.core.state == EdgeState.FAILED and not e.core.may_draft()
    plan = e.core.pipe.plan()
    if plan is not None:
        assert e.core.propose(plan, [3], [np.eye(V)[3]]) == [fail]
    assert e.core.receive(encode(Verdict(0, 1, 1), e.core.ctx)) == [fail]
    assert e.gen.committed == committed


def test_verifier_error_frames_raise() -> None:
    e = edge(PipelineConfig(gamma=1, sampling=GREEDY), max_new=10)
    e.fill()
    with pytest.raises(VerifierError) as info:
        sent(e.core, e.core.receive(encode(Error("context_full", "full", fatal=False))))
    assert info.value.code == "context_full" and not info.value.fatal


def test_a_new_session_resumes_from_the_committed_ids() -> None:
    """After a reconnect the first Propose re-sends every committed id as fixed tokens."""
    cfg = PipelineConfig(gamma=2, depth=2, sampling=GREEDY)
    e = edge(cfg, max_new=10)
    e.fill()
    e.answer(2)  # [1, 2] committed; [3, 4] in flight when the link drops
    gen = e.gen
    hello = hello_for(FP, cfg, 1)
    welcome = Welcome(FP, "s2", max_gamma=16, max_fixed=1024, max_context=1024, max_frame=1 << 20)
    again = Edge(SingleCore(gen, cfg, np.random.default_rng(1), hello, welcome), [])
    again.fill()
    assert again.proposes()[0] == (0, 0, 0, [0, 1, 2], [3, 4])
    assert gen.generated == [1, 2]
    assert again.core.opened() == []  # a new session: nothing resumed


def test_a_resumed_session_reports_the_tokens_its_verifier_kept() -> None:
    """A resumed session's next Propose starts where the verifier's cache ends; the tokens kept
    are reported once, at the opening (the driver counts them), not written by the core."""
    cfg = PipelineConfig(gamma=2, depth=2, sampling=GREEDY)
    gen = Generation([0, 1, 2], 10)
    kept = Resumed(2, text_digest([0, 1]))
    welcome = Welcome(FP, "s", 16, 1024, 1024, 1 << 20, resume="r", resumed=kept)
    core = SingleCore(gen, cfg, np.random.default_rng(0), hello_for(FP, cfg, 0), welcome)
    assert core.opened() == [Count(Counter.RESUMED_TOKENS, 2)] and core.opened() == []
    assert core.wire.verifier_len == 2 and gen.stats.resumed_tokens == 0


def _batch_with_rivals(e: Edge, draft: list[int], rivals: list[tuple[int, float]]) -> None:
    """Send one batch of ``draft`` with the given (rival, confidence) per token."""
    plan = e.core.pipe.plan()
    assert plan is not None
    q_rows = [counting_draft([x - 1], True)[1] for x in draft]
    rv = [Rival(t, c) for t, c in rivals]
    e._log(sent(e.core, e.core.propose(plan, draft, q_rows, rivals=rv)))


def _branch(e: Edge, tokens: list[int]) -> tuple[int, int]:
    """Plan the next outcome and keep ``tokens`` as its branch; returns its (pos, token)."""
    pp = e.core.pipe.book.predraft_plan()
    assert pp is not None
    rows = [counting_draft([t - 1], True)[1] for t in tokens]
    for count in e.core.pipe.book.add_branch(Growing(pp, tokens, rows, [], 0.9)):
        e.gen.stats.apply(count)
    return pp.pos, pp.token


def test_predrafted_outcomes_are_planned_likeliest_first_and_sent_on_a_hit() -> None:
    """Pre-drafting: while the batch is in flight the pipeline plans outcomes where the first
    rejection is likeliest first (c_1 ⋯ c_{i−1} (1 − c_i): 0.54 at the second token here, 0.144
    at the third, 0.1 at the first; the rival after the text before it), keeps at most
    ``predraft`` branches, and a rejection whose correction opens a branch sends it as the next
    batch at once (no draft step); a correction that opens none drops the branches it left."""
    cfg = PipelineConfig(gamma=3, depth=1, sampling=GREEDY, cogen=False, predraft=2)
    e = edge(cfg, max_new=12)
    _batch_with_rivals(e, [1, 2, 3], [(9, 0.9), (10, 0.4), (11, 0.6)])
    assert not e.core.may_draft()
    pp = e.core.pipe.book.predraft_plan()
    assert pp is not None and (pp.pos, pp.token, pp.context, pp.max_tokens) == (2, 10, [0, 1], 3)
    rows = [counting_draft([t - 1], True)[1] for t in [5, 6, 7]]
    rivals = [Rival(8, 0.5), Rival(9, 0.7), Rival(9, 0.8)]
    counts = e.core.pipe.book.add_branch(Growing(pp, [5, 6, 7], rows, rivals, 0.9))
    assert counts == [Count(Counter.PREDRAFT_BRANCHES), Count(Counter.PREDRAFT_TOKENS, 3)]
    for count in counts:
        e.gen.stats.apply(count)
    assert _branch(e, [12, 13]) == (3, 11)  # next likeliest first rejection: 0.9 · 0.4 · 0.4
    assert e.core.pipe.book.predraft_plan() is None  # two branches kept: the budget
    got = e.core.receive(encode(Verdict(0, 0, 1, token=10), e.core.ctx), now=5.0)  # 2: 10
    assert e.gen.committed == [0, 1, 10]
    # the rejection found its branch ready: a hit (whoever then uses it)
    assert Count(Counter.PREDRAFT_HITS) in got
    for ev in got:
        if isinstance(ev, Count):
            e.gen.stats.apply(ev)
    plan = e.core.pipe.plan()
    assert plan is not None
    ready, counts = e.core.pipe.book.take_branch(plan)
    assert ready is not None and ready.draft == [5, 6, 7] and len(ready.q_rows) == 3
    assert counts == [Count(Counter.PREDRAFT_USED_TOKENS, 3)]
    for count in counts:
        e.gen.stats.apply(count)
    e._log(
        sent(e.core, e.core.propose(plan, ready.draft, ready.q_rows, now=5.25, rivals=ready.rivals))
    )
    assert e.proposes()[-1] == (1, 1, 2, [10], [5, 6, 7])  # the branch, behind the correction
    st = e.gen.stats
    assert (st.predraft_branches, st.predraft_tokens, st.predraft_hits) == (2, 5, 1)
    assert st.predraft_used_tokens == 3 and st.rejection_gaps == 1
    assert st.rejection_gap_s == pytest.approx(0.25)
    assert not e.core.pipe.book.branches  # the other one's context left the text: dropped
    # A correction that opens no branch: none taken, the plan drafts as usual.
    assert _branch(e, [8]) == (3, 8)  # the likeliest first rejection in [5, 6, 7]: its rival
    e.answer(0, token=14)
    plan = e.core.pipe.plan()
    assert plan is not None and e.core.pipe.book.take_branch(plan) == (None, [])
    assert not e.core.pipe.book.branches


def test_each_rejection_no_branch_answers_is_counted_with_why() -> None:
    """Pre-drafting's misses, by reason: the correction was not among the draft's known
    alternatives; it was, but the branch budget was full (the cap); it was, with room, but no
    branch was ready (time). A rejection a branch answers counts no miss (a hit, once taken)."""

    def miss(correction: int, branches: int, predraft: int = 2) -> tuple[int, int, int]:
        cfg = PipelineConfig(gamma=3, depth=1, sampling=GREEDY, cogen=False, predraft=predraft)
        e = edge(cfg, max_new=12)
        _batch_with_rivals(e, [1, 2, 3], [(9, 0.9), (10, 0.4), (11, 0.6)])
        for k in range(branches):  # planned likeliest first: (2, 10), then (3, 11)
            _branch(e, [20 + k])
        verdict = encode(Verdict(0, 0, 1, token=correction), e.core.ctx)
        e._log(sent(e.core, e.core.receive(verdict, now=5.0)))
        assert e.gen.committed == [0, 1, correction]
        st = e.gen.stats
        return st.predraft_miss_not_alternative, st.predraft_miss_cap, st.predraft_miss_time

    assert miss(10, branches=1) == (0, 0, 0)  # its branch is there: a hit, not a miss
    assert miss(12, branches=1) == (1, 0, 0)  # 12 was never an alternative at position 2
    assert miss(10, branches=0) == (0, 0, 1)  # an alternative, room left, not prepared yet
    # The budget (one branch, spent at position 3) left no room for position 2's alternative.
    cfg = PipelineConfig(gamma=3, depth=1, sampling=GREEDY, cogen=False, predraft=1)
    e = edge(cfg, max_new=12)
    _batch_with_rivals(e, [1, 2, 3], [(9, 0.9), (10, 0.4), (11, 0.6)])
    pp = e.core.pipe.book.predraft_plan()
    assert pp is not None and (pp.pos, pp.token) == (2, 10)
    e.core.pipe.book._predrafted.at(e.core.pipe.version).discard((2, 10))  # as if never planned
    rows = [counting_draft([t - 1], True)[1] for t in [7]]
    e.core.pipe.book.branches.append(Branch([0, 1, 2, 11], [7], rows, [], 0.9))
    e._log(sent(e.core, e.core.receive(encode(Verdict(0, 0, 1, token=10), e.core.ctx), now=5.0)))
    st = e.gen.stats
    assert (st.predraft_miss_not_alternative, st.predraft_miss_cap, st.predraft_miss_time) == (
        0,
        1,
        0,
    )


def test_a_branch_still_growing_at_its_rejection_is_a_hit_if_taken_else_a_miss_for_time() -> None:
    """The correction's branch was planned but not kept yet when the verdict came: if it is
    kept and taken for the next batch, that is a hit and no miss; if the next batch is drafted
    without it, a miss for time. Either way hits + misses = rejections."""
    for in_time in (True, False):
        cfg = PipelineConfig(gamma=3, depth=1, sampling=GREEDY, cogen=False, predraft=2)
        e = edge(cfg, max_new=12)
        _batch_with_rivals(e, [1, 2, 3], [(9, 0.9), (10, 0.4), (11, 0.6)])
        pp = e.core.pipe.book.predraft_plan()
        assert pp is not None and (pp.pos, pp.token) == (2, 10)
        e._log(sent(e.core, e.core.receive(encode(Verdict(0, 0, 1, token=10), e.core.ctx))))
        if in_time:
            rows = [counting_draft([t - 1], True)[1] for t in [5, 6]]
            for count in e.core.pipe.book.add_branch(Growing(pp, [5, 6], rows, [], 0.9)):
                e.gen.stats.apply(count)
        plan = e.core.pipe.plan()
        assert plan is not None
        ready, counts = e.core.pipe.book.take_branch(plan)
        for count in counts:
            e.gen.stats.apply(count)
        draft = ready.draft if ready is not None else [7]
        rows = [counting_draft([t - 1], True)[1] for t in draft]
        e._log(sent(e.core, e.core.propose(plan, draft, rows)))
        st = e.gen.stats
        misses = st.predraft_miss_not_alternative + st.predraft_miss_cap + st.predraft_miss_time
        assert (st.predraft_hits, misses, st.rejections) == ((1, 0, 1) if in_time else (0, 1, 1))
        assert st.predraft_miss_time == (0 if in_time else 1)


def test_a_prepared_branch_goes_to_the_verifier_as_a_hedge_only_where_trees_apply() -> None:
    """Token trees: a branch being prepared is sent as a Hedge at its position (the verifier
    takes the newest version of it); nothing with trees off, without co-generation, or once
    the branch's context has left the text."""
    cfg = PipelineConfig(gamma=3, depth=1, sampling=GREEDY, predraft=2, tree=True)
    e = edge(cfg, max_new=12)
    _batch_with_rivals(e, [1, 2, 3], [(9, 0.9), (10, 0.4), (11, 0.6)])
    pp = e.core.pipe.book.predraft_plan()
    assert pp is not None and (pp.pos, pp.token) == (2, 10)
    (frame,) = sent(e.core, e.core.tree_branch(pp, [5, 6]))
    h = decode(frame, e.core.ctx)
    assert isinstance(h, Hedge) and (h.pos, h.token, h.draft.tolist()) == (2, 10, [5, 6])
    st = e.gen.stats
    assert st.hedges_sent == 1 and st.hedge_bytes == len(frame) and st.uplink_bytes > len(frame)
    e.answer(0, token=12)  # the text leaves the branch (12, not 10, at 2)
    assert e.core.tree_branch(pp, [5, 6, 7]) == []
    for off in (
        PipelineConfig(gamma=3, depth=1, sampling=GREEDY, predraft=2),
        PipelineConfig(gamma=3, depth=1, sampling=GREEDY, predraft=2, tree=True, cogen=False),
    ):
        e = edge(off, max_new=12)
        _batch_with_rivals(e, [1, 2, 3], [(9, 0.9), (10, 0.4), (11, 0.6)])
        pp = e.core.pipe.book.predraft_plan()
        assert pp is not None and e.core.tree_branch(pp, [5]) == []
    with pytest.raises(ValueError, match="needs predraft"):
        PipelineConfig(tree=True)


def test_predrafting_ranks_every_alternative_by_its_chance_to_be_the_first_correction() -> None:
    """With the draft's alternatives (``Rival.alts``), outcomes are planned by
    c_1 ⋯ c_{i−1} · q_i(y): several per position, interleaved across positions; a correction
    that is a second alternative still finds its branch."""
    cfg = PipelineConfig(gamma=3, depth=1, sampling=GREEDY, cogen=False, predraft=8)
    e = edge(cfg, max_new=12)
    plan = e.core.pipe.plan()
    assert plan is not None
    rivals = [
        Rival(9, 0.9, ((9, 0.06), (8, 0.04))),
        Rival(10, 0.4, ((10, 0.3), (11, 0.2), (12, 0.1))),
        Rival(13, 0.6, ((13, 0.3),)),
    ]
    q_rows = [counting_draft([x - 1], True)[1] for x in [1, 2, 3]]
    e._log(sent(e.core, e.core.propose(plan, [1, 2, 3], q_rows, rivals=rivals)))
    # 0.9·0.3, 0.9·0.2, 0.9·0.4·0.3, 0.9·0.1, 0.06, 0.04
    order = [_branch(e, [20 + k]) for k in range(6)]
    assert order == [(2, 10), (2, 11), (3, 13), (2, 12), (1, 9), (1, 8)]
    assert e.core.pipe.book.predraft_plan() is None  # every alternative has its branch
    e.core.receive(encode(Verdict(0, 0, 1, token=11), e.core.ctx), now=5.0)
    assert e.gen.committed == [0, 1, 11]
    plan = e.core.pipe.plan()
    assert plan is not None
    ready, _ = e.core.pipe.book.take_branch(plan)
    assert ready is not None and ready.draft == [21]


def test_a_branch_whose_head_was_co_generated_sends_the_rest() -> None:
    """Co-generated tokens committed after the correction that agree with a branch's head: the
    branch's rest is the next batch; ones that disagree drop it."""
    cfg = PipelineConfig(gamma=3, depth=1, sampling=GREEDY, predraft=4)
    e = edge(cfg, max_new=12)
    rows = [counting_draft([t - 1], True)[1] for t in [5, 6, 7]]
    pipe = e.core.pipe
    pipe.book.branches.append(Branch([0, 1], [5, 6, 7], rows, [], 0.9))
    plan = DraftPlan(epoch=0, context=[0, 1, 5], max_tokens=3, deterministic=True)
    e.gen.commit([1, 5], TokenSource.COGENERATED)
    ready, _ = pipe.book.take_branch(plan)
    assert ready is not None and ready.draft == [6, 7] and ready.context == [0, 1, 5]
    pipe.book.branches.append(Branch([0, 1, 5], [8, 9], rows[:2], [], 0.9))
    e.gen.commit([6], TokenSource.COGENERATED)  # disagrees with 8
    plan = DraftPlan(epoch=0, context=[0, 1, 5, 6], max_tokens=3, deterministic=True)
    assert pipe.book.take_branch(plan) == (None, []) and not pipe.book.branches


def test_the_verifiers_draft_budget_bounds_each_batch_not_the_pipeline() -> None:
    """Verdict.budget: the edge drafts no batch longer than that (rounds shorten), and keeps
    its pipeline as deep as before (a short round queued for every step), until a larger
    budget comes."""
    e = edge(PipelineConfig(gamma=4, depth=3, sampling=GREEDY), max_new=60)
    e.fill()  # three batches of 4: the budget unbounded
    assert [len(b.draft) for b in e.core.pipe.inflight] == [4, 4, 4]
    e.answer(4, budget=2)
    e.fill()  # the batch drafted now is of 2
    assert [len(b.draft) for b in e.core.pipe.inflight] == [4, 4, 2]
    e.answer(4)
    e.answer(4)
    e.fill()  # three batches of 2 in flight: as deep as before
    assert [len(b.draft) for b in e.core.pipe.inflight] == [2, 2, 2]
    e.answer(2, budget=MAX_BUDGET)
    e.fill()
    assert [len(b.draft) for b in e.core.pipe.inflight] == [2, 2, 4]


def test_a_cut_round_commits_the_verified_tokens_and_the_bonus_and_voids_the_rest() -> None:
    """accepted < γ with a bonus and no correction: the verifier's ration verified only the
    first ``accepted`` tokens; the bonus follows them, the rest and the batches behind go."""
    e = edge(PipelineConfig(gamma=3, depth=2, sampling=GREEDY), max_new=20)
    e.fill()  # A [1, 2, 3], B [4, 5, 6]
    e.answer(1, bonus=9, budget=2)
    assert e.gen.committed == [0, 1, 9]
    assert e.core.pipe.epoch == 1 and not e.core.pipe.inflight
    st = e.gen.stats
    assert (st.cut_rounds, st.cut_tokens, st.rejections, st.discarded_batches) == (1, 2, 0, 1)
    assert st.bonus_tokens == 1 and st.draft_tokens == 1  # only what was judged
    e.fill()  # batches of 2 (the budget) after the bonus, sent as a fixed token
    assert e.proposes()[-2:] == [(1, 2, 2, [9], [10, 11]), (1, 3, 5, [], [12, 13])]
