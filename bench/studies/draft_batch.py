"""What a batched draft forward costs: B branches stepped together (outcome pre-drafting,
``Drafter.draft_many``) against one step of one sequence, on this machine's draft.

Each measurement: a prompt of ``--context`` tokens in the drafter's cache, B branches forked
from it at different points near its end (as pre-drafting forks them after alternatives of
the tokens in flight), then ``--steps`` steps of all B together, each timed (forward, sampling
transform and rivals: what a pre-drafting step costs the edge). The ratio cost(B) / cost(1)
gives the emulated cost of a batched step, 1 + A · (B − 1), fitted by least squares.

    python -m bench draft_batch --out docs/results/draft_batch.json
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from bench.lib.cost_study import CostStudy
from bench.lib.costs import DRAFT_BATCH_COST
from bench.lib.edge import load_draft_model
from edge_agent.model.drafter import Drafter, DraftRow
from shared.maths.sampling import SamplingParams
from shared.runtime.models import load_model


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
    p = study.parser("draft_batch", __doc__)
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
