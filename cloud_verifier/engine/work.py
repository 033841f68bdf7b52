"""The verifier's model work as the session core asks for it and the engine answers it: the
work requests (:data:`Work`), their results (:data:`Result`, :class:`Failed` with its
:class:`FailureKind`), the one crop rule (:func:`cache_after`) and the bounds of the pace a
request carries (a session's weight, :data:`MIN_WEIGHT` to :data:`MAX_WEIGHT`, and
:data:`DEFER_BOUND`: :mod:`cloud_verifier.session.pace` sets them, the scheduler reads them).

The vocabulary between :mod:`cloud_verifier.session.core` (which asks) and the engine (which
answers): plain data, no torch and no I/O, so the session rules import it without importing the
engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Final, TypeVar

import numpy as np
import numpy.typing as npt

from shared.enums import TextEnum
from shared.maths.compression import SparseDist
from shared.maths.rejection import Decision
from shared.wire.messages import Logprobs, Propose

#: The scalar type of a per-token array (ids, probabilities).
G = TypeVar("G", bound=np.generic)

#: A session's weight (:mod:`cloud_verifier.session.pace`) is clamped to [MIN_WEIGHT, MAX_WEIGHT].
MIN_WEIGHT: Final = 0.25
MAX_WEIGHT: Final = 4.0
#: Steps in a row a session's deferred batches may wait before its round is served whole.
DEFER_BOUND: Final = 4


class Withheld(TextEnum):
    """Why a co-generation that asked for a model draft got none (it decodes one token)."""

    #: The step had edge-drafted work
    #: (:func:`~cloud_verifier.engine.scheduler.model_drafts_allowed`).
    LOAD = "load"
    #: The session's acceptance does not pay for a draft forward
    #: (:func:`~cloud_verifier.engine.draft_length.draft_length` = 0).
    COST = "cost"


@dataclass(frozen=True)
class Branch:
    """A branch of a token tree (a hedge forking inside a Verify's draft): should the decision
    at draft index ``at`` reject the draft token there and *recover* ``token``, ``draft`` is
    what follows. It rides in the Verify's forward (a tree row: every branch sees the
    accepted chain before ``at``, then itself) and is decided, where it opens, as a
    deterministic draft after the recovered token (the greedy-draft rule).

    Exact (recursive rejection sampling over siblings, trivial for point masses): the
    recovered token is drawn first, from the law the chain alone would use, and only then
    compared with the branch; the branch's tokens are fixed before any of the draws that
    decide them, so accepting x with probability p(x) and recovering from p without x keeps
    the law p at every position, whatever the branch holds."""

    at: int
    token: int
    draft: npt.NDArray[np.int64]

    def opened_by(self, decision: Decision) -> bool:
        """The chain's decision opens this branch: it rejected the draft token at ``at`` and
        recovered this branch's token (a recovered token the verifier drew itself)."""
        return decision.token is not None and (decision.accepted, decision.token) == (
            self.at,
            self.token,
        )


@dataclass(frozen=True)
class ProposeWork:
    """Model work over the tokens of Proposes (:attr:`segments`: ``propose`` and any verified
    with it): the first's fixed tokens, then every segment's draft, in one forward row."""

    propose: Propose

    @property
    def segments(self) -> tuple[Propose, ...]:
        return (self.propose,)

    @property
    def fixed(self) -> npt.NDArray[np.int64]:
        return self.propose.fixed

    @property
    def draft(self) -> npt.NDArray[np.int64]:
        """Every segment's draft, in order."""
        return _joined([p.draft for p in self.segments])

    @property
    def q(self) -> npt.NDArray[np.float32]:
        return _joined([p.q for p in self.segments])


def _joined(parts: list[npt.NDArray[G]]) -> npt.NDArray[G]:
    """The parts, in order (one part: itself, not a copy)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


@dataclass(frozen=True)
class Verify(ProposeWork):
    """Run the target over ``fixed + draft`` starting at ``pos`` (= the cache length) and decide
    the batch: *accepted* prefix, then a *recovered* correction or (``want_bonus``) a *bonus*.

    ``more``: Proposes that were queued right behind ``propose`` (same epoch, consecutive
    positions, no fixed tokens), verified in the same forward as one longer draft (coalesced);
    the core answers each with its own Verdict.

    ``matched``: with co-generation, the first segment's draft tokens that coincided with
    tokens the verifier had already produced (accepted at no model cost); ``propose`` then holds
    only the rest of that draft, and its fixed tokens are the known tokens the cache lacks."""

    want_bonus: bool
    more: tuple[Propose, ...] = ()
    matched: int = 0
    #: Token-tree branches verified in the same forward (:class:`Branch`).
    branches: tuple[Branch, ...] = ()
    #: Rationing (:mod:`cloud_verifier.engine.rationing`): each draft token's survival s_i
    #: (empty: the draft is never cut), â of an average token of the session, and the draft
    #: tokens a round it was promised (the budget it was last told: never left out).
    survival: tuple[float, ...] = ()
    mean_token: float = 0.0
    promised: int = 1
    #: The scheduler's weight of its session (:mod:`cloud_verifier.session.pace`), and how many
    #: steps in a row the ration deferred its batches (served whole at :data:`DEFER_BOUND`).
    weight: float = 1.0
    waited: int = 0
    #: The tokens the tree's branches are expected to add to the round (the probability each
    #: opens, times the tokens it would then commit), from the session's measured acceptance:
    #: what the scheduler prices the tree's tokens by (:func:`~cloud_verifier.engine.
    #: scheduler.plan_step`).
    tree_value: float = 0.0
    #: The edge asked no bonus (it has batches in flight behind this one) but the verifier
    #: decides the position after a draft accepted whole anyway, as a co-generated token: its
    #: logits row is in the forward already (:func:`~cloud_verifier.session.results.
    #: verified_outcome`).
    free_bonus: bool = False

    @property
    def tree_tokens(self) -> int:
        """The branches' tokens in the forward's row, beyond the chain."""
        return sum(1 + len(b.draft) for b in self.branches)

    @property
    def segments(self) -> tuple[Propose, ...]:
        return (self.propose, *self.more)

    @property
    def start(self) -> int:
        return self.propose.pos


def batch_ends(work: Verify) -> tuple[int, ...]:
    """The draft length at the end of each of ``work``'s batches (segments), in order."""
    ends, n = [], 0
    for s in work.segments:
        n += len(s.draft)
        ends.append(n)
    return tuple(ends)


def deferred(work: Verify, keep: int) -> bool:
    """Whether verifying the first ``keep`` draft tokens of ``work`` defers whole batches
    (``keep`` ends a batch past the first) rather than cutting one (it falls inside the first)."""
    ends = batch_ends(work)
    return keep in ends[:-1]


def rationed(work: Verify, keep: int) -> Verify:
    """``work`` verifying only the first ``keep`` (>= 1) tokens of its draft (rationing).

    * ``keep`` ends a batch (:func:`deferred`): the batches behind it are left for a later
      step; the rest is decided as those batches alone would be (no bonus: each asked for
      none, being followed).
    * ``keep`` falls inside the first batch: a *cut*, with a bonus token after the kept
      tokens; the rest of the draft is void.

    Either way the tree's branches are left out (they fork inside the draft the step verifies
    whole only).

    Which tokens are verified depends on draft-side information and the load only, so the
    decision on them (and a bonus at a cut) is drawn from p exactly as after a shorter
    Propose."""
    segments: list[Propose] = []
    left = keep
    for s in work.segments:
        if left <= 0 and segments:
            break
        n = min(left, len(s.draft))
        segments.append(s if n == len(s.draft) else replace(s, draft=s.draft[:n], q=s.q[:n]))
        left -= n
    whole = deferred(work, keep)
    return replace(
        work,
        propose=segments[0],
        more=tuple(segments[1:]),
        want_bonus=segments[-1].want_bonus if whole else True,
        branches=(),
        survival=work.survival[:keep],
        tree_value=0.0,
        # deferred batches follow (no bonus), or a cut's bonus voids what follows (in the
        # Verdict): never a co-generated one
        free_bonus=False,
    )


@dataclass(frozen=True)
class Federate(ProposeWork):
    """Run the target over ``fixed + draft`` and return the γ+1 sparse rows and the γ exact
    scalars p_j(x_j) (SpecFed): the edge decides."""


#: An empty draft: its token ids and their probabilities.
NO_IDS: Final = np.zeros(0, np.int64)
NO_PROBS: Final = np.zeros(0, np.float32)


@dataclass(frozen=True)
class CoGenerate:
    """Co-generation: run the target over ``fixed`` (the known tokens the cache lacks; none:
    the last cached token is scored again) from ``pos`` (= the cache length) and sample the next
    token from p — a *bonus* token with no draft before it. With a hedge that matches the text,
    or a cloud draft (``cloud``: :mod:`cloud_verifier.session.cloud_draft`), ``draft`` is verified
    as a
    deterministic draft (q a point mass): *accepted* prefix, then the *recovered* token drawn
    from p with the rejected token removed, or the *bonus* token; the verifier draws both itself
    (the greedy-draft rule, whatever the session's correction mode). With ``model_tokens`` (and
    no ``draft``), the model side first drafts up to that many tokens with its draft model,
    greedily after the known text, and verifies them so (the result's ``drafted``)."""

    pos: int
    fixed: npt.NDArray[np.int64]
    draft: npt.NDArray[np.int64] = field(default_factory=lambda: NO_IDS)
    q: npt.NDArray[np.float32] = field(default_factory=lambda: NO_PROBS)
    cloud: bool = False  # the draft is the verifier's own (not a hedge's)
    model_tokens: int = 0  # the model side drafts up to this many tokens (cloud_draft_model)
    #: The session's measured acceptance α of its model drafts: the model side drafts the
    #: length that pays for itself (:func:`~cloud_verifier.engine.draft_length.draft_length`) up to
    #: ``model_tokens``; None: ``model_tokens`` as asked (``cloud_draft_length = fixed``).
    model_alpha: float | None = None
    #: Set by the model side: why it made no model draft (None: it made one, or none was asked).
    withheld: Withheld | None = None
    #: The scheduler's weight of its session (:mod:`cloud_verifier.session.pace`).
    weight: float = 1.0


@dataclass(frozen=True)
class Crop:
    """Keep the first ``pos`` tokens of the cache (Rollback)."""

    pos: int


@dataclass(frozen=True)
class Draw:
    """Draw ``m`` more candidates from the p row kept for the last rejection (Resample)."""

    epoch: int
    pos: int
    m: int


Work = Verify | Federate | CoGenerate | Crop | Draw


def cache_after(
    work: Verify | Federate | CoGenerate | Crop,
    accepted: int = 0,
    branch: BranchTaken | None = None,
) -> int:
    """The cache length once ``work`` is done with ``accepted`` draft tokens accepted: the one
    crop rule. Verify / CoGenerate: start + fixed + the accepted draft tokens (a rejection drops
    the rest; a recovered, bonus or co-generated token is not cached: it is the next row's
    input or comes back as a fixed token); a Verify's tree ``branch`` that the recovered token
    opened keeps that token and the branch's accepted draft tokens too (not its own recovered
    or bonus token); Federate: every token (the edge rolls back); Crop: its position. The model
    side applies it and reports the length it holds, which the core adopts (the results'
    ``cache_len``)."""
    if isinstance(work, Crop):
        return work.pos
    if isinstance(work, CoGenerate):
        return work.pos + len(work.fixed) + accepted
    p = work.propose
    if isinstance(work, Federate):
        return p.pos + len(p.fixed) + len(p.draft)
    opened = 0 if branch is None else 1 + branch.decision.accepted
    return p.pos + len(p.fixed) + accepted + opened


@dataclass(frozen=True)
class BranchTaken:
    """A Verify's branch that the recovered token opened (``index`` into its ``branches``),
    and the decision of its draft: accepted prefix, then recovered or bonus token."""

    index: int
    decision: Decision


@dataclass(frozen=True)
class Verified:
    decision: Decision
    #: The model side kept p at the rejected position for later Resamples (candidates mode).
    kept_row: bool = False
    #: The cache length the model side holds now (None: not reported; the core applies
    #: :func:`cache_after` itself, as test doubles of the model side do).
    cache_len: int | None = None
    #: A CoGenerate with ``model_tokens``: the draft the model side made and verified.
    drafted: npt.NDArray[np.int64] | None = None
    #: A CoGenerate with ``model_tokens`` and no draft made: why (CoGenerate.withheld).
    withheld: Withheld | None = None
    #: Fixed tokens the model side took from its prefix cache for this work (not computed).
    cached: int = 0
    #: Hello.logprobs: the target's log-probabilities of the accepted tokens and of the
    #: decision's ids, ``pos`` 0 standing for the first accepted token's position.
    logprobs: Logprobs | None = None
    #: A Verify's tree branch opened by the recovered token (the cache then holds the
    #: recovered token and the branch's accepted tokens too).
    branch: BranchTaken | None = None
    #: Rationing: the Verify's draft tokens the step verified when it left some out
    #: (:func:`rationed`: the batches behind them deferred, or a cut with the bonus after
    #: them); None: the whole draft.
    cut: int | None = None
    #: Rationing: the draft tokens a round of the session may hold (Verdict.budget); None: not
    #: set.
    budget: int | None = None
    #: A Verify's tree rode in the step's forward (False: the plan left it out; None: not
    #: reported).
    tree: bool | None = None


@dataclass(frozen=True)
class Federated:
    dists: tuple[SparseDist, ...]  # γ+1
    p_draft: npt.NDArray[np.float32]  # [γ]
    l1: npt.NDArray[np.float32] | None  # [γ+1, 2]
    cache_len: int | None = None


@dataclass(frozen=True)
class Cropped:
    cache_len: int | None = None


@dataclass(frozen=True)
class Drawn:
    candidates: SparseDist
    logprobs: Logprobs | None = None  # Hello.logprobs: of the candidates (pos 0: theirs)


class FailureKind(TextEnum):
    """Why the engine did not do a session's model work (:class:`Failed`)."""

    ENDED = "ended"  # the session's slot was released
    DESYNC = "desync"  # the work does not start where the cache ends
    CONTEXT = "context"  # past the model's context length
    BAD_WORK = "bad_work"  # token ids out of the vocabulary, nothing to predict from, ...
    KV_QUOTA = "kv_quota"  # past the session's or its tenant's share of the KV cache
    OUT_OF_PAGES = "out_of_pages"  # the KV pool has no free page
    DRAFT_MODEL = "draft_model"  # the verifier's own draft model failed
    MODEL = "model"  # the forward or the decision raised
    ENGINE = "engine"  # a bug in the engine's step


@dataclass(frozen=True)
class Failed:
    """The model work was not done. ``cache_len``: what the cache holds now (restored or
    not); ``kind``: why, set where the failure is found and carried as it is to the core (the
    Error frame's text and the verifier's metrics name it); ``message`` says the rest to a
    person (never the kind again)."""

    message: str
    cache_len: int
    kind: FailureKind


@dataclass(frozen=True)
class Skipped:
    """The engine gave a :class:`CoGenerate` no forward (it is saturated with drafts to verify):
    a session whose edge drafts pauses co-generation until the edge's next frame; a cloud-only
    one (credits) queues it again at once."""


Result = Verified | Federated | Cropped | Drawn | Failed | Skipped


@dataclass(frozen=True)
class WorkProgress:
    """Where the session's model work stands, from the engine (see
    :class:`~shared.wire.messages.Progress`):
    ``stalled`` means the running step has run far past its estimate."""

    steps: int
    ahead: int
    running: bool
    eta_s: float
    stalled: bool = False
