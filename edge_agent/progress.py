"""Model-loading progress: a spinner line on a terminal, STATUS= under systemd, else log lines.

:meth:`Progress.report` may be called from any thread (loading runs on the model worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator
from typing import TextIO

from shared.sdnotify import Notifier

log = logging.getLogger("wanspec.edge")

_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


class Progress:
    def __init__(self, notifier: Notifier | None = None, stream: TextIO | None = None) -> None:
        self.notifier = notifier or Notifier(None)
        self.stream = stream or sys.stderr
        # Under systemd the journal is not a terminal, and STATUS= is the way to say it.
        self.tty = self.stream.isatty() and not self.notifier.enabled
        self.message = ""
        self._t0 = time.monotonic()

    def report(self, message: str) -> None:
        self.message = message
        self.notifier.notify(f"STATUS={message}")
        if not self.tty:
            log.info("%s", message)

    def _draw(self, frame: str) -> None:
        elapsed = time.monotonic() - self._t0
        self.stream.write(f"\r\x1b[2K{frame} {self.message} ({elapsed:.0f} s)")
        self.stream.flush()

    @contextlib.asynccontextmanager
    async def spinner(self) -> AsyncIterator[None]:
        """Animate the current message on a terminal while the block runs."""
        if not self.tty:
            yield
            return

        async def spin() -> None:
            i = 0
            while True:
                self._draw(_FRAMES[i % len(_FRAMES)])
                i += 1
                await asyncio.sleep(0.1)

        task = asyncio.create_task(spin())
        ok = False
        try:
            yield
            ok = True
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self._draw("✓" if ok else "✗")
            self.stream.write("\n")
            self.stream.flush()


def quiet_hub_progress() -> None:
    """transformers' own progress bars would fight with the spinner line (and fill the journal)."""
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
