"""The verifier's engine: one thread that owns the target, its KV pool and every session slot,
and runs the sessions' model work in batches.

Requests are typed: the core's :data:`~shared.verifier_core.Work` (``Verify``: prefill / extend
with fixed tokens and verify a draft; ``Federate``; ``Crop``: rollback; ``Draw``: more
candidates) for one :class:`Slot`. Each step of the engine's thread takes the pending requests in
arrival order and

* answers every ``Crop`` (a pointer move in the pool) and ``Draw`` (a device draw from the row
  kept at the last rejection);
* runs every ``Verify`` and ``Federate`` that fits in one **batched forward**: at most
  ``max_batch_sessions`` rows and ``max_batch_tokens`` padded tokens (rows × longest row); the
  oldest request always fits, so no session starves, and what does not fit is first in the next
  step;
* then, on the device and batched over the sessions (:mod:`shared.device_sampling`), applies the
  sampling transform and decides: *accepted* prefix, *recovered* correction or *bonus* token, or
  the federated rows. Only ids, counts and the few correction values reach the host.

A session has at most one request in flight (its core waits for the result), so a step sees
each slot at most once. Stale work never reaches the engine: the core drops it first. A forward
is committed (the slots' lengths moved) only once it returned; a failure leaves each slot as it
was before the request (:class:`~shared.verifier_core.Failed` says so).

``max_batch_sessions = 1`` is the serial engine (one session per forward, in arrival order), kept
for the benchmark's comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import numpy as np
import torch

from cloud_verifier.step_times import StallRule, StepTimes
from cloud_verifier.targets import Target
from shared import device_sampling as ds
from shared.batched_lm import Row
from shared.kv_pool import OutOfPages, PagedKV, SlotPages
from shared.protocol import Hello
from shared.verifier_core import (
    Crop,
    Cropped,
    Draw,
    Drawn,
    Failed,
    Federate,
    Federated,
    Generate,
    Result,
    Skipped,
    Verified,
    Verify,
    Work,
    WorkProgress,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineClosed(RuntimeError):
    """The engine was shut down; no more work runs."""


class NoFreeSlot(RuntimeError):
    """Every session slot is taken."""


@dataclass(frozen=True)
class EngineLimits:
    """How the engine batches and how much KV memory it holds.

    ``kv_tokens``: pool size in tokens over all sessions (rounded up to whole pages); 0: auto
    (:func:`_auto_kv_tokens`).
    ``batch_wait_s``: how long a step may wait for the other open sessions' work
    (:meth:`Engine._gather`)."""

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
    session_share: float = 1.0
    tenant_share: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.batch_wait_s <= 1.0:
            raise ValueError(f"batch_wait_s must be in [0, 1], got {self.batch_wait_s}")
        for name in ("slots", "max_batch_sessions", "max_batch_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_tokens < 0:
            raise ValueError(f"kv_tokens must be >= 0 (0: auto), got {self.kv_tokens}")
        for name in ("session_share", "tenant_share"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class Timing:
    forward_s: float  # the batched forward alone
    job_s: float  # the step: forward + sampling transform + decisions
    batch: int  # sessions in the forward


@dataclass(frozen=True)
class _Running:
    """The step on the engine's thread: when it started, its padded tokens, its slots."""

    started: float
    tokens: int
    slots: frozenset[int]


#: Seconds over which observed queueing delays count for admission (Engine.queue_delay_s).
WAIT_MEMORY_S: Final = 10.0


@dataclass(frozen=True)
class Outcome:
    result: Result
    timing: Timing | None
    queued_s: float  # from submission to the start of its step


@dataclass(eq=False)
class Slot:
    """One session's model side: its pages and tokens in the pool, its RNG, the sampling
    parameters of its Hello, and p at the last rejected position (candidates mode, for Draw).
    Touched only on the engine's thread once opened."""

    index: int
    hello: Hello
    generator: torch.Generator | None
    #: Who holds it (the bearer token's key): the KV quota counts a tenant's slots together.
    tenant: str = ""
    pages: SlotPages = field(default_factory=SlotPages)
    tokens: list[int] = field(default_factory=list)
    kept: tuple[torch.Tensor, int] | None = None  # ([V] probs on the device, rejected id)
    released: bool = False

    @property
    def length(self) -> int:
        return self.pages.length


@dataclass(eq=False)
class _Request:
    slot: Slot
    work: Work
    future: asyncio.Future[Outcome]
    loop: asyncio.AbstractEventLoop
    submitted: float


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


#: kv_tokens = 0 ("auto"): on the CPU (where untouched pages cost nothing) this many tokens; on
#: CUDA, what ``AUTO_KV_FRACTION`` of the free memory after loading holds.
AUTO_KV_TOKENS_CPU = 65536
AUTO_KV_FRACTION = 0.8


def _auto_kv_tokens(target: Target) -> int:
    per_token = target.kv_bytes_per_token()
    if target.device.type != "cuda" or per_token == 0:
        return AUTO_KV_TOKENS_CPU
    free, _total = torch.cuda.mem_get_info(target.device)
    tokens = int(free * AUTO_KV_FRACTION) // per_token
    log.info(
        "KV cache: %d tokens (%.0f%% of %.1f GiB free)",
        tokens,
        100 * AUTO_KV_FRACTION,
        free / 2**30,
    )
    return max(tokens, 1)


#: Work that needs a forward of the target.
_FORWARDS: Final = (Verify, Federate, Generate)


def _wants_bonus(work: Work) -> bool:
    return isinstance(work, Generate) or (isinstance(work, Verify) and work.want_bonus)


@dataclass
class _Planned:
    request: _Request
    row: Row
    start: int  # the slot's length before the forward
    work: Verify | Federate | Generate


class Engine:
    """The target model, its KV pool and the thread that runs every session's model work.

    Invariants: ``target`` and ``pool`` are set once, by :meth:`load`; only the engine's thread
    touches the pool, the slots' pages and tokens and the model; ``forwards`` (batched forward
    passes) and ``rows_forwarded`` (session rows in them) are written by that thread only.
    """

    def __init__(self, limits: EngineLimits | None = None) -> None:
        self.limits = limits or EngineLimits()
        self.target: Target | None = None
        self.pool: PagedKV | None = None
        self.forwards = 0
        self.cogen_skipped = 0  # Generates that found no room in a step (engine thread)
        self.rows_forwarded = 0
        self.warm = False
        #: Steps completed (engine thread; read under the lock).
        self.steps = 0
        #: Step time against tokens (written and read under the lock).
        self.times = StepTimes()
        self._running_step: _Running | None = None
        #: (when, seconds) the oldest request of each recent step waited in the queue.
        self._waits: deque[tuple[float, float]] = deque(maxlen=64)
        self._queue: deque[_Request | _Call] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._free_slots = list(range(self.limits.slots - 1, -1, -1))
        #: Open slots per tenant (changed under the lock; the KV quota reads it).
        self._tenants: dict[str, set[Slot]] = {}
        self._thread = threading.Thread(target=self._main, name="wanspec-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ event-loop side

    @property
    def ready(self) -> bool:
        return self.target is not None

    def require_target(self) -> Target:
        if self.target is None:
            raise RuntimeError("the target model is not loaded yet")
        return self.target

    @property
    def max_context(self) -> int:
        """Tokens one session may hold: the model's limit, capped by the session's share of
        the pool."""
        target = self.require_target()
        assert self.pool is not None  # allocated with the target, by load()
        pool_tokens = self.session_pages * self.pool.page_size
        return pool_tokens if target.max_length is None else min(target.max_length, pool_tokens)

    def _put(self, item: _Request | _Call) -> None:
        with self._cv:
            if self._closed:
                raise EngineClosed("the engine has been shut down")
            self._queue.append(item)
            self._cv.notify()

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine's thread, between steps (load, warm-up, ping)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._put(_Call(fn, fut, loop))
        return await fut

    async def load(self, loader: Callable[[], Target], *, warm_up: bool = True) -> Target:
        """Load the target on the engine's thread (so it lives where it runs), allocate the KV
        pool and, with ``warm_up``, run one batched step of every bucketed shape class."""

        def job() -> Target:
            target = loader()
            tokens = self.limits.kv_tokens or _auto_kv_tokens(target)
            pages = -(-tokens // self.limits.page_size)
            self.pool = target.allocate(pages, self.limits.page_size)
            return target

        target = await self.call(job)
        self.target = target
        if warm_up:
            await self.call(self._warm_up)
        self.warm = True
        return target

    def open(self, hello: Hello, tenant: str = "") -> Slot:
        """A slot for a session that said Hello (NoFreeSlot when all are taken)."""
        self.require_target()
        if not self._free_slots:
            raise NoFreeSlot(f"all {self.limits.slots} session slots are in use")
        slot = Slot(self._free_slots.pop(), hello, self._generator(hello), tenant)
        with self._cv:
            self._tenants.setdefault(tenant, set()).add(slot)
        return slot

    def _generator(self, hello: Hello) -> torch.Generator | None:
        if hello.sampling.greedy:
            return None
        generator = torch.Generator(device=self.require_target().device)
        if hello.seed is None:
            generator.seed()
        else:
            generator.manual_seed(hello.seed % (1 << 63))
        return generator

    def adopt(self, slot: Slot, hello: Hello, keep: int) -> list[int]:
        """On the engine's thread (:meth:`call`): hand a lost session's ``slot`` to a new
        session of ``hello`` (its sampling, its RNG), its cache cut to at most ``keep`` tokens;
        returns the tokens kept."""
        if slot.released:
            raise EngineClosed("the session's slot was released")
        assert self.pool is not None
        keep = max(0, min(keep, slot.length))
        self.pool.crop(slot.pages, keep)
        del slot.tokens[keep:]
        slot.kept = None
        slot.hello = hello
        slot.generator = self._generator(hello)
        return list(slot.tokens)

    @property
    def session_pages(self) -> int:
        """Pages one session may hold (its share of the pool)."""
        assert self.pool is not None
        return max(1, int(self.pool.num_pages * self.limits.session_share))

    @property
    def tenant_pages(self) -> int:
        """Pages the sessions of one tenant may hold together."""
        assert self.pool is not None
        return max(1, int(self.pool.num_pages * self.limits.tenant_share))

    def release(self, slot: Slot) -> None:
        """End a session: its pending work is dropped, its pages go back to the pool (on the
        engine's thread, after whatever of its work is running)."""
        if slot.released:
            return
        slot.released = True
        self._free_slots.append(slot.index)
        with self._cv:
            held = self._tenants.get(slot.tenant)
            if held is not None:
                held.discard(slot)
                if not held:
                    del self._tenants[slot.tenant]
            if not self._closed:
                loop = asyncio.get_running_loop()
                fut: asyncio.Future[None] = loop.create_future()
                # Nobody awaits it: take its outcome so that a shutdown's EngineClosed is quiet.
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
                self._queue.append(_Call(lambda: self._free_pages(slot), fut, loop))
                self._cv.notify()

    @property
    def slots_used(self) -> int:
        return self.limits.slots - len(self._free_slots)

    def memory(self) -> dict[str, int]:
        """KV pool figures for /metrics and /health (read without a lock: gauges)."""
        pool = self.pool
        if pool is None:
            return {"pages_total": 0, "pages_used": 0, "bytes_total": 0, "bytes_used": 0}
        page_bytes = pool.bytes_per_token * pool.page_size
        used = pool.pages_used
        return {
            "pages_total": pool.num_pages,
            "pages_used": used,
            "bytes_total": pool.bytes_total,
            "bytes_used": used * page_bytes,
        }

    @property
    def pages_free(self) -> int:
        return 0 if self.pool is None else len(self.pool.free)

    def _eta(self, now: float, ahead_tokens: list[int]) -> tuple[float, bool]:
        """Under the lock: seconds until the running step ends and the forward requests of
        ``ahead_tokens`` (token counts, queue order) have run, and whether the running step
        has stalled. Steps hold ``max_batch_sessions`` rows; each costs a + b·tokens."""
        remaining, stalled = 0.0, False
        run = self._running_step
        if run is not None:
            elapsed = now - run.started
            remaining = max(0.0, self.times.estimate(run.tokens) - elapsed)
            stalled = self.times.stalled(run.tokens, elapsed, self.limits.stall)
        if ahead_tokens:
            a, b = self.times.coefficients()
            steps = -(-len(ahead_tokens) // self.limits.max_batch_sessions)
            remaining += steps * a + b * sum(ahead_tokens)
        return remaining, stalled

    def progress(self, slot: Slot) -> WorkProgress:
        """Where ``slot``'s work stands (read from the event loop, under the lock)."""
        now = time.perf_counter()
        with self._cv:
            run = self._running_step
            running = run is not None and slot.index in run.slots
            tokens: list[int] = []
            found = False
            if not running:
                for item in self._queue:
                    if not isinstance(item, _Request):
                        continue
                    if isinstance(item.work, _FORWARDS):
                        tokens.append(len(item.work.fixed) + len(item.work.draft) + 1)
                    if item.slot is slot:
                        found = True
                        break
            eta, stalled = self._eta(now, tokens if found else [])
            ahead = max(0, len(tokens) - 1) if found else 0
            return WorkProgress(self.steps, ahead, running, eta, stalled)

    def queue_delay_s(self) -> float:
        """How long a forward submitted now would wait for its step: the larger of the
        estimate from the queue and step times, and the longest wait any recent step's oldest
        request saw (within ``WAIT_MEMORY_S``). Admission control reads it."""
        now = time.perf_counter()
        with self._cv:
            tokens = [
                len(item.work.fixed) + len(item.work.draft) + 1
                for item in self._queue
                if isinstance(item, _Request) and isinstance(item.work, _FORWARDS)
            ]
            eta, _ = self._eta(now, tokens)
            seen = max((w for t, w in self._waits if now - t <= WAIT_MEMORY_S), default=0.0)
        return max(eta, seen)

    async def run(self, slot: Slot, work: Work) -> Outcome:
        """Queue ``work`` for ``slot`` and wait for its outcome."""
        if slot.released:
            raise EngineClosed("the session's slot was released")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Outcome] = loop.create_future()
        self._put(_Request(slot, work, fut, loop, time.perf_counter()))
        return await fut

    def worker_alive(self) -> bool:
        return self._thread.is_alive()

    async def ping(self, timeout: float) -> bool:
        """True when a no-op job completes on the engine's thread within ``timeout`` seconds."""
        if not self.worker_alive():
            return False
        try:
            await asyncio.wait_for(self.call(lambda: None), timeout)
        except (asyncio.TimeoutError, EngineClosed, RuntimeError):
            return False
        return True

    def shutdown(self) -> None:
        """Stop accepting work; queued work fails with EngineClosed, a running step finishes."""
        with self._cv:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cv.notify()
        for item in dropped:
            err = EngineClosed("the engine has been shut down")
            with contextlib.suppress(RuntimeError):  # its loop may be closed already
                item.loop.call_soon_threadsafe(_resolve, item.future, None, err)
        if threading.current_thread() is not self._thread:
            # Wait out a running step (bounded): torch must not be torn down under it.
            self._thread.join(timeout=10.0)

    # ------------------------------------------------------------------ engine thread

    def _main(self) -> None:
        try:
            self._serve()
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
                if heartbeat is None:
                    self._gather()
                    if self._closed:
                        return
                    calls, batch = self._take()
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
                    self._step(batch)
                except Exception as e:  # a bug: no session may wait forever for its outcome
                    log.exception("engine step of %d requests failed", len(batch))
                    for req in batch:  # those already answered are left as they are
                        why = f"internal engine error ({type(e).__name__})"
                        self._finish(req, Failed(why, req.slot.length), None, time.perf_counter())
                finally:
                    with self._cv:
                        self.steps += 1
                        self._running_step = None

    def _gather(self) -> None:
        """Under the lock, with work queued: wait up to ``batch_wait_s`` for the other open
        sessions' forwards, unless every open session has one queued (or the step is full).

        Sessions that just got their verdicts send their next Propose a moment later; a step
        started at once would hold only the stragglers of the last one, and the sessions then
        alternate between two half-full steps (each round then takes two steps)."""
        wait = self.limits.batch_wait_s
        if wait <= 0:
            return
        deadline = time.monotonic() + wait
        while not self._closed:
            forwards = sum(
                1
                for item in self._queue
                if isinstance(item, _Request) and isinstance(item.work, _FORWARDS)
            )
            if forwards == 0 or forwards >= min(self.slots_used, self.limits.max_batch_sessions):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(left)

    def _take(self) -> tuple[list[_Call], list[_Request]]:
        """Under the lock: every call and cheap request in arrival order up to the first forward
        that does not fit, and the forwards of one step (module docstring).

        Co-generation gives way: a :class:`Generate` joins the step only in the room the
        drafts to verify leave, and one that finds no room is answered :class:`Skipped` at once
        (its session pauses co-generation until its edge sends a frame)."""
        calls: list[_Call] = []
        batch: list[_Request] = []
        cogen: list[_Request] = []
        forwards, longest = 0, 0
        lim = self.limits

        def fits(n: int) -> bool:
            return forwards < lim.max_batch_sessions and (
                (forwards + 1) * max(longest, n) <= lim.max_batch_tokens
            )

        while self._queue:
            item = self._queue[0]
            if isinstance(item, _Request) and isinstance(item.work, Generate):
                self._queue.popleft()
                cogen.append(item)
                continue
            if isinstance(item, _Request) and isinstance(item.work, (Verify, Federate)):
                n = len(item.work.fixed) + len(item.work.draft) + 1
                if forwards and not fits(n):
                    break
                forwards, longest = forwards + 1, max(longest, n)
            if isinstance(item, _Call) and batch:
                break  # a call runs between steps: after the step queued before it
            self._queue.popleft()
            if isinstance(item, _Call):
                calls.append(item)
            else:
                batch.append(item)
        t0 = time.perf_counter()
        for req in cogen:
            assert isinstance(req.work, Generate)
            n = len(req.work.fixed) + len(req.work.draft) + 1
            if forwards == 0 or fits(n):
                forwards, longest = forwards + 1, max(longest, n)
                batch.append(req)
            else:
                self.cogen_skipped += 1
                self._finish(req, Skipped(), None, t0)
        if batch:
            self._running_step = _Running(
                t0, forwards * longest, frozenset(r.slot.index for r in batch)
            )
            self._waits.append((t0, t0 - min(r.submitted for r in batch)))
        return calls, batch

    def _free_pages(self, slot: Slot) -> None:
        if self.pool is not None:
            self.pool.release(slot.pages)
        slot.tokens.clear()
        slot.kept = None

    def _finish(self, req: _Request, result: Result, timing: Timing | None, t0: float) -> None:
        outcome = Outcome(result, timing, t0 - req.submitted)
        req.loop.call_soon_threadsafe(_resolve, req.future, outcome)

    def _step(self, batch: list[_Request]) -> None:
        t0 = time.perf_counter()
        planned: list[_Planned] = []
        for req in batch:
            slot, work = req.slot, req.work
            if slot.released:
                self._finish(req, Failed("the session ended", slot.length), None, t0)
            elif isinstance(work, Crop):
                self._finish(req, self._crop(slot, work.pos), None, t0)
            elif isinstance(work, Draw):
                self._finish(req, self._draw(slot, work.m), None, t0)
            else:
                plan = self._plan(req, work)
                if isinstance(plan, Failed):
                    self._finish(req, plan, None, t0)
                else:
                    planned.append(plan)
        if planned:
            self._forward(planned, t0)

    def _crop(self, slot: Slot, pos: int) -> Result:
        slot.kept = None
        try:
            assert self.pool is not None
            self.pool.crop(slot.pages, pos)
        except ValueError as e:
            return Failed(f"ValueError: {e}", slot.length)
        del slot.tokens[pos:]
        return Cropped()

    def _draw(self, slot: Slot, m: int) -> Result:
        if slot.kept is None or slot.generator is None:
            return Failed("RuntimeError: no rejected row kept for a Resample", slot.length)
        row, rejected = slot.kept
        try:
            return Drawn(ds.draw_candidates(row, rejected, m, slot.generator))
        except Exception as e:
            return Failed(f"{type(e).__name__}: {e}", slot.length)

    def _plan(self, req: _Request, work: Verify | Federate | Generate) -> _Planned | Failed:
        """The forward row of one Verify/Federate: fixed + draft after the cache; with no fixed
        tokens, the last cached token again (its row scores draft[0]; its keys are rewritten
        with the same values)."""
        slot = req.slot
        slot.kept = None
        start = slot.length
        fixed, draft = work.fixed.tolist(), work.draft.tolist()
        if fixed:
            row_start, ids = start, [*fixed, *draft]
        elif start == 0:
            return Failed("ValueError: no tokens in the cache: nothing to predict from", start)
        else:
            row_start, ids = start - 1, [slot.tokens[-1], *draft]
        target = self.require_target()
        end = row_start + len(ids)
        if target.max_length is not None and end > target.max_length:
            return Failed(
                f"ContextLengthError: context of {end} tokens exceeds the model's maximum of "
                f"{target.max_length}",
                start,
            )
        if min(ids) < 0 or max(ids) >= target.vocab_size:
            return Failed(f"ValueError: token ids must be in [0, {target.vocab_size})", start)
        quota = self._over_quota(slot, end)
        if quota is not None:
            return Failed(quota, start)
        try:
            assert self.pool is not None
            self.pool.reserve(slot.pages, end)
        except OutOfPages as e:
            return Failed(f"OutOfPages: {e}", start)
        return _Planned(req, Row(slot.pages, row_start, tuple(ids), len(draft) + 1), start, work)

    def _over_quota(self, slot: Slot, end: int) -> str | None:
        """Why growing ``slot`` to ``end`` tokens would pass its session's or its tenant's
        share of the pool (None: it would not)."""
        assert self.pool is not None
        size = self.pool.page_size
        need = -(-end // size) - len(slot.pages.pages)
        if need <= 0:
            return None
        lim = self.limits
        if lim.session_share < 1.0 and len(slot.pages.pages) + need > self.session_pages:
            return (
                f"KVQuota: {end} tokens exceed this session's share of the KV cache "
                f"({self.session_pages * size} tokens)"
            )
        if lim.tenant_share >= 1.0:
            return None
        with self._cv:
            mates = list(self._tenants.get(slot.tenant, ()))
        held = sum(len(s.pages.pages) for s in mates if not s.released)
        if held + need > self.tenant_pages:
            return (
                f"KVQuota: this token's sessions hold {held} of the {self.tenant_pages} KV pages "
                f"they may share; {need} more needed"
            )
        return None

    def _forward(self, planned: list[_Planned], t0: float) -> None:
        target = self.require_target()
        try:
            f0 = time.perf_counter()
            logits = target.forward([p.row for p in planned])  # [Σ (γ+1), V]
            forward_s = time.perf_counter() - f0
        except Exception as e:
            self._failed(planned, e, t0)
            return
        self.forwards += 1
        self.rows_forwarded += len(planned)
        padded = len(planned) * max(len(p.row.ids) for p in planned)
        with self._cv:
            self.times.observe(padded, time.perf_counter() - t0)
        for p in planned:  # commit
            slot = p.request.slot
            del slot.tokens[p.row.start :]
            slot.tokens.extend(p.row.ids)
            slot.pages.length = len(slot.tokens)
        gammas = [len(p.work.draft) for p in planned]
        cu = ds.cu_from_gammas(gammas)
        verify = [i for i, p in enumerate(planned) if not isinstance(p.request.work, Federate)]
        federate = [i for i, p in enumerate(planned) if isinstance(p.request.work, Federate)]
        results: dict[int, Result] = {}
        try:
            for group, decide in ((verify, self._decide), (federate, self._federate)):
                if not group:
                    continue
                rows = np.concatenate([np.arange(cu[i] + i, cu[i + 1] + i + 1) for i in group])
                sub = logits if len(group) == len(planned) else logits[torch.as_tensor(rows)]
                results.update(zip(group, decide([planned[i] for i in group], sub), strict=True))
        except Exception as e:
            self._failed(planned, e, t0)
            return
        timing = Timing(forward_s, time.perf_counter() - t0, len(planned))
        for i, p in enumerate(planned):
            self._finish(p.request, results[i], timing, t0)

    def _failed(self, planned: list[_Planned], error: Exception, t0: float) -> None:
        """A batch failed: undo it; one session fails alone, several are run again one by one
        so that only the session whose work fails gets the error."""
        for p in planned:
            self._undo(p)
        if len(planned) == 1:
            p = planned[0]
            self._finish(p.request, Failed(f"{type(error).__name__}: {error}", p.start), None, t0)
            return
        log.info("a batch of %d sessions failed (%s); running them one by one", len(planned), error)
        for p in planned:
            replanned = self._plan(p.request, p.work)
            if isinstance(replanned, Failed):
                self._finish(p.request, replanned, None, t0)
            else:
                self._forward([replanned], t0)

    def _undo(self, p: _Planned) -> None:
        """Back to the slot's state before the request (its length never went below it)."""
        slot = p.request.slot
        assert self.pool is not None
        self.pool.crop(slot.pages, p.start)
        del slot.tokens[p.start :]
        slot.kept = None

    def _decide(self, planned: list[_Planned], logits: torch.Tensor) -> list[Result]:
        """Verdicts of the Verify group: accepted prefix, then recovered or bonus (sampling
        transform on the device, only where a decision needs it: ``verify_logits``)."""
        hellos = [p.request.slot.hello for p in planned]
        gammas = [len(p.work.draft) for p in planned]
        decisions = ds.verify_logits(
            logits,
            [h.sampling for h in hellos],
            np.concatenate([p.work.draft for p in planned]),
            np.concatenate([p.work.q for p in planned]),
            ds.cu_from_gammas(gammas),
            correction=[str(h.correction) for h in hellos],
            want_bonus=[_wants_bonus(p.request.work) for p in planned],
            generators=[p.request.slot.generator for p in planned],
            k=[h.k for h in hellos],
            eps_target=[h.eps_target for h in hellos],
            m=[h.m for h in hellos],
        )
        out: list[Result] = []
        row = 0
        for p, d, g, h in zip(planned, decisions, gammas, hellos, strict=True):
            slot = p.request.slot
            kept = False
            if d.accepted < g:
                keep = p.start + len(p.work.fixed) + d.accepted
                assert self.pool is not None
                self.pool.crop(slot.pages, keep)
                del slot.tokens[keep:]
                if d.candidates is not None:
                    # p at the rejected position, for Resamples: one row, kept on the device
                    r = logits[row + d.accepted][None]
                    s = h.sampling
                    p_row = ds.transform_rows(r, s.temperature, s.top_k, s.top_p)[0]
                    slot.kept = (p_row, int(p.work.draft[d.accepted]))
                    kept = True
            out.append(Verified(d, kept_row=kept))
            row += g + 1
        return out

    def _federate(self, planned: list[_Planned], logits: torch.Tensor) -> list[Result]:
        """SpecFed replies of the Federate group: γ+1 top-K rows, p_j(x_j), the l1 of both
        reconstructions (every row transformed: the edge needs them all)."""
        hellos = [p.request.slot.hello for p in planned]
        gammas = [len(p.work.draft) for p in planned]
        temp, top_k, top_p = ds.row_params([h.sampling for h in hellos], gammas)
        rows = ds.federate_rows(
            ds.transform_rows(logits, temp, top_k, top_p),
            np.concatenate([p.work.draft for p in planned]),
            ds.cu_from_gammas(gammas),
            [h.k for h in hellos],
            [h.eps_target for h in hellos],
        )
        return [Federated(dists, p_draft, l1) for dists, p_draft, l1 in rows]

    def _warm_up(self) -> None:
        """One batched step (and, compiled, one per shape bucket) on a scratch slot, so the
        first session does not pay for lazy initialisation or compilation."""
        target = self.require_target()
        assert self.pool is not None
        compiled = bool(getattr(target, "compiled", False))
        sizes = [1, 2, 4, 8, 16, 32, 64] if compiled else [1]
        for b in sizes:
            if b > self.limits.max_batch_sessions:
                break
            slots = [SlotPages() for _ in range(b)]
            try:
                for s in slots:
                    self.pool.reserve(s, 8)
                target.forward([Row(s, 0, (0,) * 8, 8) for s in slots])
            except OutOfPages:
                log.info("warm-up stopped at batch %d: the KV pool is smaller", b)
                break
            finally:
                for s in slots:
                    self.pool.release(s)
        self._anchor_times(target)

    def _anchor_times(self, target: Target) -> None:
        """Time one forward of 8 tokens and one of up to 128 (warm by now): the anchors of the
        step-time fit, so that the first real steps have an estimate (StepTimes)."""
        assert self.pool is not None
        limit = min(128, self.pool.num_pages * self.pool.page_size)
        if target.max_length is not None:
            limit = min(limit, target.max_length)
        for n in sorted({min(8, limit), limit}):
            pages = SlotPages()
            try:
                self.pool.reserve(pages, n)
                t0 = time.perf_counter()
                target.forward([Row(pages, 0, (0,) * n, min(n, 8))])
                with self._cv:
                    self.times.anchor(n, time.perf_counter() - t0)
            except OutOfPages:
                break
            finally:
                self.pool.release(pages)
