"""The frames of wire protocol v2, edge ↔ verifier: one dataclass per message, and the constants
both ends share.

Semantics: one stream is one session (:mod:`shared.wire.mux` carries many on one WebSocket).
``epoch`` counts rejections; a frame of an older epoch than the receiver's is stale. ``seq`` is the
batch sequence number modulo 128 (a 7-bit rolling counter: frames are ordered by TCP, so it is a
consistency check against replays and losses within the in-flight window, which is bounded by
``MAX_DEPTH`` < 128). ``pos`` is the absolute position of the first token a Propose carries (fixed
tokens first, then drafts).

How each frame travels is :mod:`shared.wire.schema` (one table per message) and
:mod:`shared.wire.codec` (encode/decode); the values the maths defines (:class:`SparseDist`,
:class:`SamplingParams`, :class:`CorrectionMode`) are carried as they are.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Final

import numpy as np
import numpy.typing as npt

from shared.enums import TextEnum
from shared.maths.compression import IdArray, ProbArray, SparseDist
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams

PROTOCOL_VERSION: Final = 2
#: WebSocket subprotocol naming the protocol version.
SUBPROTOCOL: Final = "wanspec.v2"
#: Sequence numbers roll over modulo this; the in-flight depth must stay below it.
SEQ_MODULUS: Final = 128
MAX_DEPTH: Final = SEQ_MODULUS - 1


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


class ReplyMode(TextEnum):
    """``verdict``: the verifier decides (PicoSpec); ``federated``: it sends distributions."""

    VERDICT = "verdict"
    FEDERATED = "federated"


#: The most alternatives a session may ask for at each position (OpenAI's ``top_logprobs``).
MAX_TOP_LOGPROBS: Final = 20
#: The lowest log-probability on the wire: lower values (a token the model gives no mass,
#: −inf) are sent as this (OpenAI's convention for "not among the likely").
LOGPROB_FLOOR: Final = -9999.0


@dataclass(frozen=True)
class Fingerprint:
    """What must match between a draft and a target: the tokenizer (hash and vocabulary size).

    ``model_name`` is informative: heterogeneous targets of one tokenizer are allowed.
    """

    tokenizer_hash: str
    vocab_size: int
    model_name: str

    def compatible_with(self, other: Fingerprint) -> str | None:
        """None when compatible, else a reason a user can act on. ``self`` is the draft's
        fingerprint, ``other`` the target's (every caller's order: the reason names them so)."""
        fix = (
            f"set the edge's draft to a model that shares {other.model_name}'s tokenizer, or "
            f"serve a target of {self.model_name}'s family (docs/model-pairs.md)"
        )
        if self.vocab_size != other.vocab_size:
            return (
                f"vocabulary size differs: draft {self.model_name} has {self.vocab_size}, "
                f"target {other.model_name} has {other.vocab_size}; {fix}"
            )
        if self.tokenizer_hash != other.tokenizer_hash:
            return (
                f"tokenizers differ: draft {self.model_name} ({self.tokenizer_hash[:12]}) vs "
                f"target {other.model_name} ({other.tokenizer_hash[:12]}); draft and target "
                f"must share one: {fix}"
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


#: Verdict.budget's largest value, which means "no bound": the verifier verifies whatever the
#: edge's own controller drafts.
MAX_BUDGET: Final = 255


@dataclass(frozen=True)
class Verdict:
    """Verifier → edge, the answer to one Propose (``epoch``/``seq`` are the batch's).

    ``accepted`` draft tokens were accepted. When accepted < γ, exactly one correction is set:
    ``sparse`` (top-K of p at the rejected position), ``candidates`` (exact mode (a)) or ``token``
    (the recovered token itself: greedy target, or greedy-draft mode). ``bonus`` is set on full
    acceptance when asked for. ``cached``: of the Propose's fixed tokens, how many the verifier
    took from its prefix cache instead of computing them (set only when some were).

    Rationing: ``accepted`` < γ with a ``bonus`` and no correction is a *cut*: under load the
    verifier verified only the first ``accepted`` draft tokens (all accepted) and drew the bonus
    token from p after them; the rest of the draft is void and a new epoch begins, as after a
    rejection. ``budget``: from now on, the most draft tokens a batch of the edge's should hold
    (:data:`MAX_BUDGET`: no bound); sent when it changes.
    """

    epoch: int
    seq: int
    accepted: int
    sparse: SparseDist | None = None
    candidates: SparseDist | None = None
    token: int | None = None
    bonus: int | None = None
    cached: int | None = None
    budget: int | None = None


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
