"""The verifier's session rules (:class:`cloud_verifier.session.core.VerifierCore`) as pure
functions:
one case per row of its state table. No sockets, no model, no event loop."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from cloud_verifier.engine.work import (
    BranchTaken,
    CoGenerate,
    Crop,
    Cropped,
    Draw,
    Drawn,
    Failed,
    FailureKind,
    Federate,
    Federated,
    Skipped,
    Verified,
    Verify,
    Withheld,
)
from cloud_verifier.session.cloud_draft import CloudDraft, DraftLength
from cloud_verifier.session.cogeneration import TokenCounts
from cloud_verifier.session.core import VerifierCore
from cloud_verifier.session.events import (
    CLOSE_INTERNAL_ERROR,
    CLOSE_OK,
    Close,
    CoreState,
    Event,
    Note,
    NoteKind,
    Run,
    Send,
)
from cloud_verifier.session.limits import SessionLimits, TargetInfo
from shared.errors import ErrorCode
from shared.maths.compression import SparseDist
from shared.maths.rejection import CorrectionMode, Decision
from shared.maths.sampling import SamplingParams
from shared.wire.codec import encode
from shared.wire.messages import (
    Candidates,
    Error,
    FederatedReply,
    Fingerprint,
    Generated,
    Hedge,
    Hello,
    Logprobs,
    Propose,
    ReplyMode,
    Resample,
    Rollback,
    Verdict,
    Welcome,
)
from shared.wire.packing import WireContext

pytestmark = pytest.mark.fast

V = 64
NGRAM = frozenset({CloudDraft.NGRAM})
FP = Fingerprint("t", V, "test")
SD = SparseDist(np.array([3]), np.ones(1, np.float32))
GREEDY = SamplingParams(0.0)


def opened(
    reply: ReplyMode = ReplyMode.VERDICT,
    correction: CorrectionMode = CorrectionMode.GREEDY_DRAFT,
    **limits: int,
) -> VerifierCore:
    core = VerifierCore(TargetInfo(FP, V, max_length=64), SessionLimits(**limits), "s1")
    ev = core.receive(encode(Hello(FP, SamplingParams(0.0), reply, correction)))
    assert isinstance(ev[-1], Send) and isinstance(ev[-1].msg, Welcome)
    assert core.state == CoreState.OPEN and core.max_context == 64
    return core


def ctx(core: VerifierCore) -> WireContext:
    assert core.ctx is not None
    return core.ctx


def propose(
    core: VerifierCore,
    epoch: int,
    seq: int,
    pos: int,
    draft: list[int],
    fixed: tuple[int, ...] | list[int] = (),
) -> bytes:
    q = np.ones(len(draft), np.float32)
    p = Propose(epoch, seq, pos, np.array(draft), q, np.array(fixed, np.int64))
    return encode(p, ctx(core))


def errors(events: list[Event]) -> list[str]:
    return [e.msg.code for e in events if isinstance(e, Send) and isinstance(e.msg, Error)]


def run_of(events: list[Event]) -> Run:
    (r,) = [e for e in events if isinstance(e, Run)]
    return r


# ------------------------------------------------------------------------------ handshake


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"\x00junk", "bad_handshake"),
        ("text", "bad_handshake"),
        (encode(Error("x", "y")), "bad_handshake"),
        (encode(Hello(Fingerprint("other", V, "o"))), "fingerprint_mismatch"),
        (encode(Hello(FP, k=10**6)), "bad_hello"),
        (encode(Hello(FP, reply_mode=ReplyMode.FEDERATED, logprobs=2)), "bad_hello"),
    ],
)
def test_hello_state_refuses_anything_but_a_compatible_hello(frame: bytes | str, code: str) -> None:
    core = VerifierCore(TargetInfo(FP, V), SessionLimits(), "s1")
    ev = core.receive(frame)
    assert core.closed
    assert isinstance(ev[0], Note) and ev[0].kind == NoteKind.REFUSED
    assert isinstance(ev[-1], Close) and ev[-1].error.code == code and ev[-1].error.fatal
    assert core.receive(frame) == []  # CLOSED: nothing more


# ------------------------------------------------------------------------------ Propose


def test_valid_propose_runs_verify_and_the_verdict_moves_the_session() -> None:
    core = opened()
    ev = core.receive(propose(core, 0, 0, 0, [5, 6, 7], fixed=[1, 2]))
    work = run_of(ev).work
    assert isinstance(work, Verify) and core.state == CoreState.BUSY
    # Full acceptance: the next Propose starts after fixed + draft.
    out = core.work_done(Verified(Decision(3)))
    assert isinstance(out[0], Send) and isinstance(out[0].msg, Verdict)
    assert (core.next_pos, core.cache_len, core.epoch, core.expected_seq) == (5, 5, 0, 1)
    # A rejection: the accepted prefix stays, the epoch moves on.
    core.receive(propose(core, 0, 1, 5, [8, 9]))
    core.work_done(Verified(Decision(1, token=4)))
    assert (core.next_pos, core.epoch) == (6, 1) and core.state == CoreState.OPEN


def test_logprobs_go_out_before_the_frames_that_commit_their_tokens() -> None:
    """A result's Logprobs (pos 0 = its first accepted token) is placed at that token's
    position and sent before the Verdict (or the Generated frames) that commit them."""
    core = opened()
    core.receive(propose(core, 0, 0, 0, [5, 6, 7], fixed=[1, 2]))
    lp = Logprobs(0, np.array([5, 9]), np.array([-0.5, -1.5], np.float32))
    out = core.work_done(Verified(Decision(1, token=9), logprobs=lp))
    sent = [e.msg for e in out if isinstance(e, Send)]
    assert [type(m) for m in sent] == [Logprobs, Verdict]
    assert isinstance(sent[0], Logprobs) and sent[0].pos == 2  # the draft starts after [1, 2]
    # the next batch, behind the verifier's own correction at 3: a full acceptance at 4..5
    core.receive(propose(core, 1, 1, 3, [3, 4], fixed=[9]))
    out = core.work_done(Verified(Decision(2), logprobs=replace(lp, ids=np.array([3, 4]))))
    sent = [e.msg for e in out if isinstance(e, Send)]
    assert isinstance(sent[0], Logprobs) and sent[0].pos == 4
    assert isinstance(sent[1], Verdict) and sent[1].accepted == 2


@pytest.mark.parametrize(
    ("epoch", "seq", "pos", "fixed", "code"),
    [
        (0, 3, 0, [1], "bad_seq"),
        (1, 0, 0, [1], "bad_epoch"),
        (0, 0, 2, [1], "bad_pos"),
        (0, 0, 0, [], "bad_pos"),  # pos 0 needs the prompt
    ],
)
def test_propose_refusals(epoch: int, seq: int, pos: int, fixed: list[int], code: str) -> None:
    core = opened()
    ev = core.receive(propose(core, epoch, seq, pos, [5], fixed))
    assert errors(ev) == [code] and core.bad_frames == 1 and core.state == CoreState.OPEN
    assert not any(isinstance(e, Run) for e in ev)


def test_stale_propose_is_dropped_without_work_and_consumes_its_seq() -> None:
    core = opened()
    core.receive(propose(core, 0, 0, 0, [5, 6], [1]))
    core.work_done(Verified(Decision(0, token=3)))  # epoch 1
    ev = core.receive(propose(core, 0, 1, 3, [7]))  # pipelined before the rejection was seen
    assert ev == [Note(NoteKind.STALE)] and core.expected_seq == 2 and core.bad_frames == 0


def test_context_full_is_an_error_not_a_bad_frame() -> None:
    core = opened()
    ev = core.receive(propose(core, 0, 0, 0, [5, 6], list(range(1, 64))))
    assert errors(ev) == ["context_full"] and core.bad_frames == 0


def test_frames_while_busy_are_queued_then_handled_in_order() -> None:
    core = opened(max_queued=2)
    core.receive(propose(core, 0, 0, 0, [5, 6], [1]))
    assert core.receive(propose(core, 0, 1, 3, [7])) == []  # queued behind the running work
    assert core.receive(propose(core, 0, 2, 4, [8])) == []
    assert errors(core.receive(propose(core, 0, 3, 5, [9]))) == ["queue_full"]
    # The first batch is rejected: the queued ones are of an old epoch by the time they run.
    out = core.work_done(Verified(Decision(0, token=3)))
    assert [type(e).__name__ for e in out] == ["Send", "Note", "Note"]
    assert all(isinstance(e, Note) and e.kind == NoteKind.STALE for e in out[1:])


def _verdicts(events: list[Event]) -> list[Verdict]:
    return [e.msg for e in events if isinstance(e, Send) and isinstance(e.msg, Verdict)]


def _busy_with_two_queued(**limits: int) -> VerifierCore:
    """Batch 0 runs; batches 1 (draft 7, 8) and 2 (draft 9, 10) queue behind it."""
    core = opened(**limits)
    core.receive(propose(core, 0, 0, 0, [5, 6], [1]))
    assert core.receive(propose(core, 0, 1, 3, [7, 8])) == []
    assert core.receive(propose(core, 0, 2, 5, [9, 10])) == []
    return core


def test_queued_proposes_that_continue_are_coalesced_into_one_verify() -> None:
    core = _busy_with_two_queued()
    out = core.work_done(Verified(Decision(2)))  # batch 0 accepted in full
    work = run_of(out).work
    assert isinstance(work, Verify) and [p.seq for p in work.segments] == [1, 2]
    assert work.draft.tolist() == [7, 8, 9, 10] and len(work.q) == 4 and len(work.fixed) == 0
    assert core.expected_seq == 3  # both seqs consumed, in order
    # all four accepted: one Verdict per batch, the last one's decision on the last
    out = core.work_done(Verified(Decision(4)))
    assert [(v.seq, v.accepted, v.token) for v in _verdicts(out)] == [(1, 2, None), (2, 2, None)]
    assert (core.next_pos, core.epoch) == (7, 0)


@pytest.mark.parametrize(
    ("accepted", "verdicts", "stale", "next_pos"),
    [
        (1, [(1, 1, 4)], 1, 4),  # rejected in the first batch: the second is of an old epoch
        (2, [(1, 2, None), (2, 0, 4)], 0, 5),  # rejected at the second's first token
        (3, [(1, 2, None), (2, 1, 4)], 0, 6),  # rejected inside the second
    ],
)
def test_a_coalesced_rejection_answers_each_batch_up_to_it(
    accepted: int, verdicts: list[tuple[int, int, int | None]], stale: int, next_pos: int
) -> None:
    core = _busy_with_two_queued()
    core.work_done(Verified(Decision(2)))
    out = core.work_done(Verified(Decision(accepted, token=4)))
    got = [(v.seq, v.accepted, v.token) for v in _verdicts(out)]
    assert got == verdicts
    assert sum(isinstance(e, Note) and e.kind == NoteKind.STALE for e in out) == stale
    assert (core.next_pos, core.cache_len, core.epoch) == (next_pos, next_pos, 1)
    # the edge goes on in the new epoch
    assert isinstance(run_of(core.receive(propose(core, 1, 3, next_pos, [11], [4]))).work, Verify)


def test_what_is_not_coalesced() -> None:
    """A follower with fixed tokens, at another position, of another epoch, behind a bonus
    request, past max_coalesced or with coalescing off runs on its own."""
    cases: list[tuple[dict[str, int], list[int], int]] = [
        ({}, [2], 5),  # fixed tokens (a correction or a bonus coming back)
        ({}, [], 6),  # not where batch 1 ends
        ({"max_coalesced": 3}, [], 5),  # 2 + 2 > 3
        ({"max_coalesced": 0}, [], 5),  # off
    ]
    for limits, fixed, pos in cases:
        core = opened(**limits)
        core.receive(propose(core, 0, 0, 0, [5, 6], [1]))
        core.receive(propose(core, 0, 1, 3, [7, 8]))
        core.receive(propose(core, 0, 2, pos, [9, 10], fixed))
        work = run_of(core.work_done(Verified(Decision(2)))).work
        assert isinstance(work, Verify) and work.more == (), (limits, fixed, pos)


def test_federated_propose_runs_federate() -> None:
    core = opened(ReplyMode.FEDERATED)
    work = run_of(core.receive(propose(core, 0, 0, 0, [5], [1]))).work
    assert isinstance(work, Federate)
    out = core.work_done(Federated((SD, SD), np.ones(1, np.float32), None))
    assert isinstance(out[0], Send) and isinstance(out[0].msg, FederatedReply)
    assert core.next_pos == 2 and core.epoch == 0


# ------------------------------------------------------------------------------ Rollback


def test_rollback_crops_and_enters_its_epoch() -> None:
    core = opened(ReplyMode.FEDERATED)
    core.receive(propose(core, 0, 0, 0, [5, 6], [1]))
    core.work_done(Federated((SD, SD, SD), np.ones(2, np.float32), None))
    work = run_of(core.receive(encode(Rollback(1, 2), ctx(core)))).work
    assert work == Crop(2) and (core.epoch, core.next_pos) == (1, 2)
    assert core.work_done(Cropped()) == [] and core.cache_len == 2


@pytest.mark.parametrize(("epoch", "pos"), [(0, 0), (1, 5)])
def test_bad_rollbacks(epoch: int, pos: int) -> None:
    core = opened()
    assert errors(core.receive(encode(Rollback(epoch, pos), ctx(core)))) == ["bad_rollback"]


# ------------------------------------------------------------------------------ Resample


def test_resample_draws_for_the_pending_correction_a_bounded_number_of_times() -> None:
    core = opened(correction=CorrectionMode.CANDIDATES, max_resamples=1)
    core.receive(propose(core, 0, 0, 0, [5, 6], [1]))
    core.work_done(Verified(Decision(0, candidates=SD), kept_row=True))
    ask = encode(Resample(1, 1), ctx(core))
    work = run_of(core.receive(ask)).work
    assert work == Draw(1, 1, 8)
    out = core.work_done(Drawn(SD))
    assert isinstance(out[0], Send) and out[0].msg == Candidates(1, 1, SD)
    assert errors(core.receive(ask)) == ["bad_resample"]  # more than max_resamples


def test_resample_without_a_pending_correction() -> None:
    core = opened(correction=CorrectionMode.CANDIDATES)
    assert errors(core.receive(encode(Resample(0, 0), ctx(core)))) == ["bad_resample"]


# ------------------------------------------------------------------------------ the rest


def test_edge_errors() -> None:
    core = opened()
    ev = core.receive(encode(Error("x", "note", fatal=False), ctx(core)))
    # Counted as a bad frame, with no reply (an honest edge never sends one).
    assert ev == [Note(NoteKind.EDGE_ERROR, "x: note"), Note(NoteKind.BAD_FRAME, "edge_error")]
    assert core.bad_frames == 1 and not core.closed
    ev = core.receive(encode(Error("y", "bye", fatal=True), ctx(core)))
    assert core.closed and isinstance(ev[-1], Close) and ev[-1].code == CLOSE_OK


def test_undecodable_and_wrong_direction_frames_are_bad_frames() -> None:
    core = opened()
    assert errors(core.receive(b"\xc1")) == ["bad_frame"]
    assert errors(core.receive("text")) == ["bad_frame"]
    assert errors(core.receive(encode(Verdict(0, 0, 1), ctx(core)))) == ["bad_frame"]


def test_max_bad_frames_closes_the_session() -> None:
    core = opened(max_bad_frames=3)
    for _ in range(2):
        assert errors(core.receive(b"\xc1")) == ["bad_frame"]
    ev = core.receive(b"\xc1")
    assert core.closed and isinstance(ev[-1], Close)
    assert ev[-1].error.code == "too_many_bad_frames"


def test_model_failure_is_fatal_only_when_the_cache_was_not_restored() -> None:
    core = opened()
    core.receive(propose(core, 0, 0, 0, [5], [1]))
    ev = core.work_done(Failed("RuntimeError: boom", 0, FailureKind.MODEL))
    assert errors(ev) == ["model_error"] and not core.closed
    sent = [e.msg for e in ev if isinstance(e, Send)]
    assert isinstance(sent[0], Error) and sent[0].message == "model: RuntimeError: boom"
    core.receive(propose(core, 0, 1, 0, [5], [1]))
    ev = core.work_done(Failed("boom", 2, FailureKind.MODEL))
    assert core.closed and isinstance(ev[-1], Close) and ev[-1].code == CLOSE_INTERNAL_ERROR


def test_work_done_without_work_is_a_driver_bug() -> None:
    with pytest.raises(RuntimeError):
        opened().work_done(Cropped())


def test_a_flood_of_edge_errors_closes_the_session() -> None:
    core = opened(max_bad_frames=3)
    frame = encode(Error("x", "y" * 100, fatal=False), ctx(core))
    for _ in range(2):
        assert not any(isinstance(e, (Send, Close)) for e in core.receive(frame))
    assert isinstance(core.receive(frame)[-1], Close) and core.closed


def test_stale_proposes_beyond_one_window_per_epoch_are_bad_frames() -> None:
    core = opened(max_stale_per_epoch=3, max_bad_frames=100)
    core.receive(propose(core, 0, 0, 0, [5, 6], [1]))
    core.work_done(Verified(Decision(0, token=3)))  # epoch 1
    seq = 1
    for _ in range(3):
        assert core.receive(propose(core, 0, seq, 3, [7])) == [Note(NoteKind.STALE)]
        seq += 1
    assert errors(core.receive(propose(core, 0, seq, 3, [7]))) == ["stale_flood"]
    # A new epoch opens a new window.
    core.receive(propose(core, 1, seq + 1, 1, [7], [3]))
    core.work_done(Verified(Decision(0, token=4)))
    assert core.receive(propose(core, 1, seq + 2, 3, [7])) == [Note(NoteKind.STALE)]


def test_an_idle_session_is_closed_at_its_deadline() -> None:
    core = VerifierCore(TargetInfo(FP, V), SessionLimits(idle_timeout_s=30.0), "s1")
    core.receive(encode(Hello(FP, SamplingParams(0.0))), now=100.0)
    assert core.idle_deadline() == 130.0 and core.expire(129.9) == []
    # Work pushes the deadline back; while it runs there is none.
    core.receive(propose(core, 0, 0, 0, [5], [1]), now=120.0)
    assert core.idle_deadline() is None
    core.work_done(Verified(Decision(1)), now=125.0)
    assert core.idle_deadline() == 155.0
    # Pings, bad frames and stale frames are not work.
    core.receive(b"\xc1", now=150.0)
    ev = core.expire(155.0)
    assert core.closed and isinstance(ev[-1], Close) and ev[-1].error.code == "idle_timeout"
    assert core.idle_deadline() is None


def test_idle_timeout_zero_never_expires() -> None:
    core = VerifierCore(TargetInfo(FP, V), SessionLimits(idle_timeout_s=0), "s1")
    core.receive(encode(Hello(FP, SamplingParams(0.0))), now=0.0)
    assert core.idle_deadline() is None and core.expire(1e9) == []


# ------------------------------------------------------------------------------ co-generation


def test_a_silent_edge_holds_bounded_cogeneration_and_then_times_out() -> None:
    """An edge that asks for co-generation and then stops talking gets at most
    ``max_cogen_ahead`` tokens past its last Propose; co-generation is not its activity, so the
    idle deadline still runs from its last frame and then frees the slot."""
    core = VerifierCore(
        TargetInfo(FP, V, max_length=64),
        SessionLimits(max_cogen_ahead=3, idle_timeout_s=5.0),
        "s1",
    )
    core.receive(encode(Hello(FP, SamplingParams(0.0), cogen_end=60)))
    ev = core.receive(propose(core, 0, 0, 0, [7], fixed=[1, 2]), now=1.0)
    ev = core.work_done(Verified(Decision(1)), now=1.5)  # [7] accepted: the cache holds 3
    generated = 0
    while ev and any(isinstance(e, Run) for e in ev):
        work = run_of(ev).work
        assert isinstance(work, CoGenerate) and work.pos == core.cache_len
        ev = core.work_done(Verified(Decision(0, bonus=9)), now=2.0 + generated)
        assert any(isinstance(e, Send) and isinstance(e.msg, Generated) for e in ev)
        generated += 1
    assert generated == 3 and core.text == [1, 2, 7, 9, 9, 9]
    assert core.idle_deadline() == 1.5 + 5.0  # from the edge's last work, not co-generation
    assert core.expire(5.0) == [] and not core.closed
    closed = core.expire(6.5)
    assert core.closed and any(isinstance(e, Close) for e in closed)


def _cogen_core(**limits: Any) -> VerifierCore:
    core = VerifierCore(TargetInfo(FP, V, max_length=64), SessionLimits(**limits), "s1")
    core.receive(encode(Hello(FP, SamplingParams(0.0), cogen_end=60)))
    return core


def test_a_skipped_cogeneration_waits_for_a_drafting_edge_but_not_for_a_credit() -> None:
    """The engine skips a co-generation when its step is full of drafts to verify. An edge that
    drafts sends its next batch soon: co-generation pauses until a frame comes. A cloud-only
    edge sends a credit only after tokens arrive: its co-generation queues again at once (a
    pause would stall it forever under load)."""
    credit = _cogen_core()
    credit.receive(propose(credit, 0, 0, 0, [], fixed=[1, 2]), now=1.0)
    ev = credit.work_done(Verified(Decision(0, bonus=7)), now=1.5)
    assert isinstance(run_of(ev).work, CoGenerate)
    ev = credit.work_done(Skipped(), now=2.0)
    work = run_of(ev).work
    assert isinstance(work, CoGenerate) and work.pos == credit.cache_len

    drafting = _cogen_core()
    drafting.receive(propose(drafting, 0, 0, 0, [7], fixed=[1, 2]), now=1.0)
    ev = drafting.work_done(Verified(Decision(1)), now=1.5)
    assert isinstance(run_of(ev).work, CoGenerate)
    assert drafting.work_done(Skipped(), now=2.0) == []
    # its next batch is verified at once (and co-generation may run again behind it)
    ev = drafting.receive(propose(drafting, 0, 1, 3, [8, 9]), now=2.5)
    assert isinstance(run_of(ev).work, Verify)


def hedge(core: VerifierCore, pos: int, token: int, draft: list[int]) -> bytes:
    return encode(Hedge(pos, token, np.array(draft), np.ones(len(draft), np.float32)), ctx(core))


def test_a_hedge_that_matches_the_correction_is_verified_in_the_cogeneration_forward() -> None:
    """Propose [7, 8, 9] after the prompt [1, 2]; a Hedge says: if position 3 holds 5 (not 8),
    the draft goes on 6, 4. The verifier rejects 8 and recovers 5: its next co-generation
    forward verifies [6, 4] (a Verify-like row), and every token it commits is streamed."""
    core = _cogen_core()
    core.receive(propose(core, 0, 0, 0, [7, 8, 9], fixed=[1, 2]), now=1.0)
    assert core.receive(hedge(core, 3, 5, [6, 4])) == []  # queued while busy: no reply
    ev = core.work_done(Verified(Decision(1, token=5)))
    assert _verdicts(ev)[0].token == 5 and core.text == [1, 2, 7, 5]
    work = run_of(ev).work
    assert isinstance(work, CoGenerate) and work.draft.tolist() == [6, 4]
    assert work.fixed.tolist() == [5] and work.pos == 3  # the cache lacks the recovered token
    # 6 accepted, 4 rejected: the verifier's own correction 11 follows it.
    ev = core.work_done(Verified(Decision(1, token=11)))
    gen = [e.msg for e in ev if isinstance(e, Send) and isinstance(e.msg, Generated)]
    assert [(g.pos, g.token) for g in gen] == [(4, 6), (5, 11)]
    assert core.text == [1, 2, 7, 5, 6, 11] and core.cache_len == 5
    assert core.tokens == TokenCounts(cogen=2, hedge=1)
    # The hedge is spent: the next forward is a plain one-token step.
    work = run_of(ev).work
    assert isinstance(work, CoGenerate) and len(work.draft) == 0


def test_hedges_that_do_not_match_the_text_cost_nothing() -> None:
    core = _cogen_core()
    core.receive(propose(core, 0, 0, 0, [7, 8], fixed=[1, 2]))
    core.receive(hedge(core, 3, 5, [6, 4]))  # the rival of 8 is 5...
    core.receive(hedge(core, 2, 9, [6]))  # ... and of 7 is 9
    ev = core.work_done(Verified(Decision(1, token=13)))  # ... but the verifier drew 13
    work = run_of(ev).work
    assert isinstance(work, CoGenerate) and len(work.draft) == 0


def test_a_hedge_is_used_within_the_cogeneration_bound_and_past_a_partial_match() -> None:
    core = _cogen_core(max_cogen_ahead=3)
    core.receive(propose(core, 0, 0, 0, [7], fixed=[1, 2]))
    core.receive(hedge(core, 3, 5, [6, 4, 2, 8, 9]))
    ev = core.work_done(Verified(Decision(1)))  # [7] accepted, no bonus: nothing known past it
    work = run_of(ev).work
    assert isinstance(work, CoGenerate) and len(work.draft) == 0  # the text has not reached 3
    ev = core.work_done(Verified(Decision(0, bonus=5)))  # co-generated 5: the hedge's token
    work = run_of(ev).work
    # 3 past the last Propose's end (3) at most: 5 is one, then [6] and the bonus after it.
    assert isinstance(work, CoGenerate) and work.draft.tolist() == [6]


def _tree_core(sampling: SamplingParams = GREEDY, **hello: Any) -> VerifierCore:
    """A co-generating session that has received three hedges before its batch [7, 8, 9]
    (after the prompt [1, 2]): 9 for 7 at 2, 8 for 8 at 3 (the draft's own token) and 5 for 8
    at 3 (newest last)."""
    limits = hello.pop("limits", {})
    core = VerifierCore(TargetInfo(FP, V, max_length=64), SessionLimits(**limits), "s1")
    core.receive(encode(Hello(FP, sampling, cogen_end=60, **hello)))
    assert core.receive(hedge(core, 2, 9, [6])) == []
    assert core.receive(hedge(core, 3, 8, [1])) == []
    assert core.receive(hedge(core, 3, 5, [6, 4])) == []
    return core


def test_hedges_that_fork_inside_a_batch_ride_in_its_forward_as_a_tree() -> None:
    """The batch's Verify carries the hedges forking inside its draft as branches (newest
    first; not one that agrees with the draft). The recovered token 5 opens the branch at
    index 1: its accepted token 6 and the token after it, 11, are committed at once, streamed
    as Generated after the Verdict; the cache holds 5 and 6 too; Proposes may start from the
    rejection on."""
    core = _tree_core()
    ev = core.receive(propose(core, 0, 0, 0, [7, 8, 9], fixed=[1, 2]))
    work = run_of(ev).work
    assert isinstance(work, Verify)
    assert [(b.at, b.token, b.draft.tolist()) for b in work.branches] == [
        (1, 5, [6, 4]),
        (0, 9, [6]),
    ]
    assert work.tree_tokens == 5
    ev = core.work_done(
        Verified(Decision(1, token=5), branch=BranchTaken(0, Decision(1, token=11)))
    )
    (v,) = _verdicts(ev)
    assert (v.accepted, v.token) == (1, 5)
    gen = [e.msg for e in ev if isinstance(e, Send) and isinstance(e.msg, Generated)]
    assert [(g.epoch, g.pos, g.token) for g in gen] == [(1, 4, 6), (1, 5, 11)]
    assert ev.index(Send(v)) < ev.index(Send(gen[0]))
    assert core.text == [1, 2, 7, 5, 6, 11] and core.tokens.tree == 1
    assert (core.cache_len, core.next_pos) == (5, 3)
    work = run_of(ev).work  # co-generation goes on after the branch
    assert isinstance(work, CoGenerate) and work.pos == 5 and work.fixed.tolist() == [11]


def test_a_hedge_that_comes_while_busy_rides_with_the_batch_queued_before_it() -> None:
    """The edge sends a branch after the batch it forks from: while batch 0 runs, batch 1
    queues and then the hedge for its second token comes; the hedge is kept at once, not queued
    behind batch 1, so batch 1's Verify carries it."""
    core = _cogen_core()
    core.receive(propose(core, 0, 0, 0, [7, 8], fixed=[1, 2]))
    assert core.receive(propose(core, 0, 1, 4, [9, 10])) == []
    assert core.receive(hedge(core, 5, 3, [2])) == []
    work = run_of(core.work_done(Verified(Decision(2)))).work
    assert isinstance(work, Verify) and work.propose.seq == 1
    assert [(b.at, b.token, b.draft.tolist()) for b in work.branches] == [(1, 3, [2])]


def test_a_tree_is_bounded_and_only_where_the_verifier_recovers_tokens_itself() -> None:
    # 4 tree tokens: the newest branch whole (3), the next cut to its token
    core = _tree_core(limits={"max_tree_tokens": 4})
    work = run_of(core.receive(propose(core, 0, 0, 0, [7, 8, 9], fixed=[1, 2]))).work
    assert isinstance(work, Verify) and work.tree_tokens == 4
    assert [(b.at, b.token, b.draft.tolist()) for b in work.branches] == [
        (1, 5, [6, 4]),
        (0, 9, []),
    ]
    for hello in (
        {"limits": {"max_tree_tokens": 0}},
        {"logprobs": 2},  # tree tokens would have no log-probabilities
        {"sampling": SamplingParams(1.0), "correction": CorrectionMode.CANDIDATES},
    ):
        core = _tree_core(**hello)  # type: ignore[arg-type]
        work = run_of(core.receive(propose(core, 0, 0, 0, [7, 8, 9], fixed=[1, 2]))).work
        assert isinstance(work, Verify) and work.branches == ()
    # At T > 0 in the greedy-draft mode the verifier recovers tokens itself: trees.
    core = _tree_core(SamplingParams(1.0), correction=CorrectionMode.GREEDY_DRAFT)
    work = run_of(core.receive(propose(core, 0, 0, 0, [7, 8, 9], fixed=[1, 2]))).work
    assert isinstance(work, Verify) and len(work.branches) == 2


def test_hedge_refusals() -> None:
    core = opened()  # no co-generation asked for
    assert errors(core.receive(hedge(core, 3, 5, [6]))) == ["bad_hedge"]
    core = _cogen_core()
    assert errors(core.receive(hedge(core, 0, 5, [6]))) == ["bad_hedge"]
    assert errors(core.receive(hedge(core, 62, 5, [6, 7]))) == ["bad_hedge"]


def test_hedges_kept_are_bounded_and_a_rollback_drops_them() -> None:
    core = _cogen_core(max_hedges=2)
    for pos in (3, 4, 5):
        core.receive(hedge(core, pos, 5, [6]))
    assert [h.pos for h in core.cogen.hedges] == [4, 5]
    core.receive(propose(core, 0, 0, 0, [7], fixed=[1, 2]))
    core.work_done(Verified(Decision(1)))  # then co-generation runs: the Rollback waits
    core.receive(encode(Rollback(1, 2), ctx(core)))
    ev = core.work_done(Verified(Decision(0, bonus=9)))
    assert isinstance(run_of(ev).work, Crop) and not core.cogen.hedges


def test_a_hedge_in_a_sampled_topk_session_is_verified_too() -> None:
    """topk at T > 0: once the verifier knows the text (here a bonus), a matching hedge is
    verified in the co-generation forward like any deterministic draft (the runner decides
    CoGenerate rows by the greedy-draft rule whatever the session's mode)."""
    core = VerifierCore(TargetInfo(FP, V, max_length=64), SessionLimits(), "s1")
    hello = Hello(FP, SamplingParams(1.0), correction=CorrectionMode.TOPK, cogen_end=60)
    core.receive(encode(hello))
    core.receive(propose(core, 0, 0, 0, [7], fixed=[1, 2]))
    core.receive(hedge(core, 3, 5, [6]))
    ev = core.work_done(Verified(Decision(1, bonus=5)))
    work = run_of(ev).work
    assert isinstance(work, CoGenerate) and work.draft.tolist() == [6] and not work.cloud


def test_the_verifier_drafts_for_itself_in_cogeneration() -> None:
    """cloud_draft = ngram: with no matching hedge, a co-generation forward verifies the
    verifier's own draft (prompt lookup over the text, q a point mass); accepted tokens and
    the token after them are streamed like any co-generated ones."""
    core = _cogen_core(cloud_draft=NGRAM, cloud_draft_tokens=3)
    core.receive(propose(core, 0, 0, 0, [3], fixed=[1, 2, 3, 4, 5, 1, 2]))
    ev = core.work_done(Verified(Decision(1)))  # the text is [1, 2, 3, 4, 5, 1, 2, 3]
    work = run_of(ev).work
    assert isinstance(work, CoGenerate) and work.cloud
    assert work.draft.tolist() == [4, 5, 1] and work.q.tolist() == [1.0, 1.0, 1.0]
    ev = core.work_done(Verified(Decision(2, token=9)))  # 4, 5 accepted; 1 rejected: 9
    gen = [e.msg for e in ev if isinstance(e, Send) and isinstance(e.msg, Generated)]
    assert [(g.pos, g.token) for g in gen] == [(8, 4), (9, 5), (10, 9)]
    assert core.tokens == TokenCounts(cogen=3, cloud_draft=2)
    work = run_of(ev).work  # [..., 5, 9]: 9 never occurred before, a plain step
    assert isinstance(work, CoGenerate) and not work.cloud and len(work.draft) == 0


def test_a_hedge_is_a_point_mass_whatever_its_q() -> None:
    """The greedy-draft rule recovers from p without x, exact only for q(x) = 1: a hedge's
    draft is verified as a point mass, whatever q its frame carries."""
    core = VerifierCore(TargetInfo(FP, V, max_length=64), SessionLimits(), "s1")
    hello = Hello(FP, SamplingParams(1.0), correction=CorrectionMode.TOPK, cogen_end=60)
    core.receive(encode(hello))
    core.receive(propose(core, 0, 0, 0, [7], fixed=[1, 2]))
    low_q = Hedge(3, 5, np.array([6, 4]), np.array([0.25, 0.5], np.float32))
    core.receive(encode(low_q, ctx(core)))
    work = run_of(core.work_done(Verified(Decision(1, bonus=5)))).work
    assert isinstance(work, CoGenerate) and work.q.tolist() == [1.0, 1.0]


def test_a_cloud_draft_that_fails_turns_cloud_drafts_off_for_the_session() -> None:
    """A cloud draft's extra tokens may not fit the session's KV share: its work fails with the
    cache restored, and co-generation goes on at once without cloud drafts (no pause)."""
    core = _cogen_core(cloud_draft=NGRAM)
    core.receive(propose(core, 0, 0, 0, [3], fixed=[1, 2, 3, 4, 1, 2]))
    work = run_of(core.work_done(Verified(Decision(1)))).work
    assert isinstance(work, CoGenerate) and work.cloud
    ev = core.work_done(Failed("kv share", core.cache_len, FailureKind.KV_QUOTA))
    assert not errors(ev)
    work = run_of(ev).work
    assert isinstance(work, CoGenerate) and not work.cloud and len(work.draft) == 0
    ev = core.work_done(Verified(Decision(0, bonus=1)))  # text ... 3, 1: [1] occurred before
    work = run_of(ev).work
    assert isinstance(work, CoGenerate) and not work.cloud and len(work.draft) == 0


def test_a_matching_hedge_comes_before_the_cloud_draft_and_off_means_off() -> None:
    core = _cogen_core(cloud_draft=NGRAM)
    core.receive(propose(core, 0, 0, 0, [3], fixed=[1, 2, 3, 4, 1, 2]))
    core.receive(hedge(core, 6, 3, [8]))
    work = run_of(core.work_done(Verified(Decision(1)))).work
    assert isinstance(work, CoGenerate) and not work.cloud and work.draft.tolist() == [8]
    core = _cogen_core()  # the default: prompt lookup, no model
    core.receive(propose(core, 0, 0, 0, [3], fixed=[1, 2, 3, 4, 1, 2]))
    work = run_of(core.work_done(Verified(Decision(1)))).work
    assert isinstance(work, CoGenerate) and work.cloud and work.draft.tolist() == [4, 1, 2, 3]
    core = _cogen_core(cloud_draft=frozenset())  # cloud_draft off
    core.receive(propose(core, 0, 0, 0, [3], fixed=[1, 2, 3, 4, 1, 2]))
    work = run_of(core.work_done(Verified(Decision(1)))).work
    assert isinstance(work, CoGenerate) and len(work.draft) == 0


def test_the_tail_of_a_rejected_draft_is_the_next_cloud_draft() -> None:
    """cloud_draft = tail: after a rejection the rest of the rejected draft, one position on
    behind the correction, is verified in the next co-generation forward (point mass); once
    the text leaves it, it is no draft."""
    core = _cogen_core(cloud_draft=frozenset({CloudDraft.TAIL}), cloud_draft_tokens=2)
    core.receive(propose(core, 0, 0, 0, [5, 6, 7, 8], fixed=[1, 2]))
    ev = core.work_done(Verified(Decision(1, token=9)))  # 5 accepted; 6 rejected: 9
    work = run_of(ev).work  # text [1, 2, 5, 9]: the tail [7, 8] drafted for 4, 5
    assert isinstance(work, CoGenerate) and work.cloud and work.draft.tolist() == [7, 8]
    assert work.q.tolist() == [1.0, 1.0]
    ev = core.work_done(Verified(Decision(1, token=3)))  # 7 accepted, 8 rejected: 3
    work = run_of(ev).work  # the tail [7, 8] left the text at 5: nothing more of it
    assert isinstance(work, CoGenerate) and not work.cloud and len(work.draft) == 0


def test_a_cloud_draft_model_is_asked_for_when_no_other_source_drafts() -> None:
    """With a cloud draft model (limits.cloud_model), a co-generation forward with no hedge,
    tail or prompt-lookup draft asks the model side to draft (model_tokens, within the
    co-generation room); the Generated tokens are the model side's ``drafted`` prefix and the
    token after it."""
    core = _cogen_core(cloud_draft=NGRAM, cloud_model=True, cloud_draft_tokens=3)
    core.receive(propose(core, 0, 0, 0, [3], fixed=[1, 2]))
    work = run_of(core.work_done(Verified(Decision(1)))).work  # text [1, 2, 3]: no n-gram
    assert isinstance(work, CoGenerate) and work.cloud and work.model_tokens == 3
    assert len(work.draft) == 0
    drafted = np.array([4, 5, 6], np.int64)
    ev = core.work_done(Verified(Decision(2, token=7), drafted=drafted))
    gen = [e.msg for e in ev if isinstance(e, Send) and isinstance(e.msg, Generated)]
    assert [(g.pos, g.token) for g in gen] == [(3, 4), (4, 5), (5, 7)]
    assert core.tokens.cloud_draft == 2


def test_a_model_draft_carries_the_sessions_measured_acceptance() -> None:
    """cloud_draft_length = auto: each co-generation that asks for a model draft carries the
    session's acceptance estimate (its model side picks the length from it); drafts rejected at
    once bring it down, co-generations given no draft (withheld) let the old evidence fade back
    toward the prior; fixed: none carried (model_tokens as asked)."""
    core = _cogen_core(cloud_model=True, cloud_draft_tokens=3)
    core.receive(propose(core, 0, 0, 0, [3], fixed=[1, 2]))
    work = run_of(core.work_done(Verified(Decision(1)))).work
    assert isinstance(work, CoGenerate) and work.model_alpha == pytest.approx(0.7)  # the prior
    alphas = []
    for t in range(10, 16):  # every draft rejected at its first token
        drafted = np.array([t + 100, t + 101, t + 102], np.int64)
        work = run_of(core.work_done(Verified(Decision(0, token=t), drafted=drafted))).work
        assert isinstance(work, CoGenerate) and work.model_alpha is not None
        alphas.append(work.model_alpha)
    assert alphas == sorted(alphas, reverse=True) and alphas[-1] < 0.15
    empty = np.zeros(0, np.int64)
    ev = core.work_done(Verified(Decision(0, bonus=20), drafted=empty, withheld=Withheld.COST))
    work = run_of(ev).work
    assert isinstance(work, CoGenerate) and work.model_alpha is not None
    assert work.model_alpha > alphas[-1]  # faded toward the prior
    fixed = _cogen_core(
        cloud_model=True, cloud_draft_tokens=3, cloud_draft_length=DraftLength.FIXED
    )
    fixed.receive(propose(fixed, 0, 0, 0, [3], fixed=[1, 2]))
    work = run_of(fixed.work_done(Verified(Decision(1)))).work
    assert isinstance(work, CoGenerate) and work.model_tokens == 3 and work.model_alpha is None


def test_an_empty_propose_is_a_credit_or_fixed_tokens_alone() -> None:
    """γ = 0: inside the known text it is answered at no model cost (a cloud-only edge's
    credit, which moves the co-generation bound); with fixed tokens the verifier lacks, they
    are verified (cached) like any, bonus or not; a federated session refuses it."""
    core = _cogen_core()
    ev = core.receive(propose(core, 0, 0, 0, [], fixed=[1, 2]))
    work = run_of(ev).work  # fixed tokens the verifier lacks: model work, no bonus asked
    assert isinstance(work, Verify) and work.fixed.tolist() == [1, 2] and not work.want_bonus
    ev = core.work_done(Verified(Decision(0)))
    verdict = [e.msg for e in ev if isinstance(e, Send) and isinstance(e.msg, Verdict)]
    assert verdict[0].accepted == 0 and core.text == [1, 2]
    work = run_of(ev).work  # co-generation from the end of the text
    assert isinstance(work, CoGenerate)
    core.work_done(Verified(Decision(0, bonus=5)))  # text [1, 2, 5]
    assert not core.receive(propose(core, 0, 1, 3, []))  # a credit: queued behind the work
    ev = core.work_done(Verified(Decision(0, bonus=6)))  # text [1, 2, 5, 6]; then the credit
    verdict = [e.msg for e in ev if isinstance(e, Send) and isinstance(e.msg, Verdict)]
    assert verdict[0].accepted == 0 and verdict[0].bonus is None and core.cogen.proposed_end == 3
    core = opened(ReplyMode.FEDERATED)
    ev = core.receive(propose(core, 0, 0, 0, [], fixed=[1, 2]))
    assert errors(ev) == [ErrorCode.BAD_FRAME]


@pytest.mark.parametrize(
    ("cut", "verdicts", "next_pos"),
    [
        (1, [(1, 1, 4)], 4),  # cut inside the first batch: its bonus, the second void
        (3, [(1, 2, None), (2, 1, 4)], 6),  # inside the second (the ration snaps past the first)
    ],
)
def test_a_cut_draft_answers_with_its_bonus_and_starts_a_new_epoch(
    cut: int, verdicts: list[tuple[int, int, int | None]], next_pos: int
) -> None:
    """The ration verified the first ``cut`` tokens of a coalesced draft, all accepted, the cut
    inside a batch: the Verdict of the batch the cut falls in carries the bonus token drawn
    after them, the draft behind is void (a new epoch), and the budget the edge is told rides
    with it once."""
    core = _busy_with_two_queued()
    work = run_of(core.work_done(Verified(Decision(2)))).work
    assert isinstance(work, Verify) and len(work.survival) == 4  # sent for the ration
    assert all(a >= b for a, b in itertools.pairwise(work.survival))
    out = core.work_done(Verified(Decision(cut, bonus=4), cut=cut, budget=cut))
    got = [(v.seq, v.accepted, v.bonus) for v in _verdicts(out)]
    assert got == verdicts
    assert _verdicts(out)[-1].budget == cut and core.budget == cut
    assert (core.next_pos, core.cache_len, core.epoch) == (next_pos, next_pos, 1)
    assert core.text[-1] == 4  # the bonus, which the edge sends back as a fixed token
    assert isinstance(run_of(core.receive(propose(core, 1, 3, next_pos, [11], [4]))).work, Verify)
    out = core.work_done(Verified(Decision(1), budget=cut))
    assert _verdicts(out)[-1].budget is None  # unchanged: not sent again


def test_batches_behind_the_ration_are_deferred_not_dropped() -> None:
    """The ration verified the first batch of a coalesced draft whole (it stops at a batch's
    end): accepted, that batch gets its Verdict (no bonus: a batch follows), the epoch stays,
    and the second batch is queued again, first, as it came: the next step verifies it."""
    core = _busy_with_two_queued()
    work = run_of(core.work_done(Verified(Decision(2)))).work
    assert isinstance(work, Verify) and work.promised == core.budget
    out = core.work_done(Verified(Decision(2), cut=2, budget=2))
    assert [(v.seq, v.accepted, v.bonus, v.budget) for v in _verdicts(out)] == [(1, 2, None, 2)]
    assert core.epoch == 0 and core.deferred == 1 and core.expected_seq == 3
    again = run_of(out).work  # the deferred batch, coalesced with nothing new
    assert isinstance(again, Verify) and [p.seq for p in again.segments] == [2]
    assert again.draft.tolist() == [9, 10] and again.promised == 2
    out = core.work_done(Verified(Decision(2)))
    assert [(v.seq, v.accepted) for v in _verdicts(out)] == [(2, 2)]
    assert (core.next_pos, core.epoch) == (7, 0)


def test_a_rejection_before_deferred_batches_leaves_them_stale() -> None:
    """Rejected inside the verified batch: the deferred one is of an old epoch now (a Note
    each, no work), as if it had been queued and dropped."""
    core = _busy_with_two_queued()
    run_of(core.work_done(Verified(Decision(2))))
    out = core.work_done(Verified(Decision(1, token=4), cut=2))
    assert [(v.seq, v.accepted, v.token) for v in _verdicts(out)] == [(1, 1, 4)]
    assert [e.kind for e in out if isinstance(e, Note)] == [NoteKind.STALE]
    assert core.epoch == 1 and core.deferred == 0 and not [e for e in out if isinstance(e, Run)]
