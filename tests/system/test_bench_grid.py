"""bench.lib.stats (paired bootstrap), bench.studies.grid (the users' grid) and
bench.studies.capacity (edges per verifier) on small synthetic traces."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from bench.lib import cells, stats, users
from bench.lib.prompts import DATASETS, Split
from bench.lib.traces import Trace, TraceSet, load_traces, save_traces
from bench.studies import capacity, grid

# ------------------------------------------------------------------------------------ stats


def test_ratio_ci_holds_the_point_estimate() -> None:
    rng = np.random.default_rng(1)
    den = rng.uniform(5, 15, 30)
    num = den * rng.uniform(1.2, 2.0, 30)
    point = stats.ratio(num, den)
    low, high = stats.ratio_ci(num, den)
    assert low < point < high
    assert low > 1.2 and high < 2.0


def test_paired_ratio_of_a_constant_per_prompt_ratio_is_exact() -> None:
    # Prompts differ wildly (0.1 to 1000 tok/s) but the mode is exactly 2x on each one.
    den = np.array([0.1, 1000.0, 3.0, 250.0, 7.5, 0.9, 60.0, 12.0, 400.0, 2.2])
    num = 2.0 * den
    low, high = stats.ratio_ci(num, den)
    assert abs(low - 2.0) < 1e-9 and abs(high - 2.0) < 1e-9
    # Resampling each side on its own ignores the pairing: the same data looks very uncertain.
    ulow, uhigh = stats.ratio_ci(num, den, paired=False)
    assert ulow < 1.0 and uhigh > 4.0


def test_intervals_are_deterministic_for_a_seed() -> None:
    rng = np.random.default_rng(2)
    a, b = rng.uniform(1, 10, 12), rng.uniform(1, 10, 12)
    assert stats.ratio_ci(a, b, seed=3) == stats.ratio_ci(a, b, seed=3)
    assert stats.ratio_ci(a, b, seed=3) != stats.ratio_ci(a, b, seed=4)
    assert stats.mean_ci(a, seed=5) == stats.mean_ci(a, seed=5)


def test_mean_ci_and_percentile() -> None:
    x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    low, high = stats.mean_ci(x)
    assert 1.0 <= low < 4.5 < high <= 8.0
    assert stats.mean_ci([3.0, 3.0, 3.0]) == [3.0, 3.0]
    assert stats.percentile(x, 50) == 4.5
    assert stats.percentile(x, 0) == 1.0 and stats.percentile(x, 100) == 8.0
    assert stats.percentile([0.0, 10.0], 10) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "call",
    [
        lambda: stats.ratio_ci([1.0, 2.0], [1.0]),
        lambda: stats.ratio_ci([], []),
        lambda: stats.ratio([1.0], [1.0, 2.0]),
        lambda: stats.ratio_ci([1.0], [0.0]),
        lambda: stats.ratio_ci([1.0, float("nan")], [1.0, 1.0]),
        lambda: stats.ratio_ci([1.0], [1.0], level=1.0),
        lambda: stats.ratio_ci([1.0], [1.0], n=0),
        lambda: stats.mean_ci([]),
        lambda: stats.percentile([], 50),
        lambda: stats.percentile([1.0], 101),
    ],
)
def test_bad_input_is_refused(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        call()


def test_ttft_uses_the_one_copy_of_the_median_helpers() -> None:
    from bench.studies import ttft

    assert ttft.bootstrap_median is stats.bootstrap_median
    assert ttft.bootstrap_ratio is stats.bootstrap_ratio
    assert ttft.bootstrap_diff is stats.bootstrap_diff
    rng = np.random.default_rng(0)
    med, low, high = stats.bootstrap_median([1.0, 2.0, 3.0, 4.0, 100.0], rng)
    assert med == 3.0 and low <= med <= high
    r, rl, rh = stats.bootstrap_ratio([4.0, 4.0, 4.0], [2.0, 2.0, 2.0], rng)
    assert (r, rl, rh) == (2.0, 2.0, 2.0)
    d, dl, dh = stats.bootstrap_diff([5.0, 6.0, 7.0], [1.0, 2.0, 3.0], rng)
    assert d == 4.0 and dl <= d <= dh


# ------------------------------------------------------------------------- synthetic traces


def synthetic_trace(
    name: str, split: Split, alpha: float, rng: np.random.Generator, length: int = 24
) -> Trace:
    """A trace whose draft's argmax is the target's token with probability ``alpha`` (else the
    target's token is second)."""
    prompt = tuple(int(x) for x in rng.integers(10, 1000, 12))
    path = tuple(int(x) for x in rng.integers(10, 1000, length))
    top, top_p = [], []
    for t in path:
        others = [int(x) for x in rng.choice(np.arange(1000, 2000), 7, replace=False)]
        row = [t, *others] if rng.random() < alpha else [others[0], t, *others[1:]]
        top.append(tuple(row))
        top_p.append((0.6, 0.2, 0.1, 0.04, 0.03, 0.02, 0.005, 0.005))
    dataset = name.split("/")[0]
    return Trace(name, dataset, split, prompt, path, False, tuple(top), tuple(top_p))


def write_traces(
    path: Path,
    *,
    measured: int = 2,
    tuning: int = 1,
    alpha_measured: float = 0.8,
    alpha_tuning: float = 0.8,
    length: int = 24,
) -> Path:
    """``measured`` and ``tuning`` traces of every dataset in a trace file."""
    rng = np.random.default_rng(0)
    traces = []
    for d in DATASETS:
        for i in range(measured):
            traces.append(synthetic_trace(f"{d}/{i}", Split.MEASURED, alpha_measured, rng, length))
        for i in range(measured, measured + tuning):
            traces.append(synthetic_trace(f"{d}/{i}", Split.TUNING, alpha_tuning, rng, length))
    save_traces(path, TraceSet("target", "draft", length, 8, {}, tuple(traces)))
    return path


def brackets(value: float | None, ci: list[float] | None) -> bool:
    assert value is not None and ci is not None
    return ci[0] - 1e-9 <= value <= ci[1] + 1e-9


# ---------------------------------------------------------------------------------- grid

SUMMARY_KEYS = {
    "regime",
    "draft",
    "rtt_ms",
    "mode",
    "mode_spec",
    "reply_tokens",
    "tokens_mean",
    "prompts",
    "tokens_per_s",
    "decode_tokens_per_s",
    "ttft_s",
    "ttft_p50_s",
    "reply_s",
    "speedup_vs_ar",
    "speedup_vs_ar_ci",
    "speedup_vs_cloud_sd",
    "speedup_vs_cloud_sd_ci",
    "decode_speedup_vs_ar",
    "decode_speedup_vs_ar_ci",
    "verifier_busy_s_per_100_tokens",
    "draft_acceptance",
    "alpha_per_token",
    "mean_accepted_per_round",
    "cloud_draft_acceptance",
    "uplink_bytes_per_round",
    "branch_bytes_per_round",
    "branch_cloud_s_per_100_tokens",
    "downlink_bytes_per_rejection",
    "predraft_hit_rate",
    "predraft_miss_alternative",
    "predraft_miss_none",
    "cloud_draft",
    "gamma",
    "cloud_draft_cost",
    "edge_batch_cost",
    "best_of",
    "role",
}


def test_grid_smoke_writes_every_key(tmp_path: Path) -> None:
    traces = write_traces(tmp_path / "traces.json.gz")
    out = tmp_path / "grid"
    none = str(tmp_path / "none.json")  # no capacity study: the grid's own targets only
    argv = ["--traces", str(traces), "--out", str(out), "--smoke", "--workers", "1"]
    assert grid.main([*argv, "--capacity", none, "--capacity-roofline", none]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert set(doc) == {
        "regime",
        "settings",
        "tuning",
        "summary",
        "categories",
        "targets",
        "provenance",
    }
    s = grid.SMOKE
    points = len(s.rtts_ms) * len(s.reply_tokens) * len(s.cloud_draft_costs)
    # ar, best cloud-sd, cloud decoding, the edge modes, the pre-draft modes at the CPU cost,
    # best edge.
    assert len(doc["summary"]) == points * (3 + len(s.edge_modes) + 2 + 1)
    decoding = [r for r in doc["summary"] if r["role"] == "cloud decoding"]
    assert {r["mode_spec"] for r in decoding} == {grid.CLOUD_DECODING}
    for row in doc["summary"]:
        assert set(row) == SUMMARY_KEYS
        assert row["prompts"] == 2 * len(DATASETS)
        for key in ("speedup_vs_ar", "speedup_vs_cloud_sd", "decode_speedup_vs_ar"):
            assert brackets(row[key], row[f"{key}_ci"]), (key, row)
        if row["role"] == "ar":
            assert row["speedup_vs_ar_ci"] == [1.0, 1.0]
        if row["role"] == "best cloud-sd":
            assert row["cloud_draft"] in ("model", "mixed") and row["gamma"] in s.gammas
            assert row["speedup_vs_cloud_sd_ci"] == [1.0, 1.0]
            assert row["uplink_bytes_per_round"] is None  # no Propose in cloud-sd
        if row["role"] == "best edge":
            assert row["best_of"] == list(s.edge_modes) and row["mode_spec"] in s.edge_modes
        if row["mode_spec"] in grid.PREDRAFT_MODES:
            assert row["predraft_hit_rate"] is not None
            # branches ride the uplink and would cost a cloud drafter its draft steps
            assert 0 < row["branch_bytes_per_round"] < row["uplink_bytes_per_round"]
            assert row["branch_cloud_s_per_100_tokens"] > 0
        elif row["uplink_bytes_per_round"] is not None:
            assert row["branch_cloud_s_per_100_tokens"] is None
    costs = {r["edge_batch_cost"] for r in doc["summary"] if r["mode_spec"] == "auto:predraft"}
    assert costs == {grid.DRAFT_BATCH_COST, cells.cpu_draft_batch_cost()}
    tuned = [t for t in doc["tuning"] if t["family"] == "cloud-sd"]
    assert len(tuned) == points * 2 * len(s.gammas)
    assert all(t["prompts"] == len(DATASETS) for t in doc["tuning"])
    assert {c["dataset"] for c in doc["categories"]} == set(DATASETS)
    for c in doc["categories"]:
        assert brackets(c["speedup_vs_ar"], c["speedup_vs_ar_ci"])
        assert c["edge_batch_cost"] == grid.DRAFT_BATCH_COST
    for d in DATASETS:
        best, hybrid = (c for c in doc["categories"] if c["dataset"] == d and c["rtt_ms"] == 100.0)
        assert (best["mode"], hybrid["mode_spec"]) == ("best edge", "hybrid:predraft")
        if best["mode_spec"] == "hybrid:predraft":  # the same simulation: the same figures
            assert best["tokens_per_s"] == hybrid["tokens_per_s"]
        assert {"alpha_per_token", "mean_accepted_per_round", "speedup_vs_cloud_sd_ci"} <= set(c)
    names = [t["name"] for t in doc["targets"]]
    # per RTT up to 200 ms: the default edge against best cloud-sd, its point estimate and its
    # interval's low end; at RTT 100, the rejections that found a branch ready (no capacity
    # file: no users-per-verifier targets)
    rtts = [r for r in s.rtts_ms if r <= 200]
    assert len(names) == len(set(names)) == 2 * len(rtts) + (100.0 in rtts)
    for t in doc["targets"]:
        assert {"name", "measured", "ci", "threshold", "met"} <= set(t)
        if t["ci"] is not None:
            assert brackets(t["measured"], t["ci"])
            assert t["met"] == (t["ci"][0] >= t["threshold"])
    assert {"commit", "date", "machine"} <= set(doc["provenance"])
    assert {"token_cost_source", "cloud_draft_cost_source", "edge_batch_cost_sources"} <= set(
        doc["regime"]
    )


def test_best_cloud_sd_is_chosen_on_the_tuning_prompts_only(tmp_path: Path) -> None:
    # Tuning prompts: the draft is always right (long cloud drafts pay); measured prompts: it
    # is mostly wrong (short ones do). The choice must follow the tuning prompts.
    path = write_traces(
        tmp_path / "t.json.gz", measured=1, tuning=1, alpha_measured=0.2, alpha_tuning=1.0
    )
    traces = load_traces(path)
    settings = grid.Settings(
        rtts_ms=(100.0,), reply_tokens=(24,), cloud_draft_costs=(0.05,), gammas=(2, 8)
    )
    point = (100.0, 24, 0.05)
    with cells.Runner(path, traces, 1) as runner:
        g = grid.Grid(runner, settings, 0.2)
        kind, gamma = g.tune_cloud([point])[point]

        def score(split: Split, k: str, gm: int) -> float:
            cell = g.cell(split, f"cloud-sd:{k}:{gm}", *point)
            return cells.mean(r.tokens_per_s for r in runner.get(cell))

        configs = [(k, gm) for k in ("model", "mixed") for gm in settings.gammas]
        on_tuning = max(configs, key=lambda kg: score(Split.TUNING, *kg))
        on_measured = max(configs, key=lambda kg: score(Split.MEASURED, *kg))
    assert (kind, gamma) == on_tuning
    assert on_measured != on_tuning  # the two sets favour different configs
    rows = [t for t in g.tuning if t["chosen"]]
    assert len(rows) == 1 and rows[0]["mode_spec"] == f"cloud-sd:{kind}:{gamma}"


def test_validation_compares_the_same_prompts(tmp_path: Path) -> None:
    path = write_traces(tmp_path / "t.json.gz", measured=2, tuning=1)
    traces = load_traces(path)
    runs = []
    for mode, spec in (("ar", "ar"), ("auto predraft", "auto:predraft"), ("cloud-sd", None)):
        for i in range(2):
            cell = cells.Cell(
                "measured",
                spec or "cloud-sd:mixed:4",
                100.0,
                16,
                grid.CLOUD_DRAFT_PER_VERIFY,
                grid.DRAFT_BATCH_COST,
            )
            (sim,) = cells.run_cell(cell, [traces.by_name(f"chat/{i}")])
            # The "real" run is exactly twice as fast as the simulation.
            runs.append(
                {
                    "prompt": i,
                    "dataset": "chat",
                    "mode": mode,
                    "mode_spec": spec,
                    "rtt_ms": 100.0,
                    "tokens": 16,
                    "tokens_per_s": 2 * sim.tokens_per_s,
                    "decode_tokens_per_s": 2 * sim.decode_tokens_per_s,
                    "ttft_s": sim.ttft_s / 2,
                }
            )
    runs.append({**runs[0], "mode": "something else"})  # not simulated: left out
    runs.append({**runs[0], "draft": "oracle:alpha=0.9"})  # not the traces' draft: left out
    runs.append({**runs[0], "regime": "raw"})  # not the emulated regime: left out
    with cells.Runner(path, traces, 1) as runner:
        rows = grid.validation(runner, traces, {"runs": runs}, 200)
    assert [(r["mode"], r["runs"]) for r in rows] == [
        ("ar", 2),
        ("auto predraft", 2),
        ("cloud-sd", 2),
    ]
    for r in rows:
        assert r["sim_over_measured"] == pytest.approx(0.5)
        assert r["sim_over_measured_ci"] == pytest.approx([0.5, 0.5])
        assert r["sim_over_measured_decode"] == pytest.approx(0.5)
        assert r["sim_over_measured_ttft"] == pytest.approx(2.0)
        assert r["measured_tokens_per_s"] == pytest.approx(2 * r["sim_tokens_per_s"])


# ------------------------------------------------------------------------------ capacity

CAPACITY_ROW_KEYS = {
    "mode",
    "mode_spec",
    "edges",
    "per_user_tokens_per_s_p50",
    "per_user_tokens_per_s_p10",
    "ttft_p99_s",
    "goodput_tokens_per_s",
    "verifier_busy_s_per_100_tokens",
    "verifier_utilisation",
    "replies",
    "p10_over_p50",
    "no_branch_ready",
    "uplink_bytes_per_round",
    "branch_bytes_per_round",
    "branch_cloud_s_per_100_tokens",
}


def test_capacity_smoke_writes_every_key(tmp_path: Path) -> None:
    traces = write_traces(tmp_path / "traces.json.gz")
    out = tmp_path / "capacity.json"
    argv = ["--traces", str(traces), "--out", str(out), "--smoke", "--workers", "1"]
    assert capacity.main(argv) == 0
    doc = json.loads(out.read_text())
    assert set(doc) == {
        "settings",
        "best_cloud_sd",
        "cost_model",
        "slos",
        "rows",
        "users_at_slo",
        "simulated_n",
        "headline",
        "provenance",
    }
    modes = ["ar", "best cloud-sd", "auto", "auto predraft", "hybrid", "hybrid predraft"]
    plan = capacity.SMOKE
    assert [(r["mode"], r["edges"]) for r in doc["rows"]] == [
        (m, n) for m in modes for n in plan.edges
    ]
    for r in doc["rows"]:
        assert set(r) == CAPACITY_ROW_KEYS
        assert r["replies"] == r["edges"] * plan.requests_per_user
        assert r["per_user_tokens_per_s_p10"] <= r["per_user_tokens_per_s_p50"]
        assert 0 < r["verifier_utilisation"] <= 1
    assert [s["name"] for s in doc["slos"]] == ["reading", "fast"]
    assert list(doc["users_at_slo"]) == modes
    for found in doc["users_at_slo"].values():
        assert set(found) == {"reading", "fast"}
        assert all(0 <= n <= plan.max_users for n in found.values())
    h = doc["headline"]
    assert set(h) == {
        "slo",
        "users",
        "best_edge_mode",
        "best_edge_over_best_cloud_sd",
        "best_edge_over_ar",
        "levels",
    }
    assert h["best_edge_mode"] in modes[2:]
    assert set(h["levels"]) == {"reading", "fast"}
    for level in h["levels"].values():
        assert level["best_edge_no_cloud_model_mode"] in ("auto", "auto predraft")
        assert level["best_edge_mode"] in modes[2:]
        assert {"best_edge_no_cloud_model_over_best_cloud_sd", "best_edge_over_ar"} <= set(level)
    # the grid's targets read it: users per verifier at each level (against best cloud-sd;
    # against ar at reading, linear costs), the default's p10 / p50 at N = 1 and the largest N
    doc["source_file"] = str(out)
    cap = grid.targets_from_capacity(doc, None)
    names = [t["name"] for t in cap]
    assert sum("users per verifier" in x for x in names) == 2 + 1
    assert sum("p10 / p50" in x for x in names) == 2
    assert all(t["threshold"] in (1.15, 2.5, 0.85) for t in cap)
    # each level's users were searched on a verifier told that level's rate
    assert doc["settings"]["verifier"]["service_rate"] == {"reading": 5.0, "fast": 10.0}
    for r in doc["rows"]:
        assert 0 <= r["no_branch_ready"] <= 1 and r["p10_over_p50"] <= 1
        if r["mode"] in ("auto predraft", "hybrid predraft"):
            assert r["branch_cloud_s_per_100_tokens"] >= 0
    assert {"forward_s", "points", "extrapolation", "k"} <= set(doc["cost_model"])
    best = doc["best_cloud_sd"]
    assert best["fastest_alone"]["source"].startswith("tuned here")
    # "best cloud-sd" under load is the candidate serving the most users at the headline level
    tried = {c["mode_spec"]: c["users_at_slo"]["reading"] for c in best["candidates"]}
    assert len(tried) >= 2 and best["mode_spec"] in tried
    assert tried[best["mode_spec"]] == max(tried.values()) == h["users"]["best cloud-sd"]
    # at each level, the users of the candidate serving the most there
    for level, spec in best["per_level"].items():
        there = {c["mode_spec"]: c["users_at_slo"][level] for c in best["candidates"]}
        assert there[spec] == max(there.values()) == doc["users_at_slo"]["best cloud-sd"][level]


def test_best_cloud_sd_is_chosen_at_each_level() -> None:
    """A user who needs the fast level picks cloud-sd's γ for it: the table's fast column is not
    the reading level's candidate."""
    cands = [
        {"mode_spec": "cloud-sd:model:2", "users_at_slo": {"reading": 127, "fast": 23}},
        {"mode_spec": "cloud-sd:model:4", "users_at_slo": {"reading": 61, "fast": 26}},
        {"mode_spec": "cloud-sd:mixed:2", "users_at_slo": {"reading": 127, "fast": 3}},
    ]
    best = capacity.best_per_level(cands)
    assert best["reading"]["mode_spec"] == "cloud-sd:model:2"  # ties: the first listed
    assert best["fast"]["mode_spec"] == "cloud-sd:model:4"


def test_capacity_takes_the_grids_choice(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    row = {
        "role": "best cloud-sd",
        "rtt_ms": 100.0,
        "reply_tokens": 256,
        "cloud_draft_cost": grid.CLOUD_DRAFT_PER_VERIFY,
        "cloud_draft": "model",
        "gamma": 6,
    }
    results.write_text(json.dumps({"summary": [{**row, "rtt_ms": 50.0, "gamma": 2}, row]}))
    assert capacity.best_cloud_from_grid(results, users.Plan()) == ("model", 6)
    assert capacity.best_cloud_from_grid(results, capacity.SMOKE) is None
    assert capacity.best_cloud_from_grid(tmp_path / "absent.json", users.Plan()) is None


@pytest.mark.parametrize("k", [0, 1, 2, 3, 37, 64, 1000, 2047, 2048, 5000])
def test_users_at_slo_search_on_a_monotone_fake(k: int) -> None:
    asked: list[int] = []

    def ok(n: int) -> bool:
        asked.append(n)
        return n <= k

    assert capacity.largest_meeting(ok, 2048) == min(k, 2048)
    assert len(asked) <= 2 * 12  # doubling, then bisection: logarithmic
    assert all(1 <= n <= 2048 for n in asked)


@pytest.mark.parametrize("k", [1, 2, 37, 100, 300, 1000, 2047])
def test_users_at_slo_search_to_a_resolution(k: int) -> None:
    asked: list[int] = []

    def ok(n: int) -> bool:
        asked.append(n)
        return n <= k

    found = capacity.largest_meeting(ok, 2048, resolution=8)
    assert found <= k and k - found <= max(1, found // 8)
    assert len(asked) == len(set(asked))  # never asks twice
    with pytest.raises(ValueError):
        capacity.largest_meeting(ok, 0)
