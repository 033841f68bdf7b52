"""One root for the project's errors, and the codes its Error frames carry.

Every exception the product raises on purpose derives from :class:`WanspecError` besides the
standard class that says what kind of failure it is (``ValueError`` for bad input,
``ConnectionError`` for a lost link, ``PermissionError`` for a refused token, ...): a caller can
catch one family or all of ours. :class:`ErrorCode` names every code the verifier and the edge
put in an Error frame (a peer may send others: the wire carries any short string).
"""

from __future__ import annotations

from shared.enums import TextEnum


class WanspecError(Exception):
    """The root of the project's own errors."""


class ErrorCode(TextEnum):
    """The ``code`` of an Error frame (shared.wire.messages.Error), and the reason of every
    refusal of a session: the verifier's ``X-Wanspec-Refusal`` header on an HTTP refusal, the
    code of a refused stream's Error, its ``wanspec_sessions_refused_total{reason}``; the edge
    reads the same members back."""

    # handshake (fatal): the session is not opened
    BAD_HANDSHAKE = "bad_handshake"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    BAD_HELLO = "bad_hello"
    UNSUPPORTED = "unsupported"
    UNAUTHORIZED = "unauthorized"  # also a connection's bearer token refused (HTTP 400 / 401)
    # a connection refused before the WebSocket upgrade (HTTP 400 / 426 / 503)
    BAD_HEADER = "bad_header"  # a header value that is not ASCII
    NOT_WEBSOCKET = "not_websocket"  # no Upgrade: websocket
    BAD_UPGRADE = "bad_upgrade"  # malformed upgrade headers (version, key)
    SUBPROTOCOL = "subprotocol"  # this protocol's WebSocket subprotocol not offered
    UNAVAILABLE = "unavailable"  # a 503 that names no reason (not the verifier's own, say)
    # a new session refused while the verifier is busy (fatal, with retry_after): not down
    BUSY = "busy"
    KV_FULL = "kv_full"
    TOKEN_LIMIT = "token_limit"
    OVERLOADED = "overloaded"
    LOADING = "loading"
    STOPPING = "stopping"
    # a frame refused (not fatal; counted towards max_bad_frames)
    BAD_FRAME = "bad_frame"
    BAD_SEQ = "bad_seq"
    BAD_EPOCH = "bad_epoch"
    BAD_POS = "bad_pos"
    BAD_ROLLBACK = "bad_rollback"
    BAD_RESAMPLE = "bad_resample"
    BAD_HEDGE = "bad_hedge"
    QUEUE_FULL = "queue_full"
    STALE_FLOOD = "stale_flood"
    EDGE_ERROR = "edge_error"
    # the session's work
    CONTEXT_FULL = "context_full"
    MODEL_ERROR = "model_error"
    # the session is closed
    TOO_MANY_BAD_FRAMES = "too_many_bad_frames"
    IDLE_TIMEOUT = "idle_timeout"
    RATE_LIMITED = "rate_limited"
    FLOW_CONTROL = "flow_control"
    CLOSING = "closing"
    INTERNAL = "internal"


#: Error codes after which reconnecting cannot help.
FATAL_CODES = frozenset(
    {
        ErrorCode.FINGERPRINT_MISMATCH,
        ErrorCode.UNAUTHORIZED,
        ErrorCode.BAD_HELLO,
        ErrorCode.UNSUPPORTED,
    }
)
