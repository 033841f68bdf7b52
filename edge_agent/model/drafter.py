"""The draft model: the next-token distribution q after any token sequence.

The drafter owns the draft model's KV cache and *derives* its state from the sequence it is asked
about: the cache is cropped to the longest common prefix with that sequence and extended with the
rest. Rolling back after a rejection is therefore a crop (O(1)), never a copy; committing needs
nothing at all.

Every method here blocks (model forwards): call them on the agent's single model worker, never on
the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from edge_agent.model.lm import CausalLM, SupportsCausalLM
from edge_agent.session.branches import Rival
from shared.maths.sampling import Probs, SamplingParams, sample, transform
from shared.runtime.kv_pool import SlotPages, common_prefix


@dataclass(frozen=True)
class DraftStep:
    """One draft step: ``token`` drawn from ``q`` (the transformed draft distribution, or its
    one-hot argmax when the draft is deterministic); ``prob``: the draft's probability of the
    token before any one-hot (its confidence: the adaptive γ cuts a batch where it falls);
    ``rival``: the draft's most likely other token and its temperature-1 probability of the
    drafted one (where that is lowest, a hedge or a pre-drafted branch goes after the rival),
    when asked for."""

    token: int
    q: Probs
    prob: float = 1.0
    rival: Rival | None = None


@dataclass(frozen=True)
class DraftRow:
    """One draft step request (:meth:`DraftModel.draft`, a row of
    :meth:`BranchDrafting.draft_many`): the next token after ``seq`` (non-empty), drawn from the
    draft distribution transformed by ``params`` with ``rng``, or its argmax when
    ``deterministic`` (greedy decoding and the greedy-draft correction mode); ``rival``: compute
    the step's rival too (a pass over the vocabulary: only while hedging or pre-drafting)."""

    seq: Sequence[int]
    params: SamplingParams
    rng: np.random.Generator
    deterministic: bool
    rival: bool = False


@runtime_checkable
class DraftModel(Protocol):
    """What the edge drafts with: the model draft (:class:`Drafter`) and the benchmark's oracle
    and timed drafts alike. Blocking: call it on the agent's model worker."""

    @property
    def vocab_size(self) -> int: ...

    def next_dist(self, seq: Sequence[int], params: SamplingParams) -> Probs:
        """The draft distribution q after ``seq`` (non-empty)."""
        ...

    def draft(self, row: DraftRow) -> DraftStep:
        """The next draft token after ``row.seq`` (:class:`DraftRow`)."""
        ...


#: Alternatives a rival carries (``Rival.alts``): outcome pre-drafting prepares branches after
#: the likeliest of them.
RIVALS: Final = 3


def _rival(logits: npt.NDArray[np.floating], drafted: int) -> Rival:
    """The draft's ``RIVALS`` likeliest tokens other than ``drafted`` (ties to the lowest id),
    each with its temperature-1 probability, and that probability of ``drafted`` (at T = 0 the
    drafted token is q's argmax)."""
    x = np.asarray(logits, np.float64)
    p = np.exp(x - np.max(x))
    p /= p.sum()
    conf = float(p[drafted])
    p[drafted] = -1.0
    k = min(RIVALS, p.size - 1)
    if k <= 0:
        return Rival(drafted, 1.0)
    kth = np.partition(p, p.size - k)[p.size - k]  # the k-th largest probability
    order = sorted(np.flatnonzero(p >= kth).tolist(), key=lambda t: (-p[t], t))[:k]
    alts = tuple((int(t), float(p[t])) for t in order)
    return Rival(alts[0][0], conf, alts)


class Drafter:
    """q(· | seq) for the draft model, with the request's sampling transform applied.

    Besides the sequence it drafts (the KV cache's slot), it keeps the branches of recent
    :meth:`draft_many` calls (outcome pre-drafting): slots that share the sequence's pages up
    to where they part. A branch the text turns out to follow becomes the sequence
    (:meth:`_sync`), so drafting after a prepared outcome recomputes nothing."""

    #: Branches drafted together at most (``PipelineConfig.predraft`` allows up to 64).
    MAX_BRANCHES: Final = 64
    #: Branch slots kept between calls (their KV pages are the drafter's memory bound for
    #: branches: about a page of 64 tokens each beyond what they share).
    KEPT_BRANCHES: Final = 16
    #: Branches one batched step takes where it costs about one step: on a GPU-class device
    #: 8 (the team's H200 measurement, 8 × 5 tokens at 1.07 of 1 × 5); on a CPU 2 (this
    #: project's 2-core CPUs, ``python -m bench draft_batch``: 1 / 2 / 4 / 8 branches at
    #: 55 / 59 / 92 / 134 ms a step), so that a step under way delays the next batch little.
    BRANCH_BATCH_GPU: Final = 8
    BRANCH_BATCH_CPU: Final = 2
    #: "About one step": a batched step of branches costs at most this many single steps
    #: (:func:`branch_batch_for`; the two figures above are it at their devices' costs).
    BRANCH_STEP: Final = 1.25

    def __init__(self, loaded: SupportsCausalLM) -> None:
        # 64 logits rows cover any rollback of a pipeline (γ·D tokens) at 39 MB for a
        # 151,936-token vocabulary; a deeper one recomputes its row with one token.
        self.lm = CausalLM(loaded, logits_window=64)
        self.vocab_size = self.lm.vocab_size
        self.forwards = 0  # forwards run (for tests and stats)
        self._branches: list[SlotPages] = []

    @property
    def branch_batch(self) -> int:
        """Branches :meth:`draft_many` should be given at once, on this draft's device."""
        gpu = self.lm.device.type == "cuda"
        return self.BRANCH_BATCH_GPU if gpu else self.BRANCH_BATCH_CPU

    @classmethod
    def branch_batch_for(cls, batch_cost: float) -> int:
        """Branches one batched step takes where each branch past the first adds
        ``batch_cost`` of a step: the most whose step costs at most :data:`BRANCH_STEP` steps
        (1 + c·(B − 1) ≤ BRANCH_STEP), at least 1, at most :data:`BRANCH_BATCH_GPU` (a GPU's
        0.0104: 8; this project's CPUs' 0.20: 2)."""
        if batch_cost <= 0:
            return cls.BRANCH_BATCH_GPU
        return max(1, min(cls.BRANCH_BATCH_GPU, 1 + int((cls.BRANCH_STEP - 1.0) / batch_cost)))

    def cached_prefix(self, seq: Sequence[int]) -> int:
        """How many of ``seq``'s first tokens the draft's cache holds already (a chat's next
        turn: the conversation so far), so that drafting after them computes only the rest.
        No model work."""
        return common_prefix(self.lm.tokens, seq)

    def _sync(self, seq: Sequence[int]) -> None:
        """Make the cache hold exactly ``seq`` (crop to the common prefix, extend the rest),
        from the branch that shares most of it where one shares more than the sequence."""
        common = self.cached_prefix(seq)
        found = _sharing_most(self._branches, seq, common)
        if found is not None:
            branch, common = found
            self._branches.remove(branch)
            self._branches.append(self.lm.adopt(branch))
        self.lm.crop(common)
        if common < len(seq):
            self.forwards += 1
            self.lm.extend(seq[common:], last_rows=1)

    def _logits(self, seq: Sequence[int]) -> npt.NDArray[np.float32]:
        """The draft's raw float32 logits [V] for the token after ``seq`` (non-empty)."""
        if not seq:
            raise ValueError("the draft needs at least one token of context")
        self._sync(seq)
        out: npt.NDArray[np.float32] = self.lm.last_logits.numpy()
        return out

    def next_dist(self, seq: Sequence[int], params: SamplingParams) -> Probs:
        """The draft distribution q: [V] float64 for the token after ``seq`` (non-empty)."""
        out: Probs = transform(self._logits(seq), params)
        return out

    def draft(self, row: DraftRow) -> DraftStep:
        """Draw the next draft token after ``row.seq`` (:class:`DraftStep`), on the cached
        sequence."""
        return _step(self._logits(row.seq), row)

    def draft_many(self, rows: Sequence[DraftRow]) -> list[DraftStep]:
        """The next draft step after each row's sequence, in one batched forward: outcome
        pre-drafting's branches (rows sharing one RNG), or several generations' steps at once
        (an edge serving several requests, each row with its own sampling, RNG and kind). Each
        sequence runs in a branch: the kept branch that shares most of it where that is more
        than the cached sequence shares, cropped to what they share, else a fork of the cached
        sequence where they part; branches not asked about are kept, the latest first, up to
        ``KEPT_BRANCHES`` in all, and the rest given back. Steps are drawn in order, each from
        its row's RNG exactly as :meth:`draft` would draw them one after another."""
        logits = self._many_logits([r.seq for r in rows])
        return [_step(x, r) for x, r in zip(logits, rows, strict=True)]

    def _many_logits(self, seqs: Sequence[Sequence[int]]) -> npt.NDArray[np.float32]:
        """The raw logits [len(seqs), V] after each sequence, in one batched forward over
        branches (:meth:`draft_many`)."""
        if not 1 <= len(seqs) <= self.MAX_BRANCHES:
            raise ValueError(f"draft_many takes 1..{self.MAX_BRANCHES} sequences, got {len(seqs)}")
        free = list(self._branches)
        items: list[tuple[SlotPages, Sequence[int]]] = []
        for seq in seqs:
            if not seq:
                raise ValueError("the draft needs at least one token of context")
            # At least the last token goes through the forward: its row is the step's q.
            on_main = min(self.cached_prefix(seq), len(seq) - 1)
            # A branch is reused where it saves compute; else a fork (no compute) keeps it.
            found = _sharing_most(free, seq, on_main)
            if found is not None:
                slot, shared = found
                free.remove(slot)
                self.lm.crop_branch(slot, min(shared, len(seq) - 1))
            else:
                slot = self.lm.fork(on_main)
            items.append((slot, seq[slot.length :]))
        # Kept, the latest first, up to KEPT_BRANCHES: a prepared outcome whose slot is still
        # here costs nothing to continue once the verdict chooses it.
        self._branches = [slot for slot, _ in items] + free
        for slot in self._branches[max(self.KEPT_BRANCHES, len(items)) :]:
            self.lm.release(slot)
        del self._branches[max(self.KEPT_BRANCHES, len(items)) :]
        self.forwards += 1
        out: npt.NDArray[np.float32] = self.lm.extend_branches(items).numpy()
        return out

    def release_branches(self) -> None:
        """Give every branch's pages back."""
        for slot in self._branches:
            self.lm.release(slot)
        self._branches = []


def _sharing_most(
    branches: Sequence[SlotPages], seq: Sequence[int], floor: int
) -> tuple[SlotPages, int] | None:
    """The first of ``branches`` that shares the most of ``seq``'s first tokens, and how many,
    where that is more than ``floor``; else None."""
    best: tuple[SlotPages, int] | None = None
    for branch in branches:
        shared = common_prefix(branch.tokens, seq)
        if shared > (floor if best is None else best[1]):
            best = (branch, shared)
    return best


def _step(logits: npt.NDArray[np.float32], row: DraftRow) -> DraftStep:
    """``row``'s draft step from the draft's raw logits row (:meth:`Drafter.draft`)."""
    q: Probs = transform(logits, row.params)
    if row.deterministic:
        x = int(np.argmax(q))
        onehot = np.zeros_like(q)
        onehot[x] = 1.0
        return DraftStep(x, onehot, float(q[x]), _rival(logits, x) if row.rival else None)
    x = sample(q, row.rng)
    return DraftStep(x, q, float(q[x]), _rival(logits, x) if row.rival else None)


@runtime_checkable
class BranchDrafting(Protocol):
    """A draft that steps several branches in one batched forward (:meth:`Drafter.draft_many`);
    the driver falls back to one step at a time for a :class:`DraftModel` that does not."""

    @property
    def branch_batch(self) -> int:
        """Branches one batched step should take (about the cost of one step here)."""
        ...

    def draft_many(self, rows: Sequence[DraftRow]) -> list[DraftStep]:
        """Each row's step, in one batched forward, drawn in order (:class:`DraftRow`)."""
        ...
