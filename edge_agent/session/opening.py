"""Opening a verifier session at the edge: the Hello, the verifier's answer to it (a Welcome, a
place in its admission line, or a refusal), the session's WireContext and resumed length, and
the errors an edge session ends with. Pure functions: no I/O, no clock, no model.

Invariant: a session runs only on a Welcome whose model fingerprint is compatible with its
Hello's, and a resumed one only where the verifier kept exactly the edge's committed tokens
(:func:`resumed_length`); anything else ends it with one of the errors here. A refusal the user
must act on (:class:`HandshakeError`, :class:`ContextExceeded`) is not retried.
"""

from __future__ import annotations

from typing import NoReturn

from edge_agent.session.events import GenerationEvent
from edge_agent.session.generation import Generation
from edge_agent.session.pipeline_config import Mode, PipelineConfig
from edge_agent.session.transport import VerifierBusy
from shared.errors import FATAL_CODES, WanspecError
from shared.maths.rejection import CorrectionMode
from shared.wire.codec import decode
from shared.wire.messages import (
    Error,
    Fingerprint,
    Hello,
    Progress,
    ReplyMode,
    Resume,
    Welcome,
    text_digest,
)
from shared.wire.packing import ProtocolError, WireContext


class VerifierError(WanspecError, RuntimeError):
    """The verifier sent an Error frame. ``fatal`` ones end the session."""

    def __init__(self, code: str, message: str, fatal: bool) -> None:
        super().__init__(f"verifier error {code}: {message}")
        self.code = code
        self.fatal = fatal


class DesyncError(WanspecError, RuntimeError):
    """A frame that does not match the session's state (the session must be rebuilt)."""


class HandshakeError(WanspecError, RuntimeError):
    """The verifier refused the session (e.g. a different tokenizer). Not retried."""


class ContextExceeded(WanspecError, ValueError):
    """The prompt alone fills the verifier's context (``limit`` tokens): no session can hold
    it, so it is not retried (the API answers 400 ``context_length_exceeded``)."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens; the verifier's context is {limit} tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.limit = limit


def fit_context(gen: Generation, max_context: int) -> list[GenerationEvent]:
    """Bound ``gen`` by a verifier's context (its Welcome's or its connection's Ready's
    ``max_context``): after this, prompt + ``max_tokens`` ≤ ``max_context``, so no
    Propose, hedge or co-generated token ever passes the verifier's limit, and a generation
    that reaches it ends with ``finish_reason`` "length" and its text (never a refusal that
    would be retried). A text already at the limit (a fail-over to a smaller verifier) ends
    now (the :class:`~edge_agent.session.events.Finished` returned says so). Raises
    :class:`ContextExceeded` when the prompt alone leaves no room."""
    if gen.prompt_len >= max_context:
        raise ContextExceeded(gen.prompt_len, max_context)
    gen.max_tokens = min(gen.max_tokens, max_context - gen.prompt_len)
    if gen.room <= 0 and not gen.done:
        return [gen.finish("length")]
    return []


def hello_for(
    fingerprint: Fingerprint,
    cfg: PipelineConfig,
    seed: int | None,
    *,
    k: int = 10,
    end: int = 0,
    resume: Resume | None = None,
) -> Hello:
    """The Hello of a single-verifier session (the verifier decides: PicoSpec). ``end``: the
    position where the generation stops at the latest (:attr:`Generation.end`), the bound of
    co-generation (``cfg.cogen``); ``resume``: the lost session to pick up, if any. It always
    asks for Progress frames (the verdict deadline follows them)."""
    return Hello(
        fingerprint=fingerprint,
        sampling=cfg.sampling,
        reply_mode=ReplyMode.VERDICT,
        correction=cfg.wire_correction,
        k=k,
        bonus=cfg.mode == Mode.STOP_AND_WAIT,
        seed=seed,
        cogen_end=end if cfg.cogen else 0,
        progress=True,
        resume=resume,
        resumable=True,
        logprobs=cfg.logprobs,
    )


def raise_error(msg: Error, *, opening: bool = False) -> NoReturn:
    """An Error frame as the exception it means: a busy verifier's refusal (``retry_after``)
    is :class:`~edge_agent.session.transport.VerifierBusy`; a refusal the user must act on, while
    the
    session is ``opening``, :class:`HandshakeError`; anything else :class:`VerifierError`."""
    if msg.retry_after is not None:
        raise VerifierBusy(
            f"verifier refused the session ({msg.code}): {msg.message}; "
            f"retry after {msg.retry_after:g} s",
            msg.code,
            msg.retry_after,
        )
    if opening and msg.code in FATAL_CODES:
        raise HandshakeError(f"verifier refused the session: {msg.message}")
    raise VerifierError(msg.code, msg.message, msg.fatal)


def check_welcome(hello: Hello, data: bytes) -> Welcome:
    """The verifier's answer to ``hello``: its Welcome, or the reason there is none.

    Raises :class:`HandshakeError` for a refusal the user must act on (not retried),
    :class:`VerifierError` for other Error frames and :class:`DesyncError` for anything else.
    """
    try:
        msg = decode(data)
    except ProtocolError as e:
        raise DesyncError(f"bad handshake reply: {e}") from e
    if isinstance(msg, Error):
        raise_error(msg, opening=True)
    if not isinstance(msg, Welcome):
        raise DesyncError(f"expected Welcome, got {type(msg).__name__}")
    reason = hello.fingerprint.compatible_with(msg.fingerprint)
    if reason is not None:
        raise HandshakeError(f"verifier model is incompatible: {reason}")
    return msg


def queue_progress(data: bytes) -> Progress | None:
    """``data`` as the Progress frame of a session waiting in the verifier's admission line
    (before its Welcome: ``ahead`` sessions start before it, in about ``eta_ms``), or None
    for any other frame (left to :func:`check_welcome`)."""
    try:
        msg = decode(data)
    except ProtocolError:
        return None
    return msg if isinstance(msg, Progress) else None


def wire_context(hello: Hello, welcome: Welcome) -> WireContext:
    """The session's WireContext on the edge, from the limits the verifier announced."""
    return WireContext(
        vocab_size=hello.fingerprint.vocab_size,
        max_gamma=welcome.max_gamma,
        max_fixed=welcome.max_fixed,
        max_frame=welcome.max_frame,
        draft_probs=hello.correction != CorrectionMode.GREEDY_DRAFT,
        coarse_q=hello.sampling.greedy,
    )


def resumed_length(gen: Generation, welcome: Welcome) -> int:
    """Where the verifier's cache of a resumed session ends: the next Propose starts there
    (0 for a new session). Raises :class:`DesyncError` unless the kept tokens are exactly the
    edge's committed ones (their digest), so nothing but the committed text is ever reused."""
    r = welcome.resumed
    if r is None:
        return 0
    if r.length > len(gen.committed) or r.digest != text_digest(gen.committed[: r.length]):
        raise DesyncError(f"the resumed session's {r.length} cached tokens are not this text")
    return r.length
