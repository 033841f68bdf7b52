"""The users' grid: whole replies per mode, RTT and reply length, simulated from acceptance
traces, with every ratio's 95 % bootstrap interval paired by prompt.

    python -m bench grid --traces docs/results/bench/traces.json.gz --out docs/results/bench
    python -m bench grid --traces T --out DIR --validation REALTIME/results.json
    python -m bench grid --traces T --out /tmp/grid --smoke     # few RTTs, short replies

Regime: PicoSpec's timings (:class:`bench.lib.sim.Costs`'s defaults: draft step 24 ms, verify of
1 + γ = 5 tokens 166 ms, autoregressive step 146 ms), a forward of n tokens priced by the H200's
``TREE_TOKEN_COST``, a 10 Mbit/s link at RTT 0, 50, 100, 200 and 300 ms, replies of 32 and 256
tokens (or fewer: a reply ends at EOS). Each prompt is simulated alone (one user, one verifier),
so every figure is deterministic.

* cloud-sd at its best: per RTT, reply length and cloud draft cost c (0.05, the measured 0.11,
  0.2 of a verify), every cloud draft kind (model, mixed) × γ (2, 4, 6, 8, 10, 12, 16, 24,
  32) runs on the TUNING prompts; the best by mean tokens/s is measured on the MEASURED prompts
  ("best cloud-sd").
* edge modes: stop-and-wait, pipelined with and without co-generation, auto and hybrid, with and
  without pre-drafting (hybrid takes the best cloud-sd's draft kind and γ); "best edge" is the
  best of them on the TUNING prompts. The pre-drafting modes also run at this CPU's batched
  draft cost (docs/results/draft_batch.json) beside the GPU class's.
* ratios: mean over prompts of a mode's figure over the baseline's mean, with
  :func:`bench.lib.stats.ratio_ci`'s interval (the same prompts resampled on both sides).

Writes ``OUT/results.json``: ``regime``, ``settings``, ``tuning``, ``summary``, ``categories``,
``targets``, ``validation`` (with ``--validation``), ``provenance``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.lib import stats
from bench.lib.cells import (
    AR,
    BANDWIDTH_BPS,
    CLOUD_DRAFTS,
    DRAFT_BATCH_FILE,
    GAMMAS,
    Cell,
    Point,
    PromptResult,
    Runner,
    Tuner,
    cloud_spec,
    cpu_draft_batch_cost,
    mean,
    mode_of,
    run_cell,
)
from bench.lib.cli import add_traces, study_parser
from bench.lib.costs import (
    CLOUD_DRAFT_PER_VERIFY,
    DRAFT_BATCH_COST,
    SOURCE,
    TREE_TOKEN_COST,
    VERIFY_EAGER_B1_MS,
    VERIFY_EAGER_B8_MS,
)
from bench.lib.modes import DEFAULT_EDGE
from bench.lib.prompts import DATASETS, Split
from bench.lib.sim import CloudDraftKind, Costs
from bench.lib.traces import TraceSet, load_traces
from testkit.provenance import REPO, provenance

RTTS_MS = (0.0, 50.0, 100.0, 200.0, 300.0)
REPLY_TOKENS = (32, 256)
#: The cloud's draft step in verifies: the measured ratio and two either side of it.
CLOUD_DRAFT_COSTS = (0.05, CLOUD_DRAFT_PER_VERIFY, 0.2)
EDGE_MODES = (
    "saw:4",
    "pipe:4x4",
    "pipe:4x4:nocogen",
    "auto",
    "auto:predraft",
    "hybrid",
    "hybrid:predraft",
)
#: The modes that also run at this CPU's batched draft cost.
PREDRAFT_MODES = ("auto:predraft", "hybrid:predraft")
#: The RTT and reply length of the categories table and the targets.
HEADLINE_RTT_MS = 100.0
HEADLINE_TOKENS = 256
CAPACITY_FILE = Path("docs/results/capacity.json")
#: The same study under the roofline cost model (``python -m bench capacity --roofline``).
ROOFLINE_FILE = Path("docs/results/capacity_roofline.json")
#: The product's default verifier behind an edge that does not draft (edge ``draft = "none"``):
#: prompt lookup only, at the default ``cloud_draft_tokens``; measured, not tuned.
CLOUD_DECODING = "cloud-sd:ngram:8"


# ------------------------------------------------------------------------------ figures


def share(num: float, den: float) -> float | None:
    return num / den if den else None


@dataclass(frozen=True)
class Ratio:
    value: float
    ci: list[float]


def paired_ratio(
    mode: Sequence[PromptResult],
    base: Sequence[PromptResult],
    key: Callable[[PromptResult], float],
    *,
    resamples: int,
) -> Ratio:
    """mean over prompts of ``key`` for ``mode`` over ``base``'s, CI paired by prompt."""
    if [r.name for r in mode] != [r.name for r in base]:
        raise ValueError("paired ratio over different prompts")
    num, den = [key(r) for r in mode], [key(r) for r in base]
    return Ratio(stats.ratio(num, den), stats.ratio_ci(num, den, n=resamples))


def tokens_per_s(r: PromptResult) -> float:
    return r.tokens_per_s


def decode_tokens_per_s(r: PromptResult) -> float:
    return r.decode_tokens_per_s


def acceptance(rs: Sequence[PromptResult]) -> dict[str, Any]:
    """Acceptance and link figures summed over prompts (None where undefined). The acceptance
    figures are the edge's drafts'; ``cloud_draft_acceptance`` is the verifier's own drafts'
    (cloud-sd, hybrid). A cloud-sd reply has no edge drafts: its ``draft_acceptance`` is its
    cloud drafts', and its per-token α is not known (the verifier's rejections are not
    counted), so None."""
    drafted = sum(r.drafted for r in rs)
    accepted = sum(r.accepted for r in rs)
    rejections = sum(r.rejections for r in rs)
    rounds = sum(r.rounds for r in rs)
    proposes = sum(r.proposes for r in rs)
    cloud_drafted = sum(r.cloud_drafted for r in rs)
    cloud_accepted = sum(r.cloud_accepted for r in rs)
    hits = sum(r.predraft_hits for r in rs)
    miss_alt = sum(r.predraft_miss_alternative for r in rs)
    miss_none = sum(r.predraft_miss_none for r in rs)
    predrafted = hits + miss_alt + miss_none > 0
    return {
        "draft_acceptance": share(accepted, drafted)
        if drafted
        else share(cloud_accepted, cloud_drafted),
        "alpha_per_token": share(accepted, accepted + rejections),
        "mean_accepted_per_round": share(accepted, rounds),
        "cloud_draft_acceptance": share(cloud_accepted, cloud_drafted),
        "uplink_bytes_per_round": share(sum(r.uplink_bytes for r in rs), proposes),
        "branch_bytes_per_round": share(sum(r.branch_bytes for r in rs), proposes),
        # what the same branches would cost a cloud drafting them itself (a batched step of its
        # draft model a level of the tree), per 100 committed tokens
        "branch_cloud_s_per_100_tokens": share(
            100.0 * sum(r.branch_cloud_s for r in rs), sum(r.tokens for r in rs)
        )
        if predrafted
        else None,
        "downlink_bytes_per_rejection": share(sum(r.downlink_bytes for r in rs), rejections),
        "predraft_hit_rate": share(hits, rejections) if predrafted else None,
        "predraft_miss_alternative": share(miss_alt, rejections) if predrafted else None,
        "predraft_miss_none": share(miss_none, rejections) if predrafted else None,
    }


def summary_row(
    cell: Cell,
    rs: Sequence[PromptResult],
    ar: Sequence[PromptResult],
    cloud: Sequence[PromptResult],
    *,
    draft: str,
    resamples: int,
    name: str | None = None,
) -> dict[str, Any]:
    """One summary row: ``rs`` (a mode on the measured prompts) against ``ar`` and ``cloud``
    (the best cloud-sd) on the same prompts, at the same RTT, length and costs."""
    vs_ar = paired_ratio(rs, ar, tokens_per_s, resamples=resamples)
    vs_cloud = paired_ratio(rs, cloud, tokens_per_s, resamples=resamples)
    decode = paired_ratio(rs, ar, decode_tokens_per_s, resamples=resamples)
    tokens = sum(r.tokens for r in rs)
    mode = mode_of(cell)
    return {
        "regime": "picospec",
        "draft": draft,
        "rtt_ms": cell.rtt_ms,
        "mode": name or mode.label,
        "mode_spec": cell.spec,
        "reply_tokens": cell.tokens,
        "tokens_mean": tokens / len(rs),
        "prompts": len(rs),
        "tokens_per_s": mean(r.tokens_per_s for r in rs),
        "decode_tokens_per_s": mean(r.decode_tokens_per_s for r in rs),
        "ttft_s": mean(r.ttft_s for r in rs),
        "ttft_p50_s": stats.percentile([r.ttft_s for r in rs], 50),
        "reply_s": mean(r.reply_s for r in rs),
        "speedup_vs_ar": vs_ar.value,
        "speedup_vs_ar_ci": vs_ar.ci,
        "speedup_vs_cloud_sd": vs_cloud.value,
        "speedup_vs_cloud_sd_ci": vs_cloud.ci,
        "decode_speedup_vs_ar": decode.value,
        "decode_speedup_vs_ar_ci": decode.ci,
        "verifier_busy_s_per_100_tokens": 100.0 * sum(r.busy_s for r in rs) / max(1, tokens),
        **acceptance(rs),
        "cloud_draft": None,
        "gamma": None,
        "cloud_draft_cost": cell.cloud_draft_cost,
        "edge_batch_cost": cell.edge_batch_cost,
        "best_of": None,
    }


# -------------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Settings:
    rtts_ms: tuple[float, ...] = RTTS_MS
    reply_tokens: tuple[int, ...] = REPLY_TOKENS
    cloud_draft_costs: tuple[float, ...] = CLOUD_DRAFT_COSTS
    gammas: tuple[int, ...] = GAMMAS
    edge_modes: tuple[str, ...] = EDGE_MODES
    resamples: int = stats.RESAMPLES

    @property
    def headline_tokens(self) -> int:
        return HEADLINE_TOKENS if HEADLINE_TOKENS in self.reply_tokens else max(self.reply_tokens)


SMOKE = Settings(
    rtts_ms=(0.0, 100.0, 200.0),
    reply_tokens=(8, 16),
    cloud_draft_costs=(CLOUD_DRAFT_PER_VERIFY,),
    gammas=(2, 4),
    resamples=200,
)


@dataclass(frozen=True)
class Choice:
    """What the tuning set chose at one (RTT, length, c)."""

    cloud: Cell  # the best cloud-sd (measured split)
    cloud_draft: str
    gamma: int
    edge: Cell  # the best edge mode (measured split)


class Grid(Tuner):
    def __init__(self, runner: Runner, settings: Settings, edge_cpu_cost: float) -> None:
        super().__init__(runner, settings.gammas)
        self.s, self.cpu_cost = settings, edge_cpu_cost

    def edge_cell(
        self, split: Split, spec: str, rtt: float, tokens: int, c: float, cloud: tuple[str, int]
    ) -> Cell:
        return self.cell(
            split, spec, rtt, tokens, c, cloud=cloud if spec.startswith("hybrid") else None
        )

    def points(self) -> list[Point]:
        return [
            (rtt, tokens, c)
            for rtt in self.s.rtts_ms
            for tokens in self.s.reply_tokens
            for c in self.s.cloud_draft_costs
        ]

    def choose(self) -> dict[Point, Choice]:
        """Tune cloud-sd, then the edge modes, on the tuning prompts at every point."""
        best_cloud = self.tune_cloud(self.points())
        cells = {
            p: [self.edge_cell(Split.TUNING, m, *p, cloud=best_cloud[p]) for m in self.s.edge_modes]
            for p in self.points()
        }
        self.runner.run(c for cs in cells.values() for c in cs)
        out = {}
        for p, cs in cells.items():
            i = self._best(cs, "edge")
            kind, gamma = best_cloud[p]
            out[p] = Choice(
                cloud=self.cell(Split.MEASURED, cloud_spec(CloudDraftKind(kind), gamma), *p),
                cloud_draft=kind,
                gamma=gamma,
                edge=replace(cs[i], split=Split.MEASURED.value),
            )
        return out

    def measured_cells(self, p: Point, ch: Choice) -> list[tuple[str, Cell]]:
        """(role, cell) of every measured row at point ``p``."""
        m = Split.MEASURED
        cloud = (ch.cloud_draft, ch.gamma)
        rows = [("ar", self.cell(m, AR, *p)), ("best cloud-sd", ch.cloud)]
        rows.append(("cloud decoding", self.cell(m, CLOUD_DECODING, *p)))
        rows += [("edge", self.edge_cell(m, s, *p, cloud=cloud)) for s in self.s.edge_modes]
        rows += [
            ("edge", replace(self.edge_cell(m, s, *p, cloud=cloud), edge_batch_cost=self.cpu_cost))
            for s in PREDRAFT_MODES
            if s in self.s.edge_modes
        ]
        rows.append(("best edge", ch.edge))
        return rows

    def summary(self, choices: dict[Point, Choice], draft: str) -> list[Any]:
        plan = {p: self.measured_cells(p, ch) for p, ch in choices.items()}
        self.runner.run(c for rows in plan.values() for _, c in rows)
        out = []
        for p, rows in plan.items():
            ch = choices[p]
            ar, cloud = self.runner.get(rows[0][1]), self.runner.get(ch.cloud)
            for role, c in rows:
                row = summary_row(
                    c,
                    self.runner.get(c),
                    ar,
                    cloud,
                    draft=draft,
                    resamples=self.s.resamples,
                    name=role if role in ("best cloud-sd", "best edge") else None,
                )
                row["role"] = role
                if role == "best cloud-sd":
                    row["cloud_draft"], row["gamma"] = ch.cloud_draft, ch.gamma
                if role == "best edge":
                    row["best_of"] = list(self.s.edge_modes)
                if c.cloud is not None:
                    row["cloud_draft"], row["gamma"] = c.cloud
                out.append(row)
        return out


def find(rows: Sequence[dict[str, Any]], **match: Any) -> dict[str, Any]:
    """The one row whose keys equal ``match``."""
    hits = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(hits) != 1:
        raise LookupError(f"{len(hits)} rows match {match}")
    return hits[0]


def categories(grid: Grid, choices: dict[Point, Choice], draft: str) -> list[dict[str, Any]]:
    """Per dataset at the headline point: the best edge and hybrid predraft against ar and the
    best cloud-sd."""
    p = (HEADLINE_RTT_MS, grid.s.headline_tokens, CLOUD_DRAFT_PER_VERIFY)
    if p not in choices:
        return []
    ch = choices[p]
    # The edge rows at the GPU-class batch cost (the CPU-cost rows share their specs).
    roles = {
        c.spec if r == "edge" else r: c
        for r, c in grid.measured_cells(p, ch)
        if r != "edge" or c.edge_batch_cost == DRAFT_BATCH_COST
    }
    modes = [("best edge", roles["best edge"])]
    if "hybrid:predraft" in roles:
        modes.append(("hybrid:predraft", roles["hybrid:predraft"]))
    ar_all, cloud_all = grid.runner.get(roles["ar"]), grid.runner.get(ch.cloud)
    out = []
    for dataset in DATASETS:
        keep = [i for i, r in enumerate(ar_all) if r.dataset == dataset]
        if not keep:
            continue
        ar = [ar_all[i] for i in keep]
        cloud = [cloud_all[i] for i in keep]
        for role, c in modes:
            rs = [grid.runner.get(c)[i] for i in keep]
            row = summary_row(
                c,
                rs,
                ar,
                cloud,
                draft=draft,
                resamples=grid.s.resamples,
                name=role if role == "best edge" else None,
            )
            acc = acceptance(rs)
            out.append(
                {
                    "dataset": dataset,
                    "mode": row["mode"],
                    "mode_spec": c.spec,
                    "rtt_ms": c.rtt_ms,
                    "reply_tokens": c.tokens,
                    "cloud_draft_cost": c.cloud_draft_cost,
                    "edge_batch_cost": c.edge_batch_cost,
                    "prompts": len(rs),
                    "alpha_per_token": acc["alpha_per_token"],
                    "mean_accepted_per_round": acc["mean_accepted_per_round"],
                    **{
                        k: row[k]
                        for k in (
                            "tokens_per_s",
                            "decode_tokens_per_s",
                            "speedup_vs_ar",
                            "speedup_vs_ar_ci",
                            "speedup_vs_cloud_sd",
                            "speedup_vs_cloud_sd_ci",
                            "decode_speedup_vs_ar",
                            "decode_speedup_vs_ar_ci",
                        )
                    },
                }
            )
    return out


def target(
    name: str, measured: float | None, ci: list[float] | None, threshold: float, **extra: Any
) -> dict[str, Any]:
    """A target is ``met`` when its interval's lower end (its value when it has none) reaches
    the threshold; ``point_met`` when its value does."""
    basis = ci[0] if ci is not None else measured
    return {
        "name": name,
        "measured": measured,
        "ci": ci,
        "threshold": threshold,
        "met": None if basis is None else bool(basis >= threshold),
        "point_met": None if measured is None else bool(measured >= threshold),
        **extra,
    }


def targets(
    grid: Grid,
    summary: Sequence[dict[str, Any]],
    choices: dict[Point, Choice],
    capacity: dict[str, Any] | None,
    roofline: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The issue's targets (the slowest tenth keeps pace): per user at low load (one user, the
    measured cloud draft cost, the GPU-class batch cost) from the grid: the default edge
    against best cloud-sd at every RTT up to 200 ms (its point estimate ≥ 1.0, its interval's
    low end ≥ 0.95), and the rejections that found a branch ready at RTT 100 (≥ 75 %); then
    users per verifier and the default's spread under load from the capacity studies."""
    n, c, b = grid.s.headline_tokens, CLOUD_DRAFT_PER_VERIFY, DRAFT_BATCH_COST
    out: list[dict[str, Any]] = []
    at = {"reply_tokens": n, "cloud_draft_cost": c, "edge_batch_cost": b}
    for rtt in grid.s.rtts_ms:
        if rtt > 200.0 or (rtt, n, c) not in choices:
            continue
        default = find(summary, rtt_ms=rtt, mode_spec=DEFAULT_EDGE, role="edge", **at)
        name = f"default edge ({DEFAULT_EDGE}) whole {n}-token reply / best cloud-sd at RTT {rtt:g}"
        ratio, ci = default["speedup_vs_cloud_sd"], default["speedup_vs_cloud_sd_ci"]
        out.append(target(name + ", point estimate", ratio, None, 1.0, mode_spec=DEFAULT_EDGE))
        out.append(target(name + ", interval's low end", ratio, ci, 0.95, mode_spec=DEFAULT_EDGE))
        if rtt == 100.0:
            miss = default.get("predraft_miss_none")
            out.append(
                target(
                    f"rejections with a branch ready (1 - no branch) at RTT 100, {n} tokens, "
                    "default edge",
                    None if miss is None else 1.0 - miss,
                    None,
                    0.75,
                    mode_spec=DEFAULT_EDGE,
                    uplink_bytes_per_round=default.get("uplink_bytes_per_round"),
                )
            )
    return out + targets_from_capacity(capacity, roofline)


def targets_from_capacity(
    capacity: dict[str, Any] | None, roofline: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The targets the capacity studies answer (:func:`read_capacity`'s documents; None: not
    run): users per verifier at each service level under each cost model (the best edge mode
    without a cloud draft model ≥ 1.15× best cloud-sd; ≥ 2.5× ar at reading under the linear
    model, reported without a target under the roofline one), then :func:`_spread_targets`
    from the linear one."""
    out: list[dict[str, Any]] = []
    for doc, model in ((capacity, "linear"), (roofline, "roofline")):
        levels = ((doc or {}).get("headline") or {}).get("levels") or {}
        source = str(doc["source_file"]) if doc else f"no {model} capacity file"
        for level, head in levels.items():
            pairs = [("best cloud-sd", "best_edge_no_cloud_model_over_best_cloud_sd", 1.15)]
            if level == "reading" and model == "linear":
                pairs.append(("ar", "best_edge_no_cloud_model_over_ar", 2.5))
            for what, key, threshold in pairs:
                out.append(
                    target(
                        f"users per verifier at {level!r} ({model} costs), best edge without a "
                        f"cloud draft model / {what}",
                        head.get(key),
                        None,
                        threshold,
                        mode=head.get("best_edge_no_cloud_model_mode"),
                        source=source,
                    )
                )
    if capacity:
        out += _spread_targets(capacity)
    return out


def _spread_targets(capacity: dict[str, Any]) -> list[dict[str, Any]]:
    """The default edge mode's slowest tenth against its median (per-user tokens/s p10 / p50
    ≥ 0.85) at N = 1 and at the largest N of a capacity study's rows."""
    rows = [r for r in capacity["rows"] if r["mode"] == "auto predraft"]
    out: list[dict[str, Any]] = []
    for n in sorted({1, max(r["edges"] for r in rows)}):
        r = next((x for x in rows if x["edges"] == n), None)
        if r is None:
            continue
        out.append(
            target(
                f"default edge per-user tok/s p10 / p50 at N = {n}",
                r["per_user_tokens_per_s_p10"] / r["per_user_tokens_per_s_p50"],
                None,
                0.85,
                mode="auto predraft",
                source=str(capacity["source_file"]),
            )
        )
    return out


# ------------------------------------------------------------------------------ validation

#: The real-time benchmark's mode labels and the simulated modes they are.
REALTIME_MODES = {
    "ar": "ar",
    "auto": "auto",
    "auto predraft": "auto:predraft",
    "hybrid predraft": "hybrid:predraft",
    "stop-and-wait": "saw:4",
    "pipelined γ=4 D=4": "pipe:4x4",
    "cloud-sd": "cloud-sd:mixed:4",
}


def validation(
    runner: Runner, traces: TraceSet, doc: dict[str, Any], resamples: int
) -> list[dict[str, Any]]:
    """The simulation against a real-time run: per mode and RTT, the same prompts' measured and
    simulated figures and sim / measured paired by run."""
    groups: dict[tuple[str, float], list[tuple[dict[str, Any], PromptResult]]] = {}
    for run in doc.get("runs", []):
        spec = REALTIME_MODES.get(str(run.get("mode")))
        # Only the picospec regime's runs with the traces' draft are what the traces simulate.
        if (
            spec is None
            or run.get("regime", "picospec") != "picospec"
            or run.get("draft") not in (None, traces.draft)
        ):
            continue
        trace = traces.by_name(f"{run['dataset']}/{int(run['prompt'])}")
        cell = Cell(
            Split.MEASURED.value,
            spec,
            float(run["rtt_ms"]),
            int(run["tokens"]),
            CLOUD_DRAFT_PER_VERIFY,
            DRAFT_BATCH_COST,
            ("mixed", 4) if spec.startswith("hybrid") else None,
        )
        (sim,) = run_cell(cell, [trace])
        groups.setdefault((str(run["mode"]), cell.rtt_ms), []).append((run, sim))
    out = []
    for (mode, rtt), pairs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        row: dict[str, Any] = {
            "mode": mode,
            "mode_spec": REALTIME_MODES[mode],
            "rtt_ms": rtt,
            "runs": len(pairs),
        }
        for key, suffix in (
            ("tokens_per_s", ""),
            ("decode_tokens_per_s", "_decode"),
            ("ttft_s", "_ttft"),
        ):
            both = [(float(r[key]), float(getattr(s, key))) for r, s in pairs if r.get(key)]
            measured, simulated = [m for m, _ in both], [s for _, s in both]
            row[f"measured_{key}"] = mean(measured) if both else None
            row[f"sim_{key}"] = mean(simulated) if both else None
            row[f"sim_over_measured{suffix}"] = stats.ratio(simulated, measured) if both else None
            row[f"sim_over_measured{suffix}_ci"] = (
                stats.ratio_ci(simulated, measured, n=resamples) if both else None
            )
        out.append(row)
    return out


# ------------------------------------------------------------------------------------ main


def regime(traces: TraceSet, cpu_cost: float) -> dict[str, Any]:
    costs = Costs()
    return {
        "name": "picospec",
        "draft_s": costs.draft_s,
        "verify_s": costs.verify_s,
        "ar_s": costs.ar_s,
        "timings_source": "PicoSpec's Llama 3.2 1B (edge draft, Jetson) / Llama 70B (verify, "
        "autoregressive step) timings: draft step 24 ms, verify of 1 + γ = 5 tokens 166 ms, "
        "autoregressive step 146 ms (bench.studies.realtime's picospec regime)",
        "forward_cost": Costs.FORWARD_RULE,
        "token_cost_k": TREE_TOKEN_COST,
        "token_cost_source": f"{SOURCE}: 1 × 5 tokens {VERIFY_EAGER_B1_MS} ms against 8 × 5 "
        f"tokens {VERIFY_EAGER_B8_MS} ms",
        "cloud_draft_costs": list(CLOUD_DRAFT_COSTS),
        "cloud_draft_cost_measured": CLOUD_DRAFT_PER_VERIFY,
        "cloud_draft_cost_source": f"the cloud draft step in verifies; {CLOUD_DRAFT_PER_VERIFY:.4f}"
        f" = draft step / verify, compiled, from {SOURCE}; 0.05 and 0.2 bracket it",
        "edge_batch_costs": [DRAFT_BATCH_COST, cpu_cost],
        "edge_batch_cost_sources": {
            "gpu_class": f"{DRAFT_BATCH_COST:.4f}: {SOURCE}",
            "this_cpu": f"{cpu_cost:.4f}: batch_cost_per_extra_branch of {DRAFT_BATCH_FILE}",
        },
        "bandwidth_bps": BANDWIDTH_BPS,
        "target": traces.target,
        "draft": traces.draft,
        "traces_provenance": traces.provenance,
    }


def table(summary: Sequence[dict[str, Any]], tokens: int) -> str:
    """A compact text table at the measured cloud draft cost and the GPU-class batch cost."""
    rows = [
        r
        for r in summary
        if r["cloud_draft_cost"] == CLOUD_DRAFT_PER_VERIFY
        and r["edge_batch_cost"] == DRAFT_BATCH_COST
        and r["reply_tokens"] == tokens
    ]
    lines = [
        f"{tokens}-token replies (c = {CLOUD_DRAFT_PER_VERIFY:.3f}, b = {DRAFT_BATCH_COST:.4f})",
        f"{'rtt':>5} {'mode':<28} {'tok/s':>6} {'x ar':>17} {'x cloud-sd':>17} {'ttft':>6}",
    ]
    for r in rows:
        lo, hi = r["speedup_vs_ar_ci"]
        clo, chi = r["speedup_vs_cloud_sd_ci"]
        mode = r["mode"] if r["role"] != "best edge" else f"best edge ({r['mode_spec']})"
        lines.append(
            f"{r['rtt_ms']:>5g} {mode:<28.28} {r['tokens_per_s']:>6.2f} "
            f"{r['speedup_vs_ar']:>5.2f} [{lo:.2f},{hi:.2f}] "
            f"{r['speedup_vs_cloud_sd']:>5.2f} [{clo:.2f},{chi:.2f}] {r['ttft_s']:>6.3f}"
        )
    return "\n".join(lines)


def read_capacity(path: Path | None) -> dict[str, Any] | None:
    """A capacity study's results (None: no such file), with ``source_file`` its path."""
    if path is None or not path.exists():
        return None
    doc: dict[str, Any] = json.loads(path.read_text())
    doc["source_file"] = str(path)
    return doc


def build(
    traces_path: Path,
    *,
    settings: Settings,
    workers: int,
    validation_path: Path | None = None,
    capacity_path: Path | None = None,
    roofline_path: Path | None = None,
) -> dict[str, Any]:
    traces = load_traces(traces_path)
    if not traces.measured() or not traces.tuning():
        raise SystemExit(f"{traces_path}: needs both measured and tuning traces")
    cpu_cost = cpu_draft_batch_cost()
    capacity, roofline = read_capacity(capacity_path), read_capacity(roofline_path)
    with Runner(traces_path, traces, workers) as runner:
        grid = Grid(runner, settings, cpu_cost)
        choices = grid.choose()
        summary = grid.summary(choices, traces.draft)
        doc: dict[str, Any] = {
            "regime": regime(traces, cpu_cost),
            "settings": {
                **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()},
                "cloud_drafts": [k.value for k in CLOUD_DRAFTS],
                "predraft_modes_at_cpu_cost": list(PREDRAFT_MODES),
                "measured_prompts": len(traces.measured()),
                "tuning_prompts": len(traces.tuning()),
                "users_per_simulation": 1,
                "workers": workers,
                "traces": str(traces_path),
                "capacity": str(capacity_path) if capacity else None,
                "capacity_roofline": str(roofline_path) if roofline else None,
            },
            "tuning": grid.tuning,
            "summary": summary,
            "categories": categories(grid, choices, traces.draft),
            "targets": targets(grid, summary, choices, capacity, roofline),
        }
        if validation_path is not None:
            doc["validation"] = validation(
                runner, traces, json.loads(validation_path.read_text()), settings.resamples
            )
    doc["provenance"] = provenance()
    return doc


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = study_parser("grid", __doc__)
    add_traces(p)
    p.add_argument("--out", type=Path, required=True, help="folder for results.json")
    p.add_argument("--validation", type=Path, default=None, help="a real-time run's results.json")
    p.add_argument(
        "--capacity",
        type=Path,
        default=REPO / CAPACITY_FILE,
        help="capacity.json whose headline the users-per-verifier targets read",
    )
    p.add_argument(
        "--capacity-roofline",
        type=Path,
        default=REPO / ROOFLINE_FILE,
        help="the capacity study under the roofline cost model (the same targets)",
    )
    p.add_argument("--workers", type=int, default=2, help="simulation processes (>= 1)")
    p.add_argument("--smoke", action="store_true", help="3 RTTs, 8/16-token replies, γ 2 and 4")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    settings = SMOKE if args.smoke else Settings()
    doc = build(
        args.traces,
        settings=settings,
        workers=args.workers,
        validation_path=args.validation,
        capacity_path=args.capacity,
        roofline_path=args.capacity_roofline,
    )
    doc["settings"]["smoke"] = args.smoke
    doc["settings"]["elapsed_s"] = round(time.monotonic() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    for tokens in settings.reply_tokens:
        print(table(doc["summary"], tokens))
    for t in doc["targets"]:
        ci = "" if t["ci"] is None else f" [{t['ci'][0]:.3f}, {t['ci'][1]:.3f}]"
        m = "n/a" if t["measured"] is None else f"{t['measured']:.3f}"
        print(f"target {t['name']}: {m}{ci} >= {t['threshold']}: {t['met']}")
    print(f"wrote {args.out / 'results.json'} in {doc['settings']['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
