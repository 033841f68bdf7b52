"""Token trees: a Verify's branches ride in its forward as a tree row (each branch sees the chain
up to where it forks, then itself), a recovered token that opens a branch has the branch decided
in the same step, the branch's keys move to their positions, and the committed text keeps the
target's law (greedy equality with full forwards; the joint law of two tokens, chi-square)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cloud_verifier.engine.targets import NullTarget, TorchTarget
from cloud_verifier.engine.work import (
    DEFER_BOUND,
    MAX_WEIGHT,
    MIN_WEIGHT,
    Branch,
    CoGenerate,
    Verified,
    Verify,
)
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams, transform
from shared.runtime.batched_lm import Row
from shared.runtime.kv_pool import SlotPages
from shared.runtime.models import load_model
from shared.wire.messages import Hello
from tests.stats import ALPHA, chi_square_pvalue
from tests.verifier.test_engine import (
    GREEDY,
    _engine,
    _full_argmax,
    _open_many,
    _propose,
    _qwen3_target,
    _together,
)


@pytest.fixture(params=["llama", "qwen3"])
def target(request: pytest.FixtureRequest, tiny_model_dir: Path) -> TorchTarget:
    if request.param == "qwen3":
        return _qwen3_target()
    return TorchTarget(load_model(str(tiny_model_dir)))


def _full_logits(target: TorchTarget, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = target.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    return out.float()


def test_a_tree_row_gives_each_token_the_logits_of_its_own_path(target: TorchTarget) -> None:
    """A cached prefix, then one tree row (a chain of 3 and two branches) beside a plain chain
    row of another slot: every kept row equals an uncached forward of the prefix and that
    token's path (ancestors only, at their depths)."""
    lm = target
    pool = lm.allocate(num_pages=16, page_size=4)
    prefix, other = [5, 6, 7, 8, 9], [11, 12, 13]
    a, b = SlotPages(), SlotPages()
    for slot, ids in ((a, prefix), (b, other)):
        pool.reserve(slot, len(ids))
        lm.forward([Row(slot, 0, tuple(ids), 1)])
        pool.commit(slot, 0, ids)
    # layout: last prefix token (re-fed), chain 20 21 22, then 30 31 forking before 21, then 40
    # forking before 20; parents index into the row
    ids = (9, 20, 21, 22, 30, 31, 40)
    parents = (-1, 0, 1, 2, 1, 4, 0)
    paths = [[], [20], [20, 21], [20, 21, 22], [20, 30], [20, 30, 31], [40]]
    pool.reserve(a, 4 + len(ids))
    pool.reserve(b, len(other) + 2)
    logits = lm.forward([Row(a, 4, ids, len(ids), parents), Row(b, len(other), (14, 15), 2)])
    for i, path in enumerate(paths):
        ref = _full_logits(target, [*prefix, *path])[-1]
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)
    ref_b = _full_logits(target, [*other, 14, 15])[-2:]
    torch.testing.assert_close(logits[len(ids) :], ref_b, atol=1e-4, rtol=1e-4)


def _greedy(target: TorchTarget, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(_full_argmax(target, out)[-1])
    return out[len(ids) :]


async def test_an_opened_branch_commits_its_tokens_and_its_keys_move_into_place(
    target: TorchTarget,
) -> None:
    """Greedy: the chain is wrong at index 1; a branch there holds the target's own token and
    a draft wrong at its index 2, another branch forks elsewhere. The decision is the chain's
    (1 accepted, the argmax recovered), then the branch's (2 accepted, the argmax after them);
    the cache holds exactly the committed text, and the next Verify from it, with no fixed
    tokens, decides by full forwards: the moved keys are the right ones."""
    engine = await _engine(target)
    slot = engine.open(Hello(fingerprint=target.fingerprint, sampling=GREEDY))
    prompt = [3, 4, 5, 6]
    chain = _greedy(target, prompt, 4)
    y = chain[1]
    chain[1] = (y + 1) % 64
    after = _greedy(target, [*prompt, chain[0], y], 4)
    branch = [*after[:2], (after[2] + 1) % 64, after[3]]
    decoy = Branch(0, (chain[0] + 2) % 64, np.array([1, 2], np.int64))
    work = Verify(
        _propose(prompt, chain, 0),
        want_bonus=False,
        branches=(decoy, Branch(1, y, np.array(branch, np.int64))),
    )
    before = engine.forwards
    o = await engine.run(slot, work)
    assert engine.forwards - before == 1
    assert isinstance(o.result, Verified)
    d, br = o.result.decision, o.result.branch
    assert (d.accepted, d.token) == (1, y)
    assert br is not None and br.index == 1
    assert (br.decision.accepted, br.decision.token) == (2, after[2])
    committed = [*prompt, chain[0], y, *after[:2]]
    assert slot.length == len(committed) == o.result.cache_len
    assert slot.tokens == committed
    # On from the cache: the keys of the branch's tokens moved from the tree's layout.
    nxt = _greedy(target, [*committed, after[2]], 3)
    o2 = await engine.run(slot, Verify(_propose([after[2]], nxt, len(committed)), True))
    assert isinstance(o2.result, Verified)
    assert o2.result.decision.accepted == 3
    assert o2.result.decision.bonus == _greedy(target, [*committed, after[2], *nxt], 1)[0]
    engine.shutdown()


async def test_a_branch_no_recovered_token_opens_costs_nothing_but_its_rows(
    target: TorchTarget,
) -> None:
    """Branches that do not open (full acceptance; a rejection recovering another token) leave
    the decision and the cache exactly as the chain alone would."""
    engine = await _engine(target)
    prompt = [7, 8, 9]
    chain = _greedy(target, prompt, 3)
    wrong = [chain[0], (chain[1] + 1) % 64, chain[2]]
    stray = (
        Branch(1, (chain[1] + 5) % 64, np.array([4], np.int64)),
        Branch(2, 1, np.zeros(0, np.int64)),
    )
    for draft, accepted in ((chain, 3), (wrong, 1)):
        slot = engine.open(Hello(fingerprint=target.fingerprint, sampling=GREEDY))
        o = await engine.run(slot, Verify(_propose(prompt, draft, 0), True, branches=stray))
        assert isinstance(o.result, Verified) and o.result.branch is None
        assert o.result.decision.accepted == accepted
        assert slot.tokens == [*prompt, *draft[:accepted]]
        engine.release(slot)
    engine.shutdown()


async def test_trees_keep_the_joint_law_of_two_tokens() -> None:
    """Sampled sessions (greedy-draft mode: the verifier recovers tokens itself) with a chain
    of two deterministic tokens and a branch forked at *every* alternative of both positions:
    the first two committed tokens, whichever of chain, branch or recovery gives them, have the
    target's joint law (chi-square over V² cells); branches open and are accepted and rejected."""
    v, n, chunk = 8, 6000, 200
    null = NullTarget(v)
    # every row's tree fits the step (a tree the step has no room for is left out)
    engine = await _engine(
        null,
        slots=chunk,
        max_batch_sessions=chunk,
        max_batch_tokens=chunk * 32,
        kv_tokens=chunk * 32,
    )
    params = SamplingParams(temperature=1.0)
    rows = null._rows.numpy()
    fixed = 5
    p1 = transform(rows[(fixed * 31) % len(rows)], params)

    def p2(a: int) -> np.ndarray:
        return transform(rows[(a * 31 + 1) % len(rows)], params)

    joint = np.concatenate([p1[a] * p2(a) for a in range(v)])
    x1 = int(np.argmax(p1))
    x2 = int(np.argmax(p2(x1)))
    # at index 0: every other token y, with the draft argmax p2(y); at index 1: every other
    # token, with no draft (its bonus is the third token)
    branches = tuple(
        Branch(0, y, np.array([int(np.argmax(p2(y)))], np.int64)) for y in range(v) if y != x1
    ) + tuple(Branch(1, y, np.zeros(0, np.int64)) for y in range(v) if y != x2)
    work = Verify(_propose([fixed], [x1, x2], 0), want_bonus=False, branches=branches)
    out: list[int] = []
    opened = accepted_in_branch = 0
    for c0 in range(0, n, chunk):
        slots = _open_many(engine, null, params, c0, chunk, correction=CorrectionMode.GREEDY_DRAFT)
        jobs = [lambda slot=slot: engine.run(slot, work) for slot in slots]
        for o in await _together(engine, jobs):
            assert isinstance(o.result, Verified)
            d, br = o.result.decision, o.result.branch
            assert d.sparse is None and d.candidates is None
            if d.accepted == 2:
                pair = [x1, x2]
            elif br is None:
                assert d.accepted == 1
                pair = [x1, int(d.token)]  # type: ignore[arg-type]
            else:
                opened += 1
                b = branches[br.index]
                bd = br.decision
                accepted_in_branch += bd.accepted
                follow = [
                    *b.draft[: bd.accepted].tolist(),
                    bd.token if bd.token is not None else bd.bonus,
                ]
                pair = [x1, int(d.token)] if d.accepted == 1 else [int(d.token), int(follow[0])]  # type: ignore[arg-type]
            out.append(pair[0] * v + pair[1])
        for slot in slots:
            engine.release(slot)
    pv = chi_square_pvalue(np.array(out), joint)
    assert pv > ALPHA, f"chi-square p-value {pv:.2e}"
    assert opened > n // 10 and 0 < accepted_in_branch < opened
    engine.shutdown()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)],
    ids=["T=1", "T=0.7,top-p=0.9"],
)
async def test_steps_ordered_by_pace_with_trees_keep_the_joint_law_of_two_tokens(
    params: SamplingParams,
) -> None:
    """The scheduler's new order through the engine: sessions of random weights (some starved
    for the deferral bound) queued together beyond what a step takes, their rounds cuttable,
    each with a branch at every alternative of both draft positions, on steps with room for
    the trees of some rows only (the rest verify their chain alone, their branches left for a
    co-generation). Whichever of chain, tree branch, cut, or a co-generation after a rejection
    gives the first two committed tokens, they have the target's joint law (chi-square over V²
    cells), at T = 1 and at T = 0.7 with top-p 0.9; trees both ride and are left out."""
    v, n, chunk = 8, 6000, 200
    null = NullTarget(v)
    engine = await _engine(
        null,
        slots=chunk,
        max_batch_sessions=chunk // 2,  # two steps: who goes first is the scheduler's order
        max_batch_tokens=chunk // 2 * 4 + 40 * 21,  # trees for about 40 rows a step
        kv_tokens=chunk * 32,
    )
    rows = null._rows.numpy()
    fixed = 5
    p1 = transform(rows[(fixed * 31) % len(rows)], params)

    def p2(a: int) -> np.ndarray:
        return transform(rows[(a * 31 + 1) % len(rows)], params)

    joint = np.concatenate([p1[a] * p2(a) for a in range(v)])
    x1 = int(np.argmax(p1))
    x2 = int(np.argmax(p2(x1)))
    branches = tuple(
        Branch(0, y, np.array([int(np.argmax(p2(y)))], np.int64)) for y in range(v) if y != x1
    ) + tuple(Branch(1, y, np.zeros(0, np.int64)) for y in range(v) if y != x2)
    rng = np.random.default_rng(7)
    out: list[int] = []
    opened = unbranched = 0
    for c0 in range(0, n, chunk):
        slots = _open_many(engine, null, params, c0, chunk, correction=CorrectionMode.GREEDY_DRAFT)
        works = [
            Verify(
                _propose([fixed], [x1, x2], 0),
                want_bonus=False,
                branches=branches,
                survival=(0.7, 0.5),
                mean_token=0.7,
                weight=float(rng.uniform(MIN_WEIGHT, MAX_WEIGHT)),
                waited=DEFER_BOUND if rng.random() < 0.1 else 0,
                # half pay for their trees whatever the step's price, half for none
                tree_value=100.0 if rng.random() < 0.5 else 0.0,
            )
            for _ in slots
        ]
        jobs = [lambda s=s, w=w: engine.run(s, w) for s, w in zip(slots, works, strict=True)]
        for slot, o in zip(slots, await _together(engine, jobs), strict=True):
            assert isinstance(o.result, Verified)
            d, br = o.result.decision, o.result.branch
            if d.accepted == 2:
                pair = [x1, x2]
            elif d.accepted == 1:
                pair = [x1, int(d.token if d.token is not None else d.bonus)]  # type: ignore[arg-type]
            elif br is not None:
                opened += 1
                b, bd = branches[br.index], br.decision
                first = (
                    b.draft[0] if bd.accepted else (bd.token if bd.token is not None else bd.bonus)
                )
                pair = [int(d.token), int(first)]  # type: ignore[arg-type]
            else:
                # rejected at the first token with no tree in the row: the next token is a
                # co-generation's (as the hedge's way would decide it, here with no draft)
                unbranched += 1
                token = int(d.token)  # type: ignore[arg-type]
                c = await engine.run(slot, CoGenerate(o.result.cache_len or 1, np.array([token])))
                assert isinstance(c.result, Verified) and c.result.decision.bonus is not None
                pair = [token, int(c.result.decision.bonus)]
            out.append(pair[0] * v + pair[1])
        for slot in slots:
            engine.release(slot)
    pv = chi_square_pvalue(np.array(out), joint)
    assert pv > ALPHA, f"chi-square p-value {pv:.2e}"
    assert opened > n // 20 and unbranched > n // 20, (opened, unbranched)
    engine.shutdown()
