"""The life of a service process (the verifier, the edge daemon), as `/health` reports it: its
status, the signals that stop it, and a wait for a started one to be healthy."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import time
import urllib.request

from shared.enums import TextEnum


class ServiceStatus(TextEnum):
    LOADING = "loading"  # the port listens while the model loads; /health answers 503
    READY = "ready"
    FAILED = "failed"  # the model failed to load; /health says why
    STOPPING = "stopping"  # draining after SIGTERM


class StopSignals:
    """SIGTERM and SIGINT ask a service to stop (both ends' ``serve``): once installed, either
    sets :attr:`stopping` and ``wake`` (the event the service's main loop waits on), and logs
    the signal on ``log``; :meth:`remove` (in the service's ``finally``) takes them back."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, wake: asyncio.Event, log: logging.Logger) -> None:
        self.wake = wake
        self.log = log
        self.stopping = False
        self._loop = asyncio.get_running_loop()

    def _on_signal(self, sig: signal.Signals) -> None:
        self.log.info("%s: shutting down", sig.name)
        self.stopping = True
        self.wake.set()

    def install(self) -> StopSignals:
        for sig in self.SIGNALS:
            self._loop.add_signal_handler(sig, self._on_signal, sig)
        return self

    def remove(self) -> None:
        for sig in self.SIGNALS:
            self._loop.remove_signal_handler(sig)


def wait_healthy(
    proc: subprocess.Popen[bytes], url: str, timeout_s: float, what: str = "the service"
) -> None:
    """Block until ``url`` (a ``/health``) answers 200; RuntimeError naming ``what`` when
    ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:  # urllib.error.URLError included
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{what} was not ready within {timeout_s:.0f} s")
