"""Wire protocol v1: msgpack frames between the edge agent and a cloud verifier.

Every frame is one msgpack map whose key 0 holds the protocol version and the message type in one
byte (``version << 4 | type``); the other keys are small integers (one byte each on the wire).
Token ids and probabilities travel as little-endian binary fields, never as lists of numbers:

* ids are unsigned integers of ``id_width`` bytes (2 for |V| <= 65536, 3 for |V| <= 2**24, else 4),
  fixed for a session by the vocabulary size agreed in Hello/Welcome;
* probabilities are IEEE float32.

Hot frames (Propose, Verdict, FederatedReply, Rollback, Resample, Candidates) therefore need the
session's :class:`WireContext` to decode; Hello, Welcome and Error are self-describing.

Semantics (see DESIGN.md): one WebSocket is one session. ``epoch`` counts rejections; a frame of an
older epoch than the receiver's is stale. ``seq`` is the batch sequence number modulo 128 (a
7-bit rolling counter: frames are ordered by TCP, so it is a consistency check against replays and
losses within the in-flight window, which is bounded by ``MAX_DEPTH`` < 128). ``pos`` is the
absolute position of the first token a Propose carries (fixed tokens first, then drafts).

Decoding is strict: every field is type- and range-checked and any fault raises
:class:`ProtocolError` naming the field. Nothing here does I/O; there is no pickle and no eval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Final

import msgpack
import numpy as np
import numpy.typing as npt

from shared.enums import TextEnum
from shared.sampling import SamplingParams

PROTOCOL_VERSION: Final = 1
#: WebSocket subprotocol naming the protocol version.
SUBPROTOCOL: Final = "wanspec.v1"
#: Sequence numbers roll over modulo this; the in-flight depth must stay below it.
SEQ_MODULUS: Final = 128
MAX_DEPTH: Final = SEQ_MODULUS - 1

IdArray = npt.NDArray[np.int64]
ProbArray = npt.NDArray[np.float32]


class ProtocolError(ValueError):
    """A frame that cannot be accepted. ``field`` names the offending field (or "frame")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class MsgType(IntEnum):
    HELLO = 1
    WELCOME = 2
    PROPOSE = 3
    VERDICT = 4
    FEDERATED_REPLY = 5
    ROLLBACK = 6
    ERROR = 7
    RESAMPLE = 8
    CANDIDATES = 9


class CorrectionMode(TextEnum):
    """How a rejection is corrected (negotiated in Hello).

    * ``topk``: the verifier sends the top-K of p at the rejected position; the edge samples the
      residual norm(max(0, p̂ − q)) from the reconstruction p̂. Lossy: error bounded by ε.
    * ``candidates``: exact. The verifier sends M ids drawn from p with the rejected id excluded,
      with p of each; the edge accepts the first y with probability max(0, 1 − q(y)/p(y)). If all
      M fail it sends Resample and receives M more (rare; counted).
    * ``greedy_draft``: exact, ids only. The draft proposes deterministically (q one-hot), so the
      acceptance probability is p(x) and the verifier samples the correction from p with x zeroed.
    """

    TOPK = "topk"
    CANDIDATES = "candidates"
    GREEDY_DRAFT = "greedy_draft"


class ReplyMode(TextEnum):
    """``verdict``: the verifier decides (PicoSpec); ``federated``: it sends distributions."""

    VERDICT = "verdict"
    FEDERATED = "federated"


# Integer keys of the hot frames. Names are used in error messages.
K_VT: Final = 0
K_EPOCH: Final = 1
K_SEQ: Final = 2
K_POS: Final = 3
K_A: Final = 4
K_B: Final = 5
K_C: Final = 6
K_D: Final = 7
K_E: Final = 8

_U32_MAX: Final = 2**32 - 1
_FLAG_BONUS: Final = 1


# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fingerprint:
    """What must match between a draft and a target: the tokenizer (hash and vocabulary size).

    ``model_name`` is informative: heterogeneous targets of one tokenizer are allowed.
    """

    tokenizer_hash: str
    vocab_size: int
    model_name: str

    def compatible_with(self, other: Fingerprint) -> str | None:
        """None when compatible, else a reason a user can act on."""
        if self.vocab_size != other.vocab_size:
            return (
                f"vocabulary size differs: {self.model_name} has {self.vocab_size}, "
                f"{other.model_name} has {other.vocab_size}"
            )
        if self.tokenizer_hash != other.tokenizer_hash:
            return (
                f"tokenizers differ: {self.model_name} ({self.tokenizer_hash[:12]}) vs "
                f"{other.model_name} ({other.tokenizer_hash[:12]}); draft and target must share one"
            )
        return None


@dataclass(frozen=True)
class Hello:
    """Edge → verifier, first frame of a session."""

    fingerprint: Fingerprint
    sampling: SamplingParams = field(default_factory=SamplingParams)
    reply_mode: ReplyMode = ReplyMode.VERDICT
    correction: CorrectionMode = CorrectionMode.TOPK
    k: int = 10  # top-K size of sparse distributions (upper bound when eps_target > 0)
    eps_target: float = 0.0  # adaptive K: smallest K with kept mass >= 1 - eps_target (0 = fixed K)
    m: int = 8  # candidates per exact correction
    bonus: bool = False  # a bonus token on every full acceptance (stop-and-wait)
    seed: int | None = None  # verifier RNG seed for this session (reproducible runs)


@dataclass(frozen=True)
class Welcome:
    """Verifier → edge: accepted. Limits the edge must respect for this session."""

    fingerprint: Fingerprint
    session_id: str
    max_gamma: int
    max_fixed: int
    max_context: int
    max_frame: int


@dataclass(frozen=True)
class Propose:
    """Edge → verifier: one batch. ``fixed`` tokens are committed (prompt, correction) and are
    appended before the γ ``draft`` tokens; ``q`` holds q_i(x_i) of each draft token (all 1 in
    greedy-draft mode, where it is not sent)."""

    epoch: int
    seq: int
    pos: int
    draft: IdArray  # [γ]
    q: ProbArray  # [γ]
    fixed: IdArray = field(default_factory=lambda: np.zeros(0, np.int64))  # [F]
    want_bonus: bool = False


@dataclass(frozen=True)
class SparseDist:
    """Top-K of a distribution: ``ids`` in decreasing probability, ``probs`` their exact values."""

    ids: IdArray  # [K]
    probs: ProbArray  # [K]

    @property
    def eps(self) -> float:
        """ε: the probability mass outside the kept entries."""
        return max(0.0, 1.0 - float(np.sum(self.probs, dtype=np.float64)))


@dataclass(frozen=True)
class Verdict:
    """Verifier → edge, the answer to one Propose (``epoch``/``seq`` are the batch's).

    ``accepted`` draft tokens were accepted. When accepted < γ, exactly one correction is set:
    ``sparse`` (top-K of p at the rejected position), ``candidates`` (exact mode (a)) or ``token``
    (the recovered token itself: greedy target, or greedy-draft mode). ``bonus`` is set on full
    acceptance when asked for.
    """

    epoch: int
    seq: int
    accepted: int
    sparse: SparseDist | None = None
    candidates: SparseDist | None = None
    token: int | None = None
    bonus: int | None = None


@dataclass(frozen=True)
class FederatedReply:
    """Worker → edge (SpecFed): per position j = 0..γ a top-k sparse distribution of p_j, and the
    exact scalars p_j(x_j) for the γ drafted tokens. ``l1`` optionally carries the worker's own
    exact ‖p̂_j − p_j‖₁ for reconstructions A and B, shape [γ+1, 2]."""

    epoch: int
    seq: int
    dists: tuple[SparseDist, ...]  # γ+1
    p_draft: ProbArray  # [γ]
    l1: npt.NDArray[np.float32] | None = None  # [γ+1, 2]


@dataclass(frozen=True)
class Rollback:
    """Edge → worker: a rejection at the edge; keep the first ``pos`` tokens, enter ``epoch``."""

    epoch: int
    pos: int


@dataclass(frozen=True)
class Resample:
    """Edge → verifier: all candidates of the correction at ``pos`` failed; send ``m`` more."""

    epoch: int
    pos: int


@dataclass(frozen=True)
class Candidates:
    """Verifier → edge: more candidates for the correction at ``pos``."""

    epoch: int
    pos: int
    candidates: SparseDist


@dataclass(frozen=True)
class Error:
    """Either direction. ``fatal`` errors close the session."""

    code: str
    message: str
    fatal: bool = False


Message = (
    Hello | Welcome | Propose | Verdict | FederatedReply | Rollback | Resample | Candidates | Error
)


# --------------------------------------------------------------------------------------------
# Session context for the binary fields
# --------------------------------------------------------------------------------------------


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

    @property
    def width(self) -> int:
        return id_width(self.vocab_size)


#: Limits for frames decoded before a session exists (Hello/Welcome/Error).
HANDSHAKE_MAX_FRAME: Final = 4096


# --------------------------------------------------------------------------------------------
# Binary fields
# --------------------------------------------------------------------------------------------


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


def _pack_sparse(d: SparseDist, width: int) -> bytes:
    return pack_ids(d.ids, width) + pack_probs(d.probs)


def _unpack_sparse(
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


# --------------------------------------------------------------------------------------------
# Field readers
# --------------------------------------------------------------------------------------------


def _get(m: dict[Any, Any], key: Any, name: str, required: bool = True) -> Any:
    if key in m:
        return m[key]
    if required:
        raise ProtocolError(name, "missing")
    return None


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    # bool is an int subclass in Python; refuse it so True does not pass as 1.
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(name, f"expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ProtocolError(name, f"{v} outside [{lo}, {hi}]")
    return v


def _float(v: Any, name: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ProtocolError(name, f"expected a number, got {type(v).__name__}")
    f = float(v)
    if not math.isfinite(f) or not lo <= f <= hi:
        raise ProtocolError(name, f"{v} outside [{lo}, {hi}]")
    return f


def _str(v: Any, name: str, max_len: int = 256) -> str:
    if not isinstance(v, str):
        raise ProtocolError(name, f"expected a string, got {type(v).__name__}")
    if len(v) > max_len:
        raise ProtocolError(name, f"longer than {max_len} characters")
    return v


def _bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(name, f"expected a boolean, got {type(v).__name__}")
    return v


def _bin(v: Any, name: str) -> bytes:
    if not isinstance(v, bytes):
        raise ProtocolError(name, f"expected binary, got {type(v).__name__}")
    return v


def _choice(v: Any, name: str, choices: tuple[str, ...]) -> str:
    s = _str(v, name)
    if s not in choices:
        raise ProtocolError(name, f"{s!r} is not one of {', '.join(choices)}")
    return s


def _check_keys(m: dict[Any, Any], allowed: set[Any], name: str) -> None:
    extra = set(m) - allowed
    if extra:
        raise ProtocolError(name, f"unknown field(s) {sorted(map(str, extra))}")


# --------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------


def _vt(t: MsgType) -> int:
    return (PROTOCOL_VERSION << 4) | int(t)


def _fp_map(fp: Fingerprint) -> dict[str, Any]:
    return {"tok": fp.tokenizer_hash, "vocab": fp.vocab_size, "name": fp.model_name}


def _pack(m: dict[Any, Any]) -> bytes:
    out = msgpack.packb(m, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def encode(msg: Message, ctx: WireContext | None = None) -> bytes:
    """Encode ``msg``. Hot frames need the session's ``ctx`` for their binary fields."""
    if isinstance(msg, Hello):
        s = msg.sampling
        h: dict[Any, Any] = {
            K_VT: _vt(MsgType.HELLO),
            "fp": _fp_map(msg.fingerprint),
            "sampling": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p},
            "reply": ReplyMode(msg.reply_mode).value,
            "correction": CorrectionMode(msg.correction).value,
            "k": msg.k,
            "eps": msg.eps_target,
            "m": msg.m,
            "bonus": msg.bonus,
        }
        if msg.seed is not None:
            h["seed"] = msg.seed
        return _pack(h)
    if isinstance(msg, Welcome):
        return _pack(
            {
                K_VT: _vt(MsgType.WELCOME),
                "fp": _fp_map(msg.fingerprint),
                "session": msg.session_id,
                "max_gamma": msg.max_gamma,
                "max_fixed": msg.max_fixed,
                "max_context": msg.max_context,
                "max_frame": msg.max_frame,
            }
        )
    if isinstance(msg, Error):
        return _pack(
            {K_VT: _vt(MsgType.ERROR), "code": msg.code, "msg": msg.message, "fatal": msg.fatal}
        )
    if ctx is None:
        raise ValueError(f"{type(msg).__name__} needs the session's WireContext")
    w = ctx.width
    if isinstance(msg, Propose):
        draft = pack_ids(msg.draft, w)
        if ctx.draft_probs:
            draft += pack_probs(msg.q)
        m: dict[Any, Any] = {
            K_VT: _vt(MsgType.PROPOSE),
            K_EPOCH: msg.epoch,
            K_SEQ: msg.seq,
            K_POS: msg.pos,
            K_A: draft,
        }
        if len(msg.fixed):
            m[K_B] = pack_ids(msg.fixed, w)
        if msg.want_bonus:
            m[K_C] = _FLAG_BONUS
        return _pack(m)
    if isinstance(msg, Verdict):
        m = {K_VT: _vt(MsgType.VERDICT), K_EPOCH: msg.epoch, K_SEQ: msg.seq, K_POS: msg.accepted}
        if msg.sparse is not None:
            m[K_A] = _pack_sparse(msg.sparse, w)
        if msg.candidates is not None:
            m[K_B] = _pack_sparse(msg.candidates, w)
        if msg.token is not None:
            m[K_C] = msg.token
        if msg.bonus is not None:
            m[K_D] = msg.bonus
        return _pack(m)
    if isinstance(msg, FederatedReply):
        ks = np.array([len(d.ids) for d in msg.dists], "<u4")
        m = {
            K_VT: _vt(MsgType.FEDERATED_REPLY),
            K_EPOCH: msg.epoch,
            K_SEQ: msg.seq,
            K_A: ks.tobytes(),
            K_B: pack_ids(np.concatenate([d.ids for d in msg.dists]), w),
            K_C: pack_probs(np.concatenate([d.probs for d in msg.dists])),
            K_D: pack_probs(msg.p_draft),
        }
        if msg.l1 is not None:
            m[K_E] = pack_probs(msg.l1)
        return _pack(m)
    if isinstance(msg, Rollback):
        return _pack({K_VT: _vt(MsgType.ROLLBACK), K_EPOCH: msg.epoch, K_POS: msg.pos})
    if isinstance(msg, Resample):
        return _pack({K_VT: _vt(MsgType.RESAMPLE), K_EPOCH: msg.epoch, K_POS: msg.pos})
    if isinstance(msg, Candidates):
        return _pack(
            {
                K_VT: _vt(MsgType.CANDIDATES),
                K_EPOCH: msg.epoch,
                K_POS: msg.pos,
                K_B: _pack_sparse(msg.candidates, w),
            }
        )
    raise TypeError(f"not a protocol message: {type(msg).__name__}")


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


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
    return _header(_unpack_map(data, max_frame))


def _header(m: dict[Any, Any]) -> MsgType:
    vt = _int(_get(m, K_VT, "version/type"), "version/type", 0, 255)
    version, t = vt >> 4, vt & 0xF
    if version != PROTOCOL_VERSION:
        raise ProtocolError("version", f"unsupported protocol version {version}")
    try:
        return MsgType(t)
    except ValueError:
        raise ProtocolError("type", f"unknown message type {t}") from None


def _decode_fp(v: Any) -> Fingerprint:
    if not isinstance(v, dict):
        raise ProtocolError("fp", "expected a map")
    _check_keys(v, {"tok", "vocab", "name"}, "fp")
    return Fingerprint(
        tokenizer_hash=_str(_get(v, "tok", "fp.tok"), "fp.tok", 128),
        vocab_size=_int(_get(v, "vocab", "fp.vocab"), "fp.vocab", 1, _U32_MAX),
        model_name=_str(_get(v, "name", "fp.name"), "fp.name", 256),
    )


def decode(data: bytes, ctx: WireContext | None = None) -> Message:
    """Decode and validate one frame. Raises :class:`ProtocolError` naming the bad field.

    Without ``ctx`` only Hello, Welcome and Error decode (frames are then bounded by
    ``HANDSHAKE_MAX_FRAME``); hot frames are refused.
    """
    max_frame = ctx.max_frame if ctx is not None else HANDSHAKE_MAX_FRAME
    m = _unpack_map(data, max_frame)
    t = _header(m)
    if t == MsgType.HELLO:
        _check_keys(
            m,
            {K_VT, "fp", "sampling", "reply", "correction", "k", "eps", "m", "bonus", "seed"},
            "hello",
        )
        s = _get(m, "sampling", "sampling")
        if not isinstance(s, dict):
            raise ProtocolError("sampling", "expected a map")
        _check_keys(s, {"temperature", "top_k", "top_p"}, "sampling")
        sampling = SamplingParams(
            temperature=_float(s.get("temperature", 1.0), "sampling.temperature", 0.0, 100.0),
            top_k=_int(s.get("top_k", 0), "sampling.top_k", 0, 1 << 24),
            top_p=_float(s.get("top_p", 1.0), "sampling.top_p", 1e-9, 1.0),
        )  # ranges checked above, so SamplingParams cannot refuse them
        seed = _get(m, "seed", "seed", required=False)
        return Hello(
            fingerprint=_decode_fp(_get(m, "fp", "fp")),
            sampling=sampling,
            reply_mode=ReplyMode(_choice(_get(m, "reply", "reply"), "reply", ReplyMode.choices())),
            correction=CorrectionMode(
                _choice(_get(m, "correction", "correction"), "correction", CorrectionMode.choices())
            ),
            k=_int(_get(m, "k", "k"), "k", 1, 1 << 24),
            eps_target=_float(_get(m, "eps", "eps"), "eps", 0.0, 1.0),
            m=_int(_get(m, "m", "m"), "m", 1, 4096),
            bonus=_bool(_get(m, "bonus", "bonus"), "bonus"),
            seed=None if seed is None else _int(seed, "seed", 0, 2**63 - 1),
        )
    if t == MsgType.WELCOME:
        _check_keys(
            m,
            {K_VT, "fp", "session", "max_gamma", "max_fixed", "max_context", "max_frame"},
            "welcome",
        )
        return Welcome(
            fingerprint=_decode_fp(_get(m, "fp", "fp")),
            session_id=_str(_get(m, "session", "session"), "session", 64),
            max_gamma=_int(_get(m, "max_gamma", "max_gamma"), "max_gamma", 1, 4096),
            max_fixed=_int(_get(m, "max_fixed", "max_fixed"), "max_fixed", 1, _U32_MAX),
            max_context=_int(_get(m, "max_context", "max_context"), "max_context", 1, _U32_MAX),
            max_frame=_int(_get(m, "max_frame", "max_frame"), "max_frame", 64, 1 << 30),
        )
    if t == MsgType.ERROR:
        _check_keys(m, {K_VT, "code", "msg", "fatal"}, "error")
        return Error(
            code=_str(_get(m, "code", "code"), "code", 64),
            message=_str(_get(m, "msg", "msg"), "msg", 4096),
            fatal=_bool(_get(m, "fatal", "fatal"), "fatal"),
        )
    if ctx is None:
        raise ProtocolError("type", f"{t.name} before the session is established")
    return _decode_hot(t, m, ctx)


def _decode_hot(t: MsgType, m: dict[Any, Any], ctx: WireContext) -> Message:
    w, vocab = ctx.width, ctx.vocab_size
    epoch = _int(_get(m, K_EPOCH, "epoch"), "epoch", 0, _U32_MAX)
    if t == MsgType.PROPOSE:
        _check_keys(m, {K_VT, K_EPOCH, K_SEQ, K_POS, K_A, K_B, K_C}, "propose")
        seq = _int(_get(m, K_SEQ, "seq"), "seq", 0, SEQ_MODULUS - 1)
        pos = _int(_get(m, K_POS, "pos"), "pos", 0, _U32_MAX)
        blob = _bin(_get(m, K_A, "draft"), "draft")
        per = w + 4 if ctx.draft_probs else w
        if len(blob) % per:
            raise ProtocolError("draft", f"length {len(blob)} is not a multiple of {per}")
        gamma = len(blob) // per
        if not 1 <= gamma <= ctx.max_gamma:
            raise ProtocolError("draft", f"γ = {gamma} outside [1, {ctx.max_gamma}]")
        draft = unpack_ids(blob[: gamma * w], w, vocab, "draft.ids")
        if ctx.draft_probs:
            q = unpack_probs(blob[gamma * w :], "draft.q")
        else:
            q = np.ones(gamma, np.float32)
        fixed_raw = _get(m, K_B, "fixed", required=False)
        fixed = (
            np.zeros(0, np.int64)
            if fixed_raw is None
            else unpack_ids(_bin(fixed_raw, "fixed"), w, vocab, "fixed")
        )
        if len(fixed) > ctx.max_fixed:
            raise ProtocolError("fixed", f"{len(fixed)} tokens exceed the limit {ctx.max_fixed}")
        flags = _get(m, K_C, "flags", required=False)
        want_bonus = False
        if flags is not None:
            want_bonus = bool(_int(flags, "flags", 0, _FLAG_BONUS) & _FLAG_BONUS)
        return Propose(epoch, seq, pos, draft, q, fixed, want_bonus)
    if t == MsgType.VERDICT:
        _check_keys(m, {K_VT, K_EPOCH, K_SEQ, K_POS, K_A, K_B, K_C, K_D}, "verdict")
        seq = _int(_get(m, K_SEQ, "seq"), "seq", 0, SEQ_MODULUS - 1)
        accepted = _int(_get(m, K_POS, "accepted"), "accepted", 0, ctx.max_gamma)
        sp, cd = m.get(K_A), m.get(K_B)
        tok, bonus = m.get(K_C), m.get(K_D)
        n_corr = sum(x is not None for x in (sp, cd, tok))
        if n_corr > 1:
            raise ProtocolError("verdict", "more than one correction")
        if bonus is not None and n_corr:
            raise ProtocolError("bonus", "a bonus token with a correction")
        return Verdict(
            epoch,
            seq,
            accepted,
            sparse=None if sp is None else _unpack_sparse(_bin(sp, "sparse"), ctx, "sparse"),
            candidates=None
            if cd is None
            else _unpack_sparse(
                _bin(cd, "candidates"), ctx, "candidates", distributional=False
            ),
            token=None if tok is None else _int(tok, "token", 0, vocab - 1),
            bonus=None if bonus is None else _int(bonus, "bonus", 0, vocab - 1),
        )
    if t == MsgType.FEDERATED_REPLY:
        _check_keys(m, {K_VT, K_EPOCH, K_SEQ, K_A, K_B, K_C, K_D, K_E}, "federated_reply")
        seq = _int(_get(m, K_SEQ, "seq"), "seq", 0, SEQ_MODULUS - 1)
        ks_raw = _bin(_get(m, K_A, "ks"), "ks")
        if len(ks_raw) % 4 or not 2 <= len(ks_raw) // 4 <= ctx.max_gamma + 1:
            raise ProtocolError("ks", f"needs 2..{ctx.max_gamma + 1} uint32 entries")
        ks = np.frombuffer(ks_raw, "<u4").astype(np.int64)
        if np.any(ks > ctx.max_k) or np.any(ks > vocab):
            raise ProtocolError("ks", f"a top-k size exceeds the limit {min(ctx.max_k, vocab)}")
        total = int(ks.sum())
        ids = unpack_ids(_bin(_get(m, K_B, "ids"), "ids"), w, vocab, "ids")
        probs = unpack_probs(_bin(_get(m, K_C, "probs"), "probs"), "probs")
        if len(ids) != total or len(probs) != total:
            raise ProtocolError("ids", f"expected {total} entries, got {len(ids)} / {len(probs)}")
        dists = []
        for j, (a, b) in enumerate(zip(np.cumsum(ks) - ks, np.cumsum(ks), strict=True)):
            d = SparseDist(ids[a:b], probs[a:b])
            if len(np.unique(d.ids)) != len(d.ids):
                raise ProtocolError(f"dists[{j}]", "duplicate token ids")
            if float(np.sum(d.probs, dtype=np.float64)) > 1.0 + 1e-4:
                raise ProtocolError(f"dists[{j}]", "probabilities sum to more than 1")
            dists.append(d)
        p_draft = unpack_probs(_bin(_get(m, K_D, "p_draft"), "p_draft"), "p_draft", allow_zero=True)
        if len(p_draft) != len(ks) - 1:
            raise ProtocolError("p_draft", f"expected {len(ks) - 1} scalars, got {len(p_draft)}")
        l1_raw = m.get(K_E)
        l1 = None
        if l1_raw is not None:
            buf = _bin(l1_raw, "l1")
            if len(buf) != 8 * len(ks):
                raise ProtocolError("l1", f"expected {2 * len(ks)} float32 values")
            l1 = np.frombuffer(buf, "<f4").astype(np.float32).reshape(len(ks), 2)
            if not np.all(np.isfinite(l1) & (l1 >= 0) & (l1 <= 2.0 + 1e-4)):
                raise ProtocolError("l1", "values must be finite and in [0, 2]")
        return FederatedReply(epoch, seq, tuple(dists), p_draft, l1)
    if t in (MsgType.ROLLBACK, MsgType.RESAMPLE):
        _check_keys(m, {K_VT, K_EPOCH, K_POS}, t.name.lower())
        pos = _int(_get(m, K_POS, "pos"), "pos", 0, _U32_MAX)
        return Rollback(epoch, pos) if t == MsgType.ROLLBACK else Resample(epoch, pos)
    if t == MsgType.CANDIDATES:
        _check_keys(m, {K_VT, K_EPOCH, K_POS, K_B}, "candidates")
        pos = _int(_get(m, K_POS, "pos"), "pos", 0, _U32_MAX)
        cands = _unpack_sparse(
            _bin(_get(m, K_B, "candidates"), "candidates"), ctx, "candidates", distributional=False
        )
        if len(cands.ids) == 0:
            raise ProtocolError("candidates", "empty")
        return Candidates(epoch, pos, cands)
    raise ProtocolError("type", f"{t.name} is not valid here")  # pragma: no cover


def message_equal(a: Message, b: Message) -> bool:
    """Structural equality (numpy fields compared by value); used by tests and replay checks."""
    if type(a) is not type(b):
        return False
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, tuple) and x and isinstance(x[0], SparseDist):
            if len(x) != len(y) or not all(_sparse_eq(u, v) for u, v in zip(x, y, strict=True)):
                return False
        elif isinstance(x, SparseDist) or isinstance(y, SparseDist):
            if x is None or y is None or not _sparse_eq(x, y):
                return False
        elif isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if x is None or y is None or not np.array_equal(np.asarray(x), np.asarray(y)):
                return False
        elif x != y:
            return False
    return True


def _sparse_eq(a: SparseDist, b: SparseDist) -> bool:
    return bool(np.array_equal(a.ids, b.ids) and np.array_equal(a.probs, b.probs))


__all__ = [
    "MAX_DEPTH",
    "PROTOCOL_VERSION",
    "SEQ_MODULUS",
    "SUBPROTOCOL",
    "Candidates",
    "CorrectionMode",
    "Error",
    "FederatedReply",
    "Fingerprint",
    "Hello",
    "Message",
    "MsgType",
    "Propose",
    "ProtocolError",
    "ReplyMode",
    "Resample",
    "Rollback",
    "SparseDist",
    "Verdict",
    "Welcome",
    "WireContext",
    "decode",
    "encode",
    "id_width",
    "message_equal",
    "peek_type",
]
