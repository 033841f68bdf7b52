"""Co-generation keeps the output the target's: both session cores, coupled in memory, with a
stochastic bigram target and draft at T = 1, and a random schedule that decides when the
verifier's own CoGenerate work completes (co-generation forced on at random points: before,
between or after the edge's Proposes arrive). The joint law of the first three generated
tokens is compared with the target's by a chi-square test; a broken verifier that co-generates
from the draft's law instead of p must fail the same test (the test has power). With hedges
(greedy-draft mode, every position hedged), the verifier's hedged co-generation forwards are
checked the same way, against a broken model side that accepts hedge tokens unverified.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest

from cloud_verifier.engine.work import Work
from cloud_verifier.session.cloud_draft import CloudDraft
from cloud_verifier.session.core import VerifierCore
from cloud_verifier.session.events import Run, Send
from cloud_verifier.session.limits import SessionLimits, TargetInfo
from edge_agent.session.branches import Growing, PredraftPlan, Rival
from edge_agent.session.core import SingleCore
from edge_agent.session.generation import Generation, TokenSource
from edge_agent.session.opening import hello_for
from edge_agent.session.pipeline_config import PipelineConfig
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams, sample
from shared.wire.codec import decode, encode
from shared.wire.messages import Fingerprint, Welcome
from tests.edge_events import sent
from tests.fake_model import FakeTargetModel, bigram_law
from tests.stats import ALPHA, chi_square_pvalue

V = 4
FP = Fingerprint("t", V, "bigram")
N = 6000
PROMPT = [0]
NGRAM = frozenset({CloudDraft.NGRAM})


def _bigram(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tl = rng.normal(0, 1.5, (V, V))
    dl = tl + rng.normal(0, 0.8, (V, V))
    e = np.exp(tl - tl.max(1, keepdims=True))
    d = np.exp(dl - dl.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True), d / d.sum(1, keepdims=True)


P, Q = _bigram(2)


def _greedy_q(x: int) -> tuple[int, np.ndarray, Rival]:
    """The deterministic draft after ``x``: its token, one-hot q, and its rival."""
    row = Q[x]
    order = np.argsort(-row, kind="stable")
    alts = tuple((int(t), float(row[t])) for t in order[1:3])
    return int(order[0]), np.eye(V)[order[0]], Rival(alts[0][0], float(row[order[0]]), alts)


def _hedges(edge: SingleCore) -> list[bytes]:
    """Every hedge the pipeline plans now, with its greedy continuation."""
    out: list[bytes] = []
    while (hp := edge.pipe.book.hedge_plan()) is not None:
        cont = [hp.token]
        while len(cont) <= hp.max_tokens:
            cont.append(_greedy_q(cont[-1])[0])
        out += sent(edge, edge.hedge(hp, cont[1:]))
    return out


def _draft_step(
    rng: np.random.Generator, last: int, deterministic: bool
) -> tuple[int, np.ndarray, Rival]:
    """One draft step after ``last``: its token, its q row and a rival (for pre-drafting and
    hedging: at T = 1 a random other token, so that branches cover every outcome)."""
    if deterministic:
        return _greedy_q(last)
    row = Q[last]
    x = sample(row, rng)
    other = int((x + 1 + rng.integers(V - 1)) % V)
    second = next(t for t in range(V) if t not in (x, other))
    return x, row, Rival(other, 0.5, ((other, 0.3), (second, 0.2)))


def _predraft_all(edge: SingleCore, rng: np.random.Generator, stale: bool) -> list[bytes]:
    """Prepare every outcome the pipeline plans now, each branch cut at a random length (a
    verdict came while it was drafted); returns the frames that send them (token trees)."""
    out: list[bytes] = []
    while (pp := edge.pipe.book.predraft_plan()) is not None:
        n = int(rng.integers(1, pp.max_tokens + 1))
        ctx = [*pp.context, pp.token]
        draft, q_rows, rivals = [], [], []
        for _ in range(n):
            x, row, rival = _draft_step(rng, (ctx + draft)[-1], pp.deterministic)
            if stale and not draft:  # broken: drawn after the drafted token, not the rival
                x = sample(Q[(edge.gen.committed + edge.pipe.tail)[pp.pos]], rng)
            draft.append(x)
            q_rows.append(row)
            rivals.append(rival)
        if draft:
            out += sent(edge, edge.tree_branch(pp, draft))
        edge.pipe.book.add_branch(Growing(pp, draft, q_rows, rivals, 0.5))
    return out


def _tree_all(
    edge: SingleCore, rng: np.random.Generator, context: list[int], draft: list[int]
) -> list[bytes]:
    """A branch at every alternative of every position of the batch just proposed (token
    trees forced on everywhere), each the greedy continuation of its token, 1 or 2 long."""
    out: list[bytes] = []
    for i, x in enumerate(draft):
        pos = len(context) + i
        for y in range(V):
            if y == x:
                continue
            cont = [y]
            for _ in range(int(rng.integers(1, 3))):
                cont.append(_greedy_q(cont[-1])[0])
            pp = PredraftPlan(pos, y, [*context, *draft][:pos], 2, deterministic=True)
            out += sent(edge, edge.tree_branch(pp, cont[1:]))
    return out


def generate_once(
    rng: np.random.Generator,
    mode: CorrectionMode,
    n: int,
    cogen_law: np.ndarray,
    hedge: int = 0,
    trust_hedges: bool = False,
    cloud: frozenset[CloudDraft] = frozenset(),
    cloud_only: bool = False,
    prompt_first: bool = False,
    predraft: bool = False,
    stale_branches: bool = False,
    branch_hits: list[int] | None = None,
    tree: bool = False,
    trust_branches: bool = False,
    cogen_ahead: int = 64,
) -> tuple[list[int], int, int]:
    """One generation of ``n`` tokens over a random schedule; returns (tokens, co-generated,
    draft tokens accepted in co-generation: hedges' and cloud drafts'). ``predraft``: outcome
    pre-drafting forced on at every position in flight (rivals drawn at random), branches cut
    at random lengths, taken wherever a plan opens one (``branch_hits`` gets the count);
    ``stale_branches``: a broken edge whose branch tokens are drawn after the wrong context
    (the drafted token, not the rival) while their q rows are the right context's. ``tree``:
    the branches also go to the verifier (Hedges), to ride in the forward of the batch they
    fork from; ``trust_branches``: a broken model side accepts an opened branch unverified;
    ``cogen_ahead``: the verifier's co-generation bound (SessionLimits.max_cogen_ahead)."""
    cfg = PipelineConfig(
        gamma=2,
        depth=2,
        sampling=SamplingParams(1.0),
        correction=mode,
        hedge=hedge,
        hedge_below=1.0,
        predraft=64 if predraft else 0,
        tree=tree,
    )
    gen = Generation(PROMPT, n)
    limits = SessionLimits(max_gamma=8, cloud_draft=cloud, max_cogen_ahead=cogen_ahead)
    core = VerifierCore(TargetInfo(FP, V), limits, "s")
    model = FakeTargetModel(bigram_law(P), rng, bigram_law(cogen_law), trust_hedges, trust_branches)
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

    if prompt_first:  # as the driver does: the prompt goes up before the first batch
        up.extend(sent(edge, edge.credit(bonus=False)))
    while not gen.done:
        choice = rng.integers(5 if hedge or predraft else 4)
        if choice == 0 and cloud_only:
            if edge.wants_credit():  # no draft model: credits only
                up.extend(sent(edge, edge.credit()))
        elif choice == 0 and edge.may_draft():
            plan = edge.pipe.plan()
            assert plan is not None
            draft, q_rows, rivals = [], [], []
            ready, _ = edge.pipe.book.take_branch(plan)
            if ready is not None:
                draft, q_rows, rivals = ready.draft, ready.q_rows, ready.rivals
                if branch_hits is not None:
                    branch_hits.append(1)
            while edge.pipe.wants_more(plan, draft):
                x, row, rival = _draft_step(rng, (plan.context + draft)[-1], plan.deterministic)
                rivals.append(rival)
                draft.append(x)
                q_rows.append(row)
            up.extend(sent(edge, edge.propose(plan, draft, q_rows, rivals=rivals)))
            if hedge and rng.integers(2):
                up.extend(_hedges(edge))  # right behind the Propose
            if tree:
                up.extend(_tree_all(edge, rng, plan.context, draft))  # right behind the Propose
        elif choice == 4 and not edge.may_draft():
            if predraft:
                up.extend(_predraft_all(edge, rng, stale_branches))
            else:
                up.extend(_hedges(edge))
        elif choice == 1 and up:
            act(list(core.receive(up.popleft())))
        elif choice == 2 and pending:
            act(list(core.work_done(model.run(pending.pop(), core))))
        elif choice == 3 and down:
            up.extend(sent(edge, edge.receive(down.popleft())))
    # Every token has one source: co-generated ones are counted as such, not as accepted drafts.
    sources = gen.stats.sources
    assert sum(sources.values()) == len(gen.generated)
    assert (
        sources[TokenSource.COGENERATED] + sources[TokenSource.CLOUD_DRAFT]
        <= gen.stats.cogen_tokens
    )
    # Accepted cloud drafts are told apart (Generated.cloud) and counted as their own source.
    assert sources[TokenSource.CLOUD_DRAFT] <= core.tokens.cloud_draft
    drafted = core.tokens.hedge + core.tokens.cloud_draft + core.tokens.tree
    return gen.generated[:n], gen.stats.cogen_tokens, drafted


def joint_pvalue(
    mode: CorrectionMode,
    cogen_law: np.ndarray,
    seed: int,
    n: int = 3,
    start: int = 0,
    **kw: Any,
) -> tuple[float, float, float]:
    """(p-value of 3 tokens from the ``start``-th generated one on, share of the ``n`` tokens
    co-generated, share accepted from hedges). The target's law of those 3: the marginal of
    token ``start`` (the prompt's row times P, ``start`` times), then two bigram steps."""
    rng = np.random.default_rng(seed)
    seqs, cogen, hedged = [], 0, 0
    for _ in range(N):
        out, c, h = generate_once(rng, mode, n, cogen_law, **kw)  # type: ignore[arg-type]
        seqs.append(out[start : start + 3])
        cogen += c
        hedged += h
    s = np.array(seqs)
    cells = s[:, 0] * V * V + s[:, 1] * V + s[:, 2]
    first = P[PROMPT[-1]] @ np.linalg.matrix_power(P, start)
    joint = (first[:, None, None] * P[:, :, None] * P[None, :, :]).reshape(-1)
    return chi_square_pvalue(cells, joint), cogen / (n * N), hedged / (n * N)


@pytest.mark.parametrize(
    "mode", [CorrectionMode.GREEDY_DRAFT, CorrectionMode.CANDIDATES, CorrectionMode.TOPK]
)
def test_cogeneration_keeps_the_target_joint_law(mode: CorrectionMode) -> None:
    """TOPK here is exact too: K = 10 > V keeps the whole of p."""
    pv, share, _ = joint_pvalue(mode, P, seed=len(str(mode)))
    assert share > 0.1, f"co-generation hardly ran ({share:.0%} of tokens): the test is void"
    assert pv > ALPHA, f"{mode}: chi-square p-value {pv:.2e} ({share:.0%} co-generated)"


def test_cogeneration_after_a_prompt_credit_keeps_the_target_joint_law() -> None:
    """The edge sends its prompt at once (an empty Propose, no bonus) and drafts meanwhile, as
    its driver does: the verifier prefills and co-generates before the first batch; the joint
    law is still p."""
    pv, share, _ = joint_pvalue(CorrectionMode.CANDIDATES, P, seed=23, prompt_first=True)
    assert share > 0.1, f"co-generation hardly ran ({share:.0%} of tokens): the test is void"
    assert pv > ALPHA, f"chi-square p-value {pv:.2e} ({share:.0%} co-generated)"


def test_negative_control_cogen_from_the_draft_law() -> None:
    """A verifier that co-generates from q instead of p is caught by the same test."""
    pv, share, _ = joint_pvalue(CorrectionMode.GREEDY_DRAFT, Q, seed=7)
    assert share > 0.1
    assert pv < 1e-6, f"the broken variant passed (p-value {pv:.2e}): the test has no power"


def test_hedged_cogeneration_keeps_the_target_joint_law() -> None:
    """Every draft position hedged (the edge hedges its greedy-draft sessions): the verifier
    verifies hedge drafts in its co-generation forwards; the law of the output is still p."""
    pv, share, hedged = joint_pvalue(CorrectionMode.GREEDY_DRAFT, P, seed=11, n=6, hedge=3)
    assert hedged > 0.03, f"hedges hardly used ({hedged:.1%} of tokens): the test is void"
    assert pv > ALPHA, f"chi-square p-value {pv:.2e} ({share:.0%} co-generated)"


def test_negative_control_hedges_accepted_unverified() -> None:
    """A model side that accepts a hedge's draft without verifying it is caught."""
    pv, _, hedged = joint_pvalue(
        CorrectionMode.GREEDY_DRAFT, P, seed=11, n=6, hedge=3, trust_hedges=True
    )
    assert hedged > 0.03
    assert pv < 1e-6, f"the broken variant passed (p-value {pv:.2e}): the test has no power"


@pytest.mark.parametrize(
    "mode", [CorrectionMode.GREEDY_DRAFT, CorrectionMode.CANDIDATES, CorrectionMode.TOPK]
)
def test_cloud_ngram_drafts_keep_the_target_joint_law(mode: CorrectionMode) -> None:
    """Cloud-side speculation (cloud_draft = ngram): in its co-generation forwards the verifier
    verifies drafts of its own (prompt lookup over the text) as deterministic drafts; the joint
    law of the output is still p, in every correction mode."""
    pv, share, drafted = joint_pvalue(mode, P, seed=13, n=6, cloud=NGRAM)
    assert drafted > 0.05, f"cloud drafts hardly accepted ({drafted:.1%} of tokens): void"
    assert pv > ALPHA, f"{mode}: chi-square p-value {pv:.2e} ({share:.0%} co-generated)"


def test_negative_control_cloud_drafts_accepted_unverified() -> None:
    """A model side that takes the verifier's own draft without verifying it is caught."""
    pv, _, drafted = joint_pvalue(
        CorrectionMode.GREEDY_DRAFT,
        P,
        seed=13,
        n=6,
        cloud=NGRAM,
        trust_hedges=True,
    )
    assert drafted > 0.05
    assert pv < 1e-6, f"the broken variant passed (p-value {pv:.2e}): the test has no power"


TAIL_NGRAM = frozenset({CloudDraft.TAIL, CloudDraft.NGRAM})


def test_tail_and_ngram_cloud_drafts_keep_the_target_joint_law() -> None:
    """cloud_draft = tail, ngram: after a rejection the verifier verifies the rest of the
    rejected draft (re-aligned behind the correction) in its co-generation forward, else its
    prompt-lookup draft; the joint law of the output is still p."""
    pv, share, drafted = joint_pvalue(CorrectionMode.CANDIDATES, P, seed=17, n=6, cloud=TAIL_NGRAM)
    assert drafted > 0.05, f"cloud drafts hardly accepted ({drafted:.1%} of tokens): void"
    assert pv > ALPHA, f"chi-square p-value {pv:.2e} ({share:.0%} co-generated)"


@pytest.mark.parametrize("trust", [False, True], ids=["exact", "negative-control"])
def test_cloud_only_speculation_keeps_the_target_joint_law(trust: bool) -> None:
    """No draft model on the edge (cloud-only speculative decoding): the edge sends credits,
    the verifier writes every token by co-generation with its own drafts; the joint law is p,
    and a model side that accepts those drafts unverified is caught by the same test."""
    pv, share, drafted = joint_pvalue(
        CorrectionMode.GREEDY_DRAFT,
        P,
        seed=19,
        n=6,
        cloud=NGRAM,
        cloud_only=True,
        trust_hedges=trust,
    )
    # Every token but the first (the bonus of the prompt's forward) is co-generated.
    assert share == 5 / 6, f"{share:.0%} of the tokens co-generated: the edge drafted"
    assert drafted > 0.05, f"cloud drafts hardly accepted ({drafted:.1%} of tokens): void"
    if trust:
        assert pv < 1e-6, f"the broken variant passed (p-value {pv:.2e}): the test has no power"
    else:
        assert pv > ALPHA, f"chi-square p-value {pv:.2e}"


@pytest.mark.parametrize(
    "mode", [CorrectionMode.GREEDY_DRAFT, CorrectionMode.CANDIDATES, CorrectionMode.TOPK]
)
def test_predrafted_outcomes_keep_the_target_joint_law(mode: CorrectionMode) -> None:
    """Outcome pre-drafting forced on at every position in flight, branches cut at random
    lengths and taken wherever a rejection (or a co-generated token) opens one: the branches
    are sent as ordinary batches and the joint law of the output is still p, in every
    correction mode."""
    hits: list[int] = []
    pv, share, _ = joint_pvalue(mode, P, seed=29, n=6, predraft=True, branch_hits=hits)
    assert len(hits) > N // 8, f"branches hardly used ({len(hits)} in {N} runs): the test is void"
    assert pv > ALPHA, f"{mode}: chi-square p-value {pv:.2e} ({share:.0%} co-generated)"


@pytest.mark.parametrize("trust", [False, True], ids=["exact", "negative-control"])
def test_token_trees_keep_the_target_joint_law(trust: bool) -> None:
    """Greedy-draft mode at T = 1 (the verifier recovers tokens itself), pre-drafting forced on
    at every position in flight and every branch sent to the verifier as it is made: batches
    carry the branches that fork inside them (token trees), a recovered token that opens one
    commits its tokens in the same forward; the joint law of generated tokens 3–5 (where
    branches open most) is still p's, and a model side that takes an opened branch unverified
    is caught by the same test. (No co-generation past the last batch, which would otherwise
    write most tokens before a batch reaches the model.)"""
    pv, _, drafted = joint_pvalue(
        CorrectionMode.GREEDY_DRAFT, P, seed=31, n=6, predraft=True, tree=True,
        trust_branches=trust, cogen_ahead=0, prompt_first=True, start=2,
    )  # fmt: skip
    assert drafted > 0.02, f"tree and hedge tokens hardly accepted ({drafted:.1%}): void"
    if trust:
        assert pv < 1e-6, f"the broken variant passed (p-value {pv:.2e}): the test has no power"
    else:
        assert pv > ALPHA, f"chi-square p-value {pv:.2e}"


def test_negative_control_branches_drawn_after_the_wrong_context() -> None:
    """An edge whose branch tokens are drawn after the wrong context (the rejected draft token
    instead of the correction), with the right context's q rows, is caught."""
    hits: list[int] = []
    pv, _, _ = joint_pvalue(
        CorrectionMode.CANDIDATES,
        P,
        seed=29,
        n=6,
        predraft=True,
        stale_branches=True,
        branch_hits=hits,
    )
    assert len(hits) > N // 8
    assert pv < 1e-6, f"the broken variant passed (p-value {pv:.2e}): the test has no power"
