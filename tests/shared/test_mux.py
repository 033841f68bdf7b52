"""Protocol v2's connection layer as pure functions over message sequences: framing, control
frames, and both sides' stream rules (opening, windows, ends, strays)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.wire.messages import PROTOCOL_VERSION, SUBPROTOCOL, Fingerprint
from shared.wire.mux import (
    MAX_STREAM_ID,
    ClientMux,
    Data,
    End,
    MuxError,
    Opened,
    Overflow,
    Ready,
    Refused,
    ServerMux,
    WindowUpdate,
    decode_control,
    encode_control,
    frame,
    old_protocol_message,
    split,
    stream_window,
)

pytestmark = pytest.mark.fast

FP = Fingerprint("tok", 64, "tiny")
READY = Ready(FP, 16, 8192, 8192, 1 << 20, 2, 4096)


# ---------------------------------------------------------------------------------- framing


@given(st.integers(0, MAX_STREAM_ID), st.binary(max_size=64))
def test_frames_round_trip(stream: int, payload: bytes) -> None:
    assert split(frame(stream, payload)) == (stream, payload)


def test_small_stream_ids_cost_one_byte() -> None:
    assert frame(1, b"x") == b"\x01x" and frame(127, b"") == b"\x7f"
    assert len(frame(128, b"")) == 2 and len(frame(MAX_STREAM_ID, b"")) == 5


@pytest.mark.parametrize(
    "data,why",
    [
        (b"", "empty"),
        (b"\x80", "malformed"),
        (b"\xff\xff\xff\xff\xff\x01", "malformed"),  # more than 5 bytes
        (b"\xff\xff\xff\xff\x7f", "out of range"),  # 2**35 - 1
        (b"\x81\x00", "shortest"),  # 1 written in two bytes
    ],
)
def test_malformed_prefixes_are_refused(data: bytes, why: str) -> None:
    with pytest.raises(MuxError, match=why):
        split(data)


def test_frame_refuses_ids_out_of_range() -> None:
    with pytest.raises(ValueError):
        frame(MAX_STREAM_ID + 1, b"")
    with pytest.raises(ValueError):
        frame(-1, b"")


@pytest.mark.parametrize("msg", [READY, WindowUpdate(3, 1000), End(7, 1008, "flow_control")])
def test_control_frames_round_trip(msg: Ready | WindowUpdate | End) -> None:
    stream, payload = split(encode_control(msg))
    assert stream == 0 and decode_control(payload) == msg


def _ctl(*fields: object) -> bytes:
    out = msgpack.packb(list(fields))
    assert isinstance(out, bytes)
    return out


@pytest.mark.parametrize(
    "payload,why",
    [
        (b"\xc1", "not msgpack"),
        (_ctl(), "non-empty array"),
        (msgpack.packb({"k": 1}), "array"),
        (_ctl(9, 1, 1), "kind"),
        (_ctl(2, 1), "fields"),
        (_ctl(2, 0, 10), "stream"),
        (_ctl(2, 1, 0), "credit"),
        (_ctl(2, 1, True), "credit"),
        (_ctl(3, 1, 999, ""), "code"),
        (_ctl(3, 1, 1000, "x" * 201), "reason"),
        (_ctl(1, 1, ["t", 64, "m"], 16, 8192, 8192, 1 << 20, 2, 4096), "protocol 1"),
        (_ctl(1, PROTOCOL_VERSION, ["t", 64], 16, 8192, 8192, 1 << 20, 2, 4096), "fingerprint"),
        (_ctl(1, PROTOCOL_VERSION, ["t", 64, "m"], 16, 8192, 8192, 1 << 20, 0, 4096), "streams"),
        (b"\x91" + b"\x01" * 2000, "bytes"),
    ],
)
def test_malformed_control_frames_are_refused(payload: bytes, why: str) -> None:
    with pytest.raises(MuxError, match=why):
        decode_control(payload)


def test_the_window_holds_two_whole_frames() -> None:
    assert stream_window(4096, 1 << 20) == 2 * ((1 << 20) + 5)
    assert stream_window(1 << 24, 1 << 20) == 1 << 24


def test_an_old_peer_is_told_both_versions() -> None:
    text = old_protocol_message("wanspec.v1")
    assert SUBPROTOCOL in text and "wanspec.v1" in text and str(PROTOCOL_VERSION) in text


# ---------------------------------------------------------------------------------- verifier


def test_server_opens_streams_by_their_first_frame_and_delivers_in_order() -> None:
    mux = ServerMux(max_streams=4, window=1000)
    assert mux.receive(frame(1, b"hello")) == [Opened(1, b"hello")]
    assert mux.receive(frame(3, b"hello3")) == [Opened(3, b"hello3")]
    assert mux.receive(frame(1, b"p1")) == [Data(1, b"p1")]
    assert mux.receive(frame(3, b"p3")) == [Data(3, b"p3")]
    assert mux.streams.keys() == {1, 3} and mux.last_id == 3


def test_server_grants_window_as_the_session_reads() -> None:
    mux = ServerMux(max_streams=4, window=100)
    mux.receive(frame(1, b"h" * 30))
    mux.receive(frame(1, b"p" * 60))
    assert mux.consumed(1, 30) is None  # 30 < half a window
    assert mux.consumed(1, 60) == WindowUpdate(1, 90)
    # what the edge may now send again: 100 - 0 queued
    assert mux.receive(frame(1, b"q" * 100)) == [Data(1, b"q" * 100)]


def test_a_flood_past_its_window_ends_that_stream_only() -> None:
    mux = ServerMux(max_streams=4, window=100)
    mux.receive(frame(1, b"a"))
    mux.receive(frame(2, b"b"))
    assert mux.receive(frame(1, b"x" * 99)) == [Data(1, b"x" * 99)]
    assert mux.receive(frame(1, b"y")) == [Overflow(1, 101)]
    assert mux.end(1)  # (the caller ends it, as every stream this side ends)
    assert mux.receive(frame(2, b"z" * 50)) == [Data(2, b"z" * 50)]
    assert 1 not in mux.streams and 2 in mux.streams


def test_frames_crossing_an_end_are_dropped_within_a_window() -> None:
    mux = ServerMux(max_streams=4, window=100)
    mux.receive(frame(1, b"a"))
    assert mux.end(1) and not mux.end(1)
    for _ in range(10):
        assert mux.receive(frame(1, b"x" * 10)) == []
    with pytest.raises(MuxError, match="past their windows"):
        mux.receive(frame(1, b"x"))


def test_stream_ids_are_never_reused() -> None:
    mux = ServerMux(max_streams=4, window=100)
    mux.receive(frame(5, b"a"))
    mux.receive(encode_control(End(5)))
    # an id at or below the last one is an old stream: never a new session
    with pytest.raises(MuxError):
        mux.receive(frame(4, b"hello"))


def test_streams_past_max_streams_are_refused() -> None:
    mux = ServerMux(max_streams=2, window=100)
    mux.receive(frame(1, b"a"))
    mux.receive(frame(2, b"b"))
    assert mux.receive(frame(3, b"c")) == [Refused(3)]
    assert mux.end(3)  # (the caller ends it)
    assert mux.receive(frame(3, b"more")) == []  # within the refused stream's window
    assert mux.receive(encode_control(End(1))) == [End(1, 1000, "")]
    assert mux.receive(frame(4, b"d")) == [Opened(4, b"d")]


def test_server_connection_faults() -> None:
    mux = ServerMux(max_streams=2, window=100)
    with pytest.raises(MuxError, match="never opened"):
        mux.receive(encode_control(End(9)))
    with pytest.raises(MuxError, match="verifier's control frame"):
        mux.receive(encode_control(WindowUpdate(1, 10)))
    with pytest.raises(MuxError, match="verifier's control frame"):
        mux.receive(encode_control(READY))


# ---------------------------------------------------------------------------------- edge


def test_client_opens_streams_after_ready_within_max_streams() -> None:
    mux = ClientMux()
    with pytest.raises(ValueError):
        mux.open()
    assert mux.receive(encode_control(READY)) == [READY]
    assert mux.open() == 1 and mux.open() == 2 and mux.full
    with pytest.raises(ValueError, match="max_streams"):
        mux.open()
    assert mux.end(1) and not mux.full and mux.open() == 3


def test_client_send_window() -> None:
    mux = ClientMux()
    mux.receive(encode_control(READY))
    s = mux.open()
    assert mux.may_send(s, 4096) and not mux.may_send(s, 4097)
    mux.sent(s, 4000)
    assert not mux.may_send(s, 100)
    assert mux.receive(encode_control(WindowUpdate(s, 2048))) == [WindowUpdate(s, 2048)]
    assert mux.may_send(s, 2144) and not mux.may_send(s, 2145)


def test_client_receives_per_stream_and_drops_what_crosses_its_end() -> None:
    mux = ClientMux()
    mux.receive(encode_control(READY))
    a, b = mux.open(), mux.open()
    assert mux.receive(frame(a, b"v")) == [Data(a, b"v")]
    assert mux.receive(encode_control(End(b, 1008, "rate_limited"))) == [
        End(b, 1008, "rate_limited")
    ]
    assert mux.receive(frame(b, b"late")) == []
    mux.end(a)
    assert mux.receive(frame(a, b"late")) == []
    assert mux.receive(encode_control(WindowUpdate(a, 10))) == []


@pytest.mark.parametrize(
    "first,why",
    [(frame(1, b"x"), "before Ready"), (encode_control(WindowUpdate(1, 5)), "before Ready")],
)
def test_client_needs_ready_first(first: bytes, why: str) -> None:
    with pytest.raises(MuxError, match=why):
        ClientMux().receive(first)


def test_client_connection_faults() -> None:
    mux = ClientMux()
    mux.receive(encode_control(READY))
    with pytest.raises(MuxError, match="second Ready"):
        mux.receive(encode_control(READY))
    with pytest.raises(MuxError, match="never opened"):
        mux.receive(frame(1, b"x"))
    with pytest.raises(MuxError, match="never opened"):
        mux.receive(encode_control(End(1)))
