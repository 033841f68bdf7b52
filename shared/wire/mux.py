"""Protocol v2's connection layer: many sessions (streams) on one WebSocket, h11-style.

A WebSocket message is ``varint(stream) ‖ payload``: the stream id as an unsigned LEB128 varint
(one byte below 128), then the payload.

* **Stream 0** is the connection's own: its payload is one control frame (:class:`Ready`,
  :class:`WindowUpdate`, :class:`End`), a msgpack array ``[kind, ...]``.
* **A stream s > 0** is one session, exactly as one WebSocket was in v1: its payload is one
  session frame of :mod:`shared.wire.messages` (Hello first, then Propose, Verdict, ...), with
  its own state, sequence numbers and epochs. The edge opens a stream by sending its Hello on a
  new id, larger than every id it used before on this connection, and may send the session's
  first Propose behind it in the same flight: a session costs no round trip to open.

The verifier speaks first: :class:`Ready` carries what v1's Welcome said of the verifier (its
model's fingerprint and its limits) once per connection, and the streams and window it grants.

**Flow control** (HTTP/2's per-stream windows): each stream may have at most ``window`` bytes of
session frames sent to the verifier and not yet consumed by its session; the verifier grants
more with :class:`WindowUpdate` as its session takes frames in. One session's backlog therefore
never holds another's frames back, and the verifier's memory per connection stays
``max_streams × window``. A stream that sends past its window has broken the rule and is ended
alone (``flow_control``).

**Ending a stream**: :class:`End` from either side. The edge sends it when its generation is done
(the verifier releases the session's cache); the verifier after a session's fatal Error frame
or a refusal. Frames that cross an End on the wire are dropped by their receiver, within a
bound: on the verifier, at most a window's worth per stream it ended.

The connection's loss ends every stream on it; each session resumes as a lone v1 session did.

Everything here is pure (no I/O, no clock): :class:`ServerMux` and :class:`ClientMux` take the
bytes read and return events, and the asyncio sides (``cloud_verifier.daemon.app``,
``edge_agent.link.connection``) carry them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final

import msgpack

from shared.errors import WanspecError
from shared.wire.messages import PROTOCOL_VERSION, SUBPROTOCOL, Fingerprint, Welcome

#: The connection's own stream.
CONTROL: Final = 0
#: Stream ids are below this (a varint of at most 5 bytes).
MAX_STREAM_ID: Final = 2**31 - 1
#: Bytes before a payload at most (the varint of the largest stream id).
MAX_PREFIX: Final = 5
#: The WebSocket close code of an End that is a normal end (RFC 6455's 1000).
END_OK: Final = 1000
#: A control frame is never larger than this.
MAX_CONTROL: Final = 1024
#: The subprotocols of earlier versions, named in refusals.
OLD_SUBPROTOCOLS: Final = tuple(f"wanspec.v{v}" for v in range(1, PROTOCOL_VERSION))


class MuxError(WanspecError, ValueError):
    """A connection-level fault (a malformed prefix or control frame, a frame for a stream that
    was never opened): the connection, and only it, is closed."""


class Control(IntEnum):
    READY = 1
    WINDOW = 2
    END = 3


@dataclass(frozen=True)
class Ready:
    """Verifier → edge, the connection's first frame: the target's fingerprint and limits (what
    each session's Welcome will say), ``max_streams`` sessions at once on this connection, and
    each stream's ``window`` (bytes of session frames in flight towards the verifier)."""

    fingerprint: Fingerprint
    max_gamma: int
    max_fixed: int
    max_context: int
    max_frame: int
    max_streams: int
    window: int

    def welcome(self) -> Welcome:
        """The Welcome a new session will get, known before it arrives: the edge runs the
        session on it from its first frame (zero round trips); the real one brings the
        session's id and resumption token."""
        return Welcome(
            fingerprint=self.fingerprint,
            session_id="",
            max_gamma=self.max_gamma,
            max_fixed=self.max_fixed,
            max_context=self.max_context,
            max_frame=self.max_frame,
        )


@dataclass(frozen=True)
class WindowUpdate:
    """Verifier → edge: ``credit`` more bytes may be sent on ``stream``."""

    stream: int
    credit: int


@dataclass(frozen=True)
class End:
    """Either direction: ``stream`` is over. ``code`` as a WebSocket close code (1000: a normal
    end; 1008: the session broke a rule; 1011: the verifier failed), ``reason`` for logs."""

    stream: int
    code: int = END_OK
    reason: str = ""


ControlFrame = Ready | WindowUpdate | End


# ------------------------------------------------------------------------------ framing


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def frame(stream: int, payload: bytes) -> bytes:
    """One WebSocket message: ``payload`` on ``stream``."""
    if not 0 <= stream <= MAX_STREAM_ID:
        raise ValueError(f"stream id {stream} out of range")
    return _varint(stream) + payload


def split(data: bytes) -> tuple[int, bytes]:
    """(stream, payload) of one WebSocket message; MuxError if its prefix is malformed."""
    if not isinstance(data, (bytes, bytearray)):
        raise MuxError(f"expected a binary message, got {type(data).__name__}")
    stream = 0
    for i in range(min(len(data), MAX_PREFIX)):
        byte = data[i]
        stream |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if stream > MAX_STREAM_ID:
                raise MuxError(f"stream id {stream} out of range")
            if i and byte == 0:
                raise MuxError("stream id not in its shortest form")
            return stream, bytes(data[i + 1 :])
    raise MuxError("malformed stream id" if data else "empty message")


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise MuxError(f"control {name}: expected an integer in [{lo}, {hi}], got {v!r:.40}")
    return v


def _str(v: Any, name: str, limit: int) -> str:
    if not isinstance(v, str) or len(v) > limit:
        raise MuxError(f"control {name}: expected a string of at most {limit} characters")
    return v


def encode_control(msg: ControlFrame) -> bytes:
    """A control frame, ready to send (on stream 0)."""
    body: list[Any]
    if isinstance(msg, Ready):
        fp = msg.fingerprint
        body = [
            Control.READY,
            PROTOCOL_VERSION,
            [fp.tokenizer_hash, fp.vocab_size, fp.model_name],
            msg.max_gamma,
            msg.max_fixed,
            msg.max_context,
            msg.max_frame,
            msg.max_streams,
            msg.window,
        ]
    elif isinstance(msg, WindowUpdate):
        body = [Control.WINDOW, msg.stream, msg.credit]
    else:
        body = [Control.END, msg.stream, msg.code, msg.reason[:200]]
    out = msgpack.packb(body, use_bin_type=True)
    assert isinstance(out, bytes)
    return frame(CONTROL, out)


_U32: Final = 2**32 - 1


def decode_control(payload: bytes) -> ControlFrame:
    """A control frame's payload; MuxError naming what is wrong."""
    if len(payload) > MAX_CONTROL:
        raise MuxError(f"control frame of {len(payload)} bytes (at most {MAX_CONTROL})")
    try:
        v = msgpack.unpackb(
            payload, raw=False, use_list=True, max_array_len=16, max_map_len=4, max_ext_len=0
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise MuxError(f"control frame is not msgpack ({type(e).__name__})") from None
    if not isinstance(v, list) or not v:
        raise MuxError("control frame: expected a non-empty array")
    kind = _int(v[0], "kind", 1, max(Control))
    want = {Control.READY: 9, Control.WINDOW: 3, Control.END: 4}[Control(kind)]
    if len(v) != want:
        raise MuxError(f"control {Control(kind).name}: {len(v)} fields, expected {want}")
    if kind == Control.WINDOW:
        return WindowUpdate(_int(v[1], "stream", 1, MAX_STREAM_ID), _int(v[2], "credit", 1, _U32))
    if kind == Control.END:
        return End(
            _int(v[1], "stream", 1, MAX_STREAM_ID),
            _int(v[2], "code", 1000, 4999),
            _str(v[3], "reason", 200),
        )
    version = _int(v[1], "version", 0, 255)
    if version != PROTOCOL_VERSION:
        raise MuxError(f"the verifier speaks protocol {version}, this edge {PROTOCOL_VERSION}")
    fp = v[2]
    if not isinstance(fp, list) or len(fp) != 3:
        raise MuxError("control READY: fingerprint must be [tokenizer, vocab, name]")
    return Ready(
        Fingerprint(
            _str(fp[0], "tokenizer", 128), _int(fp[1], "vocab", 1, _U32), _str(fp[2], "name", 256)
        ),
        max_gamma=_int(v[3], "max_gamma", 1, 4096),
        max_fixed=_int(v[4], "max_fixed", 1, _U32),
        max_context=_int(v[5], "max_context", 1, _U32),
        max_frame=_int(v[6], "max_frame", 64, 1 << 30),
        max_streams=_int(v[7], "max_streams", 1, 1 << 16),
        window=_int(v[8], "window", 64, 1 << 30),
    )


def stream_window(wanted: int, max_frame: int) -> int:
    """The window a verifier grants: ``wanted``, but at least twice a whole message of
    ``max_frame`` bytes, so that a frame always fits once half a window is consumed."""
    return max(wanted, 2 * (max_frame + MAX_PREFIX))


def old_protocol_message(offered: str) -> str:
    """What a peer offering an earlier subprotocol is told (both versions named)."""
    return (
        f"this verifier speaks {SUBPROTOCOL} (protocol {PROTOCOL_VERSION}); the client offered "
        f"{offered}: upgrade the edge agent"
    )


# ------------------------------------------------------------------------------ events


@dataclass(frozen=True)
class Opened:
    """A new stream, with its first frame (the session's Hello)."""

    stream: int
    payload: bytes


@dataclass(frozen=True)
class Data:
    """A session frame on an open stream."""

    stream: int
    payload: bytes


@dataclass(frozen=True)
class Overflow:
    """The edge sent past ``stream``'s window: the caller ends that stream (flow_control)."""

    stream: int
    queued: int


@dataclass(frozen=True)
class Refused:
    """A stream opened past ``max_streams``: the caller refuses it (busy) and ends it."""

    stream: int


#: What ``receive`` returns. The peer's control frames are their own events: a Ready
#: (the edge's first), a WindowUpdate (credit for one of the edge's streams), an End (the
#: peer ended that stream). Overflow and Refused name a stream that stays open here until the
#: caller ``end``s it, so that every stream this side ends goes through ``end``.
MuxEvent = Opened | Data | Overflow | Refused | Ready | WindowUpdate | End


# ------------------------------------------------------------------------------ verifier side


@dataclass
class _Inbound:
    queued: int = 0  # bytes received and not yet consumed by the session
    consumed: int = 0  # bytes consumed since the last WindowUpdate


class ServerMux:
    """The verifier's side of one connection. ``receive`` sorts each message into events; the
    session tasks report what they consumed (``consumed``, which may grant a window) and the
    streams they end (``end``)."""

    def __init__(self, max_streams: int, window: int) -> None:
        self.max_streams = max_streams
        self.window = window
        self.streams: dict[int, _Inbound] = {}
        self.last_id = 0
        #: Bytes of frames that may still arrive for streams this side ended (each ended
        #: stream adds its window): frames that crossed the End on the wire. Past it, the
        #: edge is sending to streams it knows are over.
        self.stray_budget = 0

    def receive(self, data: bytes) -> list[MuxEvent]:
        stream, payload = split(data)
        if stream == CONTROL:
            msg = decode_control(payload)
            if not isinstance(msg, End):
                raise MuxError(f"the edge sent {type(msg).__name__}, a verifier's control frame")
            if msg.stream in self.streams:
                del self.streams[msg.stream]
                return [msg]
            if msg.stream > self.last_id:
                raise MuxError(f"End for stream {msg.stream}, which was never opened")
            return []  # crossed our own End
        inbound = self.streams.get(stream)
        if inbound is None:
            if stream <= self.last_id:
                return self._stray(len(payload))
            self.last_id = stream
            full = len(self.streams) >= self.max_streams
            self.streams[stream] = _Inbound(queued=len(payload))
            return [Refused(stream) if full else Opened(stream, payload)]
        if inbound.queued + len(payload) > self.window:
            return [Overflow(stream, inbound.queued + len(payload))]
        inbound.queued += len(payload)
        return [Data(stream, payload)]

    def _stray(self, n: int) -> list[MuxEvent]:
        self.stray_budget -= n
        if self.stray_budget < 0:
            raise MuxError("frames for ended streams past their windows")
        return []

    def consumed(self, stream: int, n: int) -> WindowUpdate | None:
        """The session on ``stream`` took a frame of ``n`` bytes in: a WindowUpdate once half a
        window has been consumed since the last (so a steady stream costs one small frame per
        half window, and never stalls)."""
        inbound = self.streams.get(stream)
        if inbound is None:
            return None
        inbound.queued -= n
        inbound.consumed += n
        if inbound.consumed * 2 < self.window:
            return None
        credit, inbound.consumed = inbound.consumed, 0
        return WindowUpdate(stream, credit)

    def end(self, stream: int) -> bool:
        """This side ends ``stream``; whether it was open (an End is then to be sent)."""
        if self.streams.pop(stream, None) is None:
            return False
        self.stray_budget += self.window
        return True


# ------------------------------------------------------------------------------ edge side


@dataclass
class _Outbound:
    credit: int


@dataclass
class ClientMux:
    """The edge's side of one connection: the Ready, the streams it opened and each one's
    send window."""

    ready: Ready | None = None
    streams: dict[int, _Outbound] = field(default_factory=dict)
    last_id: int = 0

    def receive(self, data: bytes) -> list[MuxEvent]:
        stream, payload = split(data)
        if stream == CONTROL:
            msg = decode_control(payload)
            if isinstance(msg, Ready):
                if self.ready is not None:
                    raise MuxError("a second Ready")
                self.ready = msg
                return [msg]
            if self.ready is None:
                raise MuxError(f"{type(msg).__name__} before Ready")
            if msg.stream > self.last_id:
                raise MuxError(f"control frame for stream {msg.stream}, never opened")
            out = self.streams.get(msg.stream)
            if out is None:
                return []  # a stream this side ended already
            if isinstance(msg, WindowUpdate):
                out.credit = min(out.credit + msg.credit, 1 << 31)
            else:
                del self.streams[msg.stream]
            return [msg]
        if self.ready is None:
            raise MuxError("a session frame before Ready")
        if stream > self.last_id:
            raise MuxError(f"a frame for stream {stream}, never opened")
        if stream not in self.streams:
            return []  # crossed our End
        return [Data(stream, payload)]

    @property
    def full(self) -> bool:
        """Every stream the verifier grants is open."""
        return self.ready is None or len(self.streams) >= self.ready.max_streams

    def open(self) -> int:
        """A new stream's id (ValueError before Ready, when full, or out of ids)."""
        if self.ready is None:
            raise ValueError("no Ready yet")
        if self.full:
            raise ValueError(f"{self.ready.max_streams} streams are open (max_streams)")
        if self.last_id >= MAX_STREAM_ID:
            raise ValueError("this connection has used every stream id")
        self.last_id += 1
        self.streams[self.last_id] = _Outbound(self.ready.window)
        return self.last_id

    def may_send(self, stream: int, n: int) -> bool:
        """Whether ``n`` more bytes fit ``stream``'s window. The verifier's window is at least
        twice its largest frame and it grants credit once half a window is consumed, so a frame
        that does not fit now will once the session has read what is queued."""
        out = self.streams.get(stream)
        return out is None or n <= out.credit  # ended: send() raises

    def sent(self, stream: int, n: int) -> None:
        out = self.streams.get(stream)
        if out is not None:
            out.credit -= n

    def end(self, stream: int) -> bool:
        """This side ends ``stream``; whether it was open (an End is then to be sent)."""
        return self.streams.pop(stream, None) is not None
