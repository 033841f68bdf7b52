"""Edge agent against a live verifier over real WebSockets, with tiny random models.

* greedy output equals target-only greedy output token for token, for every γ, D and mode;
* at T = 1 the emitted tokens are distributed as the target's: each x_t must be a draw from the
  target's p_t given the text before it, so the count O_j of each id j has mean E_j = Σ_t p_t(j)
  and variance Σ_t p_t(j)(1 − p_t(j)) <= E_j; Pearson's Σ (O_j − E_j)²/E_j is then (slightly
  conservatively) chi-square with |V| − 1 degrees of freedom. The draft's own samples must fail
  the same test (negative control);
* killing the connection mid-generation (twice) changes nothing in the text.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch

from cloud_verifier.daemon.state import STATE, VerifierState
from cloud_verifier.engine.targets import Target, TorchTarget
from edge_agent.link.connection import LinkSettings, TokenRefused, WebSocketTransport
from edge_agent.model.drafter import Drafter
from edge_agent.model.lm import CausalLM
from edge_agent.runtime.agent import EdgeAgent, HandshakeError, RetryPolicy
from edge_agent.session.events import Committed, GenerationEvent
from edge_agent.session.generation import TokenSource
from edge_agent.session.pipeline_config import Mode, PipelineConfig
from edge_agent.session.transport import LinkClosed, Transport
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams, transform
from shared.runtime.models import LoadedModel, load_model
from testkit.harness import target_greedy
from testkit.tiny_models import build_tiny_model
from tests.edge_helpers import SlowTarget
from tests.stats import sequential_chi_square
from tests.verifiers import KillAfter, serve_verifier, session_url

TOKEN = "e2e-token-abcdef0123456789"
PROMPT = [1, 10, 20, 30, 40]


async def serve_app(
    aiohttp_server: Any, loader: Callable[[], Target], **overrides: Any
) -> tuple[str, VerifierState]:
    """A verifier on ``loader``'s target, once ready: its session URL and its state (kept here
    under this name: tests/system/test_overload.py uses it)."""
    server = await serve_verifier(aiohttp_server, loader, auth=[TOKEN], **overrides)
    return session_url(server), server.app[STATE]


async def serve(aiohttp_server: Any, target: LoadedModel, **overrides: Any) -> str:
    url, _ = await serve_app(aiohttp_server, lambda: TorchTarget(target), **overrides)
    return url


def agent_for(draft: LoadedModel, url: str, token: str = TOKEN) -> EdgeAgent:
    link = LinkSettings(url=url, token=token, heartbeat_s=0)

    async def connect() -> Transport:
        return await WebSocketTransport.connect(link)

    retry = RetryPolicy(max_attempts=3, backoff_initial_s=0.01, backoff_max_s=0.05)
    return EdgeAgent(Drafter(draft), draft.fingerprint, connect, retry=retry)


GREEDY_CASES = [(g, d, Mode.PIPELINED) for g in (1, 3, 6) for d in (1, 2, 4)] + [
    (g, 1, Mode.STOP_AND_WAIT) for g in (1, 3, 6)
]


async def test_greedy_equals_target_only(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    """Every γ, D and mode: the text is the target's greedy text. The verifier does not
    co-generate (cogen_ahead = 0), so the edge's rounds write it all and each case runs the
    rollback path (with co-generation a fast verifier writes a short text alone)."""
    url = await serve(aiohttp_server, target, cogen_ahead=0)
    n = 40
    expected = target_greedy(target, PROMPT, n)
    agent = agent_for(draft, url)
    try:
        for gamma, depth, mode in GREEDY_CASES:
            cfg = PipelineConfig(gamma=gamma, depth=depth, mode=mode, sampling=SamplingParams(0.0))
            gen = await agent.generate(PROMPT, cfg, max_tokens=n, seed=1)
            assert gen.generated == expected, (gamma, depth, mode)
            st = gen.stats
            assert st.rejections > 0  # a random draft: the rollback path really ran
            if mode == Mode.STOP_AND_WAIT:
                assert st.discarded_batches == 0
    finally:
        agent.close()


async def test_concurrent_edges_each_get_target_greedy_text(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    """Four edges (own drafters, different prompts, pipelined and stop-and-wait) on one
    verifier at once: their forwards share batched steps, and each text is exactly the
    target-only greedy text of its prompt."""
    url, state = await serve_app(aiohttp_server, lambda: TorchTarget(target), batch_wait_ms=5.0)
    prompts = [PROMPT, [1, 3, 5], [1, 50, 51, 52, 53, 54, 55, 56], [1, 9]]
    modes = [(3, 2, Mode.PIPELINED), (2, 1, Mode.STOP_AND_WAIT), (4, 3, Mode.PIPELINED),
             (1, 1, Mode.STOP_AND_WAIT)]  # fmt: skip
    agents = [agent_for(draft, url) for _ in prompts]
    try:
        gens = await asyncio.gather(
            *(
                a.generate(
                    p,
                    PipelineConfig(gamma=g, depth=d, mode=m, sampling=SamplingParams(0.0)),
                    max_tokens=30,
                )
                for a, p, (g, d, m) in zip(agents, prompts, modes, strict=True)
            )
        )
    finally:
        for a in agents:
            a.close()
    for p, gen in zip(prompts, gens, strict=True):
        assert gen.generated == target_greedy(target, p, 30), p
    engine = state.engine
    assert engine.rows_forwarded > engine.forwards  # some forwards carried several sessions


@pytest.mark.parametrize("own_draft", [True, False], ids=["accepting", "rejecting"])
async def test_coalesced_verification_keeps_the_target_text(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel, own_draft: bool
) -> None:
    """A slow verifier (every forward +40 ms) behind a deep pipeline: Proposes queue up and are
    verified several per forward (coalescing), each answered with its own Verdict; the text is
    still exactly the target's greedy text, with a draft that is always right and with one that
    is often wrong (rejections inside coalesced batches)."""
    url, state = await serve_app(aiohttp_server, lambda: SlowTarget(TorchTarget(target), 0.04))
    agent = agent_for(target if own_draft else draft, url)
    try:
        cfg = PipelineConfig(gamma=2, depth=4, sampling=SamplingParams(0.0))
        gen = await agent.generate(PROMPT, cfg, max_tokens=40)
    finally:
        agent.close()
    assert gen.generated == target_greedy(target, PROMPT, 40)
    coalesced = state.metrics.coalesced.get()
    if own_draft:
        assert coalesced > 0 and gen.stats.rejections == 0
    else:
        assert gen.stats.rejections > 0


def near_draft(target_dir: Path) -> LoadedModel:
    """A draft close to the target (its output layer perturbed): often wrong, and then often
    right with its second choice (hedges and pre-drafted branches get used)."""
    near = load_model(str(target_dir))
    with torch.no_grad():
        w = near.model.get_output_embeddings().weight
        w += torch.randn(w.shape, generator=torch.Generator().manual_seed(3)) * 0.3 * w.std()
    return near


async def test_hedged_generation_keeps_the_target_text(
    aiohttp_server: Any, target: LoadedModel, tiny_model_dir: Path
) -> None:
    """A slow verifier (every forward +40 ms) behind a deep pipeline: the edge waits for room,
    and spends the wait drafting hedges (every position below confidence 1) that the verifier
    uses after its rejections; the text is exactly the target's greedy text."""
    url, state = await serve_app(aiohttp_server, lambda: SlowTarget(TorchTarget(target), 0.04))
    agent = agent_for(near_draft(tiny_model_dir), url)
    try:
        cfg = PipelineConfig(
            gamma=2, depth=2, sampling=SamplingParams(0.0), hedge=3, hedge_below=1.0
        )
        gen = await agent.generate(PROMPT, cfg, max_tokens=40)
    finally:
        agent.close()
    assert gen.generated == target_greedy(target, PROMPT, 40)
    st = gen.stats
    assert st.rejections > 0 and st.hedges_sent > 0 and 0 < st.hedge_bytes < st.uplink_bytes
    assert state.metrics.hedge_tokens.get() > 0 and st.hedge_hits > 0


@pytest.mark.parametrize("cogen", [True, False], ids=["cogen", "no-cogen"])
async def test_predrafted_outcomes_keep_the_target_text(
    aiohttp_server: Any, target: LoadedModel, tiny_model_dir: Path, cogen: bool
) -> None:
    """A slow verifier (every forward +40 ms) behind a full pipeline: the edge spends the wait
    preparing branches where a rejection is likeliest, and a rejection whose correction
    opens one sends it at once; the text is exactly the target's greedy text."""
    url, _ = await serve_app(aiohttp_server, lambda: SlowTarget(TorchTarget(target), 0.04))
    agent = agent_for(near_draft(tiny_model_dir), url)
    try:
        cfg = PipelineConfig(
            gamma=2, depth=2, sampling=SamplingParams(0.0), cogen=cogen, predraft=4
        )
        gen = await agent.generate(PROMPT, cfg, max_tokens=40)
    finally:
        agent.close()
    assert gen.generated == target_greedy(target, PROMPT, 40)
    st = gen.stats
    assert st.rejections > 0 and st.predraft_branches > 0 and st.predraft_hits > 0
    assert 0 < st.predraft_used_tokens <= st.predraft_tokens
    assert st.rejection_gaps > 0


async def test_token_trees_keep_the_target_text(
    aiohttp_server: Any, target: LoadedModel, tiny_model_dir: Path, monkeypatch: Any
) -> None:
    """Pre-drafted branches also go to the verifier as they grow (token trees): a batch is
    verified with the branches that fork inside it in one forward (grown beside it and sent
    before it, or sent while it waits behind the verifier's running work), and a rejection
    whose recovered token opens one commits its tokens at once; the text is exactly the
    target's greedy text. (The drafter steps a GPU's rows at once, 8, as a Jetson's does: on
    this CPU's 2, one branch grows beside each batch.)"""
    monkeypatch.setattr(Drafter, "BRANCH_BATCH_CPU", Drafter.BRANCH_BATCH_GPU)
    url, state = await serve_app(aiohttp_server, lambda: SlowTarget(TorchTarget(target), 0.04))
    agent = agent_for(near_draft(tiny_model_dir), url)
    try:
        cfg = PipelineConfig(gamma=2, depth=2, sampling=SamplingParams(0.0), predraft=8, tree=True)
        gen = await agent.generate(PROMPT, cfg, max_tokens=60)
    finally:
        agent.close()
    assert gen.generated == target_greedy(target, PROMPT, 60)
    st, m = gen.stats, state.metrics
    assert st.rejections > 0 and st.hedges_sent > 0 and st.predraft_branches > 0
    # trees rode, and branches were taken on the verifier: in a tree's forward, or (the
    # co-generation that runs at once after a rejection on an idle verifier) as hedges
    assert m.tree_branches.get() > 0
    assert m.tree_branches_opened.get() + st.hedge_hits > 0


async def test_a_conversations_next_turn_is_served_from_the_prefix_cache(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    """Turn 2 of a conversation (a new session whose prompt is turn 1's text and more) takes
    turn 1's full pages from the verifier's prefix cache and computes only the rest; another
    bearer token sending the same text gets no hit (tenants do not share by default); the text
    is the target's greedy text either way."""
    other = "e2e-other-token-0123456789"
    server = await serve_verifier(
        aiohttp_server, lambda: TorchTarget(target), auth=[TOKEN, other], kv_page_size=4
    )
    url, state = session_url(server), server.app[STATE]
    cfg = PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(0.0))
    agent = agent_for(draft, url)
    try:
        turn1 = await agent.generate(PROMPT, cfg, max_tokens=20)
        prompt2 = [*PROMPT, *turn1.generated, 11, 12, 13]
        turn2 = await agent.generate(prompt2, cfg, max_tokens=12)
    finally:
        agent.close()
    assert turn2.generated == target_greedy(target, prompt2, 12)
    hits = state.engine.memory()["prefix_hit_tokens"]
    assert hits >= len(PROMPT) + 20 - 4  # turn 1's text, in whole pages of 4
    # the verifier says so in its verdict; the edge counts it (the API's wanspec object)
    assert turn1.stats.prompt_cached_tokens == 0 and turn2.stats.prompt_cached_tokens == hits
    stranger = agent_for(draft, url, token=other)
    try:
        again = await stranger.generate(prompt2, cfg, max_tokens=12)
    finally:
        stranger.close()
    assert again.generated == turn2.generated
    assert state.engine.memory()["prefix_hit_tokens"] == hits
    assert again.stats.prompt_cached_tokens == 0


async def test_greedy_with_the_target_as_its_own_draft_accepts_everything(
    aiohttp_server: Any, target: LoadedModel
) -> None:
    url = await serve(aiohttp_server, target)
    agent = agent_for(target, url)
    try:
        cfg = PipelineConfig(gamma=4, depth=2, sampling=SamplingParams(0.0))
        gen = await agent.generate(PROMPT, cfg, max_tokens=32)
    finally:
        agent.close()
    assert gen.generated == target_greedy(target, PROMPT, 32)
    assert gen.stats.rejections == 0 and gen.stats.accepted_tokens == gen.stats.draft_tokens


def target_rows(
    target: LoadedModel, prompt: list[int], tokens: list[int], params: SamplingParams
) -> np.ndarray:
    """The target's p_t for every emitted token, given the text before it: [n, V]."""
    lm = CausalLM(target, logits_window=None)
    logits = lm.extend(prompt + tokens)  # [P + n, V] (teacher forcing)
    return transform(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].numpy(), params)


@pytest.mark.parametrize("correction", [CorrectionMode.CANDIDATES, CorrectionMode.GREEDY_DRAFT])
async def test_sampled_output_is_distributed_as_the_target(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel, correction: str
) -> None:
    url = await serve(aiohttp_server, target)
    params = SamplingParams(1.0)
    agent = agent_for(draft, url)
    toks, rows = [], []
    try:
        for i in range(4):
            prompt = [1, 5 + i, 9 + 2 * i]
            cfg = PipelineConfig(gamma=3, depth=2, sampling=params, correction=correction)
            gen = await agent.generate(prompt, cfg, max_tokens=300, seed=100 + i)
            assert gen.stats.rejections > 0
            toks += gen.generated
            rows.append(target_rows(target, prompt, gen.generated, params))
    finally:
        agent.close()
    pv = sequential_chi_square(np.array(toks), np.concatenate(rows))
    assert pv > 1e-4, f"{correction}: chi-square p-value {pv:.2e} over {len(toks)} tokens"


async def test_sampled_output_with_a_warm_prefix_cache_is_distributed_as_the_target(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    """The exactness check of the test above, with a warm prefix cache: each turn is a new
    session whose prompt is the previous turn's prompt and text and one more token, so its
    prefill claims the previous turn's pages (4 tokens a page) and computes only the rest."""
    url, state = await serve_app(aiohttp_server, lambda: TorchTarget(target), kv_page_size=4)
    params = SamplingParams(1.0)
    agent = agent_for(draft, url)
    toks, rows = [], []
    prompt = [1, 5, 9]
    try:
        for i in range(4):
            cfg = PipelineConfig(gamma=3, depth=2, sampling=params)
            gen = await agent.generate(prompt, cfg, max_tokens=250, seed=200 + i)
            toks += gen.generated
            rows.append(target_rows(target, prompt, gen.generated, params))
            prompt = [*prompt, *gen.generated[:60], 7]
    finally:
        agent.close()
    assert state.engine.memory()["prefix_hit_tokens"] >= 3 * 60  # the earlier turns, cached
    pv = sequential_chi_square(np.array(toks), np.concatenate(rows))
    assert pv > 1e-4, f"chi-square p-value {pv:.2e} over {len(toks)} tokens"


def test_chi_square_has_power_negative_control(target: LoadedModel, draft: LoadedModel) -> None:
    """The draft's own samples (not the target's) must fail the same test."""
    params = SamplingParams(1.0)
    rng = np.random.default_rng(0)
    lm = CausalLM(draft)
    all_toks, rows = [], []
    for i in range(4):
        prompt = [1, 5 + i, 9 + 2 * i]
        lm.reset()
        logits = lm.extend(prompt)[-1]
        toks = []
        for _ in range(300):
            q = transform(logits.numpy(), params)
            t = int(rng.choice(len(q), p=q))
            toks.append(t)
            logits = lm.extend([t])[0]
        all_toks += toks
        rows.append(target_rows(target, prompt, toks, params))
    assert sequential_chi_square(np.array(all_toks), np.concatenate(rows)) < 1e-6


@pytest.mark.parametrize("mode", [Mode.PIPELINED, Mode.STOP_AND_WAIT])
async def test_connection_killed_twice_text_unchanged(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel, mode: str
) -> None:
    url = await serve(aiohttp_server, target)
    n = 48
    expected = target_greedy(target, PROMPT, n)
    agent = agent_for(draft, url)
    killer = KillAfter(agent.connect, [5, 7])  # frames incl. Welcome
    agent.connect = killer
    try:
        cfg = PipelineConfig(gamma=3, depth=3, mode=mode, sampling=SamplingParams(0.0))
        gen = await agent.generate(PROMPT, cfg, max_tokens=n)
    finally:
        agent.close()
    assert killer.kills == 2
    assert gen.stats.reconnects == 2
    assert gen.generated == expected


async def test_verifier_restart_mid_generation(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    """The verifier's process state is lost (a new app on the same port): text unchanged."""
    url = await serve(aiohttp_server, target)
    expected = target_greedy(target, PROMPT, 40)
    agent = agent_for(draft, url)
    inner = agent.connect
    calls = 0

    async def connect() -> Transport:
        nonlocal calls
        calls += 1
        return await inner()

    agent.connect = KillAfter(connect, [4])
    try:
        gen = await agent.generate(
            PROMPT, PipelineConfig(gamma=2, sampling=SamplingParams(0.0)), max_tokens=40
        )
    finally:
        agent.close()
    assert calls == 2 and gen.generated == expected


async def test_wrong_token_and_wrong_tokenizer_are_clear_errors(
    aiohttp_server: Any, target: LoadedModel, tmp_path: Path
) -> None:
    url = await serve(aiohttp_server, target)
    other = load_model(str(build_tiny_model(tmp_path / "v80", vocab_size=80, seed=2)))
    cfg = PipelineConfig(sampling=SamplingParams(0.0))
    agent = agent_for(other, url)
    try:
        with pytest.raises(HandshakeError, match="vocabulary size differs"):
            await agent.generate(PROMPT, cfg, max_tokens=4)
    finally:
        agent.close()
    bad = agent_for(target, url, token="wrong")
    try:
        with pytest.raises(TokenRefused, match="refused the token"):
            await bad.generate(PROMPT, cfg, max_tokens=4)
    finally:
        bad.close()


async def test_unreachable_verifier_gives_up(draft: LoadedModel) -> None:
    agent = agent_for(draft, "ws://127.0.0.1:9/v1/session")
    try:
        with pytest.raises(LinkClosed, match="gave up"):
            await agent.generate(PROMPT, PipelineConfig(sampling=SamplingParams(0.0)), max_tokens=4)
    finally:
        agent.close()


@pytest.mark.slow
def test_demo_with_default_models() -> None:
    """``make demo`` (README, The two commands), for a few dozen tokens, with the real default
    models (enough that the edge has rounds: the verifier co-generates from the prompt on while
    the edge drafts)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "edge_agent.daemon.cli", "demo", "--max-tokens", "96", "--json"]
    out = subprocess.run(
        [*cmd, "--verbose"],
        capture_output=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    result = orjson.loads(out.stdout.decode().strip().splitlines()[-1])
    assert result["tokens"] > 0 and result["text"].strip()
    assert result["rounds"] > 0 and 0 < result["acceptance_rate"] <= 1
    # What goes up is token ids (and q_i(x_i) where the correction mode needs it), never a
    # distribution: a frame's header plus a few bytes an id. The ids: the prompt (sent once, in
    # the credit before the first batch), every draft token sent, kept or discarded, and each
    # correction or resample's token. How many rounds share the prompt's bytes depends on how
    # much the verifier co-generates meanwhile, so the bound is per frame and per id, not per
    # round. Frames: the Proposes, the credit and the Resamples. Beside them, the branches
    # sent to the verifier (token trees, ids only) within their budget, branch_uplink (256 B)
    # a batch sent, unspent bytes carried over up to four batches' worth.
    proposes = round(result["uplink_bytes"] / result["uplink_bytes_per_round"])
    frames = proposes + 1 + result["resamples"]
    ids = (
        result["prompt_tokens"] + result["draft_tokens"] + result["discarded_tokens"]
        + result["rejections"] + result["resamples"]
    )  # fmt: skip
    id_bytes = 2 + (0 if result["correction"] == "greedy_draft" else 4)  # 49,152 ids; float32 q
    rounds = result["uplink_bytes"] - result["branch_bytes"]
    assert rounds <= 24 * frames + id_bytes * ids, result
    assert result["branch_bytes"] <= 256 * (proposes + 1), result
    # The statistics in plain words, and (--verbose) the internals on a line of their own.
    err = out.stderr.decode().splitlines()
    n = result["tokens"]
    assert any(line.startswith(f"[stats] {n} tokens in ") for line in err), err[-5:]
    assert any(
        line.startswith(f"[details] {result['mode']} γ=") and " accepted/round over " in line
        for line in err
    ), err[-5:]


class Outage:
    """connect() that works, then (after the first session dies) refuses until told otherwise."""

    def __init__(self, inner: Any, kill_after_frames: int) -> None:
        self.killer = KillAfter(inner, [kill_after_frames])
        self.inner = inner
        self.phase = 0  # 0: up; 1: down; 2: up again
        self.while_down = 0

    async def __call__(self) -> Transport:
        if self.phase == 1 or (self.phase == 0 and self.killer.kills):
            self.phase = 1
            raise LinkClosed("test: verifier unreachable")
        if self.phase == 0:
            return await self.killer()
        return await self.inner()

    def on_event(self, ev: GenerationEvent) -> None:
        if self.phase == 1 and isinstance(ev, Committed):
            self.while_down += len(ev.ids)
            if self.while_down >= 6:
                self.phase = 2  # the verifier is back


async def test_link_down_wait_policy_fails_clearly(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    url = await serve(aiohttp_server, target)
    agent = agent_for(draft, url)
    outage = Outage(agent.connect, 4)
    agent.connect = outage
    agent.retry = RetryPolicy(backoff_initial_s=0.05, backoff_max_s=0.1, deadline_s=0.5)
    try:
        with pytest.raises(LinkClosed, match="no verifier reachable"):
            await agent.generate(
                PROMPT, PipelineConfig(sampling=SamplingParams(0.0)), max_tokens=60
            )
    finally:
        agent.close()
    assert outage.phase == 1


async def test_link_down_draft_only_policy_flags_and_resyncs(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel
) -> None:
    url = await serve(aiohttp_server, target)
    agent = agent_for(draft, url)
    outage = Outage(agent.connect, 4)
    agent.connect = outage
    agent.retry = RetryPolicy(
        backoff_initial_s=0.05, backoff_max_s=0.1, link_down="draft_only", deadline_s=0.5
    )
    # A draft step of 20 ms, like a real one: each pause between attempts drafts a few tokens.
    from bench.lib.edge import TimedDrafter

    agent.drafter = TimedDrafter(draft, 0.02)
    n = 40
    try:
        gen = await agent.generate(
            PROMPT,
            PipelineConfig(gamma=2, sampling=SamplingParams(0.0)),
            max_tokens=n,
            on_event=outage.on_event,
        )
    finally:
        agent.close()
    assert outage.phase == 2 and len(gen.generated) == n
    assert gen.unverified_tokens >= 6
    (start, end), *_ = gen.unverified
    assert start > 0 and end < n  # verified before, draft-only during, verified again after
    # before the outage: the target's greedy text; after: the target's greedy continuation of
    # the committed text (the verifier was re-synced from it, unverified tokens included)
    assert gen.generated[:start] == target_greedy(target, PROMPT, start)
    last = gen.unverified[-1][1]
    assert gen.generated[last:] == target_greedy(target, PROMPT + gen.generated[:last], n - last)


@pytest.mark.parametrize("edge_draft", [False, True], ids=["cloud-only", "hybrid"])
async def test_cloud_speculation_keeps_the_target_text(
    aiohttp_server: Any, target: LoadedModel, draft: LoadedModel, edge_draft: bool
) -> None:
    """A verifier that speculates by itself (cloud_draft = tail, ngram and a cloud draft model,
    ``self:skip=1`` of the target through the real loading path): with no draft model on the
    edge (cloud-only speculative decoding: the edge sends credits, the verifier writes the
    text) and with the edge drafting too (hybrid), the greedy text is the target's own, and
    the token sources say who wrote it."""
    url, state = await serve_app(
        aiohttp_server,
        lambda: TorchTarget(target),
        cloud_draft="tail,ngram",
        cloud_draft_model="self:skip=1",
    )
    if edge_draft:
        agent = agent_for(draft, url)
    else:
        link = LinkSettings(url=url, token=TOKEN, heartbeat_s=0)

        async def connect() -> Transport:
            return await WebSocketTransport.connect(link)

        agent = EdgeAgent(None, target.fingerprint, connect)
    try:
        cfg = PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(0.0))
        gen = await agent.generate(PROMPT, cfg, max_tokens=40)
    finally:
        agent.close()
    assert gen.generated == target_greedy(target, PROMPT, 40)
    sources = gen.stats.sources
    assert sum(sources.values()) == 40
    assert sources[TokenSource.CLOUD_DRAFT] > 0
    assert state.metrics.cloud_draft_tokens.get() >= sources[TokenSource.CLOUD_DRAFT]
    if not edge_draft:
        assert sources[TokenSource.EDGE_DRAFT] == 0 and sources[TokenSource.BONUS] == 1
    with pytest.raises(ValueError, match="cogen must be on"):
        await EdgeAgent(None, target.fingerprint, agent.connect).generate(
            PROMPT, PipelineConfig(cogen=False), max_tokens=4
        )
