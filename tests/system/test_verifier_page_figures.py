"""The figures docs/benchmarks/verifier.md quotes are those of the results files it cites: each
carries its source's marker (``NUMBER<!-- fig FILE PATH -->``) and equals the source's value
(bench.publish.check_figures, run here on this page's sources)."""

from __future__ import annotations

from pathlib import Path

from bench.publish import tables as publish

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "benchmarks" / "verifier.md"


def test_the_verifier_pages_figures_come_from_the_files_it_cites() -> None:
    text = PAGE.read_text()
    marked = [m["file"] for m in publish.FIGURE.finditer(text)]
    # the sources the page reads: the batched engine, cloud-only sessions, the CPU's and the
    # GPU's costs, the users' grid, overload and tenants
    for source in (
        "verifier_load.json",
        "verifier_load_cloud.json",
        "draft_batch.json",
        "tree_cost.json",
        "gpu_costs.json",
        "bench/results.json",
        "overload.json",
        "overload_tenants.json",
    ):
        assert source in marked, f"no figure of {source} is marked on the page"
    wrong = [
        line for line in publish.check_figures() if line.startswith("docs/benchmarks/verifier.md")
    ]
    assert wrong == []
    # the edge-drafted against cloud-only table: every cell marked
    rows = [
        line for line in text.splitlines() if line.startswith("| 8 |") or line.startswith("| 64 |")
    ]
    assert rows and all(
        line.count("<!-- fig ") >= 5
        for line in rows
        if "cloud-sd" in line or "verifier_load_cloud" in line
    )
