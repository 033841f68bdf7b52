"""Task ownership helpers (Python 3.10 has no TaskGroup) and the single model worker."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


async def run_until_first_done(*coros: Coroutine[Any, Any, None]) -> None:
    """Run the coroutines as tasks owned here until the first finishes or fails.

    The others are then cancelled and awaited; the first exception (if any) propagates. If this
    coroutine is itself cancelled, every task is cancelled and awaited before it returns.
    """
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        await cancel_all(tasks)


async def run_within(aw: Awaitable[T], timeout: float) -> asyncio.Future[T] | None:
    """Run ``aw`` as a task owned here for at most ``timeout`` seconds: the finished task (its
    result or its error in it), or None when the time ran out (it is cancelled and awaited;
    one that ended as it was cancelled is returned, not leaked). Built on ``asyncio.wait``:
    ``asyncio.wait_for`` can swallow a cancellation on Python <= 3.11."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait({task}, timeout=max(0.0, timeout))
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    return None if task.cancelled() else task


async def cancel_all(tasks: list[asyncio.Task[None]] | list[asyncio.Future[None]]) -> None:
    """Cancel the tasks and wait until each has finished (their errors are theirs to report)."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


class ModelWorker:
    """One dedicated thread for model forwards, so the event loop (heartbeats, verdicts) never
    blocks on one. Calls run one at a time, in submission order."""

    def __init__(self, name: str = "model") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
