"""Chaos run: generations that must survive lost connections, verifier restarts and stalls.

    python -m bench reliability --generations 100 --out bench/out/reliability.json

A real ``cloud-verifier serve`` process (tiny random target, CPU) listens on a fixed loopback
port behind the WAN emulator (:mod:`testkit.net.wanem`); a real edge agent (tiny draft, pipelined,
greedy) runs here. Every generation gets one to three faults, each fired when the generation has
committed a random number of tokens (so they land mid-generation, at any phase of the pipeline):

* ``cut_up`` / ``cut_down``: the connection is cut (RST) after a random number (0..400) of further
  bytes in that direction, usually in the middle of a frame;
* ``drop``: every connection is dropped at once (RST or FIN);
* ``stall``: nothing is delivered in either direction for ``stall_s`` (longer than the edge's
  heartbeat): the heartbeat must notice the dead link while the stall lasts, and the agent
  reconnects (the new connection waits out the stall);
* ``kill``: the verifier process gets SIGKILL and a new one is started on the same port (every
  session's KV cache is gone; the edge re-prefills from its committed ids);
* ``term``: SIGTERM: sessions are closed with GOING_AWAY (1001) and the process must exit within
  its ``shutdown_timeout``; then it is started again.

Each generation's text must equal the same generation run without faults, and target-only greedy
decoding (T = 0). The report counts survived/attempted, faults fired by kind, reconnects, stall
detection times, SIGTERM exit times and the restart downtime. Everything is bounded: each
generation by ``--generation-timeout``, each restart by 120 s.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.runtime.agent import AgentEvent, EdgeAgent, RetryPolicy
from edge_agent.session.generation import Generation
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.transport import LinkClosed, Transport
from shared.maths.sampling import SamplingParams
from testkit.harness import (
    WanRig,
    config_parser,
    greedy_cases,
    run_command,
    wan_rig,
)
from testkit.net.wanem import LinkConfig

log = logging.getLogger("bench.reliability")

FAULTS = ("cut_up", "cut_down", "drop", "stall", "kill", "term")
TOKEN = "reliability-token"


@dataclass(frozen=True)
class ChaosConfig:
    generations: int = 100
    max_new_tokens: int = 64
    gamma: int = 3
    depth: int = 2
    rtt_ms: float = 20.0
    jitter_ms: float = 2.0
    heartbeat_s: float = 1.0  # the edge's LinkSettings.heartbeat_s
    stall_s: float = 2.5  # > heartbeat_s * 1.5: the heartbeat must fire during the stall
    verifier_heartbeat_s: float = 2.0
    shutdown_timeout_s: float = 3.0
    extra_faults: int = 2  # up to this many faults besides the round-robin one
    generation_timeout_s: float = 180.0
    seed: int = 0


@dataclass
class GenerationResult:
    index: int
    faults: list[str]
    fired: list[str]
    completed: bool
    equal_uninterrupted: bool
    equal_target: bool
    reconnects: int
    seconds: float
    error: str | None = None


@dataclass
class ChaosReport:
    config: dict[str, Any]
    attempted: int = 0
    survived: int = 0
    equal_target_greedy: int = 0
    uninterrupted_equal_target: int = 0
    faults_planned: dict[str, int] = field(default_factory=dict)
    faults_fired: dict[str, int] = field(default_factory=dict)
    faults_skipped: dict[str, int] = field(default_factory=dict)  # a restart was under way
    reconnects: int = 0
    verifier_starts: int = 0
    restart_downtime_s: dict[str, float] = field(default_factory=dict)
    sigterm_exit_s: list[float] = field(default_factory=list)
    sigterm_exit_codes: list[int | None] = field(default_factory=list)
    going_away_seen: int = 0
    stall_detect_s: list[float] = field(default_factory=list)
    stalls_undetected: int = 0
    wall_s: float = 0.0
    failures: list[dict[str, Any]] = field(default_factory=list)

    def ok(self) -> bool:
        return (
            self.survived == self.attempted
            and self.stalls_undetected == 0
            and all(rc == 0 for rc in self.sigterm_exit_codes)
        )


class Recorder:
    """Wraps connect(): times every connection attempt and keeps why each link closed."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self.inner = connect
        self.attempts: list[float] = []
        self.closes: list[str] = []

    async def __call__(self) -> Transport:
        self.attempts.append(time.monotonic())
        t = await self.inner()
        rec = self

        class Recorded:
            async def send(self, data: bytes) -> None:
                await t.send(data)

            async def recv(self) -> bytes:
                try:
                    data: bytes = await t.recv()
                except LinkClosed as e:
                    rec.closes.append(str(e))
                    raise
                return data

            async def close(self) -> None:
                await t.close()

        return Recorded()


class Chaos:
    """Fires the planned faults of one generation as it commits tokens."""

    def __init__(self, rig: WanRig, cfg: ChaosConfig, report: ChaosReport) -> None:
        self.emu = rig.emu
        self.verifier = rig.verifier
        self.cfg = cfg
        self.report = report
        self.rng = random.Random(cfg.seed)
        self.tasks: list[asyncio.Task[None]] = []
        self.stalls: list[tuple[float, float]] = []  # (start, end) monotonic
        self.restart_downtimes: list[float] = []

    def plan(self, index: int, n_tokens: int) -> list[tuple[int, str]]:
        kinds = [FAULTS[index % len(FAULTS)]]
        kinds += self.rng.choices(FAULTS, k=self.rng.randint(0, self.cfg.extra_faults))
        at = sorted(self.rng.randint(1, max(1, n_tokens - 8)) for _ in kinds)
        return list(zip(at, kinds, strict=True))

    def fire(self, kind: str) -> None:
        rep = self.report
        if kind in ("kill", "term") and any(not t.done() for t in self.tasks):
            rep.faults_skipped[kind] = rep.faults_skipped.get(kind, 0) + 1
            return  # a restart is already under way
        rep.faults_fired[kind] = rep.faults_fired.get(kind, 0) + 1
        if kind in ("cut_up", "cut_down"):
            self.emu.drop_after_bytes(
                "up" if kind == "cut_up" else "down", self.rng.randrange(400), rst=True
            )
        elif kind == "drop":
            self.emu.drop_all(rst=self.rng.random() < 0.5)
        elif kind == "stall":
            now = time.monotonic()
            self.stalls.append((now, now + self.cfg.stall_s))
            self.emu.stall("both", self.cfg.stall_s)
        elif kind in ("kill", "term"):
            self.tasks.append(asyncio.ensure_future(self._restart(kind)))
        else:  # pragma: no cover
            raise ValueError(kind)

    async def _restart(self, kind: str) -> None:
        t0 = time.monotonic()
        if kind == "kill":
            await self.verifier.kill()
        else:
            rc, dt = await self.verifier.terminate(self.cfg.shutdown_timeout_s + 5.0)
            self.report.sigterm_exit_codes.append(rc)
            self.report.sigterm_exit_s.append(round(dt, 3))
        await asyncio.sleep(self.rng.uniform(0.0, 0.5))  # the host comes back after a while
        self.verifier.start()
        await self.verifier.wait_ready(120.0)
        self.restart_downtimes.append(time.monotonic() - t0)

    async def settle(self) -> None:
        """Wait for restarts in progress (bounded by wait_ready's timeout)."""
        if self.tasks:
            await asyncio.gather(*self.tasks)
            self.tasks.clear()


async def run(cfg: ChaosConfig, workdir: Path) -> ChaosReport:
    report = ChaosReport(config=asdict(cfg))
    t_start = time.monotonic()
    args = (
        f"--heartbeat={cfg.verifier_heartbeat_s} --shutdown-timeout={cfg.shutdown_timeout_s}"
        " --log-level=warning"
    ).split()
    link = LinkConfig(rtt_ms=cfg.rtt_ms, jitter_ms=cfg.jitter_ms, seed=cfg.seed)
    async with wan_rig(workdir, [TOKEN], args, link) as rig:
        retry = RetryPolicy(backoff_initial_s=0.05, backoff_max_s=1.0, handshake_timeout_s=10.0)
        agent = rig.agent(TOKEN, heartbeat_s=cfg.heartbeat_s, retry=retry)
        recorder = Recorder(agent.connect)
        agent.connect = recorder
        pcfg = PipelineConfig(gamma=cfg.gamma, depth=cfg.depth, sampling=SamplingParams(0.0))
        chaos = Chaos(rig, cfg, report)
        try:
            rng = random.Random(f"prompts-{cfg.seed}")
            cases = greedy_cases(rig.pair.target, rng, cfg.generations, 12, cfg.max_new_tokens)
            for i, (prompt, expected) in enumerate(cases):
                clean = await asyncio.wait_for(
                    agent.generate(prompt, pcfg, max_tokens=cfg.max_new_tokens),
                    cfg.generation_timeout_s,
                )
                report.uninterrupted_equal_target += clean.generated == expected
                res = await _chaos_generation(
                    i, prompt, clean.generated, expected, agent, pcfg, chaos
                )
                report.attempted += 1
                report.survived += res.completed and res.equal_uninterrupted
                report.equal_target_greedy += res.completed and res.equal_target
                report.reconnects += res.reconnects
                for k in res.faults:
                    report.faults_planned[k] = report.faults_planned.get(k, 0) + 1
                if not (res.completed and res.equal_uninterrupted):
                    report.failures.append(asdict(res))
                log.info(
                    "generation %d: %s, faults %s (fired %s), %d reconnects, %.1f s",
                    i,
                    "ok" if res.completed and res.equal_uninterrupted else "FAILED",
                    res.faults,
                    res.fired,
                    res.reconnects,
                    res.seconds,
                )
        finally:
            agent.close()
            await chaos.settle()
    report.verifier_starts = rig.verifier.starts
    report.going_away_seen = sum("code=1001" in c for c in recorder.closes)
    for start, end in chaos.stalls:
        seen = [t - start for t in recorder.attempts if start <= t < end]
        if seen:
            report.stall_detect_s.append(round(min(seen), 3))
        else:
            report.stalls_undetected += 1
    if chaos.restart_downtimes:
        d = chaos.restart_downtimes
        report.restart_downtime_s = {
            "mean": round(statistics.fmean(d), 2),
            "max": round(max(d), 2),
        }
    report.wall_s = round(time.monotonic() - t_start, 1)
    return report


async def _chaos_generation(
    index: int,
    prompt: list[int],
    clean: list[int],
    expected: list[int],
    agent: EdgeAgent,
    pcfg: PipelineConfig,
    chaos: Chaos,
) -> GenerationResult:
    cfg = chaos.cfg
    plan = chaos.plan(index, cfg.max_new_tokens)
    pending = list(plan)
    fired: list[str] = []

    def on_event(_event: AgentEvent) -> None:
        while pending and len(gen.generated) >= pending[0][0]:
            _, kind = pending.pop(0)
            fired.append(kind)
            chaos.fire(kind)

    gen = Generation(prompt, cfg.max_new_tokens)
    t0 = time.monotonic()
    error = None
    try:
        await asyncio.wait_for(agent.run(gen, pcfg, on_event=on_event), cfg.generation_timeout_s)
    except Exception as e:  # a failed generation is a result, not the end of the run
        error = f"{type(e).__name__}: {e}"
    await chaos.settle()
    chaos.emu.stall("both", 0)  # end a stall that outlived the generation
    return GenerationResult(
        index=index,
        faults=[k for _, k in plan],
        fired=fired,
        completed=error is None and gen.done,
        equal_uninterrupted=gen.generated == clean,
        equal_target=gen.generated == expected,
        reconnects=gen.stats.reconnects,
        seconds=round(time.monotonic() - t0, 2),
        error=error,
    )


def summary(report: ChaosReport) -> str:
    fired = Counter(report.faults_fired)
    lines = [
        f"survived {report.survived}/{report.attempted} generations "
        f"(text equal to the uninterrupted run; {report.equal_target_greedy} equal to "
        f"target-only greedy)",
        "faults fired: " + ", ".join(f"{k} {fired[k]}" for k in FAULTS),
        f"reconnects {report.reconnects}, verifier starts {report.verifier_starts}, "
        f"restart downtime {report.restart_downtime_s}",
        f"SIGTERM exits {report.sigterm_exit_codes} in {report.sigterm_exit_s} s; "
        f"GOING_AWAY closes seen by the edge: {report.going_away_seen}",
        f"stalls detected by the heartbeat in {report.stall_detect_s} s "
        f"(undetected: {report.stalls_undetected})",
        f"wall {report.wall_s} s",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    return config_parser(
        "python -m bench reliability",
        __doc__,
        ChaosConfig,
        "generations",
        "max_new_tokens",
        "gamma",
        "depth",
        "rtt_ms",
        "heartbeat_s",
        "stall_s",
        "extra_faults",
        "seed",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("wanspec.edge").setLevel(logging.ERROR)  # one line per reconnect
    logging.getLogger("testkit.net.wanem").setLevel(logging.WARNING)  # refused upstream connects
    _, report = run_command(ChaosConfig, args, "wanspec-chaos-", run, summary)
    return 0 if report.ok() else 1


if __name__ == "__main__":
    raise SystemExit(main())
