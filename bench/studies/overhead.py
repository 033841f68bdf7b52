"""Per-round overhead of the verifier, measured through the real code path.

Starts the service in-process on 127.0.0.1 (real aiohttp server, real WebSocket, the real session
code), then runs stop-and-wait rounds with a :class:`~testkit.probe.Driver`: each round is
encode Propose → send → server decode, checks, model job (forward + sampling transform +
decision), encode Verdict → client decode. Every forward is timed on the worker, so

    overhead of a round = client round trip − that round's model forward

With ``--model null:VOCAB`` (no model: logits are a lookup) the round trip is all overhead; with
``--model default`` the forward is SmolLM2-135M on the CPU verifying fixed + γ tokens.

    python -m bench overhead --model null:49152 --rounds 2000
    python -m bench overhead --model default --rounds 40
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence as Seq

import numpy as np
import torch
from aiohttp import ClientSession, web

from bench.lib.cli import study_parser
from bench.net.verifier import WrappedTarget
from cloud_verifier.daemon.app import STATE, build_app
from cloud_verifier.daemon.auth import Authenticator, generate_token
from cloud_verifier.daemon.settings import VerifierSettings
from cloud_verifier.engine.targets import Target, load_target
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams
from shared.runtime.batched_lm import Row
from shared.wire.messages import SUBPROTOCOL, Hello, ReplyMode, Verdict
from testkit.net.stream_ws import StreamWS
from testkit.probe import Driver, ProbeClient, auth_headers


class _TimedTarget(WrappedTarget):
    """Wraps a target so that every forward's duration lands in ``times``."""

    def __init__(self, inner: Target) -> None:
        super().__init__(inner)
        self.times: list[float] = []

    def forward(self, rows: Seq[Row]) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.inner.forward(rows)
        self.times.append(time.perf_counter() - t0)
        return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="null:49152", help="target spec (default: null:49152)")
    p.add_argument("--rounds", type=int, default=2000, help="measured rounds")
    p.add_argument("--warmup", type=int, default=20, help="rounds before measuring")
    p.add_argument("--gamma", type=int, default=5, help="draft tokens per round")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens (first Propose)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reply-mode", choices=ReplyMode.choices(), default=ReplyMode.VERDICT)
    p.add_argument("--correction", choices=CorrectionMode.choices(), default=CorrectionMode.TOPK)
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--seed", type=int, default=0)


def _ms(xs: np.ndarray) -> str:
    return (
        f"mean {xs.mean() * 1e3:.3f} ms  p50 {np.percentile(xs, 50) * 1e3:.3f} ms  "
        f"p99 {np.percentile(xs, 99) * 1e3:.3f} ms"
    )


async def measure(args: argparse.Namespace) -> dict[str, float]:
    settings = VerifierSettings(
        model=args.model,
        port=0,
        device=args.device,
        dtype=args.dtype,
        max_context=1 << 24,
        max_gamma=max(16, args.gamma),
        max_fixed=max(8192, args.prompt),
        heartbeat=0.0,
    )
    token = generate_token()
    holder: list[_TimedTarget] = []

    def loader() -> Target:
        t = _TimedTarget(load_target(args.model, device=args.device, dtype=args.dtype))
        holder.append(t)
        return t

    app = build_app(settings, auth=Authenticator([token]), loader=loader)
    state = app[STATE]
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        t_load = time.perf_counter()
        while state.status == "loading":
            await state.changed.wait()
            state.changed.clear()
        if state.status != "ready":
            raise RuntimeError(state.reason)
        print(f"model: {state.reason} (ready in {time.perf_counter() - t_load:.1f} s)")
        target = holder[0]
        rng = np.random.default_rng(args.seed)
        async with ClientSession() as http:
            ws = StreamWS(
                await http.ws_connect(
                    f"http://127.0.0.1:{port}/v1/session",
                    headers=auth_headers(token),
                    protocols=(SUBPROTOCOL,),
                )
            )
            client = ProbeClient(ws)
            hello = Hello(
                fingerprint=target.fingerprint,
                sampling=SamplingParams(temperature=args.temperature),
                reply_mode=args.reply_mode,
                correction=args.correction,
                seed=args.seed,
            )
            welcome = await client.hello(hello)
            driver = Driver(client, target.vocab_size, args.gamma, rng)
            driver.fixed = rng.integers(4, target.vocab_size, args.prompt).tolist()
            rtts: list[float] = []
            fwds: list[float] = []
            accepted: list[int] = []
            for i in range(args.warmup + args.rounds):
                if driver.pos + args.prompt + args.gamma + 1 > welcome.max_context:
                    print(f"stopping after {i} rounds: context limit {welcome.max_context}")
                    break
                n_fwd = len(target.times)
                reply = await driver.round()
                rtt = driver.last_round_trip_s
                if i < args.warmup:
                    continue
                rtts.append(rtt)
                fwds.append(sum(target.times[n_fwd:]))
                if isinstance(reply, Verdict):
                    accepted.append(reply.accepted)
            await ws.close()
    finally:
        await runner.cleanup()

    rtt_a, fwd_a = np.array(rtts), np.array(fwds)
    over = rtt_a - fwd_a
    m = state.metrics
    job_mean = m.verify_seconds.sum() / max(1, m.verify_seconds.count())
    print(f"rounds: {len(rtts)} (γ = {args.gamma}, T = {args.temperature}, {args.reply_mode})")
    if accepted:
        print(f"mean accepted per round: {np.mean(accepted):.2f}")
    print(f"client round trip      : {_ms(rtt_a)}")
    print(f"model forward          : {_ms(fwd_a)}")
    print(f"non-model overhead     : {_ms(over)}")
    print(
        f"server worker job mean : {job_mean * 1e3:.3f} ms (forward + transform + decision); "
        f"server handler mean {m.round_seconds.sum() / max(1, m.round_seconds.count()) * 1e3:.3f}"
        " ms"
    )
    return {
        "rtt_mean": float(rtt_a.mean()),
        "forward_mean": float(fwd_a.mean()),
        "overhead_mean": float(over.mean()),
        "overhead_p50": float(np.percentile(over, 50)),
        "overhead_p99": float(np.percentile(over, 99)),
    }


def main(argv: Seq[str] | None = None) -> int:
    parser = study_parser("overhead", None)
    add_arguments(parser)
    asyncio.run(measure(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
