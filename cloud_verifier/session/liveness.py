"""Liveness of one verifier session, over the ``now`` its core is passed (no clock of its own,
no I/O): :class:`Liveness`, the one owner of the frame-rate bucket (``max_frame_rate``,
``frame_burst``), the idle clock (``idle_timeout_s``: an open session without model work is
closed and its slot freed) and the Progress timing (Hello.progress: at most one per
``progress_interval_s``, the first once the work has waited that long).

Invariant: only the edge's activity moves the idle clock: the Hello, the session's admission,
and the start or the end of model work the edge asked for (co-generation does not count).
"""

from __future__ import annotations

from typing import Final

from cloud_verifier.engine.work import WorkProgress
from cloud_verifier.session.events import Event, Note, NoteKind, closing
from cloud_verifier.session.limits import SessionLimits
from shared.errors import ErrorCode
from shared.wire.messages import Progress

_U32_MAX: Final = 2**32 - 1


class Liveness:
    """One session's clocks (module docstring); its core decides when each applies."""

    def __init__(self, limits: SessionLimits) -> None:
        self.limits = limits
        self.active_at = 0.0  # the last time model work started or ended (``now`` passed in)
        self.work_at = 0.0  # when the running work started (Progress timing)
        self.progress_at = 0.0  # when the last Progress was sent
        self._bucket = float(limits.frame_burst)  # frame-rate tokens left
        self._bucket_at: float | None = None

    def take_token(self, now: float) -> bool:
        """The frame-rate bucket: refill by the time since the last frame, take one."""
        rate = self.limits.max_frame_rate
        if rate <= 0:
            return True
        if self._bucket_at is not None:
            refill = max(0.0, now - self._bucket_at) * rate
            self._bucket = min(float(self.limits.frame_burst), self._bucket + refill)
        self._bucket_at = now
        if self._bucket < 1.0:
            return False
        self._bucket -= 1.0
        return True

    def rate_limited(self) -> list[Event]:
        """What closes a session past its frame rate."""
        rate, burst = self.limits.max_frame_rate, self.limits.frame_burst
        why = f"more than {rate:g} frames a second (burst {burst}) from this session"
        return closing(Note(NoteKind.BAD_FRAME, "rate_limited"), ErrorCode.RATE_LIMITED, why)

    def progress_due(self) -> float:
        """When the next Progress frame is due, should the running work still run."""
        return max(self.work_at, self.progress_at) + self.limits.progress_interval_s

    def progress(self, p: WorkProgress, now: float) -> Progress:
        """The Progress frame sent at ``now`` for the engine's word ``p`` on the running work."""
        self.progress_at = now
        eta_ms = min(_U32_MAX, max(0, round(p.eta_s * 1000)))
        return Progress(p.steps % (_U32_MAX + 1), p.ahead, eta_ms, p.running)

    def idle_deadline(self) -> float | None:
        """When an open session with no model work is closed (None: never)."""
        if self.limits.idle_timeout_s <= 0:
            return None
        return self.active_at + self.limits.idle_timeout_s

    def idle_closed(self) -> list[Event]:
        """What closes a session idle past its deadline."""
        t = self.limits.idle_timeout_s
        why = f"no Propose for {t:g} s (idle_timeout); the session's slot is freed"
        return closing(Note(NoteKind.IDLE), ErrorCode.IDLE_TIMEOUT, why)
