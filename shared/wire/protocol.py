"""Wire protocol v2: msgpack frames between the edge agent and a cloud verifier.

Every frame is one msgpack map whose key 0 holds the protocol version and the message type in one
byte (``version << 4 | type``); the other keys are small integers (one byte each on the wire).
Token ids and probabilities travel as little-endian binary fields, never as lists of numbers:

* ids are unsigned integers of ``id_width`` bytes (2 for |V| <= 65536, 3 for |V| <= 2**24, else 4),
  fixed for a session by the vocabulary size agreed in Hello/Welcome;
* probabilities are IEEE float32.

Hot frames (Propose, Verdict, FederatedReply, Rollback, Resample, Candidates, Generated, Hedge,
Logprobs) therefore need the session's :class:`WireContext` to decode; Hello, Welcome and Error are
self-describing.

Semantics: one stream is one session (:mod:`shared.wire.mux` carries many on one WebSocket).
``epoch`` counts rejections; a frame of an older epoch than the receiver's is stale. ``seq`` is the
batch sequence number modulo 128 (a 7-bit rolling counter: frames are ordered by TCP, so it is a
consistency check against replays and losses within the in-flight window, which is bounded by
``MAX_DEPTH`` < 128). ``pos`` is the absolute position of the first token a Propose carries (fixed
tokens first, then drafts).

The schema is written once, as one table per message (``_FRAMES``): for each field its key, the
name errors give, its kind (integer or float with its range, string with its length limit, bool,
enum, id/probability/sparse blob, nested map), whether it is required, and the dataclass attribute
it carries. :func:`encode` and :func:`decode` both run from these tables. What a table cannot say
(Verdict: one correction at most; FederatedReply: ids/probs split by the sizes ks; ...) is in the
message's small ``make`` function, which decoding calls last.

Decoding is strict: unknown keys are refused, every field is type- and range-checked, and any fault
raises :class:`ProtocolError` naming the field. Checks run in a fixed order (unknown keys, then each
field in wire order, then the cross-field checks), so a frame with several faults names the first.
Nothing here does I/O; there is no pickle and no eval.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, dataclass, field
from dataclasses import fields as dataclass_fields
from enum import Enum, IntEnum
from functools import cached_property
from operator import attrgetter
from typing import Any, Final

import msgpack
import numpy as np
import numpy.typing as npt

from shared.enums import TextEnum
from shared.errors import WanspecError
from shared.wire.params import MIN_TEMPERATURE, SamplingParams

PROTOCOL_VERSION: Final = 2
#: WebSocket subprotocol naming the protocol version.
SUBPROTOCOL: Final = "wanspec.v2"
#: Sequence numbers roll over modulo this; the in-flight depth must stay below it.
SEQ_MODULUS: Final = 128
MAX_DEPTH: Final = SEQ_MODULUS - 1

IdArray = npt.NDArray[np.int64]
ProbArray = npt.NDArray[np.float32]


class ProtocolError(WanspecError, ValueError):
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
    GENERATED = 10
    HEDGE = 11
    PROGRESS = 12
    LOGPROBS = 13


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
#: The most alternatives a session may ask for at each position (OpenAI's ``top_logprobs``).
MAX_TOP_LOGPROBS: Final = 20
#: The lowest log-probability on the wire: lower values (a token the model gives no mass,
#: −inf) are sent as this (OpenAI's convention for "not among the likely").
LOGPROB_FLOOR: Final = -9999.0


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
class Resume:
    """Hello.resume: pick up an earlier session of the same bearer token whose connection was
    lost. ``token``: that session's Welcome.resume; ``length``: how many tokens the edge has
    committed (the verifier keeps at most this much of that session's KV cache)."""

    token: str
    length: int


@dataclass(frozen=True)
class Resumed:
    """Welcome.resumed: the verifier kept the first ``length`` tokens of the resumed session's
    cache; ``digest`` is :func:`text_digest` of them, for the edge to check against its own
    committed text before it starts its next Propose at ``length``."""

    length: int
    digest: int


def text_digest(ids: Sequence[int]) -> int:
    """A 63-bit digest of a token sequence (BLAKE2b of the ids as little-endian int64; 63 bits
    so that every msgpack peer can carry it as a signed integer too)."""
    raw = np.asarray(ids, dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


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
    #: Co-generation: while no valid draft of this session is queued, the verifier samples the
    #: next tokens from p itself (Generated frames), up to this absolute position (the prompt
    #: plus the generation's room); 0 = never.
    cogen_end: int = 0
    #: Ask for :class:`Progress` frames while this session's model work waits or runs.
    progress: bool = False
    #: Resume a lost session's KV cache (left out: a new session).
    resume: Resume | None = None
    #: This edge can resume: keep the session's KV cache a while if its connection is lost
    #: (the Welcome then carries a resume token).
    resumable: bool = False
    #: Ask for the target's log-probability of every committed token (:class:`Logprobs`
    #: frames) with this many alternatives at each position; None: none (no bytes spent).
    logprobs: int | None = None


@dataclass(frozen=True)
class Welcome:
    """Verifier → edge: accepted. Limits the edge must respect for this session.

    ``resume``: a secret naming this session, for a later Hello.resume if the connection is
    lost (none: this verifier does not keep lost sessions). ``resumed``: what was kept of the
    session the Hello asked to resume (none: a new, empty session)."""

    fingerprint: Fingerprint
    session_id: str
    max_gamma: int
    max_fixed: int
    max_context: int
    max_frame: int
    resume: str | None = None
    resumed: Resumed | None = None


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
    acceptance when asked for. ``cached``: of the Propose's fixed tokens, how many the verifier
    took from its prefix cache instead of computing them (set only when some were).
    """

    epoch: int
    seq: int
    accepted: int
    sparse: SparseDist | None = None
    candidates: SparseDist | None = None
    token: int | None = None
    bonus: int | None = None
    cached: int | None = None


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
class Generated:
    """Verifier → edge (co-generation): ``token``, sampled by the verifier from p, is the
    committed token at position ``pos`` (= the edge's committed length when it arrives).
    In-flight draft tokens at ``pos`` that differ from it are rejected there at no model cost.
    ``cloud``: the token is a draft token of the verifier's own that it accepted (cloud-side
    speculation), not one it sampled."""

    epoch: int
    pos: int
    token: int
    cloud: bool = False


@dataclass(frozen=True)
class Logprobs:
    """Verifier → edge, for a session whose Hello asked: the target's log-probabilities
    log softmax(logits) (the model's own distribution: before temperature, top-k and top-p) at
    positions ``pos`` .. ``pos + P − 1``, sent before the frame that commits or offers their
    tokens (Verdict, Generated, Candidates).

    ``ids``/``lp``: one (token, log-probability) per position, except the last position, which
    has ``last`` of them: at a rejection the edge picks its correction among the candidates or
    the top-K it is sent, so it gets the log-probability of each. ``top_ids``/``top_lp``: the n
    likeliest tokens of each position (n = Hello.logprobs; P·n entries, position-major, most
    likely first). Values are float32 in [LOGPROB_FLOOR, 0]."""

    pos: int
    ids: IdArray  # [P − 1 + last]
    lp: npt.NDArray[np.float32]  # [P − 1 + last]
    last: int = 1
    top_ids: IdArray = field(default_factory=lambda: np.zeros(0, np.int64))  # [P·n]
    top_lp: npt.NDArray[np.float32] = field(default_factory=lambda: np.zeros(0, np.float32))

    @property
    def positions(self) -> int:
        return len(self.ids) - self.last + 1


@dataclass(frozen=True)
class Hedge:
    """Edge → verifier: a *side draft* for a likely rejection point. If the committed text turns
    out to hold ``token`` at ``pos`` (the draft's second choice where its confidence was
    lowest), ``draft`` (drafted greedily by the draft model after that token: a deterministic
    draft, whatever ``q`` says) is what the edge would draft next: the verifier, co-generating
    after the rejection, verifies it in one forward instead of decoding one token, with no round
    trip (as a point mass: a token is accepted with probability p(x)). It costs the verifier
    nothing until the text reaches ``pos``; it is matched against the text, never trusted."""

    pos: int
    token: int
    draft: IdArray  # [m]
    q: ProbArray  # [m]


@dataclass(frozen=True)
class Progress:
    """Verifier → edge (if Hello.progress): this session's model work is still on its way.

    Liveness (WebSocket ping/pong, answered by the event loop) says nothing about the model;
    this does. ``steps``: engine steps completed so far (modulo 2**32), the witness that the
    engine moves; ``ahead``: requests of other sessions queued before this one's (0 once it
    is in the running step); ``eta_ms``: the verifier's estimate, from its recent step times,
    of the milliseconds until the work is answered; ``running``: its step has started.
    Sent only while work has waited a while, and only when one of these changed."""

    steps: int
    ahead: int
    eta_ms: int
    running: bool = False


@dataclass(frozen=True)
class Error:
    """Either direction. ``fatal`` errors close the session. ``retry_after`` (seconds): a
    refusal of a verifier that is busy, not down (a new session may come back then)."""

    code: str
    message: str
    fatal: bool = False
    retry_after: float | None = None


Message = (
    Hello
    | Welcome
    | Propose
    | Verdict
    | FederatedReply
    | Rollback
    | Resample
    | Candidates
    | Generated
    | Hedge
    | Progress
    | Logprobs
    | Error
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

    @cached_property
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
# Kinds: how one wire value is checked, converted and written
# --------------------------------------------------------------------------------------------


def _bin(v: Any, name: str) -> bytes:
    if not isinstance(v, bytes):
        raise ProtocolError(name, f"expected binary, got {type(v).__name__}")
    return v


class _Kind:
    """The type of one wire value.

    ``read`` checks a decoded msgpack value and returns the attribute's value, or raises
    :class:`ProtocolError` naming ``name``; ``write`` is its inverse (a kind that does not override
    it puts the attribute's value on the wire as it is). ``empty`` tells the value an optional
    field leaves out. Kinds of hot frames use the session context: encode() and decode() guarantee
    them one.
    """

    def read(self, v: Any, name: str, ctx: WireContext | None) -> Any:
        raise NotImplementedError

    def write(self, v: Any, ctx: WireContext | None) -> Any:
        return v

    def empty(self, v: Any) -> bool:
        return v is None


class _Int(_Kind):
    """An integer in [lo, hi]; ``hi`` may be a function of the session (max_gamma, |V| − 1)."""

    def __init__(self, lo: int, hi: int | Callable[[WireContext], int]) -> None:
        self.lo = lo
        self.hi = hi if isinstance(hi, int) else 0
        self.hi_of: Callable[[WireContext], int] | None = None if isinstance(hi, int) else hi

    def read(self, v: Any, name: str, ctx: WireContext | None) -> int:
        # bool is an int subclass in Python; refuse it so True does not pass as 1.
        if not isinstance(v, int) or isinstance(v, bool):
            raise ProtocolError(name, f"expected an integer, got {type(v).__name__}")
        hi = self.hi
        if self.hi_of is not None:
            assert ctx is not None
            hi = self.hi_of(ctx)
        if not self.lo <= v <= hi:
            raise ProtocolError(name, f"{v} outside [{self.lo}, {hi}]")
        return v


class _Float(_Kind):
    """A finite number in [lo, hi]; an integer is accepted (as a float), a bool is not."""

    def __init__(self, lo: float, hi: float) -> None:
        self.lo, self.hi = lo, hi

    def read(self, v: Any, name: str, ctx: WireContext | None) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ProtocolError(name, f"expected a number, got {type(v).__name__}")
        f = float(v)
        if not math.isfinite(f) or not self.lo <= f <= self.hi:
            raise ProtocolError(name, f"{v} outside [{self.lo}, {self.hi}]")
        return f


class _Temperature(_Float):
    """A temperature: 0 (greedy) or in [MIN_TEMPERATURE, 100] (SamplingParams's own rule)."""

    def __init__(self) -> None:
        super().__init__(0.0, 100.0)

    def read(self, v: Any, name: str, ctx: WireContext | None) -> float:
        f = super().read(v, name, ctx)
        if 0.0 < f < MIN_TEMPERATURE:
            raise ProtocolError(name, f"{v} is neither 0 (greedy) nor >= {MIN_TEMPERATURE:g}")
        return f


class _Str(_Kind):
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len

    def read(self, v: Any, name: str, ctx: WireContext | None) -> str:
        if not isinstance(v, str):
            raise ProtocolError(name, f"expected a string, got {type(v).__name__}")
        if len(v) > self.max_len:
            raise ProtocolError(name, f"longer than {self.max_len} characters")
        return v


class _Bool(_Kind):
    def read(self, v: Any, name: str, ctx: WireContext | None) -> bool:
        if not isinstance(v, bool):
            raise ProtocolError(name, f"expected a boolean, got {type(v).__name__}")
        return v


class _Choice(_Str):
    """A member of a TextEnum, on the wire as its value."""

    def __init__(self, enum: type[TextEnum]) -> None:
        super().__init__(256)
        self.enum, self.choices = enum, enum.choices()

    def read(self, v: Any, name: str, ctx: WireContext | None) -> TextEnum:
        s = super().read(v, name, ctx)
        if s not in self.choices:
            raise ProtocolError(name, f"{s!r} is not one of {', '.join(self.choices)}")
        return self.enum(s)

    def write(self, v: Any, ctx: WireContext | None) -> str:
        return str(self.enum(v).value)


class _Flag(_Kind):
    """A bool carried as a bit of a small integer (the only bit defined; off: left out)."""

    def __init__(self, bit: int) -> None:
        self.bit, self.range = bit, _Int(0, bit)

    def read(self, v: Any, name: str, ctx: WireContext | None) -> bool:
        return bool(self.range.read(v, name, ctx) & self.bit)

    def write(self, v: Any, ctx: WireContext | None) -> int:
        return self.bit if v else 0

    def empty(self, v: Any) -> bool:
        return not v


class _Ids(_Kind):
    """Token ids below |V|, ``id_width`` bytes each; at most ``limit`` of them when set."""

    def __init__(self, limit: Callable[[WireContext], int] | None = None) -> None:
        self.limit = limit

    def read(self, v: Any, name: str, ctx: WireContext | None) -> IdArray:
        assert ctx is not None
        ids = unpack_ids(_bin(v, name), ctx.width, ctx.vocab_size, name)
        if self.limit is not None and len(ids) > self.limit(ctx):
            raise ProtocolError(name, f"{len(ids)} tokens exceed the limit {self.limit(ctx)}")
        return ids

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        assert ctx is not None
        return pack_ids(v, ctx.width)

    def empty(self, v: Any) -> bool:
        return len(v) == 0


class _Probs(_Kind):
    """float32 probabilities in (0, 1], or in [0, 1] with ``allow_zero``."""

    def __init__(self, *, allow_zero: bool = False) -> None:
        self.allow_zero = allow_zero

    def read(self, v: Any, name: str, ctx: WireContext | None) -> ProbArray:
        return unpack_probs(_bin(v, name), name, allow_zero=self.allow_zero)

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        return pack_probs(v)


class _Sparse(_Kind):
    """A :class:`SparseDist`: K ids, then K float32 probabilities (see :func:`_unpack_sparse`)."""

    def __init__(self, *, distributional: bool) -> None:
        self.distributional = distributional

    def read(self, v: Any, name: str, ctx: WireContext | None) -> SparseDist:
        assert ctx is not None
        return _unpack_sparse(_bin(v, name), ctx, name, distributional=self.distributional)

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        assert ctx is not None
        return pack_ids(v.ids, ctx.width) + pack_probs(v.probs)


class _Draft(_Kind):
    """Propose's (draft, q): γ ids, then γ float32 q values unless the session is greedy-draft
    (``draft_probs`` off: q is all ones and not sent). γ, the blob length over the bytes per
    token, is in [``min_gamma``, max_gamma]: a Propose may carry no draft (a credit of a
    cloud-only edge, or fixed tokens alone), a Hedge may not."""

    def __init__(self, min_gamma: int = 1) -> None:
        self.min_gamma = min_gamma

    def read(self, v: Any, name: str, ctx: WireContext | None) -> tuple[IdArray, ProbArray]:
        assert ctx is not None
        blob, w = _bin(v, name), ctx.width
        per = w + 4 if ctx.draft_probs else w
        if len(blob) % per:
            raise ProtocolError(name, f"length {len(blob)} is not a multiple of {per}")
        gamma = len(blob) // per
        if not self.min_gamma <= gamma <= ctx.max_gamma:
            raise ProtocolError(name, f"γ = {gamma} outside [{self.min_gamma}, {ctx.max_gamma}]")
        draft = unpack_ids(blob[: gamma * w], w, ctx.vocab_size, name + ".ids")
        if not ctx.draft_probs:
            return draft, np.ones(gamma, np.float32)
        return draft, unpack_probs(blob[gamma * w :], name + ".q")

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        assert ctx is not None
        draft, q = v
        blob = pack_ids(draft, ctx.width)
        return blob + pack_probs(q) if ctx.draft_probs else blob


class _Scored(_Kind):
    """(ids, log-probabilities): n token ids, then n float32 values, finite and in
    [LOGPROB_FLOOR, 0]; at most ``limit`` entries when set."""

    def __init__(self, limit: Callable[[WireContext], int] | None = None) -> None:
        self.limit = limit

    def read(
        self, v: Any, name: str, ctx: WireContext | None
    ) -> tuple[IdArray, npt.NDArray[np.float32]]:
        assert ctx is not None
        blob, w = _bin(v, name), ctx.width
        if len(blob) % (w + 4):
            raise ProtocolError(name, f"length {len(blob)} is not a multiple of {w + 4}")
        n = len(blob) // (w + 4)
        if self.limit is not None and n > self.limit(ctx):
            raise ProtocolError(name, f"{n} entries exceed the limit {self.limit(ctx)}")
        ids = unpack_ids(blob[: n * w], w, ctx.vocab_size, name + ".ids")
        lp = np.frombuffer(blob[n * w :], "<f4").astype(np.float32)
        if not np.all(np.isfinite(lp) & (lp >= LOGPROB_FLOOR) & (lp <= 0.0)):
            raise ProtocolError(
                name + ".lp", f"values must be finite and in [{LOGPROB_FLOOR:g}, 0]"
            )
        return ids, lp

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        assert ctx is not None
        ids, lp = v
        if len(ids) != len(lp):
            raise ValueError(f"{len(lp)} log-probabilities for {len(ids)} ids")
        return pack_ids(ids, ctx.width) + pack_probs(lp)

    def empty(self, v: Any) -> bool:
        return len(v[0]) == 0


class _TopKSizes(_Kind):
    """The sizes K_0..K_γ of FederatedReply's distributions: 2..max_gamma+1 uint32 values, each at
    most min(max_k, |V|)."""

    def read(self, v: Any, name: str, ctx: WireContext | None) -> IdArray:
        assert ctx is not None
        raw = _bin(v, name)
        if len(raw) % 4 or not 2 <= len(raw) // 4 <= ctx.max_gamma + 1:
            raise ProtocolError(name, f"needs 2..{ctx.max_gamma + 1} uint32 entries")
        ks = np.frombuffer(raw, "<u4").astype(np.int64)
        if np.any(ks > ctx.max_k) or np.any(ks > ctx.vocab_size):
            limit = min(ctx.max_k, ctx.vocab_size)
            raise ProtocolError(name, f"a top-k size exceeds the limit {limit}")
        return ks

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        return np.array(v, "<u4").tobytes()


class _Distances(_Kind):
    """float32 L1 distances between distributions, ‖p̂ − p‖₁: finite, in [0, 2] (the message checks
    how many)."""

    def read(self, v: Any, name: str, ctx: WireContext | None) -> npt.NDArray[np.float32]:
        buf = _bin(v, name)
        if len(buf) % 4:
            raise ProtocolError(name, f"length {len(buf)} is not a multiple of 4")
        d = np.frombuffer(buf, "<f4").astype(np.float32)
        if not np.all(np.isfinite(d) & (d >= 0) & (d <= 2.0 + 1e-4)):
            raise ProtocolError(name, "values must be finite and in [0, 2]")
        return d

    def write(self, v: Any, ctx: WireContext | None) -> bytes:
        return pack_probs(v)


class _Map(_Kind):
    """A nested map with a table of its own (Fingerprint, SamplingParams)."""

    def __init__(self, table: _Table) -> None:
        self.table = table

    def read(self, v: Any, name: str, ctx: WireContext | None) -> Any:
        if not isinstance(v, dict):
            raise ProtocolError(name, "expected a map")
        return self.table.read(v, ctx)

    def write(self, v: Any, ctx: WireContext | None) -> dict[Any, Any]:
        return self.table.write(v, ctx)


# --------------------------------------------------------------------------------------------
# Tables: the wire schema, written once; encode() and decode() both run from them
# --------------------------------------------------------------------------------------------


class _Presence(Enum):
    """Whether a field must be on the wire.

    * REQUIRED: always written; a frame without it is refused ("missing").
    * OPTIONAL: left out when its value is empty (None, no ids, a flag off); absent or nil, it reads
      back as the attribute's dataclass default, which is that empty value.
    * DEFAULTED: always written; absent, it reads as the attribute's dataclass default (nil is read,
      and refused).
    """

    REQUIRED = "required"
    OPTIONAL = "optional"
    DEFAULTED = "defaulted"


_REQUIRED: Final = _Presence.REQUIRED
_OPTIONAL: Final = _Presence.OPTIONAL
_DEFAULTED: Final = _Presence.DEFAULTED

#: What m.get() returns for a key that is not in the map (None is msgpack nil).
_ABSENT: Final = object()


@dataclass(frozen=True)
class _Field:
    """One map entry: its ``key``, the ``name`` errors give, its ``kind``, its presence, and the
    dataclass attribute it carries (``attr``, by default ``name``; a tuple when the kind reads and
    writes a tuple of attributes). ``get`` instead derives the wire value from the whole object,
    for a field that carries only part of an attribute (the table's ``make`` reassembles it)."""

    key: int | str
    name: str
    kind: _Kind
    attr: str | tuple[str, ...] = ""
    presence: _Presence = _REQUIRED
    get: Callable[[Any], Any] | None = None


class _Table:
    """The fields of one msgpack map in wire order, and the dataclass they make.

    Invariants, checked here (at import): keys are unique; the fields' attributes cover the
    dataclass's fields in order, so that ``cls(*values)`` makes it unless the table has a
    ``make`` (which must then also run the cross-field checks); a non-required field's attribute
    has a dataclass default, and an optional field's default is its kind's empty value. ``vt``, the
    header of a frame, goes first under key 0.
    """

    def __init__(
        self,
        cls: type[Any],
        scope: str,
        fields: list[_Field],
        *,
        vt: int | None = None,
        make: Callable[[list[Any]], Any] | None = None,
        prefix: str = "",
    ) -> None:
        self.cls, self.scope, self.vt, self.fields = cls, scope, vt, tuple(fields)
        keys = [f.key for f in fields] + ([] if vt is None else [K_VT])
        if len(set(keys)) != len(keys):
            raise TypeError(f"{scope}: duplicate keys")
        self.keys = frozenset(keys)
        attrs = [f.attr or f.name for f in fields]
        flat = [a for at in attrs for a in ((at,) if isinstance(at, str) else at)]
        members = {m.name: m for m in dataclass_fields(cls)}
        if list(dict.fromkeys(flat)) != list(members):
            raise TypeError(f"{scope}: the fields do not cover {cls.__name__}'s attributes")
        if make is None and (flat != list(members) or len(flat) != len(attrs)):
            raise TypeError(f"{scope}: this table needs a make() to build {cls.__name__}")
        self.make: Callable[[list[Any]], Any] = make or (lambda values: cls(*values))
        # Per field, so that a frame costs one pass and no lookups: for reading (key, name in
        # errors, reader, maker of the absent value or None when required, whether nil is absent);
        # for writing (key, getter, writer or None for as-is, emptiness test or None to always).
        readers, writers = [], []
        for f, at in zip(fields, attrs, strict=True):
            absent = None
            if f.presence is not _REQUIRED:
                if isinstance(at, str):
                    absent = _default_of(members[at])
                else:  # several attributes in one field: a tuple of their defaults
                    parts = [_default_of(members[a]) for a in at]

                    def absent(parts: list[Callable[[], Any]] = parts) -> tuple[Any, ...]:
                        return tuple(p() for p in parts)

                if f.presence is _OPTIONAL and not f.kind.empty(absent()):
                    raise TypeError(f"{scope}: {f.name}'s default is not its empty value")
            readers.append((f.key, prefix + f.name, f.kind.read, absent, f.presence is _OPTIONAL))
            get = f.get or (attrgetter(at) if isinstance(at, str) else attrgetter(*at))
            put = None if type(f.kind).write is _Kind.write else f.kind.write
            writers.append((f.key, get, put, f.kind.empty if f.presence is _OPTIONAL else None))
        self.readers = tuple(readers)
        self.writers = tuple(writers)

    def read(self, m: dict[Any, Any], ctx: WireContext | None) -> Any:
        """Check ``m`` (unknown keys first, then each field in wire order) and make the object."""
        if not m.keys() <= self.keys:
            extra = sorted(map(str, set(m) - self.keys))
            raise ProtocolError(self.scope, f"unknown field(s) {extra}")
        values = []
        for key, name, read, absent, nil_is_absent in self.readers:
            v = m.get(key, _ABSENT)
            if v is _ABSENT or (v is None and nil_is_absent):
                if absent is None:
                    raise ProtocolError(name, "missing")
                values.append(absent())
            else:
                values.append(read(v, name, ctx))
        return self.make(values)

    def write(self, obj: Any, ctx: WireContext | None) -> dict[Any, Any]:
        m: dict[Any, Any] = {} if self.vt is None else {K_VT: self.vt}
        for key, get, put, empty in self.writers:
            v = get(obj)
            if empty is None or not empty(v):
                m[key] = v if put is None else put(v, ctx)
        return m


class _Frame(_Table):
    """A message's table. Hot frames (all but Hello, Welcome and Error) need a WireContext."""

    def __init__(
        self,
        msg_type: MsgType,
        cls: type[Any],
        fields: list[_Field],
        make: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        vt = (PROTOCOL_VERSION << 4) | int(msg_type)
        super().__init__(cls, msg_type.name.lower(), fields, vt=vt, make=make)
        self.msg_type = msg_type
        self.hot = msg_type not in (MsgType.HELLO, MsgType.WELCOME, MsgType.ERROR)


def _default_of(f: Field[Any]) -> Callable[[], Any]:
    if f.default_factory is not MISSING:
        return f.default_factory
    if f.default is MISSING:
        raise TypeError(f"{f.name} has no default, so it must be required")
    value = f.default
    return lambda: value


def _make_propose(v: list[Any]) -> Propose:
    epoch, seq, pos, (draft, q), fixed, want_bonus = v
    return Propose(epoch, seq, pos, draft, q, fixed, want_bonus)


def _make_hedge(v: list[Any]) -> Hedge:
    pos, token, (draft, q) = v
    return Hedge(pos, token, draft, q)


def _make_verdict(v: list[Any]) -> Verdict:
    """At most one correction, and no bonus token with one."""
    sparse, candidates, token, bonus = v[3:7]
    n_corr = (sparse is not None) + (candidates is not None) + (token is not None)
    if n_corr > 1:
        raise ProtocolError("verdict", "more than one correction")
    if bonus is not None and n_corr:
        raise ProtocolError("bonus", "a bonus token with a correction")
    return Verdict(*v)


# FederatedReply.dists travels as three fields: the sizes, all ids, all probabilities.
def _ks_of(r: FederatedReply) -> list[int]:
    return [len(d.ids) for d in r.dists]


def _ids_of(r: FederatedReply) -> IdArray:
    return np.concatenate([d.ids for d in r.dists])


def _probs_of(r: FederatedReply) -> ProbArray:
    return np.concatenate([d.probs for d in r.dists])


def _make_federated_reply(v: list[Any]) -> FederatedReply:
    """Split ids/probs into the γ+1 distributions of sizes ks (each: distinct ids, mass <= 1);
    γ p_draft scalars; l1, when sent, of shape [γ+1, 2]."""
    epoch, seq, ks, ids, probs, p_draft, l1 = v
    total = int(ks.sum())
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
    if len(p_draft) != len(ks) - 1:
        raise ProtocolError("p_draft", f"expected {len(ks) - 1} scalars, got {len(p_draft)}")
    if l1 is not None:
        if len(l1) != 2 * len(ks):
            raise ProtocolError("l1", f"expected {2 * len(ks)} float32 values")
        l1 = l1.reshape(len(ks), 2)
    return FederatedReply(epoch, seq, tuple(dists), p_draft, l1)


def _scored_limit(ctx: WireContext) -> int:
    return ctx.max_gamma + max(ctx.max_k, 4096)


def _make_logprobs(v: list[Any]) -> Logprobs:
    """At least one position, and the same number n <= MAX_TOP_LOGPROBS of alternatives at
    each."""
    pos, (ids, lp), last, (top_ids, top_lp) = v
    positions = len(ids) - last + 1
    if positions < 1:
        raise ProtocolError("last", f"{last} ids at the last position of {len(ids)}")
    if len(top_ids) % positions or len(top_ids) // positions > MAX_TOP_LOGPROBS:
        raise ProtocolError(
            "top", f"{len(top_ids)} entries are not up to {MAX_TOP_LOGPROBS} per position"
        )
    return Logprobs(pos, ids, lp, last, top_ids, top_lp)


def _make_candidates(v: list[Any]) -> Candidates:
    if len(v[2].ids) == 0:
        raise ProtocolError("candidates", "empty")
    return Candidates(*v)


_U32: Final = _Int(0, _U32_MAX)
_SEQ: Final = _Int(0, SEQ_MODULUS - 1)
_TOKEN: Final = _Int(0, lambda ctx: ctx.vocab_size - 1)
_FP: Final = _Map(
    _Table(
        Fingerprint,
        "fp",
        [
            _Field("tok", "tok", _Str(128), "tokenizer_hash"),
            _Field("vocab", "vocab", _Int(1, _U32_MAX), "vocab_size"),
            _Field("name", "name", _Str(256), "model_name"),
        ],
        prefix="fp.",
    )
)
# Within SamplingParams's own ranges, so that making it cannot fail.
_SAMPLING: Final = _Map(
    _Table(
        SamplingParams,
        "sampling",
        [
            _Field("temperature", "temperature", _Temperature(), presence=_DEFAULTED),
            _Field("top_k", "top_k", _Int(0, 1 << 24), presence=_DEFAULTED),
            _Field("top_p", "top_p", _Float(1e-9, 1.0), presence=_DEFAULTED),
        ],
        prefix="sampling.",
    )
)

_RESUME: Final = _Map(
    _Table(
        Resume,
        "resume",
        [
            _Field("token", "token", _Str(64)),
            _Field("len", "len", _Int(0, _U32_MAX), "length"),
        ],
        prefix="resume.",
    )
)
_RESUMED: Final = _Map(
    _Table(
        Resumed,
        "resumed",
        [
            _Field("len", "len", _Int(0, _U32_MAX), "length"),
            _Field("digest", "digest", _Int(0, 2**63 - 1)),
        ],
        prefix="resumed.",
    )
)

_FRAMES: Final = (
    _Frame(
        MsgType.HELLO,
        Hello,
        [
            _Field("fp", "fp", _FP, "fingerprint"),
            _Field("sampling", "sampling", _SAMPLING),
            _Field("reply", "reply", _Choice(ReplyMode), "reply_mode"),
            _Field("correction", "correction", _Choice(CorrectionMode)),
            _Field("k", "k", _Int(1, 1 << 24)),
            _Field("eps", "eps", _Float(0.0, 1.0), "eps_target"),
            _Field("m", "m", _Int(1, 4096)),
            _Field("bonus", "bonus", _Bool()),
            _Field("seed", "seed", _Int(0, 2**63 - 1), presence=_OPTIONAL),
            _Field("cogen", "cogen", _Int(0, _U32_MAX), "cogen_end", presence=_DEFAULTED),
            _Field("progress", "progress", _Flag(1), presence=_OPTIONAL),
            _Field("resume", "resume", _RESUME, presence=_OPTIONAL),
            _Field("resumable", "resumable", _Flag(1), presence=_OPTIONAL),
            _Field("logprobs", "logprobs", _Int(0, MAX_TOP_LOGPROBS), presence=_OPTIONAL),
        ],
    ),
    _Frame(
        MsgType.WELCOME,
        Welcome,
        [
            _Field("fp", "fp", _FP, "fingerprint"),
            _Field("session", "session", _Str(64), "session_id"),
            _Field("max_gamma", "max_gamma", _Int(1, 4096)),
            _Field("max_fixed", "max_fixed", _Int(1, _U32_MAX)),
            _Field("max_context", "max_context", _Int(1, _U32_MAX)),
            _Field("max_frame", "max_frame", _Int(64, 1 << 30)),
            _Field("resume", "resume", _Str(64), presence=_OPTIONAL),
            _Field("resumed", "resumed", _RESUMED, presence=_OPTIONAL),
        ],
    ),
    _Frame(
        MsgType.ERROR,
        Error,
        [
            _Field("code", "code", _Str(64)),
            _Field("msg", "msg", _Str(4096), "message"),
            _Field("fatal", "fatal", _Bool()),
            _Field("retry", "retry", _Float(0.0, 3600.0), "retry_after", presence=_OPTIONAL),
        ],
    ),
    _Frame(
        MsgType.PROPOSE,
        Propose,
        [
            _Field(K_EPOCH, "epoch", _U32),
            _Field(K_SEQ, "seq", _SEQ),
            _Field(K_POS, "pos", _U32),
            _Field(K_A, "draft", _Draft(min_gamma=0), ("draft", "q")),
            _Field(K_B, "fixed", _Ids(limit=attrgetter("max_fixed")), presence=_OPTIONAL),
            _Field(K_C, "flags", _Flag(_FLAG_BONUS), "want_bonus", presence=_OPTIONAL),
        ],
        _make_propose,
    ),
    _Frame(
        MsgType.VERDICT,
        Verdict,
        [
            _Field(K_EPOCH, "epoch", _U32),
            _Field(K_SEQ, "seq", _SEQ),
            _Field(K_POS, "accepted", _Int(0, attrgetter("max_gamma"))),
            _Field(K_A, "sparse", _Sparse(distributional=True), presence=_OPTIONAL),
            _Field(K_B, "candidates", _Sparse(distributional=False), presence=_OPTIONAL),
            _Field(K_C, "token", _TOKEN, presence=_OPTIONAL),
            _Field(K_D, "bonus", _TOKEN, presence=_OPTIONAL),
            _Field(K_E, "cached", _U32, presence=_OPTIONAL),
        ],
        _make_verdict,
    ),
    _Frame(
        MsgType.FEDERATED_REPLY,
        FederatedReply,
        [
            _Field(K_EPOCH, "epoch", _U32),
            _Field(K_SEQ, "seq", _SEQ),
            _Field(K_A, "ks", _TopKSizes(), "dists", get=_ks_of),
            _Field(K_B, "ids", _Ids(), "dists", get=_ids_of),
            _Field(K_C, "probs", _Probs(), "dists", get=_probs_of),
            _Field(K_D, "p_draft", _Probs(allow_zero=True)),
            _Field(K_E, "l1", _Distances(), presence=_OPTIONAL),
        ],
        _make_federated_reply,
    ),
    _Frame(
        MsgType.ROLLBACK, Rollback, [_Field(K_EPOCH, "epoch", _U32), _Field(K_POS, "pos", _U32)]
    ),
    _Frame(
        MsgType.RESAMPLE, Resample, [_Field(K_EPOCH, "epoch", _U32), _Field(K_POS, "pos", _U32)]
    ),
    _Frame(
        MsgType.CANDIDATES,
        Candidates,
        [
            _Field(K_EPOCH, "epoch", _U32),
            _Field(K_POS, "pos", _U32),
            _Field(K_B, "candidates", _Sparse(distributional=False)),
        ],
        _make_candidates,
    ),
    _Frame(
        MsgType.GENERATED,
        Generated,
        [
            _Field(K_EPOCH, "epoch", _U32),
            _Field(K_POS, "pos", _U32),
            _Field(K_C, "token", _TOKEN),
            _Field(K_D, "cloud", _Flag(1), presence=_OPTIONAL),
        ],
    ),
    _Frame(
        MsgType.HEDGE,
        Hedge,
        [
            _Field(K_POS, "pos", _U32),
            _Field(K_C, "token", _TOKEN),
            _Field(K_A, "draft", _Draft(), ("draft", "q")),
        ],
        _make_hedge,
    ),
    _Frame(
        MsgType.LOGPROBS,
        Logprobs,
        [
            _Field(K_POS, "pos", _U32),
            # the accepted tokens (<= max_gamma) and a rejection's candidates (m <= 4096) or
            # top-K (k <= max_k)
            _Field(K_A, "scored", _Scored(_scored_limit), ("ids", "lp")),
            _Field(K_C, "last", _Int(1, 1 << 24), presence=_DEFAULTED),
            _Field(K_D, "top", _Scored(), ("top_ids", "top_lp"), presence=_OPTIONAL),
        ],
        _make_logprobs,
    ),
    _Frame(
        MsgType.PROGRESS,
        Progress,
        [
            _Field(K_A, "steps", _U32),
            _Field(K_B, "ahead", _U32),
            _Field(K_D, "eta_ms", _U32),
            _Field(K_C, "running", _Flag(1), presence=_OPTIONAL),
        ],
    ),
)
if sorted(t.msg_type for t in _FRAMES) != list(MsgType):
    raise TypeError("every message type needs exactly one table")
_BY_CLASS: Final = {t.cls: t for t in _FRAMES}
#: Keyed by the header byte (version << 4 | type): one dict lookup validates and dispatches it.
_BY_HEADER: Final = {t.vt: t for t in _FRAMES}
_HEADER: Final = _Int(0, 255)


# --------------------------------------------------------------------------------------------
# Encoding and decoding
# --------------------------------------------------------------------------------------------


def encode(msg: Message, ctx: WireContext | None = None) -> bytes:
    """Encode ``msg``. Hot frames need the session's ``ctx`` for their binary fields."""
    frame = _BY_CLASS.get(type(msg))
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


def _frame_of(m: dict[Any, Any]) -> _Frame:
    """The table of the frame ``m`` by its header; ProtocolError if missing, malformed or
    unknown."""
    vt = m.get(K_VT)
    if type(vt) is int and vt in _BY_HEADER:
        return _BY_HEADER[vt]
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


__all__ = [
    "LOGPROB_FLOOR",
    "MAX_DEPTH",
    "MAX_TOP_LOGPROBS",
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
