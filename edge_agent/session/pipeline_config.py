"""The settings of one generation's pipeline: draft length, depth, mode, sampling, correction.

Pure data shared by the edge's session cores, its drivers and its user interfaces, with the one
declaration of the bounds of a generation's own options (:class:`Bounds`): the daemon's defaults
for them (``EdgeSettings``), the API's request body and the REPL's ``/set`` all check these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from shared.enums import TextEnum
from shared.maths.compression import Reconstruction
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import MIN_TEMPERATURE, SamplingParams
from shared.wire.messages import MAX_TOP_LOGPROBS, SEQ_MODULUS

N = TypeVar("N", int, float)


@dataclass(frozen=True)
class Range(Generic[N]):
    """The values ``lo..hi`` of a numeric option, both included (``lo`` excluded with
    ``open_lo``); with ``gap_below``, none strictly between ``lo`` and it (a temperature is 0,
    greedy, or large enough to sample with)."""

    lo: N
    hi: N
    open_lo: bool = False
    gap_below: N | None = None

    def __contains__(self, value: float) -> bool:
        above = self.lo < value if self.open_lo else self.lo <= value
        in_gap = self.gap_below is not None and self.lo < value < self.gap_below
        return above and value <= self.hi and not in_gap

    def words(self) -> str:
        """``in 1..64`` (integers), ``in (0, 1]`` (numbers), ``0 or at least 0.0001, at most
        2`` (with a gap)."""
        if isinstance(self.lo, int) and isinstance(self.hi, int):
            return f"in {self.lo}..{self.hi}"
        if self.gap_below is not None:
            return f"{self.lo:g} or at least {self.gap_below:g}, at most {self.hi:g}"
        return f"in {'(' if self.open_lo else '['}{self.lo:g}, {self.hi:g}]"

    def check(self, name: str, value: N) -> N:
        """``value``, or ValueError naming ``name`` and the range."""
        if value not in self:
            raise ValueError(f"{name} must be {self.words()}, got {value}")
        return value


class Bounds:
    """The one declaration of the bounds of a generation's own options: the daemon's defaults
    for them (``EdgeSettings``), the API's request body and the REPL's ``/set`` check these
    (as attributes named like the options, upper case)."""

    #: Draft tokens per batch (γ).
    GAMMA = Range(1, 64)
    #: Batches in flight (D): batch numbers are 7-bit.
    DEPTH = Range(1, SEQ_MODULUS - 1)
    #: OpenAI's range; 0 is greedy, a smaller positive one leaves nothing to sample from.
    TEMPERATURE = Range(0.0, 2.0, gap_below=MIN_TEMPERATURE)
    TOP_P = Range(0.0, 1.0, open_lo=True)
    #: 0 = off; no vocabulary is larger.
    TOP_K = Range(0, 1 << 24)
    #: Completion tokens of one generation.
    MAX_TOKENS = Range(1, 1 << 20)
    #: Seeds are non-negative (numpy's generators refuse negative ones) and fit 64 bits.
    SEED = Range(0, 2**64 - 1)
    #: A request's deadline (seconds): all its waits (the daemon's queue, the verifier's
    #: admission line) and its generation.
    TIMEOUT = Range(1.0, 86_400.0)

    @classmethod
    def of(cls, option: str) -> Range[int] | Range[float]:
        """The range of ``option`` (``"top_k"``); KeyError for an option without one."""
        bound = getattr(cls, option.upper(), None)
        if not isinstance(bound, Range):
            raise KeyError(option)
        return bound


#: ``gamma``/``depth`` chosen by the online controller (:mod:`edge_agent.session.controller`).
Auto = Literal["auto"]


#: Frames besides Proposes a link may have waiting to be sent at once (a Hedge, a Rollback,
#: a Resample, an Error).
CONTROL_FRAMES = 4


def max_inflight(depth: int) -> int:
    """Batches a pipeline of depth ``depth`` may have in flight: ``depth`` still drafting, and
    decided ones waiting for their Verdicts up to 4 × depth (batch numbers are 7-bit)."""
    return min(SEQ_MODULUS - 1, 4 * depth)


class Mode(TextEnum):
    """``pipelined``: up to D batches in flight (PicoSpec); ``stop-and-wait``: one batch, and a
    bonus token on every full acceptance (classic speculative decoding)."""

    PIPELINED = "pipelined"
    STOP_AND_WAIT = "stop-and-wait"


@dataclass(frozen=True)
class RequestOptions:
    """A generation's own sampling and speculation values, laid over the daemon's defaults by
    ``EdgeSettings.pipeline``; None: the default. The API's request body and the REPL's
    settings are both read into one."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    gamma: int | Auto | None = None
    depth: int | Auto | None = None
    mode: Mode | None = None
    correction: CorrectionMode | None = None


@dataclass(frozen=True)
class PipelineConfig:
    gamma: int = 4
    depth: int = 2
    mode: Mode = Mode.PIPELINED
    sampling: SamplingParams = field(default_factory=SamplingParams)
    correction: CorrectionMode = CorrectionMode.TOPK
    reconstruction: Reconstruction = Reconstruction.RENORMALISED
    #: Co-generation: the verifier decodes on its own whenever no valid draft of this session
    #: is queued, and streams its tokens down (:mod:`cloud_verifier.session.core`).
    cogen: bool = True
    #: Hedging (with co-generation, where the verifier draws corrections itself): while the
    #: pipeline is full, draft this many tokens after the draft's second choice at its least
    #: confident position in flight (below ``hedge_below``) and send them as a Hedge, so that a
    #: rejection there is followed by a verified forward, not a one-token step; 0 = off.
    hedge: int = 0
    hedge_below: float = 0.8
    #: Outcome pre-drafting: while the pipeline is full, the drafter prepares up to this many
    #: branches, each up to γ draft tokens after the draft's second choice at one of its least
    #: confident positions in flight (the likeliest correction should the draft token there be
    #: rejected); a rejection whose correction opens a prepared branch sends it as the next
    #: batch at once (:meth:`~edge_agent.session.branches.BranchBook.take_branch`); 0 = off.
    predraft: int = 0
    #: Token trees: each prepared branch also goes to the verifier as it grows (a Hedge at its
    #: position), so that the batch it forks from is verified with it in one forward (tree
    #: mask) and a rejection there that recovers its token commits its accepted tokens at once,
    #: no round trip; with co-generation and a deterministic draft, where the verifier
    #: recovers tokens itself (like hedges). Needs ``predraft``.
    tree: bool = False
    #: Branch planning (:mod:`edge_agent.session.branch_plan`): no branch is prepared for an
    #: outcome less likely than this (where the draft is sure, nothing is drafted).
    branch_floor: float = 0.02
    #: Token trees: the bytes of branch frames (Hedges) the edge may send per batch it sends,
    #: on average (unspent bytes carry over up to four batches' worth); 0 = no bound.
    branch_uplink: int = 256
    #: Adaptive draft length / depth (``--gamma auto`` / ``--depth auto``): ``gamma`` and
    #: ``depth`` are then the starting values and ``max_gamma`` / ``max_depth`` the bounds of
    #: the online controller (:mod:`edge_agent.session.controller`).
    auto_gamma: bool = False
    auto_depth: bool = False
    max_gamma: int = 12
    max_depth: int = 8
    #: The target's log-probability of every generated token, with this many alternatives at
    #: each position (Hello.logprobs, OpenAI's top_logprobs); None: none (no bytes spent).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        Bounds.GAMMA.check("gamma", self.gamma)
        Bounds.DEPTH.check("depth", self.depth)
        Bounds.GAMMA.check("max_gamma", self.max_gamma)
        if not 0 <= self.hedge <= 64:
            raise ValueError(f"hedge must be in 0..64, got {self.hedge}")
        if not 0 <= self.predraft <= 64:
            raise ValueError(f"predraft must be in 0..64, got {self.predraft}")
        if self.tree and not self.predraft:
            raise ValueError("tree sends prepared branches: it needs predraft > 0")
        if not 0.0 <= self.branch_floor < 1.0:
            raise ValueError(f"branch_floor must be in [0, 1), got {self.branch_floor}")
        if not 0 <= self.branch_uplink <= 1 << 20:
            raise ValueError(f"branch_uplink must be in 0..{1 << 20}, got {self.branch_uplink}")
        if not 0.0 <= self.hedge_below <= 1.0:
            raise ValueError(f"hedge_below must be in [0, 1], got {self.hedge_below}")
        Bounds.DEPTH.check("max_depth", self.max_depth)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")
        # Settings files and flags give strings: store members.
        object.__setattr__(self, "mode", Mode.parse(self.mode, "mode"))
        object.__setattr__(self, "correction", CorrectionMode.parse(self.correction, "correction"))
        object.__setattr__(
            self, "reconstruction", Reconstruction.parse(self.reconstruction, "reconstruction")
        )
        if (
            self.logprobs is not None
            and self.wire_correction == CorrectionMode.TOPK
            and self.reconstruction == Reconstruction.REDISTRIBUTED
        ):
            # B spreads the residual mass over ids the verifier did not score: a correction
            # drawn there would have no log-probability.
            raise ValueError(
                "logprobs need corrections among the ids the verifier scores: correction "
                "candidates or greedy_draft, or reconstruction A"
            )

    @property
    def wire_correction(self) -> CorrectionMode:
        """Greedy decoding needs no q on the wire: q is one-hot, like the greedy-draft mode."""
        return CorrectionMode.GREEDY_DRAFT if self.sampling.greedy else self.correction

    @property
    def deterministic_draft(self) -> bool:
        return self.wire_correction == CorrectionMode.GREEDY_DRAFT

    @property
    def effective_depth(self) -> int:
        return 1 if self.mode == Mode.STOP_AND_WAIT else self.depth

    @property
    def depth_bound(self) -> int:
        """The deepest the pipeline can be: D, or ``max_depth`` when the controller adapts it."""
        if self.mode == Mode.STOP_AND_WAIT:
            return 1
        return max(self.depth, self.max_depth) if self.auto_depth else self.depth

    @property
    def tree_frames(self) -> int:
        """Frames of prepared branches (token trees) a link may have waiting: one a branch."""
        return self.predraft if self.tree else 0

    @property
    def send_queue_bound(self) -> int:
        """Frames one verifier link may have waiting to be sent: every batch in flight (none
        sent yet, at the deepest), the control frames and the branches (token trees). The one
        bound every driver uses."""
        return max_inflight(self.depth_bound) + CONTROL_FRAMES + self.tree_frames
