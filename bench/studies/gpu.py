"""GPU timings of the engine's runtime with the deployment pair's shapes (random weights, nothing
downloaded): a Qwen3-32B-shaped target and a Qwen3-0.6B-shaped draft, bf16. They give the
costs the benchmark emulates (:mod:`bench.lib.costs`).

    python -m bench gpu                      # CUDA only; writes docs/results/gpu_costs.json
    python -m bench gpu --small --device cpu --no-compile --out /tmp/gpu_costs.json  # a check

Measured, each the p50 over ``--reps`` steps after 3 unmeasured ones (compilation):

* verify: one verification step (batched forward of 1 + γ draft tokens per session after a
  ``--context``-token context, then the device-side decision, ``verify_logits``) for each of
  ``--batches``, eager and compiled (``torch.compile``);
* tree: one session's verify forward with N more token-tree tokens (branches of 4 forking inside
  the chain, with the tree mask) for each of ``--trees``, eager;
* draft step: one decode step of :class:`edge_agent.model.lm.CausalLM` at the same context,
  eager and compiled;
* draft batch: one decode step of B sessions of the draft together for each of
  ``--branches``, eager (pre-drafting's branches stepped together).

After each step every session is rolled back to its context (a pointer move), so every step sees
the same shapes. The file holds ``measured`` (milliseconds), ``costs`` (derived by
:func:`bench.lib.costs.derive`), ``setup`` and ``provenance`` (commit, date, machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from bench.lib.cli import study_parser
from bench.lib.cost_study import tree_row
from bench.lib.costs import derive
from cloud_verifier.engine import device_sampling as ds
from edge_agent.model.lm import CausalLM
from shared.maths.sampling import SamplingParams
from shared.runtime.batched_lm import BatchedLM, Row
from shared.runtime.kv_pool import SlotPages
from testkit.provenance import provenance

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


#: Steps run before the timed ones (compilation, caches), not counted.
WARMUP = 3


def _timed(prepare: Callable[[], Callable[[], object]], reps: int, device: str) -> float:
    """p50 ms of ``reps`` steps after :data:`WARMUP`: ``prepare()`` draws a step's inputs (not
    timed) and returns the step; the device is synchronised on either side of it."""
    times: list[float] = []
    for i in range(reps + WARMUP):
        step = prepare()
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return _p50(times)


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

    def prepare() -> Callable[[], object]:
        ids = rng.integers(0, v, (batch, gamma + 1))
        rows = [Row(s, context, tuple(ids[j].tolist()), gamma + 1) for j, s in enumerate(slots)]
        return lambda: ds.verify_logits(
            lm.forward(rows),
            params,
            ids[:, 1:].reshape(-1),
            np.full(batch * gamma, 0.5),
            ds.cu_from_gammas([gamma] * batch),
            ds.Corrections(["topk"] * batch, [False] * batch, gens),
        )

    p50 = _timed(prepare, reps, device)
    _release(lm, slots)
    return p50


def _prefill(lm: BatchedLM, sessions: int, context: int, room: int) -> list[SlotPages]:
    """``sessions`` slots, each with a random ``context``-token prefix in the cache and room for
    ``room`` more tokens."""
    rng = np.random.default_rng(2)
    assert lm.pool is not None
    slots = [SlotPages() for _ in range(sessions)]
    for s in slots:
        lm.pool.reserve(s, context + room)
        lm.forward([Row(s, 0, tuple(rng.integers(0, lm.vocab_size, context).tolist()), 1)])
        s.length = context
    return slots


def _release(lm: BatchedLM, slots: list[SlotPages]) -> None:
    assert lm.pool is not None
    for s in slots:
        lm.pool.release(s)


def tree_times(lm: BatchedLM, n: int, context: int, gamma: int, reps: int, device: str) -> float:
    """p50 ms of one session's verify forward: the chain (1 + γ tokens) and ``n`` more token-tree
    tokens in branches forking inside it (``n = 0``: the chain alone)."""
    rng = np.random.default_rng(3)
    (slot,) = _prefill(lm, 1, context, gamma + 1 + n)

    def prepare() -> Callable[[], object]:
        chain = rng.integers(0, lm.vocab_size, gamma + 1).tolist()
        extra = rng.integers(0, lm.vocab_size, n).tolist()
        row = tree_row(slot, context, chain, extra)
        return lambda: lm.forward([row])

    p50 = _timed(prepare, reps, device)
    _release(lm, [slot])
    return p50


def draft_batch_times(lm: BatchedLM, branches: int, context: int, reps: int, device: str) -> float:
    """p50 ms of one decode step of ``branches`` draft sessions together (one token each)."""
    rng = np.random.default_rng(4)
    slots = _prefill(lm, branches, context, 1)

    def prepare() -> Callable[[], object]:
        ids = rng.integers(0, lm.vocab_size, branches).tolist()
        rows = [Row(s, context, (ids[j],), 1) for j, s in enumerate(slots)]
        return lambda: lm.forward(rows)

    p50 = _timed(prepare, reps, device)
    _release(lm, slots)
    return p50


def draft_times(loaded: Any, context: int, reps: int, device: str, compiled: bool) -> float:
    """p50 ms of one draft decode step at ``context`` (extend one token, roll it back)."""
    rng = np.random.default_rng(1)
    lm = CausalLM(loaded, capacity=context + 64, compile_forward=compiled)
    lm.extend(rng.integers(0, loaded.vocab_size, context).tolist(), last_rows=1)

    def prepare() -> Callable[[], object]:
        lm.crop(context)  # the step before rolled back: every step extends the same context
        tok = int(rng.integers(0, loaded.vocab_size))
        return lambda: lm.extend([tok])

    return _timed(prepare, reps, device)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every timing of the module docstring, in ms, keyed as :func:`bench.lib.costs.derive` reads
    them (``verify_<mode>_b<B>_ms``, ``tree_eager_n<N>_ms``, ``draft_step_<mode>_ms``,
    ``draft_batch_eager_b<B>_ms``)."""
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    trees = [int(n) for n in args.trees.split(",")]
    branches = [int(b) for b in args.branches.split(",")]
    modes = [False] if args.no_compile else [False, True]
    target_shape, draft_shape = (SMALL, SMALL) if args.small else (QWEN3_32B, QWEN3_06B)
    out: dict[str, Any] = {}

    target = _model(target_shape, args.device, dtype)
    room = max(max(batches) * (args.context + 64), args.context + args.gamma + 1 + max(trees))
    for compiled in modes:
        lm = BatchedLM(target, target_shape["vocab_size"], compile_forward=compiled)
        lm.allocate(-(-room // 16) + 1, 16)
        key = "compiled" if compiled else "eager"
        for b in batches:
            ms = verify_times(lm, b, args.context, args.gamma, args.reps, args.device)
            out[f"verify_{key}_b{b}_ms"] = ms
            print(
                f"target verify γ={args.gamma} batch {b:2d} {key:8s} p50 {ms:8.2f} ms", flush=True
            )
        if not compiled:  # a tree's shapes vary with N: eager only
            for n in trees:
                ms = tree_times(lm, n, args.context, args.gamma, args.reps, args.device)
                out[f"tree_eager_n{n}_ms"] = ms
                print(f"target verify γ={args.gamma} + {n:2d} tree tokens p50 {ms:8.2f} ms")
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
    lm = BatchedLM(draft, draft_shape["vocab_size"])
    lm.allocate(-(-max(branches) * (args.context + 16) // 16) + 1, 16)
    for b in branches:
        ms = draft_batch_times(lm, b, args.context, args.reps, args.device)
        out[f"draft_batch_eager_b{b}_ms"] = ms
        print(f"draft decode step, {b:2d} branches together, eager p50 {ms:8.2f} ms", flush=True)
    return out


def record(args: argparse.Namespace, measured: dict[str, Any]) -> dict[str, Any]:
    """The results file: what was measured, the costs it gives, the setup, the provenance."""
    target, draft = ("small", "small") if args.small else ("Qwen3-32B", "Qwen3-0.6B")
    return {
        "what": "GPU-class costs the benchmark emulates (bench.lib.costs), measured with random "
        "weights in the deployment pair's shapes",
        "command": "python -m bench gpu " + " ".join(args.argv),
        "setup": {
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "dtype": "bfloat16" if args.device.startswith("cuda") else "float32",
            "target_shape": {"name": target, **(SMALL if args.small else QWEN3_32B)},
            "draft_shape": {"name": draft, **(SMALL if args.small else QWEN3_06B)},
            "weights": "random (AutoModelForCausalLM.from_config), nothing downloaded",
            "context": args.context,
            "gamma": args.gamma,
            "reps": args.reps,
            "statistic": "p50 over reps, after 3 unmeasured steps",
            "torch": torch.__version__,
        },
        "measured": measured,
        "costs": derive(measured),
        "provenance": provenance(),
    }


def main(argv: list[str] | None = None) -> int:
    p = study_parser("gpu", __doc__, paragraph=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="scaled-down shapes (a quick check)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--batches", default="1,8,32", help="sessions per batched verify")
    p.add_argument("--trees", default="0,8,16,35", help="token-tree tokens per verify")
    p.add_argument("--branches", default="1,2,4,8", help="draft sessions stepped together")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--out", type=Path, default=Path("docs/results/gpu_costs.json"))
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "bench gpu measures on a CUDA device and torch sees none here "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
            "for a check of the script on the CPU: "
            "python -m bench gpu --small --device cpu --no-compile --out /tmp/gpu_costs.json",
            file=sys.stderr,
        )
        return 2
    doc = record(args, measure(args))
    for name, cost in doc["costs"].items():
        print(f"{name} = {cost['value']:.4f} ({cost['basis']})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
