"""Time to first token and to a whole reply, as a user on the far side of a WAN has them.

Two parts, written to ``--out``/ttft.json with a plot (ttft.png):

**Latency** (this machine's real timings, no padding). The verifier (``cloud-verifier serve``,
the default target, one thread) behind the WAN emulator (:mod:`testkit.net.wanem`, 10 Mbit/s each
way, no jitter); at each RTT:

* ``warm``: the daemon (``edge-agent serve``, one thread) on its warm link, streaming chat
  completions over HTTP; time to the first content chunk and to the end of the reply;
* ``cold``: the same draft and settings in an agent whose every request opens its own
  connection (what ``edge-agent generate`` or a v1 edge pays: TCP, the WebSocket upgrade, then
  the session);
* ``ar``: the cloud-only baseline, the target streaming its own greedy tokens
  (:mod:`bench.net.ar_server`) on a kept-alive WebSocket through the same emulator.

Each figure is the median of ``--reps`` requests (prompts of the chat set, greedy), with a 95 %
bootstrap interval; ratios (TTFT and reply time against RTT 0, warm against ``ar``) carry
intervals from the same resampling.

**Concurrency** (the emulated device regime of :mod:`bench.studies.realtime`, time-dilated ×S): the
same 8 requests served 1, 2, 4 or 8 at a time by one edge (its draft steps batched,
:mod:`edge_agent.model.batching`), each draft step padded to 24 ms and a batched step of B rows to
24
· (1 + c · (B − 1)) ms with c from the H200 measurement in docs/results/gpu_costs.json
(:data:`bench.lib.costs.DRAFT_BATCH_COST`); the verifier's forwards padded to 166 ms
(:mod:`bench.net.verifier`); RTT 100 ms. Aggregate and per-request tokens/s, emulated.

    python -m bench ttft --out docs/results            # the full run (about an hour here)
    python -m bench ttft --out /tmp/ttft --smoke       # seconds of each, for the tests
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt

from bench.lib.cli import study_parser
from bench.lib.costs import DRAFT_BATCH_COST, SOURCE, VERIFY_EAGER_B1_MS, VERIFY_EAGER_B8_MS
from bench.lib.edge import TimedDrafter, load_draft_model
from bench.lib.pages import BENCH_PAGE, replace_between
from bench.lib.stats import bootstrap_diff, bootstrap_median, bootstrap_ratio
from bench.net.ar_server import ArClient
from edge_agent.link.connection import LinkSettings, WebSocketTransport
from edge_agent.link.warm import WarmLink
from edge_agent.model.batching import BatchingWorker
from edge_agent.model.drafter import Drafter
from edge_agent.model.tasks import ModelWorker
from edge_agent.runtime.agent import AgentEvent, EdgeAgent, RetryPolicy
from edge_agent.runtime.text import encode_prompt
from edge_agent.session.events import Committed
from edge_agent.session.generation import Generation
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.transport import Transport
from shared.maths.sampling import SamplingParams
from shared.runtime.models import load_model
from testkit.harness import REPO, VerifierProcess, free_port, write_tokens
from testkit.net.wanem import LinkConfig, WanEmulator
from testkit.provenance import machine_info, provenance

TOKEN = "bench-ttft-token-0123456789abcdef"
DRAFT = "self:skip=12"
#: PicoSpec's Llama 1B/70B timings (ms): a draft token, a verify (bench.studies.realtime's picospec
#: regime).
DRAFT_MS, VERIFY_MS = 24.0, 166.0
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "How many days are in a leap year?",
    "What does a thermometer measure?",
    "Why is the sky blue?",
    "What is two plus two?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?",
]


@dataclass
class Sample:
    ttft_s: float
    total_s: float
    tokens: int


@dataclass
class Cell:
    kind: str  # warm / cold / ar
    rtt_ms: float
    tokens: int  # asked for
    samples: list[Sample] = field(default_factory=list)


def rtt_slope(
    groups: Mapping[float, Sequence[float]], rng: np.random.Generator, n: int = 2000
) -> list[float]:
    """The least-squares slope of time against RTT (seconds per second of RTT: the round trips
    a request pays), over every sample of every RTT, and its 95 % bootstrap interval
    (resampling within each RTT)."""
    rtts = sorted(groups)
    xs = np.concatenate([np.full(len(groups[r]), r / 1000.0) for r in rtts])

    def fit(ys: npt.NDArray[np.float64]) -> float:
        xm = xs.mean()
        return float(((xs - xm) * (ys - ys.mean())).sum() / ((xs - xm) ** 2).sum())

    ys = np.concatenate([np.asarray(groups[r], float) for r in rtts])
    boots = [
        fit(
            np.concatenate([rng.choice(np.asarray(groups[r], float), len(groups[r])) for r in rtts])
        )
        for _ in range(n)
    ]
    return [fit(ys), float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))]


# ------------------------------------------------------------------------------ processes


class Daemon:
    """``edge-agent serve`` as a child process (one thread, default draft)."""

    def __init__(self, verifier_url: str, token_file: Path, log_path: Path, max_tokens: int):
        self.port = free_port()
        self.verifier_url = verifier_url
        self.token_file = token_file
        self.log_path = log_path
        self.max_tokens = max_tokens
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        for k in list(env):
            if k.startswith("WANSPEC_EDGE_"):
                del env[k]
        cmd = [
            sys.executable, "-m", "edge_agent.daemon.cli", "serve",
            "--verifier", self.verifier_url, "--token-file", str(self.token_file),
            "--port", str(self.port), "--threads", "1", "--max-tokens", str(self.max_tokens),
            "--heartbeat", "10",
        ]  # fmt: skip
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=out)

    async def wait_ready(self, timeout: float = 600.0) -> None:
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as http:
            while time.monotonic() - t0 < timeout:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"the daemon exited (log: {self.log_path})")
                with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    async with http.get(self.base + "/health") as r:
                        if r.status == 200:  # loaded, and its link is up
                            return
                await asyncio.sleep(0.2)
        raise RuntimeError("the daemon was not ready in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class ArServer:
    """The cloud-only baseline server (bench.net.ar_server) as a child process."""

    def __init__(self, token_file: Path, log_path: Path, pad_ms: float = 0.0):
        self.port = free_port()
        self.token_file = token_file
        self.log_path = log_path
        self.pad_ms = pad_ms
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        cmd = [
            sys.executable, "-m", "bench.net.ar_server", "--model", "default", "--port",
            str(self.port), "--token-file", str(self.token_file), "--pad-ms", str(self.pad_ms),
        ]  # fmt: skip
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=out)

    async def wait_ready(self, timeout: float = 300.0) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the AR server exited (log: {self.log_path})")
            try:
                _, w = await asyncio.open_connection("127.0.0.1", self.port)
                w.close()
                return
            except OSError:
                await asyncio.sleep(0.2)
        raise RuntimeError("the AR server was not ready in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)


# ------------------------------------------------------------------------------ requests


async def chat_request(http: aiohttp.ClientSession, base: str, question: str, n: int) -> Sample:
    """One streaming chat completion through the daemon: time to the first content chunk and
    to ``[DONE]``."""
    body = {
        "model": "wanspec",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    async with http.post(base + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"daemon answered {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error']}")
            for ch in ev.get("choices", []):
                if ch.get("delta", {}).get("content") and ttft is None:
                    ttft = time.perf_counter() - t0
            if "wanspec" in ev:
                tokens = int(ev["wanspec"].get("tokens", 0))
    total = time.perf_counter() - t0
    return Sample(ttft if ttft is not None else total, total, tokens)


async def agent_request(agent: EdgeAgent, prompt: list[int], n: int, cfg: PipelineConfig) -> Sample:
    """One generation of ``agent`` (its own connection each time: cold)."""
    t0 = time.perf_counter()
    first: list[float] = []

    def on_event(ev: AgentEvent) -> None:
        if isinstance(ev, Committed) and not first:
            first.append(time.perf_counter() - t0)

    gen = Generation(prompt, n)
    await agent.run(gen, cfg, on_event=on_event)
    return Sample(first[0] if first else 0.0, time.perf_counter() - t0, len(gen.generated))


async def ar_request(client: ArClient, prompt: list[int], n: int) -> Sample:
    """One reply of the AR server on ``client``'s kept-alive connection."""
    reply = await client.request(prompt, n, [])
    ttft = reply.stamps[0] - reply.sent_at if reply.stamps else 0.0
    return Sample(ttft, reply.ended_at - reply.sent_at, len(reply.ids))


# ------------------------------------------------------------------------------ part 1


async def latency_part(
    args: argparse.Namespace, work: Path, token_file: Path, log: Any
) -> dict[str, Any]:
    target = load_model("default")
    draft = load_draft_model(DRAFT, target)
    prompts = [encode_prompt(target, q, chat=True) for q in QUESTIONS]
    vport = free_port()
    verifier = VerifierProcess("default", vport, token_file, log_path=work / "verifier.log")
    ar = ArServer(token_file, work / "ar.log")
    verifier.start()
    ar.start()
    cells: list[Cell] = []
    link = LinkConfig(rtt_ms=0.0, handshake_rtt=True)
    try:
        await verifier.wait_ready(600)
        await ar.wait_ready()
        async with (
            WanEmulator(("127.0.0.1", vport), link) as emu,
            WanEmulator(("127.0.0.1", ar.port), link) as ar_emu,
        ):
            daemon = Daemon(
                f"ws://127.0.0.1:{emu.port}/v1/session", token_file, work / "daemon.log",
                max(args.tokens),
            )  # fmt: skip
            daemon.start()
            try:
                await daemon.wait_ready()
                ls = LinkSettings(
                    url=f"ws://127.0.0.1:{emu.port}/v1/session", token=TOKEN, heartbeat_s=10
                )

                async def cold_connect() -> Transport:
                    return await WebSocketTransport.connect(ls)

                cold = EdgeAgent(Drafter(draft), draft.fingerprint, cold_connect)
                cfg = PipelineConfig(sampling=SamplingParams(0.0), predraft=8)
                ar_client = ArClient(f"ws://127.0.0.1:{ar_emu.port}/v1/generate", TOKEN)
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200)) as http:
                    for rtt in args.rtts:
                        emu.set_link(rtt_ms=rtt)
                        ar_emu.set_link(rtt_ms=rtt)
                        await chat_request(http, daemon.base, QUESTIONS[0], 4)  # settle
                        await ar_client.open()
                        for n in args.tokens:
                            warm_c = Cell("warm", rtt, n)
                            cold_c = Cell("cold", rtt, n)
                            ar_c = Cell("ar", rtt, n)
                            for i in range(args.reps):
                                q = i % len(QUESTIONS)
                                await asyncio.sleep(args.pause)  # (what ran before settles)
                                warm_c.samples.append(
                                    await chat_request(http, daemon.base, QUESTIONS[q], n)
                                )
                                await asyncio.sleep(args.pause)
                                cold_c.samples.append(await agent_request(cold, prompts[q], n, cfg))
                                await asyncio.sleep(args.pause)
                                ar_c.samples.append(await ar_request(ar_client, prompts[q], n))
                                print(
                                    f"rtt {rtt:g} n {n} rep {i}: ttft warm "
                                    f"{warm_c.samples[-1].ttft_s:.3f} cold "
                                    f"{cold_c.samples[-1].ttft_s:.3f} ar "
                                    f"{ar_c.samples[-1].ttft_s:.3f} s",
                                    file=log,
                                    flush=True,
                                )
                            cells += [warm_c, cold_c, ar_c]
                        await ar_client.close()
                cold.close()
            finally:
                daemon.stop()
    finally:
        ar.stop()
        await verifier.stop()
    return summarise_latency(cells, args)


def cells_of(latency: dict[str, Any]) -> list[Cell]:
    """The raw samples of a run's latency part (``ttft.json``), to summarise again."""
    out = []
    for c in latency["cells"]:
        cell = Cell(c["kind"], float(c["rtt_ms"]), int(c["tokens"]))
        cell.samples = [
            Sample(t, r, k)
            for t, r, k in zip(
                c["ttft_samples_s"], c["reply_samples_s"], c["tokens_received"], strict=True
            )
        ]
        out.append(cell)
    return out


def summarise_latency(cells: list[Cell], args: argparse.Namespace) -> dict[str, Any]:
    """Every figure of the latency part, from the samples alone (``--report-only`` runs it
    again on a committed run's samples)."""
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"cells": [], "targets": {}}
    by = {(c.kind, c.rtt_ms, c.tokens): c for c in cells}
    for c in cells:
        out["cells"].append(
            {
                "kind": c.kind,
                "rtt_ms": c.rtt_ms,
                "tokens": c.tokens,
                "ttft_s": bootstrap_median([s.ttft_s for s in c.samples], rng),
                "reply_s": bootstrap_median([s.total_s for s in c.samples], rng),
                "tokens_received": [s.tokens for s in c.samples],
                "ttft_samples_s": [round(s.ttft_s, 4) for s in c.samples],
                "reply_samples_s": [round(s.total_s, 4) for s in c.samples],
            }
        )
    n0 = min(args.tokens)
    base_rtt = min(args.rtts)
    per_rtt = []
    for rtt in args.rtts:
        if rtt == base_rtt:
            continue
        row: dict[str, Any] = {"rtt_ms": rtt}
        for kind in ("warm", "cold", "ar"):
            at, at0 = by.get((kind, rtt, n0)), by.get((kind, base_rtt, n0))
            if at is None or at0 is None:
                continue
            d = bootstrap_diff([s.ttft_s for s in at.samples], [s.ttft_s for s in at0.samples], rng)
            row[f"{kind}_ttft_minus_rtt0_over_rtt"] = [v * 1000 / rtt for v in d]
        per_rtt.append(row)
    out["targets"]["ttft_extra_per_rtt"] = per_rtt
    slopes: dict[str, list[float]] = {}
    for kind in ("warm", "cold", "ar"):
        groups = {c.rtt_ms: [x.ttft_s for x in c.samples] for c in cells
                  if c.kind == kind and c.tokens == n0}  # fmt: skip
        if len(groups) >= 2:
            slopes[kind] = rtt_slope(groups, rng)
    # Round trips before the first token, fitted over every RTT (the slope of TTFT on RTT).
    out["targets"]["ttft_round_trips"] = slopes
    n1 = max(args.tokens)
    if (("warm", 200.0, n1) in by) and (("warm", base_rtt, n1) in by):
        out["targets"]["reply_rtt200_over_rtt0"] = bootstrap_ratio(
            [s.total_s for s in by[("warm", 200.0, n1)].samples],
            [s.total_s for s in by[("warm", base_rtt, n1)].samples],
            rng,
        )
    vs_ar = []
    for rtt in args.rtts:
        for n in args.tokens:
            w, a = by.get(("warm", rtt, n)), by.get(("ar", rtt, n))
            if w is None or a is None:
                continue
            vs_ar.append(
                {
                    "rtt_ms": rtt,
                    "tokens": n,
                    "ttft_warm_over_ar": bootstrap_ratio(
                        [s.ttft_s for s in w.samples], [s.ttft_s for s in a.samples], rng
                    ),
                    "reply_ar_over_warm": bootstrap_ratio(
                        [s.total_s for s in a.samples], [s.total_s for s in w.samples], rng
                    ),
                }
            )
    out["vs_ar"] = vs_ar
    return out


# ------------------------------------------------------------------------------ part 2


async def concurrency_part(
    args: argparse.Namespace, work: Path, token_file: Path, log: Any
) -> dict[str, Any]:
    s = args.time_scale
    target = load_model("default")
    draft_model = load_draft_model(DRAFT, target)
    prompts = [encode_prompt(target, q, chat=True) for q in QUESTIONS]
    vport = free_port()
    verifier = VerifierProcess(
        "default",
        vport,
        token_file,
        log_path=work / "verifier-padded.log",
        args=[
            "--emulate-verify-ms", str(VERIFY_MS * s), "--heartbeat", "0",
            "--kv-cache-tokens", "16384",
        ],
        command=("-m", "bench.net.verifier"),
    )  # fmt: skip
    verifier.start()
    results = []
    try:
        await verifier.wait_ready(600)
        link = LinkConfig(rtt_ms=args.concurrency_rtt * s, bandwidth_bps=10_000_000 / s)
        async with WanEmulator(("127.0.0.1", vport), link) as emu:
            warm = WarmLink(
                LinkSettings(
                    url=f"ws://127.0.0.1:{emu.port}/v1/session", token=TOKEN, heartbeat_s=0
                )
            )
            warm.start()
            drafter = TimedDrafter(Drafter(draft_model), DRAFT_MS * s / 1000.0)
            inner = ModelWorker("draft")
            batching = BatchingWorker(inner, drafter, max(args.concurrency))
            agent = EdgeAgent(
                drafter, draft_model.fingerprint, warm.stream, worker=batching,
                retry=RetryPolicy(verdict_timeout_s=60.0),
            )  # fmt: skip
            cfg = PipelineConfig(sampling=SamplingParams(0.0))
            n = args.concurrency_tokens
            try:
                await agent.generate(prompts[0], cfg, max_tokens=4)  # warm up
                k = args.concurrency_requests
                for c in args.concurrency:
                    for rep in range(args.concurrency_reps):
                        # The same k requests each time, served c at a time (as the daemon's
                        # queue serves them): aggregate = their tokens / the time for all.
                        batching.batches = batching.rows = 0
                        places = asyncio.Semaphore(c)

                        async def served(
                            i: int, places: asyncio.Semaphore = places
                        ) -> tuple[Generation, float]:
                            async with places:
                                return await _timed_generate(agent, prompts[i], n, cfg)

                        t0 = time.perf_counter()
                        gens = await asyncio.gather(*(served(i % len(prompts)) for i in range(k)))
                        wall = (time.perf_counter() - t0) / s
                        total = sum(len(g.generated) for g, _ in gens)
                        per = [len(g.generated) / (w / s) for g, w in gens]
                        results.append(
                            {
                                "concurrency": c,
                                "rep": rep,
                                "requests": k,
                                "aggregate_tok_s": total / wall,
                                "per_request_tok_s": per,
                                "rows_per_draft_batch": batching.rows / max(1, batching.batches),
                            }
                        )
                        print(
                            f"concurrency {c} rep {rep}: {total / wall:.2f} tok/s aggregate",
                            file=log,
                            flush=True,
                        )
            finally:
                agent.close()
                await batching.aclose()
                inner.close()
                await warm.close()
    finally:
        await verifier.stop()
    rng = np.random.default_rng(1)
    one = [r["aggregate_tok_s"] for r in results if r["concurrency"] == 1]
    summary = []
    for c in args.concurrency:
        agg = [r["aggregate_tok_s"] for r in results if r["concurrency"] == c]
        per = [x for r in results if r["concurrency"] == c for x in r["per_request_tok_s"]]
        summary.append(
            {
                "concurrency": c,
                "aggregate_tok_s": bootstrap_median(agg, rng),
                "per_request_tok_s": bootstrap_median(per, rng),
                "aggregate_over_one": bootstrap_ratio(agg, one, rng) if one else None,
            }
        )
    return {
        "regime": {
            "time_scale": s,
            "draft_ms_per_token": DRAFT_MS,
            "verify_ms": VERIFY_MS,
            "rtt_ms": args.concurrency_rtt,
            "batched_draft_step": f"{DRAFT_MS} ms x (1 + {DRAFT_BATCH_COST:.4f} (B - 1))",
            "batched_draft_step_source": f"{SOURCE}: 8 sessions x 5 tokens at "
            f"{VERIFY_EAGER_B8_MS / VERIFY_EAGER_B1_MS:.2f} of 1 x 5 "
            "(bench.lib.costs.DRAFT_BATCH_COST)",
            "tokens_per_request": n,
            "requests_per_run": args.concurrency_requests,
        },
        "runs": results,
        "summary": summary,
    }


async def _timed_generate(
    agent: EdgeAgent, prompt: list[int], n: int, cfg: PipelineConfig
) -> tuple[Generation, float]:
    t0 = time.perf_counter()
    gen = await agent.generate(prompt, cfg, max_tokens=n)
    return gen, time.perf_counter() - t0


# ------------------------------------------------------------------------------ report


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    lat = doc.get("latency")
    if lat:
        n0 = min(c["tokens"] for c in lat["cells"])
        for kind, style in (("warm", "o-"), ("cold", "s--"), ("ar", "^:")):
            pts = sorted(
                (c["rtt_ms"], c["ttft_s"]) for c in lat["cells"] if c["kind"] == kind
                and c["tokens"] == n0
            )  # fmt: skip
            if pts:
                x = [p[0] for p in pts]
                y = [p[1][0] for p in pts]
                err = [[p[1][0] - p[1][1] for p in pts], [p[1][2] - p[1][0] for p in pts]]
                axes[0].errorbar(x, y, yerr=err, fmt=style, label=kind, capsize=3)
        axes[0].set_xlabel("RTT (ms)")
        axes[0].set_ylabel("time to first token (s)")
        axes[0].set_title("TTFT, median and 95 % interval")
        axes[0].legend()
    con = doc.get("concurrency")
    if con:
        xs = [r["concurrency"] for r in con["summary"]]
        ys = [r["aggregate_tok_s"][0] for r in con["summary"]]
        err = [
            [r["aggregate_tok_s"][0] - r["aggregate_tok_s"][1] for r in con["summary"]],
            [r["aggregate_tok_s"][2] - r["aggregate_tok_s"][0] for r in con["summary"]],
        ]
        axes[1].errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, label="aggregate")
        per = [r["per_request_tok_s"][0] for r in con["summary"]]
        axes[1].plot(xs, per, "s--", label="per request")
        axes[1].set_xlabel("concurrent requests")
        axes[1].set_ylabel("emulated tokens/s")
        axes[1].set_title("one edge, several requests")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ci(v: Sequence[float], scale: float = 1.0, fmt: str = ".2f") -> str:
    """``median [lo, hi]``."""
    return f"{v[0] * scale:{fmt}} [{v[1] * scale:{fmt}}, {v[2] * scale:{fmt}}]"


def report(doc: dict[str, Any]) -> str:
    """The markdown tables of a run (ttft.md): every figure read off ``doc``."""
    m = doc["machine"]
    out = [
        "# Time to first token, whole replies, concurrency",
        "",
        f"Run of commit {m['git_commit']} on {m['date']} ({m['cpus']} CPUs, {m['processor']}, "
        f"torch {m['torch']}). Medians with 95 % bootstrap intervals.",
    ]
    lat = doc.get("latency")
    if lat:
        reps = len(lat["cells"][0]["ttft_samples_s"])
        out += [
            "",
            "## Latency (this machine's real timings)",
            "",
            f"Default target and draft, one thread each; {reps} requests per cell; the WAN "
            "emulator at 10 Mbit/s each way (TCP's handshake held one RTT). **warm**: the daemon "
            "on its warm link (streaming chat completion over HTTP); **cold**: a connection of "
            "its own per request; **ar**: the target streaming alone on a kept-alive connection.",
            "",
            "| RTT ms | tokens | warm TTFT s | cold TTFT s | ar TTFT s | warm reply s | cold "
            "reply s | ar reply s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        by = {(c["kind"], c["rtt_ms"], c["tokens"]): c for c in lat["cells"]}
        keys = sorted(
            {(c["rtt_ms"], c["tokens"]) for c in lat["cells"]}, key=lambda k: (k[1], k[0])
        )
        for rtt, n in keys:
            row = [f"{rtt:g}", str(n)]
            row += [_ci(by[(k, rtt, n)]["ttft_s"]) if (k, rtt, n) in by else "–" for k in
                    ("warm", "cold", "ar")]  # fmt: skip
            row += [_ci(by[(k, rtt, n)]["reply_s"]) if (k, rtt, n) in by else "–" for k in
                    ("warm", "cold", "ar")]  # fmt: skip
            out.append("| " + " | ".join(row) + " |")
        out += [
            "",
            "Extra time to the first token per RTT, (TTFT(RTT) − TTFT(0)) / RTT, shortest reply:",
            "",
            "| RTT ms | warm | cold | ar |",
            "|---|---|---|---|",
        ]
        for r in lat["targets"]["ttft_extra_per_rtt"]:
            cells = [
                _ci(r[f"{k}_ttft_minus_rtt0_over_rtt"]) if f"{k}_ttft_minus_rtt0_over_rtt" in r
                else "–"
                for k in ("warm", "cold", "ar")
            ]  # fmt: skip
            out.append(f"| {r['rtt_ms']:g} | " + " | ".join(cells) + " |")
        slope = lat["targets"].get("ttft_round_trips", {})
        if slope:
            out += [
                "",
                "Round trips before the first token, the slope of TTFT on RTT over "
                "every sample: " + ", ".join(f"{k} {_ci(v)}" for k, v in slope.items()) + ".",
            ]
        ratio = lat["targets"].get("reply_rtt200_over_rtt0")
        if ratio:
            out += ["", f"Longest warm reply at RTT 200 over RTT 0: {_ci(ratio)}."]
        out += ["", "| RTT ms | tokens | warm TTFT / ar TTFT | ar reply / warm reply |",
                "|---|---|---|---|"]  # fmt: skip
        for r in lat["vs_ar"]:
            out.append(
                f"| {r['rtt_ms']:g} | {r['tokens']} | {_ci(r['ttft_warm_over_ar'])} | "
                f"{_ci(r['reply_ar_over_warm'])} |"
            )
    con = doc.get("concurrency")
    if con:
        g = con["regime"]
        out += [
            "",
            "## Concurrency (emulated device regime)",
            "",
            f"{g['requests_per_run']} requests of {g['tokens_per_request']} tokens served c at a "
            f"time by one edge; draft {g['draft_ms_per_token']:g} ms a token, a batched draft "
            f"step {g['batched_draft_step']} ({g['batched_draft_step_source']}); verify "
            f"{g['verify_ms']:g} ms; RTT {g['rtt_ms']:g} ms; time-dilated ×{g['time_scale']:g}, "
            "emulated tokens/s.",
            "",
            "| at a time | aggregate tok/s | × one at a time | per request tok/s |",
            "|---|---|---|---|",
        ]
        for r in con["summary"]:
            over = _ci(r["aggregate_over_one"]) if r["aggregate_over_one"] else "–"
            out.append(
                f"| {r['concurrency']} | {_ci(r['aggregate_tok_s'])} | {over} | "
                f"{_ci(r['per_request_tok_s'])} |"
            )
    return "\n".join(out) + "\n"


def readme_block(doc: dict[str, Any]) -> str:
    """The benchmark page's figures (between ``<!-- ttft:begin -->`` and
    ``<!-- ttft:end -->``), read off ``doc``: TTFT per RTT (warm, cold, the AR baseline), the
    longest reply, the round trips (slopes), and concurrency's aggregate against one at a
    time."""
    lat, con = doc["latency"], doc.get("concurrency")
    n0 = min(c["tokens"] for c in lat["cells"])
    n1 = max(c["tokens"] for c in lat["cells"])
    reps = len(lat["cells"][0]["ttft_samples_s"])
    by = {(c["kind"], c["rtt_ms"], c["tokens"]): c for c in lat["cells"]}
    rtts = sorted({c["rtt_ms"] for c in lat["cells"]})
    out = [
        f"Through the daemon over the emulator (this CPU's timings, medians of {reps}; commit "
        f"{doc['machine']['git_commit']}, `docs/results/ttft.json`), seconds:",
        "",
        f"| RTT ms | first token: warm link | cold | cloud AR | {n1} tokens: warm | cloud AR |",
        "|---|---|---|---|---|---|",
    ]
    for rtt in rtts:
        cells = [f"{by[(k, rtt, n0)]['ttft_s'][0]:.2f}" for k in ("warm", "cold", "ar")]
        cells += [f"{by[(k, rtt, n1)]['reply_s'][0]:.1f}" for k in ("warm", "ar")]
        out.append(f"| {rtt:g} | " + " | ".join(cells) + " |")
    slope = lat["targets"]["ttft_round_trips"]
    out += [
        "",
        f"Round trips before the first token (slope on RTT): warm link {_ci(slope['warm'])}, "
        f"cold {_ci(slope['cold'])}, cloud AR {_ci(slope['ar'])}.",
    ]
    ratio = lat["targets"].get("reply_rtt200_over_rtt0")
    if ratio:
        out[-1] += f" {n1} tokens at RTT 200: {ratio[0]:.2f}× RTT 0."
    if con:
        four = next((r for r in con["summary"] if r["concurrency"] == 4), None)
        if four is not None and four["aggregate_over_one"]:
            out[-1] += (
                f" 4 requests at once: {_ci(four['aggregate_over_one'])}× the tokens/s of one "
                "(emulated regime)."
            )
    return "\n".join(out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = study_parser("ttft", __doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rtts", default="0,50,100,200,400")
    p.add_argument("--tokens", default="32,256")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--pause", type=float, default=0.5, help="idle seconds before each request")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--concurrency-tokens", type=int, default=32)
    p.add_argument("--concurrency-reps", type=int, default=3)
    p.add_argument(
        "--concurrency-requests", type=int, default=8, help="requests per run, served c at a time"
    )
    p.add_argument("--concurrency-rtt", type=float, default=100.0)
    p.add_argument("--time-scale", type=float, default=6.0)
    p.add_argument("--parts", default="latency,concurrency")
    p.add_argument("--smoke", action="store_true", help="a few seconds of each part (tests)")
    p.add_argument(
        "--report-only", action="store_true", help="rewrite ttft.md and ttft.png from ttft.json"
    )
    p.add_argument(
        "--publish",
        action="store_true",
        help="also rewrite the benchmark page's block from ttft.json",
    )
    args = p.parse_args(argv)
    args.rtts = [float(x) for x in args.rtts.split(",")]
    args.tokens = [int(x) for x in args.tokens.split(",")]
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    args.parts = set(args.parts.split(","))
    if args.smoke:
        args.rtts, args.tokens, args.reps = [0.0, 100.0], [8], 2
        args.concurrency, args.concurrency_tokens, args.concurrency_reps = [1, 2], 8, 1
        args.concurrency_requests = 2
        args.time_scale = 2.0
    return args


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"machine": machine_info(), "args": {
        k: sorted(v) if isinstance(v, set) else (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
    }}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="wanspec-ttft-") as tmp:
        work = Path(tmp)
        token_file = write_tokens(work / "tokens", [TOKEN])
        log = sys.stderr
        if "latency" in args.parts:
            doc["latency"] = await latency_part(args, work, token_file, log)
        if "concurrency" in args.parts:
            doc["concurrency"] = await concurrency_part(args, work, token_file, log)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    path = args.out / "ttft.json"
    if args.report_only:
        doc = json.loads(path.read_text())
        if "latency" in doc:
            cells = cells_of(doc["latency"])
            ns = argparse.Namespace(
                rtts=sorted({c.rtt_ms for c in cells}), tokens=sorted({c.tokens for c in cells})
            )
            doc["latency"] = summarise_latency(cells, ns)
            path.write_text(json.dumps(doc, indent=1) + "\n")
    else:
        import torch

        torch.set_num_threads(1)
        doc = asyncio.run(amain(args))
        doc["provenance"] = provenance()
        path.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, args.out / "ttft.png")
    (args.out / "ttft.md").write_text(report(doc))
    print(f"wrote {path}, ttft.md, ttft.png")
    if args.publish:
        BENCH_PAGE.write_text(replace_between(BENCH_PAGE.read_text(), "ttft", readme_block(doc)))
        print(f"rewrote {BENCH_PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
