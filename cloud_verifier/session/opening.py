"""Opening a verifier session and reading its frames: the edge's first frame read as a Hello
this verifier serves, or why it is refused (:func:`read_hello`), the session's
:class:`WireContext` (:func:`wire_context`) and a frame decoded with it (:func:`read_frame`).
Pure functions: no I/O, no clock, no model.

Invariant: a session opens only on a decodable Hello whose model fingerprint is compatible with
the target's and whose asks fit this verifier's limits (k and m within ``max_k``; no
log-probabilities for a federated session); anything else refuses it, with the Error code of
the reason.
"""

from __future__ import annotations

from cloud_verifier.session.limits import SessionLimits, TargetInfo
from shared.errors import ErrorCode
from shared.maths.rejection import CorrectionMode
from shared.wire.codec import decode
from shared.wire.messages import Hello, Message, ReplyMode
from shared.wire.packing import ProtocolError, WireContext


def read_hello(
    data: bytes | str, target: TargetInfo, limits: SessionLimits
) -> Hello | tuple[ErrorCode, str]:
    """The session's first frame as a Hello, or why the session is refused (the Error code and
    its message)."""
    msg = read_frame(data)
    if isinstance(msg, ProtocolError):
        return ErrorCode.BAD_HANDSHAKE, f"expected Hello: {msg}"
    if not isinstance(msg, Hello):
        return ErrorCode.BAD_HANDSHAKE, f"expected Hello first, got {type(msg).__name__}"
    reason = msg.fingerprint.compatible_with(target.fingerprint)
    if reason is not None:
        return ErrorCode.FINGERPRINT_MISMATCH, reason
    if msg.k > limits.max_k or msg.m > limits.max_k:
        return (
            ErrorCode.BAD_HELLO,
            f"k = {msg.k} / m = {msg.m} exceed this verifier's limit {limits.max_k}",
        )
    if msg.logprobs is not None and msg.reply_mode == ReplyMode.FEDERATED:
        return (
            ErrorCode.BAD_HELLO,
            "logprobs: a federated session gets distributions, not log-probabilities",
        )
    return msg


def wire_context(hello: Hello, target: TargetInfo, limits: SessionLimits) -> WireContext:
    """How the session's frames are read: this verifier's bounds and what the Hello chose."""
    return WireContext(
        vocab_size=target.vocab_size,
        max_gamma=limits.max_gamma,
        max_fixed=limits.max_fixed,
        max_k=limits.max_k,
        max_frame=limits.max_frame,
        draft_probs=hello.correction != CorrectionMode.GREEDY_DRAFT,
        coarse_q=hello.sampling.greedy,
    )


def read_frame(data: bytes | str, ctx: WireContext | None = None) -> Message | ProtocolError:
    """A frame from the edge, decoded with the session's ``ctx`` (None: before the Hello
    chose it), or the ProtocolError that says why it cannot be."""
    try:
        if not isinstance(data, bytes):
            raise ProtocolError("frame", f"expected binary data, got {type(data).__name__}")
        return decode(data, ctx)
    except ProtocolError as e:
        return e
