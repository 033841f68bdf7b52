"""A fake model side for tests that drive :class:`cloud_verifier.session.core.VerifierCore` in
memory: a
token cache and a target law, answering the core's model work as a real target would."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from cloud_verifier.engine.work import (
    BranchTaken,
    CoGenerate,
    Crop,
    Cropped,
    Draw,
    Drawn,
    Federate,
    Federated,
    Result,
    Verified,
    Verify,
    Work,
)
from cloud_verifier.session.core import VerifierCore
from shared.maths.compression import SparseDist
from shared.maths.rejection import CorrectionMode, Decision, draw_candidates, one_hot, verify_batch
from shared.maths.sampling import sample

Row = npt.NDArray[np.float64]
#: A target: the text so far -> p(· | text), a float64 row over V (after the session's
#: sampling transform; one-hot for a greedy session).
Law = Callable[[list[int]], Row]


def greedy_law(next_token: Callable[[list[int]], int], v: int) -> Law:
    """A deterministic target: p(· | text) is one-hot at ``next_token(text)``."""
    return lambda text: one_hot(next_token(text), v)


def bigram_law(table: Row) -> Law:
    """A bigram target: p(· | text) = ``table[last token]`` ([V, V])."""
    return lambda text: table[text[-1]]


def support(row: Row) -> SparseDist:
    """Every id ``row`` gives mass, in decreasing probability (a lossless SparseDist)."""
    ids = np.argsort(-row, kind="stable")[: np.count_nonzero(row)]
    return SparseDist(ids, row[ids].astype(np.float32))


class FakeTargetModel:
    """The verifier's model side over ``law``: it holds the tokens a KV cache would hold and
    decides as the verifier does (greedy sessions exactly, others by rejection sampling with
    ``rng``). ``cogen_law``: what CoGenerate samples from (default ``law``; another law is a
    broken verifier). ``trust_hedges``: broken on purpose, a CoGenerate's draft (a hedge's or a
    cloud draft) accepted unverified; ``trust_branches``: a token tree's branch so.

    Checks that stale work never reaches the model: work starts where the cache ends, in the
    core's current epoch."""

    def __init__(
        self,
        law: Law,
        rng: np.random.Generator | None = None,
        cogen_law: Law | None = None,
        trust_hedges: bool = False,
        trust_branches: bool = False,
    ) -> None:
        self.law = law
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.cogen_law = cogen_law if cogen_law is not None else law
        self.trust_hedges = trust_hedges
        self.trust_branches = trust_branches
        self.cache: list[int] = []
        self.kept: tuple[Row, int] | None = None  # p and the draft token at the last rejection

    def run(self, work: Work, core: VerifierCore) -> Result:
        hello = core.hello
        assert hello is not None
        greedy = hello.sampling.greedy
        if isinstance(work, Crop):
            assert work.pos <= len(self.cache), (work.pos, len(self.cache))
            del self.cache[work.pos :]
            return Cropped()
        if isinstance(work, Draw):
            assert self.kept is not None, "a Draw with no row kept (greedy sessions never resample)"
            return Drawn(draw_candidates(self.kept[0], self.kept[1], work.m, self.rng))
        pos = work.pos if isinstance(work, CoGenerate) else work.propose.pos
        assert pos == len(self.cache) == core.cache_len, (pos, len(self.cache), core.cache_len)
        if not isinstance(work, CoGenerate):
            assert work.propose.epoch == core.epoch, (work.propose.epoch, core.epoch)
        self.cache += work.fixed.tolist()
        draft: list[int] = work.draft.tolist()
        if isinstance(work, CoGenerate) and (not draft or self.trust_hedges):
            self.cache += draft  # a hedge's draft only when trusted (broken)
            row = self.cogen_law(self.cache)
            bonus = int(np.argmax(row)) if greedy else sample(row, self.rng)
            return Verified(Decision(len(draft), bonus=bonus))
        rows = [self.law(self.cache + draft[:i]) for i in range(len(draft) + 1)]
        if isinstance(work, Federate):
            self.cache += draft
            p_draft = np.array([r[x] for r, x in zip(rows, draft, strict=False)], np.float32)
            dists = tuple(support(r) for r in rows)
            return Federated(dists, p_draft, np.zeros((len(rows), 2), np.float32))
        d = verify_batch(
            np.stack(rows),
            draft,
            work.q,
            greedy=greedy,
            # A CoGenerate's draft (a hedge's or the verifier's own) is deterministic: the
            # verifier draws the recovered token itself, as the engine's runner does.
            correction=str(
                CorrectionMode.GREEDY_DRAFT if isinstance(work, CoGenerate) else hello.correction
            ),
            rng=self.rng,
            want_bonus=isinstance(work, CoGenerate) or work.want_bonus,
        )
        self.cache += draft[: d.accepted]
        kept = d.rejected and d.candidates is not None
        if kept:
            self.kept = (rows[d.accepted], draft[d.accepted])
        if isinstance(work, Verify) and d.token is not None:
            # A token-tree branch the recovered token opens: decided after it, as a
            # deterministic draft (the runner's rule); trusted unverified when broken.
            for i, b in enumerate(work.branches):
                if (b.at, b.token) == (d.accepted, d.token):
                    self.cache.append(d.token)
                    bd = b.draft.tolist()
                    if self.trust_branches:
                        row = self.law(self.cache + bd)
                        bonus = int(np.argmax(row)) if greedy else sample(row, self.rng)
                        taken = Decision(len(bd), bonus=bonus)
                    else:
                        taken = verify_batch(
                            np.stack([self.law(self.cache + bd[:j]) for j in range(len(bd) + 1)]),
                            bd,
                            np.ones(len(bd), np.float32),
                            greedy=greedy,
                            correction=str(CorrectionMode.GREEDY_DRAFT),
                            rng=self.rng,
                            want_bonus=True,
                        )
                    self.cache += bd[: taken.accepted]
                    return Verified(d, branch=BranchTaken(i, taken))
        return Verified(d, kept_row=kept)
