"""What the edge's cores ask of their drivers (as wsproto's events sit beside its codec),
what they tell the generation's consumer (:class:`Committed`, :class:`Finished`) and what they
report for its statistics (:data:`Tally`: the driver counts it).

A core (:class:`~edge_agent.session.core.SingleCore`,
:class:`~edge_agent.session.federation_core.FederatedCore`) does no I/O and calls nothing out:
every call that feeds it (a drafted batch, a hedge, a frame from a verifier, a round's
deadline) returns a list of these events, in the order they must be carried out (a call's
commits come first: they happened before anything it sends). What a peer sends never raises
into the driver (a frame that does not fit is a :class:`Fail`, or a :class:`Drop` of its
worker); only a driver's own misuse (a call out of order) raises. A driver only reads the
core's state, feeds it and carries out events.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.enums import TextEnum
from shared.errors import WanspecError
from shared.wire.messages import Message


@dataclass(frozen=True)
class Send:
    """Write ``msg`` on link ``link`` (0: a single verifier session's only link), encoded by
    the driver with that link's WireContext (as the verifier's core's Send is). Frames of one
    link leave in the order of their events (a Rollback before any Propose of its epoch)."""

    msg: Message
    link: int = 0


@dataclass(frozen=True)
class Drop:
    """Close link ``link``: the core has already counted the worker as down (the driver
    reconnects it; it rejoins at a boundary)."""

    link: int
    why: str


@dataclass(frozen=True)
class Fail:
    """The session cannot go on: the driver ends it with ``error`` (a VerifierError,
    DesyncError or ProtocolError). Nothing committed is lost: the caller rebuilds the session
    from the committed ids, or gives up when the error is fatal. Every later feed of the core
    returns the same failure."""

    error: WanspecError


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one generated token (log softmax of its logits, before
    any sampling transform) and its likeliest alternatives. ``logprob`` is None for a token no
    verifier scored: the draft's own while no verifier answered (link-down fallback), or one
    whose Logprobs frame was lost with a connection."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Committed:
    """Generated ids newly committed, in order (the driver hands them to its consumer: the
    runtime decodes them into text). Every committed id is in exactly one such event.
    ``logprobs``: one entry per id when the generation is scored (its Hello asked for
    log-probabilities: a verifier sends a position's Logprobs frame before the Verdict that
    commits it), else empty."""

    ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The generation ended, for ``reason`` ("stop": an end-of-sequence id; "length": the
    token limit or the verifier's context). Once per generation, after its last Committed."""

    reason: str


GenerationEvent = Committed | Finished
"""What a driver hands to its consumer (the service, the agent's caller)."""


class Counter(TextEnum):
    """A counter of the generation's :class:`~edge_agent.session.generation.Stats` that a core's
    step moves (each value is the field's name)."""

    PROPOSES_SENT = "proposes_sent"
    DISCARDED_BATCHES = "discarded_batches"
    DISCARDED_TOKENS = "discarded_tokens"
    REJECTIONS = "rejections"
    RECOVERED_TOKENS = "recovered_tokens"
    BONUS_TOKENS = "bonus_tokens"
    RESAMPLES = "resamples"
    COGEN_TOKENS = "cogen_tokens"
    HEDGE_HITS = "hedge_hits"
    PREDRAFT_BRANCHES = "predraft_branches"
    PREDRAFT_TOKENS = "predraft_tokens"
    PREDRAFT_HITS = "predraft_hits"
    PREDRAFT_USED_TOKENS = "predraft_used_tokens"
    #: Rejections no prepared branch answered, by why (BranchBook.classify_miss).
    PREDRAFT_MISS_NOT_ALTERNATIVE = "predraft_miss_not_alternative"
    PREDRAFT_MISS_CAP = "predraft_miss_cap"
    PREDRAFT_MISS_TIME = "predraft_miss_time"
    #: Token trees: branch frames not sent, the branch uplink budget spent.
    BRANCH_FRAMES_HELD = "branch_frames_held"
    RESUMED_TOKENS = "resumed_tokens"
    PROGRESS_FRAMES = "progress_frames"
    PROMPT_CACHED_TOKENS = "prompt_cached_tokens"
    DOWNLINK_BYTES = "downlink_bytes"
    DOWNLINK_REJECTION_BYTES = "downlink_rejection_bytes"
    #: Rationing: rounds the verifier cut short, and the draft tokens it never judged.
    CUT_ROUNDS = "cut_rounds"
    CUT_TOKENS = "cut_tokens"


@dataclass(frozen=True)
class Count:
    """Add ``n`` to the generation's ``counter``: the driver counts what its core reports (as
    the verifier's driver counts its core's Notes); the core writes no statistics."""

    counter: Counter
    n: int = 1


@dataclass(frozen=True)
class Round:
    """A verdict decided a batch of ``drafted`` draft tokens, ``accepted`` of them accepted,
    with the draft length ``gamma`` and the depth ``depth`` then in effect."""

    drafted: int
    accepted: int
    gamma: int
    depth: int


@dataclass(frozen=True)
class RejectionGap:
    """A batch went up ``seconds`` after the rejection (or the doomed batch) before it."""

    seconds: float


Tally = Count | Round | RejectionGap
"""What a core reports for the generation's statistics (:meth:`Stats.apply
<edge_agent.session.generation.Stats.apply>`)."""


class FedCounter(TextEnum):
    """A counter of the federation's
    :class:`~edge_agent.session.federation_members.FederationStats` (each value is the field's
    name)."""

    ROUNDS_WITH_MISSING_WORKERS = "rounds_with_missing_workers"
    WORKER_DROPS = "worker_drops"
    WORKER_REJOINS = "worker_rejoins"
    LEFT_OUT = "left_out"
    PROBES = "probes"


@dataclass(frozen=True)
class FedCount:
    """Add ``n`` to the federation's ``counter`` (the federated driver counts it)."""

    counter: FedCounter
    n: int = 1


@dataclass(frozen=True)
class Measured:
    """One position of a federated round measured: each answering worker's ε (worker index,
    ε), the bias bound, its upper estimate where there is one, and the compression bounds it
    violated (a bug: the core logs each)."""

    eps: tuple[tuple[int, float], ...]
    bias_bound: float
    bias_upper: float | None
    violations: int


FedTally = FedCount | Measured
"""What the federated core reports for the federation's statistics (:meth:`FederationStats.apply
<edge_agent.session.federation_members.FederationStats.apply>`)."""

EdgeEvent = (
    Send | Drop | Fail | Committed | Finished | Count | Round | RejectionGap | FedCount | Measured
)
