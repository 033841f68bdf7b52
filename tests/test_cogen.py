"""Co-generation keeps the output the target's: both session cores, coupled in memory, with a
stochastic bigram target and draft at T = 1, and a random schedule that decides when the
verifier's own Generate work completes (co-generation forced on at random points: before,
between or after the edge's Proposes arrive). The joint law of the first three generated
tokens is compared with the target's by a chi-square test; a broken verifier that co-generates
from the draft's law instead of p must fail the same test (the test has power).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from shared.edge_core import SingleCore, hello_for
from shared.generation import Generation
from shared.pipeline_config import PipelineConfig
from shared.protocol import CorrectionMode, Fingerprint, Welcome, decode, encode
from shared.rejection import Decision, draw_candidates, verify_batch
from shared.sampling import SamplingParams, sample
from shared.verifier_core import (
    Crop,
    Cropped,
    Draw,
    Drawn,
    Generate,
    Result,
    Run,
    Send,
    SessionLimits,
    TargetInfo,
    Verified,
    VerifierCore,
    Verify,
    Work,
)
from tests.test_exactness import ALPHA, chi_square_pvalue

V = 4
FP = Fingerprint("t", V, "bigram")
N = 6000
PROMPT = [0]


def _bigram(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tl = rng.normal(0, 1.5, (V, V))
    dl = tl + rng.normal(0, 0.8, (V, V))
    e = np.exp(tl - tl.max(1, keepdims=True))
    d = np.exp(dl - dl.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True), d / d.sum(1, keepdims=True)


P, Q = _bigram(2)


class BigramTarget:
    """The verifier's model side: p(· | text) = P[last token]; ``cogen_law`` is what Generate
    samples from (P; Q in the negative control)."""

    def __init__(self, rng: np.random.Generator, cogen_law: np.ndarray) -> None:
        self.cache: list[int] = []
        self.rng = rng
        self.cogen_law = cogen_law
        self.kept: tuple[np.ndarray, int] | None = None

    def run(self, work: Work, core: VerifierCore) -> Result:
        if isinstance(work, Generate):
            assert work.pos == len(self.cache) == core.cache_len
            self.cache += work.fixed.tolist()
            return Verified(Decision(0, bonus=sample(self.cogen_law[self.cache[-1]], self.rng)))
        if isinstance(work, Verify):
            p = work.propose
            assert p.pos == len(self.cache) == core.cache_len
            self.cache += work.fixed.tolist()
            draft = work.draft.tolist()
            ctx = self.cache[-1]
            rows = []
            for x in [ctx, *draft]:
                rows.append(P[x])
            assert core.hello is not None
            d = verify_batch(
                np.stack(rows),
                draft,
                work.q,
                greedy=False,
                correction=str(core.hello.correction),
                rng=self.rng,
                want_bonus=work.want_bonus,
            )
            self.cache += draft[: d.accepted]
            kept = False
            if d.rejected and d.candidates is not None:
                self.kept, kept = (rows[d.accepted], draft[d.accepted]), True
            return Verified(d, kept_row=kept)
        if isinstance(work, Crop):
            del self.cache[work.pos :]
            return Cropped()
        assert isinstance(work, Draw) and self.kept is not None
        return Drawn(draw_candidates(self.kept[0], self.kept[1], work.m, self.rng))


def generate_once(
    rng: np.random.Generator, mode: CorrectionMode, n: int, cogen_law: np.ndarray
) -> tuple[list[int], int]:
    """One generation of ``n`` tokens over a random schedule; returns (tokens, co-generated)."""
    cfg = PipelineConfig(gamma=2, depth=2, sampling=SamplingParams(1.0), correction=mode)
    gen = Generation(PROMPT, n)
    core = VerifierCore(TargetInfo(FP, V), SessionLimits(max_gamma=8), "s")
    model = BigramTarget(rng, cogen_law)
    hello = hello_for(FP, cfg, 0, end=len(PROMPT) + n)
    welcome = decode(encode(core.receive(encode(hello))[-1].msg))  # type: ignore[union-attr]
    assert isinstance(welcome, Welcome)
    edge = SingleCore(gen, cfg, rng, hello, welcome)
    up: deque[bytes] = deque()
    down: deque[bytes] = deque()
    pending: list[Work] = []

    def act(events: list[object]) -> None:
        for ev in events:
            if isinstance(ev, Send):
                down.append(encode(ev.msg, core.ctx))
            elif isinstance(ev, Run):
                pending.append(ev.work)

    while not gen.done:
        choice = rng.integers(4)
        if choice == 0 and edge.may_draft():
            plan = edge.pipe.plan()
            assert plan is not None
            draft, q_rows = [], []
            while edge.pipe.wants_more(plan, draft):
                row = Q[(plan.context + draft)[-1]]
                if plan.deterministic:
                    x = int(np.argmax(row))
                    row = np.eye(V)[x]
                else:
                    x = sample(row, rng)
                draft.append(x)
                q_rows.append(row)
            up.extend(edge.propose(plan, draft, q_rows))
        elif choice == 1 and up:
            act(list(core.receive(up.popleft())))
        elif choice == 2 and pending:
            act(list(core.work_done(model.run(pending.pop(), core))))
        elif choice == 3 and down:
            up.extend(edge.receive(down.popleft()))
    return gen.generated[:n], gen.stats.cogen_tokens


def joint_pvalue(mode: CorrectionMode, cogen_law: np.ndarray, seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    seqs, cogen = [], 0
    for _ in range(N):
        out, c = generate_once(rng, mode, 3, cogen_law)
        seqs.append(out)
        cogen += c
    s = np.array(seqs)
    cells = s[:, 0] * V * V + s[:, 1] * V + s[:, 2]
    joint = (P[PROMPT[-1]][:, None, None] * P[:, :, None] * P[None, :, :]).reshape(-1)
    return chi_square_pvalue(cells, joint), cogen / (3 * N)


@pytest.mark.parametrize(
    "mode", [CorrectionMode.GREEDY_DRAFT, CorrectionMode.CANDIDATES, CorrectionMode.TOPK]
)
def test_cogeneration_keeps_the_target_joint_law(mode: CorrectionMode) -> None:
    """TOPK here is exact too: K = 10 > V keeps the whole of p."""
    pv, share = joint_pvalue(mode, P, seed=len(str(mode)))
    assert share > 0.1, f"co-generation hardly ran ({share:.0%} of tokens): the test is void"
    assert pv > ALPHA, f"{mode}: chi-square p-value {pv:.2e} ({share:.0%} co-generated)"


def test_negative_control_cogen_from_the_draft_law() -> None:
    """A verifier that co-generates from q instead of p is caught by the same test."""
    pv, share = joint_pvalue(CorrectionMode.GREEDY_DRAFT, Q, seed=7)
    assert share > 0.1
    assert pv < 1e-6, f"the broken variant passed (p-value {pv:.2e}): the test has no power"
