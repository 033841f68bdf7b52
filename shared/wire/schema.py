"""The wire schema of protocol v2, written once: one table per message.

Every frame is one msgpack map whose key 0 holds the protocol version and the message type in one
byte (``version << 4 | type``); the other keys are small integers (one byte each on the wire). For
each field the table gives its key, the name errors give, its kind (:mod:`shared.wire.fields`),
whether it is required, and the dataclass attribute it carries. :func:`shared.wire.codec.encode`
and :func:`shared.wire.codec.decode` both run from these tables. What a table cannot say (Verdict:
one correction at most; FederatedReply: ids/probs split by the sizes ks; ...) is in the message's
small ``make`` function, which decoding calls last.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Final

import numpy as np

from shared.maths.compression import IdArray, ProbArray, SparseDist
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams
from shared.wire import messages
from shared.wire.fields import (
    Bool,
    Choice,
    Distances,
    Draft,
    Field,
    Flag,
    Float,
    Frame,
    Ids,
    Int,
    Map,
    Presence,
    Probs,
    Scored,
    Sparse,
    Str,
    Table,
    Temperature,
    TopKSizes,
)
from shared.wire.packing import ProtocolError, WireContext

# Integer keys of the hot frames (the header's, K_VT = 0, is the tables' own). Names are used in
# error messages.
K_EPOCH: Final = 1
K_SEQ: Final = 2
K_POS: Final = 3
K_A: Final = 4
K_B: Final = 5
K_C: Final = 6
K_D: Final = 7
K_E: Final = 8
K_F: Final = 9

_U32_MAX: Final = 2**32 - 1
_FLAG_BONUS: Final = 1


def _make_propose(v: list[Any]) -> messages.Propose:
    epoch, seq, pos, (draft, q), fixed, want_bonus = v
    return messages.Propose(epoch, seq, pos, draft, q, fixed, want_bonus)


def _make_hedge(v: list[Any]) -> messages.Hedge:
    pos, token, (draft, q) = v
    return messages.Hedge(pos, token, draft, q)


def _make_verdict(v: list[Any]) -> messages.Verdict:
    """At most one correction, and no bonus token with one."""
    sparse, candidates, token, bonus = v[3:7]
    n_corr = (sparse is not None) + (candidates is not None) + (token is not None)
    if n_corr > 1:
        raise ProtocolError("verdict", "more than one correction")
    if bonus is not None and n_corr:
        raise ProtocolError("bonus", "a bonus token with a correction")
    return messages.Verdict(*v)


# FederatedReply.dists travels as three fields: the sizes, all ids, all probabilities.
def _ks_of(r: messages.FederatedReply) -> list[int]:
    return [len(d.ids) for d in r.dists]


def _ids_of(r: messages.FederatedReply) -> IdArray:
    return np.concatenate([d.ids for d in r.dists])


def _probs_of(r: messages.FederatedReply) -> ProbArray:
    return np.concatenate([d.probs for d in r.dists])


def _make_federated_reply(v: list[Any]) -> messages.FederatedReply:
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
    return messages.FederatedReply(epoch, seq, tuple(dists), p_draft, l1)


def _scored_limit(ctx: WireContext) -> int:
    return ctx.max_gamma + max(ctx.max_k, 4096)


def _make_logprobs(v: list[Any]) -> messages.Logprobs:
    """At least one position, and the same number n <= MAX_TOP_LOGPROBS of alternatives at
    each."""
    pos, (ids, lp), last, (top_ids, top_lp) = v
    positions = len(ids) - last + 1
    if positions < 1:
        raise ProtocolError("last", f"{last} ids at the last position of {len(ids)}")
    if len(top_ids) % positions or len(top_ids) // positions > messages.MAX_TOP_LOGPROBS:
        raise ProtocolError(
            "top", f"{len(top_ids)} entries are not up to {messages.MAX_TOP_LOGPROBS} per position"
        )
    return messages.Logprobs(pos, ids, lp, last, top_ids, top_lp)


def _make_candidates(v: list[Any]) -> messages.Candidates:
    if len(v[2].ids) == 0:
        raise ProtocolError("candidates", "empty")
    return messages.Candidates(*v)


_U32: Final = Int(0, _U32_MAX)
_SEQ: Final = Int(0, messages.SEQ_MODULUS - 1)
_TOKEN: Final = Int(0, lambda ctx: ctx.vocab_size - 1)
# The session fields of the hot frames, declared once: every frame that carries an epoch, a
# sequence number or a position carries it under the same key, name and kind.
_EPOCH_FIELD: Final = Field(K_EPOCH, "epoch", _U32)
_SEQ_FIELD: Final = Field(K_SEQ, "seq", _SEQ)
_POS_FIELD: Final = Field(K_POS, "pos", _U32)
_FP: Final = Map(
    Table(
        messages.Fingerprint,
        "fp",
        [
            Field("tok", "tok", Str(128), "tokenizer_hash"),
            Field("vocab", "vocab", Int(1, _U32_MAX), "vocab_size"),
            Field("name", "name", Str(256), "model_name"),
        ],
        prefix="fp.",
    )
)
# Within SamplingParams's own ranges, so that making it cannot fail.
_SAMPLING: Final = Map(
    Table(
        SamplingParams,
        "sampling",
        [
            Field("temperature", "temperature", Temperature(), presence=Presence.DEFAULTED),
            Field("top_k", "top_k", Int(0, 1 << 24), presence=Presence.DEFAULTED),
            Field("top_p", "top_p", Float(1e-9, 1.0), presence=Presence.DEFAULTED),
        ],
        prefix="sampling.",
    )
)

_RESUME: Final = Map(
    Table(
        messages.Resume,
        "resume",
        [
            Field("token", "token", Str(64)),
            Field("len", "len", Int(0, _U32_MAX), "length"),
        ],
        prefix="resume.",
    )
)
_RESUMED: Final = Map(
    Table(
        messages.Resumed,
        "resumed",
        [
            Field("len", "len", Int(0, _U32_MAX), "length"),
            Field("digest", "digest", Int(0, 2**63 - 1)),
        ],
        prefix="resumed.",
    )
)

FRAMES: Final = (
    Frame(
        messages.MsgType.HELLO,
        messages.Hello,
        [
            Field("fp", "fp", _FP, "fingerprint"),
            Field("sampling", "sampling", _SAMPLING),
            Field("reply", "reply", Choice(messages.ReplyMode), "reply_mode"),
            Field("correction", "correction", Choice(CorrectionMode)),
            Field("k", "k", Int(1, 1 << 24)),
            Field("eps", "eps", Float(0.0, 1.0), "eps_target"),
            Field("m", "m", Int(1, 4096)),
            Field("bonus", "bonus", Bool()),
            Field("seed", "seed", Int(0, 2**63 - 1), presence=Presence.OPTIONAL),
            Field("cogen", "cogen", Int(0, _U32_MAX), "cogen_end", presence=Presence.DEFAULTED),
            Field("progress", "progress", Flag(1), presence=Presence.OPTIONAL),
            Field("resume", "resume", _RESUME, presence=Presence.OPTIONAL),
            Field("resumable", "resumable", Flag(1), presence=Presence.OPTIONAL),
            Field(
                "logprobs",
                "logprobs",
                Int(0, messages.MAX_TOP_LOGPROBS),
                presence=Presence.OPTIONAL,
            ),
        ],
    ),
    Frame(
        messages.MsgType.WELCOME,
        messages.Welcome,
        [
            Field("fp", "fp", _FP, "fingerprint"),
            Field("session", "session", Str(64), "session_id"),
            Field("max_gamma", "max_gamma", Int(1, 4096)),
            Field("max_fixed", "max_fixed", Int(1, _U32_MAX)),
            Field("max_context", "max_context", Int(1, _U32_MAX)),
            Field("max_frame", "max_frame", Int(64, 1 << 30)),
            Field("resume", "resume", Str(64), presence=Presence.OPTIONAL),
            Field("resumed", "resumed", _RESUMED, presence=Presence.OPTIONAL),
        ],
    ),
    Frame(
        messages.MsgType.ERROR,
        messages.Error,
        [
            Field("code", "code", Str(64)),
            Field("msg", "msg", Str(4096), "message"),
            Field("fatal", "fatal", Bool()),
            Field("retry", "retry", Float(0.0, 3600.0), "retry_after", presence=Presence.OPTIONAL),
        ],
    ),
    Frame(
        messages.MsgType.PROPOSE,
        messages.Propose,
        [
            _EPOCH_FIELD,
            _SEQ_FIELD,
            _POS_FIELD,
            Field(K_A, "draft", Draft(min_gamma=0), ("draft", "q")),
            Field(K_B, "fixed", Ids(limit=attrgetter("max_fixed")), presence=Presence.OPTIONAL),
            Field(K_C, "flags", Flag(_FLAG_BONUS), "want_bonus", presence=Presence.OPTIONAL),
        ],
        _make_propose,
    ),
    Frame(
        messages.MsgType.VERDICT,
        messages.Verdict,
        [
            _EPOCH_FIELD,
            _SEQ_FIELD,
            Field(K_POS, "accepted", Int(0, attrgetter("max_gamma"))),
            Field(K_A, "sparse", Sparse(distributional=True), presence=Presence.OPTIONAL),
            Field(K_B, "candidates", Sparse(distributional=False), presence=Presence.OPTIONAL),
            Field(K_C, "token", _TOKEN, presence=Presence.OPTIONAL),
            Field(K_D, "bonus", _TOKEN, presence=Presence.OPTIONAL),
            Field(K_E, "cached", _U32, presence=Presence.OPTIONAL),
            Field(
                K_F,
                "budget",
                Int(1, messages.MAX_BUDGET),
                presence=Presence.OPTIONAL,
            ),
        ],
        _make_verdict,
    ),
    Frame(
        messages.MsgType.FEDERATED_REPLY,
        messages.FederatedReply,
        [
            _EPOCH_FIELD,
            _SEQ_FIELD,
            Field(K_A, "ks", TopKSizes(), "dists", get=_ks_of),
            Field(K_B, "ids", Ids(), "dists", get=_ids_of),
            Field(K_C, "probs", Probs(), "dists", get=_probs_of),
            Field(K_D, "p_draft", Probs(allow_zero=True)),
            Field(K_E, "l1", Distances(), presence=Presence.OPTIONAL),
        ],
        _make_federated_reply,
    ),
    Frame(
        messages.MsgType.ROLLBACK,
        messages.Rollback,
        [_EPOCH_FIELD, _POS_FIELD],
    ),
    Frame(
        messages.MsgType.RESAMPLE,
        messages.Resample,
        [_EPOCH_FIELD, _POS_FIELD],
    ),
    Frame(
        messages.MsgType.CANDIDATES,
        messages.Candidates,
        [
            _EPOCH_FIELD,
            _POS_FIELD,
            Field(K_B, "candidates", Sparse(distributional=False)),
        ],
        _make_candidates,
    ),
    Frame(
        messages.MsgType.GENERATED,
        messages.Generated,
        [
            _EPOCH_FIELD,
            _POS_FIELD,
            Field(K_C, "token", _TOKEN),
            Field(K_D, "cloud", Flag(1), presence=Presence.OPTIONAL),
        ],
    ),
    Frame(
        messages.MsgType.HEDGE,
        messages.Hedge,
        [
            _POS_FIELD,
            Field(K_C, "token", _TOKEN),
            Field(K_A, "draft", Draft(), ("draft", "q")),
        ],
        _make_hedge,
    ),
    Frame(
        messages.MsgType.LOGPROBS,
        messages.Logprobs,
        [
            _POS_FIELD,
            # the accepted tokens (<= max_gamma) and a rejection's candidates (m <= 4096) or
            # top-K (k <= max_k)
            Field(K_A, "scored", Scored(_scored_limit), ("ids", "lp")),
            Field(K_C, "last", Int(1, 1 << 24), presence=Presence.DEFAULTED),
            Field(K_D, "top", Scored(), ("top_ids", "top_lp"), presence=Presence.OPTIONAL),
        ],
        _make_logprobs,
    ),
    Frame(
        messages.MsgType.PROGRESS,
        messages.Progress,
        [
            Field(K_A, "steps", _U32),
            Field(K_B, "ahead", _U32),
            Field(K_D, "eta_ms", _U32),
            Field(K_C, "running", Flag(1), presence=Presence.OPTIONAL),
        ],
    ),
)
if sorted(t.msg_type for t in FRAMES) != list(messages.MsgType):
    raise TypeError("every message type needs exactly one table")
BY_CLASS: Final = {t.cls: t for t in FRAMES}
#: Keyed by the header byte (version << 4 | type): one dict lookup validates and dispatches it.
BY_HEADER: Final = {t.vt: t for t in FRAMES}
