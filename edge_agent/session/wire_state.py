"""One verifier session's wire state at the edge (:class:`WireState`): its epoch, the next
batch number, and ``verifier_len``, the length of the verifier's cache once every Propose sent
is processed and accepted; the next Propose starts there, carrying ``committed[verifier_len:]``
as fixed tokens (the prompt, a recovered or a bonus token). The single-verifier core holds one,
the federated core one per member. No I/O, no clock, no model.

Invariant: the verifier's text agrees with the edge's committed text and in-flight drafts on
its first ``verifier_len`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edge_agent.session.opening import raise_error
from edge_agent.session.pipeline import Batch, Pipeline
from shared.wire.codec import decode
from shared.wire.messages import SEQ_MODULUS, Error, Message, Propose
from shared.wire.packing import WireContext


class WireState:
    """One verifier session's wire state (module docstring).

    Its epoch is the pipeline's when the link is the session's only one (``pipe``: one
    session, one epoch, one owner); a federation's worker links keep their own (each worker
    enters an epoch when its Rollback is sent)."""

    def __init__(self, ctx: WireContext, pipe: Pipeline | None = None) -> None:
        self.ctx = ctx
        self.pipe = pipe
        self._epoch = 0
        self.next_seq = 0
        self.verifier_len = 0  # a new session's verifier cache is empty

    @property
    def epoch(self) -> int:
        return self.pipe.epoch if self.pipe is not None else self._epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        if self.pipe is not None:
            raise AttributeError("this link's epoch is its pipeline's")
        self._epoch = value

    def propose(
        self,
        committed: Sequence[int],
        b: Batch,
        index: int,
        with_q: bool,
        want_bonus: bool = False,
    ) -> Propose:
        """The Propose of batch ``b`` for this link (registered under ``index``)."""
        pos = self.verifier_len
        fixed = list(committed[pos:])
        seq = self.next_seq
        b.seqs[index] = seq
        b.fixed = len(fixed)
        self.verifier_len = pos + len(fixed) + len(b.draft)
        self.next_seq = (seq + 1) % SEQ_MODULUS
        q = (
            np.array([q[x] for x, q in zip(b.draft, b.q_rows, strict=True)], np.float32)
            if with_q
            else np.ones(len(b.draft), np.float32)
        )
        return Propose(
            epoch=self.epoch,
            seq=seq,
            pos=pos,
            draft=np.array(b.draft, np.int64),
            q=q,
            fixed=np.array(fixed, np.int64),
            want_bonus=want_bonus,
        )

    def decode(self, data: bytes) -> Message:
        """A frame from this verifier; Error frames raise
        (:func:`~edge_agent.session.opening.raise_error`)."""
        msg = decode(data, self.ctx)
        if isinstance(msg, Error):
            raise_error(msg)
        return msg
