"""Oracle drafts for the benchmark: a drafter whose acceptance rate is a chosen α.

``oracle:alpha=A`` proposes, at each position on the target's greedy path, the target's own greedy
token with probability A and a wrong one otherwise, so greedy verification accepts each drafted
token with probability A, independently of the text: the pipeline can be measured against a
draft of known quality, without a second model (and without its compute: the draft step is pure
padding, see :class:`bench.lib.edge.TimedDrafter`).

How: the target's greedy continuation of every prompt is computed once, before the run
(:func:`greedy_continuation`, the same single-token steps as :mod:`bench.net.ar_server`), and shared
by all oracles (:class:`GreedyPaths`). For a context ``seq`` extending prompt P with k tokens:

* on the path (``seq[len(P):] == greedy[:k]``): propose ``greedy[k]`` if the A-coin of position k
  says so, else ``(greedy[k] + 1) % V``;
* off the path (an earlier draft token of this context is wrong) or past the precomputed
  continuation: propose ``greedy[min(k, last)]``; the batch is rejected earlier anyway.

The A-coins are fixed per (seed, prompt, position): drawn once per prompt from the oracle's own
seeded :class:`numpy.random.Generator`. A position redrafted after a rollback therefore gets the
same answer, runs are reproducible whatever the timing, and every mode sees the same acceptance
pattern (and coins are shared across α, so the accepted positions of α=0.75 include those of
α=0.6). q is the one-hot of the proposed token: the oracle is meant for greedy runs.

Greedy verification is exact only if the verifier's greedy text is this precomputed one; a
near-tie flipped by a different forward chunking would put the oracle off the path for the rest
of that generation. :attr:`OracleDrafter.stats` counts on-path and off-path draft steps, and the
benchmark records whether each generation followed the path.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edge_agent.model.drafter import DraftRow, DraftStep
from edge_agent.model.lm import CausalLM, SupportsCausalLM
from shared.maths.sampling import Probs, SamplingParams

__all__ = [
    "GreedyPaths",
    "OracleDrafter",
    "OracleStats",
    "greedy_continuation",
    "is_oracle",
    "parse_oracle",
]

_SPEC = re.compile(r"^oracle:alpha=([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")


def is_oracle(spec: str) -> bool:
    return spec.startswith("oracle:")


def parse_oracle(spec: str) -> float:
    """α of an ``oracle:alpha=A`` draft spec (0 ≤ A ≤ 1); ValueError otherwise."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise ValueError(f"bad oracle draft {spec!r}: expected oracle:alpha=A, 0 <= A <= 1")
    alpha = float(m.group(1))
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"bad oracle draft {spec!r}: alpha must be in [0, 1]")
    return alpha


def greedy_continuation(
    loaded: SupportsCausalLM, prompt: Sequence[int], n: int, eos: Sequence[int] = ()
) -> list[int]:
    """The target's greedy continuation of ``prompt``: up to ``n`` tokens, ending at an EOS id.

    Same computation as the autoregressive baseline (:mod:`bench.net.ar_server`): prefill, then one
    single-token forward per step, argmax of the float32 logits.
    """
    import torch

    stop = {int(t) for t in eos}
    lm = CausalLM(loaded)
    out: list[int] = []
    feed = [int(t) for t in prompt]
    with torch.inference_mode():
        for _ in range(n):
            tok = int(lm.extend(feed)[-1].argmax())
            out.append(tok)
            if tok in stop:
                break
            feed = [tok]
    return out


class GreedyPaths:
    """The target's greedy continuation of each prompt, keyed by ``tuple(prompt)``."""

    def __init__(self, loaded: SupportsCausalLM, length: int, eos: Sequence[int] = ()) -> None:
        self.loaded = loaded
        self.length = length
        self.eos = list(eos)
        self.paths: dict[tuple[int, ...], list[int]] = {}

    def add(self, prompt: Sequence[int]) -> list[int]:
        """The continuation of ``prompt`` (computed on first use, then cached)."""
        key = tuple(int(t) for t in prompt)
        if key not in self.paths:
            self.paths[key] = greedy_continuation(self.loaded, key, self.length, self.eos)
        return self.paths[key]

    def __contains__(self, prompt: Sequence[int]) -> bool:
        return tuple(prompt) in self.paths


@dataclass
class OracleStats:
    hits: int = 0  # on the path, proposed the greedy token
    misses: int = 0  # on the path, proposed a wrong token
    off_path: int = 0  # context already off the path (or past the continuation)

    @property
    def alpha_measured(self) -> float | None:
        n = self.hits + self.misses
        return self.hits / n if n else None


class OracleDrafter:
    """A draft that proposes the target's greedy token with probability α (module docstring):
    a :class:`~edge_agent.model.drafter.DraftModel` with no model."""

    def __init__(
        self,
        paths: dict[tuple[int, ...], list[int]],
        vocab_size: int,
        alpha: float,
        *,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.paths = paths  # shared, filled before the run (GreedyPaths.paths)
        self.vocab_size = vocab_size
        self.alpha = alpha
        self.seed = seed
        self.forwards = 0  # Drafter's counter: an oracle runs none
        self.stats = OracleStats()
        self._coins: dict[tuple[int, ...], np.ndarray] = {}
        self._last: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ the path

    def _prompt_of(self, seq: Sequence[int]) -> tuple[int, ...]:
        """The registered prompt ``seq`` extends (the longest, if several do)."""
        last = self._last
        if last is not None and len(seq) >= len(last) and tuple(seq[: len(last)]) == last:
            return last
        best: tuple[int, ...] | None = None
        for prompt in self.paths:
            n = len(prompt)
            if len(seq) >= n and (best is None or n > len(best)) and tuple(seq[:n]) == prompt:
                best = prompt
        if best is None:
            raise LookupError(
                f"the oracle draft knows no prompt that this context of {len(seq)} tokens "
                "extends (its greedy continuation must be computed before the run)"
            )
        self._last = best
        return best

    def _coin(self, prompt: tuple[int, ...], k: int) -> bool:
        """The A-coin of position k of ``prompt``'s continuation: fixed per (seed, prompt, k)."""
        coins = self._coins.get(prompt)
        if coins is None:
            key = zlib.crc32(np.asarray(prompt, np.int64).tobytes())
            rng = np.random.default_rng([self.seed, key])
            coins = rng.random(len(self.paths[prompt]))
            self._coins[prompt] = coins
        return bool(coins[k] < self.alpha)

    def propose(self, seq: Sequence[int]) -> int:
        """The oracle's token after ``seq``."""
        prompt = self._prompt_of(seq)
        path = self.paths[prompt]
        k = len(seq) - len(prompt)
        if not path:
            self.stats.off_path += 1
            return 0
        if k >= len(path) or list(seq[len(prompt) :]) != path[:k]:
            self.stats.off_path += 1
            return path[min(k, len(path) - 1)]
        if self._coin(prompt, k):
            self.stats.hits += 1
            return path[k]
        self.stats.misses += 1
        return (path[k] + 1) % self.vocab_size

    def on_path(self, prompt: Sequence[int], generated: Sequence[int]) -> bool:
        """Whether ``generated`` (after ``prompt``) is a prefix of the precomputed path."""
        path = self.paths.get(tuple(prompt))
        return path is not None and list(generated) == path[: len(generated)]

    # ------------------------------------------------------------------ DraftModel

    def _onehot(self, x: int) -> Probs:
        q: Probs = np.zeros(self.vocab_size, np.float64)
        q[x] = 1.0
        return q

    def next_dist(self, seq: Sequence[int], params: SamplingParams) -> Probs:
        if not seq:
            raise ValueError("the draft needs at least one token of context")
        return self._onehot(self.propose(seq))

    def draft(self, row: DraftRow) -> DraftStep:
        """The oracle's token with a one-hot q, whatever ``row.deterministic`` (module
        docstring). Its confidence is α (exactly calibrated, the same at every position: the
        adaptive γ's early cut sees it); it has no rival (an oracle is never hedged)."""
        if not row.seq:
            raise ValueError("the draft needs at least one token of context")
        x = self.propose(row.seq)
        return DraftStep(x, self._onehot(x), self.alpha)
