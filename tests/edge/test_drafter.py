"""The draft model's steps (edge_agent.model.drafter.Drafter) on a tiny real model: the rival a
hedge or a pre-drafted branch goes after."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge_agent.model.drafter import RIVALS, Drafter, DraftRow
from shared.maths.sampling import SamplingParams, transform
from shared.runtime.models import load_model


def test_the_rival_is_the_likeliest_other_token_and_conf_the_drafted_ones_probability(
    tiny_model_dir: Path,
) -> None:
    drafter = Drafter(load_model(str(tiny_model_dir)))
    rng = np.random.default_rng(0)
    seen_off_argmax = False
    for i in range(40):
        seq = [1, 2 + i % 7, 3 + i % 11]
        params = SamplingParams(0.0 if i % 2 else 1.0)
        step = drafter.draft(DraftRow(seq, params, rng, i % 2 == 1, rival=True))
        assert step.rival is not None
        p1 = transform(drafter._logits(seq), SamplingParams(1.0))  # temperature 1
        assert step.rival.token != step.token
        others = np.delete(np.arange(len(p1)), step.token)
        assert step.rival.token == int(others[np.argmax(p1[others])])
        assert np.isclose(step.rival.conf, p1[step.token], rtol=1e-5)
        seen_off_argmax |= step.token != int(np.argmax(p1))
    # Sampled steps that drew another token than q's argmax: their rival is still another
    # token (the argmax, here), never the drafted one.
    assert seen_off_argmax


def test_a_rival_carries_the_likeliest_alternatives_in_order(tiny_model_dir: Path) -> None:
    """``Rival.alts``: the RIVALS likeliest tokens other than the drafted one, likeliest first,
    each with its temperature-1 probability (where pre-drafting goes)."""
    drafter = Drafter(load_model(str(tiny_model_dir)))
    rng = np.random.default_rng(1)
    for i in range(10):
        seq = [1, 5 + i, 9 + 2 * i]
        step = drafter.draft(DraftRow(seq, SamplingParams(1.0), rng, False, rival=True))
        assert step.rival is not None
        p1 = transform(drafter._logits(seq), SamplingParams(1.0))
        others = [t for t in np.argsort(-p1, kind="stable").tolist() if t != step.token]
        assert [t for t, _ in step.rival.alts] == others[:RIVALS]
        assert np.allclose([q for _, q in step.rival.alts], p1[others[:RIVALS]], rtol=1e-5)
        assert step.rival.token == others[0]


def _count_extends(drafter: Drafter) -> list[int]:
    """From now on, the number of ids of each forward on ``drafter``'s own sequence."""
    extended: list[int] = []
    real_extend = drafter.lm.extend

    def spy(ids: list[int], **kw: int | None) -> object:
        extended.append(len(ids))
        return real_extend(ids, **kw)

    drafter.lm.extend = spy  # type: ignore[method-assign]
    return extended


def test_branches_drafted_together_are_what_one_at_a_time_gives(tiny_model_dir: Path) -> None:
    """``draft_many``: branches forked from the cached sequence (inside and at the end of a
    page, so pages are shared), stepped in one batched forward, give the steps a fresh
    drafter gives one sequence at a time, while the sequence rewrites positions of a shared
    page between steps (copied on write, by either side); a branch the text then follows
    becomes the sequence with one token computed; giving
    the branches back leaves the pool holding the sequence only."""
    loaded = load_model(str(tiny_model_dir))
    edge, ref = Drafter(loaded), Drafter(loaded)
    greedy, t1 = SamplingParams(0.0), SamplingParams(1.0)
    rng = np.random.default_rng(0)
    main = [int(t) for t in np.random.default_rng(3).integers(1, 64, size=90)]
    edge.draft(DraftRow(main, greedy, rng, True))
    seqs = [[*main[:70], 7], [*main[:64], 9], [*main[:90], 11], [*main[:3], 12]]
    for k in range(3):
        steps = edge.draft_many([DraftRow(s, t1, rng, False, rival=True) for s in seqs])
        for seq, step in zip(seqs, steps, strict=True):
            assert np.allclose(step.q, ref.next_dist(seq, t1), atol=1e-5)
            assert step.rival is not None and step.rival.token != step.token
        seqs = [[*seq, step.token] for seq, step in zip(seqs, steps, strict=True)]
        # The sequence rewrites positions of a page a branch shares: it copies it first.
        edge.draft(DraftRow([*main[: 50 - k], k + 1], t1, rng, False))
    edge.draft(DraftRow(main, t1, rng, False))
    assert edge.lm.tokens == tuple(main)
    assert np.allclose(edge.next_dist(main, greedy), ref.next_dist(main, greedy), atol=1e-5)
    # The text follows the first branch: it becomes the sequence, one token computed.
    extended = _count_extends(edge)
    follow = seqs[0] + [5]
    assert np.allclose(edge.next_dist(follow, greedy), ref.next_dist(follow, greedy), atol=1e-5)
    assert extended == [2] and edge.lm.tokens == tuple(follow)
    edge.release_branches()
    pool = edge.lm._pool
    assert pool.pages_used == -(-len(follow) // pool.page_size)


def test_branches_are_kept_across_calls_up_to_their_bound(tiny_model_dir: Path) -> None:
    """A branch not asked about in a later call stays (a prepared outcome a verdict may still
    choose: continuing it computes only what is new); at most KEPT_BRANCHES stay."""
    edge = Drafter(load_model(str(tiny_model_dir)))
    greedy, rng = SamplingParams(0.0), np.random.default_rng(0)
    main = list(range(1, 41))
    edge.draft(DraftRow(main, greedy, rng, True))
    a = [*main[:30], 50, 51, 52]
    edge.draft_many([DraftRow(a, greedy, rng, True)])
    for k in range(Drafter.KEPT_BRANCHES + 4):
        edge.draft_many([DraftRow([*main[:20], k + 1, k + 2], greedy, rng, True)])
    assert len(edge._branches) == Drafter.KEPT_BRANCHES
    edge = Drafter(load_model(str(tiny_model_dir)))
    edge.draft(DraftRow(main, greedy, rng, True))
    edge.draft_many([DraftRow(a, greedy, rng, True)])
    edge.draft_many([DraftRow([*main[:20], 9], greedy, rng, True)])
    extended = _count_extends(edge)
    edge.draft(DraftRow([*a, 53], greedy, rng, True))
    assert extended == [1] and edge.lm.tokens == (*a, 53)  # a's slot holds a: only 53 is new
