"""The asyncio side of an edge session: read frames, feed the core, carry out its events.

The rules live in :mod:`edge_agent.session.core` (and :mod:`edge_agent.session.federation_core`);
this module only
moves bytes and runs the draft model:

* :func:`draft_loop`: whenever the core says drafting may go on, draft up to γ tokens from its
  :class:`~edge_agent.session.pipeline.DraftPlan` on the model worker, checking after each step
  that no rejection voided the plan, then hand the batch to the core and write its frames;
* :class:`Outbox`: one verifier link's bounded send queue and its writer task, so frames leave in
  exactly the order the core produced them (a Rollback before any Propose of the new epoch);
* :func:`credit_loop`: with no draft model (cloud-only speculative decoding), the credits
  that let the verifier's co-generation run on (:meth:`~edge_agent.session.core.SingleCore.credit`);
* :func:`run_single`: the drafter (or the credits), the reader, the writer and the verdict
  watchdog of one verifier session, owned here until the generation is done or the link
  fails.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from edge_agent.model.drafter import BranchDrafting, DraftModel, DraftRow, DraftStep
from edge_agent.model.tasks import ModelWorker, run_until_first_done
from edge_agent.session.branches import NO_RIVAL, Growing, HedgePlan, PendingBatch, Rival
from edge_agent.session.core import SingleCore
from edge_agent.session.drafting import DraftingCore
from edge_agent.session.events import (
    Committed,
    Count,
    EdgeEvent,
    Fail,
    Finished,
    GenerationEvent,
    RejectionGap,
    Round,
    Send,
)
from edge_agent.session.generation import Stats
from edge_agent.session.opening import check_welcome, queue_progress
from edge_agent.session.pipeline import DraftPlan
from edge_agent.session.transport import LinkClosed, Transport
from shared.maths.sampling import Probs
from shared.wire.codec import encode
from shared.wire.messages import Hello, Message, Welcome
from shared.wire.packing import WireContext

Consumer = Callable[[GenerationEvent], None]
"""Who a driver hands a generation's Committed and Finished events to (the service, or the
agent's caller), in order."""


class VerdictTimeout(LinkClosed):
    """The head batch got no Verdict by its deadline: the verifier is stalled (it may still
    answer pings). The session is dropped and rebuilt from the committed ids."""


class Signal:
    """Wakes the tasks of one session whenever the core's state changed."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_for(self, ready: Callable[[], bool], timeout: float | None = None) -> None:
        """Until ``ready()``; raises asyncio.TimeoutError after ``timeout`` seconds.

        Built on ``asyncio.wait``, never ``asyncio.wait_for``: on Python ≤ 3.11 the latter can
        swallow a cancellation that races its inner wait, and an owner cancelling this task
        would then wait for it forever."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not ready():
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise asyncio.TimeoutError
            waiter = asyncio.ensure_future(self._event.wait())
            try:
                await asyncio.wait({waiter}, timeout=remaining)
            finally:
                waiter.cancel()


class Outbox:
    """One verifier link: its transport and a bounded queue of frames to send, in order.
    Frames are encoded with the link's session context ``ctx`` and counted in ``stats`` as
    they are queued."""

    def __init__(
        self, transport: Transport, ctx: WireContext, stats: Stats, max_queued: int
    ) -> None:
        self.transport = transport
        self.ctx = ctx
        self.stats = stats
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue(max_queued)
        self.dropped = asyncio.Event()  # the core dropped this link: its tasks end
        self.why = "dropped"  # the core's reason, once it dropped the link

    def drop(self, why: str) -> None:
        """End this link's tasks, for ``why``."""
        self.why = why
        self.dropped.set()

    def room(self) -> int:
        """Frames the queue can still take."""
        return self._outbox.maxsize - self._outbox.qsize()

    def write(self, msg: Message) -> None:
        """Queue ``msg``'s frame (never blocks). A link that does not drain its queue is
        broken."""
        data = encode(msg, self.ctx)
        self.stats.sent(msg, len(data))
        try:
            self._outbox.put_nowait(data)
        except asyncio.QueueFull:
            raise LinkClosed(
                f"{self._outbox.maxsize} frames wait to be sent: the link does not drain"
            ) from None

    async def until_dropped(self) -> None:
        await self.dropped.wait()

    async def writer(self) -> None:
        while True:
            data = await self._outbox.get()
            await self.transport.send(data)


async def handshake(
    transport: Transport, hello: Hello, timeout_s: float, stats: Stats | None = None
) -> Welcome:
    """Send Hello, await Welcome (see :func:`edge_agent.session.opening.check_welcome`).

    Busy is not dead: while the session waits in the verifier's admission line, its Progress
    frames say so (counted in ``stats``, with the time waited), and each restarts the
    ``timeout_s`` bound, which therefore bounds only silence; the request's own deadline
    bounds the wait."""
    await transport.send(encode(hello))
    queued_at: float | None = None
    while True:
        data = await asyncio.wait_for(transport.recv(), timeout_s)
        if queue_progress(data) is None:
            welcome = check_welcome(hello, data)
            if stats is not None and queued_at is not None:
                stats.admission_wait_s += max(0.0, time.monotonic() - queued_at)
            return welcome
        if queued_at is None:
            queued_at = time.monotonic()
        if stats is not None:
            stats.progress_frames += 1


async def _draft_hedge(
    core: DraftingCore, drafter: DraftModel, worker: ModelWorker, hp: HedgePlan
) -> list[int]:
    """Draft ``hp``'s continuation (greedy), stopping early as soon as the pipeline has room
    again (the next batch comes first) or the plan is void."""
    out: list[int] = []
    while len(out) < hp.max_tokens and core.pipe.book.hedge_current(hp) and not core.may_draft():
        row = DraftRow([*hp.context, hp.token, *out], core.cfg.sampling, core.rng, True)
        step = await worker.run(drafter.draft, row)
        out.append(step.token)
        if step.token in core.gen.eos_ids:
            break
    return out


def _branch_row(core: DraftingCore, g: Growing) -> DraftRow:
    """The draft step that grows branch ``g`` (its rival too: branches of a branch)."""
    det = g.pp.deterministic
    return DraftRow([*g.pp.context, g.pp.token, *g.draft], core.cfg.sampling, core.rng, det, True)


def _grow(
    core: DraftingCore,
    growing: list[Growing],
    steps: list[DraftStep],
    grown: Callable[[list[EdgeEvent]], None] | None,
) -> None:
    """Add each branch's step (``steps`` in ``growing``'s order) and hand what that sends
    (token trees: :meth:`~edge_agent.session.core.SingleCore.grew`) to ``grown``."""
    for g, step in zip(growing, steps, strict=True):
        if not core.branch_open(g):
            continue  # a verdict came while the step ran: this branch is void or done
        g.add(step.token, step.q, step.rival or NO_RIVAL, step.prob)
        events = core.grew(g)
        if grown is not None:
            grown(events)


async def _predraft(
    core: DraftingCore,
    drafter: DraftModel,
    worker: ModelWorker,
    grown: Callable[[list[EdgeEvent]], None] | None = None,
) -> bool:
    """Grow prepared outcomes while the pipeline is full (:meth:`~edge_agent.session.drafting.
    DraftingCore.branch_rows`): as many at once as one batched step takes where the draft can
    (:class:`~edge_agent.model.drafter.BranchDrafting`), else one; stop as soon as the pipeline
    has room again (a verdict came: the next batch comes first, and may be one of these, as
    far as it got). Returns whether any branch grew."""
    many = drafter if isinstance(drafter, BranchDrafting) else None
    room = many.branch_batch if many is not None else 1
    any_grew = False
    while not core.may_draft() and (active := core.branch_rows(room)):
        rows = [_branch_row(core, g) for g in active]
        if many is not None:
            steps = await worker.run(many.draft_many, rows)
        else:
            steps = [await worker.run(drafter.draft, rows[0])]
            active = active[:1]
        _grow(core, active, steps, grown)
        any_grew = True
    core.settle_branches()
    return any_grew


async def draft_loop(
    core: DraftingCore,
    drafter: DraftModel,
    worker: ModelWorker,
    signal: Signal,
    submit: Callable[[DraftPlan, list[int], list[Probs], list[Rival]], None],
    hedge: Callable[[HedgePlan, list[int]], None] | None = None,
    grown: Callable[[list[EdgeEvent]], None] | None = None,
) -> None:
    """Draft batches while the generation runs; ``submit`` hands each to the core and writes
    its frames. Outcome pre-drafting (``cfg.predraft``): each draft step also grows the
    prepared branches (:meth:`~edge_agent.session.drafting.DraftingCore.branch_rows`: where a
    rejection is likely, the batch being drafted's positions included) in the same batched
    forward, beside the batch (:class:`~edge_agent.model.drafter.BranchDrafting`: up to
    ``branch_batch`` rows, the batch's one of them), and while the pipeline is full they grow
    alone; a batch that a rejection opens is then sent at once
    (``BranchBook.take_branch``). With ``hedge``, the pipeline's idle time then drafts hedges
    (``BranchBook.hedge_plan``). ``grown`` carries out what a grown branch sends (token
    trees). Waiting for room (backpressure, stop-and-wait) is counted as drafter idle time."""
    gen, cfg = core.gen, core.cfg
    want_rival = (hedge is not None and cfg.hedge > 0) or cfg.predraft > 0
    many = drafter if isinstance(drafter, BranchDrafting) and cfg.predraft else None
    beside = many.branch_batch - 1 if many is not None else 0
    while not gen.done:
        if not core.may_draft():
            if cfg.predraft and await _predraft(core, drafter, worker, grown):
                continue
            hp = core.pipe.book.hedge_plan() if hedge is not None else None
            if hedge is not None and hp is not None:
                hedge(hp, await _draft_hedge(core, drafter, worker, hp))
                continue
            t0 = time.perf_counter()
            await signal.wait_for(lambda: gen.done or core.may_draft())
            gen.stats.drafter_wait_s += time.perf_counter() - t0
            continue
        plan, start = core.start_batch()
        draft, q_rows, rivals, prob = start.draft, start.q_rows, start.rivals, start.prob
        while core.pipe.wants_more(plan, draft, prob):
            t0 = time.perf_counter()
            row = DraftRow(
                plan.context + draft, cfg.sampling, core.rng, plan.deterministic, want_rival
            )
            pending = PendingBatch(len(plan.context), list(draft), list(rivals))
            branches = core.branch_rows(beside, pending) if beside else []
            if many is not None and branches:
                steps = await worker.run(
                    many.draft_many, [row, *(_branch_row(core, g) for g in branches)]
                )
                step = steps[0]
                _grow(core, branches, steps[1:], grown)
            else:
                step = await worker.run(drafter.draft, row)
            core.on_draft_step(time.perf_counter() - t0)
            if not core.pipe.current(plan, [*draft, step.token]):
                break  # a rejection (or a differing co-generated token) voided this batch
            draft.append(step.token)
            q_rows.append(step.q)
            rivals.append(step.rival or NO_RIVAL)
            prob = step.prob
        submit(plan, draft, q_rows, rivals)
        signal.notify()


async def credit_loop(
    core: SingleCore, signal: Signal, carry_out: Callable[[list[EdgeEvent]], None]
) -> None:
    """Cloud-only sessions: send each credit as soon as the core says one is due."""
    while not core.gen.done:
        if core.wants_credit():
            carry_out(core.credit(time.monotonic()))
        await signal.wait_for(lambda: core.gen.done or core.wants_credit())


async def verdict_watchdog(
    core: DraftingCore,
    signal: Signal,
    floor_s: float,
    now: Callable[[], float] = time.monotonic,
) -> None:
    """Raise :class:`VerdictTimeout` when the head batch passes its verdict deadline
    (:meth:`~edge_agent.session.pipeline.Pipeline.verdict_deadline`) with no Verdict."""
    gen = core.gen
    while not gen.done:
        deadline = core.pipe.verdict_deadline(floor_s)
        if deadline is None:
            await signal.wait_for(
                lambda: gen.done or core.pipe.verdict_deadline(floor_s) is not None
            )
            continue

        def moved(d: float = deadline) -> bool:
            return gen.done or core.pipe.verdict_deadline(floor_s) != d

        try:
            await signal.wait_for(moved, max(0.0, deadline - now()))
        except asyncio.TimeoutError:
            raise VerdictTimeout(core.pipe.overdue(now(), deadline)) from None


async def run_single(
    core: SingleCore,
    drafter: DraftModel | None,
    worker: ModelWorker,
    transport: Transport,
    *,
    verdict_timeout_s: float = 10.0,
    on_event: Consumer | None = None,
) -> None:
    """Run ``core``'s generation over one established session until it is done (``drafter``
    None: cloud-only, the verifier's co-generation writes the text); ``on_event`` is handed
    the core's Committed and Finished events as they come. Raises
    LinkClosed (VerdictTimeout for a stalled verifier) / VerifierError / DesyncError /
    ProtocolError when the session fails."""
    signal = Signal()
    io = Outbox(transport, core.ctx, core.gen.stats, max_queued=core.cfg.send_queue_bound)

    def carry_out(events: list[EdgeEvent]) -> None:
        for event in events:
            if isinstance(event, Send):
                io.write(event.msg)
            elif isinstance(event, (Committed, Finished)):
                if on_event is not None:
                    on_event(event)
            elif isinstance(event, (Count, Round, RejectionGap)):
                core.gen.stats.apply(event)
            elif isinstance(event, Fail):
                raise event.error
            else:  # a single session has no worker links to drop
                raise AssertionError(f"{event} from a single-verifier core")

    def submit(plan: DraftPlan, draft: list[int], q_rows: list[Probs], rivals: list[Rival]) -> None:
        carry_out(core.propose(plan, draft, q_rows, time.monotonic(), rivals))

    def hedge(hp: HedgePlan, draft: list[int]) -> None:
        carry_out(core.hedge(hp, draft))

    def grown(events: list[EdgeEvent]) -> None:
        # A branch frame is optional: it never takes the room kept for batches and control
        # frames (a link that drains slowly gets fewer branches, never a full queue).
        room = io.room() > core.cfg.send_queue_bound - core.cfg.tree_frames
        carry_out([e for e in events if room or not isinstance(e, Send)])

    carry_out(core.opened())
    if core.gen.done:
        return
    if drafter is not None and core.cfg.cogen and core.prompt_unsent():
        # The prompt goes up at once: the verifier prefills it and sends its forward's token
        # (the first token in one round trip), then co-generates, while the first batch is
        # drafted.
        carry_out(core.credit(time.monotonic()))

    async def reader() -> None:
        while not core.gen.done:
            data = await transport.recv()
            carry_out(core.receive(data, time.monotonic()))
            signal.notify()

    await run_until_first_done(
        (
            credit_loop(core, signal, carry_out)
            if drafter is None
            else draft_loop(core, drafter, worker, signal, submit, hedge, grown)
        ),
        reader(),
        io.writer(),
        verdict_watchdog(core, signal, verdict_timeout_s),
    )
