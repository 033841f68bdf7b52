"""The wire bytes of every frame kind, pinned: a restructuring of the codec (modules moved, types
renamed, enums where strings were) must leave every byte on the wire as it was. Each frame's
SHA-256 is compared with the one recorded when it was last changed on purpose; a change to the
wire format updates this table in the same commit (and, if old peers break, PROTOCOL_VERSION)."""

from __future__ import annotations

import hashlib

import pytest

from shared.wire.codec import encode
from shared.wire.messages import Fingerprint
from shared.wire.mux import End, Ready, WindowUpdate, encode_control, frame
from tests.shared.test_protocol import ALL_MESSAGES, SMOL

_FP = Fingerprint("ab" * 32, 49152, "SmolLM2-135M-Instruct")

CONTROLS = [
    Ready(_FP, 16, 8192, 8192, 1 << 20, 64, 1 << 20),
    WindowUpdate(3, 65536),
    End(5),
    End(7, 1008, "bad_frame"),
]


def _frames() -> list[tuple[str, bytes]]:
    out = [(f"{i:02d}-{type(m).__name__}", encode(m, SMOL)) for i, m in enumerate(ALL_MESSAGES)]
    out += [(f"c{i}-{type(c).__name__}", encode_control(c)) for i, c in enumerate(CONTROLS)]
    out.append(("mux-frame", frame(300, b"payload")))
    return out


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


PINNED = {
    "00-Hello": "209690cbd9b6b80c",
    "01-Hello": "5c99971e6b52b59d",
    "02-Welcome": "47dee1a01abb9a44",
    "03-Welcome": "982a36477c833347",
    "04-Error": "15d8d6fa460de3d4",
    "05-Error": "a2e8fd93fa59cad7",
    "06-Propose": "f0829f63d5d1a7f3",
    "07-Propose": "7b4d3ec1b8b0bf36",
    "08-Propose": "f2d19b273efeb61a",
    "09-Verdict": "b1b73259c6beeb00",
    "10-Verdict": "402478553a3a441e",
    "11-Verdict": "517721b656ef00e4",
    "12-Verdict": "faaa100ecf615a4a",
    "13-Verdict": "f57eefa70c5e3869",
    "14-Verdict": "3f2b2023a3b68a65",
    "15-FederatedReply": "d81b6dabdb16a299",
    "16-FederatedReply": "ccf7161ae5d8cce2",
    "17-Rollback": "25e4af201cf12f92",
    "18-Resample": "df0042e18e07fb73",
    "19-Candidates": "ced85eeb1fd03a89",
    "20-Generated": "b20a26439d96ca3d",
    "21-Generated": "a62d38621a6410ab",
    "22-Hedge": "c12e9c9f7836b47c",
    "23-Progress": "d5a467eee2f775b1",
    "24-Progress": "94922a6996eadbbb",
    "25-Logprobs": "9d6e1b7cf1d3181b",
    "26-Logprobs": "7afcfa3ba1bc480b",
    "27-Verdict": "e8287a19d8938c3a",  # a cut with its budget (rationing)
    "c0-Ready": "82337d70dd46fdb9",
    "c1-WindowUpdate": "8358ccf30fa64af3",
    "c2-End": "b486f0aafaeba9ba",
    "c3-End": "0b931060e42e44e0",
    "mux-frame": "3221fa4a4038297f",
}


@pytest.mark.parametrize(("name", "data"), _frames(), ids=[n for n, _ in _frames()])
def test_frame_bytes_unchanged(name: str, data: bytes) -> None:
    assert _digest(data) == PINNED[name], f"{name}: the wire bytes changed"


def test_every_frame_is_pinned() -> None:
    assert sorted(PINNED) == sorted(n for n, _ in _frames())
