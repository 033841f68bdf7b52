"""The autoregressive baseline's wire format (:mod:`bench.net.ar_server`): one msgpack request
frame up (:func:`encode_request`, :func:`decode_request`), then 4-byte token frames down and an
end frame. The simulation (:mod:`bench.lib.sim`) counts an ``ar`` request's bytes with the same
encoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np

MAX_REQUEST = 1 << 20
#: Bytes of a token frame (one little-endian uint32) and of a reported end frame (float64).
TOKEN_FRAME = 4
BUSY_FRAME = 8


@dataclass(frozen=True)
class ArRequest:
    prompt: list[int]
    max_new_tokens: int
    eos: set[int]
    keep: bool = False  # the connection stays open after the reply
    report: bool = False  # the end frame carries the reply's busy seconds (needs ``keep``)


def decode_request(data: bytes) -> ArRequest:
    try:
        m = msgpack.unpackb(data, raw=False, max_bin_len=MAX_REQUEST, max_array_len=64)
        prompt = np.frombuffer(m["prompt"], "<u4").astype(np.int64).tolist()
        req = ArRequest(
            prompt,
            int(m["max_new_tokens"]),
            {int(t) for t in m.get("eos", [])},
            bool(m.get("keep", False)),
            bool(m.get("report", False)),
        )
    except Exception as e:
        raise ValueError(f"bad request: {e}") from e
    if not prompt or not 1 <= req.max_new_tokens <= 1 << 16:
        raise ValueError("bad request: empty prompt or max_new_tokens out of range")
    if req.report and not req.keep:
        raise ValueError("bad request: report needs keep (the end frame carries the busy time)")
    return req


def encode_request(
    prompt: list[int],
    max_new_tokens: int,
    eos: list[int],
    *,
    keep: bool = False,
    report: bool = False,
) -> bytes:
    """A request; ``keep``: the connection stays open for the next one (a kept-alive cloud API:
    the reply ends with an end frame instead of the close), empty, or with ``report`` the
    reply's busy seconds (:data:`BUSY_FRAME` bytes)."""
    out = msgpack.packb(
        {
            "prompt": np.asarray(prompt, "<u4").tobytes(),
            "max_new_tokens": max_new_tokens,
            "eos": eos,
            "keep": keep,
            "report": report,
        },
        use_bin_type=True,
    )
    assert isinstance(out, bytes)
    return out
