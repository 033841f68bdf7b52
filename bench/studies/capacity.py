"""Edges per verifier: N users sharing one verifier GPU, simulated from acceptance traces.

    python -m bench capacity --traces docs/results/bench/traces.json.gz \\
        --out docs/results/capacity.json
    python -m bench capacity --traces docs/results/bench/traces.json.gz \\
        --out docs/results/capacity_roofline.json --roofline
    python -m bench capacity --traces T --out /tmp/capacity.json --smoke

RTT 100 ms, 10 Mbit/s, 256-token replies, the measured prompts. N = 1, 4, 16, 64 users each send
4 requests one after another (user u starts at prompt u mod P, then the next ones); the users'
first requests start spread uniformly (seeded) over one ``ar`` reply time. Modes: ``ar``
(continuous batching), the best cloud-sd (the grid's choice at RTT 100, 256 tokens and the
measured cloud draft cost; tuned here as the grid does when no grid file is given), ``auto``,
``auto:predraft``, ``hybrid`` and ``hybrid:predraft`` (with the best cloud-sd's draft kind and γ).
Under load the best cloud-sd is searched again among :data:`CLOUD_CANDIDATES`: the one serving
the most users at the headline level stands as "best cloud-sd" in the rows, and at each service
level the users counted are those of the candidate serving the most there (the grid's choice,
fastest for one user, is among them).

Per mode and N: per-user tokens/s over all replies (median, 10th percentile), TTFT p99, goodput
(tokens over the span), verifier busy time per 100 tokens and utilisation. Per mode and service
level (``SLOS``), the most users one verifier serves at it: doubling from 1, then bisection, up
to :data:`MAX_USERS`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.lib.cells import (
    AR,
    BANDWIDTH_BPS,
    Cell,
    Runner,
    Tuner,
    cloud_spec,
    mean,
    mode_of,
    run_cell,
)
from bench.lib.cli import add_traces, study_parser
from bench.lib.costs import (
    CLOUD_DRAFT_PER_VERIFY,
    DRAFT_BATCH_COST,
    H200_HBM_TBPS,
    H200_PEAK_BF16_TFLOPS,
    ROOFLINE_FLOOR_MS,
    ROOFLINE_OVERHEAD_MS,
    ROOFLINE_PER_TOKEN_MS,
    ROOFLINE_RULE,
    SOURCE,
    TARGET_PARAMS,
    TREE_TOKEN_COST,
    VERIFY_EAGER_B1_MS,
    VERIFY_EAGER_B8_MS,
)
from bench.lib.prompts import Split
from bench.lib.sim import CloudDraftKind, Costs, Link, simulate
from bench.lib.traces import load_traces
from bench.lib.users import MAX_USERS, RESOLUTION, Plan, batch_limits, figures, users
from testkit.provenance import provenance

EDGE_MODES = ("auto", "auto:predraft", "hybrid", "hybrid:predraft")
#: The service levels users are counted at.
SLOS: tuple[dict[str, Any], ...] = (
    {"name": "reading", "min_tokens_per_s_p10": 5.0, "max_ttft_p99_s": 1.5},
    {"name": "fast", "min_tokens_per_s_p10": 10.0, "max_ttft_p99_s": 1.5},
)
HEADLINE_SLO = "reading"
#: Deadline for one mode's rows and searches in a worker.
MODE_TIMEOUT_S = 3600.0


SMOKE = Plan(
    tokens=16,
    edges=(1, 2, 4),
    requests_per_user=2,
    max_users=16,
    resolution=0,
    cloud_candidates=((CloudDraftKind.MODEL, 2), (CloudDraftKind.MIXED, 4)),
)


def largest_meeting(ok: Callable[[int], bool], limit: int = MAX_USERS, resolution: int = 0) -> int:
    """The largest N in [1, limit] with ``ok(N)``, for a predicate that holds up to some N and
    fails beyond it: 0 when ``ok(1)`` fails; doubling from 1, then bisection between the last
    N that held and the first that failed. With ``resolution`` r > 0 the bisection stops once
    that bracket is at most max(1, N // r) wide (the answer is then within 1/r below the
    exact one); 0: exact."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if resolution < 0:
        raise ValueError(f"resolution must be >= 0, got {resolution}")
    if not ok(1):
        return 0
    good, bad = 1, None
    while good < limit:
        n = min(2 * good, limit)
        if not ok(n):
            bad = n
            break
        good = n
    if bad is None:
        return good
    while bad - good > (max(1, good // resolution) if resolution else 1):
        mid = (good + bad) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good


def meets(fig: dict[str, float], slo: dict[str, Any]) -> bool:
    return bool(
        fig["per_user_tokens_per_s_p10"] >= slo["min_tokens_per_s_p10"]
        and fig["ttft_p99_s"] <= slo["max_ttft_p99_s"]
    )


@dataclass(frozen=True)
class ModeJob:
    name: str  # the row's mode
    cell: Cell  # the mode, costs and RTT (split and tokens as the plan's)
    spread_s: float
    plan: Plan
    traces_path: str


def run_mode(job: ModeJob) -> dict[str, Any]:
    """One mode's rows at the plan's N and its users at each service level."""
    traces = load_traces(job.traces_path).measured()
    mode, cell = mode_of(job.cell), job.cell
    costs = Costs(
        token_cost=TREE_TOKEN_COST,
        cloud_draft_per_verify=cell.cloud_draft_cost,
        draft_batch_cost=cell.edge_batch_cost,
        roofline=job.plan.roofline,
    )
    link = Link(rtt_s=cell.rtt_ms / 1000.0, bandwidth_bps=BANDWIDTH_BPS)
    cache: dict[tuple[int, float], dict[str, float]] = {}

    def at(n: int, rate: float) -> dict[str, float]:
        if (n, rate) not in cache:
            result = simulate(
                mode,
                users(traces, n, job.plan),
                costs,
                link,
                start_spread_s=job.spread_s,
                seed=job.plan.seed,
                batch=batch_limits(job.plan),
                service_rate=rate,
            )
            cache[n, rate] = figures(result)
        return cache[n, rate]

    head = service_rate(HEADLINE_SLO)
    rows = [
        {"mode": job.name, "mode_spec": cell.spec, "edges": n, **at(n, head)}
        for n in job.plan.edges
    ]
    found = {}
    for slo in SLOS:

        def ok(n: int, slo: dict[str, Any] = slo) -> bool:
            return meets(at(n, service_rate(slo["name"])), slo)

        found[slo["name"]] = largest_meeting(ok, job.plan.max_users, job.plan.resolution)
    simulated = {str(r): sorted(n for n, rr in cache if rr == r) for r in {r for _, r in cache}}
    return {"rows": rows, "users_at_slo": found, "simulated_n": simulated}


def service_rate(level: str) -> float:
    """The verifier's ``service_rate`` when its operator runs for ``level``: the level's
    per-user rate (an operator who promises 10 tokens/s tells the verifier so), for every
    mode alike."""
    return float(next(s for s in SLOS if s["name"] == level)["min_tokens_per_s_p10"])


def best_cloud_from_grid(path: Path, plan: Plan) -> tuple[str, int] | None:
    """The grid's best cloud-sd (kind, γ) at the plan's RTT and length and the measured cloud
    draft cost; None when the file has no such row."""
    if not path.exists():
        return None
    for row in json.loads(path.read_text()).get("summary", []):
        if (
            row.get("role") == "best cloud-sd"
            and row.get("rtt_ms") == plan.rtt_ms
            and row.get("reply_tokens") == plan.tokens
            and row.get("cloud_draft_cost") == CLOUD_DRAFT_PER_VERIFY
        ):
            return str(row["cloud_draft"]), int(row["gamma"])
    return None


def cost_model(roofline: bool = False) -> dict[str, Any]:
    costs = Costs()
    if roofline:
        return {
            "forward_s": ROOFLINE_RULE,
            "verify_s": costs.verify_s,
            "draft_s": costs.draft_s,
            "floor_ms": ROOFLINE_FLOOR_MS,
            "per_token_ms": ROOFLINE_PER_TOKEN_MS,
            "overhead_ms": ROOFLINE_OVERHEAD_MS,
            "published": {
                "gpu": "NVIDIA H200 SXM",
                "bf16_dense_tflops": H200_PEAK_BF16_TFLOPS,
                "hbm_tb_per_s": H200_HBM_TBPS,
                "target_parameters": TARGET_PARAMS,
            },
            "source": f"the GPU's published peaks and {SOURCE}",
            "cloud_draft_per_verify": CLOUD_DRAFT_PER_VERIFY,
            "edge_batch_cost": DRAFT_BATCH_COST,
            "bandwidth_bps": BANDWIDTH_BPS,
        }
    return {
        "forward_s": Costs.FORWARD_RULE,
        "verify_s": costs.verify_s,
        "ar_s": costs.ar_s,
        "draft_s": costs.draft_s,
        "k": TREE_TOKEN_COST,
        "points": [
            {"sessions": 1, "tokens": 5, "ms": VERIFY_EAGER_B1_MS},
            {"sessions": 8, "tokens": 40, "ms": VERIFY_EAGER_B8_MS},
        ],
        "source": SOURCE,
        "extrapolation": "k is the slope between the two H200 points (5 and 40 tokens); larger "
        "batches are extrapolated linearly (no measurement beyond 40 tokens)",
        "cloud_draft_per_verify": CLOUD_DRAFT_PER_VERIFY,
        "edge_batch_cost": DRAFT_BATCH_COST,
        "bandwidth_bps": BANDWIDTH_BPS,
    }


#: Edge modes that need no draft model on the verifier (hybrid does).
NO_CLOUD_MODEL = ("auto", "auto predraft")


def headline(found: dict[str, dict[str, int]], cloud_name: str) -> dict[str, Any]:
    """Users at :data:`HEADLINE_SLO` per mode and the best edge mode's ratios to the best
    cloud-sd and to ar (None when the baseline serves nobody); ``levels``: the same at every
    service level, for the best edge mode and for the best one with no draft model on the
    verifier (:data:`NO_CLOUD_MODEL`)."""

    def at_level(level: str) -> dict[str, Any]:
        at = {mode: v[level] for mode, v in found.items()}
        edge = [m for m in at if m not in (AR, cloud_name)]
        out: dict[str, Any] = {"users": at}
        for key, modes in (("best_edge", edge), ("best_edge_no_cloud_model", NO_CLOUD_MODEL)):
            kept = [m for m in edge if m in modes]
            if not kept:
                continue
            best = max(kept, key=lambda m: (at[m], -kept.index(m)))
            out[f"{key}_mode"] = best
            out[f"{key}_over_best_cloud_sd"] = at[best] / at[cloud_name] if at[cloud_name] else None
            out[f"{key}_over_ar"] = at[best] / at[AR] if at[AR] else None
        return out

    levels = {slo["name"]: at_level(slo["name"]) for slo in SLOS}
    head = levels[HEADLINE_SLO]
    return {
        "slo": HEADLINE_SLO,
        "users": head["users"],
        "best_edge_mode": head["best_edge_mode"],
        "best_edge_over_best_cloud_sd": head["best_edge_over_best_cloud_sd"],
        "best_edge_over_ar": head["best_edge_over_ar"],
        "levels": levels,
    }


def best_per_level(candidates: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """At each service level, the cloud-sd candidate that serves the most users there (ties: the
    first listed, the single-user best): a user picks cloud-sd's γ for the level they need."""
    out: dict[str, dict[str, Any]] = {}
    for slo in SLOS:
        level = str(slo["name"])
        # max keeps the first of equals: the candidates' order breaks ties
        out[level] = max(candidates, key=lambda c: int(c["users_at_slo"][level]))
    return out


def build(traces_path: Path, *, plan: Plan, grid_path: Path | None, workers: int) -> dict[str, Any]:
    traces = load_traces(traces_path)
    measured = traces.measured()
    if not measured:
        raise SystemExit(f"{traces_path}: no measured traces")
    c, b = CLOUD_DRAFT_PER_VERIFY, DRAFT_BATCH_COST
    point = (plan.rtt_ms, plan.tokens, c)
    chosen = best_cloud_from_grid(grid_path, plan) if grid_path else None
    source = f"the grid's choice in {grid_path}"
    if chosen is None:
        with Runner(traces_path, traces, 1) as runner:
            chosen = Tuner(runner).tune_cloud([point])[point]
        source = "tuned here on the tuning prompts, as python -m bench grid does"
    kind, gamma = chosen
    m = Split.MEASURED.value
    ar_cell = Cell(m, AR, plan.rtt_ms, plan.tokens, c, b)
    spread = mean(r.reply_s for r in run_cell(ar_cell, measured))
    cloud_name = "best cloud-sd"
    jobs = [ModeJob(AR, ar_cell, spread, plan, str(traces_path))]
    candidates = list(dict.fromkeys([(CloudDraftKind(kind), gamma), *plan.cloud_candidates]))
    for ck, cg in candidates:
        cell = Cell(m, cloud_spec(ck, cg), plan.rtt_ms, plan.tokens, c, b)
        jobs.append(ModeJob(f"cloud-sd {ck.value} γ={cg}", cell, spread, plan, str(traces_path)))
    for spec in EDGE_MODES:
        cloud = (kind, gamma) if spec.startswith("hybrid") else None
        cell = Cell(m, spec, plan.rtt_ms, plan.tokens, c, b, cloud)
        jobs.append(ModeJob(mode_of(cell).label, cell, spread, plan, str(traces_path)))
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            futures = [pool.submit(run_mode, j) for j in jobs]
            results = [f.result(timeout=MODE_TIMEOUT_S) for f in futures]
    else:
        results = [run_mode(j) for j in jobs]
    # The cloud-sd candidate serving the most users at the headline level (ties: the first,
    # the single-user best) stands as "best cloud-sd" in the rows; the others are listed beside.
    pairs = list(zip(jobs, results, strict=True))
    tried = [(j, r) for j, r in pairs if j.name.startswith("cloud-sd ")]
    others = [{"mode_spec": j.cell.spec, "users_at_slo": r["users_at_slo"]} for j, r in tried]
    per_level = best_per_level(others)
    best_job, best = tried[others.index(per_level[HEADLINE_SLO])]
    for row in best["rows"]:
        row["mode"] = cloud_name
    kept = [(j.name, r) for j, r in pairs if not j.name.startswith("cloud-sd ")]
    kept.insert(1, (cloud_name, best))  # after ar, as the modes are listed
    found = {name: r["users_at_slo"] for name, r in kept}
    # At each level, best cloud-sd is the candidate that serves the most users there (its
    # rows above are the headline level's choice).
    found[cloud_name] = {level: c["users_at_slo"][level] for level, c in per_level.items()}
    return {
        "settings": {
            "rtt_ms": plan.rtt_ms,
            "reply_tokens": plan.tokens,
            "edges": list(plan.edges),
            "requests_per_user": plan.requests_per_user,
            "max_users": plan.max_users,
            "resolution": plan.resolution,
            "search": "doubling from 1, then bisection until the bracket is within "
            "1/resolution of the users found (0: exact); the users found meet the level",
            "seed": plan.seed,
            "start_spread_s": spread,
            "start_spread": "first requests start uniformly over one ar reply time (the mean "
            "ar reply of the measured prompts alone)",
            "prompts": len(measured),
            "traces": str(traces_path),
            "target": traces.target,
            "draft": traces.draft,
            "workers": workers,
            "verifier": {
                **{k: v for k, v in asdict(batch_limits(plan)).items() if k != "max_sessions"},
                "max_sessions": "unbounded (every user's row fits a step)",
                "ration": "on" if batch_limits(plan).ration else "off",
                "service_rate": {slo["name"]: service_rate(slo["name"]) for slo in SLOS},
                "service_rate_rule": "each level's users are counted on a verifier told that "
                f"level's rate (service_rate); the rows at N are at {HEADLINE_SLO!r}'s",
            },
        },
        "best_cloud_sd": {
            "mode_spec": best_job.cell.spec,
            "chosen_by": f"the most users at {HEADLINE_SLO!r} of the candidates (measured prompts)",
            "per_level": {level: c["mode_spec"] for level, c in per_level.items()},
            "fastest_alone": {"cloud_draft": kind, "gamma": gamma, "source": source},
            "candidates": others,
        },
        "cost_model": cost_model(plan.roofline),
        "slos": list(SLOS),
        "rows": [row for _, r in kept for row in r["rows"]],
        "users_at_slo": found,
        "simulated_n": {name: r["simulated_n"] for name, r in kept},
        "headline": headline(found, cloud_name),
        "provenance": provenance(),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = study_parser("capacity", __doc__)
    add_traces(p)
    p.add_argument("--out", type=Path, required=True, help="the capacity.json to write")
    p.add_argument("--grid", type=Path, default=None, help="the grid study's results.json")
    p.add_argument("--workers", type=int, default=2, help="simulation processes (>= 1)")
    p.add_argument("--max-users", type=int, default=MAX_USERS, help="the search's limit")
    p.add_argument(
        "--resolution", type=int, default=RESOLUTION, help="search to within 1/R (0: exact)"
    )
    p.add_argument("--smoke", action="store_true", help="16-token replies, N 1, 2, 4, up to 16")
    p.add_argument(
        "--roofline",
        action="store_true",
        help="forwards cost max(memory floor, tokens x compute) + overhead (bench.lib.costs)",
    )
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be >= 1")
    if args.max_users < 1 or args.resolution < 0:
        p.error("--max-users must be >= 1 and --resolution >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    plan = SMOKE if args.smoke else Plan(max_users=args.max_users, resolution=args.resolution)
    plan = replace(plan, roofline=args.roofline)
    doc = build(args.traces, plan=plan, grid_path=args.grid, workers=args.workers)
    doc["settings"]["smoke"] = args.smoke
    doc["settings"]["elapsed_s"] = round(time.monotonic() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'mode':<24} {'N':>4} {'p50 tok/s':>9} {'p10':>6} {'ttft99':>7} {'goodput':>8}")
    for r in doc["rows"]:
        print(
            f"{r['mode']:<24.24} {r['edges']:>4} {r['per_user_tokens_per_s_p50']:>9.2f} "
            f"{r['per_user_tokens_per_s_p10']:>6.2f} {r['ttft_p99_s']:>7.3f} "
            f"{r['goodput_tokens_per_s']:>8.1f}"
        )
    for mode, found in doc["users_at_slo"].items():
        print(f"users at service level, {mode}: {found}")
    h = doc["headline"]
    print(
        f"headline ({h['slo']}): best edge {h['best_edge_mode']}, "
        f"x best cloud-sd {h['best_edge_over_best_cloud_sd']}, x ar {h['best_edge_over_ar']}"
    )
    print(f"wrote {args.out} in {doc['settings']['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
