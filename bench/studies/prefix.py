"""Prefix cache and chunked prefill: what a conversation's next turn and a shared system prompt
cost the verifier, with the prefix cache on and off, in the same run.

    python -m bench prefix                          # default model, CPU
    python -m bench prefix --model null:151936      # everything but the model (smoke)

Two ``cloud-verifier serve`` processes on the same model, ``prefix_cache = tenant`` and
``off`` (everything else the same, ``prefill_chunk`` at its default), on localhost (no WAN: the
verifier's own work). Sessions are cloud-only (:class:`~testkit.probe.CloudOnlyDriver`: the
prompt goes up in one frame and the verifier writes the answer by co-generation), greedy, all
on one bearer token:

* **conversation**: ``--turns`` turns; turn t is a new session whose prompt is the whole
  conversation so far (the previous prompt, its answer, and a new ``--user-tokens``-token
  message), as an OpenAI-compatible chat client sends it; each answer ``--answer-tokens``;
* **shared system prompt**: ``--sessions`` sessions one after another, each a
  ``--system-tokens``-token system prompt and its own ``--user-tokens``-token question.

Measured per session: time to first token (the prompt frame sent → the first token received),
the prompt tokens the verifier computed (its prompt minus the tokens it took from the cache,
``wanspec_prefix_cache_hit_tokens_total``) and the verifier's busy seconds
(``wanspec_engine_busy_seconds_total``). Prompts are random token ids of the model's
vocabulary (the cache matches tokens, not meaning). Writes ``docs/results/prefix_cache.json``
(``--out``).
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
from bench.lib.verifier_state import fingerprint, scrape
from cloud_verifier.daemon.auth import generate_token
from edge_agent.session.opening import hello_for
from edge_agent.session.pipeline_config import PipelineConfig
from shared.maths.sampling import SamplingParams
from shared.wire.messages import SUBPROTOCOL, Fingerprint
from testkit.harness import VerifierProcess, free_port, write_json, write_tokens
from testkit.net.stream_ws import StreamWS
from testkit.probe import CloudOnlyDriver, ProbeClient, auth_headers
from testkit.provenance import provenance

HIT = "wanspec_prefix_cache_hit_tokens_total"
BUSY = "wanspec_engine_busy_seconds_total"
MODES = ("tenant", "off")


def build_parser() -> argparse.ArgumentParser:
    p = study_parser("prefix", __doc__)
    p.add_argument("--model", default="default", help="target spec (default: default)")
    p.add_argument("--turns", type=int, default=4, help="turns of the conversation")
    p.add_argument("--sessions", type=int, default=8, help="sessions sharing a system prompt")
    p.add_argument("--system-tokens", type=int, default=1000, help="the shared system prompt")
    p.add_argument("--user-tokens", type=int, default=24, help="each user message")
    p.add_argument("--answer-tokens", type=int, default=16, help="each answer")
    p.add_argument("--threads", type=int, default=2, help="the verifier's torch threads")
    p.add_argument("--out", type=Path, default=Path("docs/results/prefix_cache.json"))
    return p


async def _turn(
    http: aiohttp.ClientSession, proc: VerifierProcess, token: str, fp: Fingerprint,
    prompt: list[int], answer: int,
) -> dict[str, Any]:  # fmt: skip
    """One session: ``prompt`` up, ``answer`` tokens back; its figures."""
    before = await scrape(http, proc.port)
    ws = StreamWS(
        await http.ws_connect(proc.url, protocols=(SUBPROTOCOL,), headers=auth_headers(token))
    )
    client = ProbeClient(ws)
    cfg = PipelineConfig(sampling=SamplingParams(0.0))
    await client.hello(hello_for(fp, cfg, 0, end=len(prompt) + answer))
    driver = CloudOnlyDriver(client, prompt, answer)
    t0 = time.perf_counter()
    await driver.run(0.0, min_tokens=1)
    ttft = time.perf_counter() - t0
    await driver.run(0.0, min_tokens=answer)
    with contextlib.suppress(Exception):
        await ws.close()
    after = await scrape(http, proc.port)
    hits = after.get(HIT, 0.0) - before.get(HIT, 0.0)
    return {
        "prompt_tokens": len(prompt),
        "cached_tokens": int(hits),
        "computed_tokens": len(prompt) - int(hits),
        "ttft_s": round(ttft, 4),
        "busy_s": round(after.get(BUSY, 0.0) - before.get(BUSY, 0.0), 4),
        "answer": driver.gen.generated,
    }


async def _run_mode(
    mode: str, args: argparse.Namespace, tmp: Path, token: str, fp: Fingerprint
) -> dict[str, Any]:
    proc = VerifierProcess(
        args.model,
        free_port(),
        tmp / "tokens",
        args=["--device", "cpu", "--prefix-cache", mode, "--heartbeat", "0",
              "--max-queue-delay", "0", "--kv-cache-tokens", "16384"],
        log_path=tmp / f"verifier-{mode}.log",
        threads=args.threads,
    )  # fmt: skip
    proc.start()
    try:
        await proc.wait_ready(timeout=600)
        rng = np.random.default_rng(0)  # the same prompts for both modes

        def tokens(n: int) -> list[int]:
            return [int(x) for x in rng.integers(4, fp.vocab_size, n)]

        async with aiohttp.ClientSession() as http:
            await _turn(http, proc, token, fp, tokens(8), 2)  # first-use costs, not measured
            conversation: list[dict[str, Any]] = []
            prompt = tokens(args.user_tokens)
            for _ in range(args.turns):
                turn = await _turn(http, proc, token, fp, prompt, args.answer_tokens)
                conversation.append(turn)
                prompt = [*prompt, *turn.pop("answer"), *tokens(args.user_tokens)]
            system = tokens(args.system_tokens)
            shared: list[dict[str, Any]] = []
            for _ in range(args.sessions):
                s = await _turn(
                    http, proc, token, fp, [*system, *tokens(args.user_tokens)], args.answer_tokens
                )
                s.pop("answer")
                shared.append(s)
    finally:
        await proc.kill()
    return {"conversation": conversation, "shared_system_prompt": shared}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    fp = fingerprint(args.model)
    result: dict[str, Any] = {
        "model": args.model,
        "device": "cpu",
        "threads": args.threads,
        "host": platform.processor() or platform.machine(),
        "turns": args.turns,
        "sessions": args.sessions,
        "system_tokens": args.system_tokens,
        "user_tokens": args.user_tokens,
        "answer_tokens": args.answer_tokens,
    }
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        token = generate_token()
        write_tokens(tmp / "tokens", [token])
        for mode in MODES:
            result[mode] = await _run_mode(mode, args, tmp, token, fp)
    for mode in MODES:
        conv = result[mode]["conversation"]
        shared = result[mode]["shared_system_prompt"]
        result[mode]["summary"] = {
            "ttft_last_turn_over_first": conv[-1]["ttft_s"] / conv[0]["ttft_s"] if conv else None,
            "shared_prompt_tokens_computed": sum(s["computed_tokens"] for s in shared),
            "shared_busy_s": round(sum(s["busy_s"] for s in shared), 3),
            "conversation_busy_s": round(sum(t["busy_s"] for t in conv), 3),
        }
    return result


def _print(result: dict[str, Any]) -> None:
    for mode in MODES:
        r = result[mode]
        print(f"prefix_cache = {mode}")
        for i, t in enumerate(r["conversation"], 1):
            print(
                f"  turn {i}: prompt {t['prompt_tokens']:5d}  computed {t['computed_tokens']:5d}"
                f"  ttft {t['ttft_s'] * 1000:8.1f} ms  busy {t['busy_s']:.3f} s"
            )
        for i, s in enumerate(r["shared_system_prompt"], 1):
            print(
                f"  shared {i}: prompt {s['prompt_tokens']:5d}  computed {s['computed_tokens']:5d}"
                f"  ttft {s['ttft_s'] * 1000:8.1f} ms  busy {s['busy_s']:.3f} s"
            )
        print(f"  {r['summary']}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = asyncio.run(main_async(args))
    _print(result)
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    result["provenance"] = provenance()
    write_json(args.out, result, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
