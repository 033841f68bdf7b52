"""Hostile input against both ends: the verifier's sessions, the edge's link, the HTTP endpoints.

    python -m testkit.fuzz --frames 10000 --out bench/out/fuzz.json

**Verifier.** A real ``cloud-verifier serve`` process (tiny target, CPU) gets ``--frames``
hostile frames over real WebSocket sessions from several concurrent clients: structured
mutations of valid frames (every field: wrong types, out-of-range and boundary integers, missing
and unknown keys, version/type nibbles; ids ≥ |V|; NaN, ±inf, negative, zero and > 1
probabilities; truncated, bit-flipped, padded, empty, text and oversized frames) and semantically
hostile ones that decode fine (wrong and stale epochs, replayed and skipped sequence numbers,
positions off by one or past the context, fixed tokens that overflow it, Rollback/Resample abuse,
repeated Hello, messages of the wrong direction, edge Error frames, floods of back-to-back
frames), mixed with valid Proposes that carry each session forward so the hostile frames reach
every state (after rejections, with a correction pending, in federated mode, near the context
limit). A client-side model of the session rules (:class:`Shadow`) predicts every reply — a
Verdict, one Error with its code, nothing, or the close — and every prediction is checked
(``mismatches``): a bad frame must get exactly its error and leave the session as it was.
Meanwhile an honest session replays the same seeded rounds again and again; each replay's
verdicts must equal a reference run made before the fuzzing started, and no round may take more
than a few seconds. The verifier's RSS is sampled throughout.

**Edge.** A real :class:`~edge_agent.runtime.agent.EdgeAgent` generates (T = 0) through a hostile
proxy that sits in front of the same verifier and replaces, corrupts or injects downlink frames
(Verdict, Candidates, FederatedReply, Welcome, Error, replays, oversized and text frames, closes).
The agent must end each bad session with an error it handles (and reconnect), never crash or
hang; its committed ids must stay a prefix of target-only greedy decoding; and when a
generation stops on a clear error (say a Welcome with a foreign fingerprint), the same
generation continued over an honest link must finish with exactly the target's greedy text.
A frame that decodes into a *plausible* verdict (the right batch, a different count) is a lie no
client can detect; such generations are counted apart and only checked for no crash / no hang.

**HTTP.** Malformed and oversized requests to /health, /metrics and /v1/session must get 4xx.

Mutations draw from a ``random.Random``; ``tests/system/test_fuzz.py`` drives the same mutators from
hypothesis (``st.randoms()``) and replays the committed corpus in ``tests/system/fuzz_corpus/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import random
import struct
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import numpy as np
from aiohttp import WSMessage, WSMsgType, web

from cloud_verifier.engine import work
from cloud_verifier.session.core import VerifierCore
from cloud_verifier.session.events import Close, Run, Send
from cloud_verifier.session.limits import SessionLimits, TargetInfo
from edge_agent.link.connection import TokenRefused
from edge_agent.runtime.agent import EdgeAgent, HandshakeError, RetryPolicy
from edge_agent.session.generation import Generation
from edge_agent.session.opening import VerifierError, wire_context
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.transport import LinkClosed
from shared.maths.compression import SparseDist
from shared.maths.rejection import CorrectionMode, Decision
from shared.maths.sampling import SamplingParams
from shared.runtime.models import LoadedModel
from shared.wire.codec import decode, encode, message_equal
from shared.wire.messages import (
    PROTOCOL_VERSION,
    SEQ_MODULUS,
    SUBPROTOCOL,
    Candidates,
    Error,
    FederatedReply,
    Fingerprint,
    Hedge,
    Hello,
    Message,
    MsgType,
    Propose,
    ReplyMode,
    Resample,
    Rollback,
    Verdict,
    Welcome,
)
from shared.wire.mux import MuxError, encode_control, split
from shared.wire.mux import frame as mux_frame
from shared.wire.packing import ProtocolError, WireContext
from testkit.harness import (
    VOCAB,
    VerifierProcess,
    config_parser,
    free_port,
    make_agent,
    random_prompt,
    rss_kib,
    run_command,
    target_greedy,
    tiny_pair,
    write_tokens,
)
from testkit.net.stream_ws import StreamWS
from testkit.probe import Driver, ProbeClient, auth_headers, replies_match

log = logging.getLogger("testkit.fuzz")

ClientWS = StreamWS

TOKEN = "fuzz-token"
HONEST_TOKEN = "honest-token"


@dataclass(frozen=True)
class FuzzConfig:
    frames: int = 10_000  # hostile frames at the verifier
    edge_frames: int = 2_000  # hostile downlink frames at the edge
    clients: int = 4  # concurrent hostile clients
    max_session_frames: int = 48  # hostile frames per session before it hangs up itself
    honest_rounds: int = 24
    edge_tokens: int = 48
    edge_p: float = 0.12  # probability that a downlink frame is hostile
    http_requests: int = 200
    max_frame: int = 65536  # the verifier's --max-frame (oversized frames are cheap)
    max_k: int = 64  # the verifier's --max-k
    max_bad_frames: int = 16
    max_resamples: int = 4
    reply_timeout_s: float = 10.0  # a predicted reply that does not come is a hang
    seed: int = 0


@dataclass
class FuzzReport:
    config: dict[str, Any]
    verifier_frames: int = 0  # hostile frames sent to the verifier
    verifier_valid_frames: int = 0  # valid frames that carried sessions forward
    sessions: int = 0
    replies: dict[str, int] = field(default_factory=dict)
    mutations: dict[str, int] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    mismatch_count: int = 0
    hangs: list[str] = field(default_factory=list)
    honest_replays: int = 0
    honest_rounds: int = 0
    honest_wrong: int = 0
    honest_max_round_s: float = 0.0
    edge_frames: int = 0
    edge_actions: dict[str, int] = field(default_factory=dict)
    edge_generations: int = 0
    edge_completed: int = 0
    edge_clear_errors: dict[str, int] = field(default_factory=dict)
    edge_lied_to: int = 0
    edge_text_checked: int = 0
    edge_garbage: list[str] = field(default_factory=list)
    edge_crashes: list[str] = field(default_factory=list)
    edge_resumed_ok: int = 0
    http_requests: int = 0
    http_status: dict[str, int] = field(default_factory=dict)
    http_bad: list[str] = field(default_factory=list)
    verifier_alive: bool = True
    rss_kib: dict[str, int] = field(default_factory=dict)
    edge_rss_kib: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def ok(self) -> bool:
        return (
            self.mismatch_count == 0
            and not self.hangs
            and self.honest_wrong == 0
            and not self.edge_garbage
            and not self.edge_crashes
            and not self.http_bad
            and self.verifier_alive
        )


def _words(text: str) -> list[str]:
    return text.split()


def _count(d: dict[str, int], key: str, n: int = 1) -> None:
    d[key] = d.get(key, 0) + n


_MAP_MUTATIONS = _words(
    "drop_key unknown_key junk_value int_edge vt bin_ids bin_probs bin_len nest"
)

_VERIFIER_ACTIONS = _words(
    "bytes map map epoch seq pos context ids probs gamma rollback resample direction "
    "hello_again edge_error text oversize flood stale_flood"
)

_EDGE_ACTIONS = _words(
    "bytes map semantic wrong_type error replay duplicate inject text close oversize welcome"
)

_EDGE_ERROR_CODES = _words(
    "x bad_seq model_error internal fingerprint_mismatch unauthorized bad_hello unsupported"
)

_VERDICT_MUTATIONS = _words(
    "seq epoch accepted_over strip_correction token_vocab bonus_and_token sparse_nan "
    "sparse_dup wrong_kind lie"
)


# ============================================================================ mutations (pure)

# fmt: off
_JUNK_VALUES: tuple[Any, ...] = (
    None, True, False, -1, 0, 1, 127, 128, 255, 256, 2**16, 2**31, 2**32 - 1, 2**32, 2**63 - 1,
    2**64 - 1, -(2**63), 0.5, -0.0, 1e308, "x", "", "\u00e9" * 3, b"", b"\x00", b"\xff" * 9,
    [], [1, 2], {}, {"a": 1},
)
# fmt: on
_BAD_FLOATS = (float("nan"), float("inf"), -float("inf"), -1.0, 0.0, -0.0, 1.5, 1e-45, 3.4e38)


def unpack_map(data: bytes) -> dict[Any, Any]:
    out = msgpack.unpackb(data, raw=False, strict_map_key=False)
    assert isinstance(out, dict)
    return out


def pack_map(m: Any) -> bytes:
    out = msgpack.packb(m, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def mutate_bytes(data: bytes, r: random.Random) -> tuple[str, bytes]:
    """A byte-level mutation of an encoded frame."""
    kind = r.choice(("truncate", "flip", "insert", "append", "garbage", "empty", "dup_tail"))
    if kind == "truncate":
        return kind, data[: r.randrange(max(1, len(data)))]
    if kind == "flip":
        b = bytearray(data)
        for _ in range(r.randint(1, 4)):
            i = r.randrange(len(b))
            b[i] ^= 1 << r.randrange(8)
        return kind, bytes(b)
    if kind == "insert":
        i = r.randrange(len(data) + 1)
        return kind, data[:i] + r.randbytes(r.randint(1, 16)) + data[i:]
    if kind == "append":
        return kind, data + r.randbytes(r.randint(1, 64))
    if kind == "garbage":
        return kind, r.randbytes(r.randint(1, 256))
    if kind == "dup_tail":
        i = r.randrange(len(data))
        return kind, data + data[i:]
    return kind, b""


def _bad_probs(n: int, r: random.Random) -> bytes:
    vals = [r.uniform(0.01, 1.0) for _ in range(n)]
    vals[r.randrange(n)] = r.choice(_BAD_FLOATS)
    return struct.pack(f"<{n}f", *vals)


def _bad_ids(n: int, width: int, vocab: int, r: random.Random) -> bytes:
    ids = [r.randrange(vocab) for _ in range(n)]
    ids[r.randrange(n)] = r.randrange(vocab, 1 << (8 * width))
    return b"".join(i.to_bytes(4, "little")[:width] for i in ids)


def mutate_map(data: bytes, r: random.Random, vocab: int = VOCAB) -> tuple[str, bytes]:
    """A structured mutation of one field of an encoded frame (which stays valid msgpack)."""
    m = unpack_map(data)
    keys = list(m)
    kind = r.choice(_MAP_MUTATIONS)
    k = r.choice(keys)
    if kind == "drop_key":
        del m[k]
    elif kind == "unknown_key":
        m[r.choice((9, 10, 99, -1, "zz", 0.5, b"k"))] = r.choice(_JUNK_VALUES)
    elif kind == "junk_value":
        m[k] = r.choice(_JUNK_VALUES)
    elif kind == "int_edge":
        m[k] = r.choice((-1, 0, 1, 2**32 - 1, 2**32, 2**64 - 1, SEQ_MODULUS, SEQ_MODULUS - 1))
    elif kind == "vt":
        m[0] = r.choice([(v << 4) | t for v in (0, 1, 2, 15) for t in range(16)])
    elif kind in ("bin_ids", "bin_probs", "bin_len"):
        bins = [key for key in keys if isinstance(m[key], bytes) and m[key]]
        if not bins:
            m[k] = r.randbytes(r.randint(0, 64))
        else:
            k = r.choice(bins)
            n = max(1, len(m[k]) // 6)
            if kind == "bin_ids":
                m[k] = _bad_ids(n, 2, vocab, r) + m[k][2 * n :]
            elif kind == "bin_probs":
                m[k] = m[k][: len(m[k]) - 4 * n] + _bad_probs(n, r)
            else:
                m[k] = m[k] + m[k] * r.randint(0, 3) + r.randbytes(r.randint(0, 3))
    else:
        m[k] = [[[[r.choice(_JUNK_VALUES)]]]]
    return kind, pack_map(m)


# ============================================================================ verifier fuzzing


class Shadow:
    """The client's oracle: the verifier's own session core (:class:`VerifierCore`), fed the
    same frames, predicts every reply kind; the real replies complete its model work. What the
    next valid Propose must carry as fixed tokens (a correction or bonus) is the client's own
    choice, kept in ``fixed``."""

    def __init__(
        self,
        limits: SessionLimits,
        vocab_size: int,
        *,
        federated: bool = False,
        correction: CorrectionMode = CorrectionMode.TOPK,
        fixed: list[int] | None = None,
    ) -> None:
        """A session of ``limits`` (those the verifier announced, and its frame limits) that
        asked for ``correction``; ``ctx``, the session's WireContext, is the core's."""
        self.max_context = limits.max_context
        fp = Fingerprint("shadow", vocab_size, "shadow")
        self.core = VerifierCore(TargetInfo(fp, vocab_size), limits, "shadow")
        reply_mode = ReplyMode.FEDERATED if federated else ReplyMode.VERDICT
        self.core.receive(encode(Hello(fp, reply_mode=reply_mode, correction=correction, k=1, m=1)))
        assert self.core.ctx is not None, "the shadow's Hello is refused"
        self.ctx: WireContext = self.core.ctx
        self.fixed = list(fixed or [5])  # what the next valid Propose must carry

    @staticmethod
    def limits(welcome: Welcome, max_k: int, max_bad: int, max_resamples: int) -> SessionLimits:
        """The limits of a session that got ``welcome``, from a verifier of ``--max-k``,
        ``--max-bad-frames`` and ``--max-resamples`` (its other limits at their defaults)."""
        return SessionLimits(
            max_gamma=welcome.max_gamma,
            max_fixed=welcome.max_fixed,
            max_context=welcome.max_context,
            max_frame=welcome.max_frame,
            max_k=max_k,
            max_bad_frames=max_bad,
            max_resamples=max_resamples,
        )

    # The session's position, as the core sees it.
    @property
    def epoch(self) -> int:
        return self.core.epoch

    @property
    def seq(self) -> int:
        return self.core.expected_seq

    @property
    def pos(self) -> int:
        return self.core.next_pos

    def start_at(self, epoch: int, seq: int, pos: int) -> None:
        """Put the session at (epoch, seq, pos), its cache that long (tests start elsewhere
        than at 0)."""
        self.core.epoch, self.core.expected_seq = epoch, seq
        self.core.next_pos = self.core.cache_len = pos

    @property
    def pending(self) -> tuple[int, int] | None:
        """(epoch, pos) of the correction a Resample may ask more candidates for."""
        pr = self.core._pending
        return None if pr is None else (pr.epoch, pr.pos)

    def predict(self, data: bytes | str) -> str:
        """'verdict', 'none', 'candidates', 'close', or 'error:<code>'. After 'verdict' or
        'candidates' the core waits for the reply (:meth:`on_reply`, :meth:`on_candidates`)."""
        if isinstance(data, bytes) and len(data) > self.ctx.max_frame:
            return "close"  # aiohttp refuses the frame before the session sees it
        predicted = "none"
        for ev in self.core.receive(data):
            if isinstance(ev, Close):
                return "close"
            if isinstance(ev, Send) and isinstance(ev.msg, Error):
                predicted = f"error:{ev.msg.code}"
            elif isinstance(ev, Run):
                if isinstance(ev.work, work.Crop):
                    self.core.work_done(work.Cropped())
                    self.fixed = [5] if self.pos == 0 else []
                else:
                    predicted = "candidates" if isinstance(ev.work, work.Draw) else "verdict"
        return predicted

    def on_reply(self, p: Propose, reply: Message) -> None:
        """Complete the verify work of the valid Propose ``p`` with the real reply."""
        if isinstance(reply, FederatedReply):
            self.core.work_done(work.Federated(reply.dists, reply.p_draft, reply.l1))
            self.fixed = []
            return
        assert isinstance(reply, Verdict)
        d = Decision(reply.accepted, reply.sparse, reply.candidates, reply.token, reply.bonus)
        self.core.work_done(work.Verified(d, kept_row=reply.candidates is not None))
        if reply.accepted < len(p.draft):
            corr = reply.token
            if corr is None and reply.sparse is not None:
                corr = int(reply.sparse.ids[0])
            if corr is None and reply.candidates is not None:
                corr = int(reply.candidates.ids[0])
            self.fixed = [int(corr if corr is not None else 5)]
        else:
            self.fixed = [] if reply.bonus is None else [reply.bonus]

    def on_candidates(self, c: Candidates) -> None:
        self.core.work_done(work.Drawn(c.candidates))

    def abandon(self) -> None:
        """The real verifier did not answer as predicted: end the pending work as failed
        (the session is closed after a mismatch anyway)."""
        if self.core.running is not None:
            self.core.work_done(
                work.Failed("mismatch", self.core.cache_len, work.FailureKind.MODEL)
            )


_HELLO_KINDS = (
    ("greedy", SamplingParams(0.0), ReplyMode.VERDICT, CorrectionMode.GREEDY_DRAFT),
    ("topk", SamplingParams(1.0), ReplyMode.VERDICT, CorrectionMode.TOPK),
    ("candidates", SamplingParams(1.0, top_k=20), ReplyMode.VERDICT, CorrectionMode.CANDIDATES),
    ("federated", SamplingParams(0.8), ReplyMode.FEDERATED, CorrectionMode.TOPK),
)


class SessionClosed(Exception):
    pass


class HostileClient:
    """One fuzzing client: sessions one after another until the shared budget is spent."""

    def __init__(
        self,
        url: str,
        fp: Fingerprint,
        cfg: FuzzConfig,
        report: FuzzReport,
        budget: list[int],
        r: random.Random,
    ) -> None:
        self.url = url
        self.fp = fp
        self.cfg = cfg
        self.report = report
        self.budget = budget  # [frames left], shared by the clients
        self.r = r

    async def run(self) -> None:
        async with aiohttp.ClientSession() as http:
            while self.budget[0] > 0:
                with contextlib.suppress(SessionClosed):
                    await self._session(http)

    def _spend(self, mutation: str) -> None:
        self.budget[0] -= 1
        self.report.verifier_frames += 1
        _count(self.report.mutations, mutation)

    async def _connect(self, http: aiohttp.ClientSession) -> ClientWS:
        for _ in range(200):  # at max_sessions_per_token a session ends within milliseconds
            try:
                return StreamWS(
                    await http.ws_connect(
                        self.url,
                        protocols=(SUBPROTOCOL,),
                        headers=auth_headers(TOKEN),
                        max_msg_size=0,
                        autoclose=True,
                    )
                )
            except aiohttp.WSServerHandshakeError as e:
                if e.status not in (429, 503):
                    raise
                await asyncio.sleep(0.02)
        raise RuntimeError("the verifier kept refusing sessions")

    async def _recv(self, ws: ClientWS, ctx: WireContext | None) -> Any:
        """The next reply: a Message, or 'close'. A missing reply is a hang."""
        try:
            m = await ws.receive(timeout=self.cfg.reply_timeout_s)
        except asyncio.TimeoutError:
            self.report.hangs.append("no reply within the timeout")
            raise SessionClosed from None
        if m.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
            return "close"
        if m.type != WSMsgType.BINARY:
            return f"unexpected {m.type.name}"
        try:
            return decode(m.data, ctx)
        except ProtocolError as e:
            return f"undecodable reply: {e}"

    def _check(self, predicted: str, got: Any, what: str) -> None:
        kind = _reply_kind(got)
        _count(self.report.replies, kind)
        if predicted == kind or (predicted == "close" and kind.startswith("error:")):
            return  # a fatal error frame precedes the close
        self.report.mismatch_count += 1
        if len(self.report.mismatches) < 20:
            self.report.mismatches.append(f"{what}: predicted {predicted}, got {got!r}"[:400])

    async def _expect(self, ws: ClientWS, predicted: str, ctx: WireContext, what: str) -> Any:
        if predicted == "none":
            return None
        got = await self._recv(ws, ctx)
        self._check(predicted, got, what)
        if predicted == "close" or got == "close":
            if got != "close":
                await self._recv(ws, ctx)  # the close after the fatal error
            raise SessionClosed
        return got

    async def _session(self, http: aiohttp.ClientSession) -> None:
        r, cfg = self.r, self.cfg
        ws = await self._connect(http)
        self.report.sessions += 1
        try:
            _, sampling, reply, correction = r.choice(_HELLO_KINDS)
            hello = Hello(
                self.fp,
                sampling,
                reply_mode=reply,
                correction=correction,
                k=r.choice((1, 5, 10, cfg.max_k)),
                m=r.choice((1, 2, 8)),
                seed=r.randrange(1000),
            )
            if r.random() < 0.15:
                await self._hostile_hello(ws, hello)  # usually ends the session
                return
            await ws.send_bytes(encode(hello))
            welcome = await self._recv(ws, None)
            if not isinstance(welcome, Welcome):
                raise AssertionError(f"expected Welcome, got {welcome!r}")
            sh = Shadow(
                Shadow.limits(welcome, cfg.max_k, cfg.max_bad_frames, cfg.max_resamples),
                welcome.fingerprint.vocab_size,
                federated=reply == ReplyMode.FEDERATED,
                correction=correction,
                fixed=[1, r.randrange(4, VOCAB)],
            )
            sent = 0
            while sent < cfg.max_session_frames and self.budget[0] > 0:
                if r.random() < 0.45:
                    await self._valid_round(ws, sh)
                    continue
                sent += await self._hostile(ws, sh, hello)
        finally:
            await ws.close()

    def _valid_propose(self, sh: Shadow, gamma: int | None = None) -> Propose:
        r = self.r
        g = gamma or r.randint(1, min(6, sh.ctx.max_gamma))
        return Propose(
            epoch=sh.epoch,
            seq=sh.seq,
            pos=sh.pos,
            draft=np.array([r.randrange(4, VOCAB) for _ in range(g)], np.int64),
            q=np.array([r.uniform(0.001, 1.0) for _ in range(g)], np.float32),
            fixed=np.array(sh.fixed, np.int64),
        )

    async def _valid_round(self, ws: ClientWS, sh: Shadow) -> None:
        p = self._valid_propose(sh)
        data = encode(p, sh.ctx)
        predicted = sh.predict(data)
        await ws.send_bytes(data)
        self.report.verifier_valid_frames += 1
        got = await self._expect(ws, predicted, sh.ctx, "valid Propose")
        if predicted == "verdict" and isinstance(got, (Verdict, FederatedReply)):
            sh.on_reply(p, got)
        elif predicted == "verdict":
            sh.abandon()
            raise SessionClosed
        elif predicted == "error:context_full":
            # Start over near the beginning: a valid Rollback.
            rb = encode(Rollback(sh.epoch + 1, self.r.randint(0, min(sh.pos, 8))), sh.ctx)
            predicted = sh.predict(rb)
            await ws.send_bytes(rb)
            self.report.verifier_valid_frames += 1
            await self._expect(ws, predicted, sh.ctx, "rollback after context_full")

    async def _hostile_hello(self, ws: ClientWS, hello: Hello) -> None:
        r = self.r
        kind = r.choice(("bytes", "map", "fingerprint", "limits", "not_hello", "text"))
        data: bytes | str
        if kind == "bytes":
            kind, data = mutate_bytes(encode(hello), r)
        elif kind == "map":
            kind, data = mutate_map(encode(hello), r)
        elif kind == "fingerprint":
            fp = r.choice(
                (
                    Fingerprint("other", VOCAB, "x"),
                    Fingerprint(self.fp.tokenizer_hash, VOCAB + 1, "x"),
                    Fingerprint("", 1, ""),
                )
            )
            data = encode(Hello(fp, hello.sampling))
        elif kind == "limits":
            data = encode(Hello(self.fp, hello.sampling, k=r.choice((10**6, 2**24)), m=4096))
        elif kind == "not_hello":
            data = encode(Error("x", "y"))
        else:
            data = "hello?"
        self._spend(f"hello_{kind}")
        if isinstance(data, str):
            await ws.send_str(data)
        else:
            await ws.send_bytes(data)
        predicted = _predict_hello(data, self.fp, self.cfg)
        got = await self._recv(ws, None)
        self._check(predicted, got, f"hostile Hello ({kind})")

    async def _hostile(self, ws: ClientWS, sh: Shadow, hello: Hello) -> int:
        """One hostile action (one frame, or a flood); returns the frames sent."""
        r = self.r
        ctx = sh.ctx
        action = r.choice(_VERIFIER_ACTIONS)
        frames: list[bytes | str] = []
        valid = encode(self._valid_propose(sh), ctx)
        if action == "bytes":
            action, f = mutate_bytes(valid, r)
            frames.append(f)
        elif action == "map":
            action, f = mutate_map(valid, r)
            frames.append(f)
        elif action == "epoch":
            p = self._valid_propose(sh)
            e = r.choice((sh.epoch + 1, sh.epoch + 1000, 2**32 - 1, max(0, sh.epoch - 1)))
            frames.append(encode(_replace(p, epoch=e), ctx))
        elif action == "seq":
            p = self._valid_propose(sh)
            s = r.choice(((sh.seq - 1) % SEQ_MODULUS, (sh.seq + 1) % SEQ_MODULUS, 0, 127))
            frames.append(encode(_replace(p, seq=s), ctx))
        elif action == "pos":
            p = self._valid_propose(sh)
            pos = r.choice((sh.pos + 1, max(0, sh.pos - 1), sh.max_context, 2**32 - 1, 0))
            fixed = p.fixed if pos else np.zeros(0, np.int64)
            frames.append(encode(_replace(p, pos=pos, fixed=fixed), ctx))
        elif action == "context":
            p = self._valid_propose(sh)
            n = sh.max_context - sh.pos + r.randint(-2, 40)
            fixed = np.array([r.randrange(4, VOCAB) for _ in range(max(1, n))], np.int64)
            frames.append(encode(_replace(p, fixed=fixed), ctx))
        elif action == "ids":
            m = unpack_map(valid)
            g = len(m[4]) // (ctx.width + (4 if ctx.draft_probs else 0))
            m[4] = _bad_ids(g, ctx.width, ctx.vocab_size, r) + m[4][g * ctx.width :]
            frames.append(pack_map(m))
        elif action == "probs":
            if not ctx.draft_probs:
                action = "probs_greedy"
            m = unpack_map(valid)
            g = len(m[4]) // (ctx.width + 4) if ctx.draft_probs else len(m[4]) // ctx.width
            m[4] = m[4][: g * ctx.width] + _bad_probs(g, r)
            frames.append(pack_map(m))
        elif action == "gamma":
            p = self._valid_propose(sh, gamma=1)
            g = r.choice((0, ctx.max_gamma + 1, ctx.max_gamma * 4))
            m = unpack_map(encode(p, ctx))
            per = ctx.width + (4 if ctx.draft_probs else 0)
            m[4] = (m[4][:per] * g) if g else b""
            frames.append(pack_map(m))
        elif action == "rollback":
            e = r.choice((sh.epoch, sh.epoch + 1, max(0, sh.epoch - 1), 2**32 - 1))
            pos = r.choice((0, sh.pos, sh.pos + 1, max(0, sh.pos - 1), 2**32 - 1))
            frames.append(encode(Rollback(e, pos), ctx))
        elif action == "resample":
            if sh.pending is not None and r.random() < 0.7:
                frames.append(encode(Resample(*sh.pending), ctx))
            else:
                frames.append(encode(Resample(sh.epoch, r.choice((0, sh.pos, sh.pos + 1))), ctx))
        elif action == "direction":
            sd = SparseDist(np.array([5], np.int64), np.array([0.5], np.float32))
            wrong: Message = r.choice(
                (
                    Verdict(sh.epoch, sh.seq, 0, token=5),
                    Candidates(sh.epoch, sh.pos, sd),
                    FederatedReply(sh.epoch, sh.seq, (sd, sd), np.array([0.5], np.float32)),
                    Welcome(self.fp, "s", 4, 4, 4, 4096),
                )
            )
            frames.append(encode(wrong, ctx))
        elif action == "hello_again":
            frames.append(encode(hello))
        elif action == "edge_error":
            fatal = r.random() < 0.3
            frames.append(encode(Error(r.choice(("x", "bad_seq", "")), "m" * 100, fatal), ctx))
        elif action == "text":
            frames.append(r.choice(("", "{}", "\x00" * 10, "Propose")))
        elif action == "oversize":
            frames.append(r.randbytes(ctx.max_frame + r.randint(1, 100_000)))
        elif action == "flood":
            for _ in range(r.randint(5, 40)):
                _, f = mutate_bytes(valid, r) if r.random() < 0.5 else mutate_map(valid, r)
                frames.append(f)
        else:  # stale_flood: well-formed Proposes of an old epoch: dropped without model work
            if sh.epoch == 0:
                action = "stale_flood_none"
                frames.append(encode(Rollback(1, sh.pos), ctx))
            else:
                for i in range(r.randint(5, 60)):
                    p = _replace(self._valid_propose(sh), epoch=sh.epoch - 1)
                    frames.append(encode(_replace(p, seq=(sh.seq + i) % SEQ_MODULUS), ctx))
        predictions = []
        for frame in frames:
            predictions.append(sh.predict(frame))
            self._spend(action)
            if isinstance(frame, str):
                await ws.send_str(frame)
            else:
                await ws.send_bytes(frame)
            # A frame that starts model work ends the burst: its outcome (the reply) decides
            # what the frames after it mean, as it does in the verifier.
            if predictions[-1] in ("close", "verdict", "candidates"):
                break
        for pred, frame in zip(predictions, frames, strict=False):
            got = await self._expect(ws, pred, ctx, action)
            if pred == "verdict" and isinstance(got, (Verdict, FederatedReply)):
                # A hostile frame that is in fact valid (e.g. a rollback to the same place).
                sent = decode(frame, ctx)  # type: ignore[arg-type]
                assert isinstance(sent, Propose)
                sh.on_reply(sent, got)
            elif pred == "candidates" and isinstance(got, Candidates):
                sh.on_candidates(got)
            elif pred in ("verdict", "candidates"):
                sh.abandon()
                raise SessionClosed
        return len(predictions)


def _replace(p: Propose, **kw: Any) -> Propose:
    d = {f: getattr(p, f) for f in p.__dataclass_fields__}
    d.update(kw)
    return Propose(**d)


def _reply_kind(got: Any) -> str:
    if isinstance(got, str):
        return got if got == "close" else "junk"
    if isinstance(got, (Verdict, FederatedReply)):
        return "verdict"
    if isinstance(got, Candidates):
        return "candidates"
    if isinstance(got, Error):
        return f"error:{got.code}"
    return type(got).__name__


def _predict_hello(data: bytes | str, fp: Fingerprint, cfg: FuzzConfig) -> str:
    if isinstance(data, bytes) and len(data) > cfg.max_frame:
        return "close"
    try:
        msg = decode(data)  # type: ignore[arg-type]
    except ProtocolError:
        return "error:bad_handshake"
    if not isinstance(msg, Hello):
        return "error:bad_handshake"
    if msg.fingerprint.compatible_with(fp) is not None:
        return "error:fingerprint_mismatch"
    if msg.k > cfg.max_k or msg.m > cfg.max_k:
        return "error:bad_hello"
    return "Welcome"


async def honest_rounds(
    url: str, fp: Fingerprint, rounds: int, seed: int
) -> tuple[list[Message], float]:
    """One honest session: ``rounds`` stop-and-wait rounds (T = 1, candidates, seeded).
    Returns the replies and the slowest round in seconds."""
    slowest = 0.0
    async with aiohttp.ClientSession() as http:
        ws = StreamWS(
            await http.ws_connect(url, protocols=(SUBPROTOCOL,), headers=auth_headers(HONEST_TOKEN))
        )
        try:
            client = ProbeClient(ws)
            await client.hello(
                Hello(fp, SamplingParams(1.0), correction=CorrectionMode.CANDIDATES, seed=seed)
            )
            driver = Driver(client, VOCAB, 4, np.random.default_rng(seed), q_lo=0.01, q_hi=0.5)
            driver.fixed = [1, 7, 9]
            for _ in range(rounds):
                t0 = time.perf_counter()
                await driver.round()
                slowest = max(slowest, time.perf_counter() - t0)
        finally:
            await ws.close()
    return driver.history, slowest


async def fuzz_verifier(url: str, fp: Fingerprint, cfg: FuzzConfig, report: FuzzReport) -> None:
    reference, _ = await honest_rounds(url, fp, cfg.honest_rounds, cfg.seed)
    budget = [cfg.frames]
    clients = [
        HostileClient(url, fp, cfg, report, budget, random.Random(f"{cfg.seed}-{i}"))
        for i in range(cfg.clients)
    ]
    tasks = [asyncio.ensure_future(c.run()) for c in clients]
    try:
        while not all(t.done() for t in tasks):
            replies, slowest = await honest_rounds(url, fp, cfg.honest_rounds, cfg.seed)
            report.honest_replays += 1
            report.honest_rounds += len(replies)
            report.honest_max_round_s = max(report.honest_max_round_s, round(slowest, 4))
            if len(replies) != len(reference) or not all(
                replies_match(a, b) for a, b in zip(replies, reference, strict=True)
            ):
                report.honest_wrong += 1
        for t in tasks:
            t.result()  # a client that failed is a bug in the fuzzer: raise it
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ============================================================================ edge fuzzing


class HostileProxy:
    """A fake verifier for the edge: forwards to the real one and makes downlink frames hostile.

    The edge's Hello and Welcome are decoded to know its WireContext; uplink Proposes are decoded
    to know which batches are outstanding, so that a fake frame the edge cannot tell from the
    truth (a *lie*) is recognised and the generation excluded from the text check.
    """

    def __init__(self, upstream: str, cfg: FuzzConfig, report: FuzzReport) -> None:
        self.upstream = upstream
        self.cfg = cfg
        self.report = report
        self.r = random.Random(f"proxy-{cfg.seed}")
        self.p = cfg.edge_p
        self.lied = False
        self.budget = cfg.edge_frames
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/session", self._handler)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return f"ws://127.0.0.1:{self.port}/v1/session"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _handler(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(protocols=(SUBPROTOCOL,), max_msg_size=0, compress=False)
        await ws.prepare(request)
        async with aiohttp.ClientSession() as http:
            try:
                up = StreamWS(
                    await http.ws_connect(
                        self.upstream,
                        protocols=(SUBPROTOCOL,),
                        headers=auth_headers(TOKEN),
                        max_msg_size=0,
                    )
                )
            except aiohttp.ClientError:
                await ws.close()
                return ws
            try:
                ready = await up.wait_ready(10.0)
            except (asyncio.TimeoutError, ConnectionError):
                await ws.close()
                return ws
            # The edge gets the verifier's Ready with a window the proxy never has to grant.
            await ws.send_bytes(encode_control(dataclasses.replace(ready, window=1 << 30)))
            edge = _EdgeStream(ws)
            state = _ProxyState()
            pumps = [
                asyncio.ensure_future(self._uplink(edge, up, state)),
                asyncio.ensure_future(self._downlink(edge, up, state)),
            ]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in pumps:
                    t.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
                await up.close()
                await ws.close()
        return ws

    async def _uplink(self, ws: _EdgeStream, up: ClientWS, st: _ProxyState) -> None:
        async for msg in ws:
            if msg.type != WSMsgType.BINARY:
                return
            with contextlib.suppress(ProtocolError):
                m = decode(msg.data, st.ctx)
                if isinstance(m, Hello):
                    st.hello = m
                elif isinstance(m, Propose):
                    st.gammas[(m.epoch, m.seq)] = len(m.draft)
                    st.epoch = max(st.epoch, m.epoch)
            await up.send_bytes(msg.data)

    async def _downlink(self, ws: _EdgeStream, up: ClientWS, st: _ProxyState) -> None:
        async for msg in up:
            if msg.type != WSMsgType.BINARY:
                return
            real: bytes = msg.data
            decoded: Message | None = None
            with contextlib.suppress(ProtocolError):
                decoded = decode(real, st.ctx)
            if isinstance(decoded, Welcome) and st.hello is not None:
                st.ctx = wire_context(st.hello, decoded)
            if self.budget > 0 and self.r.random() < self.p:
                self.budget -= 1
                self.report.edge_frames += 1
                if not await self._hostile(ws, real, decoded, st):
                    return
                continue
            st.history.append(real)
            await ws.send_bytes(real)

    def _is_lie(self, data: bytes, real: Message | None, st: _ProxyState) -> bool:
        """Would the edge take ``data`` for the genuine answer ``real`` (the frame it replaces
        or precedes) although it says something else? Only a consistent answer for the same
        batch is undetectable: the same epoch and seq, accepted <= γ, a correction exactly when
        accepted < γ, of the kind the session negotiated. Everything else the edge must refuse.
        """
        if st.ctx is None or real is None:
            return False
        try:
            m = decode(data, st.ctx)
        except ProtocolError:
            return False
        if message_equal(m, real):
            return False
        if isinstance(m, Candidates) and isinstance(real, Candidates):
            return (m.epoch, m.pos) == (real.epoch, real.pos)
        if not (isinstance(m, Verdict) and isinstance(real, Verdict)):
            return False
        gamma = st.gammas.get((m.epoch, m.seq))
        if (m.epoch, m.seq) != (real.epoch, real.seq) or gamma is None:
            return False
        if m.accepted > gamma or (m.accepted < gamma) != (m.bonus is None and _corrected(m)):
            return False
        if m.accepted < gamma:
            return st.hello is not None and _correction_kind(m) == _session_kind(st.hello)
        return True

    async def _hostile(
        self, ws: _EdgeStream, real: bytes, decoded: Message | None, st: _ProxyState
    ) -> bool:
        """Send something hostile instead of / besides ``real``. False: the connection ends."""
        r = self.r
        ctx = st.ctx
        vocab = ctx.vocab_size if ctx is not None else VOCAB
        action = r.choice(_EDGE_ACTIONS)
        if action == "oversize" and r.random() < 0.9:
            action = "bytes"  # 4 MiB frames: a few are enough
        if isinstance(decoded, Welcome):
            action = "welcome"
        out: list[bytes | str] = []
        if action == "bytes":
            action, f = mutate_bytes(real, r)
            out = [f]
        elif action == "map":
            action, f = mutate_map(real, r, vocab)
            out = [f]
        elif action == "semantic" and isinstance(decoded, Verdict) and ctx is not None:
            action, f = _semantic_verdict(decoded, ctx, r)
            out = [f]
        elif action == "wrong_type" and ctx is not None:
            sd = SparseDist(np.array([5, 6], np.int64), np.array([0.5, 0.25], np.float32))
            wrong: Message = r.choice(
                (
                    FederatedReply(st.epoch, 0, (sd, sd), np.array([0.5], np.float32)),
                    Candidates(st.epoch, 3, sd),
                    Rollback(st.epoch + 1, 0),
                    Resample(st.epoch, 1),
                    Welcome(Fingerprint("t", vocab, "m"), "s", 4, 64, 512, 4096),
                    Hello(Fingerprint("t", vocab, "m")),
                )
            )
            action = f"type_{type(wrong).__name__}"
            out = [encode(wrong, ctx)]
        elif action == "error":
            code = r.choice(_EDGE_ERROR_CODES)
            out = [encode(Error(code, "hostile", r.random() < 0.5))]
        elif action == "replay" and st.history:
            out = [r.choice(st.history)]
        elif action == "duplicate":
            out = [real, real]
        elif action == "inject" and ctx is not None:
            v = Verdict(st.epoch, r.randrange(SEQ_MODULUS), 0, token=r.randrange(vocab))
            out = [encode(v, ctx), real]
        elif action == "text":
            out = ["verdict"]
        elif action == "close":
            await ws.close(code=r.choice((1000, 1001, 1008, 1011, 4000)), message=b"hostile")
            _count(self.report.edge_actions, action)
            return False
        elif action == "oversize":
            out = [r.randbytes((4 << 20) + 1)]
        elif action == "welcome":
            action, f = _hostile_welcome(real, r)
            out = [f]
        else:
            action, f = mutate_bytes(real, r)
            out = [f]
        _count(self.report.edge_actions, action)
        for frame in out:
            if isinstance(frame, bytes) and self._is_lie(frame, decoded, st):
                self.lied = True
            if isinstance(frame, str):
                await ws.send_str(frame)
            else:
                await ws.send_bytes(frame)
        return True


class _EdgeStream:
    """The edge's side of the proxy: its one session's frames (stream prefixes taken off and
    put back on), text and closes on the connection itself."""

    def __init__(self, ws: web.WebSocketResponse) -> None:
        self.ws = ws
        self.sid = 1

    def __aiter__(self) -> _EdgeStream:
        return self

    async def __anext__(self) -> WSMessage:
        while True:
            msg = await self.ws.receive()
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                raise StopAsyncIteration
            if msg.type != WSMsgType.BINARY:
                return msg
            try:
                sid, payload = split(msg.data)
            except MuxError:
                return WSMessage(WSMsgType.ERROR, None, None)
            if sid == 0:
                return WSMessage(WSMsgType.CLOSE, 1000, "end")  # the edge's End
            self.sid = sid
            return WSMessage(WSMsgType.BINARY, payload, None)

    async def send_bytes(self, data: bytes) -> None:
        await self.ws.send_bytes(mux_frame(self.sid, data))

    async def send_str(self, data: str) -> None:
        await self.ws.send_str(data)

    async def close(self, *, code: int = 1000, message: bytes = b"") -> bool:
        return await self.ws.close(code=code, message=message)


@dataclass
class _ProxyState:
    hello: Hello | None = None
    ctx: WireContext | None = None
    epoch: int = 0
    gammas: dict[tuple[int, int], int] = field(default_factory=dict)  # (epoch, seq) → γ
    history: list[bytes] = field(default_factory=list)


def _corrected(v: Verdict) -> bool:
    return v.sparse is not None or v.candidates is not None or v.token is not None


def _session_kind(h: Hello) -> str:
    """The correction a verifier sends in this session (``verify_batch``)."""
    if h.sampling.greedy or h.correction == CorrectionMode.GREEDY_DRAFT:
        return "token"
    return "sparse" if h.correction == CorrectionMode.TOPK else "candidates"


def _correction_kind(v: Verdict) -> str:
    if v.sparse is not None:
        return "sparse"
    if v.candidates is not None:
        return "candidates"
    return "token" if v.token is not None else "none"


def _semantic_verdict(v: Verdict, ctx: WireContext, r: random.Random) -> tuple[str, bytes]:
    """A Verdict that decodes but contradicts the session: the edge must detect it."""
    m = unpack_map(encode(v, ctx))
    kind = r.choice(_VERDICT_MUTATIONS)
    if kind == "seq":
        m[2] = (v.seq + r.choice((1, -1, 64))) % SEQ_MODULUS
    elif kind == "epoch":
        m[1] = v.epoch + r.choice((1, 7))
    elif kind == "accepted_over":
        m[3] = r.randint(ctx.max_gamma + 1, ctx.max_gamma + 5) if r.random() < 0.5 else 17
    elif kind == "strip_correction":
        for key in (4, 5, 6):
            m.pop(key, None)
        m[3] = min(v.accepted, 0)
    elif kind == "token_vocab":
        m[6] = ctx.vocab_size + r.randrange(100)
    elif kind == "bonus_and_token":
        m[6], m[7] = 5, 6
    elif kind == "sparse_nan":
        m[4] = (5).to_bytes(2, "little") + struct.pack("<f", float("nan"))
        m.pop(6, None)
    elif kind == "sparse_dup":
        m[4] = (5).to_bytes(2, "little") * 2 + struct.pack("<2f", 0.3, 0.3)
        m.pop(6, None)
    elif kind == "wrong_kind":  # a well-formed correction of a kind the session did not ask for
        m.pop(6, None)
        if v.token is not None or v.accepted == 0:
            m[3] = 0
            m[4] = (5).to_bytes(2, "little") + struct.pack("<f", 0.5)
        else:
            m[3] = v.accepted - 1
            m[6] = 5
    else:  # a plausible lie: a different count or recovered token for the same batch
        if v.token is not None:
            m[6] = (v.token + 1) % ctx.vocab_size
        else:
            m[3] = max(0, v.accepted - 1)
            m[6] = 5
    return kind, pack_map(m)


def _hostile_welcome(real: bytes, r: random.Random) -> tuple[str, bytes]:
    m = unpack_map(real)
    kind = r.choice(("fp_vocab", "fp_hash", "gamma_1", "fixed_1", "frame_min", "bytes", "map"))
    if kind == "fp_vocab":
        m["fp"]["vocab"] = m["fp"]["vocab"] + 1
    elif kind == "fp_hash":
        m["fp"]["tok"] = "0" * 40
    elif kind == "gamma_1":
        m["max_gamma"] = 1
    elif kind == "fixed_1":
        m["max_fixed"] = 1
    elif kind == "frame_min":
        m["max_frame"] = 64
    elif kind == "bytes":
        return mutate_bytes(real, r)
    else:
        return mutate_map(real, r)
    return f"welcome_{kind}", pack_map(m)


CLEAR_ERRORS = (HandshakeError, TokenRefused, VerifierError, LinkClosed)


async def fuzz_edge(
    direct_url: str, draft: LoadedModel, target: LoadedModel, cfg: FuzzConfig, report: FuzzReport
) -> None:
    proxy = HostileProxy(direct_url, cfg, report)
    url = await proxy.start()
    retry = RetryPolicy(
        max_attempts=200, backoff_initial_s=0.001, backoff_max_s=0.01, handshake_timeout_s=5.0
    )
    hostile: EdgeAgent = make_agent(draft, url, TOKEN, retry=retry)
    honest: EdgeAgent = make_agent(draft, direct_url, TOKEN, retry=retry, worker=hostile.worker)
    pcfg = PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(0.0))
    r = random.Random(f"edge-{cfg.seed}")
    rss0 = rss_kib(os.getpid())[0]
    peak = rss0
    try:
        i = 0
        while proxy.budget > 0:
            prompt = random_prompt(r, 10)
            expected = target_greedy(target, prompt, cfg.edge_tokens)
            proxy.lied = False
            gen = Generation(prompt, cfg.edge_tokens)
            outcome = await _bounded_run(hostile, gen, pcfg, report, f"generation {i}")
            report.edge_generations += 1
            if outcome == "done":
                report.edge_completed += 1
            elif outcome != "crash":
                _count(report.edge_clear_errors, outcome)
            if proxy.lied:
                report.edge_lied_to += 1
            elif gen.generated != expected[: len(gen.generated)]:
                report.edge_garbage.append(f"generation {i}: {gen.generated} vs {expected}")
            elif outcome not in ("done", "crash", "hang") and (
                # Replace the hostile server by the real one: the same generation must finish
                # with exactly the target's text.
                await _bounded_run(honest, gen, pcfg, report, f"resume {i}") == "done"
            ):
                report.edge_resumed_ok += 1
            if not proxy.lied and gen.done:
                report.edge_text_checked += 1
                if gen.generated != expected:
                    report.edge_garbage.append(f"generation {i}: {gen.generated} vs {expected}")
            peak = max(peak, rss_kib(os.getpid())[0])
            i += 1
    finally:
        hostile.close()
        await proxy.stop()
    report.edge_rss_kib = {"start": rss0, "peak": peak, "end": rss_kib(os.getpid())[0]}


async def _bounded_run(
    agent: EdgeAgent, gen: Generation, pcfg: PipelineConfig, report: FuzzReport, what: str
) -> str:
    try:
        await asyncio.wait_for(agent.run(gen, pcfg), 120.0)
    except asyncio.TimeoutError:
        report.hangs.append(f"edge {what}: no end within 120 s")
        return "hang"
    except CLEAR_ERRORS as e:
        return type(e).__name__
    except Exception as e:
        report.edge_crashes.append(f"edge {what}: {type(e).__name__}: {e}"[:500])
        return "crash"
    return "done"


# ============================================================================ HTTP fuzzing


#: Bytes that are not valid in (or not ASCII in) an HTTP header: aiohttp hands header bytes that
#: are not UTF-8 to the application as surrogates, and they must still get a 4xx.
HOSTILE_HEADER_BYTES = (
    b"\xff", b"\xfe\xff", b"\x80", b"\xc3\xa9", b"\xe9", b"\xed\xa0\x80", b"\xf0\x9f\x92\xa9",
    b"\x00", b"\x01", b"\x1b[31m", b"\x7f", b"\r", b"\n", b"\t", b"\x0b", b"\x0c",
)  # fmt: skip


def poison_header(raw: bytes, r: random.Random) -> tuple[str, bytes]:
    """Put hostile bytes (:data:`HOSTILE_HEADER_BYTES`) into a random header value of ``raw``."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    if len(lines) < 2:
        return "poison_line", raw[:1] + r.choice(HOSTILE_HEADER_BYTES) + raw[1:]
    i = r.randrange(1, len(lines))
    name, colon, value = lines[i].partition(b":")
    at = r.randint(0, len(value))
    bad = r.choice(HOSTILE_HEADER_BYTES)
    lines[i] = name + colon + value[:at] + bad + value[at:]
    return f"poison_{name.decode('latin-1').lower()[:24]}", b"\r\n".join(lines) + sep + body


def http_fixed_cases(port: int) -> list[tuple[str, bytes]]:
    """The fixed (name, raw request) pairs of :func:`http_cases` (no random mutation)."""
    return http_cases(port, random.Random(0), 0)


def http_cases(port: int, r: random.Random, n: int) -> list[tuple[str, bytes]]:
    """(name, raw request) pairs: malformed, oversized or hostile; each must get a 4xx. The fixed
    cases come first (all of them, whatever ``n``), then random mutations up to ``n``."""
    host = f"Host: 127.0.0.1:{port}\r\n".encode()
    up = (
        b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    )
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    proto = f"Sec-WebSocket-Protocol: {SUBPROTOCOL}\r\n".encode()
    g, s = b"GET /v1/session HTTP/1.1\r\n" + host, b"GET /health HTTP/1.1\r\n" + host
    # fmt: off
    fixed: list[tuple[str, bytes]] = [
        ("no_token", g + up + proto + b"\r\n"),
        ("wrong_token", g + up + proto + b"Authorization: Bearer nope\r\n\r\n"),
        ("basic_auth", g + up + proto + b"Authorization: Basic YTpi\r\n\r\n"),
        ("huge_token", g + up + proto + b"Authorization: Bearer " + b"A" * 8000 + b"\r\n\r\n"),
        ("binary_token", g + up + proto + b"Authorization: Bearer \xff\xfe\x00x\r\n\r\n"),
        ("no_upgrade", g + auth + proto + b"\r\n"),
        ("no_subprotocol", g + up + auth + b"\r\n"),
        ("bad_subprotocol", g + up + auth + b"Sec-WebSocket-Protocol: wanspec.v0\r\n\r\n"),
        ("bad_ws_version", g + auth + proto + up.replace(b"Version: 13", b"Version: 99") + b"\r\n"),
        ("bad_ws_key", g + auth + proto + up.replace(b"dGhlIHNhbXBsZSBub25jZQ==", b"short")
         + b"\r\n"),
        # Found by this fuzzer: aiohttp's own 400 for this failed to encode (a 500).
        ("non_ascii_upgrade", g + auth + proto + up.replace(b"websocket", b"websoc\xebet")
         + b"\r\n"),
        ("post_session", b"POST /v1/session HTTP/1.1\r\n" + host + auth
         + b"Content-Length: 5\r\n\r\nhello"),
        ("post_health", b"POST /health HTTP/1.1\r\n" + host + b"Content-Length: 0\r\n\r\n"),
        ("delete_metrics", b"DELETE /metrics HTTP/1.1\r\n" + host + b"\r\n"),
        ("unknown_path", b"GET /v1/../../etc/passwd HTTP/1.1\r\n" + host + b"\r\n"),
        ("long_path", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n" + host + b"\r\n"),
        ("long_header", s + b"X-Big: " + b"b" * 9000 + b"\r\n\r\n"),
        ("many_headers", s + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(400))
         + b"\r\n"),
        ("bad_request_line", b"GARBAGE\r\n\r\n"),
        ("bad_method", b"G\x00T /health HTTP/1.1\r\n" + host + b"\r\n"),
        ("bad_version", b"GET /health HTTP/1.x\r\n" + host + b"\r\n"),
        ("bad_header", s + b"No colon here\r\n\r\n"),
        ("header_nul", s + b"X-A: a\x00b\r\n\r\n"),
        ("bad_chunked", b"POST /health HTTP/1.1\r\n" + host
         + b"Transfer-Encoding: chunked\r\n\r\nZZZ\r\nxx\r\n0\r\n\r\n"),
        ("cl_and_te", b"POST /v1/session HTTP/1.1\r\n" + host
         + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        ("negative_cl", b"POST /health HTTP/1.1\r\n" + host + b"Content-Length: -1\r\n\r\n"),
        ("huge_cl", b"POST /metrics HTTP/1.1\r\n" + host
         + b"Content-Length: 99999999999\r\n\r\n"),
        # Found by the hardening review: a token with byte 0xff (or any byte that is not UTF-8)
        # was a 500 with a logged traceback; a non-ASCII Sec-WebSocket-Key too.
        ("token_0xff", g + up + proto + b"Authorization: Bearer ab\xffcd\r\n\r\n"),
        ("token_latin1", g + up + proto + b"Authorization: Bearer caf\xe9\r\n\r\n"),
        ("token_utf8", g + up + proto + "Authorization: Bearer café\r\n\r\n".encode()),
        ("token_lone_surrogate", g + up + proto + b"Authorization: Bearer \xed\xa0\x80\r\n\r\n"),
        ("token_ctl", g + up + proto + b"Authorization: Bearer a\x1bb\r\n\r\n"),
        ("token_del", g + up + proto + b"Authorization: Bearer a\x7fb\r\n\r\n"),
        ("token_only_0xff", g + up + proto + b"Authorization: Bearer \xff\r\n\r\n"),
        ("scheme_0xff", g + up + proto + b"Authorization: Bear\xffer " + TOKEN.encode()
         + b"\r\n\r\n"),
        ("auth_twice", g + up + proto + auth + b"Authorization: Bearer \xff\r\n\r\n"),
        ("key_0xff", g + auth + proto + up.replace(b"Q==", b"Q\xff=") + b"\r\n"),
        ("key_non_base64", g + auth + proto + up.replace(b"dGhlIHNhbXBsZSBub25jZQ==", b"!!!!")
         + b"\r\n"),
        ("version_0xff", g + auth + proto + up.replace(b"Version: 13", b"Version: 1\xff")
         + b"\r\n"),
        ("protocol_0xff", g + up + auth + b"Sec-WebSocket-Protocol: wanspec.v1\xff\r\n\r\n"),
        ("connection_0xff", g + auth + proto
         + up.replace(b"Connection: Upgrade", b"Connection: Upgr\xffde") + b"\r\n"),
        ("upgrade_utf8", g + auth + proto + up.replace(b"websocket", "wébsocket".encode())
         + b"\r\n"),
        ("plain_get_0xff", g + auth + b"X-A: \xff\r\n\r\n"),
        ("header_name_0xff", s + b"X-\xff: a\r\n\r\n"),
        ("header_ctl", s + b"X-A: a\x01b\r\n\r\n"),
        ("header_bare_cr", s + b"X-A: a\rb\r\n\r\n"),
        ("header_bare_lf", s + b"X-A: a\nb: c\r\n\r\n"),
        ("header_obs_fold", s + b"X-A: a\r\n b\r\n\r\n"),
        ("host_0xff", b"GET /metrics HTTP/1.1\r\nHost: \xff\xfe\r\n\r\n"),
        ("path_0xff", b"GET /health\xff HTTP/1.1\r\n" + host + b"\r\n"),
        ("query_0xff", b"GET /health?a=\xff HTTP/1.1\r\n" + host + b"\r\n"),
        ("content_length_0xff", b"POST /health HTTP/1.1\r\n" + host
         + b"Content-Length: 1\xff\r\n\r\n"),
        ("transfer_encoding_0xff", b"POST /health HTTP/1.1\r\n" + host
         + b"Transfer-Encoding: chunk\xffed\r\n\r\n"),
    ]
    # fmt: on
    out = list(fixed)
    while len(out) < n:
        name, base = r.choice(fixed)
        if r.random() < 0.3:
            kind, data = poison_header(base, r)
        else:
            kind, data = mutate_bytes(base, r)
            if kind in ("empty", "truncate"):
                continue  # an incomplete request gets no answer at all, which is right
        out.append((f"{name}+{kind}", data))
    return out[: max(n, len(fixed))]


async def fuzz_http(port: int, cfg: FuzzConfig, report: FuzzReport) -> None:
    r = random.Random(f"http-{cfg.seed}")
    for name, raw in http_cases(port, r, cfg.http_requests):
        status = await _raw_request(port, raw)
        report.http_requests += 1
        _count(report.http_status, str(status))
        # None: the server closed the connection without answering (e.g. a request it cannot
        # even parse as HTTP after a garbage first byte): no state was created, which is fine.
        if status is not None and not 400 <= status < 500:
            report.http_bad.append(f"{name}: HTTP {status}")


async def _raw_request(port: int, raw: bytes) -> int | None:
    """The status of the answer to ``raw``; None if the server closed without one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 10.0)
    except ConnectionError:
        return None
    except asyncio.TimeoutError:
        return -1  # no answer at all: counted as "not 4xx"
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    parts = line.split()
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        return int(parts[1])
    return None


# ============================================================================ the run


async def run(
    cfg: FuzzConfig, workdir: Path, *, parts: tuple[str, ...] = ("verifier", "edge", "http")
) -> FuzzReport:
    report = FuzzReport(config=asdict(cfg))
    t0 = time.monotonic()
    pair = tiny_pair(workdir / "models")
    tokens = write_tokens(workdir / "tokens", [TOKEN, HONEST_TOKEN])
    verifier = VerifierProcess(
        str(pair.target_dir),
        free_port(),
        tokens,
        args=(
            f"--max-frame={cfg.max_frame} --max-k={cfg.max_k} "
            f"--max-bad-frames={cfg.max_bad_frames} --max-resamples={cfg.max_resamples} "
            "--handshake-timeout=2 --max-sessions-per-token=48 --log-level=warning "
            # the honest clients' verdict model predicts whole drafts; a cut depends on load
            "--no-ration"
        ).split(),
        log_path=workdir / "verifier.log",
    )
    verifier.start()
    samples: list[int] = []
    stop = asyncio.Event()

    async def sample_rss() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                samples.append(verifier.rss_kib()[0])
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)

    sampler: asyncio.Task[None] | None = None
    try:
        await verifier.wait_ready()
        sampler = asyncio.ensure_future(sample_rss())
        fp = pair.target.fingerprint
        if "verifier" in parts:
            await fuzz_verifier(verifier.url, fp, cfg, report)
        if "http" in parts:
            await fuzz_http(verifier.port, cfg, report)
        if "edge" in parts:
            await fuzz_edge(verifier.url, pair.draft, pair.target, cfg, report)
        # The verifier is still there and still right.
        replies, _ = await honest_rounds(verifier.url, fp, 4, cfg.seed + 1)
        report.verifier_alive = verifier.alive() and len(replies) == 4
    finally:
        stop.set()
        if sampler is not None:
            await sampler
        if verifier.alive():
            _, peak = verifier.rss_kib()
            if samples:
                q = max(1, len(samples) // 4)
                report.rss_kib = {
                    "first": samples[0],
                    "first_quarter_max": max(samples[:q]),
                    "last_quarter_max": max(samples[-q:]),
                    "peak": peak,
                }
        await verifier.stop()
    report.wall_s = round(time.monotonic() - t0, 1)
    return report


def summary(rep: FuzzReport) -> str:
    return "\n".join(
        [
            f"verifier: {rep.verifier_frames} hostile frames (+{rep.verifier_valid_frames} valid) "
            f"in {rep.sessions} sessions; reply predictions wrong: {rep.mismatch_count}; "
            f"hangs: {len(rep.hangs)}",
            f"honest session: {rep.honest_replays} replays, {rep.honest_rounds} rounds, "
            f"{rep.honest_wrong} wrong, slowest round {rep.honest_max_round_s} s",
            f"verifier RSS KiB: {rep.rss_kib}; alive at the end: {rep.verifier_alive}",
            f"edge: {rep.edge_frames} hostile frames over {rep.edge_generations} generations: "
            f"{rep.edge_completed} completed, clear errors {rep.edge_clear_errors}, "
            f"{rep.edge_resumed_ok} finished over an honest link afterwards; text checked "
            f"{rep.edge_text_checked}, lied to {rep.edge_lied_to}; garbage "
            f"{len(rep.edge_garbage)}, crashes {len(rep.edge_crashes)}; RSS KiB {rep.edge_rss_kib}",
            f"http: {rep.http_requests} requests, statuses {rep.http_status}, "
            f"not 4xx: {rep.http_bad}",
            f"top replies: {Counter(rep.replies).most_common(8)}",
            f"wall {rep.wall_s} s",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    p = config_parser(
        "python -m testkit.fuzz",
        __doc__,
        FuzzConfig,
        ("frames", "hostile frames at the verifier"),
        "edge_frames",
        "clients",
        "http_requests",
        "seed",
    )
    p.add_argument("--write-corpus", type=Path, help="write the small committed corpus and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.write_corpus:
        print(f"{write_corpus(args.write_corpus, args.seed)} frames in {args.write_corpus}")
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("wanspec.edge").setLevel(logging.ERROR)
    _, report = run_command(FuzzConfig, args, "wanspec-fuzz-", run, summary)
    if report.mismatches or report.hangs or report.edge_garbage or report.edge_crashes:
        print(
            json.dumps(
                {
                    k: getattr(report, k)
                    for k in ("mismatches", "hangs", "edge_garbage", "edge_crashes")
                },
                indent=1,
            )
        )
    return 0 if report.ok() else 1


# ============================================================================ the committed corpus


def corpus_frames(seed: int = 0) -> list[tuple[str, str, bytes]]:
    """(target, name, frame): a small fixed corpus, replayed by ``tests/system/test_fuzz.py``.

    ``verifier`` frames are sent as the first frame after Welcome of a greedy session
    (epoch 0, seq 0, pos 0); ``edge`` frames are the reply to an edge's first Propose
    (greedy, γ = 3: epoch 0, seq 0) and must each be refused by it (none is a consistent lie).
    """
    r = random.Random(f"corpus-{seed}")
    vctx = WireContext(vocab_size=VOCAB, max_gamma=16, max_fixed=8192, max_k=64, draft_probs=False)
    ectx = WireContext(vocab_size=VOCAB, max_gamma=16, max_fixed=8192, draft_probs=False)
    valid = encode(
        Propose(0, 0, 0, np.array([5, 6, 7], np.int64), np.ones(3, np.float32),
                np.array([1, 9], np.int64)),
        vctx,
    )  # fmt: skip
    out: list[tuple[str, str, bytes]] = []
    for i in range(12):
        kind, f = mutate_bytes(valid, r) if i % 2 else mutate_map(valid, r)
        out.append(("verifier", f"{i:02d}-{kind}", f))
    sd = SparseDist(np.array([5], np.int64), np.array([0.5], np.float32))
    hostile: list[tuple[str, Message]] = [
        ("seq_replay", Propose(0, 127, 0, np.array([5]), np.ones(1, np.float32), np.array([1]))),
        ("epoch_ahead", Propose(3, 0, 0, np.array([5]), np.ones(1, np.float32), np.array([1]))),
        ("pos_ahead", Propose(0, 0, 7, np.array([5]), np.ones(1, np.float32), np.array([1]))),
        ("pos0_no_fixed", Propose(0, 0, 0, np.array([5]), np.ones(1, np.float32))),
        ("rollback_same_epoch", Rollback(0, 0)),
        ("rollback_past_end", Rollback(1, 5)),
        ("resample_unasked", Resample(0, 0)),
        ("verdict_from_edge", Verdict(0, 0, 0, token=5)),
        ("candidates_from_edge", Candidates(0, 0, sd)),
        ("hedge_without_cogen", Hedge(3, 5, np.array([6, 7]), np.ones(2, np.float32))),
    ]
    out += [("verifier", name, encode(m, vctx)) for name, m in hostile]
    m = unpack_map(valid)
    m[4] = _bad_ids(3, 2, VOCAB, r)
    out.append(("verifier", "draft_id_over_vocab", pack_map(m)))
    m = unpack_map(valid)
    m[5] = b"\x01\x00" * 600  # 600 fixed tokens: past the tiny model's 512-token context
    out.append(("verifier", "fixed_past_context", pack_map(m)))
    out.append(("verifier", "hello_again", encode(Hello(Fingerprint("t", VOCAB, "m")))))
    # The edge's side: replies to its first Propose (epoch 0, seq 0, γ = 3, greedy).
    truth = encode(Verdict(0, 0, 1, token=5), ectx)
    VT = VERDICT_HEADER
    edge: list[tuple[str, bytes]] = [
        ("strip_correction", pack_map({0: VT, 1: 0, 2: 0, 3: 1})),
        ("accepted_over_gamma", pack_map({0: VT, 1: 0, 2: 0, 3: 4})),
        ("correction_on_full", pack_map({0: VT, 1: 0, 2: 0, 3: 3, 6: 5})),
        ("sparse_in_greedy", pack_map({0: VT, 1: 0, 2: 0, 3: 1, 4: b"\x05\x00\x00\x00\x00?"})),
        ("wrong_seq", encode(Verdict(0, 1, 1, token=5), ectx)),
        ("wrong_epoch", encode(Verdict(1, 0, 1, token=5), ectx)),
        ("token_over_vocab", pack_map({0: VT, 1: 0, 2: 0, 3: 1, 6: VOCAB})),
        ("sparse_nan", pack_map({0: VT, 1: 0, 2: 0, 3: 1, 4: b"\x05\x00\x00\x00\xc0\x7f"})),
        ("federated_reply", encode(FederatedReply(0, 0, (sd, sd), np.ones(1, np.float32)), ectx)),
        ("candidates_unasked", encode(Candidates(0, 1, sd), ectx)),
        ("welcome_again", encode(Welcome(Fingerprint("t", VOCAB, "m"), "s", 4, 64, 512, 4096))),
        ("fatal_error", encode(Error("internal", "x", True))),
        ("hedge_from_verifier", encode(Hedge(3, 5, np.array([6]), np.ones(1, np.float32)), ectx)),
    ]
    for i in range(8):
        kind, f = mutate_bytes(truth, r) if i % 2 else mutate_map(truth, r)
        with contextlib.suppress(ProtocolError):
            decode(f, ectx)
            continue  # decodes: might be a consistent lie; keep only refused ones
        edge.append((f"{i:02d}-{kind}", f))
    out += [("edge", name, f) for name, f in edge]
    return out


#: The header byte of a Verdict frame (protocol version and type).
VERDICT_HEADER = (PROTOCOL_VERSION << 4) | MsgType.VERDICT


def write_corpus(folder: Path, seed: int = 0) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.bin"):
        old.unlink()
    frames = corpus_frames(seed)
    for target, name, f in frames:
        (folder / f"{target}-{name}.bin").write_bytes(f)
    return len(frames)


if __name__ == "__main__":
    raise SystemExit(main())
