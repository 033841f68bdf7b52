"""Waits on conditions, each under a deadline. A test never sleeps a fixed time hoping that
something has happened by then: it polls for the thing itself and fails, naming it, when the
deadline passes first."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

#: Between two looks at a condition: short against every deadline used in the tests.
POLL_S = 0.01


async def until(
    cond: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0, what: str = "condition"
) -> None:
    """Return once ``cond()`` is true (it may be a coroutine function, for a condition read
    over the network); AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout:g} s")
        await asyncio.sleep(POLL_S)


def poll(
    cond: Callable[[], bool],
    timeout: float = 20.0,
    what: str = "condition",
    interval: float = 0.05,
) -> None:
    """``until`` for tests that block (no event loop in this thread), where the condition is
    often a request to a server in another thread: looked at every ``interval`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout:g} s")
        time.sleep(interval)


async def closed_within(reader: asyncio.StreamReader, timeout: float) -> bytes | None:
    """What the server sent before closing, or None if it is still open after ``timeout``."""
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    except asyncio.TimeoutError:
        return None
    except ConnectionError:
        return b""
