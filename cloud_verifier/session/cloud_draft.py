"""Cloud-side speculation: drafts the verifier makes for itself, from the session's own text.

Used in co-generation (:class:`~cloud_verifier.engine.work.CoGenerate`): while a session has no
valid
edge draft queued, the verifier does not decode one token per forward but verifies a draft of
its own in that forward, so a gap in the edge's drafts costs fewer target forwards; an edge
with no draft model at all (cloud-only speculative decoding) gets every token so. Sources, in
the order a co-generation step tries them (a hedge of the edge's comes first):

* ``tail``: after a rejection, the rejected draft's remaining tokens, re-aligned one position
  on, behind the correction (a draft that differs from the target in one token often goes on
  as the target does);
* ``ngram``: prompt lookup over the session's own text (:func:`ngram_draft`);
* a draft model (the ``cloud_draft_model`` setting: a model spec, on the verifier's device,
  batched across sessions: :mod:`cloud_verifier.engine.draft_model`), greedy.

Exactness: a cloud draft is a deterministic function of the text known before any of the
positions it drafts, so its q is a point mass; the verifier accepts a draft token x with
probability min(1, p(x)/1) = p(x) and, on a rejection, draws the recovered token from
norm(max(0, p − δ_x)) (the greedy-draft rule, :data:`~shared.maths.rejection.CorrectionMode`
``GREEDY_DRAFT``), whatever correction mode the session negotiated: the committed text keeps the
target's law (Leviathan et al., Theorem 1, with a deterministic draft).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.enums import TextEnum
from shared.errors import WanspecError


class CloudDraft(TextEnum):
    """Which drafts the verifier makes for itself."""

    OFF = "off"
    #: Prompt lookup: the tokens that followed the latest earlier occurrence of the text's last
    #: n tokens (no model: repeated names, numbers, code and quoted text).
    NGRAM = "ngram"
    #: The rest of a rejected draft, one position on behind the correction.
    TAIL = "tail"


class CloudDraftError(WanspecError, ValueError):
    """A ``cloud_draft`` setting that names no known source."""


def parse_cloud_drafts(text: str) -> frozenset[CloudDraft]:
    """``"ngram,tail"`` → the sources named (``off`` alone, or nothing: none)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    try:
        sources = {CloudDraft.parse(x, "cloud_draft") for x in names}
    except ValueError as e:
        raise CloudDraftError(str(e)) from None
    if CloudDraft.OFF in sources and len(sources) > 1:
        raise CloudDraftError(f"cloud_draft {text!r}: 'off' cannot be combined with a source")
    return frozenset(sources - {CloudDraft.OFF})


def ngram_draft(
    text: Sequence[int], max_tokens: int, *, max_n: int = 3, window: int = 4096
) -> list[int]:
    """Prompt lookup over the last ``window`` tokens of ``text``: for n from ``max_n`` down to 1,
    the latest earlier position where the text's last n tokens occur, and up to ``max_tokens``
    tokens that followed it there (empty: no match, or no room)."""
    if max_tokens <= 0 or len(text) < 2:
        return []
    arr = np.asarray(text[-window:], dtype=np.int64)
    size = len(arr)
    for n in range(min(max_n, size - 1), 0, -1):
        # Windows arr[i : i + n] with a token after them (i + n <= size - 1).
        windows = np.lib.stride_tricks.sliding_window_view(arr[: size - 1], n)
        hits = np.flatnonzero((windows == arr[size - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            out: list[int] = arr[start : start + max_tokens].tolist()
            return out
    return []


def tail_draft(
    tail: tuple[int, Sequence[int]] | None, text: Sequence[int], max_tokens: int
) -> list[int]:
    """The kept tail ``(pos, tokens)`` (tokens[i] drafted for position pos + i) where it
    continues ``text``: the text from ``pos`` on agrees with its head, and up to
    ``max_tokens`` tokens after that (empty: none kept, no agreement, or nothing left).

    Exact as a deterministic draft: the tokens were fixed by the edge before the verifier
    drew any token at ``pos`` or after; which of them is proposed depends only on the text
    before the position drafted."""
    if tail is None or max_tokens <= 0:
        return []
    pos, tokens = tail
    k = len(text) - pos  # tail tokens the text already has
    if k < 0 or k >= len(tokens) or list(text[pos:]) != list(tokens[:k]):
        return []
    return list(tokens[k : k + max_tokens])


class DraftLength(TextEnum):
    """How long a co-generation's model draft is (the ``cloud_draft_length`` setting)."""

    #: Per session: the length that maximises the expected tokens per unit of verifier time,
    #: from the session's measured acceptance and the measured cost of a draft forward
    #: (:func:`~cloud_verifier.engine.draft_length.draft_length`); 0 (no model draft) where
    #: drafting does not pay.
    AUTO = "auto"
    #: Always ``cloud_draft_tokens`` (within the room the co-generation bound leaves).
    FIXED = "fixed"


class DraftAcceptance:
    """A session's per-token acceptance α of its model drafts, estimated from the drafts
    verified so far: a draft of n tokens with k accepted is k successes and, if k < n, one
    failure of a geometric law (the tokens after a rejection are never tried). Older evidence
    fades by ``decay`` at each co-generation that asked for a draft, whether one was made or
    not, so a session whose drafts stopped paying is tried again once the prior outweighs its
    old failures. The prior (``prior`` with the weight of ``weight`` trials) is optimistic: a new
    session drafts. With every draft rejected at once, α settles at
    prior·weight / (1/(1 − decay) + weight) (0.064 by default, below a GPU's c ≈ 0.11), and
    after k co-generations with no draft at prior·weight / (decay^k/(1 − decay) + weight)."""

    def __init__(self, prior: float = 0.7, weight: float = 1.0, decay: float = 0.9) -> None:
        self.prior, self.weight, self.decay = prior, weight, decay
        self.accepted = 0.0  # faded successes
        self.trials = 0.0  # faded successes + failures

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified draft of ``drafted`` tokens, ``accepted`` of them accepted."""
        failure = 1.0 if accepted < drafted else 0.0
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + accepted + failure

    def fade(self) -> None:
        """A co-generation that asked for a draft and got none: no evidence, older fades."""
        self.accepted *= self.decay
        self.trials *= self.decay

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior * self.weight) / (self.trials + self.weight)
