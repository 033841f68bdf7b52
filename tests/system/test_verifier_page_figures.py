"""The figures docs/benchmarks/verifier.md quotes are those of the results files it cites."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from bench import costs

REPO = Path(__file__).resolve().parents[2]


def _load(rel: str) -> Any:
    return orjson.loads((REPO / rel).read_bytes())


def test_the_verifier_pages_figures_come_from_the_files_it_cites() -> None:
    page = " ".join((REPO / "docs" / "benchmarks" / "verifier.md").read_text().split())
    bench = _load("docs/results/bench/results.json")
    auto = [
        r["acceptance"]
        for r in bench["summary"]
        if r["mode"] == "auto" and r.get("draft") == "self:skip=12"
    ]
    assert f"({min(auto):.2f}–{max(auto):.2f} per token, `docs/results/bench/results.json`)" in page
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
    # the acceptance range: best at γ = 3, γ = 2–4 within 4 % of it
    for a in (min(auto), max(auto)):
        gain = {g: (1 - a ** (g + 1)) / ((1 - a) * (g * c + 1)) for g in range(1, 9)}
        assert max(gain, key=gain.__getitem__) == 3
        assert all(gain[g] >= 0.96 * gain[3] for g in (2, 4))
    assert "highest at γ = 3, and γ = 2–4 are within 4 % of it" in page
    gpu = _load("docs/results/gpu_costs.json")["measured"]
    assert f"({gpu['verify_eager_b8_ms']} ms vs {gpu['verify_eager_b1_ms']} ms for" in page
