"""Simulated cells: one mode on one prompt set in one setting (RTT, reply length, the cloud's
and the edge's draft costs), each prompt alone with one verifier, on the 10 Mbit/s link of the
studies (:data:`BANDWIDTH_BPS`). :class:`Runner` runs cells once each, in a process pool if
asked; :class:`Tuner` picks the best cloud-sd (draft kind, γ) of a point on the tuning prompts,
as the users' grid (:mod:`bench.studies.grid`) and the capacity study
(:mod:`bench.studies.capacity`) both do.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.lib.costs import CLOUD_DRAFT_PER_VERIFY, DRAFT_BATCH_COST, TREE_TOKEN_COST
from bench.lib.prompts import Split
from bench.lib.sim import CloudDraftKind, Costs, Kind, Link, Request, SimMode, simulate
from bench.lib.traces import Trace, TraceSet, load_traces
from testkit.provenance import REPO

CLOUD_DRAFTS = (CloudDraftKind.MODEL, CloudDraftKind.MIXED)
#: The issue's 2–8, and past them: at the draft's per-token α ≈ 0.9 Leviathan et al.'s best γ is
#: about 9 at c = 0.11 and longer at c = 0.05, and prompt lookup (mixed) copies long runs of
#: the prompt: a range that stopped at 8 (or 16, measured) left the baseline short of its best.
GAMMAS = (2, 4, 6, 8, 10, 12, 16, 24, 32)
#: The link of every simulated study: 10 Mbit/s each way.
BANDWIDTH_BPS = 10e6
#: This CPU's batched draft step measurement (relative to the repository root).
DRAFT_BATCH_FILE = Path("docs/results/draft_batch.json")
#: Deadline for one cell (one mode over one prompt set) in a worker.
CELL_TIMEOUT_S = 1800.0
AR = "ar"


def cpu_draft_batch_cost(path: Path = REPO / DRAFT_BATCH_FILE) -> float:
    """This CPU's measured cost of each extra branch in a batched draft step (≈ 0.20)."""
    doc = json.loads(path.read_text())
    return float(doc["batch_cost_per_extra_branch"])


@dataclass(frozen=True, order=True)
class Cell:
    """One mode on one prompt set in one setting; ``cloud`` overrides a hybrid mode's cloud
    draft (kind, γ)."""

    split: str
    spec: str
    rtt_ms: float
    tokens: int
    cloud_draft_cost: float
    edge_batch_cost: float
    cloud: tuple[str, int] | None = None


@dataclass(frozen=True)
class PromptResult:
    """One prompt's reply in one cell (sums over its rounds)."""

    name: str
    dataset: str
    tokens: int
    tokens_per_s: float
    decode_tokens_per_s: float
    ttft_s: float
    reply_s: float
    busy_s: float
    rounds: int
    drafted: int
    accepted: int
    rejections: int
    proposes: int
    uplink_bytes: int
    #: of them, the branch frames' (hedges and token trees)
    branch_bytes: int
    downlink_bytes: int
    predraft_hits: int
    predraft_miss_alternative: int
    predraft_miss_none: int
    cloud_drafted: int
    cloud_accepted: int
    #: what the same branches would cost a cloud drafting them itself (bench.lib.sim.Reply)
    branch_cloud_s: float


def mode_of(cell: Cell) -> SimMode:
    """The cell's simulated mode (a hybrid's cloud draft set from ``cell.cloud``)."""
    mode = SimMode.parse(cell.spec)
    if cell.cloud is not None:
        kind, gamma = cell.cloud
        mode = replace(mode, cloud_draft=CloudDraftKind(kind), cloud_gamma=gamma)
    return mode


def costs_of(cell: Cell) -> Costs:
    return Costs(
        token_cost=TREE_TOKEN_COST,
        cloud_draft_per_verify=cell.cloud_draft_cost,
        draft_batch_cost=cell.edge_batch_cost,
    )


def same_as(cell: Cell) -> Cell:
    """The cell whose results ``cell``'s are: the cloud draft cost enters a simulation only
    through the verifier's own drafts (cloud-sd and hybrid sessions), the edge's batched draft
    cost only through an edge's draft steps (not in ar or cloud-sd)."""
    kind = SimMode.parse(cell.spec).kind
    if kind not in (Kind.CLOUD_SD, Kind.HYBRID):
        cell = replace(cell, cloud_draft_cost=CLOUD_DRAFT_PER_VERIFY)
    if kind in (Kind.AR, Kind.CLOUD_SD):
        cell = replace(cell, edge_batch_cost=DRAFT_BATCH_COST)
    return cell


def run_cell(cell: Cell, traces: Sequence[Trace]) -> list[PromptResult]:
    """Every prompt of ``traces`` alone through the cell's mode."""
    mode, costs = mode_of(cell), costs_of(cell)
    link = Link(rtt_s=cell.rtt_ms / 1000.0, bandwidth_bps=BANDWIDTH_BPS)
    out = []
    for trace in traces:
        result = simulate(mode, [[Request(trace, cell.tokens)]], costs, link)
        (r,) = result.replies
        out.append(
            PromptResult(
                name=trace.name,
                dataset=trace.dataset,
                tokens=r.tokens,
                tokens_per_s=r.tokens_per_s,
                decode_tokens_per_s=r.decode_tokens_per_s,
                ttft_s=r.ttft_s,
                reply_s=r.reply_s,
                busy_s=r.busy_s,
                rounds=r.rounds,
                drafted=r.drafted,
                accepted=r.accepted,
                rejections=r.rejections,
                proposes=r.proposes,
                uplink_bytes=r.uplink_bytes,
                branch_bytes=r.hedge_bytes,
                downlink_bytes=r.downlink_bytes,
                predraft_hits=r.predraft_hits,
                predraft_miss_alternative=r.predraft_miss_alternative,
                predraft_miss_none=r.predraft_miss_none,
                cloud_drafted=r.cloud_drafted,
                cloud_accepted=r.cloud_accepted,
                branch_cloud_s=r.branch_cloud_s,
            )
        )
    return out


_WORKER_SETS: dict[str, list[Trace]] = {}


def _worker_init(path: str) -> None:
    ts = load_traces(path)
    _WORKER_SETS.update({Split.MEASURED.value: ts.measured(), Split.TUNING.value: ts.tuning()})


def _worker_run(cell: Cell) -> list[PromptResult]:
    return run_cell(cell, _WORKER_SETS[cell.split])


class Runner:
    """Runs cells once each (a cache), in a process pool when ``workers > 1``; the results do
    not depend on the pool (every cell is deterministic)."""

    def __init__(self, path: Path, traces: TraceSet, workers: int) -> None:
        self.path, self.workers = path, workers
        self.sets = {Split.MEASURED.value: traces.measured(), Split.TUNING.value: traces.tuning()}
        self.cache: dict[Cell, list[PromptResult]] = {}
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> Runner:
        if self.workers > 1:
            self.pool = ProcessPoolExecutor(
                self.workers, initializer=_worker_init, initargs=(str(self.path),)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def run(self, cells: Iterable[Cell]) -> None:
        todo = sorted({same_as(c) for c in cells} - set(self.cache))
        if self.pool is None:
            for c in todo:
                self.cache[c] = run_cell(c, self.sets[c.split])
            return
        futures = {c: self.pool.submit(_worker_run, c) for c in todo}
        for c, f in futures.items():
            self.cache[c] = f.result(timeout=CELL_TIMEOUT_S)

    def get(self, cell: Cell) -> list[PromptResult]:
        key = same_as(cell)
        if key not in self.cache:
            self.run([key])
        return self.cache[key]


def mean(xs: Iterable[float]) -> float:
    v = list(xs)
    return sum(v) / len(v)


#: (RTT ms, reply tokens, cloud draft cost).
Point = tuple[float, int, float]


def cloud_spec(kind: CloudDraftKind, gamma: int) -> str:
    return f"cloud-sd:{kind.value}:{gamma}"


class Tuner:
    """Chooses among cells by their mean tokens/s on the tuning prompts; every cell's score
    goes to :attr:`tuning` (the results file's ``tuning``)."""

    def __init__(self, runner: Runner, gammas: Sequence[int] = GAMMAS) -> None:
        self.runner, self.gammas = runner, tuple(gammas)
        self.tuning: list[dict[str, Any]] = []

    def cell(
        self,
        split: Split,
        spec: str,
        rtt: float,
        tokens: int,
        c: float,
        b: float = DRAFT_BATCH_COST,
        cloud: tuple[str, int] | None = None,
    ) -> Cell:
        return Cell(split.value, spec, rtt, tokens, c, b, cloud)

    def tune_cloud(self, points: Sequence[Point]) -> dict[Point, tuple[str, int]]:
        """The best cloud-sd (draft kind, γ) at each point, by mean tokens/s on the tuning
        prompts (ties: the earlier of :data:`CLOUD_DRAFTS` × γ)."""
        cells = {
            p: [
                self.cell(Split.TUNING, cloud_spec(k, g), *p)
                for k in CLOUD_DRAFTS
                for g in self.gammas
            ]
            for p in points
        }
        self.runner.run(c for cs in cells.values() for c in cs)
        out = {}
        for p, cs in cells.items():
            i = self._best(cs, "cloud-sd")
            _, kind, gamma = cs[i].spec.split(":")
            out[p] = (kind, int(gamma))
        return out

    def _best(self, cells: Sequence[Cell], family: str) -> int:
        """The index of the cell with the highest mean tokens/s (the first on a tie); every
        cell's score goes to :attr:`tuning`."""
        scores = [mean(r.tokens_per_s for r in self.runner.get(c)) for c in cells]
        best = max(range(len(cells)), key=lambda j: (scores[j], -j))
        for j, c in enumerate(cells):
            self.tuning.append(self._tuning_row(family, c, scores[j], j == best))
        return best

    def _tuning_row(self, family: str, c: Cell, score: float, chosen: bool) -> dict[str, Any]:
        mode = mode_of(c)
        return {
            "family": family,
            "rtt_ms": c.rtt_ms,
            "reply_tokens": c.tokens,
            "cloud_draft_cost": c.cloud_draft_cost,
            "mode": mode.label,
            "mode_spec": c.spec,
            "cloud": list(c.cloud) if c.cloud else None,
            "prompts": len(self.runner.get(c)),
            "tokens_per_s": score,
            "chosen": chosen,
        }
