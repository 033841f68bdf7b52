"""TEMPORARY facade: removed at integration (/tmp/h4_rewrite_imports.py rewrites its importers).

The codec now lives in shared.wire.{messages,packing,fields,schema,codec}; the value types the
maths defines (SparseDist, CorrectionMode) in shared.maths."""

# TEMPORARY facade: removed at integration

from __future__ import annotations

from shared.maths.compression import SparseDist
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import MIN_TEMPERATURE, SamplingParams
from shared.wire.codec import decode, encode, message_equal, peek_type
from shared.wire.messages import (
    LOGPROB_FLOOR,
    MAX_DEPTH,
    MAX_TOP_LOGPROBS,
    PROTOCOL_VERSION,
    SEQ_MODULUS,
    SUBPROTOCOL,
    Candidates,
    Error,
    FederatedReply,
    Fingerprint,
    Generated,
    Hedge,
    Hello,
    Logprobs,
    Message,
    MsgType,
    Progress,
    Propose,
    ReplyMode,
    Resample,
    Resume,
    Resumed,
    Rollback,
    Verdict,
    Welcome,
    text_digest,
)
from shared.wire.packing import HANDSHAKE_MAX_FRAME, ProtocolError, WireContext, id_width

__all__ = [
    "HANDSHAKE_MAX_FRAME",
    "LOGPROB_FLOOR",
    "MAX_DEPTH",
    "MAX_TOP_LOGPROBS",
    "MIN_TEMPERATURE",
    "PROTOCOL_VERSION",
    "SEQ_MODULUS",
    "SUBPROTOCOL",
    "Candidates",
    "CorrectionMode",
    "Error",
    "FederatedReply",
    "Fingerprint",
    "Generated",
    "Hedge",
    "Hello",
    "Logprobs",
    "Message",
    "MsgType",
    "Progress",
    "Propose",
    "ProtocolError",
    "ReplyMode",
    "Resample",
    "Resume",
    "Resumed",
    "Rollback",
    "SamplingParams",
    "SparseDist",
    "Verdict",
    "Welcome",
    "WireContext",
    "decode",
    "encode",
    "id_width",
    "message_equal",
    "peek_type",
    "text_digest",
]
