"""systemd's notify protocol (sd_notify(3)) without a dependency.

A message is one datagram of ``KEY=VALUE`` lines sent to the Unix socket named by
``$NOTIFY_SOCKET``; a name starting with ``@`` is in the abstract namespace (leading NUL byte).
Outside systemd the variable is unset and every call is a no-op.

Used by both services (``cloud-verifier serve`` and ``edge-agent serve``). The one module in
``shared/`` that touches a socket: a single datagram, no asyncio.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Sends notifications to one socket address (``None``: disabled)."""

    def __init__(self, address: str | None, *, watchdog_usec: int | None = None) -> None:
        self.address = address or None
        self.watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        """From ``$NOTIFY_SOCKET`` and ``$WATCHDOG_USEC`` (honouring ``$WATCHDOG_PID``)."""
        e = os.environ if env is None else env
        usec: int | None = None
        raw = e.get("WATCHDOG_USEC")
        pid = e.get("WATCHDOG_PID")
        if raw and (not pid or pid == str(os.getpid())):
            try:
                usec = int(raw)
            except ValueError:
                log.warning("ignoring WATCHDOG_USEC=%r (not an integer)", raw)
        return cls(e.get("NOTIFY_SOCKET"), watchdog_usec=usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings: a third of the watchdog period."""
        return None if self.watchdog_usec is None else self.watchdog_usec / 1e6 / 3

    def notify(self, message: str) -> bool:
        """Send ``message`` (e.g. ``"READY=1\\nSTATUS=serving"``); True if it was sent."""
        if self.address is None:
            return False
        addr = self.address
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(addr)
                sock.sendall(message.encode("utf-8"))
        except OSError as e:
            log.warning("sd_notify to %s failed: %s", self.address, e)
            return False
        return True
