"""What a batched draft forward costs: B branches stepped together (outcome pre-drafting,
``Drafter.draft_many``) against one step of one sequence, on this machine's draft.

Each measurement: a prompt of ``--context`` tokens in the drafter's cache, B branches forked
from it at different points near its end (as pre-drafting forks them after alternatives of
the tokens in flight), then ``--steps`` steps of all B together, each timed (forward, sampling
transform and rivals: what a pre-drafting step costs the edge). The ratio cost(B) / cost(1)
gives the emulated cost of a batched step, 1 + A · (B − 1), fitted by least squares.

    python -m bench.draft_batch --out docs/results/draft_batch.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import torch

from bench.costs import DRAFT_BATCH_COST
from bench.provenance import provenance
from bench.run import load_draft_model, machine_info
from edge_agent.model.drafter import Drafter, DraftRow
from shared.maths.sampling import SamplingParams
from shared.runtime.models import load_model


@dataclass(frozen=True)
class CostStudy:
    """How a forward's cost grows with a size (a batch's branches, a verify's tree tokens):
    ``unit`` names the size, ``what`` the forward timed, ``base`` the size costs are relative
    to, ``emulated`` the bench's GPU-class slope; ``keys`` are the record's names for the
    medians, the measured slope and the emulated one."""

    unit: str
    what: str
    base: int
    emulated: float
    keys: tuple[str, str, str]

    def parser(self, prog: str, doc: str) -> argparse.ArgumentParser:
        """The options every study takes (the target, the context, the steps, the warm-up, the
        record); the tool adds its sizes and its own."""
        p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
        p.add_argument("--target", default="default")
        p.add_argument("--context", type=int, default=256)
        p.add_argument("--steps", type=int, default=12, help=f"measured {self.what}s per size")
        p.add_argument("--warmup", type=int, default=3)
        p.add_argument("--out", type=Path, default=None)
        return p

    def run(
        self,
        args: argparse.Namespace,
        sizes: list[int],
        times: Callable[[int, int, int], list[float]],
    ) -> None:
        """``times(size, steps, seed)`` for each size: ``args.warmup`` steps first, unmeasured
        (seed: the size), then the median of ``args.steps`` (seed: 100 + the size); the slope
        relative to ``base``; the record to ``args.out``."""
        median: dict[int, float] = {}
        for n in sizes:
            times(n, args.warmup, n)
            median[n] = statistics.median(times(n, args.steps, 100 + n))
            ms, per = 1000 * median[n], f"per {self.what} ({args.steps} steps)"
            print(f"{self.unit}={n}: median {ms:.1f} ms {per}", flush=True)
        fit = cost_slope(median, self.base)
        if fit is not None:
            x = self.unit if self.base == 0 else f"({self.unit} − {self.base})"
            print(
                f"cost({self.unit}) / cost({self.base}) ≈ 1 + {fit:.4f} {x} on this CPU; the "
                f"bench emulates a GPU-class device: 1 + {self.emulated:.4f} {x}"
            )
        if args.out:
            medians, measured, emulated = self.keys
            record = {
                "machine": machine_info(),
                "settings": {k: str(v) for k, v in vars(args).items()},
                medians: {str(n): median[n] for n in sizes},
                measured: fit,
                emulated: self.emulated,
                "provenance": provenance(),
            }
            args.out.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")


def cost_slope(median: dict[int, float], base: int) -> float | None:
    """The least-squares slope a of cost(n) / cost(base) = 1 + a (n − base) over the sizes
    measured (the extra cost per unit of batch or tree), or None when the first size measured
    is not ``base``."""
    sizes = list(median)
    if sizes[0] != base:
        return None
    xs = [n - base for n in sizes]
    ys = [median[n] / median[base] - 1 for n in sizes]
    return sum(x * y for x, y in zip(xs, ys, strict=True)) / max(1, sum(x * x for x in xs))


def measure(drafter: Drafter, context: int, batch: int, steps: int, seed: int) -> list[float]:
    """Seconds of each of ``steps`` steps of ``batch`` branches stepped together."""
    rng = np.random.default_rng(seed)
    vocab = drafter.vocab_size
    prompt = [int(t) for t in rng.integers(0, vocab, size=context)]
    params = SamplingParams(0.0)
    drafter.draft(DraftRow(prompt, params, rng, True))
    seqs = [[*prompt[: context - 1 - i % 8], int(rng.integers(vocab))] for i in range(batch)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = drafter.draft_many([DraftRow(s, params, rng, True, rival=True) for s in seqs])
        times.append(time.perf_counter() - t0)
        seqs = [[*s, step.token] for s, step in zip(seqs, out, strict=True)]
    drafter.release_branches()
    return times


def main(argv: list[str] | None = None) -> int:
    keys = ("median_step_s", "batch_cost_per_extra_branch", "emulated_batch_cost_per_extra_branch")
    study = CostStudy("B", "draft step", 1, DRAFT_BATCH_COST, keys)
    p = study.parser("python -m bench.draft_batch", __doc__)
    p.add_argument("--draft", default="self:skip=12")
    p.add_argument("--batches", default="1,2,4,8")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as the bench's edge process
    target = load_model(args.target)
    drafter = Drafter(load_draft_model(args.draft, target))
    sizes = [int(b) for b in args.batches.split(",")]
    study.run(args, sizes, lambda b, steps, seed: measure(drafter, args.context, b, steps, seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
