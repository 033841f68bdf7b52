"""Draft steps of concurrent generations, batched into one forward.

An edge that serves several requests at once runs each one's pipeline as before; their draft
steps (:meth:`~edge_agent.model.drafter.Drafter.draft`) come here instead of straight to the model
worker. While a batch runs on the worker, the steps that arrive wait; the next batch takes all
of them (up to ``max_rows``), in arrival order, as one
:meth:`~edge_agent.model.drafter.Drafter.draft_many` forward. Each generation has at most one step
outstanding (its drafter awaits each step), so every generation gets its rows into every batch
it waits for: fair by construction, and a lone generation's steps go at once, unbatched.

A generation's step with the branches growing beside it (``draft_many`` of its row and theirs)
comes here as that many steps, queued in order. Every other call on the worker (prefix
lookups) waits here too, in arrival order, and runs only when no draft step waits. A batch that
fails is retried row by row, so one generation's error (a full context, say) is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from edge_agent.model.drafter import BranchDrafting, Drafter, DraftModel, DraftRow, DraftStep
from edge_agent.model.tasks import ModelWorker

T = TypeVar("T")


class RowDrafting(DraftModel, BranchDrafting, Protocol):
    """A draft that steps one row, or several generations' rows in one forward
    (:class:`Drafter`)."""


class BatchingWorker(ModelWorker):
    """A :class:`ModelWorker` (``inner``'s thread) that batches ``drafter.draft`` calls."""

    def __init__(self, inner: ModelWorker, drafter: RowDrafting, max_rows: int) -> None:
        # (no thread of its own: every call runs on ``inner``'s)
        self.inner = inner
        self.drafter = drafter
        self.max_rows = max(1, min(max_rows, Drafter.MAX_BRANCHES))
        self._pending: deque[tuple[DraftRow, asyncio.Future[DraftStep]]] = deque()
        self._calls: deque[tuple[Callable[[], Any], asyncio.Future[Any]]] = deque()
        self._running: asyncio.Task[None] | None = None
        #: Batches run and rows in them (for tests and stats).
        self.batches = 0
        self.rows = 0

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        # (``drafter.draft(row)`` itself, bound to this drafter: a generation's draft step; and
        # ``drafter.draft_many(rows)``: a generation's step with the branches growing beside
        # it, its rows queued as as many steps, in order)
        mine = getattr(fn, "__self__", None) is self.drafter
        name = getattr(fn, "__name__", "")
        if mine and name == "draft":
            step: Any = await self._step(*args, **kwargs)
            return step  # type: ignore[no-any-return]
        if mine and name == "draft_many":
            rows: list[DraftRow] = list(*args, **kwargs)
            steps: Any = list(await asyncio.gather(*(self._step(r) for r in rows)))
            return steps  # type: ignore[no-any-return]
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._calls.append((functools.partial(fn, *args, **kwargs), fut))
        self._wake()
        return await fut

    async def _step(self, row: DraftRow) -> DraftStep:
        fut: asyncio.Future[DraftStep] = asyncio.get_running_loop().create_future()
        self._pending.append((row, fut))
        self._wake()
        return await fut

    def _wake(self) -> None:
        if self._running is None:
            self._running = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        """Run draft batches while steps wait, other calls when none does (the task is this
        object's: ``close`` cancels it)."""
        try:
            while self._pending or self._calls:
                # One turn of the loop first: the generations whose steps just came back take
                # their next ones, and those go in the same batch (no time is waited).
                await asyncio.sleep(0)
                batch: list[tuple[DraftRow, asyncio.Future[DraftStep]]] = []
                while self._pending and len(batch) < self.max_rows:
                    row, fut = self._pending.popleft()
                    if not fut.done():  # (a generation cancelled meanwhile takes no row)
                        batch.append((row, fut))
                if batch:
                    await self._run_batch(batch)
                    continue
                if self._calls:
                    call, cfut = self._calls.popleft()
                    if cfut.done():
                        continue
                    try:
                        result = await self.inner.run(call)
                    except Exception as e:
                        if not cfut.done():
                            cfut.set_exception(e)
                    else:
                        if not cfut.done():
                            cfut.set_result(result)
        finally:
            self._running = None

    async def _run_batch(self, batch: list[tuple[DraftRow, asyncio.Future[DraftStep]]]) -> None:
        self.batches += 1
        self.rows += len(batch)
        rows = [r for r, _ in batch]
        try:
            if len(rows) == 1:  # a lone step drafts on the cached sequence, as unbatched
                steps = [await self.inner.run(self.drafter.draft, rows[0])]
            else:
                steps = await self.inner.run(self.drafter.draft_many, rows)
        except Exception as e:
            if len(batch) == 1:
                if not batch[0][1].done():
                    batch[0][1].set_exception(e)
                return
            for one in batch:  # each row alone: the error is only its generation's
                await self._run_batch([one])
            return
        for (_, fut), step in zip(batch, steps, strict=True):
            if not fut.done():
                fut.set_result(step)

    def close(self) -> None:
        """Cancel the batch loop (the inner worker is its owner's to close)."""
        if self._running is not None:
            self._running.cancel()
        for _, fut in self._pending:
            fut.cancel()
        for _, cfut in self._calls:
            cfut.cancel()
        self._pending.clear()
        self._calls.clear()

    async def aclose(self) -> None:
        task = self._running
        self.close()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
