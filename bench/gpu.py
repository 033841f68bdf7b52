"""GPU timings of the engine's runtime with the deployment pair's shapes (random weights, nothing
downloaded): a Qwen3-32B-shaped target and a Qwen3-0.6B-shaped draft, bf16.

    python -m bench.gpu                      # CUDA only; writes docs/results/gpu.json
    python -m bench.gpu --small --device cpu # the same script on scaled-down shapes (a check)

Target: one verification step (batched forward of fixed 1 + γ draft tokens per session after a
512-token context, then the device-side decision, ``verify_logits``), p50 over ``--reps``
steps, for batch 1 / 8 / 32, eager and compiled (``torch.compile``). After each step every
session is rolled back to its context (a pointer move), so every step sees the same shapes.
Draft: one decode step of :class:`edge_agent.model.lm.CausalLM` at the same context, eager and
compiled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from cloud_verifier.engine import device_sampling as ds
from edge_agent.model.lm import CausalLM
from shared.maths.sampling import SamplingParams
from shared.runtime.batched_lm import BatchedLM, Row
from shared.runtime.kv_pool import SlotPages

QWEN3_32B = dict(
    hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
    head_dim=128, intermediate_size=25600, vocab_size=151936,
)  # fmt: skip
QWEN3_06B = dict(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, intermediate_size=3072, vocab_size=151936,
)  # fmt: skip
SMALL = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, intermediate_size=256, vocab_size=4096,
)  # fmt: skip


def _model(shape: dict[str, int], device: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM, Qwen3Config

    make: Any = Qwen3Config  # keyword arguments from a dict: not checkable
    cfg = make(**shape, max_position_embeddings=4096, tie_word_embeddings=False)
    build: Any = AutoModelForCausalLM.from_config  # untyped in transformers
    with torch.device(device):  # weights are created where they run (65 GB: not via the host)
        model = build(cfg, dtype=dtype)
    return model.eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _p50(times: list[float]) -> float:
    return round(float(np.percentile(np.array(times) * 1e3, 50)), 3)


def verify_times(
    lm: BatchedLM, batch: int, context: int, gamma: int, reps: int, device: str
) -> float:
    """p50 ms of one batched verification step (forward + device decision)."""
    rng = np.random.default_rng(0)
    v = lm.vocab_size
    assert lm.pool is not None
    slots = [SlotPages() for _ in range(batch)]
    for s in slots:  # prefill the context, one session at a time
        lm.pool.reserve(s, context + gamma + 1)
        lm.forward([Row(s, 0, tuple(rng.integers(0, v, context).tolist()), 1)])
        s.length = context
    params = [SamplingParams(1.0)] * batch
    gens = [torch.Generator(device=device).manual_seed(i) for i in range(batch)]
    times: list[float] = []
    for i in range(reps + 3):
        ids = rng.integers(0, v, (batch, gamma + 1))
        rows = [Row(s, context, tuple(ids[j].tolist()), gamma + 1) for j, s in enumerate(slots)]
        _sync(device)
        t0 = time.perf_counter()
        logits = lm.forward(rows)
        ds.verify_logits(
            logits,
            params,
            ids[:, 1:].reshape(-1),
            np.full(batch * gamma, 0.5),
            ds.cu_from_gammas([gamma] * batch),
            ds.Corrections(["topk"] * batch, [False] * batch, gens),
        )
        _sync(device)
        if i >= 3:  # warm-up steps (compilation) not counted
            times.append(time.perf_counter() - t0)
    for s in slots:
        lm.pool.release(s)
    return _p50(times)


def draft_times(loaded: Any, context: int, reps: int, device: str, compiled: bool) -> float:
    """p50 ms of one draft decode step at ``context`` (extend one token, roll it back)."""
    rng = np.random.default_rng(1)
    lm = CausalLM(loaded, capacity=context + 64, compile_forward=compiled)
    lm.extend(rng.integers(0, loaded.vocab_size, context).tolist(), last_rows=1)
    times: list[float] = []
    for i in range(reps + 3):
        tok = int(rng.integers(0, loaded.vocab_size))
        _sync(device)
        t0 = time.perf_counter()
        lm.extend([tok])
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
        lm.crop(context)
    return _p50(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="scaled-down shapes (a quick check)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--out", type=Path, default=Path("docs/results/gpu.json"))
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "bench.gpu measures on a CUDA device and torch sees none here "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
            "for a check of the script on the CPU: python -m bench.gpu --small --device cpu",
            file=sys.stderr,
        )
        return 2
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    modes = [False] if args.no_compile else [False, True]
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "shapes": "small" if args.small else "Qwen3-32B target, Qwen3-0.6B draft",
        "dtype": str(dtype).removeprefix("torch."),
        "context": args.context,
        "gamma": args.gamma,
        "torch": torch.__version__,
    }
    target_shape, draft_shape = (SMALL, SMALL) if args.small else (QWEN3_32B, QWEN3_06B)

    target = _model(target_shape, args.device, dtype)
    for compiled in modes:
        lm = BatchedLM(target, target_shape["vocab_size"], compile_forward=compiled)
        lm.allocate(-(-max(batches) * (args.context + 64) // 16), 16)
        key = "compiled" if compiled else "eager"
        for b in batches:
            ms = verify_times(lm, b, args.context, args.gamma, args.reps, args.device)
            out[f"verify_{key}_b{b}_ms"] = ms
            print(
                f"target verify γ={args.gamma} batch {b:2d} {key:8s} p50 {ms:8.2f} ms", flush=True
            )
        del lm
    del target
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    draft = _model(draft_shape, args.device, dtype)
    loaded = SimpleNamespace(model=draft, vocab_size=draft_shape["vocab_size"])
    for compiled in modes:
        key = "compiled" if compiled else "eager"
        ms = draft_times(loaded, args.context, args.reps, args.device, compiled)
        out[f"draft_step_{key}_ms"] = ms
        print(f"draft decode step {key:8s} p50 {ms:8.2f} ms", flush=True)
    for key in ("eager", "compiled"):
        b1, b8 = out.get(f"verify_{key}_b1_ms"), out.get(f"verify_{key}_b8_ms")
        if b1 and b8:
            # throughput of 8 sessions in one batch vs one session alone
            out[f"batch8_speedup_{key}"] = round(8 * b1 / b8, 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
