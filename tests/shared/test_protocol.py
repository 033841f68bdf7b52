"""Wire protocol v1: byte budgets, round trips, and refusal of every malformed frame family."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.maths.compression import SparseDist
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams
from shared.wire.codec import decode, encode, message_equal, peek_type
from shared.wire.fields import Flag, Float, Int, Map, Presence, Str, Table
from shared.wire.messages import (
    PROTOCOL_VERSION,
    Candidates,
    Error,
    FederatedReply,
    Fingerprint,
    Generated,
    Hedge,
    Hello,
    Logprobs,
    MsgType,
    Progress,
    Propose,
    ReplyMode,
    Resample,
    Resume,
    Resumed,
    Rollback,
    Verdict,
    Welcome,
    text_digest,
)
from shared.wire.packing import HANDSHAKE_MAX_FRAME, ProtocolError, WireContext, id_width
from shared.wire.schema import FRAMES

pytestmark = pytest.mark.fast

SMOL = WireContext(vocab_size=49152)  # SmolLM2's vocabulary
# Realistic mid-generation values: a thousand rejections in, position 4000.
EPOCH, SEQ, POS = 1000, 100, 4000


def _sparse(k: int, vocab: int = 49152) -> SparseDist:
    ids = (np.arange(k, dtype=np.int64) * 4099) % vocab
    probs = np.linspace(0.3, 0.01, k).astype(np.float32)
    probs = (probs / probs.sum() * 0.95).astype(np.float32)
    return SparseDist(ids, probs)


def _propose(gamma: int = 4, fixed: int = 0) -> Propose:
    return Propose(
        epoch=EPOCH,
        seq=SEQ,
        pos=POS,
        draft=np.array([49151, 17, 300, 12345, 7, 9][:gamma] * (gamma // 6 + 1), np.int64)[:gamma],
        q=np.linspace(0.9, 0.2, gamma).astype(np.float32),
        fixed=np.arange(fixed, dtype=np.int64),
    )


# ----------------------------------------------------------------------------------- budgets


def test_budget_propose_gamma4() -> None:
    assert len(encode(_propose(4), SMOL)) <= 40


@pytest.mark.parametrize("vocab", [49152, 151936])
def test_budget_propose_greedy_grows_by_at_most_4_bytes_a_token(vocab: int) -> None:
    """Greedy sampling: q travels in four bits (it only ranks draft slots for rationing), so a
    round stays within PicoSpec's ~50 B as γ grows: <= 60 B at γ <= 12, <= 4 B a token more."""
    ctx = WireContext(vocab_size=vocab, coarse_q=True)
    sizes = [len(encode(_propose(g), ctx)) for g in range(1, 13)]
    assert max(sizes) <= 60
    assert all(b - a <= 4 for a, b in itertools.pairwise(sizes))
    p = _propose(6)
    got = decode(encode(p, ctx), ctx)
    assert isinstance(got, Propose) and got.draft.tolist() == p.draft.tolist()
    assert np.allclose(got.q, p.q, atol=1 / 30)  # to four bits


def test_budget_verdict_sparse_k10() -> None:
    v = Verdict(EPOCH, SEQ, accepted=2, sparse=_sparse(10))
    assert len(encode(v, SMOL)) <= 80


def test_budget_verdict_full_acceptance() -> None:
    assert len(encode(Verdict(EPOCH, SEQ, accepted=4), SMOL)) <= 16
    # with a bonus token too
    assert len(encode(Verdict(EPOCH, SEQ, accepted=4, bonus=40000), SMOL)) <= 16


def test_budget_generated_token() -> None:
    """A co-generated token costs about what a Verdict with a bonus does."""
    assert len(encode(Generated(EPOCH, POS, 40000), SMOL)) <= 16


def test_budget_hedge() -> None:
    """A hedge of a token and 3 continuation tokens, ids only (greedy): about a Propose's size."""
    ctx = WireContext(vocab_size=49152, draft_probs=False)
    h = Hedge(POS, 40000, np.array([1, 2, 3]), np.ones(3, np.float32))
    assert len(encode(h, ctx)) <= 20


def test_hedge_needs_a_draft_token() -> None:
    ctx = WireContext(vocab_size=49152, draft_probs=False)
    data = encode(Hedge(POS, 7, np.array([1]), np.ones(1, np.float32)), ctx)
    raw = msgpack.unpackb(data, strict_map_key=False)
    raw[4] = b""
    with pytest.raises(ProtocolError, match="draft"):
        decode(msgpack.packb(raw), ctx)


def test_a_propose_may_carry_no_draft() -> None:
    """γ = 0: a cloud-only edge's credit (or fixed tokens alone); small, and it round-trips."""
    ctx = WireContext(vocab_size=49152, draft_probs=False)
    credit = Propose(EPOCH, SEQ, POS, np.zeros(0, np.int64), np.zeros(0, np.float32))
    data = encode(credit, ctx)
    assert len(data) <= 16
    back = decode(data, ctx)
    assert isinstance(back, Propose) and len(back.draft) == 0 and len(back.q) == 0


def test_budget_greedy_draft_propose_sends_no_q() -> None:
    ctx = WireContext(vocab_size=49152, draft_probs=False)
    assert len(encode(_propose(4), ctx)) <= 24


def test_id_width() -> None:
    assert id_width(64) == 2
    assert id_width(65536) == 2
    assert id_width(65537) == 3
    assert id_width(262144) == 3
    assert id_width(1 << 24 + 1) == 4


# ------------------------------------------------------------------------------- round trips


def _fp() -> Fingerprint:
    return Fingerprint("ab" * 32, 49152, "SmolLM2-135M-Instruct")


ALL_MESSAGES = [
    Hello(_fp()),
    Hello(
        _fp(),
        SamplingParams(0.7, 40, 0.9),
        ReplyMode.FEDERATED,
        CorrectionMode.CANDIDATES,
        k=32,
        eps_target=0.05,
        m=16,
        bonus=True,
        seed=123,
        progress=True,
        resume=Resume("0123456789abcdef0123456789abcdef", 17),
        resumable=True,
        logprobs=5,
    ),
    Welcome(_fp(), "s-1", max_gamma=16, max_fixed=8192, max_context=8192, max_frame=1 << 20),
    Welcome(
        _fp(),
        "s-2",
        max_gamma=16,
        max_fixed=8192,
        max_context=8192,
        max_frame=1 << 20,
        resume="0123456789abcdef0123456789abcdef",
        resumed=Resumed(17, text_digest(range(17))),
    ),
    Error("bad_frame", "draft.ids: token id 70000 >= vocabulary size 49152", fatal=False),
    Error("kv_full", "the KV cache is full", fatal=True, retry_after=1.5),
    _propose(4),
    _propose(6, fixed=3),
    Propose(0, 0, 0, np.array([1], np.int64), np.array([1.0], np.float32), want_bonus=True),
    Verdict(EPOCH, SEQ, 4),
    Verdict(EPOCH, SEQ, 4, bonus=5),
    Verdict(EPOCH, SEQ, 1, sparse=_sparse(10)),
    Verdict(EPOCH, SEQ, 0, candidates=SparseDist(np.array([3, 3, 9]), np.full(3, 0.2, np.float32))),
    Verdict(EPOCH, SEQ, 2, token=49151),
    Verdict(EPOCH, SEQ, 3, bonus=5, cached=4096),
    FederatedReply(
        EPOCH,
        SEQ,
        (_sparse(10), _sparse(3), _sparse(1)),
        np.array([0.5, 0.0], np.float32),
        np.array([[0.1, 0.05], [0.2, 0.1], [0.0, 0.0]], np.float32),
    ),
    FederatedReply(EPOCH, SEQ, (_sparse(5), _sparse(5)), np.array([0.25], np.float32)),
    Rollback(EPOCH + 1, POS + 2),
    Resample(EPOCH, POS),
    Candidates(EPOCH, POS, SparseDist(np.array([1, 2]), np.array([0.5, 0.25], np.float32))),
    Generated(EPOCH, POS, 49151),
    Generated(EPOCH, POS, 7, cloud=True),
    Hedge(POS, 49151, np.array([1, 2, 3]), np.array([1.0, 0.5, 0.25], np.float32)),
    Progress(steps=2**32 - 1, ahead=3, eta_ms=1500, running=True),
    Progress(steps=0, ahead=0, eta_ms=0),
    Logprobs(POS, np.array([49151]), np.array([-0.25], np.float32)),
    Logprobs(
        POS,
        np.array([5, 9, 3, 4]),  # two positions, three scored ids at the last
        np.array([-0.1, -2.0, -0.7, -9999.0], np.float32),
        last=3,
        top_ids=np.array([5, 6, 3, 9]),
        top_lp=np.array([-0.1, -2.5, -0.7, -1.0], np.float32),
    ),
    Verdict(EPOCH, SEQ, 2, bonus=5, budget=3),  # a cut, with the budget it follows from
]


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    data = encode(msg, SMOL)  # type: ignore[arg-type]
    back = decode(data, SMOL)
    assert message_equal(back, msg), (back, msg)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    vocab=st.sampled_from([8, 64, 49152, 65536, 65537, 151936, 262144]),
    gamma=st.integers(1, 16),
    nfixed=st.integers(0, 20),
    epoch=st.integers(0, 2**32 - 1),
    seq=st.integers(0, 127),
    pos=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_propose_round_trip_property(
    vocab: int, gamma: int, nfixed: int, epoch: int, seq: int, pos: int, data: st.DataObject
) -> None:
    ctx = WireContext(vocab_size=vocab)
    ids = st.lists(st.integers(0, vocab - 1), min_size=gamma, max_size=gamma)
    probs = st.lists(
        st.floats(2.0**-20, 1.0, width=32, allow_subnormal=False), min_size=gamma, max_size=gamma
    )
    msg = Propose(
        epoch,
        seq,
        pos,
        np.array(data.draw(ids), np.int64),
        np.array(data.draw(probs), np.float32),
        np.array(data.draw(st.lists(st.integers(0, vocab - 1), max_size=nfixed)), np.int64),
    )
    assert message_equal(decode(encode(msg, ctx), ctx), msg)


@settings(max_examples=100, deadline=None)
@given(k=st.integers(1, 64), accepted=st.integers(0, 15), seed=st.integers(0, 2**31))
def test_verdict_round_trip_property(k: int, accepted: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.choice(49152, size=k, replace=False).astype(np.int64)
    probs = rng.dirichlet(np.ones(k + 1))[:k].astype(np.float32)
    probs = np.maximum(probs, np.float32(1e-9))
    msg = Verdict(EPOCH, SEQ, accepted, sparse=SparseDist(ids, probs))
    assert message_equal(decode(encode(msg, SMOL), SMOL), msg)


# -------------------------------------------------------------------------- strict decoding


def _raw(m: dict[object, object]) -> bytes:
    return msgpack.packb(m, use_bin_type=True)  # type: ignore[no-any-return]


def _good_propose_map() -> dict[object, object]:
    return dict(msgpack.unpackb(encode(_propose(4), SMOL), strict_map_key=False))


def _mutate(**changes: object) -> bytes:
    m = _good_propose_map()
    for k, v in changes.items():
        key = int(k[1:])
        if v is _DROP:
            m.pop(key)
        else:
            m[key] = v
    return _raw(m)


_DROP = object()
U16 = np.dtype("<u2")


def _draft_blob(ids: list[int], q: list[float]) -> bytes:
    return np.array(ids, U16).tobytes() + np.array(q, "<f4").tobytes()


MALFORMED: list[tuple[str, bytes, str]] = [
    ("empty", b"", "frame"),
    ("not msgpack", b"\xc1\xc1\xc1", "frame"),
    ("truncated", encode(_propose(4), SMOL)[:-3], "frame"),
    ("trailing bytes", encode(_propose(4), SMOL) + b"\x00", "frame"),
    ("not a map", _raw([1, 2, 3]), "frame"),  # type: ignore[arg-type]
    ("oversized", b"\x00" * (SMOL.max_frame + 1), "frame"),
    ("no header", _raw({1: 2}), "version/type"),
    ("unknown version", _mutate(k0=(7 << 4) | 3), "version"),
    ("unknown type", _mutate(k0=(PROTOCOL_VERSION << 4) | 15), "type"),
    ("earlier version", _mutate(k0=(1 << 4) | 3), "version"),
    ("header not int", _mutate(k0="propose"), "version/type"),
    ("bool as int", _mutate(k1=True), "epoch"),
    ("negative epoch", _mutate(k1=-1), "epoch"),
    ("epoch too large", _mutate(k1=2**40), "epoch"),
    ("seq out of range", _mutate(k2=128), "seq"),
    ("pos is a float", _mutate(k3=1.5), "pos"),
    ("missing draft", _mutate(k4=_DROP), "draft"),
    ("draft is a list", _mutate(k4=[1, 2, 3]), "draft"),
    ("draft ragged", _mutate(k4=b"\x01\x02\x03"), "draft"),
    ("gamma too large", _mutate(k4=_draft_blob([1] * 65, [0.5] * 65)), "draft"),
    ("id >= vocab", _mutate(k4=_draft_blob([1, 2, 3, 49152], [0.5] * 4)), "draft.ids"),
    ("q NaN", _mutate(k4=_draft_blob([1, 2, 3, 4], [0.5, float("nan"), 0.5, 0.5])), "draft.q"),
    ("q zero", _mutate(k4=_draft_blob([1, 2, 3, 4], [0.5, 0.0, 0.5, 0.5])), "draft.q"),
    ("q negative", _mutate(k4=_draft_blob([1, 2, 3, 4], [0.5, -0.1, 0.5, 0.5])), "draft.q"),
    ("q > 1", _mutate(k4=_draft_blob([1, 2, 3, 4], [0.5, 1.5, 0.5, 0.5])), "draft.q"),
    ("q inf", _mutate(k4=_draft_blob([1, 2, 3, 4], [0.5, float("inf"), 0.5, 0.5])), "draft.q"),
    ("fixed id >= vocab", _mutate(k5=np.array([60000], U16).tobytes()), "fixed"),
    ("fixed ragged", _mutate(k5=b"\x01"), "fixed"),
    ("unknown field", _mutate(k9=1), "propose"),
    ("bad flags", _mutate(k6=8), "flags"),
]


@pytest.mark.parametrize("name,data,field", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_propose_refused(name: str, data: bytes, field: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(data, SMOL)
    assert e.value.field.startswith(field), (e.value.field, str(e.value))
    assert field in str(e.value)


def _verdict_map(**changes: object) -> bytes:
    m = dict(
        msgpack.unpackb(
            encode(Verdict(EPOCH, SEQ, 1, sparse=_sparse(4)), SMOL), strict_map_key=False
        )
    )
    for k, v in changes.items():
        m[int(k[1:])] = v
    return _raw(m)


def _sparse_blob(ids: list[int], probs: list[float]) -> bytes:
    return np.array(ids, U16).tobytes() + np.array(probs, "<f4").tobytes()


MALFORMED_VERDICT: list[tuple[str, bytes, str]] = [
    ("accepted > max gamma", _verdict_map(k3=65), "accepted"),
    ("sparse duplicate ids", _verdict_map(k4=_sparse_blob([1, 1], [0.2, 0.2])), "sparse"),
    ("sparse mass > 1", _verdict_map(k4=_sparse_blob([1, 2], [0.7, 0.7])), "sparse"),
    ("sparse zero prob", _verdict_map(k4=_sparse_blob([1, 2], [0.7, 0.0])), "sparse.probs"),
    ("two corrections", _verdict_map(k6=5), "verdict"),
    ("token >= vocab", _raw({0: (PROTOCOL_VERSION << 4) | 4, 1: 0, 2: 0, 3: 0, 6: 49152}), "token"),
    ("bonus with correction", _verdict_map(k7=5), "bonus"),
]


@pytest.mark.parametrize(
    "name,data,field", MALFORMED_VERDICT, ids=[m[0] for m in MALFORMED_VERDICT]
)
def test_malformed_verdict_refused(name: str, data: bytes, field: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode(data, SMOL)
    assert e.value.field.startswith(field), (e.value.field, str(e.value))


def test_federated_reply_inconsistent_lengths_refused() -> None:
    good = FederatedReply(EPOCH, SEQ, (_sparse(3), _sparse(3)), np.array([0.5], np.float32))
    m = dict(msgpack.unpackb(encode(good, SMOL), strict_map_key=False))
    m[5] = m[5][:-2]  # one id short
    with pytest.raises(ProtocolError, match="ids"):
        decode(_raw(m), SMOL)
    m = dict(msgpack.unpackb(encode(good, SMOL), strict_map_key=False))
    m[7] = np.array([0.5, 0.5], "<f4").tobytes()  # two scalars for γ = 1
    with pytest.raises(ProtocolError, match="p_draft"):
        decode(_raw(m), SMOL)


def test_federated_reply_l1_refused() -> None:
    """l1: [γ+1, 2] float32 distances, each finite and in [0, 2]."""
    good = FederatedReply(EPOCH, SEQ, (_sparse(3), _sparse(3)), np.array([0.5], np.float32))
    for l1 in ([0.1, 0.2, 0.3], [0.1, float("nan"), 0.3, 0.4], [0.1, 2.5, 0.3, 0.4], [-0.1] * 4):
        m = dict(msgpack.unpackb(encode(good, SMOL), strict_map_key=False))
        m[8] = np.array(l1, "<f4").tobytes()
        with pytest.raises(ProtocolError) as e:
            decode(_raw(m), SMOL)
        assert e.value.field == "l1", (l1, e.value)
    m[8] = b"\x00" * 17  # ragged
    with pytest.raises(ProtocolError, match="l1"):
        decode(_raw(m), SMOL)


def test_cross_field_checks_refused() -> None:
    """What the tables cannot say, each message's make() checks."""
    fed = FederatedReply(EPOCH, SEQ, (_sparse(2), _sparse(2)), np.array([0.5], np.float32))
    m = dict(msgpack.unpackb(encode(fed, SMOL), strict_map_key=False))
    m[5] = np.array([1, 2, 7, 7], U16).tobytes()  # dists[1] repeats an id
    with pytest.raises(ProtocolError) as e:
        decode(_raw(m), SMOL)
    assert (e.value.field, e.value.message) == ("dists[1]", "duplicate token ids")
    m = dict(msgpack.unpackb(encode(fed, SMOL), strict_map_key=False))
    m[6] = np.array([0.5, 0.5, 0.9, 0.9], "<f4").tobytes()  # dists[1] has mass 1.8
    with pytest.raises(ProtocolError) as e:
        decode(_raw(m), SMOL)
    assert e.value.field == "dists[1]"
    with pytest.raises(ProtocolError) as e:
        decode(_raw({0: (PROTOCOL_VERSION << 4) | 9, 1: EPOCH, 3: POS, 5: b""}), SMOL)
    assert (e.value.field, e.value.message) == ("candidates", "empty")


def test_hot_frames_refused_before_handshake() -> None:
    with pytest.raises(ProtocolError, match="before the session"):
        decode(encode(_propose(4), SMOL))


def test_handshake_frames_bounded() -> None:
    big = _raw({0: (PROTOCOL_VERSION << 4) | 1, "fp": {"tok": "x" * HANDSHAKE_MAX_FRAME}})
    with pytest.raises(ProtocolError, match="frame"):
        decode(big)


def test_hello_validation() -> None:
    ok = dict(msgpack.unpackb(encode(Hello(_fp())), strict_map_key=False))
    assert peek_type(encode(Hello(_fp()))) == MsgType.HELLO
    for key, value, field in [
        ("correction", "magic", "correction"),
        ("reply", 3, "reply"),
        ("k", 0, "k"),
        ("eps", float("nan"), "eps"),
        ("bonus", 1, "bonus"),
        ("sampling", {"temperature": -1.0}, "sampling.temperature"),
        ("sampling", {"top_p": 0.0}, "sampling.top_p"),
        ("sampling", {"nucleus": 0.5}, "sampling"),
        ("fp", {"tok": "a", "vocab": 0, "name": "x"}, "fp.vocab"),
        ("extra", 1, "hello"),
    ]:
        m = dict(ok)
        m[key] = value
        with pytest.raises(ProtocolError) as e:
            decode(_raw(m))
        assert e.value.field == field, (key, e.value)


def test_fingerprint_compatibility() -> None:
    a = _fp()
    assert a.compatible_with(Fingerprint(a.tokenizer_hash, 49152, "other-target")) is None
    assert "tokenizers differ" in (a.compatible_with(Fingerprint("cd" * 32, 49152, "x")) or "")
    assert "vocabulary size" in (a.compatible_with(Fingerprint(a.tokenizer_hash, 32000, "x")) or "")


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(data: bytes) -> None:
    """Any byte string decodes or raises ProtocolError; nothing else escapes."""
    for ctx in (None, SMOL):
        with contextlib.suppress(ProtocolError):
            decode(data, ctx)


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_mutated_frames_never_crash(data: st.DataObject) -> None:
    """Structured mutations of valid frames: flip, cut and splice bytes."""
    base = data.draw(st.sampled_from([encode(m, SMOL) for m in ALL_MESSAGES]))  # type: ignore[arg-type]
    b = bytearray(base)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        i = data.draw(st.integers(0, max(0, len(b) - 1)))
        if op == "flip" and b:
            b[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del b[i : i + data.draw(st.integers(1, 8))]
        else:
            b[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    with contextlib.suppress(ProtocolError):
        decode(bytes(b), SMOL)


# ------------------------------------------------------------------------- the schema tables
# White-box: walk the one table per message that both encode() and decode() run from, so that
# every field of every message is round-tripped and refused in each way it can be malformed.


def _walk(table: Table, prefix: str = "", path: tuple[object, ...] = ()) -> list[tuple]:
    """(path of keys, name in errors, field, attribute path) of every field, nested ones too."""
    out = []
    for f in table.fields:
        attr = f.attr or f.name
        out.append(((*path, f.key), prefix + f.name, f, attr))
        if isinstance(f.kind, Map):
            for p, n, g, a in _walk(f.kind.table, f"{prefix}{f.name}.", (*path, f.key)):
                out.append((p, n, g, f"{attr}.{a}"))
    return out


SCHEMA = [(t, *row) for t in FRAMES for row in _walk(t)]
SCHEMA_IDS = [f"{t.scope}:{name}" for t, _, name, _, _ in SCHEMA]


def _wire(msg: object) -> dict[object, object]:
    return dict(msgpack.unpackb(encode(msg, SMOL), strict_map_key=False))  # type: ignore[arg-type]


def _base(table: Table, path: tuple[object, ...]) -> dict[object, object]:
    """The wire map of the first test message of ``table`` that carries the field at ``path``."""
    for msg in ALL_MESSAGES:
        if type(msg) is table.cls:
            m = _wire(msg)
            if path[0] in m:
                return m
    raise AssertionError(f"no {table.scope} message carries {path}")


def _set(m: dict[object, object], path: tuple[object, ...], value: object) -> bytes:
    inner = m
    for k in path[:-1]:
        inner = inner[k]  # type: ignore[assignment]
    if value is _DROP:
        inner.pop(path[-1], None)
    else:
        inner[path[-1]] = value
    return _raw(m)


def _refused(data: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as e:
        decode(data, SMOL)
    return e.value


def test_every_message_type_has_one_table() -> None:
    assert sorted(t.msg_type for t in FRAMES) == list(MsgType)


@pytest.mark.parametrize("table", FRAMES, ids=[t.scope for t in FRAMES])
def test_every_table_round_trips_every_field(table: Table) -> None:
    """Each message type round-trips, and every field (optional ones too) is on the wire in one of
    the round-tripped messages."""
    msgs = [m for m in ALL_MESSAGES if type(m) is table.cls]
    assert msgs
    seen: set[object] = set()
    for msg in msgs:
        seen |= set(_wire(msg))
        assert message_equal(decode(encode(msg, SMOL), SMOL), msg)  # type: ignore[arg-type]
    assert seen == table.keys


@pytest.mark.parametrize("table,path,name,field,attr", SCHEMA, ids=SCHEMA_IDS)
def test_every_field_refuses_a_wrong_type(
    table: Table, path: tuple[object, ...], name: str, field: object, attr: str
) -> None:
    # No kind accepts a list (ids and probabilities travel as binary, never as lists).
    e = _refused(_set(_base(table, path), path, [1]))
    assert e.field == name, e


@pytest.mark.parametrize("table,path,name,field,attr", SCHEMA, ids=SCHEMA_IDS)
def test_every_field_absent_or_nil(
    table: Table, path: tuple[object, ...], name: str, field: object, attr: str
) -> None:
    presence = field.presence  # type: ignore[attr-defined]
    if presence is Presence.REQUIRED:
        e = _refused(_set(_base(table, path), path, _DROP))
        assert (e.field, e.message) == (name, "missing")
    else:
        # Absent, the attribute reads back as the dataclass default.
        got = decode(_set(_base(table, path), path, _DROP), SMOL)
        # (a field carrying several attributes: each reads back as its default)
        for one in (attr,) if isinstance(attr, str) else attr:
            owner, _, leaf = one.rpartition(".")
            obj = getattr(got, owner) if owner else got
            default = {f.name: f for f in dataclasses.fields(obj)}[leaf]
            want = default.default if default.default is not dataclasses.MISSING else None
            if want is None and default.default_factory is not dataclasses.MISSING:
                assert len(getattr(obj, leaf)) == len(default.default_factory())
            else:
                assert getattr(obj, leaf) == want
    if presence is Presence.OPTIONAL:  # nil is absent
        nil = decode(_set(_base(table, path), path, None), SMOL)
        assert message_equal(nil, decode(_set(_base(table, path), path, _DROP), SMOL))
    else:
        e = _refused(_set(_base(table, path), path, None))
        assert e.field == name, e


def _maps() -> list[tuple[Table, tuple[object, ...], str]]:
    out = [(t, (), t.scope) for t in FRAMES]
    out += [(t, path, name) for t, path, name, f, _ in SCHEMA if isinstance(f.kind, Map)]
    return out


@pytest.mark.parametrize("table,path,scope", _maps(), ids=[s for _, _, s in _maps()])
def test_every_map_refuses_unknown_keys(table: Table, path: tuple[object, ...], scope: str) -> None:
    for key in (99, "zz", -1):
        e = _refused(_set(_base(table, path or (0,)), (*path, key), 1))
        assert e.field == scope and "unknown field" in e.message, e


@pytest.mark.parametrize("table,path,name,field,attr", SCHEMA, ids=SCHEMA_IDS)
def test_every_scalar_field_checks_its_range(
    table: Table, path: tuple[object, ...], name: str, field: object, attr: str
) -> None:
    kind = field.kind  # type: ignore[attr-defined]
    if isinstance(kind, Int):  # (a Flag is an Int in [0, bit])
        hi = kind.hi if kind.hi_of is None else kind.hi_of(SMOL)
        bad: list[object] = [kind.lo - 1, hi + 1, True, 1.5]
    elif isinstance(kind, Flag):
        bad = [kind.bit + 1, -1, True]
    elif isinstance(kind, Float):
        bad = [kind.lo - 1.0, kind.hi + 1.0, float("nan"), float("inf"), True]
    elif isinstance(kind, Str):  # (a _Choice is a Str too)
        bad = ["x" * (kind.max_len + 1), b"x"]
    elif isinstance(kind, Map):
        bad = ["x"]
    else:  # binary blobs: a ragged length or the wrong type
        bad = [b"\x01", "x", 5]
    for value in bad:
        e = _refused(_set(_base(table, path), path, value))
        assert e.field.startswith(name), (value, e)


# ------------------------------------------------------------------------------- logprobs


def _scored(positions: int, top: int) -> Logprobs:
    return Logprobs(
        POS,
        np.arange(positions),
        np.full(positions, -1.0, np.float32),
        top_ids=np.arange(top),
        top_lp=np.full(top, -1.0, np.float32),
    )


def test_logprobs_frame_is_small_and_checked() -> None:
    """γ + 1 = 5 positions with their log-probabilities, no alternatives: about 5 bytes each;
    a frame whose counts do not add up, or a value outside [LOGPROB_FLOOR, 0], is refused."""
    ctx = WireContext(vocab_size=49152)
    msg = Logprobs(POS, np.arange(5), np.full(5, -0.5, np.float32))
    assert len(encode(msg, ctx)) <= 50
    for bad, field in [
        (Logprobs(POS, np.arange(2), np.full(2, -0.5, np.float32), last=3), "last"),
        (Logprobs(POS, np.arange(2), np.array([-0.5, 0.5], np.float32)), "scored.lp"),
        (Logprobs(POS, np.arange(2), np.array([-0.5, np.nan], np.float32)), "scored.lp"),
        (_scored(1, top=21), "top"),
        (_scored(2, top=3), "top"),
    ]:
        with pytest.raises(ProtocolError) as e:
            decode(encode(bad, ctx), ctx)
        assert e.value.field == field, e.value
    with pytest.raises(ProtocolError, match="logprobs"):
        decode(encode(Hello(_fp(), logprobs=21)))
    with pytest.raises(ValueError, match="3 log-probabilities for 2 ids"):
        encode(Logprobs(POS, np.arange(2), np.full(3, -0.5, np.float32)), ctx)
