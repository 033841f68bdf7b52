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
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from edge_agent.core import Rival
from edge_agent.lm import CausalLM, SupportsCausalLM
from shared.maths.sampling import Probs, sample, transform
from shared.runtime.kv_pool import common_prefix
from shared.wire.params import SamplingParams


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


@runtime_checkable
class DraftModel(Protocol):
    """What the edge drafts with: the model draft (:class:`Drafter`) and the benchmark's oracle
    and timed drafts alike. Blocking: call it on the agent's model worker."""

    @property
    def vocab_size(self) -> int: ...

    def next_dist(self, seq: Sequence[int], params: SamplingParams) -> Probs:
        """The draft distribution q after ``seq`` (non-empty)."""
        ...

    def draft(
        self,
        seq: Sequence[int],
        params: SamplingParams,
        rng: np.random.Generator,
        *,
        deterministic: bool,
        rival: bool = False,
    ) -> DraftStep:
        """The next draft token after ``seq`` (``rival``: compute the step's rival too)."""
        ...


def _rival(logits: npt.NDArray[np.floating], drafted: int) -> Rival:
    """The most likely token other than ``drafted`` (ties to the lowest id) and the draft's
    temperature-1 probability of ``drafted`` (at T = 0 the drafted token is q's argmax)."""
    x = np.asarray(logits, np.float64)
    saved, x[drafted] = x[drafted], -np.inf
    alt = int(np.argmax(x))
    x[drafted] = saved
    top = float(np.max(x))
    conf = float(np.exp(saved - top) / np.sum(np.exp(x - top)))
    return Rival(alt, conf)


class Drafter:
    """q(· | seq) for the draft model, with the request's sampling transform applied."""

    def __init__(self, loaded: SupportsCausalLM) -> None:
        # 64 logits rows cover any rollback of a pipeline (γ·D tokens) at 39 MB for a
        # 151,936-token vocabulary; a deeper one recomputes its row with one token.
        self.lm = CausalLM(loaded, logits_window=64)
        self.vocab_size = self.lm.vocab_size
        self.forwards = 0  # forwards run (for tests and stats)

    def cached_prefix(self, seq: Sequence[int]) -> int:
        """How many of ``seq``'s first tokens the draft's cache holds already (a chat's next
        turn: the conversation so far), so that drafting after them computes only the rest.
        No model work."""
        return common_prefix(self.lm.tokens, seq)

    def _sync(self, seq: Sequence[int]) -> None:
        """Make the cache hold exactly ``seq`` (crop to the common prefix, extend the rest)."""
        common = self.cached_prefix(seq)
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

    def draft(
        self,
        seq: Sequence[int],
        params: SamplingParams,
        rng: np.random.Generator,
        *,
        deterministic: bool,
        rival: bool = False,
    ) -> DraftStep:
        """Draw the next draft token after ``seq`` (:class:`DraftStep`): from the transformed
        draft distribution, or its argmax when ``deterministic`` (greedy decoding and the
        greedy-draft correction mode). ``rival`` costs a pass over the vocabulary: only
        while hedging."""
        logits = self._logits(seq)
        q: Probs = transform(logits, params)
        if deterministic:
            x = int(np.argmax(q))
            onehot = np.zeros_like(q)
            onehot[x] = 1.0
            return DraftStep(x, onehot, float(q[x]), _rival(logits, x) if rival else None)
        x = sample(q, rng)
        return DraftStep(x, q, float(q[x]), _rival(logits, x) if rival else None)
