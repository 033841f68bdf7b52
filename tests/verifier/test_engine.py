"""The batched engine: sessions of different lengths and positions in one forward give what each
gets alone (and what full uncached forwards give), rollbacks stay in their slot, slots and KV
pages are bounded, and the batched device path is exact (chi-square through the engine)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from cloud_verifier.engine.draft_length import draft_length
from cloud_verifier.engine.engine import (
    Engine,
    EngineClosed,
    EngineLimits,
    Outcome,
)
from cloud_verifier.engine.kv_manager import NoFreeSlot, Slot
from cloud_verifier.engine.prefix_cache import PrefixCache
from cloud_verifier.engine.step_times import DraftCost
from cloud_verifier.engine.targets import NullTarget, Target, TorchTarget
from cloud_verifier.engine.work import (
    CoGenerate,
    Crop,
    Cropped,
    Draw,
    Drawn,
    Failed,
    FailureKind,
    Federate,
    Federated,
    Verified,
    Verify,
    Withheld,
)
from shared.maths.rejection import CorrectionMode, try_candidates
from shared.maths.sampling import SamplingParams, transform
from shared.runtime.batched_lm import BatchedLM, Row
from shared.runtime.kv_pool import SlotPages
from shared.runtime.models import load_model
from shared.wire.messages import Fingerprint, Hello, Propose, ReplyMode
from tests.stats import ALPHA, chi_square_pvalue
from tests.waits import until

GREEDY = SamplingParams(temperature=0.0)


def _qwen3_target() -> TorchTarget:
    """A tiny random Qwen3 (the deployment pair's architecture: q/k norms, GQA, head_dim)."""
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = Qwen3ForCausalLM(cfg).eval()
    loaded = SimpleNamespace(
        model=model,
        vocab_size=64,
        fingerprint=Fingerprint("qwen3-tiny", 64, "t"),
        name="qwen3-tiny",
        device="cpu",
    )
    return TorchTarget(loaded)


@pytest.fixture(params=["llama", "qwen3"])
def target(request: pytest.FixtureRequest, tiny_model_dir: Path) -> TorchTarget:
    if request.param == "qwen3":
        return _qwen3_target()
    return TorchTarget(load_model(str(tiny_model_dir)))


def _full_argmax(target: TorchTarget, ids: list[int]) -> list[int]:
    """Reference: argmax of every position of one uncached forward."""
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    return [int(x) for x in logits.float().argmax(-1)]


def _propose(fixed: list[int], draft: list[int], pos: int) -> Propose:
    return Propose(
        epoch=0,
        seq=0,
        pos=pos,
        draft=np.array(draft, np.int64),
        q=np.ones(len(draft), np.float32),
        fixed=np.array(fixed, np.int64),
    )


#: An engine whose sessions share nothing (no KV shares, no prefix cache, no chunked
#: prefill) unless a test asks for it.
BARE: dict[str, Any] = {
    "session_share": 1.0,
    "tenant_share": 1.0,
    "prefix_cache": PrefixCache.OFF,
    "prefill_chunk": 0,
}


async def _engine(target: Target, **limits: Any) -> Engine:
    engine = Engine(
        EngineLimits(**{"slots": 8, "page_size": 4, "kv_tokens": 512, **BARE, **limits})
    )
    await engine.load(lambda: target)
    return engine


async def _together(engine: Engine, jobs: list[Callable[[], Awaitable[Outcome]]]) -> list[Outcome]:
    """Run jobs so that they reach the engine in one step: the engine's thread is held until
    every job has queued its request."""
    holding, gate = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        gate.wait()

    held = asyncio.ensure_future(engine.call(hold))
    await until(holding.is_set, 10.0, "the engine's thread held")
    tasks = [asyncio.ensure_future(job()) for job in jobs]
    await until(lambda: len(engine._queue) == len(jobs), 10.0, "every job's request queued")
    gate.set()
    await held
    return list(await asyncio.gather(*tasks))


class _Session:
    """One greedy session and what its cache must hold (the reference's view)."""

    def __init__(self, engine: Engine, target: TorchTarget) -> None:
        self.engine, self.target = engine, target
        self.slot: Slot = engine.open(Hello(fingerprint=target.fingerprint, sampling=GREEDY))
        self.committed: list[int] = []

    def verify(self, fixed: list[int], draft: list[int]) -> Callable[[], Awaitable[Outcome]]:
        work = Verify(_propose(fixed, draft, len(self.committed)), want_bonus=True)
        return lambda: self.engine.run(self.slot, work)

    def crop(self, n: int) -> Callable[[], Awaitable[Outcome]]:
        return lambda: self.engine.run(self.slot, Crop(n))

    def check(self, fixed: list[int], draft: list[int], outcome: Outcome) -> None:
        """The verdict equals argmax over full forwards; track the cache."""
        assert isinstance(outcome.result, Verified), outcome.result
        d = outcome.result.decision
        ctx = self.committed + fixed
        ref = _full_argmax(self.target, ctx + draft)
        accepted = next((i for i, x in enumerate(draft) if ref[len(ctx) - 1 + i] != x), len(draft))
        assert d.accepted == accepted
        nxt = ref[len(ctx) - 1 + accepted]
        assert (d.token if accepted < len(draft) else d.bonus) == nxt
        self.committed = ctx + draft[:accepted]
        assert self.slot.length == len(self.committed)


def _greedy(target: TorchTarget, ids: list[int], n: int, wrong_at: int | None) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(_full_argmax(target, out)[-1])
    draft = out[len(ids) :]
    if wrong_at is not None:
        draft[wrong_at] = (draft[wrong_at] + 1) % 64
    return draft


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "serial"])
async def test_ragged_batches_equal_full_forwards(target: TorchTarget, batch: bool) -> None:
    engine = await _engine(target, max_batch_sessions=8 if batch else 1)
    s = [_Session(engine, target) for _ in range(3)]
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], list(range(20, 34))]
    wrong = [1, None, 0]

    async def round_(plan: list[tuple[_Session, list[int], list[int]]]) -> None:
        before = engine.forwards
        outs = await _together(engine, [x.verify(f, d) for x, f, d in plan])
        for (x, f, d), o in zip(plan, outs, strict=True):
            x.check(f, d, o)
        assert engine.forwards - before == (1 if batch else len(plan))

    # 1. prefills of 3, 9 and 14 tokens in one forward, drafts rejected at 1, never, 0
    await round_(
        [(x, p, _greedy(target, p, 4, w)) for x, p, w in zip(s, prompts, wrong, strict=True)]
    )
    # 2. session 0 rolls back to 2 tokens, session 2 to nothing (a new prompt)
    outs = await _together(engine, [s[0].crop(2), s[2].crop(0)])
    assert all(isinstance(o.result, Cropped) for o in outs)
    s[0].committed, s[2].committed = s[0].committed[:2], []
    assert (s[0].slot.length, s[2].slot.length) == (2, 0)
    # 3. re-prefill after the rollbacks, in one forward with a session going on from its cache
    # with no fixed tokens (its last token is fed again to score draft[0])
    plan = [
        (s[0], [40, 41], _greedy(target, [*s[0].committed, 40, 41], 3, 2)),
        (s[1], [], _greedy(target, s[1].committed, 5, 3)),
        (s[2], [50, 51, 52, 53, 54, 55], _greedy(target, [50, 51, 52, 53, 54, 55], 2, None)),
    ]
    await round_(plan)
    # 4. and on, each from its own state
    await round_([(x, [7], _greedy(target, [*x.committed, 7], 4, i)) for i, x in enumerate(s)])
    assert engine.rows_forwarded == 9


async def test_slots_and_kv_pages_are_bounded(target: TorchTarget) -> None:
    engine = await _engine(target, slots=2, page_size=4, kv_tokens=16)
    a, b = _Session(engine, target), _Session(engine, target)
    with pytest.raises(NoFreeSlot):
        engine.open(Hello(fingerprint=target.fingerprint, sampling=GREEDY))
    assert engine.memory()["pages_total"] == 4 and engine.pages_free == 4
    # a needs 5 pages of the 4: refused, its cache untouched; b still runs
    big, small = list(range(5, 23)), [5, 6, 7]
    outs = await _together(engine, [a.verify(big, [1]), b.verify(small, [1])])
    assert isinstance(outs[0].result, Failed) and outs[0].result.kind == FailureKind.OUT_OF_PAGES
    assert outs[0].result.cache_len == 0 and a.slot.length == 0
    assert isinstance(outs[1].result, Verified)
    # a rollback gives whole pages back; a released slot gives its pages and its index back
    b.committed = [*small, *([1] if outs[1].result.decision.accepted else [])]
    assert engine.pages_free == 3
    await engine.run(b.slot, Crop(0))
    assert engine.pages_free == 4
    engine.release(a.slot)
    c = _Session(engine, target)
    assert c.slot.index == a.slot.index
    engine.shutdown()


async def test_work_refused_before_the_forward_says_why_by_its_kind(
    tiny_model_dir: Path,
) -> None:
    """Each refusal the runner finds before the forward carries its FailureKind (the core,
    the Error frame's text and the metrics name it), the slot left as it was."""
    target = TorchTarget(load_model(str(tiny_model_dir)))
    engine = await _engine(target, session_share=0.25)  # 128 of the 512 tokens
    s = _Session(engine, target)
    cases = [
        (Verify(_propose([5, 6], [7], pos=3), False), FailureKind.DESYNC),
        (Verify(_propose([], [7], pos=0), False), FailureKind.BAD_WORK),
        (Verify(_propose([5, target.vocab_size], [7], pos=0), False), FailureKind.BAD_WORK),
        (Verify(_propose([5] * 199, [7], pos=0), False), FailureKind.KV_QUOTA),
        (Draw(0, 0, 2), FailureKind.BAD_WORK),  # no rejected row kept
    ]
    assert target.max_length is not None
    too_long = _propose([5] * target.max_length, [7], pos=0)
    cases.append((Verify(too_long, False), FailureKind.CONTEXT))
    for work, kind in cases:
        out = await engine.run(s.slot, work)
        assert isinstance(out.result, Failed) and out.result.kind == kind, (work, out.result)
        assert out.result.cache_len == 0 and s.slot.length == 0
        assert not out.result.message.startswith(f"{kind}:"), out.result.message  # said once
    engine.shutdown()


async def test_a_failing_session_fails_alone(target: TorchTarget) -> None:
    """A batch that fails is run again one session at a time: only the culprit gets Failed,
    and its cache is as before the request."""
    engine = await _engine(target)
    a, b = _Session(engine, target), _Session(engine, target)
    runner = engine.require_runner()
    real = runner._decide

    def broken(planned: list[Any], probs: torch.Tensor) -> Any:
        if any(p.slot is a.slot for p in planned):
            raise RuntimeError("boom")
        return real(planned, probs)

    runner._decide = broken  # type: ignore[method-assign]
    f, d = [5, 6, 7], _greedy(target, [5, 6, 7], 3, None)
    outs = await _together(engine, [a.verify([1, 2], [3]), b.verify(f, d)])
    assert isinstance(outs[0].result, Failed) and outs[0].result.kind == FailureKind.MODEL
    assert "boom" in outs[0].result.message
    assert a.slot.length == 0 and a.slot.tokens == []
    b.check(f, d, outs[1])


def _open_many(
    engine: Engine, target: Target, params: SamplingParams, first_seed: int, n: int, **hello: Any
) -> list[Slot]:
    """``n`` sampled sessions, seeds ``first_seed`` on (one generator each)."""
    return [
        engine.open(
            Hello(fingerprint=target.fingerprint, sampling=params, seed=first_seed + i, **hello)
        )
        for i in range(n)
    ]


async def test_engine_path_is_exact_chi_square() -> None:
    """Sampled verification through the engine (many sessions per batched forward, each with its
    own generator): the first emitted token is distributed as p (candidates mode, Resample
    included), against the NumPy transform of the null target's logits."""
    v, n, chunk = 8, 6000, 200
    null = NullTarget(v)
    engine = await _engine(
        null, slots=chunk, max_batch_sessions=chunk, kv_tokens=chunk * 4, page_size=4
    )
    params = SamplingParams(temperature=0.8, top_k=6)
    fixed = 5
    logits = null._rows[(fixed * 31) % len(null._rows)].numpy()
    p = transform(logits, params)
    q = transform(np.linspace(-1.0, 1.0, v) * 2.0, params)
    rng = np.random.default_rng(7)
    out: list[int] = []
    for c0 in range(0, n, chunk):
        slots = _open_many(
            engine, null, params, c0, chunk, correction=CorrectionMode.CANDIDATES, m=2
        )
        drafts = rng.choice(v, chunk, p=q)
        jobs = []
        for slot, x in zip(slots, drafts, strict=True):
            prop = Propose(
                epoch=0,
                seq=0,
                pos=0,
                draft=np.array([x], np.int64),
                q=np.array([q[x]], np.float32),
                fixed=np.array([fixed], np.int64),
            )
            jobs.append(lambda slot=slot, prop=prop: engine.run(slot, Verify(prop, False)))
        before = engine.forwards
        outs = await _together(engine, jobs)
        assert engine.forwards - before == 1
        for slot, x, o in zip(slots, drafts, outs, strict=True):
            assert isinstance(o.result, Verified)
            d = o.result.decision
            if d.accepted:
                out.append(int(x))
                continue
            assert d.candidates is not None
            tok = try_candidates(d.candidates, q, rng)
            while tok is None:  # Resample: more candidates from the kept row
                more = await engine.run(slot, Draw(0, 1, 4))
                assert isinstance(more.result, Drawn)
                tok = try_candidates(more.result.candidates, q, rng)
            out.append(tok)
        for slot in slots:
            engine.release(slot)
    pv = chi_square_pvalue(np.array(out), p)
    assert pv > ALPHA, f"chi-square p-value {pv:.2e}"
    engine.shutdown()


async def test_a_cloud_draft_in_a_topk_session_is_exact_through_the_engine() -> None:
    """A CoGenerate's draft (the verifier's own, q a point mass) in a sampled topk session: the
    runner decides it by the greedy-draft rule (a recovered *token*, never a sparse
    correction), and the first token committed is distributed as p."""
    v, n, chunk = 8, 6000, 200
    null = NullTarget(v)
    engine = await _engine(
        null, slots=chunk, max_batch_sessions=chunk, kv_tokens=chunk * 4, page_size=4
    )
    params = SamplingParams(temperature=0.8, top_k=6)
    fixed = 5
    p = transform(null._rows[(fixed * 31) % len(null._rows)].numpy(), params)
    x = int(np.argmax(p))  # the draft: the likeliest token (accepted with probability p(x))
    out: list[int] = []
    for c0 in range(0, n, chunk):
        slots = _open_many(engine, null, params, c0, chunk, correction=CorrectionMode.TOPK)
        work = CoGenerate(
            0, np.array([fixed], np.int64), np.array([x], np.int64), np.ones(1, np.float32), True
        )
        jobs = [lambda slot=slot, work=work: engine.run(slot, work) for slot in slots]
        for o in await _together(engine, jobs):
            assert isinstance(o.result, Verified)
            d = o.result.decision
            assert d.sparse is None and d.candidates is None
            out.append(x if d.accepted else int(d.token))  # type: ignore[arg-type]
        for slot in slots:
            engine.release(slot)
    pv = chi_square_pvalue(np.array(out), p)
    assert pv > ALPHA, f"chi-square p-value {pv:.2e}"
    assert 0.2 < out.count(x) / n < 0.95  # both branches ran
    engine.shutdown()


def test_compiled_forward_equals_eager(tiny_model_dir: Path) -> None:
    """torch.compile'd forward (bucketed shapes; inductor on the CPU here, CUDA graphs where
    torch uses them) gives the eager logits, for ragged batches and after a rollback."""
    loaded = load_model(str(tiny_model_dir))
    eager = BatchedLM(loaded.model, 64)
    compiled = BatchedLM(loaded.model, 64, compile_forward=True)
    outs = []
    for lm in (eager, compiled):
        pool = lm.allocate(16, 8)
        a, b = SlotPages(), SlotPages()
        pool.reserve(a, 24)
        pool.reserve(b, 24)
        first = lm.forward([Row(a, 0, (5, 6, 7, 8, 9), 5), Row(b, 0, (1, 2, 3), 3)])
        a.length, b.length = 5, 3
        pool.crop(a, 2)  # rollback by pointer
        second = lm.forward([Row(a, 2, (10, 11), 2), Row(b, 3, (4,), 1)])
        outs.append(torch.cat([first, second]))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def test_a_compile_failure_falls_back_to_eager(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend that cannot compile (say, no Triton on a Jetson): one warning, then eager, and
    the failed call's result is computed eagerly."""
    loaded = load_model(str(tiny_model_dir))
    lm = BatchedLM(loaded.model, 64)
    pool = lm.allocate(4, 8)

    def broken(*args: Any) -> torch.Tensor:
        raise RuntimeError("no triton for this device")

    lm._run, lm.compiled = broken, True
    slot = SlotPages()
    pool.reserve(slot, 3)
    out = lm.forward([Row(slot, 0, (1, 2, 3), 3)])
    assert out.shape == (3, 64) and not lm.compiled
    assert "torch.compile failed (RuntimeError: no triton" in caplog.text


async def test_an_engine_bug_fails_the_step_and_the_engine_goes_on(target: TorchTarget) -> None:
    """An exception the step does not expect (a bug) answers every request of that step with
    Failed instead of leaving its session waiting; the next step runs normally."""
    engine = await _engine(target)
    a = _Session(engine, target)
    runner = engine.require_runner()
    real = runner._plan

    def broken(*args: Any) -> Any:
        raise TypeError("a bug")

    runner._plan = broken  # type: ignore[method-assign]
    out = await asyncio.wait_for(a.verify([1, 2], [3])(), 10)
    assert isinstance(out.result, Failed) and out.result.kind == FailureKind.ENGINE
    runner._plan = real  # type: ignore[method-assign]
    f, d = [5, 6, 7], _greedy(target, [5, 6, 7], 3, None)
    a.check(f, d, await a.verify(f, d)())
    assert engine.worker_alive()


async def test_a_cloud_draft_model_drafts_for_sessions_together_and_is_exact_greedy(
    tiny_model_dir: Path,
) -> None:
    """cloud_draft_model through the real loading path (``self:skip=1`` of the target, weights
    shared): three greedy sessions co-generate with model drafts in shared steps (one draft
    forward per draft token for all of them), and each text is the target's own greedy text."""
    from cloud_verifier.engine.draft_model import load_draft_target

    target = TorchTarget(load_model(str(tiny_model_dir)))
    engine = Engine(EngineLimits(slots=4, page_size=4, kv_tokens=512, **BARE))
    await engine.load(lambda: target, draft_loader=lambda t: load_draft_target("self:skip=1", t))
    runner = engine.require_runner()
    assert runner.drafter is not None
    prompts = [[1, 2, 3], [7, 8], [9, 10, 11, 12]]
    slots = [engine.open(Hello(fingerprint=target.fingerprint, sampling=GREEDY)) for _ in prompts]
    texts = [list(p) for p in prompts]
    drafted_any = 0
    for _ in range(4):
        jobs = []
        for slot, text in zip(slots, texts, strict=True):
            fixed = np.array(text[slot.length :], np.int64)
            work = CoGenerate(slot.length, fixed, cloud=True, model_tokens=3)
            jobs.append(lambda slot=slot, work=work: engine.run(slot, work))
        before = runner.drafter.forwards
        outs = await _together(engine, jobs)
        assert runner.drafter.forwards - before == 3  # batched: one forward per draft token
        for text, o in zip(texts, outs, strict=True):
            assert isinstance(o.result, Verified) and o.result.drafted is not None
            d, drafted = o.result.decision, o.result.drafted.tolist()
            assert len(drafted) == 3
            drafted_any += d.accepted
            token = d.token if d.accepted < 3 else d.bonus
            text += [*drafted[: d.accepted], token]
    for prompt, text in zip(prompts, texts, strict=True):
        n = len(text) - len(prompt)
        assert text == prompt + _greedy(target, prompt, n, None)
    assert drafted_any > 0  # the self-draft of a 2-layer model agrees now and then
    engine.shutdown()


async def test_cloud_model_drafts_keep_the_joint_law_of_two_tokens() -> None:
    """Sampled sessions co-generating with a cloud draft model (the target's own argmax: a
    greedy draft, q a point mass): the joint law of the first two committed tokens is the
    target's (chi-square over V² cells), with both acceptance and rejection exercised."""
    v, n, chunk = 8, 6000, 200
    null = NullTarget(v)
    limits = EngineLimits(
        slots=chunk, max_batch_sessions=chunk, kv_tokens=chunk * 8, page_size=4, **BARE
    )
    engine = Engine(limits)
    await engine.load(lambda: null, draft_loader=lambda t: NullTarget(v))
    params = SamplingParams(temperature=1.0)
    rows = null._rows.numpy()
    fixed = 5
    p1 = transform(rows[(fixed * 31) % len(rows)], params)
    joint = np.concatenate(
        [p1[a] * transform(rows[(a * 31 + 1) % len(rows)], params) for a in range(v)]
    )
    out: list[int] = []
    accepted = 0
    for c0 in range(0, n, chunk):
        slots = _open_many(engine, null, params, c0, chunk)
        first = CoGenerate(0, np.array([fixed], np.int64), cloud=True, model_tokens=2)
        jobs = [lambda slot=slot, w=first: engine.run(slot, w) for slot in slots]
        pairs: list[list[int]] = []
        for o in await _together(engine, jobs):
            assert isinstance(o.result, Verified) and o.result.drafted is not None
            d, drafted = o.result.decision, o.result.drafted.tolist()
            accepted += d.accepted
            pairs.append([*drafted[: d.accepted], int(d.token if d.accepted < 2 else d.bonus)])  # type: ignore[arg-type]
        short = [i for i, pr in enumerate(pairs) if len(pr) < 2]
        more = [
            lambda slot=slots[i], t=pairs[i][0]: engine.run(
                slot, CoGenerate(slot.length, np.array([t], np.int64), cloud=True, model_tokens=2)
            )
            for i in short
        ]
        for i, o in zip(short, await _together(engine, more), strict=True):
            assert isinstance(o.result, Verified) and o.result.drafted is not None
            d, drafted = o.result.decision, o.result.drafted.tolist()
            pairs[i].append(drafted[0] if d.accepted else int(d.token))  # type: ignore[arg-type]
        out += [a * v + b for a, b, *_ in pairs]
        for slot in slots:
            engine.release(slot)
    pv = chi_square_pvalue(np.array(out), joint)
    assert pv > ALPHA, f"chi-square p-value {pv:.2e}"
    assert 0.1 < accepted / n < 1.9  # drafts accepted and rejected
    engine.shutdown()


async def test_model_drafts_give_way_to_edge_drafted_work() -> None:
    """A step with an edge-drafted Verify: the co-generation beside it decodes one token (no
    draft forward delays the edge's row); alone, it drafts (model_drafts_allowed)."""
    v = 16
    null = NullTarget(v)
    engine = Engine(EngineLimits(slots=4, page_size=4, kv_tokens=256, **BARE))
    await engine.load(lambda: null, draft_loader=lambda t: NullTarget(v))
    runner = engine.require_runner()
    assert runner.drafter is not None
    edge, cloud = (engine.open(Hello(fingerprint=null.fingerprint, sampling=GREEDY)) for _ in "ab")
    verify = Verify(_propose([1, 2], [3, 4], 0), want_bonus=True)
    cogen = CoGenerate(0, np.array([5, 6], np.int64), cloud=True, model_tokens=3)
    outs = await _together(
        engine, [lambda: engine.run(edge, verify), lambda: engine.run(cloud, cogen)]
    )
    result = outs[1].result
    assert isinstance(result, Verified) and result.drafted is not None
    assert len(result.drafted) == 0 and runner.drafter.forwards == 0
    assert runner.drafts_deferred == 1 and result.withheld == Withheld.LOAD
    alone = CoGenerate(cloud.length, np.zeros(0, np.int64), cloud=True, model_tokens=3)
    result = (await engine.run(cloud, alone)).result
    assert isinstance(result, Verified) and result.drafted is not None
    assert len(result.drafted) == 3 and runner.drafter.forwards == 3
    engine.shutdown()


class _FixedCost(DraftCost):
    """c held at a value (the engine's own steps would move the measured one)."""

    def __init__(self, ratio: float) -> None:
        super().__init__()
        self._ratio = ratio

    @property
    def ratio(self) -> float:
        return self._ratio


async def test_a_sessions_model_draft_is_as_long_as_its_acceptance_pays_for() -> None:
    """cloud_draft_length = auto: per session and step, the model side drafts the length that
    maximises the expected tokens per unit of target time at the measured draft cost c
    (draft_length), none where the session's acceptance is below c (withheld: cost, no draft
    forward, one token decoded); sessions of one step draft together, each its own length."""
    v = 16
    null = NullTarget(v)
    engine = Engine(EngineLimits(slots=4, page_size=4, kv_tokens=256, **BARE))
    await engine.load(lambda: null, draft_loader=lambda t: NullTarget(v))
    runner = engine.require_runner()
    assert runner.drafter is not None
    runner.draft_cost = _FixedCost(0.5)
    poor, fair, good = (
        engine.open(Hello(fingerprint=null.fingerprint, sampling=GREEDY)) for _ in "abc"
    )
    works = {
        slot: CoGenerate(0, np.array([5, 6], np.int64), cloud=True, model_tokens=4, model_alpha=a)
        for slot, a in ((poor, 0.3), (fair, 0.7), (good, 0.97))
    }
    outs = await _together(engine, [lambda s=s, w=w: engine.run(s, w) for s, w in works.items()])
    lengths = []
    for o in outs:
        assert isinstance(o.result, Verified) and o.result.drafted is not None
        lengths.append(len(o.result.drafted))
    assert lengths == [draft_length(a, 0.5, 4) for a in (0.3, 0.7, 0.97)] == [0, 1, 4]
    first = outs[0].result
    assert isinstance(first, Verified) and first.withheld == Withheld.COST
    assert runner.drafts_declined == 1
    assert runner.drafter.forwards == 4  # batched: the longest draft's forwards
    # Fixed length (no acceptance carried): drafted as asked, whatever c.
    fixed = CoGenerate(poor.length, np.zeros(0, np.int64), cloud=True, model_tokens=3)
    result = (await engine.run(poor, fixed)).result
    assert isinstance(result, Verified) and result.drafted is not None
    assert len(result.drafted) == 3 and result.withheld is None
    engine.shutdown()


# ----------------------------------------------------------------------------- prefix cache


def _fed(fixed: list[int], draft: list[int], pos: int) -> Federate:
    return Federate(_propose(fixed, draft, pos))


async def _script(engine: Engine, target: TorchTarget, tenant_b: str) -> list[Any]:
    """One scripted run: session 1 (tenant a) prefills a 22-token prompt, verifies, rolls back
    and verifies again; then session 2 (tenant a) and session 3 (``tenant_b``) open with
    prompts that share its first 16 tokens (4 pages of 4), and session 4 (tenant a) with a
    prompt that forks inside the shared pages and rolls back into them; every result."""
    rng = np.random.default_rng(5)
    prompt = [int(x) for x in rng.integers(1, 64, 22)]
    hello = Hello(
        fingerprint=target.fingerprint,
        sampling=SamplingParams(1.0),
        reply_mode=ReplyMode.FEDERATED,
        k=8,
    )
    out: list[Any] = []
    s1 = engine.open(hello, tenant="a")
    out.append((await engine.run(s1, _fed(prompt, [3, 4, 5], 0))).result)
    out.append((await engine.run(s1, Crop(20))).result)  # a rollback inside its own pages
    out.append((await engine.run(s1, _fed([9], [6, 7], 20))).result)
    engine.release(s1)
    for tenant, tail in (("a", [40, 41, 42]), (tenant_b, [40, 41, 42])):
        s = engine.open(hello, tenant=tenant)
        text = [*prompt[:16], *tail]
        out.append((await engine.run(s, _fed(text, [8, 9], 0))).result)
        out.append((await engine.run(s, Crop(14))).result)  # back into the shared pages
        out.append((await engine.run(s, _fed([50, 51], [10], 14))).result)
        engine.release(s)
    s = engine.open(hello, tenant="a")  # the first prompt again: a re-prefill
    out.append((await engine.run(s, _fed(prompt, [3, 4, 5], 0))).result)
    engine.release(s)
    return out


async def test_verdicts_are_the_same_with_and_without_the_prefix_cache() -> None:
    """The prefix cache and chunked prefill change what is computed when, never what comes
    out: the same script on engines with the cache (per tenant, global), with prefills in
    chunks of 5 tokens and with a pool so small that cached pages are evicted gives the sparse
    rows of one without either (ids equal, probabilities within float tolerance); tenant a's
    second session and its re-prefill claim the shared pages, tenant b's only in the global
    namespace; rollbacks into shared pages copy them."""
    target = _qwen3_target()
    runs = {}
    # (cache, chunk, pool tokens): 8 pages of 4 make the later sessions evict cached pages
    configs = [(m, 0, 512) for m in PrefixCache]
    configs += [(PrefixCache.OFF, 5, 512), (PrefixCache.TENANT, 5, 512)]
    configs += [(PrefixCache.TENANT, 0, 32), (PrefixCache.GLOBAL, 5, 32)]
    for mode, chunk, kv in configs:
        engine = await _engine(target, prefix_cache=mode, prefill_chunk=chunk, kv_tokens=kv)
        pool = engine.pool
        assert pool is not None
        result = await _script(engine, target, "b")
        runs[mode, chunk, kv] = (result, engine.memory(), pool.copies)
        engine.shutdown()
    ref = runs[PrefixCache.OFF, 0, 512][0]
    for key in configs[1:]:
        got = runs[key][0]
        assert len(got) == len(ref)
        for a, b in zip(ref, got, strict=True):
            assert type(a) is type(b)
            if isinstance(a, Federated):
                for x, y in zip(a.dists, b.dists, strict=True):
                    assert x.ids.tolist() == y.ids.tolist()
                    np.testing.assert_allclose(x.probs, y.probs, atol=1e-5)
                np.testing.assert_allclose(a.p_draft, b.p_draft, atol=1e-5)
            assert a.cache_len == b.cache_len  # type: ignore[union-attr]
    hits = {key: memory["prefix_hit_tokens"] for key, (_, memory, _) in runs.items()}
    assert hits[PrefixCache.OFF, 0, 512] == hits[PrefixCache.OFF, 5, 512] == 0
    # a's second session (16), the re-prefill (20: its last prompt token is computed)
    assert hits[PrefixCache.TENANT, 0, 512] == hits[PrefixCache.TENANT, 5, 512] == 16 + 20
    assert hits[PrefixCache.GLOBAL, 0, 512] == 16 + 16 + 20  # and tenant b's
    assert runs[PrefixCache.TENANT, 0, 512][2] >= 1  # a rollback into a shared page copied it
    for small in ((PrefixCache.TENANT, 0, 32), (PrefixCache.GLOBAL, 5, 32)):
        assert runs[small][1]["prefix_evictions"] > 0  # the same verdicts after evictions


async def test_a_full_pool_evicts_idle_cached_pages_before_refusing_anyone() -> None:
    """With every page either held or cached, a new session's pages come from the idle cached
    ones (least recently used first); only pages that sessions hold make a pool full."""
    target = _qwen3_target()
    engine = await _engine(target, kv_tokens=32, prefix_cache=PrefixCache.TENANT)  # 8 pages
    hello = Hello(fingerprint=target.fingerprint, sampling=GREEDY)
    a = engine.open(hello, tenant="a")
    result = (
        await engine.run(a, Verify(_propose(list(range(1, 30)), [2], 0), want_bonus=False))
    ).result
    assert isinstance(result, Verified)
    engine.release(a)
    await until(lambda: engine.memory()["pages_used"] == 0, 5.0, "a's pages released")
    assert engine.memory()["pages_cached"] == 7 and engine.pages_free == 8
    b = engine.open(hello, tenant="b")  # another tenant: no hit, its pages evict a's
    result = (
        await engine.run(b, Verify(_propose(list(range(31, 59)), [2], 0), want_bonus=False))
    ).result
    assert isinstance(result, Verified), result
    memory = engine.memory()
    assert memory["prefix_evictions"] >= 6 and memory["prefix_hit_tokens"] == 0
    engine.shutdown()


async def test_a_long_prefill_in_chunks_does_not_hold_up_another_sessions_round() -> None:
    """Chunked prefill: a 200-token prompt and another session's short round arrive together;
    with chunks of 16 the short round is answered in the first step (its row never padded to
    the prompt: at most to the chunk, or in a forward of its own) while the prompt takes 10
    steps; without chunking both wait for one step that computes the whole prompt. The long
    session's verdict is the same either way."""
    target = _qwen3_target()
    rng = np.random.default_rng(9)
    prompt = [int(x) for x in rng.integers(1, 64, 200)]
    hello = Hello(fingerprint=target.fingerprint, sampling=GREEDY)
    seen = {}
    for chunk in (0, 16):
        engine = await _engine(target, prefill_chunk=chunk, kv_tokens=1024)
        long, short = engine.open(hello), engine.open(hello)
        first = await engine.run(short, Verify(_propose([1, 2, 3], [4], 0), want_bonus=True))
        assert isinstance(first.result, Verified) and first.result.cache_len is not None
        forwards = engine.forwards  # (counted before a step's outcomes are handed out)
        jobs = [
            (long, Verify(_propose(prompt, [5, 6], 0), want_bonus=True)),
            (short, Verify(_propose([7], [8, 9], first.result.cache_len), want_bonus=True)),
        ]
        outs = await _together(engine, [lambda e=engine, s=s, w=w: e.run(s, w) for s, w in jobs])
        seen[chunk] = (outs, engine.forwards - forwards)
        engine.shutdown()
    (long0, short0), forwards0 = seen[0]
    (long16, short16), forwards16 = seen[16]
    # one step: the short round's row in the prompt's forward (padded) or in its own
    assert forwards0 in (1, 2) and short0.timing is not None
    assert short0.timing.padded_tokens in (2 * 202, 202 + 3)
    # nine chunks of 16, then the last 56 (a round's size: DECODE_FIXED) whole, with the draft:
    # ten steps (the first may split the round from the chunk)
    assert forwards16 in (10, 11) and short16.timing is not None
    assert short16.timing.padded_tokens <= 2 * 16
    assert long16.timing is not None and long16.timing.padded_tokens == 56 + 2
    for a, b in ((long0, long16), (short0, short16)):
        assert isinstance(a.result, Verified) and isinstance(b.result, Verified)
        assert a.result.decision == b.result.decision
        assert a.result.cache_len == b.result.cache_len


def test_the_cpu_pool_is_sized_to_the_model_and_the_machine(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    """kv_tokens = auto on the CPU: 16,384 tokens, but never more than a tenth of the
    machine's memory (at least 1,024 tokens)."""
    from cloud_verifier.engine import engine as engine_module

    target = TorchTarget(load_model(str(tiny_model_dir)))
    per_token = target.kv_bytes_per_token()
    monkeypatch.setattr(engine_module, "_physical_memory", lambda: 1 << 40)
    assert engine_module._auto_kv_tokens(target) == 16384
    monkeypatch.setattr(engine_module, "_physical_memory", lambda: 4000 * per_token * 10)
    assert engine_module._auto_kv_tokens(target) == 4000
    monkeypatch.setattr(engine_module, "_physical_memory", lambda: 0)  # unknown
    assert engine_module._auto_kv_tokens(target) == 16384
    monkeypatch.setattr(engine_module, "_physical_memory", lambda: per_token)
    assert engine_module._auto_kv_tokens(target) == 1024


async def test_logprobs_of_a_rejection_and_its_resample() -> None:
    """Hello.logprobs through the engine: a rejection's Verified carries the log softmax of
    the logits (the model's own, not the sampling transform's) at each accepted position and of
    every candidate the edge may pick at the rejected one; a Resample's Drawn carries its new
    candidates' from the row kept for it; the n likeliest alternatives come with each."""
    v = 8
    null = NullTarget(v)
    engine = await _engine(null)
    params = SamplingParams(temperature=0.8, top_k=6)
    fixed = 5
    try:
        for seed in range(40):
            slot = engine.open(
                Hello(fingerprint=null.fingerprint, sampling=params, seed=seed,
                      correction=CorrectionMode.CANDIDATES, m=2, logprobs=3)
            )  # fmt: skip
            draft = np.array([1, 2, 3], np.int64)
            prop = Propose(0, 0, 0, draft, np.full(3, 0.9, np.float32), np.array([fixed]))
            out = (await engine.run(slot, Verify(prop, False))).result
            assert isinstance(out, Verified) and out.logprobs is not None
            d, lp = out.decision, out.logprobs
            if d.candidates is None:
                engine.release(slot)
                continue
            text = [fixed, *draft[: d.accepted].tolist()]
            rows = torch.stack([null._rows[(t * 31 + i) % len(null._rows)] for i, t in
                                enumerate(text)])  # fmt: skip
            ref = torch.log_softmax(rows.double(), dim=-1)  # [accepted + 1, V]
            a = d.accepted
            assert lp.positions == a + 1 and lp.last == len(d.candidates.ids)
            want = [float(ref[j, draft[j]]) for j in range(a)]
            want += [float(ref[a, int(c)]) for c in d.candidates.ids]
            np.testing.assert_allclose(lp.lp, want, atol=1e-5)
            np.testing.assert_allclose(
                lp.top_lp.reshape(a + 1, 3), torch.topk(ref, 3).values.numpy(), atol=1e-5
            )
            more = (await engine.run(slot, Draw(0, 1 + a, 4))).result
            assert isinstance(more, Drawn) and more.logprobs is not None
            np.testing.assert_allclose(
                more.logprobs.lp, [float(ref[a, int(c)]) for c in more.candidates.ids], atol=1e-5
            )
            assert more.logprobs.positions == 1 and len(more.logprobs.top_ids) == 3
            engine.release(slot)
            return
        raise AssertionError("no rejection in 40 sessions")
    finally:
        engine.shutdown()


async def _rounds(engine: Engine, slot: Slot) -> None:
    """Another session generating: a short round, again and again (cropped back each time), so
    a prefill beside it gets the shared chunk budget, not the whole step."""
    while True:
        await engine.run(slot, Verify(_propose([7], [8], 0), want_bonus=True))
        await engine.run(slot, Crop(0))


async def test_a_call_waits_for_one_step_at_most_behind_a_long_prefill() -> None:
    """A control call (the watchdog's ping, a release, a resume's adoption) is planned before
    the next step whatever is queued: asked while a long prompt prefills in chunks, it runs
    after the running step, not after the prompt."""
    target = _qwen3_target()
    engine = await _engine(target, prefill_chunk=8, kv_tokens=1024)
    hello = Hello(fingerprint=target.fingerprint, sampling=GREEDY)
    long, other = engine.open(hello), engine.open(hello)
    busy = asyncio.ensure_future(_rounds(engine, other))  # another active session: chunks of 8
    prompt = [int(x) for x in np.random.default_rng(3).integers(1, 64, 240)]
    task = asyncio.ensure_future(
        engine.run(long, Verify(_propose(prompt, [5], 0), want_bonus=True))
    )
    await until(lambda: engine.steps >= 2, what="the prefill under way")
    asked = engine.steps
    ran_at = await engine.call(lambda: engine.steps)
    assert ran_at <= asked + 1 and not task.done()
    assert engine.health().alive
    outcome = await task
    assert isinstance(outcome.result, Verified)
    assert engine.steps >= 20  # the prompt took its chunks
    busy.cancel()
    engine.shutdown()


async def test_cancelling_the_awaiter_drops_the_rest_of_a_prefill() -> None:
    """A session whose task is cancelled (its connection went) spends no more engine time: its
    queued request, and the rest of a chunked prefill, leave the queue."""
    target = _qwen3_target()
    engine = await _engine(target, prefill_chunk=8, kv_tokens=1024)
    hello = Hello(fingerprint=target.fingerprint, sampling=GREEDY)
    long, other = engine.open(hello), engine.open(hello)
    busy = asyncio.ensure_future(_rounds(engine, other))
    prompt = [int(x) for x in np.random.default_rng(4).integers(1, 64, 240)]
    task = asyncio.ensure_future(
        engine.run(long, Verify(_propose(prompt, [5], 0), want_bonus=True))
    )
    await until(lambda: engine.steps >= 2, what="the prefill under way")
    task.cancel()
    busy.cancel()
    for t in (task, busy):
        with pytest.raises(asyncio.CancelledError):
            await t
    await engine.call(lambda: None)  # the running step is over
    settled = engine.steps
    await engine.call(lambda: None)
    assert engine.steps == settled  # no step ran for the cancelled prefill
    assert 0 < long.length < 240  # what was cached stays (a resume may keep it)
    engine.shutdown()


class _Boom(BaseException):
    """Escapes the engine's step handler (which catches Exception): its thread dies."""


async def test_a_dead_engine_thread_fails_every_session_and_says_why() -> None:
    target = _qwen3_target()
    engine = await _engine(target)
    hello = Hello(fingerprint=target.fingerprint, sampling=GREEDY)
    slot = engine.open(hello)
    assert engine.health().alive and engine.health().error is None

    def boom(rows: Any) -> torch.Tensor:
        raise _Boom("the device fell off the bus")

    target.forward = boom  # type: ignore[method-assign]
    with pytest.raises(EngineClosed, match="the model engine stopped: _Boom"):
        await engine.run(slot, Verify(_propose([1, 2, 3], [4], 0), want_bonus=True))
    await until(lambda: not engine.health().alive, what="the engine seen dead")
    health = engine.health()
    assert health.error is not None and "device fell off the bus" in health.error
    with pytest.raises(EngineClosed, match="device fell off the bus"):
        await engine.run(slot, Verify(_propose([1, 2, 3], [4], 0), want_bonus=True))
    assert not await engine.ping(1.0)


async def test_one_tenants_backlog_of_prompts_is_not_read_as_the_engines_delay() -> None:
    """Three prompts of one tenant are prefilled oldest first; the third waits for the other
    two, but behind its own tenant, not behind the engine: the queue delay admission reads
    stays about a step, not two thirds of the whole prefill."""
    target = _qwen3_target()
    engine = await _engine(target, prefill_chunk=8, kv_tokens=2048)
    hello = Hello(fingerprint=target.fingerprint, sampling=GREEDY)
    other = engine.open(hello)
    busy = asyncio.ensure_future(_rounds(engine, other))
    rng = np.random.default_rng(5)
    slots = [engine.open(hello, tenant="a") for _ in range(3)]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    outs = await asyncio.gather(
        *(
            engine.run(
                s, Verify(_propose([int(x) for x in rng.integers(1, 64, 160)], [5], 0), True)
            )
            for s in slots
        )
    )
    elapsed = loop.time() - t0
    assert all(isinstance(o.result, Verified) for o in outs)
    assert engine.queue_delay_s() < 0.3 * elapsed, (engine.queue_delay_s(), elapsed)
    busy.cancel()
    with pytest.raises(asyncio.CancelledError):
        await busy
    engine.shutdown()
