"""bench.studies.capacity_validation: the paired bootstrap, the figures, the verifier's pads by the
simulation's cost rule, and the smoke end to end (a real verifier process, real edges)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from bench.lib import stats
from bench.lib.sim import Costs, Link, SimMode, simulate
from bench.lib.traces import load_traces
from bench.lib.users import Plan, batch_limits, figures, users
from bench.net.verifier import PaddedTarget, row_rule, token_rule
from bench.studies.capacity_validation import (
    FIGURES,
    REPLY_COUNTS,
    Cell,
    assigned,
    costs,
    row,
    simulated,
    time_scale,
    verifier_args,
)
from cloud_verifier.engine.targets import NullTarget
from shared.runtime.batched_lm import Row
from shared.runtime.kv_pool import SlotPages

REPO = Path(__file__).resolve().parents[2]
TRACES = REPO / "docs/results/bench/traces.json.gz"


def test_paired_ratio_ci_resamples_pairs_together() -> None:
    x = [1.0, 2.0, 3.0, 4.0, 5.0]
    y = [1.1, 2.2, 2.9, 4.1, 5.3]
    # With the mean it is ratio_ci: the same resamples for the same seed.
    value, ci = stats.paired_ratio_ci(x, y, np.mean)
    assert value == pytest.approx(15 / 15.6)
    assert ci == stats.ratio_ci(x, y)
    # A side that is the other scaled: every resample gives the same ratio.
    value, ci = stats.paired_ratio_ci([2 * v for v in y], y, np.median)
    assert value == pytest.approx(2.0) and ci == pytest.approx([2.0, 2.0])
    # Rows of several fields (a statistic of tokens over a span): resampled as rows.
    a = np.array([[10.0, 2.0], [20.0, 5.0], [30.0, 4.0]])
    b = a * [1.0, 2.0]  # twice the span: half the rate
    value, ci = stats.paired_ratio_ci(a, b, lambda m: m[:, 0].sum() / m[:, 1].max())
    assert value == pytest.approx(2.0) and ci == pytest.approx([2.0, 2.0])
    assert stats.paired_ratio_ci(x, y, np.mean, seed=1) == stats.paired_ratio_ci(
        x, y, np.mean, seed=1
    )
    with pytest.raises(ValueError, match="rows"):
        stats.paired_ratio_ci(x, y[:4], np.mean)
    with pytest.raises(ValueError, match="positive"):
        stats.paired_ratio_ci(x, [0.0] * 5, np.mean)
    with pytest.raises(ValueError, match="finite"):
        stats.paired_ratio_ci([math.nan, *x[1:]], y, np.mean)


def test_figures_are_the_capacity_studys() -> None:
    """One repeat's figures equal :func:`bench.lib.users.figures` of the same simulation."""
    traces = load_traces(TRACES).measured()
    prompts = assigned(traces, 3, 0)
    mode = SimMode.parse("auto:predraft")
    reqs = users(prompts, 3, Plan(tokens=16, requests_per_user=1))
    result = simulate(mode, reqs, costs(), Link(0.1), batch=batch_limits(Plan()))
    expected = figures(result)
    replies = simulated(Cell(mode, (tuple(prompts),), 16, 1.0))[0]
    rows = np.array([row(r, 0) for r in replies])
    for name, stat in FIGURES.items():
        assert stat(rows) == pytest.approx(expected[name]), name
    # Spread starts: the real users start where the simulation's do.
    spread = Cell(mode, (tuple(prompts),), 16, 1.0, start_spread_s=2.0)
    sent = [r.sent_s for r in simulated(spread)[0]]
    assert sent == pytest.approx(spread.offsets) and len(set(sent)) == 3
    assert Cell(mode, (tuple(prompts),), 16, 1.0).offsets == [0.0] * 3


def test_prompts_rotate_by_repeat_and_the_scale_grows_with_n() -> None:
    traces = load_traces(TRACES).measured()
    p = len(traces)
    first, second = assigned(traces, 4, 0), assigned(traces, 4, 1)
    assert [t.name for t in first] == [t.name for t in traces[:4]]
    assert [t.name for t in second] == [t.name for t in traces[4:8]]
    assert [t.name for t in assigned(traces, 16, 3)] == [
        traces[(u + 48) % p].name for u in range(16)
    ]
    assert [time_scale(n) for n in (1, 4, 16)] == [6, 16, 64]
    assert time_scale(4, 1.0, 2) == 4 and time_scale(1, 1.0, 2) == 2


def test_verifier_settings_follow_the_simulation() -> None:
    args = verifier_args(SimMode.parse("cloud-sd:model:2"), 16, 10.0, 32768)
    assert "--ration" in args
    opts = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    assert opts["--prefill-chunk"] == "2048" and opts["--max-batch-sessions"] == "64"
    assert float(opts["--emulate-verify-ms"]) == pytest.approx(1660)
    assert float(opts["--emulate-cloud-draft-ms"]) == pytest.approx(costs().cloud_draft_s * 1e4)
    assert opts["--cloud-draft"] == "off" and opts["--cloud-draft-tokens"] == "2"
    assert opts["--cloud-draft-model"] == "self:skip=12"
    assert float(opts["--idle-timeout"]) == 600 and float(opts["--max-queue-delay"]) == 150
    assert float(opts["--batch-wait-ms"]) == 20
    assert opts["--threads"] == "1" and opts["--kv-cache-tokens"] == "32768"
    plain = verifier_args(SimMode.parse("auto:predraft"), 4, 16.0, 8192)
    assert "--cloud-draft-model" not in plain and "--emulate-cloud-draft-ms" not in plain
    # N = 16 at 4 a user: S = 64, past which a scaled duration may pass its setting's bound;
    # every one stays within it (the verifier refuses to start otherwise)
    import dataclasses

    from bench.studies.capacity_validation import SCALED_SETTINGS
    from cloud_verifier.daemon.settings import VerifierSettings

    wide = verifier_args(SimMode.parse("auto:predraft"), 16, time_scale(16), 8192)
    opts = {a: wide[i + 1] for i, a in enumerate(wide[:-1]) if a.startswith("--")}
    assert float(opts["--progress-interval"]) == 60
    for f in dataclasses.fields(VerifierSettings):
        if f.name in SCALED_SETTINGS:
            value = float(opts[f"--{f.name.replace('_', '-')}"])
            assert f.metadata.get("min", 0) <= value <= f.metadata.get("max", float("inf")), f.name


def test_padded_target_follows_the_simulations_cost_rule() -> None:
    """A forward of n tokens is padded to Costs.forward_s(n), a draft step of B rows to
    Costs.cloud_draft_step_s(B); the overruns are counted."""
    inner = NullTarget(100)
    k = 0.01
    target = PaddedTarget(inner, 100.0, 80.0, token_rule(100.0, 80.0, k))
    draft = PaddedTarget(inner, 10.0, rule=row_rule(10.0, k))
    rule = Costs(verify_s=0.1, ar_s=0.08, token_cost=k)
    pool = inner.allocate(64, 16)
    slots = [SlotPages() for _ in range(3)]
    for s in slots:
        pool.reserve(s, 300)
    slept: list[float] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "sleep", slept.append)
        # the forward itself takes no time here: the pad is the whole rule, however loaded the
        # machine (a real forward's time is taken off its pad)
        mp.setattr(time, "perf_counter", lambda: 0.0)
        target.forward([Row(slots[0], 0, (1,), 1)])
        target.forward([Row(slots[0], 0, (1, 2, 3), 3)])
        target.forward([Row(s, 0, tuple(range(1, 101)), 1) for s in slots])
        draft.forward([Row(s, 0, (1,), 1) for s in slots])
    expected = [rule.forward_s(1), rule.forward_s(3), rule.forward_s(300), 0.01 * (1 + 2 * k)]
    assert slept == pytest.approx(expected, abs=1e-9)
    assert expected[0] == pytest.approx(0.08) and expected[2] == pytest.approx(0.1 * (1 + 2.95))
    assert target.forwards == 3 and target.overruns == 0
    slow = PaddedTarget(inner, 1.0, rule=lambda rows: 0.0)
    slow.forward([Row(slots[0], 0, (1,), 1)])
    report = slow.report()
    assert report["forwards"] == 1 and report["overruns"] == 1
    assert report["overrun_s"] == report["worst_overrun_s"] >= 0


@pytest.mark.slow
def test_capacity_validation_smoke(tmp_path: Path) -> None:
    """Two real edges against one real padded verifier and the simulation of the same users:
    every figure measured, simulated and compared, with the run's overruns and provenance."""
    out = tmp_path / "cv.json"
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "bench", "capacity_validation", "--smoke", "--out", str(out)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = subprocess.run(cmd, capture_output=True, cwd=REPO, env=env, timeout=600, check=False)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    assert time.monotonic() - t0 < 300
    doc = orjson.loads(out.read_bytes())
    assert doc["complete"] and doc["settings"]["smoke"]
    assert {"commit", "date"} <= set(doc["provenance"])
    assert "bench capacity_validation" in doc["command"]
    (cell,) = doc["rows"]
    assert (cell["mode_spec"], cell["edges"], cell["time_scale"]) == ("auto:predraft", 2, 2.0)
    assert "bench.net.verifier" in cell["verifier_command"]
    assert "--emulate-token-cost" in cell["verifier_command"]
    for name in FIGURES:
        assert cell["measured"][name] > 0 and cell["simulated"][name] > 0, name
        ratio = cell["ratio"][name]
        assert math.isfinite(ratio["value"]) and all(math.isfinite(v) for v in ratio["ci"])
        assert ratio["ci"][0] <= ratio["ci"][1]
        assert isinstance(cell["within_15pct"][name], bool)
    o = cell["overruns"]
    assert o["edge_draft_steps"] > 0 and o["verifier_target_forwards"] > 0
    assert 0 <= o["edge_draft_overruns"] <= o["edge_draft_steps"]
    assert o["edge_draft_overrun_s_per_reply"] >= 0 and o["verifier_overrun_s"] >= 0
    assert cell["session_failures"] == [] and cell["replies_off_trace"] >= 0
    assert len(cell["replies"]) == 2
    for r in cell["replies"]:
        assert r["measured"]["tokens"] == r["simulated"]["tokens"] == 8
        assert r["measured"]["ttft_s"] > 0 and r["measured"]["tokens_per_s"] > 0
        # (the smoke's drafts overrun their pads: a reply may be all co-generated, no round)
        for side in ("measured", "simulated"):
            assert all(r[side][k] >= 0 for k in REPLY_COUNTS), r[side]
