"""The verifier's engine: one thread that owns the target, its KV pool and every session slot,
and runs the sessions' model work in batched steps.

Three parts (vLLM v1's EngineCore / Scheduler / ModelRunner split, on a small scale):

* this module: the thread, the queue and the futures, the public face the session handlers
  use (:meth:`Engine.run`, :meth:`Engine.call`, :meth:`Engine.open`, :meth:`Engine.release`)
  and what they may ask of it (:meth:`Engine.progress`, :meth:`Engine.queue_delay_s`);
* :mod:`cloud_verifier.engine.scheduler`: which queued requests make the next step (pure);
* :mod:`cloud_verifier.engine.runner`: the step itself, rows → one batched forward → decisions, and
  the slots' model state (the one owner of each cache length).

Requests are typed: the core's :data:`~cloud_verifier.engine.work.Work` for one :class:`Slot`. A
session has at most one request in flight (its core waits for the result), so a step sees each
slot at most once. Stale work never reaches the engine: the core drops it first.

``max_batch_sessions = 1`` is the serial engine (one session per forward, in arrival order), kept
for the benchmark's comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final, TypeVar

import torch

from cloud_verifier.engine.draft_model import CloudDrafter
from cloud_verifier.engine.kv_manager import KVManager, Shares, Slot
from cloud_verifier.engine.prefix_cache import PrefixCache
from cloud_verifier.engine.runner import FORWARDS, Prefilled, Runner, Timing, advance
from cloud_verifier.engine.scheduler import (
    BatchLimits,
    Kind,
    Pages,
    Queued,
    Row,
    RunningStep,
    as_planned,
    forward_entry,
    plan_step,
    queue_eta,
    should_gather,
)
from cloud_verifier.engine.step_times import StallRule, StepTimes
from cloud_verifier.engine.targets import Target
from cloud_verifier.engine.work import (
    Failed,
    FailureKind,
    Result,
    Skipped,
    Verified,
    Verify,
    Work,
    WorkProgress,
    deferred,
)
from shared.errors import WanspecError
from shared.runtime.kv_pool import PagedKV
from shared.wire.messages import Hello

__all__ = [
    "AUTO_KV_FRACTION",
    "AUTO_KV_TOKENS_CPU",
    "Engine",
    "EngineClosed",
    "EngineHealth",
    "EngineLimits",
    "Outcome",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineClosed(WanspecError, RuntimeError):
    """The engine was shut down; no more work runs."""


@dataclass(frozen=True)
class EngineLimits:
    """How the engine batches and how much KV memory it holds.

    ``kv_tokens``: pool size in tokens over all sessions (rounded up to whole pages); 0: auto
    (:func:`_auto_kv_tokens`).
    ``batch_wait_s``: how long a step may wait for the other open sessions' work
    (:func:`~cloud_verifier.engine.scheduler.should_gather`).

    Filled from the settings (``cloud_verifier.daemon.limits.engine_limits``); the defaults are
    the settings' defaults (tests/verifier/test_limits_derived.py holds them equal)."""

    slots: int = 64
    max_batch_sessions: int = 64
    max_batch_tokens: int = 4096
    page_size: int = 16
    kv_tokens: int = 0
    batch_wait_s: float = 0.002
    #: When a running step counts as stalled (progress reports stop; see StepTimes.stalled).
    stall: StallRule = field(default_factory=StallRule)
    #: Shares of the KV pool: one session may hold at most ``session_share`` of its pages, the
    #: sessions of one tenant (bearer token) together ``tenant_share`` (1.0: no own limit).
    session_share: float = 0.5
    tenant_share: float = 0.75
    #: Who shares the prefix cache of the KV pool (off: no prefix caching).
    prefix_cache: PrefixCache = PrefixCache.TENANT
    #: Chunked prefill: prefill tokens a step computes at most while other sessions are
    #: active, shared fairly between tenants (0: no chunking;
    # :mod:`cloud_verifier.engine.scheduler`),
    #: and the share of such a step's time they may add to its rounds' (0: no such bound).
    prefill_chunk: int = 512
    prefill_share: float = 0.25
    #: Rationing speculation (:mod:`cloud_verifier.engine.rationing`); off: every draft whole.
    #: ``ration_share``: what the draft tokens past the promised budgets may add to a step, in
    #: forward overheads (rationing.ration's ``share``).
    ration: bool = True
    ration_share: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.batch_wait_s <= 1.0:
            raise ValueError(f"batch_wait_s must be in [0, 1], got {self.batch_wait_s}")
        for name in ("slots", "max_batch_sessions", "max_batch_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_tokens < 0:
            raise ValueError(f"kv_tokens must be >= 0 (0: auto), got {self.kv_tokens}")
        if not 0.0 < self.ration_share <= 10.0:
            raise ValueError(f"ration_share must be in (0, 10], got {self.ration_share}")
        if not 0.0 <= self.prefill_share <= 10.0:
            raise ValueError(f"prefill_share must be in [0, 10], got {self.prefill_share}")
        for name in ("session_share", "tenant_share"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")

    @property
    def batch(self) -> BatchLimits:
        return BatchLimits(
            self.max_batch_sessions,
            self.max_batch_tokens,
            self.prefill_chunk,
            self.prefill_share,
            self.ration,
            self.ration_share,
        )


@dataclass(frozen=True)
class EngineHealth:
    """What shows the engine making progress, read without queueing behind its work (the
    systemd watchdog and ``/health`` read it). ``alive``: its thread runs and did not die
    (``error`` says why it did); ``stalled``: the running step has run far past its estimate
    (:class:`~cloud_verifier.engine.step_times.StallRule`); ``beat_age_s``: seconds since its thread
    last finished a step or a call (0 while it waits for work)."""

    alive: bool
    stalled: bool
    error: str | None
    beat_age_s: float


#: The figures of Engine.memory().
MEMORY_KEYS = (
    "pages_total",
    "pages_used",
    "bytes_total",
    "bytes_used",
    "pages_cached",
    "prefix_hit_tokens",
    "prefix_evictions",
)


@dataclass(frozen=True)
class Outcome:
    result: Result
    timing: Timing | None
    queued_s: float  # from submission to the start of its step


@dataclass(eq=False)
class _Request:
    slot: Slot
    work: Work
    future: asyncio.Future[Outcome]
    loop: asyncio.AbstractEventLoop
    submitted: float
    #: When it (or, for a chunked prefill, its rest) was last queued: what admission counts as
    #: its wait.
    queued_at: float = 0.0
    #: Its awaiter went away (under the lock): it leaves the queue and is never queued again.
    cancelled: bool = False


@dataclass(eq=False)
class _Call:
    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


def _resolve(
    fut: asyncio.Future[Any], value: Any = None, error: BaseException | None = None
) -> None:
    if fut.done():  # cancelled by its awaiter meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def _queued(item: _Request | _Call) -> Queued:
    """What the scheduler needs to know of a queue entry."""
    if isinstance(item, _Call):
        return Queued(Kind.CALL)
    work = item.work
    if isinstance(work, FORWARDS):
        slot = item.slot
        return forward_entry(work, slot.tenant, slot.length, len(slot.pages.pages))
    return Queued(Kind.CHEAP)


#: kv_tokens = 0 ("auto"): on the CPU (where untouched pages cost nothing) this many tokens; on
#: CUDA, what ``AUTO_KV_FRACTION`` of the free memory after loading holds.
AUTO_KV_TOKENS_CPU = 16384
#: On the CPU, the pool never takes more than this share of the machine's memory.
AUTO_KV_FRACTION_CPU = 0.1
AUTO_KV_FRACTION = 0.8

#: Seconds over which observed queueing delays count for admission (Engine.queue_delay_s).
WAIT_MEMORY_S: Final = 10.0
#: A session that sent work this recently is active even while none of it is queued (its next
#: round is on its way: a generating edge sends one every round trip plus its draft time), so a
#: prefill beside it gets the shared budget, not the whole step.
ACTIVE_S: Final = 2.0
#: Steps whose rounds' tokens make the typical step a prefill budget is sized against.
TYPICAL_STEPS: Final = 8


def _auto_kv_tokens(target: Target, draft: Target | None = None) -> int:
    """Tokens of the KV pool (and of the draft model's, which has as many pages): on CUDA,
    :data:`AUTO_KV_FRACTION` of the memory free after loading, over both pools' bytes per
    token."""
    per_token = target.kv_bytes_per_token() + (draft.kv_bytes_per_token() if draft else 0)
    if per_token == 0:
        return AUTO_KV_TOKENS_CPU
    if target.device.type != "cuda":
        # A CPU verifier serves a few sessions: enough for them, and never a large share of
        # the machine's memory (the pool is preallocated).
        memory = _physical_memory()
        cap = int(memory * AUTO_KV_FRACTION_CPU) // per_token if memory else AUTO_KV_TOKENS_CPU
        return max(1024, min(AUTO_KV_TOKENS_CPU, cap))
    free, _total = torch.cuda.mem_get_info(target.device)
    tokens = int(free * AUTO_KV_FRACTION) // per_token
    log.info(
        "KV cache: %d tokens (%.0f%% of %.1f GiB free)",
        tokens,
        100 * AUTO_KV_FRACTION,
        free / 2**30,
    )
    return max(tokens, 1)


def _physical_memory() -> int:
    """Bytes of memory of this machine (0: unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


class Engine:
    """The engine's thread and queue in front of a :class:`~cloud_verifier.engine.runner.Runner`.

    Invariants: ``runner`` is set once, by :meth:`load`; only the engine's thread touches the
    runner (the pool, the slots' model state, the model); ``steps``, ``times``, the running
    step, the queue and the tenants' slots are read and written under the lock.
    """

    def __init__(self, limits: EngineLimits | None = None) -> None:
        self.limits = limits or EngineLimits()
        self.runner: Runner | None = None
        self.cogen_skipped = 0  # Generates that found no room in a step (engine thread)
        #: Verifies whose first batch the ration cut / whose later batches it deferred (engine
        #: thread).
        self.cut_rounds = 0
        self.deferred_rounds = 0
        self.warm = False
        #: Steps completed (engine thread; read under the lock).
        self.steps = 0
        #: Seconds the engine spent in steps (forwards and decisions): the verifier's busy time
        #: (engine thread; read under the lock).
        self.busy_s = 0.0
        #: Step time against tokens (written and read under the lock).
        self.times = StepTimes()
        self._running_step: RunningStep | None = None
        #: (when, seconds) the oldest request of each recent step waited in the queue.
        self._waits: deque[tuple[float, float]] = deque(maxlen=64)
        self._queue: deque[_Request | _Call] = deque()
        self._cv = threading.Condition()
        self._closed = False
        #: The one owner of the session slots and of who may hold which pages.
        self.kv = KVManager(
            self.limits.slots,
            Shares(self.limits.session_share, self.limits.tenant_share),
            self.limits.prefix_cache,
        )
        #: Why the engine's thread died (None while it lives; under the lock).
        self._error: str | None = None
        #: When the engine's thread last finished a step or a call (monotonic; under the lock),
        #: and whether it is waiting for work now.
        self._beat = time.monotonic()
        self._idle = True
        #: The running step's requests (under the lock): failed too if the thread dies.
        self._running: list[_Request] = []
        #: When each open slot last sent work (under the lock): who is active.
        self._seen: dict[int, float] = {}
        #: The rounds' tokens of the last steps, by tenant (under the lock).
        self._round_tokens: deque[dict[str, int]] = deque(maxlen=TYPICAL_STEPS)
        #: ... and their shapes: (rows, longest row, longest cache) (under the lock).
        self._round_shapes: deque[tuple[int, int, int]] = deque(maxlen=TYPICAL_STEPS)
        #: What each tenant has saved towards its next prefill chunk beside other tenants'
        #: rounds (the scheduler's deficit round robin; engine thread).
        self._credit: dict[str, float] = {}
        self._thread = threading.Thread(target=self._main, name="wanspec-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ event-loop side

    @property
    def target(self) -> Target | None:
        return None if self.runner is None else self.runner.target

    @property
    def pool(self) -> PagedKV | None:
        return None if self.runner is None else self.runner.pool

    @property
    def forwards(self) -> int:
        """Batched forward passes so far."""
        return 0 if self.runner is None else self.runner.forwards

    @property
    def rows_forwarded(self) -> int:
        """Session rows in them."""
        return 0 if self.runner is None else self.runner.rows_forwarded

    @property
    def ready(self) -> bool:
        return self.runner is not None

    def require_runner(self) -> Runner:
        if self.runner is None:
            raise RuntimeError("the target model is not loaded yet")
        return self.runner

    def require_target(self) -> Target:
        return self.require_runner().target

    @property
    def max_context(self) -> int:
        """Tokens one session may hold (:attr:`Runner.max_context`)."""
        return self.require_runner().max_context

    def _put(self, item: _Request | _Call) -> None:
        with self._cv:
            if self._closed:
                raise EngineClosed(self._error or "the engine has been shut down")
            if isinstance(item, _Request):
                self._seen[item.slot.index] = item.submitted
            self._queue.append(item)
            self._cv.notify()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine's thread, between steps (load, warm-up, ping, adopt)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._put(_Call(fn, fut, loop))
        return await fut

    async def load(
        self,
        loader: Callable[[], Target],
        *,
        warm_up: bool = True,
        draft_loader: Callable[[Target], Target] | None = None,
    ) -> Target:
        """Load the target on the engine's thread (so it lives where it runs), allocate the KV
        pool and, with ``warm_up``, run one batched step of every bucketed shape class and time
        the step-time anchors. ``draft_loader``: the cloud draft model, from the target
        (cloud_draft_model), with a KV pool of as many pages as the target's."""
        lim = self.limits

        def job() -> Runner:
            target = loader()
            draft = draft_loader(target) if draft_loader is not None else None
            tokens = lim.kv_tokens or _auto_kv_tokens(target, draft)
            pool = target.allocate(-(-tokens // lim.page_size), lim.page_size)
            self.kv.attach(pool, target.fingerprint)
            drafter = None
            if draft is not None:
                draft_pool = draft.allocate(pool.num_pages, lim.page_size)
                drafter = CloudDrafter(draft, draft_pool, target.vocab_size)
            return Runner(target, self.kv, drafter)

        runner = await self.call(job)
        self.runner = runner
        if warm_up:
            anchors = await self.call(lambda: runner.warm_up(lim.max_batch_sessions))
            with self._cv:
                for tokens, seconds in anchors:
                    self.times.anchor(tokens, seconds)
        self.warm = True
        return runner.target

    def open(self, hello: Hello, tenant: str = "") -> Slot:
        """A slot for a session that said Hello
        (:class:`~cloud_verifier.engine.kv_manager.NoFreeSlot` when all are taken)."""
        return self.kv.open(hello, tenant, self.require_target().device)

    def adopt(self, slot: Slot, hello: Hello, keep: int) -> list[int]:
        """On the engine's thread (:meth:`call`): :meth:`Runner.adopt` of a lost session's
        slot for a new session."""
        if slot.released:
            raise EngineClosed("the session's slot was released")
        return self.require_runner().adopt(slot, hello, keep)

    def release(self, slot: Slot) -> None:
        """End a session: its queued work is answered Failed at once, its pages go back to the
        pool (on the engine's thread, after whatever of its work is running)."""
        if not self.kv.close(slot):
            return
        with self._cv:
            self._seen.pop(slot.index, None)
            mine = [i for i in self._queue if isinstance(i, _Request) and i.slot is slot]
            for req in mine:
                self._queue.remove(req)
                req.cancelled = True
                self._finish(
                    req,
                    Failed("the session ended", slot.length, FailureKind.ENDED),
                    None,
                    req.submitted,
                )
            runner = self.runner
            if not self._closed and runner is not None:
                loop = asyncio.get_running_loop()
                fut: asyncio.Future[None] = loop.create_future()
                # Nobody awaits it: take its outcome so that a shutdown's EngineClosed is quiet.
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
                self._queue.append(_Call(lambda: runner.free(slot), fut, loop))
                self._cv.notify()

    @property
    def slots_used(self) -> int:
        return self.kv.slots_used

    def busy_seconds(self) -> float:
        """Seconds spent in steps since the engine started (the verifier's busy time)."""
        with self._cv:
            return self.busy_s

    def memory(self) -> dict[str, int]:
        """KV pool figures for /metrics and /health (read without a lock: gauges)."""
        pool = self.pool
        runner = self.runner
        if pool is None or runner is None:
            return dict.fromkeys(MEMORY_KEYS, 0)
        page_bytes = pool.bytes_per_token * pool.page_size
        used = pool.pages_used
        return {
            "pages_total": pool.num_pages,
            "pages_used": used,
            "bytes_total": pool.bytes_total,
            "bytes_used": used * page_bytes,
            "pages_cached": pool.pages_cached,
            "prefix_hit_tokens": runner.prefix_hit_tokens,
            "prefix_evictions": pool.evictions,
        }

    @property
    def pages_free(self) -> int:
        pool = self.pool
        return 0 if pool is None else pool.pages_available

    def progress(self, slot: Slot) -> WorkProgress:
        """Where ``slot``'s work stands (read from the event loop, under the lock)."""
        now = time.perf_counter()
        with self._cv:
            run = self._running_step
            running = run is not None and slot.index in run.slots
            queue = [_queued(item) for item in self._queue]
            at = next(
                (
                    i
                    for i, item in enumerate(self._queue)
                    if isinstance(item, _Request) and item.slot is slot
                ),
                None,
            )
            eta, stalled = queue_eta(
                run,
                now,
                queue,
                self.times,
                self.limits.batch,
                self.limits.stall,
                at,
                queued=at is not None,
            )
            ahead = (
                0
                if at is None
                else sum(1 for q in queue[:at] if q.kind in (Kind.FORWARD, Kind.COGEN))
            )
            return WorkProgress(self.steps, ahead, running, eta, stalled)

    def queue_delay_s(self) -> float:
        """How long a round submitted now would wait for its step: the larger of the estimate
        from the queue and step times (:func:`~cloud_verifier.engine.scheduler.queue_eta`), and the
        longest wait any recent step's requests saw since they were (re)queued (within
        ``WAIT_MEMORY_S``: a prefill's chunks count as chunks, not as the prompt's age).
        Admission control reads it."""
        now = time.perf_counter()
        with self._cv:
            queue = [_queued(item) for item in self._queue]
            eta, _ = queue_eta(
                self._running_step, now, queue, self.times, self.limits.batch, self.limits.stall
            )
            seen = max((w for t, w in self._waits if now - t <= WAIT_MEMORY_S), default=0.0)
        return max(eta, seen)

    async def run(self, slot: Slot, work: Work) -> Outcome:
        """Queue ``work`` for ``slot`` and wait for its outcome. Cancelling the awaiting task
        takes the work off the queue (the rest of a chunked prefill too): a session whose
        connection went spends no more of the engine's time."""
        if slot.released:
            raise EngineClosed("the session's slot was released")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Outcome] = loop.create_future()
        now = time.perf_counter()
        req = _Request(slot, work, fut, loop, now, now)
        self._put(req)
        try:
            return await fut
        except asyncio.CancelledError:
            with self._cv:
                req.cancelled = True
                with contextlib.suppress(ValueError):
                    self._queue.remove(req)
            raise

    def worker_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def health(self) -> EngineHealth:
        """The engine's liveness (:class:`EngineHealth`), from its thread's own beat: never
        queued behind a step."""
        now = time.monotonic()
        with self._cv:
            error = self._error
            alive = self._thread.is_alive() and error is None
            run = self._running_step
            stalled = run is not None and self.times.stalled(
                run.tokens, time.perf_counter() - run.started, self.limits.stall
            )
            age = 0.0 if self._idle else now - self._beat
        return EngineHealth(alive, stalled, error, age)

    async def ping(self, timeout: float) -> bool:
        """True when a no-op call completes on the engine's thread within ``timeout`` seconds
        (calls run before the next step: it waits for the running step at most)."""
        if not self.worker_alive():
            return False
        try:
            await asyncio.wait_for(self.call(lambda: None), timeout)
        except (asyncio.TimeoutError, EngineClosed, RuntimeError):
            return False
        return True

    def shutdown(self) -> None:
        """Stop accepting work; queued work fails with EngineClosed, a running step finishes."""
        self._fail_queue("the engine has been shut down")
        if threading.current_thread() is not self._thread:
            # Wait out a running step (bounded): torch must not be torn down under it.
            self._thread.join(timeout=10.0)

    def _fail_queue(self, why: str) -> None:
        """Close the queue and fail everything in it with EngineClosed(``why``)."""
        with self._cv:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for item in dropped:
            err = EngineClosed(why)
            with contextlib.suppress(RuntimeError):  # its loop may be closed already
                item.loop.call_soon_threadsafe(_resolve, item.future, None, err)

    # ------------------------------------------------------------------ engine thread

    def _main(self) -> None:
        try:
            self._serve()
        except BaseException as e:
            # The thread dies: say why, and no session waits for an answer that cannot come.
            why = f"the model engine stopped: {type(e).__name__}: {e}"
            log.critical("%s", why, exc_info=True)
            with self._cv:
                self._error = why
                running = self._running
            self._fail_queue(why)
            for req in running:
                err = EngineClosed(why)
                with contextlib.suppress(RuntimeError):
                    req.loop.call_soon_threadsafe(_resolve, req.future, None, err)
        finally:
            # A tensor-parallel target tells its follower ranks to stop (from this thread,
            # after the last step: every rank sees the same commands in the same order).
            close = getattr(self.target, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    log.exception("closing the target failed")

    def _serve(self) -> None:
        while True:
            heartbeat: Callable[[], None] | None = None
            with self._cv:
                self._beat, self._idle = time.monotonic(), not self._queue
                while not self._queue and not self._closed:
                    # A tensor-parallel target's followers wait for a command with a deadline:
                    # while idle, it sends them a heartbeat every ``idle_tick_s``.
                    beat = getattr(self.target, "heartbeat", None)
                    tick = float(getattr(self.target, "idle_tick_s", 0.0) or 0.0)
                    if not callable(beat) or tick <= 0:
                        self._cv.wait()
                    elif not self._cv.wait(tick):
                        heartbeat = beat
                        break
                self._beat, self._idle = time.monotonic(), False
                if heartbeat is None:
                    self._gather()
                    if self._closed:
                        return
                    calls, batch, rows = self._take()
            if heartbeat is not None:
                heartbeat()
                continue
            for c in calls:
                try:
                    value = c.fn()
                except BaseException as e:  # handed to the caller
                    c.loop.call_soon_threadsafe(_resolve, c.future, None, e)
                else:
                    c.loop.call_soon_threadsafe(_resolve, c.future, value)
            if batch:
                try:
                    self._step(batch, rows)
                except Exception as e:  # a bug: no session may wait forever for its outcome
                    log.exception("engine step of %d requests failed", len(batch))
                    for req in batch:  # those already answered are left as they are
                        why = f"internal engine error ({type(e).__name__})"
                        self._finish(
                            req,
                            Failed(why, req.slot.length, FailureKind.ENGINE),
                            None,
                            time.perf_counter(),
                        )
                finally:
                    with self._cv:
                        self.steps += 1
                        self._running_step = None
                # (kept when the step raised past Exception: the thread's death fails them)
                with self._cv:
                    self._running = []

    def _gather(self) -> None:
        """Under the lock, with work queued: wait up to ``batch_wait_s`` while the scheduler
        says the other open sessions' forwards are worth waiting for."""
        wait = self.limits.batch_wait_s
        if wait <= 0:
            return
        deadline = time.monotonic() + wait
        while not self._closed:
            queue = [_queued(item) for item in self._queue]
            if any(q.kind == Kind.CALL for q in queue):
                return  # a call never waits
            if not should_gather(queue, self.slots_used, self.limits.batch):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(left)

    def _take(self) -> tuple[list[_Call], list[_Request], list[Row]]:
        """Under the lock: the scheduler's next step, taken off the queue; co-generations it
        found no room for are answered Skipped at once. Returns the calls (run first), the
        step's requests and, for each, its row of the plan (a cheap one: chunk 0)."""
        queue = list(self._queue)
        seen = [_queued(item) for item in queue]
        a, b = self.times.coefficients()
        now = time.perf_counter()
        active = {i for i, t in self._seen.items() if now - t <= ACTIVE_S}
        active |= {item.slot.index for item in queue if isinstance(item, _Request)}
        plan = plan_step(
            seen,
            self.limits.batch,
            active_sessions=len(active),
            typical_rounds=self._typical_rounds(),
            typical_shape=max(self._round_shapes, key=lambda s: s[0] * s[1], default=(0, 0, 0)),
            credit=self._credit,
            # nothing measured yet (or no cost per token): rows share one forward
            overhead_tokens=a / b if b > 0 else math.inf,
            pages=None if self.kv.pool is None else Pages(self.kv.pages_free(), self.kv.page_size),
        )
        taken = plan.taken
        if plan.rows:
            rounds: dict[str, int] = {}
            longest = count = kv = 0
            for r in plan.rows:
                q = seen[r.index]
                if not q.prefill:
                    rounds[q.tenant] = rounds.get(q.tenant, 0) + r.tokens
                    count, longest = count + 1, max(longest, r.tokens)
                    kv = max(kv, q.cached + r.tokens)
            self._round_tokens.append(rounds)
            self._round_shapes.append((count, longest, kv))
        self._credit = dict(plan.credit)
        self._queue = deque(item for i, item in enumerate(queue) if i not in taken)
        calls = [queue[i] for i in plan.calls]
        row_of = {r.index: r for r in plan.rows}
        work = [(queue[i], row_of.get(i, Row(i, 0, 0))) for i in plan.work]
        t0 = time.perf_counter()
        for i in plan.skipped:
            req = queue[i]
            assert isinstance(req, _Request)
            self.cogen_skipped += 1
            self._finish(req, Skipped(), None, t0)
        assert all(isinstance(c, _Call) for c in calls)
        requests = [r for r, _ in work if isinstance(r, _Request)]
        rows = [row for r, row in work if isinstance(r, _Request)]
        assert len(requests) == len(work)
        if requests:
            slots = frozenset(r.slot.index for r in requests)
            self._running_step = RunningStep(t0, plan.tokens, slots)
            self._running = requests
            self._waits.append((t0, t0 - min(r.queued_at for r in requests)))
            # A tenant's prompts wait behind each other (oldest first), not behind the engine:
            # while one of them is served, the others' wait starts again (what admission reads
            # is the engine's own delay, not one tenant's backlog).
            served = {seen[r.index].tenant for r in plan.rows if seen[r.index].prefill}
            for item in self._queue:
                if not isinstance(item, _Request) or item.slot.tenant not in served:
                    continue
                if _queued(item).prefill:
                    item.queued_at = t0
        return [c for c in calls if isinstance(c, _Call)], requests, rows

    def _typical_rounds(self) -> dict[str, int]:
        """Under the lock: each tenant's largest rounds' tokens in the last steps."""
        out: dict[str, int] = {}
        for step in self._round_tokens:
            for tenant, n in step.items():
                out[tenant] = max(out.get(tenant, 0), n)
        return out

    def _finish(self, req: _Request, result: Result, timing: Timing | None, t0: float) -> None:
        outcome = Outcome(result, timing, t0 - req.submitted)
        req.loop.call_soon_threadsafe(_resolve, req.future, outcome)

    def _step(self, batch: list[_Request], rows: list[Row]) -> None:
        t0 = time.perf_counter()
        runner = self.require_runner()
        for req, row in zip(batch, rows, strict=True):
            if row.cut is not None and isinstance(req.work, Verify):
                if deferred(req.work, row.cut):
                    self.deferred_rounds += 1
                else:
                    self.cut_rounds += 1
        works = [as_planned(req.work, row) for req, row in zip(batch, rows, strict=True)]
        try:
            answers = runner.step(
                [(req.slot, w) for req, w in zip(batch, works, strict=True)],
                [(row.chunk, row.forward) for row in rows],
            )
        finally:  # a step that raised was busy time too
            with self._cv:
                self.busy_s += time.perf_counter() - t0
        again: list[_Request] = []
        answers = [
            (
                (replace(res, cut=row.cut, budget=row.budget, tree=row.tree), t)
                if isinstance(res, Verified)
                else (res, t)
            )
            for (res, t), row in zip(answers, rows, strict=True)
        ]
        for req, (result, timing) in zip(batch, answers, strict=True):
            if isinstance(result, Prefilled):  # a chunk of a long prefill: the rest goes next
                req.work = advance(req.work, result.cache_len)
                again.append(req)
            else:
                self._finish(req, result, timing, t0)
        now = time.perf_counter()
        with self._cv:
            # The rest of a prefill goes back ahead of later prefills (rounds go first anyway:
            # the scheduler), waiting from now; one whose awaiter went is dropped.
            again = [req for req in again if not req.cancelled]
            for req in again:
                req.queued_at = now
            self._queue.extendleft(reversed(again))
            if again:
                self._cv.notify_all()
            for tokens, seconds in runner.last_forwards:
                self.times.observe(tokens, seconds)
