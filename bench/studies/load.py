"""Load: many concurrent edge sessions against one verifier process, through the WAN emulator.

    python -m bench load --sessions 64 --seconds 60 --out bench/out/load.json

One ``cloud-verifier serve`` process (tiny random target, CPU, one model worker) behind
:mod:`testkit.net.wanem` (RTT ``--rtt-ms``, jitter, 10 Mbit/s); ``--sessions`` edge agents here
(tiny draft, greedy, pipelined; their drafts share one model worker thread), each generating one
text after another for ``--seconds``. Every generation is a new WebSocket session, so the verifier
sees ``--sessions`` concurrent sessions and a steady churn of openings and closings; the sessions
spread over ``--tokens`` bearer tokens (per-token accounting under load).

Checked: every generation's text equals target-only greedy decoding; no errors, no reconnects;
the verifier's memory stays bounded (RSS sampled every 0.25 s: the last quarter of the run may not
exceed the first by more than ``--rss-slack-mib``); the number of concurrent sessions (from
``/health``) is reported with the verifier's peak RSS (VmHWM).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from edge_agent.model.tasks import ModelWorker
from edge_agent.runtime.agent import RetryPolicy
from edge_agent.session.pipeline_config import PipelineConfig
from shared.maths.sampling import SamplingParams
from testkit.harness import WanRig, config_parser, greedy_cases, run_command, wan_rig
from testkit.net.wanem import LinkConfig

log = logging.getLogger("bench.load")


@dataclass(frozen=True)
class LoadConfig:
    sessions: int = 64
    seconds: float = 60.0
    tokens: int = 4  # bearer tokens the sessions are spread over
    max_new_tokens: int = 32
    prompts: int = 16
    gamma: int = 3
    depth: int = 2
    rtt_ms: float = 40.0
    jitter_ms: float = 4.0
    rss_slack_mib: float = 64.0
    seed: int = 0


@dataclass
class LoadReport:
    config: dict[str, Any]
    generations: int = 0
    tokens: int = 0
    wrong: int = 0
    errors: list[str] = field(default_factory=list)
    reconnects: int = 0
    concurrent_sessions: dict[str, float] = field(default_factory=dict)
    rss_mib: dict[str, float] = field(default_factory=dict)
    generation_s: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    wall_s: float = 0.0

    def ok(self, cfg: LoadConfig) -> bool:
        grew = self.rss_mib.get("last_quarter_max", 0.0) - self.rss_mib.get(
            "first_quarter_max", 0.0
        )
        return (
            self.generations >= self.config["sessions"]
            and self.wrong == 0
            and not self.errors
            and self.reconnects == 0
            and grew <= cfg.rss_slack_mib
        )


async def run(cfg: LoadConfig, workdir: Path) -> LoadReport:
    report = LoadReport(config=asdict(cfg))
    t_start = time.monotonic()
    tokens = [f"load-token-{i}" for i in range(cfg.tokens)]
    per_token = -(-cfg.sessions // cfg.tokens)
    args = (
        f"--max-sessions={cfg.sessions + 16} --max-sessions-per-token={per_token + 4} "
        "--heartbeat=5 --log-level=warning"
    ).split()
    link = LinkConfig(rtt_ms=cfg.rtt_ms, jitter_ms=cfg.jitter_ms, seed=cfg.seed)
    async with wan_rig(workdir, tokens, args, link) as rig:
        worker = ModelWorker("draft-model")  # the drafts' one thread, shared by the sessions
        try:
            await _measure(cfg, rig, tokens, worker, report)
        finally:
            worker.close()
    report.wall_s = round(time.monotonic() - t_start, 1)
    return report


async def _measure(
    cfg: LoadConfig, rig: WanRig, tokens: list[str], worker: ModelWorker, report: LoadReport
) -> None:
    """The sessions' generations for ``cfg.seconds``, the verifier's memory and sessions
    sampled meanwhile: into ``report``."""
    rng = random.Random(cfg.seed)
    cases = greedy_cases(rig.pair.target, rng, cfg.prompts, 10, cfg.max_new_tokens)
    pcfg = PipelineConfig(gamma=cfg.gamma, depth=cfg.depth, sampling=SamplingParams(0.0))
    retry = RetryPolicy(max_attempts=3, backoff_initial_s=0.05, backoff_max_s=0.2)
    durations: list[float] = []
    deadline = time.monotonic() + cfg.seconds

    async def session(i: int) -> None:
        agent = rig.agent(tokens[i % cfg.tokens], retry=retry, worker=worker)
        k = i
        try:
            while time.monotonic() < deadline:
                prompt, expected = cases[k % cfg.prompts]
                k += 1
                t0 = time.monotonic()
                try:
                    gen = await asyncio.wait_for(
                        agent.generate(prompt, pcfg, max_tokens=cfg.max_new_tokens),
                        120.0,
                    )
                except Exception as e:
                    report.errors.append(f"session {i}: {type(e).__name__}: {e}"[:300])
                    return
                durations.append(time.monotonic() - t0)
                report.generations += 1
                report.tokens += len(gen.generated)
                report.reconnects += gen.stats.reconnects
                if gen.generated != expected:
                    report.wrong += 1
        finally:
            agent.close()

    samples: list[int] = []
    concurrent: list[int] = []
    stop = asyncio.Event()

    async def sample() -> None:
        health = f"http://127.0.0.1:{rig.verifier.port}/health"
        async with aiohttp.ClientSession() as http:
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    samples.append(rig.verifier.rss_kib()[0])
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.get(health, timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            concurrent.append(int((await r.json())["sessions"]))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.25)

    sampler = asyncio.ensure_future(sample())
    t_run = time.monotonic()
    try:
        await asyncio.gather(*(session(i) for i in range(cfg.sessions)))
    finally:
        stop.set()
        await sampler
    run_s = time.monotonic() - t_run
    report.tokens_per_s = round(report.tokens / run_s, 1)
    _, peak = rig.verifier.rss_kib()
    q = max(1, len(samples) // 4)
    report.rss_mib = {
        "start": round(samples[0] / 1024, 1),
        "first_quarter_max": round(max(samples[:q]) / 1024, 1),
        "last_quarter_max": round(max(samples[-q:]) / 1024, 1),
        "peak": round(peak / 1024, 1),
    }
    steady = concurrent[len(concurrent) // 10 : -max(1, len(concurrent) // 10)] or concurrent
    report.concurrent_sessions = {
        "max": max(concurrent, default=0),
        "mean_steady": round(statistics.fmean(steady), 1) if steady else 0.0,
        "min_steady": min(steady, default=0),
    }
    if durations:
        durations.sort()
        report.generation_s = {
            "p50": round(durations[len(durations) // 2], 3),
            "p99": round(durations[int(len(durations) * 0.99)], 3),
            "max": round(durations[-1], 3),
        }


def summary(rep: LoadReport) -> str:
    c = rep.config
    return (
        f"{c['sessions']} sessions for {c['seconds']:g} s (RTT {c['rtt_ms']:g} ms): "
        f"{rep.generations} generations, {rep.tokens} tokens ({rep.tokens_per_s} tok/s), "
        f"wrong texts {rep.wrong}, errors {len(rep.errors)}, reconnects {rep.reconnects}\n"
        f"concurrent sessions at the verifier {rep.concurrent_sessions}\n"
        f"verifier RSS MiB {rep.rss_mib}\n"
        f"generation seconds {rep.generation_s}; wall {rep.wall_s} s"
    )


def main(argv: list[str] | None = None) -> int:
    p = config_parser(
        "python -m bench load",
        __doc__,
        LoadConfig,
        "sessions",
        "seconds",
        ("tokens", "bearer tokens to spread over"),
        "rtt_ms",
        "max_new_tokens",
        "rss_slack_mib",
        "seed",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    cfg, report = run_command(LoadConfig, args, "wanspec-load-", run, summary)
    for e in report.errors[:10]:
        print("error:", e)
    return 0 if report.ok(cfg) else 1


if __name__ == "__main__":
    raise SystemExit(main())
