"""Encoding and decoding of protocol v2's frames (msgpack maps), run from the tables of
:mod:`shared.wire.schema`.

Decoding is strict: unknown keys are refused, every field is type- and range-checked, and any fault
raises :class:`~shared.wire.packing.ProtocolError` naming the field. Checks run in a fixed order
(unknown keys, then each field in wire order, then the cross-field checks), so a frame with several
faults names the first. Nothing here does I/O; there is no pickle and no eval.
"""

from __future__ import annotations

from typing import Any, Final

import msgpack
import numpy as np

from shared.maths.compression import SparseDist
from shared.wire.fields import K_VT, Frame, Int
from shared.wire.messages import PROTOCOL_VERSION, Message, MsgType
from shared.wire.packing import HANDSHAKE_MAX_FRAME, ProtocolError, WireContext
from shared.wire.schema import BY_CLASS, BY_HEADER

_HEADER: Final = Int(0, 255)


def encode(msg: Message, ctx: WireContext | None = None) -> bytes:
    """Encode ``msg``. Hot frames need the session's ``ctx`` for their binary fields."""
    frame = BY_CLASS.get(type(msg))
    if frame is None:
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    if frame.hot and ctx is None:
        raise ValueError(f"{type(msg).__name__} needs the session's WireContext")
    out = msgpack.packb(frame.write(msg, ctx), use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def _unpack_map(data: bytes, max_frame: int) -> dict[Any, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("frame", f"expected binary data, got {type(data).__name__}")
    if len(data) > max_frame:
        raise ProtocolError("frame", f"{len(data)} bytes exceed the limit of {max_frame}")
    if len(data) == 0:
        raise ProtocolError("frame", "empty")
    try:
        obj = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=False,
            use_list=True,
            max_bin_len=max_frame,
            max_str_len=max_frame,
            max_array_len=1024,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError("frame", f"not a valid msgpack frame ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict):
        raise ProtocolError("frame", f"expected a map, got {type(obj).__name__}")
    return obj


def peek_type(data: bytes, max_frame: int = HANDSHAKE_MAX_FRAME) -> MsgType:
    """Validate the header of ``data`` and return its message type."""
    return _frame_of(_unpack_map(data, max_frame)).msg_type


def _frame_of(m: dict[Any, Any]) -> Frame:
    """The table of the frame ``m`` by its header; ProtocolError if missing, malformed or
    unknown."""
    vt = m.get(K_VT)
    if type(vt) is int and vt in BY_HEADER:
        return BY_HEADER[vt]
    if K_VT not in m:
        raise ProtocolError("version/type", "missing")
    vt = _HEADER.read(vt, "version/type", None)
    if vt >> 4 != PROTOCOL_VERSION:
        raise ProtocolError(
            "version",
            f"unsupported protocol version {vt >> 4} (this side speaks {PROTOCOL_VERSION})",
        )
    raise ProtocolError("type", f"unknown message type {vt & 0xF}")


def decode(data: bytes, ctx: WireContext | None = None) -> Message:
    """Decode and validate one frame. Raises :class:`ProtocolError` naming the bad field.

    Without ``ctx`` only Hello, Welcome and Error decode (frames are then bounded by
    ``HANDSHAKE_MAX_FRAME``); hot frames are refused.
    """
    m = _unpack_map(data, ctx.max_frame if ctx is not None else HANDSHAKE_MAX_FRAME)
    frame = _frame_of(m)
    if frame.hot and ctx is None:
        raise ProtocolError("type", f"{frame.msg_type.name} before the session is established")
    msg: Message = frame.read(m, ctx)
    return msg


def message_equal(a: Message, b: Message, *, rtol: float = 0.0, atol: float = 0.0) -> bool:
    """Structural equality (numpy fields compared by value); used by tests and replay checks.

    ``rtol``/``atol``: compare probabilities (sparse distributions, float arrays) within that
    tolerance, ids and every other field exactly; e.g. replies of a session whose forward ran
    in different batches, whose logits differ in the last bits."""
    if type(a) is not type(b):
        return False

    def arrays(x: Any, y: Any) -> bool:
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            return False
        if (rtol or atol) and np.issubdtype(x.dtype, np.floating):
            return bool(np.allclose(x, y, rtol=rtol, atol=atol))
        return bool(np.array_equal(x, y))

    def sparse(u: SparseDist, v: SparseDist) -> bool:
        return bool(np.array_equal(u.ids, v.ids)) and arrays(u.probs, v.probs)

    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, tuple) and x and isinstance(x[0], SparseDist):
            if len(x) != len(y) or not all(sparse(u, v) for u, v in zip(x, y, strict=True)):
                return False
        elif isinstance(x, SparseDist) or isinstance(y, SparseDist):
            if x is None or y is None or not sparse(x, y):
                return False
        elif isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if x is None or y is None or not arrays(x, y):
                return False
        elif x != y:
            return False
    return True
