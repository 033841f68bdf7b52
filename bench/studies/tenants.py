"""Tenants: one bearer token's long prompts beside honest sessions (issue 38's benchmark).

    python -m bench tenants                              # default model, this CPU (~5 min)
    python -m bench tenants --smoke --out /tmp/t.json    # tiny model (< 60 s)

Setup. One ``cloud-verifier serve`` process (the product, its default settings but the KV pool,
see below) with two bearer tokens, the honest tenant's and the attacker's, on 127.0.0.1 (no
WAN: what is measured is the verifier's own scheduling). Sessions are raw sessions over the
wire, one connection each, their rounds played by the edge's own session core
(:class:`edge_agent.session.core.SingleCore`, as :class:`testkit.probe.Driver` does): greedy target,
stop-and-wait rounds of γ random draft tokens, Progress frames asked for (as a real edge does)
and waited through; a round's time is its Propose sent → its Verdict received.

Two arms of ``--duration`` seconds each, the same honest load in both, run in this order:

* ``honest_only``: ``--honest`` users on the honest token, each looping sessions: open (a
  refusal is recorded with its time and code, and retried after its Retry-After × [1, 1.5]),
  a ``--honest-prompt``-token random prompt with the first round (its prefill), then up to
  ``--rounds-per-session`` rounds, close (normally: the verifier releases it), again;
* ``with_attacker``: the same, plus ``--attackers`` sessions on the attacker's token, each
  looping: open, one Propose carrying a fresh random ``--attack-prompt``-token prompt (no
  prefix-cache hit is possible) and γ drafts, wait for its Verdict, close, again.

At the end of an arm no new round or session starts; the attacker's sessions are closed at
once, and the honest rounds in flight get ``--drain`` seconds more to finish (those that do not
are counted ``unfinished``, with the time they had waited: the p99 is then a lower bound).

Per arm, honest tenant: goodput (Verdicts received within the arm, and the tokens they
committed, per second of the arm), round p50/p99 over every round sent in the arm (first
rounds, with their prefill, included; the first rounds alone and the later ones alone too),
``failures`` (an Error frame, a closed connection or stream, a malformed frame: anything the
benchmark did not do itself; refusals are apart), admission ``refusals`` (HTTP 503/429 at the
upgrade, or a fatal Error with Retry-After to the Hello: ``busy``, ``overloaded``, ``kv_full``,
...), each with its time in the arm and the attacker prompts in flight then. Attacker: prompts
sent and answered, prompt tokens answered per second, its refusals and failures. Verifier
(``/metrics``, sampled every ``--sample`` s): the admission queue-delay gauge, refusals by
reason, forwards.

The ratios with_attacker / honest_only of the honest goodput and p99 round carry 95 %
percentile-bootstrap intervals **over honest users** (each arm's users resampled with
replacement, ``--bootstrap`` times; a user's verdicts and rounds move together). Targets
(issue 38): goodput ratio ≥ 0.8, p99 ratio ≤ 2, zero honest failures in either arm, and no
honest refusal while the attacker's prompts are prefilling (an attacker prompt in flight).

Attacker prompt length: the requested ``--attack-prompt``, or less where the verifier's
``max_context`` (its Welcome) does not allow it with γ drafts (the output says which).
KV pool (``--kv-cache-tokens``; 0: sized here): large enough for every session's whole text at
once with the attacker's sessions within the product's default per-token share
(``kv_token_share``), so that the benchmark measures the scheduler, not a KV refusal.

Writes ``--out`` (``docs/results/overload_tenants.json``): ``targets`` (value, interval,
met), ``arms`` (everything above, with a timeline), ``setup`` (commit, date, machine, every
setting); and a figure beside it (``.png``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import math
import os
import platform
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import WSMsgType

from bench.lib.cli import add_verifier_run, study_parser
from bench.lib.verifier_state import scrape, wait_idle
from cloud_verifier.daemon.auth import generate_token
from edge_agent.session.core import SingleCore
from edge_agent.session.events import Fail, Send
from edge_agent.session.generation import Generation
from edge_agent.session.pipeline_config import Mode, PipelineConfig
from shared.maths.sampling import SamplingParams
from shared.wire.codec import decode, encode
from shared.wire.messages import SUBPROTOCOL, Error, Hello, Progress, Welcome
from shared.wire.mux import Ready
from testkit.harness import (
    REPO,
    VerifierProcess,
    free_port,
    record_study,
    write_tokens,
)
from testkit.net.stream_ws import StreamWS
from testkit.probe import auth_headers
from testkit.provenance import git

HONEST, ATTACKER = "honest", "attacker"
#: The percentiles of the honest round times kept for the figure.
QUANTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9, 100)
ARMS = ("honest_only", "with_attacker")

#: What the product's per-token KV share is (cloud_verifier.daemon.settings.VerifierSettings), for
#: sizing the pool; read from the settings when they can be imported.
DEFAULT_TOKEN_SHARE = 0.75


# ------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class TenantsConfig:
    out: Path = Path("docs/results/overload_tenants.json")
    model: str = "default"  # the target: a model spec, or "tiny" (testkit.tiny_models)
    honest: int = 16  # honest users (sessions at once)
    attackers: int = 8  # the attacker's sessions at once
    attack_prompt: int = 8000  # tokens per attacker prompt (less if max_context says so)
    honest_prompt: int = 128  # tokens per honest session's prompt
    gamma: int = 8  # draft tokens per round
    rounds_per_session: int = 32  # honest rounds per session, the first included
    duration_s: float = 120.0  # per arm
    drain_s: float = 60.0  # more for the honest rounds in flight at an arm's end
    threads: int = 1  # the verifier's torch threads
    kv_cache_tokens: int = 0  # 0: sized for every session at once (module docstring)
    max_queue_delay: float | None = None  # the verifier's admission setting (None: default)
    bin_s: float = 10.0  # the timeline's bins
    sample_s: float = 2.0  # /metrics sampling
    probe_every_s: float = 5.0  # a new honest session's admission probed this often (0: off)
    bootstrap: int = 2000
    seed: int = 0
    smoke: bool = False


SMOKE: dict[str, Any] = {
    "model": "tiny",
    "honest": 4,
    "attackers": 2,
    "honest_prompt": 24,
    "gamma": 4,
    "rounds_per_session": 6,
    "duration_s": 4.0,
    "drain_s": 10.0,
    "bin_s": 1.0,
    "sample_s": 0.5,
    "probe_every_s": 0.5,
    "bootstrap": 200,
}


# ------------------------------------------------------------------------------ records


@dataclass
class Round:
    user: int
    sent: float  # seconds into the arm
    seconds: float | None  # None: no Verdict by the end of the drain (waited: ``waited``)
    first: bool  # the session's first round (its prompt's prefill)
    committed: int = 0
    waited: float = 0.0


@dataclass
class Refusal:
    tenant: str
    at: float  # seconds into the arm
    code: str
    retry_after_s: float | None
    attack_prompts_in_flight: int
    http_status: int | None = None
    probe: bool = False  # an admission probe's (else a user's next session)

    def json(self) -> dict[str, Any]:
        return {
            "at_s": round(self.at, 2),
            "code": self.code,
            "retry_after_s": self.retry_after_s,
            "attack_prompts_in_flight": self.attack_prompts_in_flight,
            "http_status": self.http_status,
            "probe": self.probe,
        }


@dataclass
class Failure:
    tenant: str
    at: float
    what: str

    def json(self) -> dict[str, Any]:
        return {"at_s": round(self.at, 2), "what": self.what}


@dataclass
class AttackPrompt:
    sent: float
    tokens: int
    seconds: float | None  # None: not answered by the arm's end


@dataclass
class Arm:
    """One arm's clock and what happened in it."""

    name: str
    t0: float
    end: float  # monotonic: no new round or session from here
    drain_end: float
    rounds: list[Round] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    attack: list[AttackPrompt] = field(default_factory=list)
    sessions_opened: dict[str, int] = field(default_factory=lambda: {HONEST: 0, ATTACKER: 0})
    attack_inflight: int = 0
    samples: list[dict[str, float]] = field(default_factory=list)
    #: Admission probes: (seconds into the arm, "admitted" or the refusal's code or
    #: "no_welcome", seconds to the answer).
    probes: list[tuple[float, str, float]] = field(default_factory=list)
    #: This machine's 1-minute load average at the arm's start and end (other work on it).
    load: list[float] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def sample(self, metrics: dict[str, float]) -> None:
        """Keep a /metrics scrape's figures, with the time and the attacker's prompts in
        flight."""
        at = {"t": round(self.now(), 2), "attack_in_flight": float(self.attack_inflight)}
        self.samples.append({**at, **_metric_subset(metrics)})


class Refused(Exception):
    """A new session refused (busy, not down): its code and Retry-After."""

    def __init__(self, code: str, retry_after: float | None, status: int | None) -> None:
        super().__init__(code)
        self.code = code
        self.retry_after = retry_after
        self.status = status


# ------------------------------------------------------------------------------ a session


class RawSession:
    """One session on its own connection: Hello → Welcome, then stop-and-wait rounds of γ
    random drafts through the edge's :class:`~edge_agent.session.core.SingleCore` (greedy
    target)."""

    def __init__(
        self,
        ws: StreamWS,
        hello: Hello,
        welcome: Welcome,
        rng: np.random.Generator,
        prompt: list[int],
        gamma: int,
    ) -> None:
        self.ws = ws
        self.rng = rng
        self.vocab = welcome.fingerprint.vocab_size
        cfg = PipelineConfig(
            gamma=min(gamma, welcome.max_gamma),
            depth=1,
            mode=Mode.STOP_AND_WAIT,
            sampling=hello.sampling,
            correction=hello.correction,
        )
        self.gamma = cfg.gamma
        self.max_context = welcome.max_context
        self.core = SingleCore(Generation(prompt, 1 << 40), cfg, rng, hello, welcome)

    @property
    def room(self) -> bool:
        """Another round fits in the session's context."""
        return len(self.core.gen.committed) + self.gamma + 1 <= self.max_context

    async def round(self, timeout: float) -> int:
        """One round; the tokens it committed. Raises TimeoutError past ``timeout`` seconds,
        ConnectionError if the stream or connection ends, the core's error on an Error
        frame."""
        core, gen = self.core, self.core.gen
        plan = core.pipe.plan()
        assert plan is not None, "a stop-and-wait session has nothing in flight between rounds"
        draft = self.rng.integers(4, self.vocab, self.gamma).tolist()
        q = np.exp(self.rng.uniform(np.log(1e-7), np.log(1e-3), self.gamma))
        q_rows = []
        for x, qx in zip(draft, q, strict=True):
            row = np.zeros(self.vocab)  # [vocab]
            row[x] = qx
            q_rows.append(row)
        before = len(gen.committed)
        await self._do(core.propose(plan, draft, q_rows))
        deadline = time.monotonic() + timeout
        while core.pipe.inflight:
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError
            m = await self.ws.receive(timeout=left)
            if m.type != WSMsgType.BINARY:
                raise ConnectionError(f"the session ended: {m.type.name} {m.data!r} {m.extra!r}")
            await self._do(core.receive(m.data))
        return len(gen.committed) - before

    async def _do(self, events: Sequence[object]) -> None:
        for e in events:
            if isinstance(e, Fail):
                raise e.error
            if isinstance(e, Send):
                await self.ws.send_bytes(encode(e.msg, self.core.ctx))


async def open_session(
    http: aiohttp.ClientSession, url: str, token: str, seed: int, timeout: float
) -> tuple[StreamWS, Hello, Welcome]:
    """A new session on its own connection (greedy, Progress frames asked for). Raises
    :class:`Refused` for a refusal with Retry-After (before or after the upgrade)."""
    try:
        raw = await http.ws_connect(url, protocols=(SUBPROTOCOL,), headers=auth_headers(token))
    except aiohttp.WSServerHandshakeError as e:
        retry = e.headers.get("Retry-After") if e.headers else None
        code = (e.headers.get("X-Wanspec-Refusal") if e.headers else None) or f"http_{e.status}"
        if e.status in (429, 503):
            raise Refused(code, float(retry) if retry else None, e.status) from None
        raise
    ws = StreamWS(raw)
    try:
        ready: Ready = await ws.wait_ready(timeout)
        hello = Hello(
            fingerprint=ready.fingerprint, sampling=SamplingParams(0.0), seed=seed, progress=True
        )
        await ws.send_bytes(encode(hello))
        while True:
            m = await ws.receive(timeout=timeout)
            if m.type != WSMsgType.BINARY:
                raise ConnectionError(f"closed before Welcome: {m.type.name} {m.data!r}")
            msg = decode(m.data)
            if isinstance(msg, Welcome):
                return ws, hello, msg
            if isinstance(msg, Error) and msg.retry_after is not None:
                raise Refused(msg.code, msg.retry_after, None)
            if not isinstance(msg, Progress):
                raise ConnectionError(f"expected Welcome, got {msg}")
    except BaseException:
        await ws.close()
        raise


# ------------------------------------------------------------------------------ the tenants


@dataclass
class Tenants:
    """What every user of a run needs."""

    cfg: TenantsConfig
    http: aiohttp.ClientSession
    url: str
    tokens: dict[str, str]  # tenant → bearer token
    attack_prompt: int  # tokens, after the max_context check
    log: Callable[[str], None] = print


def _what(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


async def _backoff(arm: Arm, retry_after: float | None, rng: random.Random) -> None:
    wait = (retry_after or 1.0) * rng.uniform(1.0, 1.5)
    await asyncio.sleep(max(0.0, min(wait, arm.end - time.monotonic())))


async def _open(
    t: Tenants, arm: Arm, who: str, k: int, jitter: random.Random
) -> tuple[StreamWS, Hello, Welcome] | None:
    """Open tenant ``who``'s ``k``-th session; a refusal or a failure is recorded (and waited
    out: Retry-After, or 1 s) and gives None."""
    try:
        opened = await open_session(t.http, t.url, t.tokens[who], seed=k, timeout=30.0)
    except Refused as r:
        arm.refusals.append(
            Refusal(who, arm.now(), r.code, r.retry_after, arm.attack_inflight, r.status)
        )
        await _backoff(arm, r.retry_after, jitter)
        return None
    except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError, ValueError) as e:
        arm.failures.append(Failure(who, arm.now(), "opening: " + _what(e)))
        await _backoff(arm, 1.0, jitter)
        return None
    arm.sessions_opened[who] += 1
    return opened


async def _sessions(
    t: Tenants, arm: Arm, who: str, n: int
) -> AsyncIterator[tuple[np.random.Generator, random.Random, tuple[StreamWS, Hello, Welcome]]]:
    """The sessions user ``n`` of its kind opens one after another until the arm ends (refusals
    and failures to open counted and backed off), with its two random streams: ``rng`` for its
    prompts and draws, ``jitter`` for its backoffs."""
    rng = np.random.default_rng([t.cfg.seed, n])
    jitter = random.Random(t.cfg.seed * 1000 + n)
    k = 0
    while time.monotonic() < arm.end:
        k += 1
        opened = await _open(t, arm, who, k, jitter)
        if opened is not None:
            yield rng, jitter, opened


async def honest_user(t: Tenants, arm: Arm, i: int) -> None:
    cfg = t.cfg
    async for rng, jitter, (ws, hello, welcome) in _sessions(t, arm, HONEST, i):
        try:
            prompt = rng.integers(4, welcome.fingerprint.vocab_size, cfg.honest_prompt).tolist()
            s = RawSession(ws, hello, welcome, rng, prompt, cfg.gamma)
            for k_round in range(cfg.rounds_per_session):
                if time.monotonic() >= arm.end or not s.room:
                    break
                sent, first = time.monotonic(), k_round == 0
                try:
                    n = await s.round(arm.drain_end - sent)
                except asyncio.TimeoutError:
                    waited = time.monotonic() - sent
                    arm.rounds.append(Round(i, sent - arm.t0, None, first, 0, waited))
                    return
                arm.rounds.append(Round(i, sent - arm.t0, time.monotonic() - sent, first, n))
        except Exception as e:  # counted: this is what the arm measures
            arm.failures.append(Failure(HONEST, arm.now(), _what(e)))
            await _backoff(arm, 1.0, jitter)
        finally:
            with contextlib.suppress(Exception):
                await ws.close()


async def attacker(t: Tenants, arm: Arm, j: int) -> None:
    cfg = t.cfg
    async for rng, jitter, (ws, hello, welcome) in _sessions(t, arm, ATTACKER, 10_000 + j):
        sent = time.monotonic()
        record = AttackPrompt(sent - arm.t0, t.attack_prompt, None)
        arm.attack.append(record)
        arm.attack_inflight += 1
        try:
            prompt = rng.integers(4, welcome.fingerprint.vocab_size, t.attack_prompt).tolist()
            s = RawSession(ws, hello, welcome, rng, prompt, cfg.gamma)
            with contextlib.suppress(asyncio.TimeoutError):  # the arm's end: abandoned
                await s.round(arm.end - sent)
                record.seconds = time.monotonic() - sent
        except Exception as e:
            arm.failures.append(Failure(ATTACKER, arm.now(), _what(e)))
            await _backoff(arm, 1.0, jitter)
        finally:
            arm.attack_inflight -= 1
            with contextlib.suppress(Exception):
                await ws.close()


async def probe_admission(t: Tenants, arm: Arm, k: int) -> None:
    """A new honest session asks to be admitted (Hello → Welcome or a refusal), then leaves."""
    at = arm.now()
    t_open = time.monotonic()
    try:
        ws, _, _ = await open_session(t.http, t.url, t.tokens[HONEST], 50_000 + k, 30.0)
    except Refused as r:
        arm.probes.append((at, r.code, time.monotonic() - t_open))
        refusal = Refusal(HONEST, at, r.code, r.retry_after, arm.attack_inflight, r.status, True)
        arm.refusals.append(refusal)
        return
    except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError, ValueError) as e:
        arm.probes.append((at, "no_welcome", time.monotonic() - t_open))
        arm.failures.append(Failure(HONEST, at, "admission probe: " + _what(e)))
        return
    arm.probes.append((at, "admitted", time.monotonic() - t_open))
    with contextlib.suppress(Exception):
        await ws.close()


async def prober(t: Tenants, arm: Arm) -> None:
    """An admission probe every ``probe_every_s`` until the arm's end, each on its own (a slow
    answer does not delay the next); returns when all have answered."""
    probes: list[asyncio.Future[None]] = []
    k = 0
    try:
        while t.cfg.probe_every_s > 0 and time.monotonic() < arm.end:
            k += 1
            probes.append(asyncio.ensure_future(probe_admission(t, arm, k)))
            await asyncio.sleep(min(t.cfg.probe_every_s, max(0.0, arm.end - time.monotonic())))
        await asyncio.gather(*probes)
    finally:
        for p in probes:
            p.cancel()
        await asyncio.gather(*probes, return_exceptions=True)


async def sampler(t: Tenants, arm: Arm, port: int) -> None:
    """The verifier's admission gauge and counters, every ``sample_s`` until cancelled."""
    while True:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            arm.sample(await scrape(t.http, port))
        await asyncio.sleep(t.cfg.sample_s)


def _metric_subset(m: dict[str, float]) -> dict[str, float]:
    out = {
        "queue_delay_s": m.get("wanspec_queue_delay_seconds", float("nan")),
        "forwards": m.get("wanspec_model_forwards_total", float("nan")),
        "fixed_tokens": m.get("wanspec_fixed_tokens_total", float("nan")),
        "sessions": m.get("wanspec_sessions_active", float("nan")),
    }
    for key, v in m.items():
        if key.startswith("wanspec_sessions_refused_total{"):
            out["refused:" + key.split('"')[1]] = v
    return out


async def run_arm(t: Tenants, name: str, attackers: int, port: int) -> Arm:
    cfg = t.cfg
    t0 = time.monotonic()
    arm = Arm(name, t0, t0 + cfg.duration_s, t0 + cfg.duration_s + cfg.drain_s)
    t.log(
        f"arm {name}: {cfg.honest} honest users, {attackers} attacker sessions, "
        f"{cfg.duration_s:g} s …"
    )
    arm.load.append(round(os.getloadavg()[0], 2))
    sample = asyncio.ensure_future(sampler(t, arm, port))
    users = [asyncio.ensure_future(honest_user(t, arm, i)) for i in range(cfg.honest)]
    users += [asyncio.ensure_future(attacker(t, arm, j)) for j in range(attackers)]
    users.append(asyncio.ensure_future(prober(t, arm)))
    try:
        await asyncio.wait_for(asyncio.gather(*users), cfg.duration_s + cfg.drain_s + 60.0)
    finally:
        for u in [*users, sample]:
            u.cancel()
        await asyncio.gather(*users, sample, return_exceptions=True)
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
        arm.sample(await scrape(t.http, port))
    arm.load.append(round(os.getloadavg()[0], 2))
    return arm


# ------------------------------------------------------------------------------ figures


def _ms(xs: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(np.asarray(xs) * 1000, q)), 1) if len(xs) else None


def _round_times(rounds: Sequence[Round]) -> list[float]:
    """Each round's time; an unfinished one counts what it had waited (a lower bound)."""
    return [r.seconds if r.seconds is not None else r.waited for r in rounds]


def _verdicts_in(rounds: Sequence[Round], duration: float) -> tuple[int, int]:
    """(Verdicts received within the arm, the tokens they committed)."""
    done = [r for r in rounds if r.seconds is not None and r.sent + r.seconds <= duration]
    return len(done), sum(r.committed for r in done)


def summarize(arm: Arm, cfg: TenantsConfig) -> dict[str, Any]:
    d = cfg.duration_s
    honest = [r for r in arm.rounds if r.sent <= d]
    verdicts, committed = _verdicts_in(honest, d)
    times = _round_times(honest)
    unfinished = sum(r.seconds is None for r in honest)
    refusals = [r for r in arm.refusals if r.tenant == HONEST]
    a_refusals = [r for r in arm.refusals if r.tenant == ATTACKER]
    answered = [p for p in arm.attack if p.seconds is not None]
    windows = max(1, math.ceil(d / cfg.bin_s))
    per_window = [0] * windows
    for r in honest:
        if r.seconds is not None and r.sent + r.seconds <= d:
            per_window[min(windows - 1, int((r.sent + r.seconds) // cfg.bin_s))] += 1
    qd = [s["queue_delay_s"] for s in arm.samples if not math.isnan(s["queue_delay_s"])]
    first_s = arm.samples[0] if arm.samples else {}
    last_s = arm.samples[-1] if arm.samples else {}
    refused_by_reason = {
        k.split(":", 1)[1]: int(v - first_s.get(k, 0.0))
        for k, v in last_s.items()
        if k.startswith("refused:") and v - first_s.get(k, 0.0) > 0
    }
    return {
        "honest": {
            "users": cfg.honest,
            "sessions_opened": arm.sessions_opened[HONEST],
            "verdicts": verdicts,
            "verdicts_per_s": round(verdicts / d, 3),
            "committed_tokens_per_s": round(committed / d, 3),
            "rounds": len(honest),
            "unfinished_rounds": unfinished,
            "p50_round_ms": _ms(times, 50),
            "p99_round_ms": _ms(times, 99),
            "p99_is_lower_bound": unfinished > 0.01 * max(1, len(honest)),
            "max_round_ms": _ms(times, 100),
            "round_ms_quantiles": {f"{q:g}": _ms(times, q) for q in QUANTILES} if times else {},
            "first_round_p50_ms": _ms(_round_times([r for r in honest if r.first]), 50),
            "first_round_p99_ms": _ms(_round_times([r for r in honest if r.first]), 99),
            "later_round_p99_ms": _ms(_round_times([r for r in honest if not r.first]), 99),
            "failures": len([f for f in arm.failures if f.tenant == HONEST]),
            "failure_list": [f.json() for f in arm.failures if f.tenant == HONEST][:20],
            "refusals": len(refusals),
            "refusals_while_attack_prefilling": sum(
                r.attack_prompts_in_flight > 0 for r in refusals
            ),
            "refusal_list": [r.json() for r in refusals][:50],
            "admission_probes": _probes(arm),
        },
        "attacker": {
            "sessions": cfg.attackers if arm.name == ARMS[1] else 0,
            "sessions_opened": arm.sessions_opened[ATTACKER],
            "prompts_sent": len(arm.attack),
            "prompts_answered": len(answered),
            "prompt_tokens_answered_per_s": round(sum(p.tokens for p in answered) / d, 2),
            "prompt_seconds_p50": (
                round(float(np.median([p.seconds for p in answered])), 2) if answered else None
            ),
            "refusals": len(a_refusals),
            "refusal_codes": sorted({r.code for r in a_refusals}),
            "failures": len([f for f in arm.failures if f.tenant == ATTACKER]),
            "failure_list": [f.json() for f in arm.failures if f.tenant == ATTACKER][:10],
        },
        "load_average": arm.load,
        "verifier": {
            "queue_delay_max_s": round(max(qd), 2) if qd else None,
            "forwards": int(last_s.get("forwards", 0) - first_s.get("forwards", 0)),
            "fixed_tokens": int(last_s.get("fixed_tokens", 0) - first_s.get("fixed_tokens", 0)),
            "refused_by_reason": refused_by_reason,
        },
        "timeline": {
            "window_s": cfg.bin_s,
            "honest_verdicts_per_s": [round(n / cfg.bin_s, 2) for n in per_window],
            "attack_prompts_in_flight": [[s["t"], int(s["attack_in_flight"])] for s in arm.samples],
            "queue_delay_s": [
                [s["t"], round(s["queue_delay_s"], 2)]
                for s in arm.samples
                if not math.isnan(s["queue_delay_s"])
            ],
            "honest_refusals_s": [round(r.at, 2) for r in refusals],
        },
    }


def _probes(arm: Arm) -> dict[str, Any]:
    waits = [w for _, what, w in arm.probes if what == "admitted"]
    return {
        "sent": len(arm.probes),
        "admitted": len(waits),
        "refused": sum(what not in ("admitted", "no_welcome") for _, what, _ in arm.probes),
        "no_welcome": sum(what == "no_welcome" for _, what, _ in arm.probes),
        "welcome_s_p50": round(float(np.median(waits)), 3) if waits else None,
        "welcome_s_max": round(max(waits), 3) if waits else None,
        "list": [[round(at, 2), what, round(w, 3)] for at, what, w in arm.probes][:500],
    }


def _per_user(arm: Arm, cfg: TenantsConfig) -> tuple[np.ndarray, list[np.ndarray]]:
    """Per honest user: Verdicts within the arm, and the round times (s) of its rounds."""
    d = cfg.duration_s
    verdicts = np.zeros(cfg.honest)
    times: list[list[float]] = [[] for _ in range(cfg.honest)]
    for r in arm.rounds:
        if r.sent > d:
            continue
        times[r.user].append(r.seconds if r.seconds is not None else r.waited)
        if r.seconds is not None and r.sent + r.seconds <= d:
            verdicts[r.user] += 1
    return verdicts, [np.asarray(t) for t in times]


def bootstrap_ratios(a: Arm, b: Arm, cfg: TenantsConfig) -> dict[str, Any]:
    """b / a of the honest goodput (Verdicts) and p99 round, each with a 95 % percentile
    bootstrap interval over honest users (each arm's users resampled with replacement)."""
    va, ta = _per_user(a, cfg)
    vb, tb = _per_user(b, cfg)
    rng = np.random.default_rng(cfg.seed + 38)

    def p99(times: list[np.ndarray], idx: np.ndarray) -> float:
        pooled = np.concatenate([times[i] for i in idx])
        return float(np.percentile(pooled, 99)) if pooled.size else math.nan

    def ratio(x: float, y: float) -> float:
        return x / y if y > 0 else math.nan

    all_a, all_b = np.arange(cfg.honest), np.arange(cfg.honest)
    goodput = ratio(vb.sum(), va.sum())
    p99r = ratio(p99(tb, all_b), p99(ta, all_a))
    g, p = [], []
    for _ in range(cfg.bootstrap):
        ia = rng.integers(0, cfg.honest, cfg.honest)
        ib = rng.integers(0, cfg.honest, cfg.honest)
        g.append(ratio(vb[ib].sum(), va[ia].sum()))
        p.append(ratio(p99(tb, ib), p99(ta, ia)))

    def ci(xs: list[float]) -> list[float | None]:
        arr = np.asarray([x for x in xs if not math.isnan(x)])
        if not arr.size:
            return [None, None]
        return [round(float(np.percentile(arr, 2.5)), 3), round(float(np.percentile(arr, 97.5)), 3)]

    return {
        "goodput": {"value": _round(goodput), "ci95": ci(g)},
        "p99_round": {"value": _round(p99r), "ci95": ci(p)},
        "interval": f"95 % percentile bootstrap over honest users ({cfg.honest} per arm, "
        f"resampled with replacement in each arm, {cfg.bootstrap} resamples)",
    }


def _round(x: float, digits: int = 3) -> float | None:
    return None if math.isnan(x) else round(float(x), digits)


def targets(ratios: dict[str, Any], arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    g, p = ratios["goodput"]["value"], ratios["p99_round"]["value"]
    failures = sum(arms[a]["honest"]["failures"] for a in ARMS)
    refusals = arms[ARMS[1]]["honest"]["refusals_while_attack_prefilling"]
    out: dict[str, Any] = {
        "goodput_ratio": {
            "target": ">= 0.8",
            "value": g,
            "ci95": ratios["goodput"]["ci95"],
            "met": g is not None and g >= 0.8,
        },
        "p99_round_ratio": {
            "target": "<= 2",
            "value": p,
            "ci95": ratios["p99_round"]["ci95"],
            "met": p is not None and p <= 2.0,
        },
        "honest_failures": {"target": "0 (both arms)", "value": failures, "met": failures == 0},
        "honest_refusals_while_prefilling": {
            "target": "0",
            "value": refusals,
            "met": refusals == 0,
        },
    }
    out["all_met"] = all(v["met"] for v in out.values())
    return out


# ------------------------------------------------------------------------------ the run


def _code() -> dict[str, Any]:
    """Which code ran: the commit, whether the verifier's code differs from it, and where the
    verifier package was imported from (the verifier process runs from the same tree)."""
    import cloud_verifier

    changed = git("status", "--porcelain", "--", "cloud_verifier", "shared", "edge_agent")
    return {
        "commit": git("rev-parse", "HEAD"),
        "commit_subject": git("log", "-1", "--format=%s")[:120],
        "verifier_code_uncommitted_changes": bool(changed),
        "tree": str(REPO),
        "cloud_verifier_imported_from": str(Path(cloud_verifier.__file__).parent),
    }


def _target_spec(cfg: TenantsConfig, workdir: Path) -> str:
    if cfg.model != "tiny":
        return cfg.model
    from testkit.tiny_models import build_tiny_model

    return str(build_tiny_model(workdir / "models" / "target", vocab_size=64, seed=0))


def _max_queue_delay(cfg: TenantsConfig) -> float | None:
    """The verifier's admission threshold in this run (its default unless set)."""
    if cfg.max_queue_delay is not None:
        return cfg.max_queue_delay
    try:
        from cloud_verifier.daemon.settings import VerifierSettings

        return float(VerifierSettings().max_queue_delay)
    except (ImportError, TypeError, AttributeError):
        return None


def kv_tokens(cfg: TenantsConfig, page: int = 16) -> int:
    """A pool holding every session's whole text at once, the attacker's within the default
    per-token share (module docstring)."""
    if cfg.kv_cache_tokens:
        return cfg.kv_cache_tokens
    margin = cfg.gamma + 1 + 2 * page
    attack = cfg.attackers * (cfg.attack_prompt + margin)
    honest = cfg.honest * (cfg.honest_prompt + cfg.rounds_per_session * (cfg.gamma + 1) + margin)
    try:
        from cloud_verifier.daemon.settings import VerifierSettings

        share = VerifierSettings().kv_token_share
    except (ImportError, TypeError, AttributeError):
        share = DEFAULT_TOKEN_SHARE
    need = max(attack + honest, attack / share, honest / share, 16384)
    return int(math.ceil(need / 1024) * 1024)


async def run(
    cfg: TenantsConfig, workdir: Path, log: Callable[[str], None] = print
) -> dict[str, Any]:
    t_start = time.monotonic()
    code = _code()
    log(
        f"verifier code: {code['cloud_verifier_imported_from']} at {code['commit'][:10]}"
        + (" (uncommitted changes)" if code["verifier_code_uncommitted_changes"] else "")
    )
    spec = await asyncio.to_thread(_target_spec, cfg, workdir)
    tokens = {HONEST: generate_token(), ATTACKER: generate_token()}
    token_file = write_tokens(workdir / "tokens", [tokens[HONEST], tokens[ATTACKER]])
    kv = kv_tokens(cfg)
    args = [
        "--device",
        "cpu",
        "--threads",
        str(cfg.threads),
        "--kv-cache-tokens",
        str(kv),
        "--log-level",
        "warning",
    ]
    if cfg.max_queue_delay is not None:
        args += ["--max-queue-delay", f"{cfg.max_queue_delay:g}"]
    verifier = VerifierProcess(
        spec,
        free_port(),
        token_file,
        args=args,
        log_path=workdir / "verifier.log",
        threads=cfg.threads,
    )
    verifier.start()
    arms: dict[str, Arm] = {}
    try:
        ready_s = await verifier.wait_ready(600)
        log(f"verifier ready in {ready_s:.1f} s (KV pool {kv} tokens)")
        async with aiohttp.ClientSession() as http:
            ws, _, welcome = await open_session(http, verifier.url, tokens[HONEST], 0, 60.0)
            await ws.close()
            fit = welcome.max_context - cfg.gamma - 1
            attack_prompt = min(cfg.attack_prompt, fit, welcome.max_fixed)
            if attack_prompt < cfg.attack_prompt:
                log(
                    f"attacker prompt: {attack_prompt} tokens, not {cfg.attack_prompt}: the "
                    f"verifier's max_context is {welcome.max_context} (γ = {cfg.gamma})"
                )
            t = Tenants(cfg, http, verifier.url, tokens, attack_prompt, log)
            # First use (allocations, the first forwards of each kind) is not measured.
            warm = Arm("warm-up", time.monotonic(), time.monotonic() + 1e9, time.monotonic() + 1e9)
            await _warm_up(t, warm)
            for name, n in zip(ARMS, (0, cfg.attackers), strict=True):
                if not await wait_idle(http, verifier.port, 120.0):
                    log(f"warning: sessions still open at the verifier before arm {name}")
                arms[name] = await run_arm(t, name, n, verifier.port)
                s = summarize(arms[name], cfg)
                h, a = s["honest"], s["attacker"]
                log(
                    f"arm {name}: honest {h['verdicts_per_s']} verdicts/s, "
                    f"{h['committed_tokens_per_s']} tok/s, p50 {h['p50_round_ms']} ms, "
                    f"p99 {h['p99_round_ms']} ms, unfinished {h['unfinished_rounds']}, "
                    f"failures {h['failures']}, refusals {h['refusals']}, admission probes "
                    f"{h['admission_probes']['admitted']}/{h['admission_probes']['sent']} "
                    f"admitted; attacker "
                    f"{a['prompts_answered']}/{a['prompts_sent']} prompts answered, "
                    f"refusals {a['refusals']}"
                )
            idle = await wait_idle(http, verifier.port, 60.0)
    finally:
        await verifier.stop()
    summaries = {name: summarize(arm, cfg) for name, arm in arms.items()}
    ratios = bootstrap_ratios(arms[ARMS[0]], arms[ARMS[1]], cfg)
    result = {
        "targets": targets(ratios, summaries),
        "ratios": ratios,
        "arms": summaries,
        "setup": {
            **code,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": cfg.model,
            "verifier": f"cloud-verifier serve --model {cfg.model} {' '.join(args)} "
            "(every other setting its default)",
            "max_context": welcome.max_context,
            "max_fixed": welcome.max_fixed,
            "vocab_size": welcome.fingerprint.vocab_size,
            "attack_prompt_tokens": attack_prompt,
            "attack_prompt_requested": cfg.attack_prompt,
            "attack_prompt_note": (
                "as requested"
                if attack_prompt == cfg.attack_prompt
                else f"cut to the verifier's max_context {welcome.max_context} − γ − 1"
            ),
            "kv_cache_tokens": kv,
            "honest_users": cfg.honest,
            "attacker_sessions": cfg.attackers,
            "honest_prompt_tokens": cfg.honest_prompt,
            "gamma": cfg.gamma,
            "rounds_per_session": cfg.rounds_per_session,
            "duration_s": cfg.duration_s,
            "drain_s": cfg.drain_s,
            "threads": cfg.threads,
            "max_queue_delay_s": cfg.max_queue_delay,
            "admission_max_queue_delay_s": _max_queue_delay(cfg),
            "drafts": "random ids, q log-uniform in [1e-7, 1e-3]; greedy target",
            "transport": "127.0.0.1, one connection per session (no WAN)",
            "order": "honest_only, then with_attacker, on one verifier process",
            "idle_after": idle,
            "smoke": cfg.smoke,
            "seed": cfg.seed,
            "host": {
                "machine": platform.machine(),
                "processor": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
            "seconds": round(time.monotonic() - t_start, 1),
        },
    }
    return result


async def _warm_up(t: Tenants, arm: Arm) -> None:
    """One honest session of a few rounds, and one long prompt (both unmeasured)."""
    ws, hello, welcome = await open_session(t.http, t.url, t.tokens[HONEST], 1, 60.0)
    try:
        rng = np.random.default_rng(12345)
        vocab = welcome.fingerprint.vocab_size
        prompt = rng.integers(4, vocab, min(512, t.attack_prompt // 2)).tolist()
        s = RawSession(ws, hello, welcome, rng, prompt, t.cfg.gamma)
        for _ in range(3):
            if s.room:
                await s.round(600.0)
    finally:
        await ws.close()


# ------------------------------------------------------------------------------ output


def report(result: dict[str, Any]) -> str:
    """The headline lines."""
    tg = result["targets"]
    lines = []
    for key in ("goodput_ratio", "p99_round_ratio"):
        v = tg[key]
        lines.append(
            f"{key}: {v['value']} (95 % CI {v['ci95'][0]}–{v['ci95'][1]}), "
            f"target {v['target']}: {'met' if v['met'] else 'NOT met'}"
        )
    for key in ("honest_failures", "honest_refusals_while_prefilling"):
        v = tg[key]
        lines.append(
            f"{key}: {v['value']}, target {v['target']}: {'met' if v['met'] else 'NOT met'}"
        )
    return "\n".join(lines)


def plot(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = result["arms"]
    s = result["setup"]
    colors = {ARMS[0]: "tab:blue", ARMS[1]: "tab:red"}
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, r in arms.items():
        tl = r["timeline"]
        v = tl["honest_verdicts_per_s"]
        x = [(k + 0.5) * tl["window_s"] for k in range(len(v))]
        a.plot(x, v, marker="o", color=colors[name], label=f"honest, {name}")
    a.set_ylim(bottom=0)
    a.set_xlabel("seconds into the arm")
    a.set_ylabel(f"honest Verdicts/s (windows of {arms[ARMS[0]]['timeline']['window_s']:g} s)")
    a.legend(loc="lower left")
    a.grid(alpha=0.3)
    for name, r in arms.items():
        q = r["honest"]["round_ms_quantiles"]
        qs = [float(k) for k in q]
        b.plot([q[k] for k in q], qs, marker=".", color=colors[name], label=name)
        h = r["honest"]
        b.annotate(
            f"p99 {h['p99_round_ms']} ms",
            (h["p99_round_ms"] or 1, 99),
            color=colors[name],
            fontsize=8,
            ha="right",
            va="bottom",
        )
    b.set_xscale("log")
    b.set_xlabel("honest round (ms), Propose → Verdict")
    b.set_ylabel("percentile")
    b.legend(loc="lower right")
    b.grid(alpha=0.3)
    att = arms[ARMS[1]]
    tl = att["timeline"]
    if tl["queue_delay_s"]:
        qx, qy = zip(*tl["queue_delay_s"], strict=True)
        c.plot(qx, qy, color="tab:purple", label="admission's queue delay (gauge)")
    probes = [(at, w) for at, what, w in att["honest"]["admission_probes"]["list"]
              if what == "admitted"]  # fmt: skip
    if probes:
        px, py = zip(*probes, strict=True)
        c.scatter(px, py, s=10, color="tab:green", label="admission probe: seconds to Welcome")
    limit = s.get("admission_max_queue_delay_s")
    if limit:
        c.axhline(limit, color="tab:purple", ls=":", label=f"max_queue_delay ({limit:g} s)")
    c2 = c.twinx()
    if tl["attack_prompts_in_flight"]:
        ix, iy = zip(*tl["attack_prompts_in_flight"], strict=True)
        c2.step(ix, iy, where="post", color="grey", alpha=0.6, label="attacker prompts in flight")
    c2.set_ylabel("attacker prompts in flight", color="grey")
    c2.set_ylim(bottom=0)
    for k, t_ in enumerate(tl["honest_refusals_s"]):
        c.axvline(
            t_, color="tab:red", alpha=0.4, lw=0.8, label="honest refusal" if k == 0 else None
        )
    c.set_xlabel("seconds into the arm with the attacker")
    c.set_ylabel("queue delay (s)")
    c.set_ylim(bottom=0)
    h1, l1 = c.get_legend_handles_labels()
    h2, l2 = c2.get_legend_handles_labels()
    c.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    c.grid(alpha=0.3)
    tg = result["targets"]
    g, p = tg["goodput_ratio"], tg["p99_round_ratio"]
    fig.suptitle(
        f"tenants: {s['model']} ({s['host']['cpus']} CPUs, "
        f"{s['threads']} thread), {s['honest_users']} honest users beside "
        f"{s['attacker_sessions']} attacker sessions × {s['attack_prompt_tokens']}-token "
        f"prompts; goodput ×{g['value']} ({'met' if g['met'] else 'not met'}), "
        f"p99 ×{p['value']} ({'met' if p['met'] else 'not met'}); commit {s['commit'][:8]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: The settings a command line may give (``smoke`` is the preset's own).
FIELDS = frozenset(f.name for f in dataclasses.fields(TenantsConfig)) - {"smoke"}


def config(smoke: bool, given: dict[str, Any]) -> TenantsConfig:
    """The preset (``smoke``: tiny model, seconds) with the given settings over it."""
    cfg = dataclasses.replace(TenantsConfig(), **SMOKE, smoke=True) if smoke else TenantsConfig()
    return dataclasses.replace(cfg, **{k: v for k, v in given.items() if k in FIELDS})


def build_parser() -> argparse.ArgumentParser:
    p = study_parser("tenants", __doc__)
    # None: the preset's value (--smoke, or TenantsConfig's default)
    add_verifier_run(p, "--smoke", "tiny model, < 60 s", TenantsConfig.out)
    add = p.add_argument
    add("--honest", type=int, help="honest users (16)")
    add("--attackers", type=int, help="the attacker's sessions (8)")
    add("--attack-prompt", type=int, help="tokens per attacker prompt (8000)")
    add("--honest-prompt", type=int, help="tokens per honest prompt (128)")
    add("--gamma", type=int, help="draft tokens per round (8)")
    add("--rounds-per-session", type=int, help="honest rounds per session (32)")
    add("--duration", type=float, dest="duration_s", help="seconds per arm (120)")
    add("--drain", type=float, dest="drain_s", help="for rounds in flight (60)")
    add("--kv-cache-tokens", type=int, help="the verifier's KV pool (0: sized)")
    add("--bootstrap", type=int, help="resamples for the ratios' intervals (2000)")
    return p


def config_from_args(args: argparse.Namespace) -> TenantsConfig:
    """The settings: the preset (``--smoke`` or not) with the given ones over it."""
    given = {k: v for k, v in vars(args).items() if v is not None and v is not False}
    return config(args.smoke, given)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    result = record_study("wanspec-tenants-", args, cfg, run, cfg.out, plot)
    print(report(result))
    print(f"wrote {cfg.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
