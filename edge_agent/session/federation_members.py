"""A member (worker) of the federation at the edge, as the federated core sees it: its
parameters (:class:`WorkerParams`), its state (DOWN, LIVE in step, BEHIND left out), what it owes
(its unanswered Proposes) and how fast it answers, and the liveness rule that says when its
silence means it is dead. Also the federation's measurements (:class:`FederationStats`), which
the driver counts from the core's events. No I/O, no clock: times are passed in.

Invariant: a member's ``outstanding`` table holds exactly its Proposes not answered yet, oldest
first (each Propose gets one FederatedReply or an Error; see
:mod:`edge_agent.session.federation_core`).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from edge_agent.session.events import FedCount, FedTally
from edge_agent.session.pipeline import PREFILL_ALLOWANCE_S
from edge_agent.session.wire_state import WireState
from shared.enums import TextEnum

#: A member is dead past this multiple of its slowest recent round (or of its verifier's own
#: estimate of the time left), or ``liveness_s`` when longer: the single verifier's rule.
LIVENESS_FACTOR: Final = 4.0
#: Recent round times kept per member.
ROUNDS_KEPT: Final = 16


class WorkerState(TextEnum):
    DOWN = "down"
    LIVE = "live"  # in step: sent every batch, waited for in the rounds it was sent
    BEHIND = "behind"  # left out: keeps its session, probed, never waited for


@dataclass(frozen=True)
class WorkerParams:
    """One worker's place in the federation: its name, weight and top-k."""

    name: str
    weight: float = 1.0
    k: int = 10
    eps_target: float = 0.0

    def __post_init__(self) -> None:
        if not (self.weight > 0 and np.isfinite(self.weight)):
            raise ValueError(f"worker {self.name}: weight must be positive, got {self.weight}")
        if self.k < 1:
            raise ValueError(f"worker {self.name}: k must be >= 1, got {self.k}")
        if not 0.0 <= self.eps_target < 1.0:
            raise ValueError(f"worker {self.name}: eps_target must be in [0, 1)")


@dataclass
class FederationStats:
    """The federation's measurements. The core writes none: it reports them as events
    (:data:`~edge_agent.session.events.FedTally`), which the federated driver counts here
    (:meth:`apply`)."""

    rounds_with_missing_workers: int = 0
    worker_drops: int = 0
    #: Times a member became LIVE again (readmitted after being left out, or after a drop).
    worker_rejoins: int = 0
    #: Times an in-step member was left out of the rounds for being slow (not dropped).
    left_out: int = 0
    #: Batches sent to a left-out member to see whether it keeps up again.
    probes: int = 0
    bound_violations: int = 0
    positions_measured: int = 0
    eps_sum: list[float] = field(default_factory=list)  # per worker
    bias_bound_sum: float = 0.0
    bias_upper_sum: float = 0.0
    bias_upper_count: int = 0

    def apply(self, tally: FedTally) -> None:
        """Count what the federated core reported."""
        if isinstance(tally, FedCount):
            setattr(self, tally.counter.value, getattr(self, tally.counter.value) + tally.n)
            return
        self.positions_measured += 1
        for i, e in tally.eps:
            self.eps_sum[i] += e
        self.bias_bound_sum += tally.bias_bound
        if tally.bias_upper is not None:
            self.bias_upper_sum += tally.bias_upper
            self.bias_upper_count += 1
        self.bound_violations += tally.violations

    def mean_eps(self) -> list[float]:
        n = max(1, self.positions_measured)
        return [e / n for e in self.eps_sum]


@dataclass(frozen=True)
class Sent:
    """A Propose a member has not answered yet: when it was sent and its fixed tokens."""

    at: float
    fixed: int


@dataclass
class Worker:
    params: WorkerParams
    index: int
    state: WorkerState = WorkerState.DOWN
    wire: WireState | None = None
    joins: int = 0  # times it became LIVE (more than one: it rejoined)
    #: Its Proposes not answered yet, by batch number, oldest first (see the invariants).
    outstanding: dict[int, Sent] = field(default_factory=dict)
    #: Seconds from sending a Propose to its reply, recent rounds (queueing included).
    rounds: deque[float] = field(default_factory=lambda: deque(maxlen=ROUNDS_KEPT))
    replied_at: float | None = None  # its last reply (this session)
    progress_at: float | None = None  # its last Progress frame (this session)
    progress_eta_s: float = 0.0  # that frame's estimate of the time its work still takes
    probe_at: float = 0.0  # BEHIND: its next probe no sooner than this
    answered: int = 0  # replies in this session

    @property
    def connected(self) -> bool:
        return self.state != WorkerState.DOWN

    def pace(self) -> float | None:
        """Its typical round time: the median of its recent rounds (None before any)."""
        return statistics.median(self.rounds) if self.rounds else None

    def liveness_deadline(self, floor_s: float) -> float | None:
        """When this member counts as dead if it stays silent (None: nothing outstanding).

        From the later of its oldest outstanding Propose and its last reply: ``floor_s`` or
        LIVENESS_FACTOR × its slowest recent round, plus that Propose's prefill allowance.
        From a Progress frame since: ``floor_s`` or LIVENESS_FACTOR × the verifier's estimate
        of the time left. A verifier whose engine moves sends Progress every second or so, so
        only one that stopped (or a path that swallows frames) gets there."""
        if not self.outstanding:
            return None
        oldest = next(iter(self.outstanding.values()))
        base = oldest.at if self.replied_at is None else max(oldest.at, self.replied_at)
        slowest = max(self.rounds, default=0.0)
        deadline = (
            base + max(floor_s, LIVENESS_FACTOR * slowest) + PREFILL_ALLOWANCE_S * oldest.fixed
        )
        if self.progress_at is not None and self.progress_at >= base:
            eta = LIVENESS_FACTOR * self.progress_eta_s
            deadline = max(deadline, self.progress_at + max(floor_s, eta))
        return deadline
