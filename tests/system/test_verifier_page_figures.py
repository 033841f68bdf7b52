"""The figures docs/benchmarks/verifier.md quotes are those of the results files it cites."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson

from bench.lib import costs

REPO = Path(__file__).resolve().parents[2]


def _load(rel: str) -> Any:
    return orjson.loads((REPO / rel).read_bytes())


def test_the_verifier_pages_figures_come_from_the_files_it_cites() -> None:
    page = " ".join((REPO / "docs" / "benchmarks" / "verifier.md").read_text().split())
    bench = _load("docs/results/bench/results.json")
    # the per-token α (accepted / judged) of auto's 256-token rows at the measured cloud draft
    # cost and the GPU-class batch cost, every RTT (the grid's summary, bench.studies.grid)
    auto = [
        r["alpha_per_token"]
        for r in bench["summary"]
        if r["mode"] == "auto"
        and r.get("reply_tokens") == 256
        and math.isclose(r.get("cloud_draft_cost", -1), costs.CLOUD_DRAFT_PER_VERIFY, rel_tol=1e-6)
        and math.isclose(r.get("edge_batch_cost", -1), costs.DRAFT_BATCH_COST, rel_tol=1e-6)
    ]
    assert auto, "no auto rows of 256 tokens at c = CLOUD_DRAFT_PER_VERIFY in results.json"
    assert f"(α = {min(auto):.3f}–{max(auto):.3f}, `alpha_per_token` of the 256-token rows" in page
    cloud = _load("docs/results/verifier_load_cloud.json")
    for i, n in enumerate(cloud["sessions"]):
        row = (
            f"| {n} | {cloud['batched_tokens_per_s'][i]:.0f} "
            f"| {cloud['cloud-sd_tokens_per_s'][i]:.0f} "
            f"({100 * cloud['cloud-sd_cloud_share'][i]:.0f} %) "
            f"| {cloud['cloud-sd-fixed_tokens_per_s'][i]:.0f} "
            f"({100 * cloud['cloud-sd-fixed_cloud_share'][i]:.0f} %) |"
        )
        assert row in page, row
    auto64, fixed64 = cloud["cloud-sd_tokens_per_s"][-1], cloud["cloud-sd-fixed_tokens_per_s"][-1]
    assert f"{auto64 / fixed64:.1f}× the text of fixed" in page
    c = costs.CLOUD_DRAFT_PER_VERIFY
    assert f"c ≈ {c:.2f} ({costs.DRAFT_STEP_COMPILED_MS} / {costs.VERIFY_COMPILED_B1_MS} ms" in page
    draft = _load("docs/results/draft_batch.json")["median_step_s"]["1"]
    verify = _load("docs/results/tree_cost.json")["median_forward_s"]["0"]
    assert f"({1000 * draft:.0f} ms against {1000 * verify:.0f} ms" in page
    # Leviathan et al.'s expected speed-up (1 − α^(γ+1)) / ((1 − α)(γ c + 1)) at either end of
    # the per-token acceptance range: best at γ = 9, γ = 6–13 within 5 % of it
    for a in (min(auto), max(auto)):
        gain = {g: (1 - a ** (g + 1)) / ((1 - a) * (g * c + 1)) for g in range(1, 21)}
        assert max(gain, key=gain.__getitem__) == 9
        assert all(gain[g] >= 0.95 * gain[9] for g in range(6, 14))
    assert "highest at γ = 9, and γ = 6–13 are within 5 % of it" in page
    gpu = _load("docs/results/gpu_costs.json")["measured"]
    assert f"({gpu['verify_eager_b8_ms']} ms vs {gpu['verify_eager_b1_ms']} ms for" in page
