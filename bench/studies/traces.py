"""Acceptance traces from the real models: the simulation's input (:mod:`bench.lib.traces`).

    python -m bench traces --out docs/results/bench/traces.json.gz --workers 2
    python -m bench traces --smoke --out /tmp/traces.json.gz    # tiny models, 2 prompts, 16 tokens

For each prompt of :mod:`bench.lib.prompts` the target generates greedily, as the autoregressive
baseline does (:func:`bench.lib.oracle.greedy_continuation`: prefill, then single-token steps), up
to ``--length`` tokens, stopping after (and including) the first EOS. The draft then runs one
teacher-forced forward over prompt + path: its logits at position ``len(prompt) - 1 + j``
predict ``path[j]``; their softmax (temperature 1, float64) gives the draft's top-k ids and
probabilities at every position of the path.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.lib.cli import study_parser
from bench.lib.oracle import greedy_continuation
from bench.lib.prompts import Prompt, Split, encode, load_prompts
from bench.lib.traces import Trace, TraceSet, load_traces, save_traces
from edge_agent.runtime.text import eos_ids
from shared.runtime.models import LoadedModel
from testkit.provenance import provenance

DEFAULT_TARGET = "default"
DEFAULT_DRAFT = "self:skip=12"
DEFAULT_LENGTH = 256
DEFAULT_TOP_K = 8
SMOKE_LENGTH = 16
SMOKE_PROMPTS = 2
#: A worker process's deadline (seconds): the real run takes about 25 minutes on 2 cores.
WORKER_TIMEOUT_S = 4 * 3600.0


def draft_top_along(
    draft: LoadedModel, prompt: Sequence[int], path: Sequence[int], top_k: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[float, ...], ...]]:
    """The draft's top-k ids and probabilities at each position of ``path`` after ``prompt``,
    from one teacher-forced forward over ``prompt + path``."""
    import torch

    if not prompt:
        raise ValueError("draft_top_along needs a non-empty prompt")
    if not path:
        return (), ()
    ids = torch.tensor([[int(t) for t in [*prompt, *path]]], device=draft.device)
    with torch.inference_mode():
        # The last len(path) + 1 positions; all but the last predict path[0], ..., path[-1].
        logits = draft.model(input_ids=ids, logits_to_keep=len(path) + 1).logits[0]
    rows = logits[:-1, : draft.vocab_size].to(torch.float64)
    probs = torch.softmax(rows, dim=-1)
    top_p, top = torch.topk(probs, min(top_k, probs.shape[-1]), dim=-1)
    return (
        tuple(tuple(int(t) for t in r) for r in top.tolist()),
        tuple(tuple(float(p) for p in r) for r in top_p.tolist()),
    )


def record_one(
    target: LoadedModel, draft: LoadedModel, prompt: Prompt, length: int, top_k: int = DEFAULT_TOP_K
) -> Trace:
    """One prompt's trace (see the module's docstring)."""
    ids = encode(target, prompt)
    stop = eos_ids(target)
    path = greedy_continuation(target, ids, length, stop)
    top, top_p = draft_top_along(draft, ids, path, top_k)
    return Trace(
        name=prompt.name,
        dataset=prompt.dataset,
        split=prompt.split,
        prompt=tuple(ids),
        path=tuple(path),
        eos=bool(path) and path[-1] in set(stop),
        draft_top=top,
        draft_top_p=top_p,
    )


def record(
    target: LoadedModel,
    draft: LoadedModel,
    prompts: Sequence[Prompt],
    length: int,
    top_k: int = DEFAULT_TOP_K,
    *,
    progress: bool = False,
) -> list[Trace]:
    """The traces of ``prompts``, in their order; ``progress`` prints a line per prompt."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    out = []
    for p in prompts:
        t0 = time.monotonic()
        trace = record_one(target, draft, p, length, top_k)
        out.append(trace)
        if progress:
            print(
                f"{trace.name}: prompt {len(trace.prompt)} tokens, path {len(trace.path)} tokens, "
                f"draft agreement {trace.agreement():.3f}, {time.monotonic() - t0:.1f} s",
                flush=True,
            )
    return out


def load_pair(target_spec: str, draft_spec: str) -> tuple[LoadedModel, LoadedModel]:
    """The target and the draft (a ``self:`` draft shares the target's weights)."""
    from bench.lib.edge import load_draft_model
    from shared.runtime.models import load_model

    target = load_model(target_spec)
    return target, load_draft_model(draft_spec, target)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = study_parser("traces", __doc__)
    p.add_argument("--out", type=Path, required=True, help="the trace file (.json.gz) to write")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model spec")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model spec")
    p.add_argument("--length", type=int, default=DEFAULT_LENGTH, help="path tokens at most")
    p.add_argument(
        "--split", default="measured,tuning", help="prompt sets, comma-separated (measured,tuning)"
    )
    p.add_argument("--per-dataset", type=int, default=None, help="at most N prompts a dataset")
    p.add_argument("--workers", type=int, default=1, help="processes sharing the prompts")
    p.add_argument("--smoke", action="store_true", help="tiny random models, 2 prompts, 16 tokens")
    # Internal: a worker records every n-th prompt from the i-th (``i/n``) into --out.
    p.add_argument("--shard", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.length < 1:
        p.error(f"--length must be >= 1, got {args.length}")
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if args.per_dataset is not None and args.per_dataset < 0:
        p.error(f"--per-dataset must be >= 0, got {args.per_dataset}")
    try:
        args.splits = [Split(s.strip()) for s in args.split.split(",") if s.strip()]
    except ValueError:
        p.error(f"--split: expected measured and/or tuning, got {args.split!r}")
    if not args.splits:
        p.error("--split names no prompt set")
    return args


def _prompts(args: argparse.Namespace) -> list[Prompt]:
    prompts = [
        p
        for s in args.splits
        for p in load_prompts(s, per_dataset=args.per_dataset, smoke=args.smoke)
    ]
    return prompts[:SMOKE_PROMPTS] if args.smoke else prompts


def _shard(text: str) -> tuple[int, int]:
    i, n = (int(x) for x in text.split("/"))
    if not 0 <= i < n:
        raise ValueError(f"--shard: expected i/n with 0 <= i < n, got {text!r}")
    return i, n


def _run_workers(args: argparse.Namespace, target: str, draft: str, n: int) -> list[Trace]:
    """Record the prompts in ``n`` worker processes (prompt k goes to worker k mod n); the
    traces come back in prompt order."""
    with tempfile.TemporaryDirectory(prefix="wanspec-traces-") as tmp:
        procs = []
        for i in range(n):
            cmd = [
                sys.executable, "-m", "bench", "traces",
                "--out", str(Path(tmp) / f"{i}.json.gz"),
                "--target", target, "--draft", draft, "--length", str(args.length),
                "--split", ",".join(s.value for s in args.splits),
                "--shard", f"{i}/{n}",
            ]  # fmt: skip
            if args.per_dataset is not None:
                cmd += ["--per-dataset", str(args.per_dataset)]
            if args.smoke:
                cmd.append("--smoke")
            procs.append(subprocess.Popen(cmd))
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        failed = []
        for i, proc in enumerate(procs):
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                raise RuntimeError(f"trace worker {i} ran past {WORKER_TIMEOUT_S:.0f} s") from None
            if rc != 0:
                failed.append(f"worker {i} exited {rc}")
        if failed:
            raise RuntimeError("trace workers failed: " + ", ".join(failed))
        parts = [list(load_traces(Path(tmp) / f"{i}.json.gz").traces) for i in range(n)]
    total = sum(len(p) for p in parts)
    return [parts[k % n][k // n] for k in range(total)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    prompts = _prompts(args)
    with tempfile.TemporaryDirectory(prefix="wanspec-traces-models-") as tmp:
        target_spec, draft_spec = args.target, args.draft
        length = args.length
        if args.smoke and args.shard is None:
            from testkit.tiny_models import build_tiny_model

            target_spec = str(build_tiny_model(Path(tmp) / "target", vocab_size=256, seed=0))
            draft_spec = str(build_tiny_model(Path(tmp) / "draft", vocab_size=256, seed=1))
            length = min(length, SMOKE_LENGTH)
            args.length = length
        if args.shard is not None:
            i, n = _shard(args.shard)
            target, draft = load_pair(target_spec, draft_spec)
            traces = record(target, draft, prompts[i::n], length, progress=True)
        elif not prompts:
            raise SystemExit("bench traces: no prompts to record (see --split, --per-dataset)")
        elif args.workers > 1:
            traces = _run_workers(args, target_spec, draft_spec, min(args.workers, len(prompts)))
        else:
            target, draft = load_pair(target_spec, draft_spec)
            traces = record(target, draft, prompts, length, progress=True)
    result = TraceSet(
        target=args.target if not args.smoke else "tiny:seed=0",
        draft=args.draft if not args.smoke else "tiny:seed=1",
        length=length,
        top_k=DEFAULT_TOP_K,
        provenance=provenance(),
        traces=tuple(traces),
    )
    save_traces(args.out, result)
    if args.shard is None:
        _summary(result)
        print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")
    return 0


def _summary(result: TraceSet) -> None:
    by: dict[str, list[Trace]] = {}
    for t in result.traces:
        by.setdefault(t.dataset, []).append(t)
    for dataset, ts in by.items():
        hits = sum(sum(t.draft_ok(j) for j in range(len(t.path))) for t in ts)
        n = sum(len(t.path) for t in ts)
        rate = hits / max(1, n)
        print(f"{dataset}: {len(ts)} prompts, {n} path tokens, draft agreement {rate:.3f}")


if __name__ == "__main__":
    sys.exit(main())
