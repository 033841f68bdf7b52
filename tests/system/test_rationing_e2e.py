"""Rationing under load, end to end: real edges and a real verifier on tiny models, every
forward costing time per token (so that a loaded step's price cuts draft tails, as on a busy
GPU). The ration leaves speculative slots out (batches deferred to the next step, first batches
longer than their promise cut) and tells each edge its budget, and the text stays the target's:
greedy equality, and at T = 1 the tokens' law (sequential chi-square against the target's p_t).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.net.verifier import WrappedTarget
from cloud_verifier.engine.targets import TorchTarget
from edge_agent.session.generation import Generation
from edge_agent.session.pipeline_config import PipelineConfig
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams
from shared.runtime.batched_lm import Row
from shared.runtime.models import LoadedModel
from testkit.harness import target_greedy
from tests.stats import sequential_chi_square
from tests.system.test_edge_e2e import agent_for, near_draft, serve_app, target_rows

#: Seconds a forward costs per token it computes (its compute is the tiny model's, ~free).
PER_TOKEN_S = 0.003
PROMPTS = [[1, 10, 20, 30, 40], [1, 3, 5], [1, 50, 51, 52, 53], [1, 9], [1, 7, 7], [1, 60, 2]]


class PerToken(WrappedTarget):
    """A target whose forward takes ``PER_TOKEN_S`` per token more: a step's cost grows with
    its tokens, so a forward's overhead is worth few tokens and speculation has a price."""

    def __init__(self, inner: TorchTarget) -> None:
        super().__init__(inner, inner.description + " (per-token cost)")

    def forward(self, rows: Sequence[Row]) -> torch.Tensor:
        time.sleep(PER_TOKEN_S * sum(len(r.ids) for r in rows))  # on the engine's thread
        return self.inner.forward(rows)


async def _generate_all(
    url: str, draft: LoadedModel, cfg: PipelineConfig, n: int, seeds: Sequence[int]
) -> list[Generation]:
    agents = [agent_for(draft, url) for _ in PROMPTS]
    try:
        return await asyncio.gather(
            *(
                a.generate(p, cfg, max_tokens=n, seed=s)
                for a, p, s in zip(agents, PROMPTS, seeds, strict=True)
            )
        )
    finally:
        for a in agents:
            a.close()


async def test_greedy_text_under_load_with_drafts_rationed(
    aiohttp_server: Any, target: LoadedModel, tiny_model_dir: Path
) -> None:
    """A draft close to the target (long accepted runs, so the ration is often what ends a
    round)."""
    draft = near_draft(tiny_model_dir)
    url, state = await serve_app(
        aiohttp_server, lambda: PerToken(TorchTarget(target)), batch_wait_ms=5.0, cogen_ahead=0
    )
    cfg = PipelineConfig(gamma=6, depth=3, sampling=SamplingParams(0.0))
    gens = await _generate_all(url, draft, cfg, 40, range(len(PROMPTS)))
    for p, gen in zip(PROMPTS, gens, strict=True):
        assert gen.generated == target_greedy(target, p, 40), p
    assert state.engine.deferred_rounds > 0


async def test_sampled_text_under_load_with_drafts_rationed_is_the_targets(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    url, state = await serve_app(
        aiohttp_server, lambda: PerToken(TorchTarget(target)), batch_wait_ms=5.0, cogen_ahead=0
    )
    params = SamplingParams(1.0)
    cfg = PipelineConfig(gamma=6, depth=3, sampling=params, correction=CorrectionMode.CANDIDATES)
    gens = await _generate_all(url, draft, cfg, 150, range(300, 300 + len(PROMPTS)))
    # batches were deferred (cuts, which only a first batch longer than its promise gets, are
    # rare once the edges draft within their budgets: their law is tests/shared/test_exactness)
    assert state.engine.deferred_rounds > 0
    toks = np.array([t for g in gens for t in g.generated])
    rows = np.concatenate(
        [target_rows(target, p, g.generated, params) for p, g in zip(PROMPTS, gens, strict=True)]
    )
    pv = sequential_chi_square(toks, rows)
    assert pv > 1e-4, f"chi-square p-value {pv:.2e} over {len(toks)} tokens"


async def test_greedy_text_under_load_with_branches_and_the_pace_order(
    aiohttp_server: Any, target: LoadedModel, tiny_model_dir: Path
) -> None:
    """The scheduler's order by pace (a service level no session meets, so every session is
    behind it by its own measure and weighs differently) with pre-drafted branches grown beside
    each batch and sent to the verifier (token trees where a step has room, hedges for the
    co-generation after a rejection otherwise), co-generation and the free bonus on: the text
    is the target's greedy text, and branches were used."""
    draft = near_draft(tiny_model_dir)
    url, state = await serve_app(
        aiohttp_server, lambda: PerToken(TorchTarget(target)), batch_wait_ms=5.0,
        service_rate=500.0,
    )  # fmt: skip
    cfg = PipelineConfig(gamma=4, depth=2, sampling=SamplingParams(0.0), predraft=8, tree=True)
    gens = await _generate_all(url, draft, cfg, 40, range(len(PROMPTS)))
    for p, gen in zip(PROMPTS, gens, strict=True):
        assert gen.generated == target_greedy(target, p, 40), p
    hits = sum(g.stats.predraft_hits + g.stats.hedge_hits for g in gens)
    assert sum(g.stats.hedges_sent for g in gens) > 0
    assert hits + state.metrics.tree_branches_opened.get() > 0
