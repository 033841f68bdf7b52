"""The edge pipeline over an in-memory transport with a scripted verifier: no sockets, no models.

The scripted verifier answers only when D batches are outstanding (the drafter is then blocked by
backpressure), which makes every interleaving, and so every sequence below, exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from edge_agent.pipeline import (
    PIPELINED,
    STOP_AND_WAIT,
    DesyncError,
    Generation,
    PipelineConfig,
    SpeculativeSession,
)
from edge_agent.tasks import ModelWorker
from edge_agent.transport import MemoryTransport, memory_pair
from shared.protocol import (
    Candidates,
    CorrectionMode,
    Propose,
    Resample,
    SparseDist,
    Verdict,
    WireContext,
    decode,
    encode,
)
from shared.sampling import Probs, SamplingParams

V = 16


class CountingDrafter:
    """Drafts (last + 1) mod V; q is a fixed distribution peaked there (or one-hot)."""

    def __init__(self) -> None:
        self.calls = 0

    def draft(
        self,
        seq: Sequence[int],
        params: SamplingParams,
        rng: np.random.Generator,
        *,
        deterministic: bool,
    ) -> tuple[int, Probs]:
        self.calls += 1
        x = (seq[-1] + 1) % V
        q = np.full(V, 0.02)
        q[x] = 1 - 0.02 * (V - 1)
        if deterministic:
            q = np.zeros(V)
            q[x] = 1.0
        return x, q


@dataclass
class Reply:
    accepted: int
    token: int | None = None
    sparse: SparseDist | None = None
    candidates: SparseDist | None = None
    bonus: int | None = None


@dataclass
class ScriptedVerifier:
    """Replies per script once ``depth`` current-epoch batches are outstanding."""

    end: MemoryTransport
    ctx: WireContext
    script: list[Reply]
    depth: int
    log: list[tuple[int, int, int, list[int], list[int]]] = field(default_factory=list)
    stale: int = 0
    max_outstanding: int = 0
    resamples: list[Resample] = field(default_factory=list)
    resample_reply: SparseDist | None = None
    _rejected: bool = False
    resample_delay_s: float = 0.0

    async def run(self) -> None:
        epoch = 0
        outstanding: list[Propose] = []
        while True:  # until the test cancels it
            try:
                # A quiet pipe with work outstanding means the edge can send no more (its
                # token budget is in flight): answer the head batch then.
                quiet = 0.2 if outstanding and self.script else None
                data = await asyncio.wait_for(self.end.recv(), quiet)
            except asyncio.TimeoutError:
                await self._reply(outstanding.pop(0))
                if self._rejected:
                    epoch += 1
                    outstanding.clear()
                continue
            msg = decode(data, self.ctx)
            if isinstance(msg, Resample):
                self.resamples.append(msg)
                assert self.resample_reply is not None
                await asyncio.sleep(self.resample_delay_s)  # a slow round trip
                await self.end.send(
                    encode(Candidates(msg.epoch, msg.pos, self.resample_reply), self.ctx)
                )
                continue
            assert isinstance(msg, Propose)
            self.log.append((msg.epoch, msg.seq, msg.pos, msg.fixed.tolist(), msg.draft.tolist()))
            if msg.epoch < epoch:
                self.stale += 1
                continue
            outstanding.append(msg)
            self.max_outstanding = max(self.max_outstanding, len(outstanding))
            if len(outstanding) < self.depth or not self.script:
                continue
            await self._reply(outstanding.pop(0))
            if self._rejected:
                epoch += 1
                outstanding.clear()

    async def _reply(self, head: Propose) -> None:
        r = self.script.pop(0)
        accepted = min(r.accepted, len(head.draft))  # a short last batch
        v = Verdict(head.epoch, head.seq, accepted, r.sparse, r.candidates, r.token, r.bonus)
        self._rejected = accepted < len(head.draft)
        await self.end.send(encode(v, self.ctx))


async def _run(
    cfg: PipelineConfig,
    script: list[Reply],
    max_new: int,
    *,
    resample_reply: SparseDist | None = None,
    resample_delay_s: float = 0.0,
    server_depth: int | None = None,
) -> tuple[Generation, ScriptedVerifier, SpeculativeSession]:
    edge, server = memory_pair()
    ctx = WireContext(vocab_size=V, draft_probs=cfg.wire_correction != CorrectionMode.GREEDY_DRAFT)
    gen = Generation([0], max_new)
    worker = ModelWorker("test")
    sess = SpeculativeSession(
        gen,
        CountingDrafter(),
        worker,
        edge,
        ctx,
        cfg,
        np.random.default_rng(0),  # type: ignore[arg-type]
    )
    fake = ScriptedVerifier(
        server,
        ctx,
        script,
        server_depth or cfg.effective_depth,
        resample_reply=resample_reply,
        resample_delay_s=resample_delay_s,
    )
    task = asyncio.ensure_future(fake.run())
    try:
        await asyncio.wait_for(sess.run(), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        worker.close()
    return gen, fake, sess


GREEDY = SamplingParams(temperature=0.0)


async def test_pipelined_commits_rollbacks_and_discards() -> None:
    cfg = PipelineConfig(gamma=2, depth=2, mode=PIPELINED, sampling=GREEDY)
    script = [
        Reply(2),  # batch A [1, 2] accepted
        Reply(1, token=9),  # batch B [3, 4]: 3 accepted, 4 rejected → 9; batch C discarded
        Reply(2),  # batch D [10, 11] (fixed [9]) accepted
        Reply(0, token=7),  # batch E [12, 13] rejected at once → 7
        Reply(1),  # batch F: [8] accepted (the last token allowed)
    ]
    gen, fake, sess = await _run(cfg, script, max_new=8)
    # (epoch, seq, pos, fixed, draft) of every Propose, in order
    assert fake.log == [
        (0, 0, 0, [0], [1, 2]),
        (0, 1, 3, [], [3, 4]),
        (0, 2, 5, [], [5, 6]),  # drafted while B was in flight
        (1, 3, 4, [9], [10, 11]),  # after the rejection: the recovered token is a fixed token
        (1, 4, 7, [], [12, 13]),
        (2, 5, 7, [7], [8]),
    ]
    assert gen.generated == [1, 2, 3, 9, 10, 11, 7, 8]
    assert gen.finish_reason == "length"
    st = gen.stats
    assert (st.rounds, st.rejections, st.discarded_batches, st.discarded_tokens) == (5, 2, 1, 2)
    assert st.accepted_tokens == 2 + 1 + 2 + 0 + 1
    assert st.accepted_per_position == [4, 2]
    # batch C was queued at the verifier when B was rejected: dropped there, discarded here
    assert fake.stale == 0
    assert fake.max_outstanding <= 2  # backpressure at depth D
    assert sess.epoch == 2


@pytest.mark.parametrize("depth", [1, 3])
async def test_backpressure_never_exceeds_depth(depth: int) -> None:
    cfg = PipelineConfig(gamma=1, depth=depth, mode=PIPELINED, sampling=GREEDY)
    gen, fake, _ = await _run(cfg, [Reply(1)] * 12, max_new=12)
    assert gen.generated == list(range(1, 13))
    assert fake.max_outstanding == depth
    assert [e[1] for e in fake.log] == list(range(len(fake.log)))  # seq numbers consecutive


async def test_stop_and_wait_with_bonus_tokens() -> None:
    cfg = PipelineConfig(gamma=3, mode=STOP_AND_WAIT, sampling=GREEDY)
    script = [Reply(3, bonus=5), Reply(1, token=0), Reply(3, bonus=9)]
    gen, fake, _ = await _run(cfg, script, max_new=9)
    assert fake.log == [
        (0, 0, 0, [0], [1, 2, 3]),
        (0, 1, 4, [5], [6, 7, 8]),  # the bonus token goes up as a fixed token
        (1, 2, 6, [0], [1, 2, 3]),
    ]
    assert gen.generated == [1, 2, 3, 5, 6, 0, 1, 2, 3]
    assert fake.max_outstanding == 1
    assert gen.stats.bonus_tokens == 1  # the last bonus fell past max_new_tokens


async def test_eos_stops_generation() -> None:
    cfg = PipelineConfig(gamma=4, depth=2, sampling=GREEDY)
    edge, server = memory_pair()
    ctx = WireContext(vocab_size=V, draft_probs=False)
    gen = Generation([0], 100, eos_ids=[3])
    worker = ModelWorker("test")
    sess = SpeculativeSession(
        gen,
        CountingDrafter(),
        worker,
        edge,
        ctx,
        cfg,  # type: ignore[arg-type]
        np.random.default_rng(0),
    )
    fake = ScriptedVerifier(server, ctx, [Reply(3)], 1)
    task = asyncio.ensure_future(fake.run())
    await asyncio.wait_for(sess.run(), 10)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    worker.close()
    # the drafter stops at the end-of-sequence id: one batch [1, 2, 3]
    assert fake.log == [(0, 0, 0, [0], [1, 2, 3])]
    assert gen.generated == [1, 2, 3] and gen.finish_reason == "stop"


async def test_topk_correction_sampled_from_residual() -> None:
    """A sparse correction whose only id with residual mass is 11: the edge must emit 11."""
    cfg = PipelineConfig(gamma=2, depth=1, sampling=SamplingParams(1.0))
    # draft q at a rejected position puts 0.7 on x and 0.02 elsewhere; p̂ = {x: 0.5, 11: 0.5}
    sparse = SparseDist(np.array([2, 11]), np.array([0.5, 0.5], np.float32))
    gen, _fake, _ = await _run(cfg, [Reply(1, sparse=sparse)], max_new=2)
    assert gen.generated == [1, 11]


async def test_candidates_resample_when_all_fail() -> None:
    cfg = PipelineConfig(
        gamma=2, depth=1, sampling=SamplingParams(1.0), correction=CorrectionMode.CANDIDATES
    )
    # q(5) = 0.02 >= p(5) = 0.01: accepted with probability max(0, 1 − q/p) = 0
    hopeless = SparseDist(np.array([5, 5]), np.array([0.01, 0.01], np.float32))
    sure = SparseDist(np.array([6]), np.array([1.0], np.float32))  # 1 − 0.02/1 = 0.98
    gen, fake, _ = await _run(cfg, [Reply(0, candidates=hopeless)], max_new=1, resample_reply=sure)
    assert len(fake.resamples) >= 1
    assert fake.resamples[0].epoch == 1 and fake.resamples[0].pos == 1
    assert gen.generated == [6]
    assert gen.stats.resamples == len(fake.resamples)


async def test_no_drafting_while_a_recovery_waits_for_candidates() -> None:
    """While the Resample round trip is pending, the drafter must not draft from a text that
    lacks the recovered token: the next Propose carries it as its fixed token."""
    cfg = PipelineConfig(
        gamma=2, depth=4, sampling=SamplingParams(1.0), correction=CorrectionMode.CANDIDATES
    )
    hopeless = SparseDist(np.array([5]), np.array([0.01], np.float32))
    sure = SparseDist(np.array([6]), np.array([1.0], np.float32))
    gen, fake, _ = await _run(
        cfg,
        [Reply(0, candidates=hopeless)] + [Reply(2)] * 8,
        max_new=12,
        resample_reply=sure,
        resample_delay_s=0.3,
        server_depth=1,  # answers at once: the drafter is busy when the rejection arrives
    )
    after = [e for e in fake.log if e[0] == 1]  # Proposes of the epoch after the rejection
    assert after and after[0][3] == [6], fake.log
    assert gen.generated[0] == 6


async def test_rejection_without_correction_is_a_desync() -> None:
    """A Verdict that stops short of γ without a correction cannot be applied: the batches
    behind it were drafted from the tokens it leaves out."""
    cfg = PipelineConfig(gamma=2, depth=1, sampling=GREEDY)
    edge, server = memory_pair()
    ctx = WireContext(vocab_size=V, draft_probs=False)
    gen = Generation([0], 10)
    worker = ModelWorker("test")
    sess = SpeculativeSession(
        gen,
        CountingDrafter(),
        worker,
        edge,
        ctx,
        cfg,  # type: ignore[arg-type]
        np.random.default_rng(0),
    )

    async def liar() -> None:
        await server.recv()
        await server.send(encode(Verdict(0, 0, 1), ctx))  # 1 of 2 accepted, no correction

    task = asyncio.ensure_future(liar())
    with pytest.raises(DesyncError, match="without a correction"):
        await asyncio.wait_for(sess.run(), 10)
    await task
    worker.close()
    assert gen.generated == []


async def test_verdict_for_wrong_batch_is_a_desync() -> None:
    cfg = PipelineConfig(gamma=2, depth=1, sampling=GREEDY)
    edge, server = memory_pair()
    ctx = WireContext(vocab_size=V, draft_probs=False)
    gen = Generation([0], 10)
    worker = ModelWorker("test")
    sess = SpeculativeSession(
        gen,
        CountingDrafter(),
        worker,
        edge,
        ctx,
        cfg,  # type: ignore[arg-type]
        np.random.default_rng(0),
    )

    async def liar() -> None:
        await server.recv()
        await server.send(encode(Verdict(0, 5, 2), ctx))  # seq 5 was never sent

    task = asyncio.ensure_future(liar())
    with pytest.raises(DesyncError, match="seq 5"):
        await asyncio.wait_for(sess.run(), 10)
    await task
    worker.close()
    assert gen.generated == []  # nothing committed from a frame that does not match
