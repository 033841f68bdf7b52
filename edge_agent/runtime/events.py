"""The one stream of typed events the runtime hands its front doors (the HTTP APIs, the REPL,
the CLI; any new one: gRPC, a Python API), as h11 hands its caller one event per thing that
happened and the verifier's session core does its daemon.

:meth:`~edge_agent.runtime.service.EdgeService.stream` yields, for one request:

- :class:`Piece` — text committed since the last one, with its tokens' log-probabilities;
- :class:`RoundTrip` — a session's first round trip (Hello → first frame back) as measured;
- :class:`Waiting` — a session failed and the request waits for a verifier (busy, down or
  stalled: :class:`~edge_agent.session.retry.WaitCause`), each time what it meets changes;
- then exactly one of :class:`Finished` (the text, why it ended, its statistics) or
  :class:`Failed` (a :class:`FailureKind`, the message, what it had produced).

The front doors read this stream and nothing else: no exception crosses it (a bug in the
runtime is a :attr:`FailureKind.INTERNAL`), and no state is shared with the generation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from edge_agent.session.events import TokenLogprob
from edge_agent.session.retry import WaitCause
from shared.enums import TextEnum
from shared.errors import WanspecError


@dataclass(frozen=True)
class Piece:
    """A text increment of a stream; ``tokens``: the generated tokens committed since the last
    piece, with their log-probabilities (requests that asked for them; else empty)."""

    text: str
    tokens: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class RoundTrip:
    """A verifier session's first round trip, in seconds (on a warm link: the network's RTT
    plus the verifier's turn-around)."""

    seconds: float


@dataclass(frozen=True)
class Waiting:
    """A verifier session of this request came to nothing (``cause``; ``detail``: what was met)
    and the request waits for another, within ``verifier_wait``: told when a wait starts and
    whenever its cause changes."""

    cause: WaitCause
    detail: str


@dataclass(frozen=True)
class Finished:
    """The end of a stream: what OpenAI's ``usage``/``finish_reason`` and our extension need."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)  # the "wanspec" extension
    #: Every generated token with its log-probabilities (requests that asked; else empty).
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Partial:
    """What a generation that failed had produced: its text (as far as it was, or would have
    been, streamed), its token counts and statistics."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)


class FailureKind(TextEnum):
    """Why a request failed: a closed set, each with its one answer on every front door."""

    QUEUE_FULL = "queue_full"  # the daemon's line is full (HTTP 429, Retry-After)
    DEADLINE = "deadline"  # the request's deadline passed, waiting or generating (504)
    NO_VERIFIER = "no_verifier"  # no verifier could be used within verifier_wait (503)
    PROMPT_TOO_LONG = "prompt_too_long"  # the verifier's context is smaller (400)
    VERIFIER_ERROR = "verifier_error"  # the verifier refused the request for good (502)
    INTERNAL = "internal"  # a bug in the runtime (500; logged with its traceback)


@dataclass(frozen=True)
class Failed:
    """The end of a stream that failed. ``retry_after``: whole seconds after which the client
    may try again (None: retrying will not help); ``partial``: what was generated before (None
    where nothing had started); ``code``: the verifier's error code (:attr:`VERIFIER_ERROR`)."""

    kind: FailureKind
    message: str
    retry_after: int | None = None
    partial: Partial | None = None
    code: str | None = None

    def error(self) -> GenerationFailed:
        """This failure as an exception, for a caller that raises (the CLI)."""
        return GenerationFailed(self)


class GenerationFailed(WanspecError, RuntimeError):
    """A :class:`Failed` raised: its message, and the event itself as ``failed``."""

    def __init__(self, failed: Failed) -> None:
        super().__init__(failed.message)
        self.failed = failed


RuntimeEvent = Piece | RoundTrip | Waiting | Finished | Failed


async def last_event(events: AsyncIterator[RuntimeEvent]) -> Finished | Failed:
    """A stream read to its end (a non-streaming answer): its Finished or its Failed."""
    async for ev in events:
        if isinstance(ev, (Finished, Failed)):
            return ev
    raise RuntimeError("the runtime's stream ended without a Finished or a Failed")
