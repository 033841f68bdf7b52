"""The benchmark's GPU-class costs come from a measurement committed in the repository, and every
results file says where it came from."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.lib import costs
from testkit.provenance import commit, provenance

REPO = Path(__file__).resolve().parents[2]


def _load(rel: str) -> Any:
    return orjson.loads((REPO / rel).read_bytes())


def test_the_constants_are_the_committed_measurements_costs() -> None:
    doc = _load(str(costs.GPU_COSTS_FILE))
    assert doc["measured"] == costs.MEASURED
    derived = costs.derive(doc["measured"])
    assert (
        set(derived)
        == set(doc["costs"])
        == {
            "draft_batch_cost",
            "tree_token_cost",
            "cloud_draft_per_verify",
        }
    )
    for name, cost in doc["costs"].items():
        assert cost == pytest.approx(derived[name]), name
    constants = {
        "draft_batch_cost": costs.DRAFT_BATCH_COST,
        "tree_token_cost": costs.TREE_TOKEN_COST,
        "cloud_draft_per_verify": costs.CLOUD_DRAFT_PER_VERIFY,
    }
    for name, value in constants.items():
        assert doc["costs"][name]["value"] == pytest.approx(value), name
    # the bench reads them from bench.lib.costs, not from copies
    from bench.net import verifier
    from bench.studies import realtime as run

    assert run.DRAFT_BATCH_COST is costs.DRAFT_BATCH_COST
    assert run.CLOUD_DRAFT_PER_VERIFY is costs.CLOUD_DRAFT_PER_VERIFY
    assert verifier.TREE_TOKEN_COST is costs.TREE_TOKEN_COST
    assert doc["setup"]["device"] == "NVIDIA H200" and doc["provenance"]["note"]


def test_derive_prefers_a_direct_measurement_to_the_estimate() -> None:
    base = {"verify_eager_b1_ms": 10.0, "verify_eager_b8_ms": 17.0, "draft_step_eager_ms": 2.0}
    est = costs.derive(base)
    assert est["draft_batch_cost"]["value"] == pytest.approx(0.1)  # 70 % over 7 more sessions
    assert est["tree_token_cost"]["value"] == pytest.approx(0.02)  # over 35 more tokens
    assert est["cloud_draft_per_verify"]["value"] == pytest.approx(0.2)
    direct = costs.derive(
        {
            **base,
            "draft_batch_eager_b1_ms": 4.0,
            "draft_batch_eager_b3_ms": 6.0,  # 1 + 0.25 (B − 1)
            "tree_eager_n0_ms": 10.0,
            "tree_eager_n10_ms": 11.0,  # 1 + 0.01 N
            "draft_step_compiled_ms": 1.0,
            "verify_compiled_b1_ms": 4.0,
        }
    )
    assert direct["draft_batch_cost"]["value"] == pytest.approx(0.25)
    assert direct["tree_token_cost"]["value"] == pytest.approx(0.01)
    assert direct["cloud_draft_per_verify"]["value"] == pytest.approx(0.25)  # compiled first


def test_nothing_cites_a_file_outside_the_repository() -> None:
    roots = ["bench", "docs", "README.md", "mkdocs.yml", "shared", "edge_agent", "cloud_verifier"]
    found = subprocess.run(
        ["git", "grep", "-n", "-I", "-F", "-e", "../shared", "-e", "MODELS.md", "--", *roots],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    assert found == ""


def test_provenance_names_the_commit_date_and_machine() -> None:
    p = provenance()
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert p["commit"] == commit() and p["commit"].removesuffix("-dirty") == head
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", p["date"])
    assert p["machine"]["cpus"] >= 1 and p["machine"]["torch"] and "gpu" in p["machine"]


def test_every_committed_results_file_says_where_it_came_from() -> None:
    for path in sorted((REPO / "docs" / "results").rglob("*.json")):
        prov = orjson.loads(path.read_bytes())["provenance"]
        assert prov.get("commit") or prov.get("commit_of_file") or prov.get("note"), path
