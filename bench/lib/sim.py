"""A discrete-event simulation of wanspec and its baselines in virtual time, driven by
acceptance traces (:mod:`bench.lib.traces`): edges, their emulated WAN links and one verifier GPU.

    from bench.lib.sim import Costs, Link, Request, SimMode, simulate
    result = simulate(SimMode.parse("auto:predraft"), [[Request(trace, 256)]], Costs(), Link(0.1))

No sleeps, threads or sockets: a reply of 256 tokens takes milliseconds of CPU. The simulation
runs the product's own rules, not a model of them:

* **Both session cores are the product's.** Each edge request is a
  :class:`~edge_agent.session.core.SingleCore` (its :class:`~edge_agent.session.pipeline.Pipeline`:
  may_draft, plan, take_branch, predraft_plan, commit_round, discard_inflight, the γ/D
  :class:`~edge_agent.session.controller.Controller` fed by ``commit_round`` and by the driver's
  ``on_draft_step``, as in the product) and each verifier session a
  :class:`~cloud_verifier.session.core.VerifierCore` (co-generation and its
  ``max_cogen_ahead``, doomed and stale batches, coalescing, tail / n-gram / model cloud drafts
  with ``DraftAcceptance``). Every frame between them is the wire's real encoding
  (:func:`shared.wire.codec.encode`): its byte count is what crosses the link and what the
  Reply counts.
* **The drivers are mirrored.** :meth:`_Edge._draft_loop` is
  :func:`edge_agent.link.driver.draft_loop` (with ``_predraft``) as a generator over virtual
  time: draft a batch while ``may_draft`` (checking ``current`` after each step), each step
  also growing the prepared branches (``DraftingCore.branch_rows``, the batch being drafted's
  positions included) in the same batched forward, as many rows as the product's drafter steps
  together at the edge's batch cost (``Drafter.branch_batch_for``: 8 at a GPU's, 2 at this
  CPU's), at that step's batched cost; else grow branches alone (as many at once; stopping
  when ``may_draft``), else wait for a frame. What a grown branch sends (token trees: a Hedge
  frame within ``branch_uplink``) goes up the link like any frame. A cloud-only session sends
  credits as :func:`~edge_agent.link.driver.credit_loop` does; an edge that drafts with
  co-generation sends its prompt in a credit at once, as
  :func:`~edge_agent.link.driver.run_single`.
* **The verifier's engine plans with the product's scheduler** (:class:`_Engine`): whenever
  the GPU is idle and work is queued, :func:`~cloud_verifier.engine.scheduler.plan_step` plans
  one step from every session's queued work (Verify, CoGenerate, Crop) and the ``ar`` rows:
  decode work by the sessions' weights (``pace``: each verifier core owes its session
  ``service_rate`` tokens/s and weighs its work by the rate attained, in virtual time),
  prefill chunks (``prefill_chunk`` tokens a step, a prompt's last chunk deciding), the
  ration of speculative slots by weighted survival (deferred batches, cuts, the budget each
  session is told), the token trees that pay (else left out, their branches kept as hedges
  for the co-generation after a rejection); each row runs as ``scheduler.as_planned`` makes
  it; the step costs :meth:`Costs.forward_s` of its rows' tokens (a row is its fixed tokens,
  or the last cached token again when it has none, plus the draft and tree tokens it
  verifies: ``runner._plan``).
  CoGenerates that ask for a model draft get one only where the plan allows model drafts
  (``scheduler.model_drafts_allowed``), of the length ``draft_length`` picks from the session's
  α and the draft/target cost ratio (``DraftCost``, fed the virtual times); the draft steps run
  before the forward, all sessions batched, a step of B rows costing
  ``cloud_draft_s · (1 + token_cost · (B − 1))``. The batch limits are the product's defaults
  (:data:`SIM_BATCH`) but for the sessions a step may hold, which is unbounded here.
* **The models are the trace.** Greedy decoding: the target's token at path position j is
  ``path[j]`` (the verifier's text is always the committed text). The draft's token at j after
  an on-path context is ``draft_top[j][0]`` (right iff ``draft_ok(j)``), with probability
  ``draft_top_p[j][0]`` and rivals the next ``RIVALS`` entries (``drafter._rival``); after an
  off-path context it is always wrong: ``draft_top[j][0]``, or ``draft_top[j][1]`` where that
  one is right, with the trace's probabilities at j. The cloud's draft model is the edge's. So
  a ``tail`` cloud draft (the rest of a rejected batch, drafted after its wrong token) is never
  accepted here, where a real draft often goes on as the target does: hybrid's tail source is
  worth nothing in the simulation.
* **Pre-drafting's counters are the product's** (``BranchBook.classify_miss``):
  ``predraft_miss_alternative`` is its not-an-alternative count (the correction is not among the
  draft's ``RIVALS`` alternatives at that position), ``predraft_miss_none`` its cap + time
  counts. A branch taken on the verifier (a tree's, or a hedge's in co-generation) answers
  the rejection there; the edge counts the rejection a hit when it takes the branch too. What
  a cloud that drafted the same branches itself would spend on them is counted per reply
  (``branch_steps``, ``branch_cloud_s``: one batched step of its draft model per level).

Simplifications (each a difference from a real run to expect):

* The session opens with no time and no bytes (the daemon's warm link: its Hello and Welcome
  ride with the first frames); a reply's session is closed half an RTT after its last token
  reaches the edge (queued work of it is dropped then). Progress frames are not sent.
* The edge's draft prefill is one batched draft step of the prompt's P tokens,
  ``draft_s · (1 + draft_batch_cost · (P − 1))``, before its first draft step.
* A link is a FIFO per direction: a frame of n bytes (the encoded frame, no WebSocket / TCP
  headers) takes ``n · 8 / bandwidth`` to serialise, then ``rtt / 2`` to arrive.
* The engine: no padding (a forward costs by its total tokens, not rows × longest row, and
  one forward takes every row: no second forward for far prefills), no ``batch_wait_ms``
  (2 ms), no session bound on a step (:data:`SIM_BATCH`), no KV limits. Its CPU work between
  steps is free.
* ``ar``: the bench's autoregressive server (:mod:`bench.net.ar_server`) as rows of the same
  engine (continuous batching with every other session): the request (its real msgpack bytes)
  goes up, the prompt's P tokens are prefilled (in chunks, as a prompt) and give token 1, then
  a 1-token row per token; each token
  goes down as its own 4-byte frame.
* The reply ends at ``min(max_tokens, len(path))`` tokens, or at the path's EOS: a trace holds
  no target token past its path.
* Time is virtual and exact: no dilation, no jitter, no scheduling noise of a real machine.
  Real runs are expected to be a little slower (the emulated pads are minimums; event loops,
  encoding and the CPU add to every step), most where a mode has the most frames per token.
"""

from __future__ import annotations

import heapq
import math
import random
import re
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import ClassVar, Final

import numpy as np

from bench.lib.ar_wire import encode_request
from bench.lib.costs import (
    CLOUD_DRAFT_PER_VERIFY,
    DRAFT_BATCH_COST,
    ROOFLINE_OVERHEAD_MS,
    ROOFLINE_PER_TOKEN_MS,
    ROW_TOKENS,
    TREE_TOKEN_COST,
    roofline_ms,
)
from bench.lib.modes import PREDRAFT_BRANCHES, ModeSpec
from bench.lib.traces import Trace
from cloud_verifier.engine.draft_length import draft_length
from cloud_verifier.engine.engine import EngineLimits
from cloud_verifier.engine.runner import advance, work_start
from cloud_verifier.engine.scheduler import (
    DECODE_FIXED,
    BatchLimits,
    Queued,
    Row,
    as_planned,
    forward_entry,
    plan_step,
)
from cloud_verifier.engine.scheduler import Kind as SchedKind
from cloud_verifier.engine.step_times import DraftCost
from cloud_verifier.engine.work import (
    NO_IDS,
    BranchTaken,
    CoGenerate,
    Crop,
    Cropped,
    Result,
    Skipped,
    Verified,
    Verify,
    Withheld,
    Work,
)
from cloud_verifier.session.cloud_draft import CloudDraft
from cloud_verifier.session.core import VerifierCore
from cloud_verifier.session.events import Close, Run
from cloud_verifier.session.events import Send as VSend
from cloud_verifier.session.limits import SessionLimits, TargetInfo
from edge_agent.model.drafter import RIVALS, Drafter
from edge_agent.session.branches import NO_RIVAL, Growing, PendingBatch, Rival
from edge_agent.session.core import SingleCore
from edge_agent.session.events import (
    Committed,
    Count,
    Counter,
    EdgeEvent,
    Fail,
    Finished,
    RejectionGap,
)
from edge_agent.session.events import Round as RoundEvent
from edge_agent.session.events import Send as ESend
from edge_agent.session.generation import Generation
from edge_agent.session.opening import hello_for
from edge_agent.session.pipeline_config import Mode, PipelineConfig
from shared.enums import TextEnum
from shared.maths.rejection import Decision
from shared.maths.sampling import Probs, SamplingParams
from shared.wire.codec import encode
from shared.wire.messages import Fingerprint, Propose, Welcome

#: Bytes of one ``ar`` token frame (``bench.net.ar_server``: one little-endian u32).
AR_TOKEN_BYTES: Final = 4
#: The vocabulary the wire is told (3-byte ids, as a real ~150k vocabulary has), unless a
#: trace holds a larger id.
SIM_VOCAB: Final = 1 << 17
#: A greedy (deterministic) draft sends no q: one placeholder row serves every step.
_Q: Final[Probs] = np.ones(1)


class SimError(RuntimeError):
    """A session failed in the simulation (a core reported an error): a modelling bug."""


# ------------------------------------------------------------------------------ modes


class Kind(TextEnum):
    AR = "ar"
    CLOUD_SD = "cloud-sd"
    STOP_AND_WAIT = "stop-and-wait"
    PIPELINED = "pipelined"
    AUTO = "auto"
    HYBRID = "hybrid"


class CloudDraftKind(TextEnum):
    MODEL = "model"  # the cloud's draft model only
    MIXED = "mixed"  # the product's default order: tail (hybrid only), then n-gram, then the model
    NGRAM = "ngram"  # prompt lookup only, no model (the bench's ``cloud-sd:ngram``)


_FORMS = (
    "ar, cloud-sd:mixed:G, cloud-sd:model:G, cloud-sd:ngram:G, saw:G, "
    "pipe:GxD[:nocogen][:predraft], auto, auto:predraft, hybrid, hybrid:predraft "
    "(or a mode's label)"
)
_SPEC_CLOUD = re.compile(r"^cloud-sd:(mixed|model|ngram):(\d+)$")
_SPEC_SAW = re.compile(r"^saw:(\d+)$")
_SPEC_PIPE = re.compile(r"^pipe:(\d+)x(\d+)(:nocogen)?(:predraft)?$")
_LABEL_CLOUD = re.compile(r"^cloud-sd (mixed|model|ngram) γ=(\d+)$")
_LABEL_SAW = re.compile(r"^stop-and-wait γ=(\d+)$")
_LABEL_PIPE = re.compile(r"^pipelined γ=(\d+) D=(\d+)( no-cogen)?( predraft)?$")


@dataclass(frozen=True)
class SimMode:
    """What one simulated user runs. ``cogen`` applies to PIPELINED, AUTO and HYBRID
    (stop-and-wait never co-generates, cloud-sd always does); ``predraft`` to the edge modes
    but stop-and-wait."""

    kind: Kind
    gamma: int = 4  # edge γ (SAW, PIPELINED; start value of AUTO/HYBRID)
    depth: int = 4  # D (PIPELINED; start value of AUTO/HYBRID)
    cogen: bool = True  # the verifier decodes while no valid draft is queued
    predraft: int = 0  # branches prepared at most (0: off)
    cloud_draft: CloudDraftKind = CloudDraftKind.MIXED  # CLOUD_SD, HYBRID
    cloud_gamma: int = 4  # CLOUD_SD, HYBRID: the cloud's draft length (at most)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind.parse(self.kind, "kind"))
        object.__setattr__(
            self, "cloud_draft", CloudDraftKind.parse(self.cloud_draft, "cloud_draft")
        )
        for name in ("gamma", "depth", "cloud_gamma"):
            if not 1 <= getattr(self, name) <= 64:
                raise ValueError(f"{name} must be in 1..64, got {getattr(self, name)}")
        if not 0 <= self.predraft <= 64:
            raise ValueError(f"predraft must be in 0..64, got {self.predraft}")

    @property
    def label(self) -> str:
        """The name results use: ``"pipelined γ=4 D=4 no-cogen"``, ``"auto predraft"``, ..."""
        k = self.kind
        pre = " predraft" if self.predraft else ""
        if k == Kind.AR:
            return "ar"
        if k == Kind.CLOUD_SD:
            return f"cloud-sd {self.cloud_draft} γ={self.cloud_gamma}"
        if k == Kind.STOP_AND_WAIT:
            return f"stop-and-wait γ={self.gamma}"
        if k == Kind.PIPELINED:
            nocogen = "" if self.cogen else " no-cogen"
            return f"pipelined γ={self.gamma} D={self.depth}{nocogen}{pre}"
        return f"{k}{'' if self.cogen else ' no-cogen'}{pre}"

    @property
    def spec(self) -> str:
        """The short form :meth:`parse` reads: ``"pipe:4x4:nocogen"``, ``"auto:predraft"``."""
        k = self.kind
        if k == Kind.AR:
            return "ar"
        if k == Kind.CLOUD_SD:
            return f"cloud-sd:{self.cloud_draft}:{self.cloud_gamma}"
        if k == Kind.STOP_AND_WAIT:
            return f"saw:{self.gamma}"
        if k == Kind.PIPELINED:
            opts = ("" if self.cogen else ":nocogen") + (":predraft" if self.predraft else "")
            return f"pipe:{self.gamma}x{self.depth}{opts}"
        return f"{k}" + (":predraft" if self.predraft else "")

    @classmethod
    def parse(cls, spec: str) -> SimMode:
        """A mode from its short form or its label (module forms); ValueError otherwise."""
        s = spec.strip()
        if s == "ar":
            return cls(Kind.AR)
        if s in ("auto", "hybrid", "auto:predraft", "hybrid:predraft"):
            kind, _, opt = s.partition(":")
            return cls(Kind(kind), predraft=PREDRAFT_BRANCHES if opt else 0)
        if s in ("auto predraft", "hybrid predraft"):
            return cls(Kind(s.split()[0]), predraft=PREDRAFT_BRANCHES)
        if m := _SPEC_CLOUD.match(s) or _LABEL_CLOUD.match(s):
            return cls(Kind.CLOUD_SD, cloud_draft=CloudDraftKind(m[1]), cloud_gamma=int(m[2]))
        if m := _SPEC_SAW.match(s) or _LABEL_SAW.match(s):
            return cls(Kind.STOP_AND_WAIT, gamma=int(m[1]), depth=1, cogen=False)
        if m := _SPEC_PIPE.match(s) or _LABEL_PIPE.match(s):
            pre = PREDRAFT_BRANCHES if m[4] else 0
            return cls(Kind.PIPELINED, int(m[1]), int(m[2]), cogen=not m[3], predraft=pre)
        raise ValueError(f"bad simulation mode {spec!r}: expected one of {_FORMS}")

    def pipeline_config(self) -> PipelineConfig:
        """The edge's PipelineConfig: cloud-sd's credit sessions take the defaults; the other
        modes' are built as the real-time studies build theirs (:class:`bench.lib.modes.ModeSpec`,
        one rule for both)."""
        if self.kind == Kind.CLOUD_SD:
            return PipelineConfig(sampling=SamplingParams(0.0), cogen=True)
        if self.kind == Kind.STOP_AND_WAIT:
            spec = ModeSpec(self.spec, Mode.STOP_AND_WAIT, self.gamma, 1, cogen=False)
        else:
            auto = self.kind in (Kind.AUTO, Kind.HYBRID)
            spec = ModeSpec(self.spec, Mode.PIPELINED, self.gamma, self.depth, cogen=self.cogen,
                            auto=auto, predraft=self.predraft)  # fmt: skip
        return spec.pipeline_config()

    def session_limits(self) -> SessionLimits:
        """The verifier's limits for this mode's sessions (the settings' defaults; cloud drafts
        for cloud-sd as the bench's cloud-sd verifier is started, and for hybrid the defaults'
        sources with the cloud draft's)."""
        if self.kind not in (Kind.CLOUD_SD, Kind.HYBRID):
            return SessionLimits()
        kind = self.cloud_draft
        sources = {
            CloudDraftKind.MIXED: frozenset({CloudDraft.TAIL, CloudDraft.NGRAM}),
            CloudDraftKind.MODEL: frozenset(),
            CloudDraftKind.NGRAM: frozenset({CloudDraft.NGRAM}),
        }[kind]
        if self.kind == Kind.HYBRID:
            sources |= SessionLimits().cloud_draft
        return SessionLimits(
            cloud_draft=sources,
            cloud_model=kind != CloudDraftKind.NGRAM,
            cloud_draft_tokens=self.cloud_gamma,
        )


# ------------------------------------------------------------------------------ costs, link


@dataclass(frozen=True)
class Costs:
    """Emulated seconds (the picospec regime by default)."""

    draft_s: float = 0.024  # the edge's draft step, one token
    verify_s: float = 0.166  # a verifier forward of one session's 1 + γ = 5 tokens
    ar_s: float = 0.146  # a forward of 1 token
    token_cost: float = TREE_TOKEN_COST
    cloud_draft_per_verify: float = CLOUD_DRAFT_PER_VERIFY
    draft_batch_cost: float = DRAFT_BATCH_COST  # the edge's batched draft step
    roofline: bool = False  # forwards cost by the roofline model, not the linear one

    #: :meth:`forward_s` in words, for the results files that state the cost model.
    FORWARD_RULE: ClassVar[str] = (
        "a forward of n tokens (all sessions batched together) costs verify_s · (1 + k · (n − 5)) "
        "for n ≥ 5 and interpolates linearly between ar_s at n = 1 and verify_s at n = 5"
    )

    def forward_s(self, tokens: int) -> float:
        """A forward of ``tokens`` batch tokens (:attr:`FORWARD_RULE`, or with ``roofline``
        :data:`bench.lib.costs.ROOFLINE_RULE`); 0 for none."""
        if tokens <= 0:
            return 0.0
        if self.roofline:
            return self.verify_s * roofline_ms(max(tokens, ROW_TOKENS)) / roofline_ms(ROW_TOKENS)
        if tokens >= ROW_TOKENS:
            return self.verify_s * (1.0 + self.token_cost * (tokens - ROW_TOKENS))
        return self.ar_s + (self.verify_s - self.ar_s) * (tokens - 1) / (ROW_TOKENS - 1)

    @property
    def overhead_tokens(self) -> float:
        """a/b of the forward's cost a + b·n past ``ROW_TOKENS`` (what the engine's step-time
        fit gives the scheduler's price): one forward's overhead in tokens."""
        if self.roofline:  # past the floor: a = the overhead, b = the compute per token
            return ROOFLINE_OVERHEAD_MS / ROOFLINE_PER_TOKEN_MS
        if self.token_cost <= 0:
            return math.inf
        return 1.0 / self.token_cost - ROW_TOKENS

    @property
    def cloud_draft_s(self) -> float:
        return self.verify_s * self.cloud_draft_per_verify

    def cloud_draft_step_s(self, rows: int) -> float:
        """One batched step of the cloud's draft model over ``rows`` sessions."""
        return self.cloud_draft_s * (1.0 + self.token_cost * (rows - 1)) if rows > 0 else 0.0

    def draft_step_s(self, rows: int) -> float:
        """The edge's batched draft step of ``rows`` rows (or a prefill of ``rows`` tokens)."""
        return self.draft_s * (1.0 + self.draft_batch_cost * (rows - 1))


@dataclass(frozen=True)
class Link:
    rtt_s: float
    bandwidth_bps: float = 10e6  # each way; a message of n bytes takes n·8/bandwidth + rtt/2


@dataclass(frozen=True)
class Request:
    trace: Trace
    max_tokens: int  # reply length asked for (the reply also ends at the path's EOS)


@dataclass
class Reply:
    user: int
    name: str
    dataset: str
    tokens: int = 0
    sent_s: float = 0.0
    first_s: float = math.nan
    done_s: float = math.nan
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    bonus: int = 0
    cogen_tokens: int = 0
    cloud_drafted: int = 0
    cloud_accepted: int = 0
    predraft_hits: int = 0
    predraft_miss_alternative: int = 0
    predraft_miss_none: int = 0
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    #: Branch frames (token trees) among the uplink bytes.
    hedge_bytes: int = 0
    proposes: int = 0
    #: Draft steps that grew prepared branches (levels of the tree the edge drafted), and what
    #: a cloud that drafted the same branches itself would have spent on them: one batched
    #: step of its draft model per level, over as many rows (Costs.cloud_draft_step_s).
    branch_steps: int = 0
    branch_cloud_s: float = 0.0
    gamma_mean: float | None = None
    depth_mean: float | None = None
    busy_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.first_s - self.sent_s

    @property
    def reply_s(self) -> float:
        return self.done_s - self.sent_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.reply_s if self.reply_s > 0 else math.nan

    @property
    def decode_tokens_per_s(self) -> float:
        span = self.done_s - self.first_s
        return (self.tokens - 1) / span if self.tokens >= 2 and span > 0 else math.nan


@dataclass(frozen=True)
class SimEvent:
    """What :func:`simulate`'s ``observe`` is told, in virtual time: ``what`` happened to
    ``user`` from ``t`` to ``end`` (= ``t`` for an instant). ``what``: ``draft`` (a draft step
    on the edge), ``branch`` (a batched step of pre-drafted branches), ``propose`` (a batch sent:
    ``n`` draft tokens; a credit has none), ``verify`` (the user's row in a verifier step:
    ``kind`` the work's, ``n`` its tokens), ``round`` (a verdict decided a batch: ``n``
    drafted, ``k`` accepted), ``commit`` (``n`` tokens committed at the edge), ``hit`` (a
    rejection answered by a pre-drafted branch)."""

    t: float
    end: float
    user: int
    what: str
    kind: str = ""
    n: int = 0
    k: int = 0


@dataclass
class SimResult:
    replies: list[Reply]
    busy_s: float  # the verifier's total busy time (forwards, its own draft steps)
    span_s: float  # first request sent → last reply done


# ------------------------------------------------------------------------------ the models


class _TraceModels:
    """The target and the draft of one trace, as the simulation asks them (module doc)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.p = len(trace.prompt)
        self.path = trace.path
        self._filler = trace.path[-1] if trace.path else trace.prompt[-1]

    def target(self, pos: int) -> int:
        """The target's greedy token at text position ``pos`` after the committed text."""
        j = pos - self.p
        return self.path[j] if 0 <= j < len(self.path) else self._filler

    def on_path(self, context: Sequence[int]) -> bool:
        j = len(context) - self.p
        return 0 <= j <= len(self.path) and tuple(context[self.p :]) == self.path[:j]

    def draft(self, context: Sequence[int], on_path: bool | None = None) -> tuple[int, float]:
        """The draft's greedy token after ``context`` (prompt + text) and its probability.
        After an off-path context the token is wrong: the argmax where that is wrong, else the
        second choice standing in for it, with the argmax's probability (the trace's values at
        that index)."""
        j = len(context) - self.p
        if not 0 <= j < len(self.path):
            return self._filler, 1.0
        ok = self.on_path(context) if on_path is None else on_path
        top, probs = self.trace.draft_top[j], self.trace.draft_top_p[j]
        wrong = not ok and top[0] == self.path[j] and len(top) > 1
        return (top[1] if wrong else top[0]), probs[0]

    def rival(self, context: Sequence[int]) -> Rival:
        """``drafter._rival`` from the trace at the drafted position: the argmax's
        probability and the ``RIVALS`` likeliest other tokens."""
        j = len(context) - self.p
        if not 0 <= j < len(self.path):
            return NO_RIVAL
        top, probs = self.trace.draft_top[j], self.trace.draft_top_p[j]
        alts = tuple((top[i], float(probs[i])) for i in range(1, min(len(top), 1 + RIVALS)))
        return Rival(alts[0][0], float(probs[0]), alts) if alts else NO_RIVAL


def _vocab(trace: Trace) -> int:
    ids = [*trace.prompt, *trace.path, *(t for row in trace.draft_top for t in row)]
    return max(SIM_VOCAB, max(ids) + 1)


# ------------------------------------------------------------------------------ the clock


class _Clock:
    """Events in virtual time, in order of time, then of scheduling."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn))
        self._seq += 1

    def run(self, limit_events: int = 50_000_000) -> None:
        n = 0
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            fn()
            n += 1
            if n > limit_events:
                raise SimError(f"more than {limit_events} events: the simulation does not end")


class _Pipe:
    """One direction of a link: FIFO serialisation, then half the RTT."""

    def __init__(self, clock: _Clock, link: Link) -> None:
        self.clock, self.link = clock, link
        self.free_at = 0.0

    def send(self, nbytes: int, deliver: Callable[[float], None]) -> None:
        start = max(self.clock.now, self.free_at)
        self.free_at = start + nbytes * 8.0 / self.link.bandwidth_bps
        arrive = self.free_at + self.link.rtt_s / 2.0
        self.clock.at(arrive, lambda: deliver(arrive))


# ------------------------------------------------------------------------------ the verifier


@dataclass(eq=False)
class _VSession:
    """One verifier session: its core and the work it asked for (at most one)."""

    core: VerifierCore
    models: _TraceModels
    reply: Reply
    send_down: Callable[[bytes], None]
    engine: _Engine
    work: Work | None = None
    closed: bool = False
    since: int = 0  # when its work was queued (the engine's count): the queue is FIFO

    def handle(self, events: Sequence[object]) -> None:
        for ev in events:
            if isinstance(ev, VSend):
                assert self.core.ctx is not None
                self.send_down(encode(ev.msg, self.core.ctx))
            elif isinstance(ev, Run):
                if self.work is not None:
                    raise SimError("a verifier core asked for work while its work runs")
                self.work = ev.work
                self.since = self.engine.queued()
                self.engine.wake()
            elif isinstance(ev, Close):
                raise SimError(f"the verifier closed a session: {ev.error.message}")

    def receive(self, data: bytes, now: float) -> None:
        if not self.closed:
            self.handle(self.core.receive(data, now))


@dataclass(eq=False)
class _ARSession:
    """The bench's autoregressive server's request: prefill, then one token a forward."""

    models: _TraceModels
    reply: Reply
    n: int
    on_token: Callable[[int], None]
    done: int = 0  # tokens produced
    queued: bool = False  # a row waits for the next step
    prefilled: int = 0  # prompt tokens cached by chunks so far
    since: int = 0  # when its row was queued (the engine's count)

    @property
    def queued_row(self) -> Queued:
        """Its next row as the scheduler sees it: the prompt's tokens not yet cached, then the
        row that decides (one token)."""
        left = len(self.models.trace.prompt) - self.prefilled if self.done == 0 else 1
        return Queued(SchedKind.FORWARD, left - 1, 1)


#: The engine's batch limits here: the product's defaults (chunked prefill, its share beside
#: the rounds, rationing, the step's token bound) but no bound on the sessions of a step, which
#: would cap it below the users simulated (an operator serving more users than
#: ``max_batch_sessions`` raises it, and ``slots``).
SIM_BATCH: Final = replace(EngineLimits().batch, max_sessions=1 << 20)


def _queued(work: Work | None) -> Queued:
    """A session's work as the scheduler sees it (the engine's entry, with an empty cache: no
    KV limits here)."""
    if isinstance(work, (Verify, CoGenerate)):
        return forward_entry(work)
    if isinstance(work, Crop):
        return Queued(SchedKind.CHEAP)
    raise SimError(f"{type(work).__name__}: not simulated (greedy sessions never ask for it)")


class _Engine:
    """The verifier GPU (module doc): one step at a time, with all queued work."""

    def __init__(
        self,
        clock: _Clock,
        costs: Costs,
        batch: BatchLimits,
        observe: Callable[[SimEvent], None] | None = None,
    ) -> None:
        self.clock, self.costs, self.batch, self.observe = clock, costs, batch, observe
        self.sessions: list[_VSession] = []
        self.ars: list[_ARSession] = []
        self.running = False
        self._woken = False
        self.busy_s = 0.0
        self.draft_cost = DraftCost()
        self._count = 0

    def queued(self) -> int:
        """A number for work queued now, larger than every earlier one's: the engine's queue is
        first come, first served (a step takes what fits in that order; the rest keeps its
        place)."""
        self._count += 1
        return self._count

    def wake(self) -> None:
        """Work was queued: start a step now if idle (after the events of this instant)."""
        if not self.running and not self._woken:
            self._woken = True
            self.clock.at(self.clock.now, self._step)

    def _step(self) -> None:
        self._woken = False
        if self.running:
            return
        self.sessions = [s for s in self.sessions if not s.closed]
        vs = sorted((s for s in self.sessions if s.work is not None), key=lambda s: s.since)
        ars = sorted((a for a in self.ars if a.queued), key=lambda a: a.since)
        if not vs and not ars:
            return
        costs = self.costs
        # The product's scheduler plans the step (calls aside): which rows, prefill chunks,
        # the ration of speculative slots and the budget each session is told.
        queue = [_queued(s.work) for s in vs] + [a.queued_row for a in ars]
        plan = plan_step(
            queue,
            self.batch,
            active_sessions=len(self.sessions) + len(self.ars),
            overhead_tokens=costs.overhead_tokens,
        )
        rows = {r.index: r for r in plan.rows}
        # Model drafts (runner._model_drafts): only where the plan allows them.
        asks: dict[int, int] = {}
        withheld: dict[int, Withheld] = {}
        for i, s in enumerate(vs):
            w = s.work
            if i not in rows or not isinstance(w, CoGenerate):
                continue
            if w.model_tokens > 0 and not len(w.draft) and rows[i].chunk == len(w.fixed):
                if not plan.model_drafts:
                    withheld[i] = Withheld.LOAD
                    continue
                n = w.model_tokens
                if w.model_alpha is not None:
                    n = draft_length(w.model_alpha, self.draft_cost.ratio, n)
                if n > 0:
                    asks[i] = n
                else:
                    withheld[i] = Withheld.COST
        share = [0.0] * len(vs)
        draft_s = 0.0
        steps = max(asks.values(), default=0)
        for k in range(steps):
            drafting = [i for i, n in asks.items() if n > k]
            t = costs.cloud_draft_step_s(len(drafting))
            draft_s += t
            for i in drafting:
                share[i] += t / len(drafting)
        if steps:
            self.draft_cost.observe_draft(steps, draft_s)
        # The forward: every planned row (a prefill chunk caches its tokens and decides
        # nothing; the others are decided, as the ration cut them).
        results: dict[int, Result] = {}
        tokens = [0] * len(vs)
        for i, s in enumerate(vs):
            w = s.work
            r = rows.get(i)
            if i in plan.skipped:
                results[i] = Skipped()
            elif i in plan.cheap:
                results[i] = Cropped()
            elif r is None or not isinstance(w, (Verify, CoGenerate)):
                continue
            elif r.chunk < len(w.fixed):
                s.work = advance(w, work_start(w) + r.chunk)
                tokens[i] = r.tokens
            else:
                planned = as_planned(w, r)  # rationed, its tree kept or left out
                assert isinstance(planned, (Verify, CoGenerate))
                results[i] = self._decide(s, planned, asks.get(i, 0), withheld.get(i), r)
                # the forward's row (runner._plan): its fixed tokens, or the last cached token
                # again when it has none, then the draft tokens it verifies and its tree
                tree = planned.tree_tokens if isinstance(planned, Verify) else 0
                tokens[i] = max(1, len(w.fixed)) + len(planned.draft) + tree + asks.get(i, 0)
        ar_rows = [0] * len(ars)
        for j, a in enumerate(ars):
            r = rows.get(len(vs) + j)
            if r is not None:
                ar_rows[j] = r.tokens
                a.prefilled += r.chunk
        total = sum(tokens) + sum(ar_rows)
        fwd = costs.forward_s(total)
        if total:
            self.draft_cost.observe_target(fwd)
        for i, s in enumerate(vs):
            s.reply.busy_s += share[i] + (fwd * tokens[i] / total if total else 0.0)
        decided: list[_ARSession] = []
        for j, (a, row) in enumerate(zip(ars, ar_rows, strict=True)):
            a.reply.busy_s += fwd * row / total if total else 0.0
            r = rows.get(len(vs) + j)
            if r is not None and r.chunk == queue[len(vs) + j].fixed:
                a.queued = False
                decided.append(a)
        spent = draft_s + fwd
        self.busy_s += spent
        self.running = True
        end = self.clock.now + spent
        if self.observe is not None:
            for i, s in enumerate(vs):
                if tokens[i] or i in results:
                    w = s.work
                    long = isinstance(w, (Verify, CoGenerate)) and len(w.fixed) > DECODE_FIXED
                    kind = "prefill" if i not in results or long else type(w).__name__.lower()
                    self.observe(
                        SimEvent(self.clock.now, end, s.reply.user, "verify", kind, tokens[i])
                    )
        done = {i: (vs[i], vs[i].work, res) for i, res in results.items()}
        self.clock.at(end, lambda: self._done(end, done, decided))

    def _decide(
        self,
        s: _VSession,
        w: Verify | CoGenerate,
        model_n: int,
        withheld: Withheld | None,
        row: Row,
    ) -> Result:
        """The result of ``s``'s work ``w`` as its ``row`` of the plan runs it (greedy, from
        the trace: ``as_planned``, its draft cut or deferred, its tree kept or left out); the
        result carries the row's cut and the budget the session is told."""
        m = s.models
        if isinstance(w, Verify):
            base = w.propose.pos + len(w.fixed)
            d = _greedy(m, base, w.draft.tolist(), w.want_bonus)
            taken = None
            for k, b in enumerate(w.branches):
                if b.opened_by(d):  # the recovered token opens it: decided in this forward
                    taken = BranchTaken(k, _greedy(m, base + b.at + 1, b.draft.tolist(), True))
                    break
            return Verified(d, cut=row.cut, budget=row.budget, branch=taken)
        base = w.pos + len(w.fixed)
        drafted = None
        draft = w.draft.tolist()
        if model_n:
            text = [*s.core.text[: w.pos], *w.fixed.tolist()]
            draft = _model_draft(m, text, model_n)
            drafted = np.array(draft, np.int64)
        elif w.model_tokens and not draft:
            drafted = NO_IDS
        d = _greedy(m, base, draft, True)
        if w.cloud or model_n:
            s.reply.cloud_drafted += len(draft)
            s.reply.cloud_accepted += d.accepted
        return Verified(d, drafted=drafted, withheld=withheld, budget=row.budget)

    def _done(
        self,
        end: float,
        done: dict[int, tuple[_VSession, Work | None, Result]],
        decided: list[_ARSession],
    ) -> None:
        self.running = False
        for s, w, r in done.values():
            if s.closed or s.work is not w:
                continue
            s.work = None
            s.handle(s.core.work_done(r, end))
        for a in decided:
            a.done += 1
            a.on_token(a.models.path[a.done - 1])
            if a.done < a.n:
                a.queued, a.since = True, self.queued()
        self.ars = [a for a in self.ars if a.done < a.n]
        self.wake()


def _greedy(m: _TraceModels, base: int, draft: Sequence[int], want_bonus: bool) -> Decision:
    """The greedy decision on ``draft`` at text position ``base``."""
    for i, x in enumerate(draft):
        t = m.target(base + i)
        if x != t:
            return Decision(i, token=t)
    return Decision(len(draft), bonus=m.target(base + len(draft)) if want_bonus else None)


def _model_draft(m: _TraceModels, text: list[int], n: int) -> list[int]:
    """The cloud draft model's greedy draft of ``n`` tokens after the committed ``text``."""
    out: list[int] = []
    ok = True
    for _ in range(n):
        tok, _ = m.draft(text + out, on_path=ok)
        ok = ok and tok == m.target(len(text) + len(out))
        out.append(tok)
    return out


# ------------------------------------------------------------------------------ the edge

#: What a driver generator yields: seconds of device time to spend, or a condition to wait for
#: (checked after every frame the edge receives).
_Yield = float | Callable[[], bool]


class _Edge:
    """One request of one user on its edge device, driven like ``run_single``."""

    def __init__(
        self, sim: _Sim, user: int, req: Request, reply: Reply, on_done: Callable[[], None]
    ) -> None:
        self.sim = sim
        self.models = _TraceModels(req.trace)
        self.reply = reply
        self.on_done = on_done
        mode = sim.mode
        trace = req.trace
        n = min(req.max_tokens, len(trace.path))
        eos = {trace.path[-1]} if trace.eos else set()
        self.gen = Generation(list(trace.prompt), n, sorted(eos))
        self.cfg = mode.pipeline_config()
        fp = Fingerprint("sim", _vocab(trace), "sim")
        hello = hello_for(fp, self.cfg, sim.seed, end=len(trace.prompt) + n)
        limits = replace(mode.session_limits(), service_rate=sim.service_rate)
        vcore = VerifierCore(TargetInfo(fp, fp.vocab_size), limits, f"u{user}")
        self.vs = _VSession(vcore, self.models, reply, self._down, sim.engine)
        opened = [e.msg for e in vcore.receive(encode(hello)) if isinstance(e, VSend)]
        if len(opened) != 1 or not isinstance(opened[0], Welcome):
            raise SimError(f"the verifier did not open the session: {opened}")
        rng = np.random.default_rng(sim.seed)
        self.core = SingleCore(self.gen, self.cfg, rng, hello, opened[0])
        self.up = sim.links[user][0]
        self.down = sim.links[user][1]
        self._proc: Iterator[_Yield] | None = None
        self._waiting: Callable[[], bool] | None = None
        self.prefill_s = sim.costs.draft_step_s(len(trace.prompt))
        #: Rows one batched draft step takes at this edge's batch cost (the batch's and its
        #: branches', or branches alone).
        self.branch_batch = Drafter.branch_batch_for(sim.costs.draft_batch_cost)

    # -- frames

    def _carry_out(self, events: Sequence[EdgeEvent]) -> None:
        stats = self.gen.stats
        for ev in events:
            if isinstance(ev, ESend):
                data = encode(ev.msg, self.core.ctx)
                stats.sent(ev.msg, len(data))
                self.up.send(len(data), partial(self._up, data))
                if isinstance(ev.msg, Propose):
                    self._note("propose", n=len(ev.msg.draft))
            elif isinstance(ev, Committed):
                if ev.ids and math.isnan(self.reply.first_s):
                    self.reply.first_s = self.sim.clock.now
                self._note("commit", n=len(ev.ids))
            elif isinstance(ev, Finished):
                pass
            elif isinstance(ev, (Count, RoundEvent, RejectionGap)):
                stats.apply(ev)
                if isinstance(ev, RoundEvent):
                    self._note("round", n=ev.drafted, k=ev.accepted)
                elif isinstance(ev, Count) and ev.counter == Counter.PREDRAFT_HITS:
                    self._note("hit")
            elif isinstance(ev, Fail):
                raise SimError(f"the edge's session failed: {ev.error}") from ev.error
            else:
                raise SimError(f"unexpected edge event {ev}")

    def _note(self, what: str, seconds: float = 0.0, n: int = 0, k: int = 0) -> None:
        """Tell the simulation's observer (if any) what this edge did now."""
        if self.sim.observe is not None:
            t = self.sim.clock.now
            self.sim.observe(SimEvent(t, t + seconds, self.reply.user, what, n=n, k=k))

    def _up(self, data: bytes, now: float) -> None:
        self.vs.receive(data, now)

    def _down(self, data: bytes) -> None:
        self.down.send(len(data), lambda t: self._receive(data, t))

    def _receive(self, data: bytes, now: float) -> None:
        if self.gen.done:
            return
        self._carry_out(self.core.receive(data, now))
        if self.gen.done:
            self._finish(now)
            return
        if self._waiting is not None and self._waiting():
            self._waiting = None
            self._resume()

    # -- the driver

    def start(self) -> None:
        now = self.sim.clock.now
        self.reply.sent_s = now
        cloud_only = self.sim.mode.kind == Kind.CLOUD_SD
        if not cloud_only and self.cfg.cogen and self.core.prompt_unsent():
            self._carry_out(self.core.credit(now))  # as the driver: its bonus is token 1
        self._proc = self._credit_loop() if cloud_only else self._draft_loop()
        self._resume()

    def _resume(self) -> None:
        while self._proc is not None and not self.gen.done:
            try:
                y = next(self._proc)
            except StopIteration:
                self._proc = None
                return
            if isinstance(y, float):
                self.sim.clock.at(self.sim.clock.now + y, self._resume)
                return
            if not y():
                self._waiting = y
                return

    def _credit_loop(self) -> Generator[_Yield, None, None]:
        """``credit_loop``."""
        core, gen = self.core, self.gen
        while not gen.done:
            if core.wants_credit():
                self._carry_out(core.credit(self.sim.clock.now))
            yield lambda: gen.done or core.wants_credit()

    def _step(self, context: list[int], want_rival: bool) -> tuple[int, float, Rival]:
        tok, prob = self.models.draft(context)
        rival = self.models.rival(context) if want_rival else NO_RIVAL
        return tok, prob, rival

    def _grow(self, growing: Sequence[Growing]) -> None:
        """``_grow``: one step of each branch, and what it sends (token trees)."""
        core = self.core
        if growing:
            self.reply.branch_steps += 1
            self.reply.branch_cloud_s += self.sim.costs.cloud_draft_step_s(len(growing))
        for g in growing:
            if not core.branch_open(g):
                continue
            tok, p, rival = self._step([*g.pp.context, g.pp.token, *g.draft], True)
            g.add(tok, _Q, rival, p)
            self._carry_out(core.grew(g))

    def _draft_loop(self) -> Generator[_Yield, None, None]:
        """``draft_loop``, in virtual time: each draft step also grows the prepared branches
        beside the batch (as many rows as the product's drafter steps together at the edge's
        batch cost, ``Drafter.branch_batch_for``, the batch's one of them), at that step's
        batched cost."""
        core, gen, cfg = self.core, self.gen, self.cfg
        want_rival = cfg.predraft > 0
        beside = self.branch_batch - 1 if cfg.predraft else 0
        while not gen.done:
            if not core.may_draft():
                if cfg.predraft:
                    grew = yield from self._predraft()
                    if grew:
                        continue
                yield lambda: gen.done or core.may_draft()
                continue
            plan, start = core.start_batch()
            draft, q_rows, rivals, prob = start.draft, start.q_rows, start.rivals, start.prob
            while core.pipe.wants_more(plan, draft, prob):
                pending = PendingBatch(len(plan.context), list(draft), list(rivals))
                branches = core.branch_rows(beside, pending) if beside else []
                seconds = self.sim.costs.draft_step_s(1 + len(branches)) + self.prefill_s
                self.prefill_s = 0.0  # the draft model's prefill, with its first step
                self._note("draft", seconds, n=len(branches))
                yield seconds
                tok, p, rival = self._step(plan.context + draft, want_rival)
                self._grow(branches)
                core.on_draft_step(seconds)
                if not core.pipe.current(plan, [*draft, tok]):
                    break
                draft.append(tok)
                q_rows.append(_Q)
                rivals.append(rival)
                prob = p
            self._carry_out(core.propose(plan, draft, q_rows, self.sim.clock.now, rivals))

    def _predraft(self) -> Generator[_Yield, None, bool]:
        """``_predraft``: while the pipeline is full, the branches grow alone, as many at once
        as the product's drafter takes at this batch cost (``Drafter.branch_batch_for``)."""
        core = self.core
        grew = False
        while not core.may_draft() and (active := core.branch_rows(self.branch_batch)):
            seconds = self.sim.costs.draft_step_s(len(active))
            self._note("branch", seconds, n=len(active))
            yield seconds
            self._grow(active)
            grew = True
        core.settle_branches()
        return grew

    def _finish(self, now: float) -> None:
        self._proc = None
        self._waiting = None
        r, st = self.reply, self.gen.stats
        r.done_s = now
        r.tokens = len(self.gen.generated)
        r.rounds, r.drafted, r.accepted = st.rounds, st.draft_tokens, st.accepted_tokens
        r.rejections, r.bonus, r.cogen_tokens = st.rejections, st.bonus_tokens, st.cogen_tokens
        r.predraft_hits = st.predraft_hits
        r.predraft_miss_alternative = st.predraft_miss_not_alternative
        r.predraft_miss_none = st.predraft_miss_cap + st.predraft_miss_time
        r.uplink_bytes, r.downlink_bytes = st.uplink_bytes, st.downlink_bytes
        r.hedge_bytes = st.hedge_bytes
        r.proposes = st.proposes_sent
        r.gamma_mean = st.gamma_sum / st.rounds if st.rounds else None
        r.depth_mean = st.depth_sum / st.rounds if st.rounds else None
        vs = self.vs
        # The edge closes the session: the verifier hears it half an RTT later.
        self.sim.clock.at(now + self.sim.link.rtt_s / 2.0, lambda: setattr(vs, "closed", True))
        self.on_done()


# ------------------------------------------------------------------------------ the run


@dataclass
class _Sim:
    mode: SimMode
    costs: Costs
    link: Link
    seed: int
    batch: BatchLimits = SIM_BATCH
    observe: Callable[[SimEvent], None] | None = None
    service_rate: float = SessionLimits().service_rate
    clock: _Clock = field(default_factory=_Clock)
    engine: _Engine = field(init=False)
    links: list[tuple[_Pipe, _Pipe]] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine = _Engine(self.clock, self.costs, self.batch, self.observe)

    def start(self, user: int, reqs: Sequence[Request], k: int) -> None:
        """User ``user`` sends its ``k``-th request now; the next follows its reply."""
        if k >= len(reqs):
            return
        req = reqs[k]
        t = req.trace
        reply = Reply(user, t.name, t.dataset)
        self.replies.append(reply)

        def next_() -> None:
            self.start(user, reqs, k + 1)

        if self.mode.kind == Kind.AR:
            self._start_ar(user, req, reply, next_)
        else:
            edge = _Edge(self, user, req, reply, next_)
            self.engine.sessions.append(edge.vs)
            edge.start()

    def _start_ar(self, user: int, req: Request, reply: Reply, next_: Callable[[], None]) -> None:
        """``bench.net.ar_server``'s request: up, prefill + one token a step, each token down."""
        trace = req.trace
        n = min(req.max_tokens, len(trace.path))
        up, down = self.links[user]
        reply.sent_s = self.clock.now
        eos = [trace.path[-1]] if trace.eos else []
        data = encode_request(list(trace.prompt), n, eos, keep=True, report=True)
        reply.uplink_bytes = len(data)
        models = _TraceModels(trace)
        got = 0

        def arrived(t: float) -> None:
            nonlocal got
            got += 1
            reply.downlink_bytes += AR_TOKEN_BYTES
            reply.tokens = got
            if got == 1:
                reply.first_s = t
            if got == n:
                reply.done_s = t
                next_()

        def on_token(_: int) -> None:
            down.send(AR_TOKEN_BYTES, arrived)

        session = _ARSession(models, reply, n, on_token)

        def queued(_: float) -> None:
            session.queued, session.since = True, self.engine.queued()
            self.engine.ars.append(session)
            self.engine.wake()

        up.send(len(data), queued)


def simulate(
    mode: SimMode,
    users: Sequence[Sequence[Request]],
    costs: Costs,
    link: Link,
    *,
    start_spread_s: float = 0.0,
    seed: int = 0,
    batch: BatchLimits = SIM_BATCH,
    observe: Callable[[SimEvent], None] | None = None,
    service_rate: float | None = None,
) -> SimResult:
    """Simulate ``users`` (each a closed loop over its requests: the next leaves when the
    previous reply is complete; user u starts at a seeded uniform offset in
    ``[0, start_spread_s)``), each with its own edge and link, sharing one verifier GPU whose
    scheduler runs with ``batch`` and owes every session ``service_rate`` tokens/s (the
    verifier's setting; None: its default); ``observe`` is told every :class:`SimEvent`."""
    if link.rtt_s < 0 or link.bandwidth_bps <= 0:
        raise ValueError(f"bad link {link}: rtt must be >= 0 and bandwidth > 0")
    rate = SessionLimits().service_rate if service_rate is None else service_rate
    sim = _Sim(mode, costs, link, seed, batch, observe, rate)
    rng = random.Random(seed)
    for u, reqs in enumerate(users):
        sim.links.append((_Pipe(sim.clock, link), _Pipe(sim.clock, link)))
        offset = rng.uniform(0.0, start_spread_s) if start_spread_s > 0 else 0.0
        sim.clock.at(offset, partial(sim.start, u, reqs, 0))
    sim.clock.run()
    unfinished = [r for r in sim.replies if math.isnan(r.done_s)]
    if unfinished:
        raise SimError(f"{len(unfinished)} replies never finished ({unfinished[0].name})")
    first = min((r.sent_s for r in sim.replies), default=0.0)
    last = max((r.done_s for r in sim.replies), default=0.0)
    return SimResult(sim.replies, sim.engine.busy_s, last - first)
