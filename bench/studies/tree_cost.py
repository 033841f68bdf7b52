"""What a token tree costs the verifier: one verify forward of a chain (the last cached token and
γ draft tokens) against the same forward with N more tree tokens (branches forking inside the
chain, with the tree mask), on this machine's target.

Each measurement: a prompt of ``--context`` tokens in the target's cache, then ``--steps``
forwards of one row (the chain, then N tree tokens in branches of 4 forking at the chain's
positions in turn), each timed (the forward alone: what the tree adds to a verify). Nothing is
committed, so every forward sees the same cache. The ratio cost(N) / cost(0) gives the cost of a
tree token, 1 + a · N, fitted by least squares; the bench pads tree tokens at the GPU-class
figure instead (:data:`bench.lib.costs.TREE_TOKEN_COST`).

    python -m bench tree_cost --out docs/results/tree_cost.json
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from bench.lib.cost_study import CostStudy, tree_row
from bench.lib.costs import TREE_TOKEN_COST
from cloud_verifier.engine.targets import TorchTarget
from shared.runtime.batched_lm import Row
from shared.runtime.kv_pool import SlotPages
from shared.runtime.models import load_model


def measure(
    target: TorchTarget, context: int, gamma: int, n: int, steps: int, seed: int
) -> list[float]:
    """Seconds of each of ``steps`` verify forwards with ``n`` tree tokens."""
    rng = np.random.default_rng(seed)
    vocab = target.vocab_size
    lm = target
    pool = lm.pool
    assert pool is not None
    slot = SlotPages()
    prompt = [int(t) for t in rng.integers(0, vocab, size=context)]
    pool.reserve(slot, context + gamma + 1 + n)
    lm.forward([Row(slot, 0, tuple(prompt), 1)])
    pool.commit(slot, 0, prompt)
    times = []
    for _ in range(steps):
        chain = [prompt[-1], *(int(t) for t in rng.integers(0, vocab, size=gamma))]
        extra = [int(t) for t in rng.integers(0, vocab, size=n)]
        row = tree_row(slot, context - 1, chain, extra)
        t0 = time.perf_counter()
        lm.forward([row])
        times.append(time.perf_counter() - t0)
    pool.release(slot)
    return times


def main(argv: list[str] | None = None) -> int:
    keys = ("median_forward_s", "cost_per_tree_token", "emulated_cost_per_tree_token")
    study = CostStudy("N", "verify forward", 0, TREE_TOKEN_COST, keys)
    p = study.parser("tree_cost", __doc__)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--trees", default="0,4,8,16,32", help="tree tokens per forward")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as the bench's verifier process
    target = TorchTarget(load_model(args.target))
    sizes = [int(n) for n in args.trees.split(",")]
    target.allocate(num_pages=-(-(args.context + args.gamma + 1 + max(sizes)) // 16), page_size=16)
    study.run(
        args,
        sizes,
        lambda n, steps, seed: measure(target, args.context, args.gamma, n, steps, seed),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
