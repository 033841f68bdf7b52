"""The binary fields of the hot frames, and the session context they depend on.

Token ids and probabilities travel as little-endian binary fields, never as lists of numbers:

* ids are unsigned integers of ``id_width`` bytes (2 for |V| <= 65536, 3 for |V| <= 2**24, else 4),
  fixed for a session by the vocabulary size agreed in Hello/Welcome;
* probabilities are IEEE float32.

Hot frames (Propose, Verdict, FederatedReply, Rollback, Resample, Candidates, Generated, Hedge,
Logprobs) therefore need the session's :class:`WireContext` to decode; Hello, Welcome and Error are
self-describing. Every check here raises :class:`ProtocolError`, the one error a bad frame gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Final

import numpy as np
import numpy.typing as npt

from shared.errors import WanspecError
from shared.maths.compression import IdArray, ProbArray, SparseDist


class ProtocolError(WanspecError, ValueError):
    """A frame that cannot be accepted. ``field`` names the offending field (or "frame")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def id_width(vocab_size: int) -> int:
    """Bytes per token id on the wire for a vocabulary of ``vocab_size``."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 1 << 16:
        return 2
    if vocab_size <= 1 << 24:
        return 3
    return 4


@dataclass(frozen=True)
class WireContext:
    """Per-session settings that the hot frames' binary fields depend on, plus size limits."""

    vocab_size: int
    max_gamma: int = 64
    max_fixed: int = 32768
    max_k: int = 1 << 20
    max_frame: int = 4 << 20
    draft_probs: bool = True  # False in greedy-draft mode: Propose carries no q
    #: Propose's q in four bits each (q ≈ b/15, two a byte): greedy sampling decides by the
    #: target's argmax, so q is read only to rank draft slots for rationing, never to accept a
    #: token.
    coarse_q: bool = False

    @cached_property
    def width(self) -> int:
        return id_width(self.vocab_size)


#: Limits for frames decoded before a session exists (Hello/Welcome/Error).
HANDSHAKE_MAX_FRAME: Final = 4096


def pack_ids(ids: npt.ArrayLike, width: int) -> bytes:
    """Little-endian unsigned ids of ``width`` bytes each."""
    a = np.asarray(ids, dtype=np.int64).reshape(-1)
    if a.size and (a.min() < 0 or a.max() >= 1 << (8 * width)):
        raise ValueError(f"token id out of range for {width}-byte ids")
    raw = a.astype("<u4").view(np.uint8).reshape(-1, 4)
    return raw[:, :width].tobytes()


def unpack_ids(buf: bytes, width: int, vocab_size: int, name: str) -> IdArray:
    if len(buf) % width:
        raise ProtocolError(name, f"length {len(buf)} is not a multiple of {width}")
    n = len(buf) // width
    raw = np.zeros((n, 4), np.uint8)
    raw[:, :width] = np.frombuffer(buf, np.uint8).reshape(n, width)
    ids = raw.view("<u4").reshape(n).astype(np.int64)
    if n and int(ids.max()) >= vocab_size:
        raise ProtocolError(name, f"token id {int(ids.max())} >= vocabulary size {vocab_size}")
    return ids


def pack_probs(p: npt.ArrayLike) -> bytes:
    return np.asarray(p, dtype="<f4").reshape(-1).tobytes()


#: Levels of a coarse probability (four bits: q ≈ b/15, b in 1..15).
COARSE_LEVELS: Final = 15


def coarse_bytes(n: int) -> int:
    """Bytes of ``n`` coarse probabilities."""
    return (n + 1) // 2


def pack_coarse(p: npt.ArrayLike) -> bytes:
    """Probabilities in (0, 1] in four bits each, two a byte (low nibble first):
    round(15·p), at least 1."""
    a = np.asarray(p, dtype=np.float64).reshape(-1)
    b = np.clip(np.rint(a * COARSE_LEVELS), 1, COARSE_LEVELS).astype(np.uint8)
    if b.size % 2:
        b = np.append(b, np.uint8(0))
    return (b[0::2] | (b[1::2] << 4)).astype(np.uint8).tobytes()


def unpack_coarse(buf: bytes, n: int, name: str) -> ProbArray:
    """``n`` coarse probabilities from ``buf`` (:func:`pack_coarse`)."""
    raw = np.frombuffer(buf, np.uint8)
    if len(raw) != coarse_bytes(n):
        raise ProtocolError(name, f"{len(raw)} bytes for {n} probabilities")
    b = np.stack([raw & 0x0F, raw >> 4], axis=1).reshape(-1)
    if n % 2 and b[-1]:
        raise ProtocolError(name, "padding nibble is not 0")
    b = b[:n]
    if b.size and int(b.min()) == 0:
        raise ProtocolError(name, "probability 0 outside (0, 1]")
    out: ProbArray = b.astype(np.float32) / np.float32(COARSE_LEVELS)
    return out


def unpack_probs(buf: bytes, name: str, *, allow_zero: bool = False) -> ProbArray:
    if len(buf) % 4:
        raise ProtocolError(name, f"length {len(buf)} is not a multiple of 4")
    p = np.frombuffer(buf, "<f4").astype(np.float32)
    if not np.all(np.isfinite(p)):
        raise ProtocolError(name, "probability is not finite")
    lo_ok = p >= 0.0 if allow_zero else p > 0.0
    if not np.all(lo_ok & (p <= 1.0)):
        bad = float(p[~(lo_ok & (p <= 1.0))][0])
        rng = "[0, 1]" if allow_zero else "(0, 1]"
        raise ProtocolError(name, f"probability {bad} outside {rng}")
    return p


def unpack_sparse(
    buf: bytes, ctx: WireContext, name: str, *, distributional: bool = True
) -> SparseDist:
    """A top-K (``distributional``: distinct ids, mass <= 1) or a candidate list (i.i.d. draws:
    ids may repeat)."""
    w = ctx.width
    if len(buf) % (w + 4):
        raise ProtocolError(name, f"length {len(buf)} is not a multiple of {w + 4}")
    k = len(buf) // (w + 4)
    if k > ctx.max_k:
        raise ProtocolError(name, f"{k} entries exceed the limit {ctx.max_k}")
    ids = unpack_ids(buf[: k * w], w, ctx.vocab_size, name + ".ids")
    probs = unpack_probs(buf[k * w :], name + ".probs")
    if distributional:
        if k and len(np.unique(ids)) != k:
            raise ProtocolError(name, "duplicate token ids")
        if float(np.sum(probs, dtype=np.float64)) > 1.0 + 1e-4:
            raise ProtocolError(name, "probabilities sum to more than 1")
    return SparseDist(ids, probs)
