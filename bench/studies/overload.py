"""Offered load against one verifier: goodput, failures and recovery as concurrent sessions grow.

    python -m bench overload                             # default model, this CPU (~6 min)
    python -m bench overload --quick --out /tmp/o.json   # tiny models, a smoke run (~25 s)

One tenant's long prompts beside honest sessions are the tenants study's
(:mod:`bench.studies.tenants`, ``python -m bench tenants``).

Setup. One verifier process (``python -m bench.net.verifier``: the product's ``cloud-verifier
serve`` with, if ``--verify-ms`` > 0, every forward padded to that time) behind the WAN emulator
(:mod:`testkit.net.wanem`: ``--rtt-ms``, ``--bandwidth-mbit``). The edges run here, each an
:class:`~edge_agent.runtime.agent.EdgeAgent` with its own worker thread, the product's retry policy
and
an oracle draft (:mod:`bench.lib.oracle`: the target's greedy token with probability ``--alpha``)
whose every step is padded to ``--draft-ms`` (24 ms: PicoSpec's Llama-3.2-1B step on a Jetson,
the draft time of :mod:`bench.studies.realtime`'s ``picospec`` regime). The edges thus cost this
machine almost nothing, and what saturates is the verifier: by default the real default model on
this CPU (``--verify-ms 0``: its forwards take what they take, ~0.1 s for a round, ~0.7 s for a
130-token prefill on one core). Prompts: everyday chat questions (:data:`CHAT_PROMPTS`, 106–268
tokens with the default model's chat template), greedy, ``--tokens`` new tokens each.

The verifier serves ``--max-sessions`` (4) sessions at once; the others wait in its admission
line (bounded by ``admission_queue``, told their place by Progress frames) until a slot frees.
The offered load is read against it: ``offered_x`` = N / max_sessions, so the default sweep
offers 0.25× to 4× what the verifier serves at once.

For each offered load N (``--sessions``): N users, each starting a new generation as soon as its
previous one ends (a failed one after a second), for ``--window`` seconds; then arrivals stop
and the generations under way finish. Per N (``loads``):

* ``completed`` / ``failed``: generations that returned / raised (or ran past ``--gen-timeout``);
* ``goodput_tokens_per_s``: tokens of completed generations / (window start → last one done);
* ``p99_round_ms`` (and ``p50_round_ms``): Propose sent → its Verdict received, at the edges (a
  tap on each edge's transport decodes the frames), over every round of the level, WAN included;
* ``admission_wait_ms_p50`` / ``_p99``: the time each completed generation's session waited in
  the verifier's admission line (the edge's ``admission_wait_s``: Progress frames before the
  Welcome), beside ``line_max`` / ``line_mean``, the line's length (the verifier's
  ``wanspec_admission_waiting``, read every 0.25 s) and ``queued_sessions`` (sessions that
  waited at all);
* ``recovery_s``: from the end of the window, when the first probe session started whose median
  round was within ``--recovery-factor`` (1.5) × the unloaded one. A probe is a
  :class:`testkit.probe.Driver` session through the emulator: the probe prompt's prefill, then
  ``--probe-rounds`` stop-and-wait rounds of γ = 4 random drafts; the unloaded level is the
  same probe before the sweep. Probes run back to back from the window's end, while the last
  generations drain (a probe refused as overloaded counts as not recovered); null if none
  qualified within ``--recovery-timeout``.

Reconnect cost (``reconnect``): a generation of the longest prompt is cut mid-way (the emulator
resets every connection once ``--drop-after`` tokens are committed). Measured per trial: the time
from the cut to the next Verdict, and the prompt tokens the verifier ran again (the cut run's
``wanspec_fixed_tokens_total`` minus that of the same run uncut). ``with_resume``: the product as
it is (the edge resumes its session if the verifier's Welcome offered a resume token);
``without_resume``: the tap removes the resume token from every Welcome, so every reconnect is a
new session, as against a verifier that keeps no lost session (``resume_grace = 0``).
``resumption_offered`` says whether the verifier offered any token at all (if not, the two are
the same measurement).

Writes ``--out`` (``docs/results/overload.json``): ``setup`` (every emulated timing and where it
comes from), ``unloaded``, ``loads`` (one object per N: ``offered_sessions``, ``completed``,
``failed``, ``goodput_tokens_per_s``, ``p99_round_ms``, ``recovery_s``, ...), ``saturation``
(every load's goodput against the sweep's peak, the least of them past the peak's load, and
the failures of the loads whose admission line had room) and ``reconnect``; and a plot beside
it (``.png``): goodput (y from zero) and failures against offered load; p99 round time and
recovery time; p99 admission wait beside the line's length.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.lib.cli import add_verifier_run, study_parser
from bench.lib.edge import TimedDrafter
from bench.lib.modes import parse_mode
from bench.lib.oracle import GreedyPaths, OracleDrafter
from bench.lib.verifier_state import delta, scrape, wait_idle
from cloud_verifier.daemon.settings import VerifierSettings
from edge_agent.link.connection import LinkSettings, WebSocketTransport
from edge_agent.runtime.agent import AgentEvent, EdgeAgent
from edge_agent.runtime.service import retry_policy
from edge_agent.runtime.settings import EdgeSettings
from edge_agent.session.events import Committed
from edge_agent.session.opening import wire_context
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.transport import Transport
from shared.maths.sampling import SamplingParams
from shared.runtime.models import LoadedModel
from shared.wire.codec import decode, encode
from shared.wire.messages import SUBPROTOCOL, Fingerprint, Hello, Propose, Verdict, Welcome
from shared.wire.packing import ProtocolError, WireContext
from testkit.harness import (
    REPO,
    VerifierProcess,
    free_port,
    record_study,
    tiny_pair,
    write_tokens,
)
from testkit.net.stream_ws import StreamWS
from testkit.net.wanem import LinkConfig, WanEmulator
from testkit.probe import Driver, ProbeClient, auth_headers

#: Everyday chat questions: 106–268 tokens each with the default model's chat template.
CHAT_PROMPTS: tuple[str, ...] = (
    "I'm planning a small dinner party for six friends this Saturday. Two of them are "
    "vegetarian, one is allergic to nuts, and I only have about three hours to cook after "
    "work. I have a medium-sized kitchen with one oven and four burners, and my budget is "
    "around sixty dollars for everything. Could you suggest a simple three-course menu that "
    "works for everyone, and give me a rough order in which to prepare the dishes so that "
    "everything is ready at the same time? Please keep it practical.",
    "My manager asked me to write a short email to the whole team announcing that our weekly "
    "status meeting is moving from Monday morning to Tuesday afternoon, starting next month. "
    "Some people have complained that Monday mornings are too rushed, and a few others work "
    "part-time and are never in on Tuesdays, so they will need to send their updates in "
    "writing instead. Can you draft a friendly, clear email that explains the change, the "
    "reason for it, and what the part-time staff should do?",
    "I started running three weeks ago. I can now run for about twenty minutes without "
    "stopping, but my knees feel sore the day after, especially when I go downhill. I run "
    "three times a week on pavement in old shoes I bought five years ago. I would like to "
    "run a 10 km race in two months. What should I change in my routine, and is the soreness "
    "something to worry about? I don't want to get injured before the race.",
    "We are a family of four going on a road trip next summer: two adults, a nine-year-old "
    "who gets car sick, and a teenager who is bored by museums. We have ten days, one car, "
    "and we want to see some mountains and a lake, but we don't want to drive more than four "
    "hours on any single day. We will be staying in cheap motels or campsites. Can you help "
    "me think through how to plan the route and what to pack to keep everyone happy? Last "
    "year we tried something similar and it went badly: we left too late every morning, the "
    "kids argued about music for hours, we ran out of snacks in places with no shops, and we "
    "spent one night looking for a campsite in the dark because the one we had picked was "
    "full. My partner would also like at least one day with no driving at all, somewhere "
    "with a short hike and a place to swim. We have a small cooler, a tent for four, two "
    "sleeping bags that are a bit old, and a roof box that we can borrow from a friend. "
    "How much should we plan for food, fuel and campsites each day, roughly?",
    "My apartment gets very hot in the afternoon because the living room windows face west, "
    "and I don't have air conditioning. The landlord won't let me install anything on the "
    "outside of the building. I work from home, so I'm there all day with my laptop and a "
    "second monitor, which make it even warmer. What are some cheap ways to keep the room "
    "cooler during the summer months?",
    "I've been asked to give a ten-minute talk at my cousin's wedding. I'm not a confident "
    "public speaker, and I've known my cousin since we were kids, so I have lots of stories, "
    "but some of them are a bit embarrassing. The guests will include her new husband's "
    "grandparents, who are quite formal, and a lot of our old school friends. How should I "
    "structure the speech, and how do I choose which stories to tell? Any tips for calming "
    "my nerves on the day would also help. I was thinking of opening with the story of the "
    "summer we built a raft that sank in the lake, then talking about how she helped me when "
    "I moved to a new city, and ending with a toast. But I'm worried that the raft story "
    "only makes sense to people who were there, and that the middle part might sound more "
    "about me than about her. I also don't know whether I should mention her late father, "
    "who would have loved to be there; I don't want to make anyone cry in the middle of the "
    "party, but leaving him out entirely feels wrong too. How long should each part be?",
    "I want to start saving money but I always seem to run out before the end of the month. "
    "I earn a regular salary, pay rent, have a car loan, and spend quite a lot on takeaway "
    "food and subscriptions I rarely use. Could you explain a simple budgeting method that a "
    "beginner can actually stick to, and suggest a few first steps I could take this week?",
    "My elderly neighbour has asked me to help her set up a new smartphone so she can make "
    "video calls with her grandchildren who live abroad. She has never used a touchscreen "
    "before, her eyesight is not great, and she gets frustrated when things change on the "
    "screen unexpectedly. What settings should I change to make the phone easier for her to "
    "use, and how can I teach her the basics in a way that won't overwhelm her?",
)

#: Where the emulated timings come from (the ``setup`` object of the output).
SOURCES = {
    "draft_ms": "PicoSpec's Llama-3.2-1B draft step on a Jetson "
    "(bench/studies/realtime.py, regime picospec)",
    "verify_ms": "0: the target's real forwards on this CPU (the verifier's own capacity); "
    "> 0: every forward padded to at least that (bench/net/verifier.py PaddedTarget)",
    "rtt_ms": "an edge on a WAN (testkit/net/wanem.py emulator, jitter 0)",
    "retry": "the product's edge defaults (edge_agent.runtime.service: retry_policy)",
}


# ------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class OverloadConfig:
    out: Path = Path("docs/results/overload.json")
    model: str = "default"  # the target: a model spec, or "tiny" (testkit.harness.tiny_pair)
    sessions: tuple[int, ...] = (1, 2, 4, 8, 12, 16)
    #: The verifier's session slots: what it serves at once, the rest wait in its admission
    #: line. The offered load is read against it (``offered_x`` = sessions / max_sessions).
    max_sessions: int = 4
    admission_queue: int | None = None  # the verifier's setting (None: its default)
    window_s: float = 30.0
    tokens: int = 24
    mode: str = "pipe:4x2:nocogen"  # bench.lib.modes.parse_mode
    alpha: float = 0.75
    draft_ms: float = 24.0
    verify_ms: float = 0.0
    rtt_ms: float = 50.0
    bandwidth_mbit: float = 10.0
    threads: int = 1  # the verifier's torch threads
    max_queue_delay: float | None = None  # the verifier's setting (None: its default)
    gen_timeout_s: float = 300.0
    recovery_factor: float = 1.5
    recovery_timeout_s: float = 120.0
    probe_rounds: int = 8
    reconnect: str = "both"  # both, with, without, off
    reconnect_trials: int = 3
    reconnect_tokens: int = 48
    drop_after: int = 12
    quick: bool = False
    seed: int = 0


QUICK: dict[str, Any] = {
    "model": "tiny",
    "sessions": (1, 3),
    "max_sessions": 2,
    "window_s": 3.0,
    "tokens": 12,
    "draft_ms": 2.0,
    "verify_ms": 20.0,
    "rtt_ms": 10.0,
    "gen_timeout_s": 60.0,
    "recovery_timeout_s": 20.0,
    "probe_rounds": 4,
    "reconnect_trials": 1,
    "reconnect_tokens": 16,
    "drop_after": 4,
}


# ------------------------------------------------------------------------------ the verifier


class PaddedVerifierProcess(VerifierProcess):
    """``python -m bench.net.verifier`` (forwards padded to ``pad_ms``; 0: not padded) as a child
    process, with ``env`` added to its environment; readiness, stop and memory are
    :class:`~testkit.harness.VerifierProcess`'s."""

    def __init__(
        self,
        model: str,
        port: int,
        token_file: Path,
        *,
        pad_ms: float,
        env: Mapping[str, str] | None = None,
        args: Sequence[str] = (),
        log_path: Path | None = None,
        threads: int = 1,
    ) -> None:
        super().__init__(model, port, token_file, args=args, log_path=log_path, threads=threads)
        self.pad_ms = pad_ms
        self.env = dict(env or {})

    def start(self) -> None:
        if self.alive():
            raise RuntimeError("verifier already running")
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), HF_HUB_OFFLINE="1")
        env.pop("WANSPEC_CONFIG", None)
        env.update(self.env)
        cmd = [
            sys.executable, "-m", "bench.net.verifier", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--token-file", str(self.token_file), "--emulate-verify-ms", f"{self.pad_ms:g}",
            *self.args,
        ]  # fmt: skip
        log = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=log if log is not None else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        finally:
            if log is not None:
                log.close()  # the child holds its own descriptor
        self.starts += 1


# ------------------------------------------------------------------------------ the edge's tap


class Tap:
    """What the edges' transports carried, timed (``time.monotonic()``): every round (a Propose
    sent → its Verdict received), every Verdict's arrival, every Welcome. With
    ``strip_resume`` the resume token is taken out of each Welcome before the edge sees it."""

    def __init__(self, *, strip_resume: bool = False) -> None:
        self.strip_resume = strip_resume
        self.rounds: list[float] = []
        self.verdicts: list[float] = []
        self.welcomes: list[Welcome] = []
        self.resume_offered = 0  # Welcomes that carried a resume token (before any strip)
        self.undecoded = 0

    def wrap(self, inner: Transport) -> Transport:
        return _Tapped(inner, self)


class _Tapped:
    """One session's transport under a :class:`Tap`."""

    def __init__(self, inner: Transport, tap: Tap) -> None:
        self.inner = inner
        self.tap = tap
        self.hello: Hello | None = None
        self.ctx: WireContext | None = None
        self.sent: dict[tuple[int, int], float] = {}

    def _decode(self, data: bytes) -> object:
        try:
            return decode(data, self.ctx)
        except ProtocolError:
            self.tap.undecoded += 1
            return None

    async def send(self, data: bytes) -> None:
        msg = self._decode(data)
        if isinstance(msg, Hello):
            self.hello = msg
        elif isinstance(msg, Propose):
            self.sent[(msg.epoch, msg.seq)] = time.monotonic()
        await self.inner.send(data)

    async def recv(self) -> bytes:
        data = await self.inner.recv()
        now = time.monotonic()
        msg = self._decode(data)
        if isinstance(msg, Verdict):
            self.tap.verdicts.append(now)
            sent = self.sent.pop((msg.epoch, msg.seq), None)
            if sent is not None:
                self.tap.rounds.append(now - sent)
        elif isinstance(msg, Welcome):
            token = getattr(msg, "resume", None)
            if token:
                self.tap.resume_offered += 1
                if self.tap.strip_resume:
                    msg = dataclasses.replace(msg, resume=None)
                    data = encode(msg)
            self.tap.welcomes.append(msg)
            if self.hello is not None:
                self.ctx = wire_context(self.hello, msg)
        return data

    async def close(self) -> None:
        await self.inner.close()


# ------------------------------------------------------------------------------ the run


@dataclass
class Bench:
    """Everything a level needs: the verifier, the emulator, the models and the prompts."""

    cfg: OverloadConfig
    pcfg: PipelineConfig
    target: LoadedModel
    prompts: list[list[int]]
    eos: list[int]
    paths: GreedyPaths
    verifier: VerifierProcess
    emu: WanEmulator
    token: str
    http: aiohttp.ClientSession
    unloaded_round_s: float = 0.0
    log: Callable[[str], None] = print

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.emu.port}/v1/session"

    @property
    def fingerprint(self) -> Fingerprint:
        return self.target.fingerprint

    def agent(self, tap: Tap, seed: int) -> tuple[EdgeAgent, OracleDrafter]:
        """An edge with the product's retry policy and its own oracle draft, through ``tap``."""
        link = LinkSettings(url=self.url, token=self.token, heartbeat_s=EdgeSettings.heartbeat)

        async def connect() -> Transport:
            return tap.wrap(await WebSocketTransport.connect(link))

        oracle = OracleDrafter(self.paths.paths, self.target.vocab_size, self.cfg.alpha, seed=seed)
        drafter = TimedDrafter(oracle, self.cfg.draft_ms / 1000)
        retry = retry_policy(EdgeSettings(verifier=self.url))
        return EdgeAgent(drafter, self.fingerprint, connect, retry=retry), oracle

    async def metrics(self) -> dict[str, float]:
        return await scrape(self.http, self.verifier.port)


@dataclass
class GenRecord:
    ok: bool
    tokens: int
    started: float
    ended: float
    reconnects: int = 0
    busy_refusals: int = 0
    admission_wait_s: float = 0.0
    on_path: bool = True
    error: str | None = None


async def probe_round_s(
    http: aiohttp.ClientSession,
    url: str,
    token: str,
    fingerprint: Fingerprint,
    prompt: Sequence[int],
    *,
    rounds: int,
    seed: int,
    gamma: int = 4,
) -> float:
    """Median round trip (s) of a probe session at ``url``: the prompt's prefill (not counted),
    then ``rounds`` stop-and-wait rounds of ``gamma`` random drafts, greedy
    (:class:`testkit.probe.Driver`). Raises if the verifier refuses the session."""
    ws = StreamWS(await http.ws_connect(url, protocols=(SUBPROTOCOL,), headers=auth_headers(token)))
    try:
        client = ProbeClient(ws)
        await client.hello(Hello(fingerprint=fingerprint, sampling=SamplingParams(0.0), seed=seed))
        driver = Driver(client, fingerprint.vocab_size, gamma, np.random.default_rng(seed))
        driver.fixed = list(prompt)
        await driver.round()  # the prefill
        times = []
        for _ in range(rounds):
            await driver.round()
            times.append(driver.last_round_trip_s)
        return statistics.median(times)
    finally:
        await ws.close()


async def probe_once(b: Bench, seed: int) -> float:
    """:func:`probe_round_s` through the emulator, with the probe prompt (prompt 0)."""
    return await probe_round_s(
        b.http, b.url, b.token, b.fingerprint, b.prompts[0], rounds=b.cfg.probe_rounds, seed=seed
    )


async def recovery(b: Bench, since: float) -> tuple[float | None, list[list[float]]]:
    """Probes back to back from ``since``: (start of the first within the recovery factor of the
    unloaded round, or None; [[start − since, median round ms or -1 when refused]])."""
    deadline = since + b.cfg.recovery_timeout_s
    samples: list[list[float]] = []
    k = 0
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        k += 1
        try:
            med = await asyncio.wait_for(probe_once(b, 10_000 + k), max(1.0, deadline - t0))
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, RuntimeError):
            samples.append([round(t0 - since, 2), -1.0])
            await asyncio.sleep(0.5)
            continue
        samples.append([round(t0 - since, 2), round(med * 1000, 1)])
        if med <= b.cfg.recovery_factor * b.unloaded_round_s:
            return t0 - since, samples
    return None, samples


def _pct(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs) * 1000, q)) if xs else None


def _r(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


async def run_level(b: Bench, n: int) -> dict[str, Any]:
    cfg = b.cfg
    tap = Tap()
    records: list[GenRecord] = []
    m0 = await b.metrics()
    t0 = time.monotonic()
    window_end = t0 + cfg.window_s

    async def user(i: int) -> None:
        agent, oracle = b.agent(tap, cfg.seed + i)
        k = i
        try:
            while time.monotonic() < window_end:
                prompt = b.prompts[k % len(b.prompts)]
                k += n
                started = time.monotonic()
                try:
                    gen = await asyncio.wait_for(
                        agent.generate(
                            prompt, b.pcfg, max_tokens=cfg.tokens, eos_ids=b.eos, seed=k
                        ),
                        cfg.gen_timeout_s,
                    )
                except Exception as e:  # counted: this is what the level measures
                    err = f"{type(e).__name__}: {e}"[:300]
                    records.append(GenRecord(False, 0, started, time.monotonic(), error=err))
                    await asyncio.sleep(min(1.0, max(0.0, window_end - time.monotonic())))
                    continue
                st = gen.stats
                records.append(
                    GenRecord(
                        True,
                        len(gen.generated),
                        started,
                        time.monotonic(),
                        reconnects=st.reconnects,
                        busy_refusals=int(getattr(st, "busy_refusals", 0)),
                        admission_wait_s=st.admission_wait_s,
                        on_path=oracle.on_path(prompt, gen.generated),
                    )
                )
        finally:
            agent.close()

    line: list[float] = []  # the verifier's admission line, sampled while users are on

    async def watch_line() -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                line.append((await b.metrics()).get(LINE_GAUGE, 0.0))
            await asyncio.sleep(LINE_SAMPLE_S)

    users = [asyncio.ensure_future(user(i)) for i in range(n)]
    watcher = asyncio.ensure_future(watch_line())
    try:
        await asyncio.sleep(max(0.0, window_end - time.monotonic()))
        recovered, samples = await recovery(b, window_end)
        await asyncio.gather(*users)
    finally:
        for task in (*users, watcher):
            task.cancel()
        await asyncio.gather(*users, watcher, return_exceptions=True)
    m1 = await b.metrics()
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    last = max((r.ended for r in records), default=time.monotonic())
    wall = last - t0
    gen_s = [r.ended - r.started for r in done]
    refused = delta(m1, m0, 'wanspec_sessions_refused_total{reason="overloaded"}')
    waits = [r.admission_wait_s for r in done]
    row = {
        "offered_sessions": n,
        "offered_x": round(n / cfg.max_sessions, 2),
        "completed": len(done),
        "failed": len(failed),
        "goodput_tokens_per_s": round(sum(r.tokens for r in done) / wall, 2) if wall > 0 else 0.0,
        "p99_round_ms": _r(_pct(tap.rounds, 99)),
        "recovery_s": _r(recovered, 2),
        "p50_round_ms": _r(_pct(tap.rounds, 50)),
        "rounds": len(tap.rounds),
        "wall_s": round(wall, 2),
        "generation_s_p50": _r(float(np.percentile(gen_s, 50)) if gen_s else None, 2),
        "generation_s_max": _r(max(gen_s) if gen_s else None, 2),
        "reconnects": sum(r.reconnects for r in done),
        "busy_refusals": sum(r.busy_refusals for r in done),
        "queued_sessions": int(delta(m1, m0, "wanspec_sessions_queued_total")),
        "admission_wait_ms_p50": _r(_pct(waits, 50)),
        "admission_wait_ms_p99": _r(_pct(waits, 99)),
        "line_max": int(max(line, default=0.0)),
        "line_mean": _r(statistics.fmean(line) if line else 0.0, 2),
        "refused_overloaded": int(refused),
        "resumed_sessions": int(delta(m1, m0, "wanspec_sessions_resumed_total")),
        "fixed_tokens": int(delta(m1, m0, "wanspec_fixed_tokens_total")),
        "off_path": sum(not r.on_path for r in done),
        "recovery_probes": samples,
        "errors": sorted({r.error for r in failed if r.error})[:5],
    }
    b.log(
        f"N={n:3d}  completed {row['completed']:4d}  failed {row['failed']:3d}  "
        f"goodput {row['goodput_tokens_per_s']:7.2f} tok/s  p99 round {row['p99_round_ms']} ms  "
        f"recovery {row['recovery_s']} s  refused {row['refused_overloaded']}  "
        f"p99 admission wait {row['admission_wait_ms_p99']} ms  line max {row['line_max']}"
    )
    if not await wait_idle(b.http, b.verifier.port, 60.0):
        b.log(f"warning: sessions still open at the verifier 60 s after level N={n}")
    return row


async def one_cut(
    b: Bench, prompt: list[int], *, strip: bool, drop_after: int | None, seed: int
) -> dict[str, Any]:
    """One generation of ``prompt``; with ``drop_after``, every connection is reset once that
    many tokens are committed."""
    tap = Tap(strip_resume=strip)
    agent, _ = b.agent(tap, seed)
    state: dict[str, float] = {}
    committed = 0

    def on_event(ev: AgentEvent) -> None:
        nonlocal committed
        if not isinstance(ev, Committed):
            return
        committed += len(ev.ids)
        if drop_after is not None and "drop" not in state and committed >= drop_after:
            state["drop"] = time.monotonic()
            state["committed"] = committed
            b.emu.drop_all()

    m0 = await b.metrics()
    try:
        gen = await asyncio.wait_for(
            agent.generate(
                prompt,
                b.pcfg,
                max_tokens=b.cfg.reconnect_tokens,
                eos_ids=b.eos,
                seed=seed,
                on_event=on_event,
            ),
            b.cfg.gen_timeout_s,
        )
    finally:
        agent.close()
    m1 = await b.metrics()
    out: dict[str, Any] = {
        "generated": gen.generated,
        "fixed_tokens": delta(m1, m0, "wanspec_fixed_tokens_total"),
        "resumed_sessions": delta(m1, m0, "wanspec_sessions_resumed_total"),
        "reconnects": gen.stats.reconnects,
        "resume_offered": tap.resume_offered,
        "welcomes_resumed": sum(getattr(w, "resumed", None) is not None for w in tap.welcomes),
    }
    if "drop" in state:
        after = [t for t in tap.verdicts if t > state["drop"]]
        out["drop_to_verdict_s"] = after[0] - state["drop"] if after else None
        out["committed_at_drop"] = int(state["committed"])
    return out


async def reconnect_cost(b: Bench, strip: bool) -> dict[str, Any]:
    cfg = b.cfg
    prompt = max(b.prompts, key=len)
    ref = await one_cut(b, prompt, strip=strip, drop_after=None, seed=1)
    trials = []
    for t in range(cfg.reconnect_trials):
        await wait_idle(b.http, b.verifier.port, 30.0)
        r = await one_cut(b, prompt, strip=strip, drop_after=cfg.drop_after, seed=1)
        r["reprefilled_tokens"] = r["fixed_tokens"] - ref["fixed_tokens"]
        r["text_unchanged"] = r["generated"] == ref["generated"]
        trials.append(r)
        b.log(
            f"reconnect ({'without' if strip else 'with'} resume) trial {t + 1}: "
            f"drop → verdict {r.get('drop_to_verdict_s')} s, "
            f"re-prefilled {r['reprefilled_tokens']:.0f} tokens, "
            f"resumed {r['welcomes_resumed']}, text unchanged {r['text_unchanged']}"
        )
    times = [r["drop_to_verdict_s"] for r in trials if r.get("drop_to_verdict_s") is not None]
    return {
        "trials": len(trials),
        "drop_to_verdict_s": _r(statistics.median(times), 3) if times else None,
        "drop_to_verdict_s_all": [_r(x, 3) for x in times],
        "reprefilled_tokens": statistics.median(r["reprefilled_tokens"] for r in trials),
        "reprefilled_tokens_all": [r["reprefilled_tokens"] for r in trials],
        "committed_at_drop": [r.get("committed_at_drop") for r in trials],
        "reconnects": [r["reconnects"] for r in trials],
        "resumed_sessions": sum(int(r["resumed_sessions"]) for r in trials),
        "text_unchanged": all(r["text_unchanged"] for r in trials),
        "resume_offered": sum(r["resume_offered"] for r in trials) > 0,
    }


# ------------------------------------------------------------------------------ set-up


def _workload(cfg: OverloadConfig, workdir: Path) -> tuple[str, LoadedModel, list[list[int]]]:
    """(the verifier's --model, the target loaded here, the prompts' ids)."""
    from edge_agent.runtime.text import encode_prompt
    from shared.runtime.models import load_model

    if cfg.model == "tiny":
        pair = tiny_pair(workdir / "models")
        rng = random.Random(cfg.seed)
        prompts = [
            [1] + [rng.randrange(4, pair.target.vocab_size) for _ in range(rng.randint(20, 60))]
            for _ in range(8)
        ]
        return str(pair.target_dir), pair.target, prompts
    target = load_model(cfg.model)
    chat = bool(getattr(target.tokenizer, "chat_template", None))
    return cfg.model, target, [encode_prompt(target, p, chat=chat) for p in CHAT_PROMPTS]


async def run(
    cfg: OverloadConfig, workdir: Path, log: Callable[[str], None] = print
) -> dict[str, Any]:
    from edge_agent.runtime.text import eos_ids

    t_start = time.monotonic()
    admission_queue = (
        VerifierSettings.admission_queue if cfg.admission_queue is None else cfg.admission_queue
    )
    spec, target, prompts = await asyncio.to_thread(_workload, cfg, workdir)
    eos = [] if cfg.model == "tiny" else eos_ids(target)
    token = "overload-" + os.urandom(12).hex()
    tokens_file = write_tokens(workdir / "tokens", [token])
    kv = max(16384, 2 * max(cfg.sessions) * (max(map(len, prompts)) + cfg.reconnect_tokens + 64))
    env = {}
    if cfg.max_queue_delay is not None:
        env["WANSPEC_MAX_QUEUE_DELAY"] = f"{cfg.max_queue_delay:g}"
    if cfg.admission_queue is not None:
        env["WANSPEC_ADMISSION_QUEUE"] = str(cfg.admission_queue)
    verifier = PaddedVerifierProcess(
        spec,
        free_port(),
        tokens_file,
        pad_ms=cfg.verify_ms,
        env=env,
        args=["--device", "cpu", "--kv-cache-tokens", str(kv), "--max-sessions-per-token", "0",
              "--max-sessions", str(cfg.max_sessions), "--log-level", "warning"],
        log_path=workdir / "verifier.log",
        threads=cfg.threads,
    )  # fmt: skip
    verifier.start()
    try:
        log(f"computing the target's greedy paths of {len(prompts)} prompts …")
        paths = GreedyPaths(target, max(cfg.tokens, cfg.reconnect_tokens), eos)
        for p in prompts:
            await asyncio.to_thread(paths.add, p)
        await verifier.wait_ready(600)
        link = LinkConfig(rtt_ms=cfg.rtt_ms, bandwidth_bps=cfg.bandwidth_mbit * 1e6, seed=cfg.seed)
        async with WanEmulator(("127.0.0.1", verifier.port), link) as emu, \
                aiohttp.ClientSession() as http:  # fmt: skip
            b = Bench(
                cfg, parse_mode(cfg.mode).pipeline_config(), target, prompts, eos, paths,
                verifier, emu, token, http, log=log,
            )  # fmt: skip
            # First use (allocations, the first prefill) is not part of any measurement.
            await one_cut(b, prompts[0], strip=False, drop_after=None, seed=0)
            probes = [await probe_once(b, 100 + i) for i in range(3)]
            b.unloaded_round_s = statistics.median(probes)
            log(f"unloaded probe round: {b.unloaded_round_s * 1000:.1f} ms")
            reconnect: dict[str, Any] = {
                "prompt_tokens": len(max(prompts, key=len)),
                "drop_after_tokens": cfg.drop_after,
                "tokens": cfg.reconnect_tokens,
            }
            if cfg.reconnect in ("both", "with"):
                reconnect["with_resume"] = await reconnect_cost(b, strip=False)
            if cfg.reconnect in ("both", "without"):
                reconnect["without_resume"] = await reconnect_cost(b, strip=True)
            reconnect["resumption_offered"] = any(
                v.get("resume_offered", False) for v in reconnect.values() if isinstance(v, dict)
            )
            loads = []
            for n in cfg.sessions:
                loads.append(await run_level(b, n))
    finally:
        await verifier.stop()
    lens = [len(p) for p in prompts]
    setup = {
        "model": target.name,
        "verifier": f"python -m bench.net.verifier --model {spec} --device cpu "
        f"--emulate-verify-ms {cfg.verify_ms:g} (OMP threads {cfg.threads})",
        "max_queue_delay_s": cfg.max_queue_delay,
        "max_sessions": cfg.max_sessions,
        "admission_queue": admission_queue,
        "verify_ms": cfg.verify_ms,
        "draft": f"oracle:alpha={cfg.alpha:g}",
        "draft_ms": cfg.draft_ms,
        "rtt_ms": cfg.rtt_ms,
        "bandwidth_mbit": cfg.bandwidth_mbit,
        "mode": cfg.mode,
        "tokens": cfg.tokens,
        "window_s": cfg.window_s,
        "prompts": len(prompts),
        "prompt_tokens": [min(lens), max(lens)],
        "recovery_factor": cfg.recovery_factor,
        "recovery_timeout_s": cfg.recovery_timeout_s,
        "probe": f"testkit.probe.Driver: prefill of prompt 0, then {cfg.probe_rounds} "
        "stop-and-wait rounds of 4 random drafts; median round",
        "sources": SOURCES,
        "quick": cfg.quick,
        "host": {
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "seconds": round(time.monotonic() - t_start, 1),
    }
    # The headline keys, one entry per offered load (aligned lists, as verifier_load.json);
    # ``loads`` holds every figure of each load.
    summary = {key: [r[key] for r in loads] for key in SUMMARY_KEYS}
    return {
        **summary,
        "saturation": saturation(loads, cfg.max_sessions, admission_queue),
        "setup": setup,
        "unloaded": {"probe_round_ms": round(b.unloaded_round_s * 1000, 2)},
        "loads": loads,
        "reconnect": reconnect,
    }


#: The keys of overload.json that hold one entry per offered load.
SUMMARY_KEYS = (
    "offered_sessions",
    "completed",
    "failed",
    "goodput_tokens_per_s",
    "p99_round_ms",
    "recovery_s",
    "offered_x",
    "admission_wait_ms_p99",
    "line_max",
)
#: The verifier's gauge of sessions waiting in its admission line, and how often it is read.
LINE_GAUGE = "wanspec_admission_waiting"
LINE_SAMPLE_S = 0.25


def saturation(
    loads: Sequence[Mapping[str, Any]], max_sessions: int, admission_queue: int
) -> dict[str, Any]:
    """Overload degrades throughput, never turns into errors. Saturation is the offered load
    whose goodput is the sweep's peak; every load past it is read against that peak
    (``min_goodput_vs_peak_past_saturation``, within 10 % or not), and the failures of the
    loads whose admission line never filled (its largest sampled length below
    ``admission_queue``) are counted. ``goodput_vs_peak`` has every load's ratio, those
    below saturation too (offered ≥ ``max_sessions`` keeps the slots full only if users
    never pause)."""
    goodput = [float(r["goodput_tokens_per_s"]) for r in loads]
    peak = max(goodput, default=0.0)
    pairs = list(zip(loads, goodput, strict=True))
    at = next((r["offered_sessions"] for r, g in pairs if g == peak), None)
    past = [g / peak for r, g in pairs if at is not None and r["offered_sessions"] >= at]
    room = [r for r in loads if r["line_max"] < admission_queue]
    return {
        "peak_goodput_tokens_per_s": peak,
        "saturated_at_sessions": at,
        "saturated_at_x": None if at is None else round(at / max_sessions, 2),
        "goodput_vs_peak": [round(g / peak, 3) if peak > 0 else 0.0 for g in goodput],
        "min_goodput_vs_peak_past_saturation": round(min(past), 3) if past else None,
        "within_10pct_of_peak": bool(past) and min(past) >= 0.9,
        "failed_while_line_had_room": sum(int(r["failed"]) for r in room),
        "loads_whose_line_had_room": len(room),
    }


# ------------------------------------------------------------------------------ output


def _legend(ax: Any, twin: Any, loc: str) -> None:
    """One legend on ``ax`` for its lines and those of its twin axis."""
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc=loc)


def _twin(ax: Any, ylabel: str, twin_ylabel: str, color: str) -> Any:
    """Label panel ``ax`` (offered sessions across) and give it a twin axis, labelled in the
    ``color`` of what it plots."""
    ax.set_xlabel("offered concurrent sessions")
    ax.set_ylabel(ylabel)
    twin = ax.twinx()
    twin.set_ylabel(twin_ylabel, color=color)
    return twin


def plot(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = result["loads"]
    n = [r["offered_sessions"] for r in loads]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4))
    a.plot(n, [r["goodput_tokens_per_s"] for r in loads], marker="o", label="goodput")
    a.set_ylim(bottom=0)
    a2 = _twin(a, "goodput (tokens/s of completed generations)", "failed generations", "tab:red")
    a2.bar(n, [r["failed"] for r in loads], width=[x * 0.25 for x in n], color="tab:red",
           alpha=0.5, label="failed generations")  # fmt: skip
    a2.set_ylim(bottom=0, top=max(1, *(r["failed"] + r["completed"] for r in loads)))
    for r in loads:
        a.annotate(f"{r['failed']} failed / {r['completed']}", (r["offered_sessions"], 0),
                   xytext=(0, 4), textcoords="offset points", ha="center", fontsize=7,
                   rotation=90, color="tab:red")  # fmt: skip
    _legend(a, a2, "center right")
    b.plot(n, [r["p99_round_ms"] for r in loads], marker="o", label="p99 round (edge)")
    b.axhline(result["unloaded"]["probe_round_ms"], color="grey", ls=":", label="unloaded probe")
    b.set_yscale("log")
    b2 = _twin(b, "round time (ms)", "recovery (s)", "tab:green")
    rec = [r["recovery_s"] for r in loads]
    b2.plot(n, [x if x is not None else float("nan") for x in rec], marker="s",
            color="tab:green", label="recovery after the window")  # fmt: skip
    b2.set_ylim(bottom=0)
    _legend(b, b2, "upper left")
    c.plot(n, [(r["admission_wait_ms_p99"] or 0.0) / 1000 for r in loads], marker="o",
           label="p99 admission wait")  # fmt: skip
    c.set_ylim(bottom=0)
    c2 = _twin(c, "wait in the admission line (s)", "sessions in line (max)", "tab:purple")
    c2.bar(n, [r["line_max"] for r in loads], width=[x * 0.25 for x in n], color="tab:purple",
           alpha=0.4, label="longest line (sessions)")  # fmt: skip
    c2.set_ylim(bottom=0)
    slots = result["setup"]["max_sessions"]
    c.axvline(slots, color="grey", ls=":", label=f"max_sessions = {slots}")
    _legend(c, c2, "upper left")
    for ax in (a, b, c):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    s = result["setup"]
    fig.suptitle(
        f"overload: {s['model']}, verify pad {s['verify_ms']:g} ms, RTT {s['rtt_ms']:g} ms, "
        f"{s['draft']} at {s['draft_ms']:g} ms/token, {s['tokens']} tokens, "
        f"window {s['window_s']:g} s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sessions(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not out or min(out) < 1 or max(out) > 256:
        raise argparse.ArgumentTypeError("sessions must be integers in 1..256")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = study_parser("overload", __doc__)
    # None: the preset's value (--quick, or OverloadConfig's default)
    add_verifier_run(p, "--quick", "tiny models, a smoke run (~30 s)", OverloadConfig.out)
    add = p.add_argument
    add("--sessions", type=_sessions, help="offered loads (default: 1,2,4,8,12,16)")
    add("--window", type=float, dest="window_s", help="seconds of arrivals per load (30)")
    add("--tokens", type=int, help="new tokens per generation (24)")
    add("--mode", help="bench.lib.modes mode spec (default: pipe:4x2:nocogen)")
    add("--alpha", type=float, help="the oracle draft's acceptance (0.75)")
    add("--draft-ms", type=float, help="per draft token (24)")
    add("--verify-ms", type=float, help="pad every verifier forward to this (0: off)")
    add("--rtt-ms", type=float, help="emulated WAN round trip (50)")
    add("--bandwidth-mbit", type=float, help="emulated WAN bandwidth (10)")
    add("--max-sessions", type=int, help="the verifier's session slots; offered_x is read "
        "against it (4)")  # fmt: skip
    add("--admission-queue", type=int, help="the verifier's admission line bound (its default)")
    add("--gen-timeout", type=float, dest="gen_timeout_s", help="a generation fails past this")
    add("--recovery-factor", type=float, help="recovered: probe round within this × unloaded")
    add("--recovery-timeout", type=float, dest="recovery_timeout_s", help="probe this long")
    add("--probe-rounds", type=int, help="measured rounds per probe session (8)")
    add("--reconnect", choices=("both", "with", "without", "off"),
        help="reconnect cost with and/or without resumption (both)")  # fmt: skip
    add("--reconnect-trials", type=int, help="cut generations per variant (3)")
    add("--drop-after", type=int, help="cut once this many tokens are committed (12)")
    return p


def config_from_args(args: argparse.Namespace) -> OverloadConfig:
    base = dataclasses.replace(OverloadConfig(), **QUICK, quick=True) if args.quick else None
    cfg = base or OverloadConfig()
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(OverloadConfig)
        if getattr(args, f.name, None) is not None and f.name not in ("quick",)
    }
    out = dataclasses.replace(cfg, **given)
    if not 1 <= out.max_sessions <= 256:
        raise SystemExit(f"--max-sessions must be in 1..256, got {out.max_sessions}")
    if out.admission_queue is not None and out.admission_queue < 0:
        raise SystemExit(f"--admission-queue must be >= 0, got {out.admission_queue}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    result = record_study("wanspec-overload-", args, cfg, run, cfg.out, plot)
    failed = sum(r["failed"] for r in result["loads"])
    print(f"wrote {cfg.out}; failed generations: {failed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
