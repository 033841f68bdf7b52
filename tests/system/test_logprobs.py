"""The target's log-probabilities of the generated tokens (``PipelineConfig.logprobs``, sent
by the verifier in Logprobs frames): equal to the target's own log softmax of a forward over
the prompt and the text (teacher forcing), with the likeliest alternatives, in every
correction mode, with and without co-generation and cloud drafts."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from cloud_verifier.engine.targets import TorchTarget
from edge_agent.model.lm import CausalLM
from edge_agent.session.generation import Generation, TokenSource
from edge_agent.session.pipeline_config import PipelineConfig
from shared.maths.compression import Reconstruction
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams
from shared.runtime.models import LoadedModel
from tests.system.test_edge_e2e import TOKEN, agent_for, serve_app

PROMPT = [1, 10, 20, 30, 40]


def reference(target: LoadedModel, gen: Generation) -> torch.Tensor:
    """log softmax of the target's logits at every generated position: [n, V]."""
    lm = CausalLM(target, logits_window=None)
    with torch.inference_mode():
        logits = lm.extend(gen.committed)
    p = gen.prompt_len
    return torch.log_softmax(logits[p - 1 : len(gen.committed) - 1].double(), dim=-1)


def check(target: LoadedModel, gen: Generation, n: int) -> None:
    ref = reference(target, gen)
    entries = gen.token_logprobs(0, len(gen.generated))
    assert [e.token for e in entries] == gen.generated
    for j, e in enumerate(entries):
        assert e.logprob is not None, f"token {j} has no log-probability"
        assert e.logprob == pytest.approx(float(ref[j, e.token]), abs=1e-4), j
        assert len(e.top) == n
        want = torch.topk(ref[j], n)
        got_ids = [i for i, _ in e.top]
        got_lp = np.array([lp for _, lp in e.top])
        np.testing.assert_allclose(got_lp, want.values.numpy(), atol=1e-4)
        # the same ids, up to near-ties
        for i, lp in e.top:
            assert float(ref[j, i]) == pytest.approx(lp, abs=1e-4)
        assert len(set(got_ids)) == n


CASES = [
    pytest.param(0.0, CorrectionMode.CANDIDATES, True, id="greedy-cogen"),
    pytest.param(0.0, CorrectionMode.CANDIDATES, False, id="greedy-no-cogen"),
    pytest.param(1.0, CorrectionMode.CANDIDATES, True, id="candidates-cogen"),
    pytest.param(1.0, CorrectionMode.CANDIDATES, False, id="candidates"),
    pytest.param(1.0, CorrectionMode.TOPK, False, id="topk"),
    pytest.param(1.0, CorrectionMode.GREEDY_DRAFT, False, id="greedy-draft"),
]


@pytest.mark.parametrize("temperature,correction,cogen", CASES)
async def test_logprobs_are_the_targets_own(
    aiohttp_server: Any,
    target: LoadedModel,
    draft: LoadedModel,
    temperature: float,
    correction: CorrectionMode,
    cogen: bool,
) -> None:
    url, _ = await serve_app(aiohttp_server, lambda: TorchTarget(target))
    agent = agent_for(draft, url, TOKEN)
    try:
        cfg = PipelineConfig(
            gamma=3,
            depth=2,
            sampling=SamplingParams(temperature),
            correction=correction,
            cogen=cogen,
            logprobs=4,
        )
        gen = await agent.generate(PROMPT, cfg, max_tokens=48, seed=3)
    finally:
        agent.close()
    st = gen.stats
    if cogen:  # a fast verifier writes much of the text alone
        assert st.sources[TokenSource.COGENERATED] > 0
    else:
        assert st.rejections > 0  # corrections were scored too
    check(target, gen, 4)


async def test_logprobs_with_cloud_drafts(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    """The verifier's own accepted draft tokens (cloud speculation) are scored too."""
    url, _ = await serve_app(
        aiohttp_server,
        lambda: TorchTarget(target),
        cloud_draft="tail,ngram",
        cloud_draft_model="self:skip=1",
    )
    agent = agent_for(draft, url, TOKEN)
    try:
        cfg = PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(0.0), logprobs=0)
        gen = await agent.generate(PROMPT, cfg, max_tokens=40)
    finally:
        agent.close()
    assert gen.stats.sources[TokenSource.CLOUD_DRAFT] > 0
    check(target, gen, 0)


async def test_without_logprobs_no_frame_is_sent(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    """Opt-in: a session that does not ask gets no Logprobs frame (no bytes spent)."""
    url, _ = await serve_app(aiohttp_server, lambda: TorchTarget(target))
    agent = agent_for(draft, url, TOKEN)
    try:
        cfg = PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(1.0))
        plain = await agent.generate(PROMPT, cfg, max_tokens=24, seed=5)
        scored = await agent.generate(
            PROMPT, PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(1.0), logprobs=2),
            max_tokens=24, seed=5,
        )  # fmt: skip
    finally:
        agent.close()
    assert all(e.logprob is None for e in plain.token_logprobs(0, len(plain.generated)))
    assert all(e.logprob is not None for e in scored.token_logprobs(0, len(scored.generated)))


def test_logprobs_refuse_a_correction_they_cannot_score() -> None:
    with pytest.raises(ValueError, match="reconstruction A"):
        PipelineConfig(
            sampling=SamplingParams(1.0),
            correction=CorrectionMode.TOPK,
            reconstruction=Reconstruction.REDISTRIBUTED,
            logprobs=1,
        )
    with pytest.raises(ValueError, match=r"logprobs must be in 0\.\.20"):
        PipelineConfig(logprobs=21)
