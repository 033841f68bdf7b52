"""Start-up feedback: a spinner line on a terminal, STATUS= under systemd, else log lines; the
line naming the draft model's device; no third-party progress bars.

:meth:`Progress.report` may be called from any thread (loading runs on the model worker). The
spinner animates from a thread of its own, so it turns from the moment it starts even while the
main thread is busy importing torch. Light on purpose: importing this module imports neither
torch nor transformers (the functions that need torch import it when called).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import TextIO

from shared.runtime.device import cuda_hint
from shared.service.sdnotify import Notifier

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
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def report(self, message: str) -> None:
        self.message = message
        self.notifier.notify(f"STATUS={message}")
        if not self.tty:
            log.info("%s", message)

    def _draw(self, frame: str) -> None:
        elapsed = time.monotonic() - self._t0
        with self._lock:
            self.stream.write(f"\r\x1b[2K{frame} {self.message} ({elapsed:.0f} s)")
            self.stream.flush()

    @property
    def spinning(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Draw the first frame now and animate until :meth:`stop` (a terminal only)."""
        if not self.tty or self._thread is not None:
            return
        self._stop.clear()
        self._draw(_FRAMES[0])

        def spin() -> None:
            i = 1
            while not self._stop.wait(0.1):
                self._draw(_FRAMES[i % len(_FRAMES)])
                i += 1

        self._thread = threading.Thread(target=spin, name="wanspec-spinner", daemon=True)
        self._thread.start()

    def stop(self, ok: bool) -> None:
        """End the spinner line with ✓ or ✗ (nothing when it is not spinning)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()
        self._draw("✓" if ok else "✗")
        with self._lock:
            self.stream.write("\n")
            self.stream.flush()

    @contextlib.contextmanager
    def spin(self) -> Iterator[None]:
        """Animate the current message on a terminal while the block runs."""
        self.start()
        ok = False
        try:
            yield
            ok = True
        finally:
            self.stop(ok)

    @contextlib.asynccontextmanager
    async def spinner(self) -> AsyncIterator[None]:
        """:meth:`spin` for ``async with``."""
        with self.spin():
            yield


def quiet_hub_progress() -> None:
    """No third-party progress bars ("Loading weights: 42%|████…", "Converting and de-quantizing
    GGUF tensors…"): they would fight with the spinner line on a terminal and fill a service's
    log. Every edge command calls this before it imports torch: tqdm, huggingface_hub and
    transformers read these variables when first imported (transformers' GGUF conversion uses
    tqdm directly); the libraries already imported are told directly. Explicit settings of the
    variables are kept."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        with contextlib.suppress(Exception):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    if "huggingface_hub" in sys.modules:
        with contextlib.suppress(Exception):
            import huggingface_hub.utils as hub_utils

            hub_utils.disable_progress_bars()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- the draft's device


def cuda_missing_reason() -> str | None:
    """None when torch sees a CUDA device; else why not, in words."""
    import torch

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is built without CUDA (on a Jetson install NVIDIA's "
            "JetPack torch system-wide, then `make install SYSTEM_TORCH=1`; elsewhere "
            "`make install CUDA=cu128`)"
        )
    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU "
        "(driver, or device permissions: the video/render groups)"
    )


def check_cuda(device: str) -> str | None:
    """Before loading: ``device = "cuda"`` on a machine where torch finds none is an error
    (ConfigError); ``auto`` where CUDA was expected (:func:`cuda_hint`) but is missing gives
    the warning returned (None: nothing to say)."""
    if device == "cpu":
        return None
    if device == "cuda":
        why = cuda_missing_reason()
        if why is not None:
            from shared.service.config import ConfigError

            raise ConfigError("device", f"cuda was asked for but {why}")
        return None
    hint = cuda_hint()  # shared.runtime.device's rule, as the verifier's
    if hint is None:
        return None
    why = cuda_missing_reason()
    if why is None:
        return None
    return f"CUDA was expected ({hint}) but {why}: the draft runs on the CPU, slowly"
