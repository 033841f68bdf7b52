"""The daemon's line: at most ``max_concurrent`` generations at once, the rest waiting in
arrival order up to ``max_queue`` (then a 429), each wait bounded by its request's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shared.errors import WanspecError

#: The Retry-After of a 429 (the daemon's line full): a place frees as a generation ends.
QUEUE_RETRY_AFTER_S = 1


class QueueFull(WanspecError, RuntimeError):
    """Too many requests are waiting (HTTP 429, with ``retry_after`` seconds)."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeout(WanspecError, RuntimeError):
    """The request's deadline (``request_timeout``, or its own ``wanspec.timeout``) passed
    before its text was done: it waited that long in line (the daemon's, the verifier's) or
    generated that long (HTTP 504, with its text so far). ``retry_after``: whole seconds."""

    def __init__(self, message: str, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class FairQueue:
    """At most ``max_active`` holders at a time, the others served first come, first served, up
    to ``max_waiting`` of them (then :class:`QueueFull`).

    A waiter that is cancelled leaves the queue; a slot handed to a waiter that is cancelled at
    that very moment is passed on, never lost."""

    def __init__(self, max_waiting: int, max_active: int = 1) -> None:
        self.max_waiting = max_waiting
        self.max_active = max_active
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.active = 0

    @property
    def busy(self) -> bool:
        """Every slot is held."""
        return self.active >= self.max_active

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    def check(self) -> None:
        """Raise :class:`QueueFull` if a request arriving now would be refused."""
        if (self.busy or self._waiters) and self.waiting >= self.max_waiting:
            raise QueueFull(
                f"{self.waiting} requests are already waiting; try again later",
                retry_after=QUEUE_RETRY_AFTER_S,
            )

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # handed over: the slot stays held
                return
        self.active -= 1

    @contextlib.asynccontextmanager
    async def slot(self, wait_s: float | None = None) -> AsyncIterator[None]:
        """Hold a place; wait for one at most ``wait_s`` seconds (None: no bound), then
        :class:`RequestTimeout` (``wait_s`` is what is left of the request's deadline);
        :class:`QueueFull` at once when the line is full."""
        if self.busy or self._waiters:
            self.check()
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await asyncio.wait_for(asyncio.shield(fut), wait_s)
            except BaseException as e:
                if fut.done() and not fut.cancelled():
                    self._release()  # the slot was ours already: pass it on
                else:
                    fut.cancel()
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(fut)
                if isinstance(e, asyncio.TimeoutError):
                    raise RequestTimeout(
                        f"waited {wait_s:g} s for one of the {self.max_active} generations "
                        "(the request's deadline: request_timeout or wanspec.timeout); try "
                        "again later",
                        retry_after=max(1, min(60, round(wait_s or 1))),
                    ) from e
                raise
        else:
            self.active += 1
        try:
            yield
        finally:
            self._release()


@dataclass(eq=False)
class Slot:
    """A generation holding a place: when it last made progress, by the monotonic clock. Its
    client taking a piece of text is progress; a token committed is too, unless a piece
    waits for the client (``handed``): then only the client can make progress (tokens
    committed for a client that stopped reading help nobody)."""

    last: float
    handed: bool = False

    def committed(self, now: float) -> None:
        if not self.handed:
            self.last = now
