"""``bench.publish.tables`` on a fixture of the grid's and the capacity study's format: every row is
rendered, the intervals are printed, a "≥" only where an interval's low end is ≥ 1, the README
block fits the README's budget, and ``--check`` tells a stale page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.lib.costs import CLOUD_DRAFT_PER_VERIFY, DRAFT_BATCH_COST
from bench.lib.pages import replace_between
from bench.publish import tables as publish
from bench.publish.tables import Results, claim

REPO = Path(__file__).resolve().parents[2]
RTTS = (0.0, 50.0, 100.0, 200.0, 300.0)
EDGE = (
    ("auto", "auto"),
    ("auto predraft", "auto:predraft"),
    ("hybrid predraft", "hybrid:predraft"),
)


def _row(role: str, mode: str, spec: str, rtt: float, n: int, c: float, b: float,
         k: float) -> dict[str, Any]:  # fmt: skip
    """A summary row as bench.studies.grid writes it; ``k`` sets its figures apart."""
    tps = 6.0 + k + rtt / 1000
    row: dict[str, Any] = {
        "regime": "picospec", "draft": "self:skip=12", "rtt_ms": rtt, "mode": mode,
        "mode_spec": spec, "reply_tokens": n, "tokens_mean": n - 1, "prompts": 44,
        "tokens_per_s": tps, "decode_tokens_per_s": tps * 1.1, "ttft_s": 0.3 + rtt / 1000,
        "ttft_p50_s": 0.3, "reply_s": n / tps,
        "speedup_vs_ar": tps / 6.0, "speedup_vs_ar_ci": [tps / 6.0 - 0.1, tps / 6.0 + 0.1],
        "speedup_vs_cloud_sd": tps / 9.0,
        "speedup_vs_cloud_sd_ci": [tps / 9.0 - 0.05, tps / 9.0 + 0.05],
        "decode_speedup_vs_ar": tps / 5.0, "decode_speedup_vs_ar_ci": [1.0, 2.0],
        "verifier_busy_s_per_100_tokens": 10.0 + k, "draft_acceptance": 0.65,
        "alpha_per_token": 0.83, "mean_accepted_per_round": 2.5,
        "uplink_bytes_per_round": None, "downlink_bytes_per_rejection": 30.0,
        "predraft_hit_rate": 0.7 if "predraft" in spec else None,
        "predraft_miss_alternative": 0.2 if "predraft" in spec else None,
        "predraft_miss_none": 0.1 if "predraft" in spec else None,
        "cloud_draft": None, "gamma": None, "cloud_draft_cost": c, "edge_batch_cost": b,
        "best_of": None, "role": role,
    }  # fmt: skip
    return row


def fixture() -> dict[str, Any]:
    rows = []
    for c in (0.05, CLOUD_DRAFT_PER_VERIFY, 0.2):
        for n in (32, 256):
            for rtt in RTTS:
                b = DRAFT_BATCH_COST
                rows.append(_row("ar", "ar", "ar", rtt, n, c, b, 0.0))
                sd = _row("best cloud-sd", "best cloud-sd", "cloud-sd:mixed:4", rtt, n, c, b, 3.0)
                sd |= {"cloud_draft": "mixed", "gamma": 4}
                rows.append(sd)
                for i, (label, spec) in enumerate(EDGE):
                    rows.append(_row("edge", label, spec, rtt, n, c, b, 4.0 + i))
                    if "predraft" in spec:
                        rows.append(_row("edge", label, spec, rtt, n, c, 0.2, 3.5 + i))
                best = _row("best edge", "best edge", "hybrid:predraft", rtt, n, c, b, 6.0)
                rows.append(best | {"best_of": [s for _, s in EDGE]})
    categories = [
        {"dataset": ds, "mode": "best edge", "mode_spec": "hybrid:predraft", "rtt_ms": 100.0,
         "reply_tokens": 256, "prompts": 8, "alpha_per_token": 0.8 + i / 100,
         "mean_accepted_per_round": 2.0, "tokens_per_s": 12.0 + i, "speedup_vs_ar": 2.0,
         "speedup_vs_ar_ci": [1.9, 2.1], "speedup_vs_cloud_sd": 1.1,
         "speedup_vs_cloud_sd_ci": [0.97, 1.2]}
        for i, ds in enumerate(("gsm8k", "chat", "translation"))
    ]  # fmt: skip
    targets = [
        {"name": "best edge decode rate / ar at RTT 100", "measured": 3.2, "ci": [3.05, 3.3],
         "threshold": 3.0, "met": True},
        {"name": "auto predraft pre-draft hit rate at RTT 100", "measured": 0.7,
         "ci": [0.65, 0.75], "threshold": 0.8, "met": False},
        {"name": "users per verifier, best edge / ar", "measured": None, "ci": None,
         "threshold": 4.0, "met": None},
    ]  # fmt: skip
    validation = [
        {"mode": "auto", "mode_spec": "auto", "rtt_ms": 100.0, "runs": 16,
         "measured_tokens_per_s": 10.0, "sim_tokens_per_s": 10.5, "sim_over_measured": 1.05,
         "sim_over_measured_ci": [1.01, 1.09], "measured_decode_tokens_per_s": 12.0,
         "sim_decode_tokens_per_s": 12.1, "sim_over_measured_decode": 1.01,
         "sim_over_measured_decode_ci": [0.98, 1.04], "measured_ttft_s": 0.41,
         "sim_ttft_s": 0.39, "sim_over_measured_ttft": 0.95,
         "sim_over_measured_ttft_ci": [0.9, 1.0]},
    ]  # fmt: skip
    return {"summary": rows, "categories": categories, "targets": targets,
            "validation": validation, "regime": {"name": "picospec"}, "provenance": {}}  # fmt: skip


def capacity() -> dict[str, Any]:
    modes = ("ar", "best cloud-sd", "auto", "hybrid predraft")
    rows = [
        {"mode": m, "edges": n, "per_user_tokens_per_s_p50": 20.0 / (1 + i) - n / 10,
         "per_user_tokens_per_s_p10": 15.0 - n / 10, "ttft_p99_s": 0.5 + n / 100,
         "goodput_tokens_per_s": 10.0 * n, "verifier_busy_s_per_100_tokens": 14.6 - i}
        for i, m in enumerate(modes)
        for n in (1, 4, 16, 64)
    ]  # fmt: skip
    slos = [
        {"name": "reading", "min_tokens_per_s_p10": 5.0, "max_ttft_p99_s": 1.5},
        {"name": "fast", "min_tokens_per_s_p10": 10.0, "max_ttft_p99_s": 1.5},
    ]
    users = {m: {"reading": 10 * (i + 1), "fast": 3 * (i + 1)} for i, m in enumerate(modes)}
    return {"rows": rows, "slos": slos, "users_at_slo": users, "headline": {"slo": "reading"}}


def test_claim_words_follow_the_interval() -> None:
    assert claim([1.0, 1.3]) == "≥" and claim([1.02, 1.1]) == "≥"
    assert claim([0.97, 1.1]) == "≈"  # straddles 1: no "≥", however high the point
    assert claim([0.8, 0.99]) == "<"
    assert claim(None) == "?" and claim([None, 1.2]) == "?"


def test_readme_block_renders_every_rtt_with_intervals_and_fits() -> None:
    res = Results(fixture(), capacity(), "docs/results/bench")
    block = res.readme_section()
    lines = block.splitlines()
    table = [x for x in lines if x.startswith("| ") and not x.startswith("| RTT")]
    assert [x.split(" | ")[0] for x in table] == [f"| {r:g}" for r in RTTS]
    sd, edge = res.by_role(res.at(256), "best cloud-sd"), res.by_role(res.at(256), "best edge")
    for rtt, line in zip(RTTS, table, strict=True):
        e = edge[rtt]
        lo, hi = e["speedup_vs_cloud_sd_ci"]
        assert (
            f"| {e['tokens_per_s']:.1f} (" in line
            and f", {e['speedup_vs_cloud_sd']:.2f}× [{lo:.2f}–{hi:.2f}])" in line
        )
        assert "mixed γ=4" in line and "hybrid:predraft" in line  # each one's choice
        assert line.endswith(f" | {sd[rtt]['ttft_s']:.2f}/{e['ttft_s']:.2f} |")
    assert "Users per verifier at p10 ≥ 5 tok/s, p99 TTFT ≤ 1.5 s: ar 10," in block
    assert "hybrid predraft 40." in block
    # the README with this block stays within tests/system/test_docs.py's budget
    readme = replace_between((REPO / "README.md").read_text(), "results", block)
    read = publish.as_read(readme).encode()  # as read: figure markers aside
    assert len(read) <= 10_000, len(read)


def test_claim_line_says_ge_only_where_the_interval_allows() -> None:
    data = fixture()
    for r in data["summary"]:
        if r["role"] == "best edge" and r["rtt_ms"] >= 200:
            r["speedup_vs_cloud_sd_ci"] = [0.98, 1.2] if r["rtt_ms"] == 200 else [0.8, 0.95]
    res = Results(data, capacity(), "x")
    line = "Best edge vs best cloud-sd: ≥ at 0, 50, 100 ms; ≈ at 200 ms; < at 300 ms."
    assert res.claim_line(res.at(256)) == line
    assert line in res.page_section()


def test_page_block_renders_every_section() -> None:
    res = Results(fixture(), capacity(), "docs/results/bench")
    page = res.page_section()
    for n in (32, 256):
        assert f"### {n}-token replies" in page
    assert "### Cloud draft step c = 0.05" in page and "### Cloud draft step c = 0.20" in page
    assert "### Edge batch cost b = 0.20" in page
    for title in ("Verifier busy seconds", "Branches ready at a rejection", "Categories", "Targets",
                  "Edges per verifier", "Validation"):  # fmt: skip
        assert f"### {title}" in page, title
    # every edge mode's row at every RTT, 32 and 256 tokens, each with its intervals
    for r in res.rows:
        if (
            r["role"] == "edge"
            and r["edge_batch_cost"] == DRAFT_BATCH_COST
            and r["cloud_draft_cost"] == CLOUD_DRAFT_PER_VERIFY
        ):
            lo, hi = r["speedup_vs_ar_ci"]
            cell = f"{r['tokens_per_s']:.2f} ({r['speedup_vs_ar']:.2f}× [{lo:.2f}–{hi:.2f}]"
            assert cell in page, cell
    # pre-drafting: hit rate and the two miss reasons
    assert "| 100 | auto predraft | 0.70 | 20 % | 10 % |" in page
    # targets: met, not met, not measured
    assert "| best edge decode rate / ar at RTT 100 | 3.20 | [3.05–3.30] | ≥ 3.00 | yes |" in page
    assert "| 0.70 | [0.65–0.75] | ≥ 0.80 | no |" in page
    assert "| users per verifier, best edge / ar | – | – | ≥ 4.00 | – |" in page
    # capacity: N = 1, 4, 16, 64 per mode; users at each service level
    for mode in ("ar", "best cloud-sd", "auto", "hybrid predraft"):
        for n in (1, 4, 16, 64):
            assert f"| {mode} | {n} | " in page
    assert "| reading (p10 ≥ 5 tok/s, p99 TTFT ≤ 1.5 s) | fast (p10 ≥ 10 tok/s" in page
    assert "| hybrid predraft | 40 | 12 |" in page
    assert "| auto | 100 | 16 | 10.00 → 10.50 (1.05× [1.01–1.09])" in page
    assert "| translation | hybrid:predraft | 8 | 0.82 |" in page


def test_page_without_capacity_or_validation_says_so() -> None:
    data = fixture()
    del data["validation"]
    page = Results(data, None, "x").page_section()
    assert "No capacity study" in page and "No real-time validation run" in page
    assert "no capacity study yet" in Results(data, None, "x").readme_section()


def test_publish_rewrites_and_check_tells_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = tmp_path / "bench" / "results.json"
    grid.parent.mkdir()
    grid.write_bytes(orjson.dumps(fixture()))
    (tmp_path / "capacity.json").write_bytes(orjson.dumps(capacity()))
    readme, page = tmp_path / "README.md", tmp_path / "index.md"
    readme.write_text("# x\n\n<!-- results:begin -->\nold\n<!-- results:end -->\n")
    page.write_text("<!-- bench-tables:begin -->\n\nold\n\n<!-- bench-tables:end -->\n")
    monkeypatch.setattr(publish, "README", readme)
    monkeypatch.setattr(publish, "BENCH_PAGE", page)
    monkeypatch.setattr(publish, "ROOT", tmp_path)
    assert publish.main([str(grid), "--check"]) == 1
    assert publish.main([str(grid)]) == 0
    assert "Users per verifier at p10" in readme.read_text()  # ../capacity.json
    assert publish.main([str(grid), "--check"]) == 0
    assert "| hybrid predraft | 40 | 12 |" in page.read_text()
    page.write_text(page.read_text().replace("0.70", "0.71"))
    assert publish.main([str(grid), "--check"]) == 1
    assert "out of date: index.md" in capsys.readouterr().out


def test_a_category_shows_the_best_edge_mode_once_when_it_is_also_listed() -> None:
    """The best edge mode is often one of the modes listed beside it (hybrid predraft): the
    category table shows that mode once per category, not twice."""
    data = fixture()
    extra = [c | {"mode": "hybrid predraft"} for c in data["categories"]]
    data["categories"] = data["categories"] + extra
    table = Results(data, capacity(), "x").categories_table()
    body = [line for line in table if line.startswith("| ") and not line.startswith("| category")]
    assert len(body) == 3 and [line.split(" | ")[0] for line in body] == [
        "| gsm8k",
        "| chat",
        "| translation",
    ]


def test_the_roofline_study_and_the_check_under_load_are_published_beside() -> None:
    """The users table carries the roofline study's counts beside the linear one's, the README
    line names them, and the real-time check under load gets its table, a figure outside 15 %
    marked."""
    roof = capacity()
    roof["users_at_slo"] = {m: {"reading": 2 * v["reading"], "fast": 0} for m, v in
                            roof["users_at_slo"].items()}  # fmt: skip
    ratio = {"value": 1.05, "ci": [0.98, 1.12]}
    fig = {"per_user_tokens_per_s_p50": 10.0, "per_user_tokens_per_s_p10": 8.0,
           "ttft_p99_s": 0.5, "goodput_tokens_per_s": 40.0}  # fmt: skip
    check = {
        "rows": [
            {
                "mode": "auto predraft",
                "edges": 4,
                "time_scale": 16.0,
                "measured": fig,
                "simulated": fig,
                "ratio": dict.fromkeys(fig, ratio),
                "within_15pct": {**dict.fromkeys(fig, True), "ttft_p99_s": False},
                "overruns": {
                    "edge_draft_steps": 300,
                    "edge_draft_overruns": 12,
                    "verifier_target_forwards": 20,
                    "verifier_target_overruns": 0,
                },
            }
        ]
    }
    res = Results(fixture(), capacity(), "x", roof, check)
    table = "\n".join(res.capacity_tables())
    assert "reading, roofline" in table
    first = next(m for m in roof["users_at_slo"])
    assert "roofline costs: " + first in res.users_line()
    rows = res.load_check_table()
    assert rows[2].startswith("| auto predraft | 4 | 16 |")
    assert rows[2].count("✗") == 1 and "draft 12/300, verifier 0/20" in rows[2]
    assert "### The capacity study's check under load" in res.page_section()


def test_a_prose_figure_is_checked_against_its_source(tmp_path: Path) -> None:
    """``<!-- fig FILE PATH -->`` after a number: the number must be the field's value as
    written (rounded to its decimals; ×100 for a percent); a missing field is stale too."""
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    doc = {
        "rows": [{"mode": "auto", "edges": 64, "x": 1.2345}, {"mode": "ar", "edges": 64, "x": 2}],
        "users_at_slo": {"auto predraft": {"reading": 104}},
        "share": 0.123,
    }
    (results / "c.json").write_bytes(orjson.dumps(doc))
    assert publish.resolve(doc, 'users_at_slo."auto predraft".reading') == 104
    assert publish.resolve(doc, "rows[mode=ar,edges=64].x") == 2
    assert publish.resolve(doc, "rows.0.x") == 1.2345
    with pytest.raises(KeyError):
        publish.resolve(doc, "rows[mode=hybrid].x")
    (tmp_path / "README.md").write_text(
        'serves 104<!-- fig c.json users_at_slo."auto predraft".reading --> users, '
        "1.23×<!-- fig c.json rows[mode=auto].x --> and 12.3 %<!-- fig c.json share ×100 -->\n"
    )
    (tmp_path / "docs" / "page.md").write_text(
        "now 1.24<!-- fig c.json rows[mode=auto].x -->, 7<!-- fig c.json nothing.here -->\n"
    )
    (tmp_path / "docs" / "other.md").write_text("\nshare 12.4 %<!-- fig c.json share ×100 -->\n")
    bad = publish.check_figures(tmp_path)
    assert len(bad) == 3, bad
    assert bad[0].startswith("docs/other.md:2: 12.4 %") and "12.30" in bad[0]
    assert bad[1].startswith("docs/page.md:1: 1.24") and "1.2345" in bad[1]
    assert "nothing" in bad[2]
    # --fix-figures: each wrong number becomes its source's, to the places written
    assert publish.check_figures(tmp_path, fix=True) == bad
    assert (tmp_path / "docs" / "page.md").read_text().startswith("now 1.23<!-- fig")
    assert "share 12.3 %<!--" in (tmp_path / "docs" / "other.md").read_text()
    assert len(publish.check_figures(tmp_path)) == 1  # the missing source stays reported


def test_every_marked_figure_in_the_committed_pages_is_its_sources() -> None:
    """(The tables: tests/system/test_docs.py reads them off the committed results.)"""
    assert publish.check_figures() == []
