"""What the verifier's session core asks of its driver (:data:`Event`: frames to send, model
work to run, a close, a lost session to adopt), what it notes for metrics and logs
(:class:`Note`) and the states it is in (:class:`CoreState`).

A core (:class:`~cloud_verifier.session.core.VerifierCore`) does no I/O: every call that feeds
it returns a list of these events, in the order the driver must carry them out (built here where
several of its parts build the same: :func:`closing`, :func:`logprobs_at`). A driver only reads
the core's state, feeds it and carries out events.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

from cloud_verifier.engine.work import Work
from shared.enums import TextEnum
from shared.errors import ErrorCode
from shared.wire.messages import Error, Logprobs, Message

#: WebSocket close codes the core asks for (RFC 6455).
CLOSE_OK: Final = 1000
CLOSE_POLICY_VIOLATION: Final = 1008
CLOSE_INTERNAL_ERROR: Final = 1011


class CoreState(TextEnum):
    HELLO = "hello"
    RESUMING = "resuming"  # waiting for the driver to adopt a lost session (Adopt)
    OPEN = "open"
    BUSY = "busy"
    CLOSED = "closed"


class NoteKind(TextEnum):
    OPENED = "opened"
    REFUSED = "refused"  # detail: the Error code (bad_handshake, bad_hello, ...)
    STALE = "stale"  # a Propose of an old epoch dropped unprocessed
    BAD_FRAME = "bad_frame"
    EDGE_ERROR = "edge_error"  # detail: the edge's Error code and message
    MODEL_ERROR = "model_error"
    IDLE = "idle"  # closed for want of work


# ------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Send:
    """Write ``msg`` to the edge, encoded with the core's WireContext (its ``ctx``)."""

    msg: Message


@dataclass(frozen=True)
class Run:
    """Hand ``work`` to the engine; its result goes back to the core (``work_done``)."""

    work: Work


@dataclass(frozen=True)
class Close:
    """Send ``error`` (unless ``code`` is OK), then close the WebSocket with ``code``."""

    error: Error
    code: int = CLOSE_POLICY_VIOLATION


@dataclass(frozen=True)
class Note:
    kind: NoteKind
    detail: str = ""


@dataclass(frozen=True)
class Adopt:
    """Find the lost session named ``token`` (of this session's tenant: the driver checks),
    keep at most the first ``length`` tokens of its cache, and answer
    :meth:`~cloud_verifier.session.core.VerifierCore.adopted` with them (None: not found,
    expired or not this tenant's)."""

    token: str
    length: int


Event = Send | Run | Close | Note | Adopt


def logprobs_at(lp: Logprobs | None, pos: int) -> list[Event]:
    """The Logprobs frame of a result (Hello.logprobs), placed at ``pos``; none if not asked."""
    return [] if lp is None else [Send(replace(lp, pos=pos))]


def closing(
    note: Note, code: ErrorCode, message: str, close: int = CLOSE_POLICY_VIOLATION
) -> list[Event]:
    """``note``, then the session's end: a fatal Error (``code``, ``message``) and the
    WebSocket's close with ``close``."""
    return [note, Close(Error(code, message, fatal=True), close)]
