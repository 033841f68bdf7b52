"""The model side of one verification session: its KV cache, its RNG and the work it runs.

The session's rules live in :class:`shared.verifier_core.VerifierCore`; this module only carries
out the work that core asks for (:data:`shared.verifier_core.Work`) on the engine's worker
thread and returns the result the core expects. Every job leaves the cache as the core assumes
(the accepted prefix after a rejection, fixed + draft after a full acceptance) or, when it
fails, restored to its length before the job (reported in :class:`Failed`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cloud_verifier.engine import Sequence
from shared import compression
from shared.protocol import Hello, Propose
from shared.rejection import draw_candidates, verify_batch
from shared.sampling import Probs, transform
from shared.verifier_core import (
    Crop,
    Cropped,
    Draw,
    Drawn,
    Failed,
    Federate,
    Federated,
    Result,
    Verified,
    Verify,
    Work,
)


@dataclass(frozen=True)
class Timing:
    forward_s: float  # the target's forward alone
    job_s: float  # forward + sampling transform + decision


class SessionModel:
    """One session's target cache and RNG (seeded by the Hello's ``seed``). Blocking: every
    method runs on the engine's worker thread."""

    def __init__(self, seq: Sequence, hello: Hello) -> None:
        self.seq = seq
        self.hello = hello
        self.rng = np.random.default_rng(hello.seed)
        #: p at the last rejected position (candidates mode), for Resample draws.
        self._kept: tuple[Probs, int] | None = None  # ([V], rejected id)

    def run(self, work: Work) -> tuple[Result, Timing | None]:
        """Carry out ``work``; exceptions become :class:`Failed` (the cache restored if it can)."""
        start = self.seq.length
        t0 = time.perf_counter()
        try:
            if isinstance(work, Verify):
                return self._verify(work, t0)
            if isinstance(work, Federate):
                return self._federate(work.propose, t0)
            if isinstance(work, Crop):
                self._kept = None
                self.seq.crop(work.pos)
                return Cropped(), None
            if isinstance(work, Draw):
                if self._kept is None:
                    raise RuntimeError("no rejected row kept for a Resample")
                p_row, rejected = self._kept
                return Drawn(draw_candidates(p_row, rejected, work.m, self.rng)), None
        except Exception as e:
            if self.seq.length > start and not isinstance(work, Crop):
                with contextlib.suppress(Exception):
                    self.seq.crop(start)
            return Failed(f"{type(e).__name__}: {e}", self.seq.length), None
        raise TypeError(f"not model work: {type(work).__name__}")

    def _rows(self, p: Propose) -> tuple[npt.NDArray[np.float32], float]:
        """Run the target over fixed + draft. Returns the γ+1 logit rows [γ+1, V] (row i scores
        draft[i], row γ is the bonus position) and the forward time."""
        f, g = len(p.fixed), len(p.draft)
        tokens = [*p.fixed.tolist(), *p.draft.tolist()]
        # F = 0: draft[0] is scored by the logits after the last cached token.
        prev = self.seq.last_logits()[None] if f == 0 else None  # [1, V]
        t0 = time.perf_counter()
        logits = self.seq.extend(tokens, last_rows=g if f == 0 else g + 1)  # [γ or γ+1, V]
        forward_s = time.perf_counter() - t0
        rows = logits if prev is None else np.concatenate([prev, logits])
        return rows, forward_s

    def _verify(self, work: Verify, t0: float) -> tuple[Result, Timing]:
        p, h = work.propose, self.hello
        start = self.seq.length
        self._kept = None
        rows, forward_s = self._rows(p)
        probs = transform(rows, h.sampling)  # [γ+1, V] float64
        d = verify_batch(
            probs,
            p.draft,
            p.q,
            greedy=h.sampling.greedy,
            correction=h.correction,
            rng=self.rng,
            k=h.k,
            eps_target=h.eps_target,
            m=h.m,
            want_bonus=work.want_bonus,
        )
        kept = False
        if d.accepted < len(p.draft):
            self.seq.crop(start + len(p.fixed) + d.accepted)
            if d.candidates is not None:
                self._kept = (probs[d.accepted].copy(), int(p.draft[d.accepted]))
                kept = True
        return Verified(d, kept_row=kept), Timing(forward_s, time.perf_counter() - t0)

    def _federate(self, p: Propose, t0: float) -> tuple[Result, Timing]:
        h = self.hello
        self._kept = None
        rows, forward_s = self._rows(p)
        probs = transform(rows, h.sampling)  # [γ+1, V] float64
        vocab = probs.shape[1]
        dists = tuple(compression.compress(row, h.k, h.eps_target) for row in probs)
        p_draft = probs[np.arange(len(p.draft)), p.draft].astype(np.float32)  # [γ]
        l1 = np.array(
            [
                [
                    compression.l1(compression.reconstruct(d, vocab, how), row)
                    for how in compression.RECONSTRUCTIONS
                ]
                for d, row in zip(dists, probs, strict=True)
            ],
            dtype=np.float32,
        )  # [γ+1, 2]: ‖A − p‖₁, ‖B − p‖₁
        return Federated(dists, p_draft, l1), Timing(forward_s, time.perf_counter() - t0)
