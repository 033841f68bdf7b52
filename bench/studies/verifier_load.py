"""Verifier load: N concurrent edge sessions against one verifier, the batched engine and the
serial engine (``--max-batch-sessions 1``: one session per forward) in the same run.

    python -m bench verifier_load                       # default model, CPU, N = 1 … 64
    python -m bench verifier_load --model null:151936   # everything but the model

For each engine a ``cloud-verifier serve`` process (same settings but ``max_batch_sessions``)
is started; for each N, N sessions (probe edges: stop-and-wait rounds of γ random draft tokens
after a 32-token prompt each, greedy target) run rounds for ``--seconds`` (and at least
``--min-rounds`` rounds each). Measured at the edges, on localhost (no WAN: the verifier's own
capacity):

* verified tokens/s: draft tokens the verifier scored (γ per round), summed over sessions;
* round p50 / p99: Propose sent → reply received.

Engine ``cloud-sd`` (``--engines …,cloud-sd``): the batched engine speculating by itself
(``cloud_draft = tail,ngram`` and ``--cloud-model``, ``--cloud-draft-tokens`` per step), its
sessions cloud-only (:class:`~testkit.probe.CloudOnlyDriver`: no edge draft, credits only).
Its figure is the text it writes, **tokens/s summed over sessions**: the capacity trade-off
against edge drafting, where the verifier only scores drafts (what an edge-drafted session
commits per verified draft token is its draft's acceptance, measured by ``python -m bench
realtime``). Its model drafts are as long as each session's measured acceptance pays for
(``cloud_draft_length = auto``); engine ``cloud-sd-fixed`` is the same with
``cloud_draft_length = fixed`` (always ``--cloud-draft-tokens``), the choice's trade-off.

Writes ``docs/results/verifier_load.json`` (``--out``): ``sessions`` and, aligned with it,
``batched_tokens_per_s``, ``serial_tokens_per_s``, ``batched_p50_ms``, ``batched_p99_ms``,
``serial_p50_ms``, ``serial_p99_ms``; and a plot beside it (``.png``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.lib.cli import study_parser
from bench.lib.verifier_state import fingerprint
from cloud_verifier.daemon.auth import generate_token
from edge_agent.session.generation import TokenSource
from shared.maths.sampling import SamplingParams
from shared.wire.messages import SUBPROTOCOL, Fingerprint, Hello
from testkit.harness import VerifierProcess, free_port, write_json, write_tokens
from testkit.net.stream_ws import StreamWS
from testkit.probe import CloudOnlyDriver, Driver, ProbeClient, auth_headers
from testkit.provenance import provenance

ENGINES = {"batched": 64, "serial": 1, "cloud-sd": 64, "cloud-sd-fixed": 64}
#: The engines whose sessions are cloud-only (their figure: the text written per second).
CLOUD = ("cloud-sd", "cloud-sd-fixed")


def _parse_sessions(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not out or min(out) < 1 or max(out) > 1024:
        raise argparse.ArgumentTypeError("sessions must be integers in 1..1024")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="target spec (default: default)")
    p.add_argument("--sessions", type=_parse_sessions, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--seconds", type=float, default=6.0, help="measured seconds per N")
    p.add_argument("--min-rounds", type=int, default=3, help="rounds per session at least")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per session")
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--engines", default="batched,serial", help="which engines, in order")
    p.add_argument(
        "--cloud-model",
        default="self:skip=12",
        help="the cloud-sd engine's draft model (a model spec; '' = tail and ngram only)",
    )
    p.add_argument("--cloud-draft-tokens", type=int, default=4, help="the cloud-sd engine's")
    p.add_argument("--threads", type=int, default=2, help="the verifier's torch threads")
    p.add_argument("--batch-wait-ms", type=float, default=2.0, help="the batched engine's")
    p.add_argument("--out", type=Path, default=Path("docs/results/verifier_load.json"))
    p.add_argument("--no-plot", action="store_true")


async def _session(
    http: aiohttp.ClientSession, url: str, token: str, fp: Fingerprint, seed: int, end: int = 0
) -> ProbeClient:
    """A greedy session; ``end`` > 0: co-generation up to that position (cloud-only)."""
    ws = StreamWS(await http.ws_connect(url, protocols=(SUBPROTOCOL,), headers=auth_headers(token)))
    client = ProbeClient(ws)
    hello = Hello(fingerprint=fp, sampling=SamplingParams(0.0), seed=seed, cogen_end=end)
    await client.hello(hello)
    return client


async def _measure_cloud(
    url: str, token: str, fp: Fingerprint, n: int, args: argparse.Namespace
) -> dict[str, Any]:
    """``n`` cloud-only sessions: tokens the verifier wrote in the window, and the share of
    them that were its own accepted draft tokens."""
    rng = np.random.default_rng(n)
    # Within a session's part of the pool (_start_engine: 1024 tokens per session at most N).
    max_new = 1024 - args.prompt - 16
    async with aiohttp.ClientSession() as http:
        prompts = [rng.integers(4, fp.vocab_size, args.prompt).tolist() for _ in range(n)]
        clients = await asyncio.gather(
            *(_session(http, url, token, fp, i, args.prompt + max_new) for i in range(n))
        )
        drivers = [CloudOnlyDriver(c, p, max_new) for c, p in zip(clients, prompts, strict=True)]
        # prefills and first tokens, not measured
        await asyncio.gather(*(d.run(0.0, min_tokens=1) for d in drivers))
        before = [len(d.gen.generated) for d in drivers]
        t0 = time.perf_counter()
        await asyncio.gather(*(d.run(t0 + args.seconds) for d in drivers))
        elapsed = time.perf_counter() - t0
        for c in clients:
            with contextlib.suppress(Exception):
                await c.ws.close()
    tokens = sum(len(d.gen.generated) - b for d, b in zip(drivers, before, strict=True))
    cloud = sum(d.gen.stats.sources[TokenSource.CLOUD_DRAFT] for d in drivers)
    total = sum(len(d.gen.generated) for d in drivers)
    return {"times": [elapsed], "elapsed": elapsed, "tokens": float(tokens),
            "cloud_share": cloud / total if total else 0.0}  # fmt: skip


async def _measure(
    url: str, token: str, fp: Fingerprint, n: int, args: argparse.Namespace
) -> dict[str, Any]:
    rng = np.random.default_rng(n)
    async with aiohttp.ClientSession() as http:
        clients = await asyncio.gather(*(_session(http, url, token, fp, i) for i in range(n)))
        drivers = []
        for i, c in enumerate(clients):
            d = Driver(c, fp.vocab_size, args.gamma, np.random.default_rng(1000 + i))
            d.fixed = rng.integers(4, fp.vocab_size, args.prompt).tolist()
            drivers.append(d)
        await asyncio.gather(*(d.round() for d in drivers))  # prefills, not measured
        times: list[float] = []
        t0 = time.perf_counter()
        stop = t0 + args.seconds

        async def run(d: Driver) -> int:
            rounds = 0
            while rounds < args.min_rounds or time.perf_counter() < stop:
                await d.round()
                times.append(d.last_round_trip_s)
                rounds += 1
            return rounds

        rounds = await asyncio.gather(*(run(d) for d in drivers))
        elapsed = time.perf_counter() - t0
        for c in clients:
            with contextlib.suppress(Exception):
                await c.ws.close()
    return {"times": times, "elapsed": elapsed, "rounds": float(sum(rounds))}


def _pooled(parts: list[dict[str, Any]], gamma: int) -> dict[str, float]:
    """One figure from several measuring windows of the same engine and N."""
    times = [t for p in parts for t in p["times"]]
    ms = np.array(times) * 1e3
    elapsed = sum(p["elapsed"] for p in parts)
    if "tokens" in parts[0]:  # cloud-only sessions: the text written
        return {
            "tokens_per_s": sum(p["tokens"] for p in parts) / elapsed,
            "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)),
            "cloud_share": float(np.mean([p["cloud_share"] for p in parts])),
        }
    rounds = sum(p["rounds"] for p in parts)
    return {
        "tokens_per_s": rounds * gamma / elapsed,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "rounds": rounds,
    }


async def _start_engine(
    name: str, args: argparse.Namespace, tmp: Path, token: str
) -> VerifierProcess:
    """The engine's ``serve`` process, ready and warm (its caller kills it)."""
    port = free_port()
    extra = [
        "--device", args.device,
        "--compile", args.compile,
        "--max-batch-sessions", str(ENGINES[name]),
        # twice the largest N: a measurement's sessions may still be closing on the verifier
        # when the next one's connect (each closes its WebSockets and goes on), and a refusal
        # for the connection limit would end the bench, not measure the engine
        "--max-sessions", str(2 * max(args.sessions)),
        "--max-sessions-per-token", "0",
        "--kv-cache-tokens", str(max(args.sessions) * 1024),
        # every probe session runs on one token: the shares would bound the bench, not the engine
        "--kv-session-share", "1", "--kv-token-share", "1",
        # capacity is the point: never refuse a session for its queueing delay
        "--max-queue-delay", "0",
        "--heartbeat", "0",
        "--batch-wait-ms", str(args.batch_wait_ms if ENGINES[name] > 1 else 0.0),
    ]  # fmt: skip
    if name in CLOUD:
        extra += [
            "--cloud-draft",
            "tail,ngram",
            "--cloud-draft-tokens",
            str(args.cloud_draft_tokens),
            "--cloud-draft-length",
            "fixed" if name == "cloud-sd-fixed" else "auto",
        ]
        if args.cloud_model:
            extra += ["--cloud-draft-model", args.cloud_model]
    proc = VerifierProcess(
        args.model,
        port,
        tmp / "tokens",
        args=extra,
        log_path=tmp / f"verifier-{name}.log",
        threads=args.threads,
    )
    proc.start()
    await proc.wait_ready(timeout=600)
    warm = argparse.Namespace(**{**vars(args), "seconds": 2.0})
    measure = _measure_cloud if name in CLOUD else _measure
    await measure(proc.url, token, fingerprint(args.model), 1, warm)  # first-use costs
    return proc


async def _measure_engines(
    procs: dict[str, VerifierProcess], args: argparse.Namespace, token: str
) -> dict[str, list[dict[str, float]]]:
    """Every engine at every N, in ABBA order within each N (each engine measured twice for
    half the seconds, the order reversed the second time), so that neither pays for going
    first (a machine's state drifts: measured here, the engine run first was 10-25 % slower
    at N = 1 whichever it was)."""
    fp = fingerprint(args.model)
    half = argparse.Namespace(**{**vars(args), "seconds": args.seconds / 2})
    rows: dict[str, list[dict[str, float]]] = {e: [] for e in procs}
    names = list(procs)
    for n in args.sessions:
        parts: dict[str, list[dict[str, Any]]] = {e: [] for e in names}
        for e in [*names, *reversed(names)]:
            measure = _measure_cloud if e in CLOUD else _measure
            parts[e].append(await measure(procs[e].url, token, fp, n, half))
        for e in names:
            r = _pooled(parts[e], args.gamma)
            print(
                f"{e:14s} N={n:3d}  {r['tokens_per_s']:8.1f} tok/s  "
                f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms",
                flush=True,
            )
            rows[e].append(r)
    return rows


def _plot(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    n = result["sessions"]
    for name, color in (
        ("batched", "tab:blue"),
        ("serial", "tab:orange"),
        ("cloud-sd", "tab:green"),
        ("cloud-sd-fixed", "tab:olive"),
    ):
        if f"{name}_tokens_per_s" in result:
            a.plot(n, result[f"{name}_tokens_per_s"], marker="o", color=color, label=name)
            b.plot(n, result[f"{name}_p99_ms"], marker="o", color=color, label=f"{name} p99")
            b.plot(n, result[f"{name}_p50_ms"], marker=".", linestyle="--", color=color,
                   label=f"{name} p50")  # fmt: skip
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sessions")
        ax.grid(alpha=0.3)
        ax.legend()
    a.set_ylabel("verified tokens/s (all sessions)")
    b.set_ylabel("round time (ms)")
    b.set_yscale("log")
    fig.suptitle(f"verifier load: {result['model']} on {result['device']}, γ = {result['gamma']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            raise SystemExit(f"unknown engine {e!r}: choose from {', '.join(ENGINES)}")
    result: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "gamma": args.gamma,
        "prompt": args.prompt,
        "seconds": args.seconds,
        "threads": args.threads,
        "batch_wait_ms": args.batch_wait_ms,
        "host": platform.processor() or platform.machine(),
        "sessions": args.sessions,
    }
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        token = generate_token()
        write_tokens(tmp / "tokens", [token])
        procs: dict[str, VerifierProcess] = {}
        try:
            for e in engines:
                procs[e] = await _start_engine(e, args, tmp, token)
            measured = await _measure_engines(procs, args, token)
        finally:
            for proc in procs.values():
                await proc.kill()
        for e, rows in measured.items():
            for key in ("tokens_per_s", "p50_ms", "p99_ms", "cloud_share"):
                if key in rows[0]:
                    result[f"{e}_{key}"] = [round(r[key], 3) for r in rows]
    if "batched" in engines and "serial" in engines:
        result["ratio"] = [
            round(b / s, 2)
            for b, s in zip(
                result["batched_tokens_per_s"], result["serial_tokens_per_s"], strict=True
            )
        ]
    return result


def main(argv: list[str] | None = None) -> int:
    p = study_parser("verifier_load", __doc__, full=True)
    add_arguments(p)
    args = p.parse_args(argv)
    result = asyncio.run(main_async(args))
    result["provenance"] = provenance()
    write_json(args.out, result, indent=1)
    if not args.no_plot:
        _plot(args.out.with_suffix(".png"), result)
    if "ratio" in result:
        print("batched / serial:", dict(zip(result["sessions"], result["ratio"], strict=True)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
