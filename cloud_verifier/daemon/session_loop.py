"""One session's loop, from its first frame to its end: its Hello (within ``handshake_timeout``),
its wait for its turn when it joined the admission line, its slot (a new one, or that of the
lost session it resumes), then frames in and the core's events out while its model work runs on
the engine, and at the end its slot released or kept for resumption. The session's rules are its
core's (:class:`~cloud_verifier.session.core.VerifierCore`: no I/O); this module carries out the
core's events and counts them. Invariants: a session has at most one model request in flight and
one pending read, both tasks owned by :func:`_session_loop`, which cancels and awaits them on its
way out; while model work runs at most ``READ_AHEAD`` frames are queued in the core; a session is
in ``state.sessions`` exactly while it runs, and its slot is released or parked once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
import time
import uuid
from typing import Any

from aiohttp import WSCloseCode, WSMessage, WSMsgType

from cloud_verifier.daemon.admission import wait_turn
from cloud_verifier.daemon.lifecycle import check_engine
from cloud_verifier.daemon.metrics import VerifierMetrics
from cloud_verifier.daemon.parking import adopt_parked, drop_oldest_kept, park
from cloud_verifier.daemon.state import (
    LOG_NAME,
    LiveSession,
    SlowReader,
    Stream,
    VerifierState,
    send_message,
)
from cloud_verifier.engine.engine import Outcome
from cloud_verifier.engine.kv_manager import NoFreeSlot, Slot
from cloud_verifier.engine.work import (
    CoGenerate,
    Crop,
    Draw,
    Failed,
    FailureKind,
    Federate,
    Skipped,
    Verified,
    Verify,
    Work,
    batch_ends,
    deferred,
)
from cloud_verifier.session.cogeneration import TokenCounts
from cloud_verifier.session.core import VerifierCore
from cloud_verifier.session.events import (
    CLOSE_OK,
    Adopt,
    Close,
    Event,
    Note,
    NoteKind,
    Run,
    Send,
)
from cloud_verifier.session.limits import TargetInfo
from shared.errors import ErrorCode
from shared.service.ratelog import LogLimiter
from shared.wire.messages import Error, FederatedReply, Hello, Progress, Verdict

log = logging.getLogger(LOG_NAME)

FIRST = asyncio.FIRST_COMPLETED
#: Frames read ahead while a session's model work runs (an honest pipelined edge has its depth
#: D of Proposes in flight; a flood waits in the socket instead of in memory).
READ_AHEAD = 16


async def _fatal(peer: Stream, state: VerifierState, close: Close, core: VerifierCore) -> None:
    """Tell the peer why (unless the close is a normal one), then end the session's stream."""
    with contextlib.suppress(ConnectionError):
        if close.code != CLOSE_OK:
            await send_message(peer, state, close.error, core)
    await peer.close(close.code, f"{close.error.code}: {close.error.message}")


def _new_core(state: VerifierState, resume_token: str | None = None) -> VerifierCore:
    target = state.engine.require_target()
    info = TargetInfo(target.fingerprint, target.vocab_size, state.engine.max_context)
    return VerifierCore(info, state.limits, uuid.uuid4().hex[:16], resume_token)


def _clip(text: str, n: int = 200) -> str:
    """Peer-chosen text for a log line: quoted (no control characters) and bounded."""
    return repr(text if len(text) <= n else text[:n] + "...")


def _note(state: VerifierState, core: VerifierCore, n: Note, logs: LogLimiter | None) -> None:
    """Count a note; log the ones worth a line, within the session's log budget (a peer can
    cause edge errors and model errors once per frame)."""
    m = state.metrics
    if n.kind == NoteKind.REFUSED:
        m.sessions_refused.inc(reason=n.detail)
    elif n.kind == NoteKind.STALE:
        m.stale_dropped.inc()
    elif n.kind == NoteKind.BAD_FRAME:
        m.bad_frames.inc()
    elif n.kind == NoteKind.IDLE:
        m.idle_closed.inc()
    elif n.kind == NoteKind.EDGE_ERROR and logs is not None:
        logs.log(log, logging.INFO, "session %s: edge reports %s", core.session_id, _clip(n.detail))
    elif n.kind == NoteKind.MODEL_ERROR and logs is not None:
        logs.log(log, logging.WARNING, "session %s: model error: %s", core.session_id, n.detail)


def _count_work(state: VerifierState, work: Work, outcome: Outcome) -> None:
    m = state.metrics
    result, timing = outcome.result, outcome.timing
    m.queue_seconds.observe(outcome.queued_s)
    if isinstance(result, Failed):
        m.model_errors.inc(kind=result.kind)
    if isinstance(work, CoGenerate):
        if isinstance(result, Verified):
            if work.cloud:
                drafted = work.draft if result.drafted is None else result.drafted
                m.cloud_draft_proposed.inc(len(drafted))
            if result.withheld is not None:
                m.cloud_drafts_withheld.inc(reason=result.withheld.value)
        elif isinstance(result, Skipped):
            m.cogen_skipped.inc()
    if isinstance(work, Verify) and isinstance(result, Verified) and result.cut is not None:
        ends = batch_ends(work)
        if deferred(work, result.cut):
            m.draft_deferred_batches.inc(len(ends) - ends.index(result.cut) - 1)
        else:
            m.draft_cut_rounds.inc()
            m.draft_cut_tokens.inc(len(work.draft) - result.cut)
    if isinstance(work, Verify) and work.branches and isinstance(result, Verified) and result.tree:
        m.tree_branches.inc(len(work.branches))
        if result.branch is not None:
            m.tree_branches_opened.inc()
    if isinstance(work, (Verify, Federate, CoGenerate)) and timing is not None:
        f = len(work.fixed)
        m.model_forwards.inc()
        m.fixed_tokens.inc(f)
        m.forward_seconds.observe(timing.forward_s)
        m.verify_seconds.observe(timing.job_s)
        m.batch_sessions.observe(timing.batch)
    if isinstance(work, Federate) and not isinstance(result, Failed):
        m.federated_rounds.inc()
    elif isinstance(work, Verify) and isinstance(result, Verified):
        m.coalesced.inc(len(work.more))
        d, g = result.decision, len(work.draft)
        m.num_drafts.inc()
        m.num_draft_tokens.inc(g)
        m.num_accepted_tokens.inc(d.accepted)
        for i in range(d.accepted):
            m.accepted_per_pos.inc(position=str(i))
        if d.accepted < g:
            kind = "sparse" if d.sparse is not None else "candidates" if d.candidates else "token"
            m.corrections.inc(kind=kind)
        elif d.bonus is not None:
            m.bonus_tokens.inc()
    elif isinstance(work, Crop) and not isinstance(result, Failed):
        m.rollbacks.inc()
    elif isinstance(work, Draw):
        m.resamples.inc()


async def _run_work(state: VerifierState, live: LiveSession, work: Work) -> list[Event]:
    """Hand one model request of the core to the engine (batched with other sessions' work);
    feed the result back."""
    try:
        outcome = await state.engine.run(live.slot, work)
    except Exception as e:  # the engine itself failed (shut down, or its thread died)
        if check_engine(state) and live.logs.allow():
            log.warning("session %s: engine error", live.core.session_id, exc_info=e)
        failed = Failed(f"{type(e).__name__}: {e}", live.slot.length, FailureKind.ENGINE)
        outcome = Outcome(failed, None, 0.0)
    _count_work(state, work, outcome)
    if live.core.closed:  # closed meanwhile (e.g. too many bad frames): nothing to resume
        return []
    before = live.core.tokens
    events = live.core.work_done(outcome.result, time.monotonic())
    _count_tokens(state.metrics, live.core.tokens - before)
    return events


def _count_tokens(m: VerifierMetrics, added: TokenCounts) -> None:
    """The tokens a result added to its session's count (the core's, the one owner)."""
    m.cogen_tokens.inc(added.cogen)
    m.hedge_tokens.inc(added.hedge)
    m.cloud_draft_tokens.inc(added.cloud_draft)
    m.tree_tokens.inc(added.tree)


async def _act(
    peer: Stream, state: VerifierState, live: LiveSession, events: list[Event], t0: float
) -> Work | None:
    """Carry out the core's events in order: notes, sends, a close. Returns the model work the
    core asked for (at most one: it is BUSY until its result), for the caller to start."""
    core = live.core
    work: Work | None = None
    for ev in events:
        if isinstance(ev, Note):
            _note(state, core, ev, live.logs)
        elif isinstance(ev, Send):
            await send_message(peer, state, ev.msg, core)
            if isinstance(ev.msg, (Verdict, FederatedReply)):
                state.metrics.round_seconds.observe(time.perf_counter() - t0)
            elif isinstance(ev.msg, Progress):
                state.metrics.progress_frames.inc()
        elif isinstance(ev, Run):
            assert work is None, "the core asks for one model request at a time"
            work = ev.work
        elif isinstance(ev, Close):
            log.info("session %s closed: %s: %s", core.session_id, ev.error.code, ev.error.message)
            await _fatal(peer, state, ev, core)
            return None
    return work


async def _next_frame(peer: Stream, core: VerifierCore) -> WSMessage | None:
    """The next message from the peer, or None once the core's idle deadline has passed (the
    connection's pings never count as a session's activity)."""
    while True:
        deadline = core.idle_deadline()
        if deadline is None:
            return await peer.receive()
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        with contextlib.suppress(asyncio.TimeoutError):
            # A message that arrives as the deadline passes stays queued in the reader.
            if sys.version_info >= (3, 11):
                async with asyncio.timeout(left):  # no extra task per frame
                    return await peer.receive()
            return await asyncio.wait_for(peer.receive(), left)


ENDED = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)


async def _cancel(task: asyncio.Task[Any] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _session_loop(
    peer: Stream, state: VerifierState, live: LiveSession, events: list[Event]
) -> None:
    """Read frames and run the session's model work at the same time.

    Frames that arrive while model work runs go to the core at once, up to ``READ_AHEAD`` of
    them (it queues them, and Proposes that continue the running one are coalesced into the
    next forward; beyond that the frames wait in the socket, and TCP holds the peer back); the model
    work is a task whose result goes back to the core. Owns both tasks, the model work in
    flight (at most one) and the pending read, and cancels and awaits them on the way out. The
    read waits with the core's idle deadline, so it is restarted when the core goes from BUSY
    (no deadline) to OPEN. While model work waits or runs, the engine's word on it goes to the
    core when a Progress frame is due."""
    core = live.core
    work: asyncio.Task[list[Event]] | None = None
    read: asyncio.Task[WSMessage | None] | None = None
    t0 = started = time.perf_counter()
    try:
        while True:
            asked = await _act(peer, state, live, events, t0)
            events = []
            if core.closed:
                return
            if asked is not None:
                work = asyncio.create_task(_run_work(state, live, asked))
                started = time.perf_counter()
            if read is None and (work is None or core.queued < READ_AHEAD):
                read = asyncio.create_task(_next_frame(peer, core))
            due = core.progress_due() if work is not None else None
            timeout = None if due is None else max(0.0, due - time.monotonic())
            done, _ = await asyncio.wait(
                [t for t in (read, work) if t is not None], timeout=timeout, return_when=FIRST
            )
            if not done:  # a Progress frame is due
                report = state.engine.progress(live.slot)
                if report.stalled and live.logs.allow():
                    log.warning(
                        "session %s: the engine's running step has stalled (estimate %.1f s)",
                        core.session_id,
                        report.eta_s,
                    )
                events = core.report(report, time.monotonic())
                continue
            if work is not None and work.done():
                events, work, t0 = work.result(), None, started
                if read is not None and core.running is None and not read.done():
                    await _cancel(read)  # OPEN again: the read's idle deadline starts now
                    read = None
                continue  # act on the result before the next frame
            if read is None or not read.done():
                continue
            msg, read = read.result(), None
            if msg is None:  # idle past its deadline: the core closes it (idle_timeout)
                events, t0 = core.expire(time.monotonic()), time.perf_counter()
                continue
            if msg.type in ENDED:
                return
            t0 = time.perf_counter()
            events = core.receive(msg.data, time.monotonic())
    finally:
        await _cancel(work)
        await _cancel(read)


def _open_slot(state: VerifierState, hello: Hello, tenant: str) -> Slot:
    """A new slot; a lost session kept for resumption gives up its own if none is free."""
    while True:
        try:
            return state.engine.open(hello, tenant)
        except NoFreeSlot:
            if not drop_oldest_kept(state):
                raise


async def run_session(peer: Stream, state: VerifierState, tenant: str = "") -> None:
    s = state.settings
    token = secrets.token_hex(16) if s.resume_grace > 0 else None
    core = _new_core(state, token)
    try:
        first = await asyncio.wait_for(peer.receive(), s.handshake_timeout)
    except asyncio.TimeoutError:
        err = Error(ErrorCode.BAD_HANDSHAKE, f"no Hello within {s.handshake_timeout} s", fatal=True)
        state.metrics.sessions_refused.inc(reason=err.code)
        await _fatal(peer, state, Close(err), core)
        return
    if first.type != WSMsgType.BINARY:
        return  # ended before saying anything
    events = core.receive(first.data, time.monotonic())
    if core.closed or core.hello is None:
        for ev in events:
            if isinstance(ev, Note):
                _note(state, core, ev, None)
            elif isinstance(ev, Close):
                await _fatal(peer, state, ev, core)
        return
    if peer.ticket is not None and not await wait_turn(peer, state, core):
        return  # ended, or refused by the service's status, while it waited in line
    slot: Slot | None = None
    ask = next((ev for ev in events if isinstance(ev, Adopt)), None)
    if ask is not None:
        adopted = await adopt_parked(state, ask, core.hello, tenant)
        slot = None if adopted is None else adopted[0]
        events = core.adopted(None if adopted is None else adopted[1])
    if slot is None:
        slot = _open_slot(state, core.hello, tenant)
    live = LiveSession(core, slot)
    state.sessions[core.session_id] = live
    state.metrics.sessions.inc()
    state.metrics.sessions_active.set(len(state.sessions))
    h = core.hello
    log.info(
        "session %s open (%s, %s, %s%s)",
        core.session_id,
        h.reply_mode,
        h.correction,
        h.sampling,
        f", resumed {core.resumed} tokens" if core.resumed else "",
    )
    # Kept for resumption when the connection was lost (or the edge ended the stream
    # abnormally), not when the edge ended it normally (End 1000: it is done) or this side
    # ended it (a slow reader, an internal error, or the core's own close).
    ours = False
    try:
        await _session_loop(peer, state, live, events)
    except SlowReader as e:
        ours = True
        await peer.conn.slow_reader(e)
    except ConnectionError:
        log.info("session %s: connection lost", core.session_id)
    except Exception as e:
        ours = True
        log.exception("session %s: internal error", core.session_id)
        err = Error(
            ErrorCode.INTERNAL,
            f"internal error ({type(e).__name__}); see the verifier's log",
            fatal=True,
        )
        await _fatal(peer, state, Close(err, WSCloseCode.INTERNAL_ERROR), core)
    finally:
        del state.sessions[core.session_id]
        lost = not ours and not core.closed and peer.lost
        lost = lost and core.hello.resumable  # an edge that cannot resume gets nothing kept
        kept = lost and token is not None and park(state, token, slot, tenant)
        if not kept:
            state.engine.release(live.slot)
        state.metrics.sessions_active.set(len(state.sessions))
        live.logs.flush(log, logging.INFO, f"session {core.session_id}")
        how = "lost (kept for resumption)" if kept else "ended"
        log.info("session %s %s", core.session_id, how)
