"""Rate-limited logging: events a peer can cause at will (frames, refused requests) must not
turn into one log line each.

A :class:`LogLimiter` lets ``burst`` lines through per ``interval`` seconds and counts the rest;
the next line that gets through says how many were dropped, and :meth:`LogLimiter.flush` reports
a remainder (e.g. when a session ends).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field


@dataclass(eq=False)
class LogLimiter:
    """At most ``burst`` lines per ``interval`` seconds (a fixed window); the rest are counted."""

    burst: int = 5
    interval: float = 60.0
    _: KW_ONLY
    clock: Callable[[], float] = time.monotonic
    #: Lines dropped since the last one that got through (or the last flush).
    suppressed: int = field(default=0, init=False)
    #: Lines dropped in all.
    suppressed_total: int = field(default=0, init=False)
    _window: float = field(default=-math.inf, init=False)
    _used: int = field(default=0, init=False)

    def allow(self) -> bool:
        now = self.clock()
        if now - self._window >= self.interval:
            self._window, self._used = now, 0
        if self._used < self.burst:
            self._used += 1
            return True
        self.suppressed += 1
        self.suppressed_total += 1
        return False

    def log(self, logger: logging.Logger, level: int, msg: str, *args: object) -> bool:
        """Log ``msg % args`` if the budget allows (with the count of lines dropped before it);
        True when it was logged."""
        if not self.allow():
            return False
        if self.suppressed:
            msg += " (%d similar line(s) suppressed)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        logger.log(level, msg, *args)
        return True

    def flush(self, logger: logging.Logger, level: int, what: str) -> None:
        """Report lines dropped since the last one logged (``what``: whose lines they were)."""
        if self.suppressed:
            logger.log(level, "%s: %d more similar line(s) suppressed", what, self.suppressed)
            self.suppressed = 0
