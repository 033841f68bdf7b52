"""The benchmark: its analytical ceiling, the verifier's timing pad, and a smoke run end to end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
import torch

from bench.lib.costs import TREE_TOKEN_COST
from bench.lib.edge import TimedDrafter
from bench.lib.modes import PREDRAFT_BRANCHES, parse_mode
from bench.lib.oracle import OracleDrafter, greedy_continuation, parse_oracle
from bench.net.verifier import PaddedTarget, tree_tokens
from bench.net.verifier import main as padded_verifier_main
from bench.studies.realtime import (
    DRAFT_BATCH_COST,
    BenchConfig,
    Journal,
    Regime,
    Run,
    ceiling,
    estimate,
    in_ceiling_model,
    parse_args,
    summarise,
)
from cloud_verifier.daemon.cli import main as verifier_main
from cloud_verifier.engine.targets import NullTarget
from edge_agent.model.drafter import DraftRow
from edge_agent.session.pipeline_config import Mode
from shared.maths.sampling import SamplingParams
from shared.runtime.batched_lm import Row
from shared.runtime.kv_pool import SlotPages
from shared.wire.messages import SUBPROTOCOL, Fingerprint, Hello
from testkit.harness import free_port
from testkit.net.stream_ws import StreamWS
from testkit.probe import Driver, ProbeClient
from tests.verifiers import serve_process, wait_healthy

REPO = Path(__file__).resolve().parents[2]


def assert_provenance(doc: dict[str, Any]) -> None:
    """A results file records the commit, the date and the machine it was made on."""
    p = doc["provenance"]
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", p["commit"]), p["commit"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", p["date"]), p["date"]
    machine = p["machine"]
    assert machine["cpus"] >= 1 and machine["platform"] and machine["torch"]
    assert "gpu" in machine


def test_ceiling_formula() -> None:
    # stop-and-wait: one round = γ t_d + RTT + T_v
    assert ceiling(Mode.STOP_AND_WAIT, 4, 1, 0.024, 0.166, 0.1, 3.0, 0.5) == pytest.approx(
        3.0 / (4 * 0.024 + 0.1 + 0.166)
    )
    # pipelined, no rejections, deep enough queue: the drafter is the bottleneck
    assert ceiling(Mode.PIPELINED, 4, 4, 0.1, 0.1, 0.2, 4.0, 0.0) == pytest.approx(4.0 / 0.4)
    # pipelined, D = 1: bounded by RTT + verify per batch
    assert ceiling(Mode.PIPELINED, 4, 1, 0.01, 0.1, 0.2, 4.0, 0.0) == pytest.approx(4.0 / 0.3)
    # every round rejected: pipelining cannot beat stop-and-wait
    assert ceiling(Mode.PIPELINED, 4, 4, 0.02, 0.1, 0.2, 2.0, 1.0) == pytest.approx(
        ceiling(Mode.STOP_AND_WAIT, 4, 1, 0.02, 0.1, 0.2, 2.0, 1.0)
    )


def test_ceiling_with_cogeneration() -> None:
    t_d, t_v = 0.024, 0.166
    # every draft wrong: the verifier decodes alone, 1/T_v at any RTT
    for rtt in (0.0, 0.1, 0.3):
        assert ceiling(Mode.PIPELINED, 4, 4, t_d, t_v, rtt, 1.0, 1.0, cogen=True) == pytest.approx(
            1 / t_v
        )
    # no rejection: nothing to co-generate
    plain = ceiling(Mode.PIPELINED, 4, 4, t_d, t_v, 0.1, 4.0, 0.0)
    assert ceiling(Mode.PIPELINED, 4, 4, t_d, t_v, 0.1, 4.0, 0.0, cogen=True) == plain
    # each rejection adds the (γ t_d + R)/T_v tokens decoded during the refill
    rtt, n_bar, r = 0.3, 2.0, 0.8
    c = (4 * t_d + rtt) / t_v
    flow, refill = max(4 * t_d, (rtt + t_v) / 4, t_v), 4 * t_d + rtt + t_v
    expected = (n_bar + r * c) / ((1 - r) * flow + r * refill)
    got = ceiling(Mode.PIPELINED, 4, 4, t_d, t_v, rtt, n_bar, r, cogen=True)
    assert got == pytest.approx(expected)
    assert got > ceiling(Mode.PIPELINED, 4, 4, t_d, t_v, rtt, n_bar, r)
    # stop-and-wait keeps its formula
    assert ceiling(Mode.STOP_AND_WAIT, 4, 1, t_d, t_v, rtt, 3.0, 0.5, cogen=True) == ceiling(
        Mode.STOP_AND_WAIT, 4, 1, t_d, t_v, rtt, 3.0, 0.5
    )


def test_mode_specs_and_labels() -> None:
    saw = parse_mode("saw:4")
    assert (saw.label, saw.kind, saw.gamma, saw.cogen) == (
        "stop-and-wait",
        Mode.STOP_AND_WAIT,
        4,
        False,
    )
    assert parse_mode("saw:6").label == "stop-and-wait γ=6"
    pipe = parse_mode("pipe:4x4")
    assert pipe.label == "pipelined γ=4 D=4" and pipe.cogen
    assert pipe.pipeline_config().cogen and pipe.pipeline_config().depth == 4
    nocogen = parse_mode("pipe:8x2:nocogen")
    assert nocogen.label == "pipelined γ=8 D=2 no-cogen"
    assert not nocogen.pipeline_config().cogen and nocogen.pipeline_config().gamma == 8
    hybrid = parse_mode("hybrid:predraft")
    assert hybrid.label == "hybrid predraft" and hybrid.predraft == PREDRAFT_BRANCHES
    assert hybrid.cloud == parse_mode("hybrid").cloud and not parse_mode("hybrid").predraft
    tree = parse_mode("auto:tree")
    assert tree.label == "auto tree" and tree.predraft == PREDRAFT_BRANCHES
    # branches go to the verifier with pre-drafting, as the edge daemon's default: ``:tree``
    # names the same configuration
    assert tree.pipeline_config() == parse_mode("auto:predraft").pipeline_config()
    assert tree.pipeline_config().tree and hybrid.pipeline_config().tree
    assert not parse_mode("auto").pipeline_config().tree
    assert parse_mode("hybrid:tree").label == "hybrid tree"
    auto = parse_mode("auto").pipeline_config()
    assert auto.auto_gamma and auto.auto_depth and (auto.gamma, auto.depth) == (4, 4)
    for bad in ("pipe:4", "saw", "pipe:4x4:cogen", "fast"):
        with pytest.raises(ValueError):
            parse_mode(bad)
    assert parse_oracle("oracle:alpha=0.75") == 0.75
    for bad in ("oracle:alpha=1.5", "oracle:0.5", "oracle:alpha="):
        with pytest.raises(ValueError):
            parse_oracle(bad)


def test_oracle_drafter_follows_the_greedy_path() -> None:
    prompt, other = (5, 6, 7), (9, 9)
    path = [10, 11, 12, 13, 14, 15, 16, 17]
    paths = {prompt: path, other: [1, 2, 3]}
    params = SamplingParams(0.0)
    rng = np.random.default_rng(0)
    always = OracleDrafter(paths, 32, 1.0)
    never = OracleDrafter(paths, 32, 0.0)
    for k in range(len(path)):
        seq = list(prompt) + path[:k]
        step = always.draft(DraftRow(seq, params, rng, True))
        x, q = step.token, step.q
        assert x == path[k] and step.prob == 1.0 and step.rival is None
        assert q.dtype == np.float64 and q.shape == (32,) and q[x] == 1.0 and q.sum() == 1.0
        assert never.draft(DraftRow(seq, params, rng, True)).token == (path[k] + 1) % 32
    assert always.stats.hits == len(path) and never.stats.misses == len(path)
    # off the path (an earlier draft wrong), past the continuation, another prompt
    assert always.propose([*prompt, 10, 99]) == path[2]
    assert always.propose([*prompt, *path, 1]) == path[-1]
    assert always.stats.off_path == 2
    assert always.propose([9, 9, 1]) == 2
    with pytest.raises(LookupError):
        always.propose([1, 2, 3])
    # the coins: fixed per (seed, prompt, position), rate α, and nested across α
    half = OracleDrafter(paths, 32, 0.5, seed=3)
    long = tuple(range(40))
    paths[long] = [int(t) for t in np.random.default_rng(1).integers(0, 32, 2000)]
    a = OracleDrafter(paths, 32, 0.5, seed=3)
    b = OracleDrafter(paths, 32, 0.8, seed=3)
    greedy = paths[long]
    hits_a = [a.propose([*long, *greedy[:k]]) == greedy[k] for k in range(2000)]
    hits_b = [b.propose([*long, *greedy[:k]]) == greedy[k] for k in range(2000)]
    again = [a.propose([*long, *greedy[:k]]) == greedy[k] for k in range(2000)]
    assert hits_a == again
    assert 0.45 < np.mean(hits_a) < 0.55 and 0.75 < np.mean(hits_b) < 0.85
    assert all(hb for ha, hb in zip(hits_a, hits_b, strict=True) if ha)
    assert a.stats.alpha_measured == pytest.approx(np.mean(hits_a))
    assert half.draft(DraftRow(list(long), params, rng, True)).prob == 0.5
    assert a.on_path(long, greedy[:7]) and not a.on_path(long, [0])


def test_oracle_greedy_path_and_timed_padding(tiny_model_dir: Path) -> None:
    from edge_agent.model.lm import CausalLM
    from shared.runtime.models import load_model

    target = load_model(str(tiny_model_dir))
    prompt = [1, 7, 9, 11]
    path = greedy_continuation(target, prompt, 12)
    lm = CausalLM(target)
    ids = list(prompt)
    for tok in path:  # the target's greedy choice after each prefix
        assert int(lm.extend(ids[len(lm.tokens) :])[-1].argmax()) == tok
        ids.append(tok)
    oracle = OracleDrafter({tuple(prompt): path}, target.vocab_size, 1.0)
    timed = TimedDrafter(oracle, 0.02)
    t0 = time.perf_counter()
    step = timed.draft(
        DraftRow(prompt + path[:3], SamplingParams(0.0), np.random.default_rng(0), True)
    )
    assert time.perf_counter() - t0 >= 0.019
    assert step.token == path[3] and step.q.shape == (target.vocab_size,)
    assert timed.vocab_size == target.vocab_size and step.prob == 1.0
    assert timed.inner is oracle and timed.forwards == 0
    # Branches stepped together: one padded batched step, 1 + A (B − 1) of one step.
    seqs = [prompt + path[:k] for k in (1, 2, 3)]
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    steps = timed.draft_many([DraftRow(s, SamplingParams(0.0), rng, True) for s in seqs])
    assert time.perf_counter() - t0 >= 0.02 * (1 + 2 * DRAFT_BATCH_COST) - 1e-3
    assert [x.token for x in steps] == path[1:4]
    # --draft-batch-cost: this CPU's 0.20 per extra branch instead of the GPU class's
    cpu = TimedDrafter(oracle, 0.02, batch_cost=0.2)
    cpu.draft_many([DraftRow(s, SamplingParams(0.0), rng, True) for s in seqs])
    assert cpu.times[-1] >= 0.02 * 1.4 - 1e-3 > 0.02 * (1 + 2 * DRAFT_BATCH_COST)
    with pytest.raises(ValueError, match="batch_cost"):
        TimedDrafter(oracle, 0.02, batch_cost=-0.1)


def test_bench_options_reply_lengths_datasets_and_batch_cost() -> None:
    args = parse_args(["--tokens", "32,256", "--datasets", "gsm8k,qa", "--draft-batch-cost", "0.2"])
    assert args.tokens == (32, 256) and args.datasets == ("gsm8k", "qa")
    assert args.draft_batch_cost == 0.2 and str(args.out) == "docs/results/bench/real"
    defaults = parse_args([])
    assert defaults.tokens == (32, 256) and defaults.draft_batch_cost == DRAFT_BATCH_COST
    assert "translation" in defaults.datasets and "rag" in defaults.datasets
    for bad in (["--tokens", "32,x"], ["--tokens", "0"], ["--datasets", "mtbench"],
                ["--draft-batch-cost", "-1"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_draft_batch_measures_batched_branch_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``python -m bench draft_batch`` on a tiny model: a median step time per batch size and
    the fitted cost of each extra branch, written with the machine."""
    from bench.studies import draft_batch

    out = tmp_path / "draft_batch.json"
    args = ["--target", str(tiny_model_dir), "--draft", str(tiny_model_dir), "--batches", "1,3"]
    assert draft_batch.main([*args, "--steps", "2", "--warmup", "1", "--context", "70",
                            "--out", str(out)]) == 0  # fmt: skip
    record = orjson.loads(out.read_bytes())
    assert set(record["median_step_s"]) == {"1", "3"}
    assert record["batch_cost_per_extra_branch"] is not None and record["machine"]["cpus"] >= 1
    assert_provenance(record)


def test_time_estimate_runs_oracles_cheaper() -> None:
    reg = Regime("picospec", 24.0, 166.0, 146.0, scale=4.0, oracle_scale=1.5)
    real = BenchConfig(Path("x"), drafts=("self:skip=12",), regimes=(reg,), oracle_modes=())
    oracle = replace(
        real, drafts=("oracle:alpha=0.75",), oracle_modes=real.modes, oracle_rtts_ms=real.rtts_ms
    )
    secs_real, lines = estimate(real, 4)
    secs_oracle, _ = estimate(oracle, 4)
    assert 0 < secs_oracle < secs_real and "S=4" in lines[0]


def test_padded_target_pads_and_keeps_logits() -> None:
    inner = NullTarget(100)
    padded = PaddedTarget(inner, 60.0)
    slot = SlotPages()
    padded.allocate(4, 16).reserve(slot, 3)
    rows = [Row(slot, 0, (1, 2, 3), 3)]
    t0 = time.perf_counter()
    out = padded.forward(rows)
    assert time.perf_counter() - t0 >= 0.058
    torch.testing.assert_close(out, inner.forward(rows))
    assert padded.fingerprint == inner.fingerprint
    # A token tree's branch tokens cost TREE_TOKEN_COST of the pad each (here 2 past the chain).
    tree = Row(slot, 0, (1, 2, 3, 4, 5), 5, (-1, 0, 1, 0, 3))
    assert tree_tokens(tree) == 2 and tree_tokens(rows[0]) == 0
    padded.pad_s = 1.0
    with pytest.MonkeyPatch.context() as mp:
        slept: list[float] = []
        mp.setattr(time, "sleep", slept.append)
        padded.forward([tree])
    assert slept[0] == pytest.approx(1 + 2 * TREE_TOKEN_COST, abs=0.05)


async def test_padded_verifier_process_pads_forwards() -> None:
    """``python -m bench.net.verifier``: the product's serve path, every forward padded."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANSPEC_")}
    proc = serve_process(
        "--model", "null:64", "--insecure-no-auth", "--port", str(port), "--log-level",
        "warning", "--emulate-verify-ms", "80", env=env, module="bench.net.verifier",
    )  # fmt: skip
    try:
        health = await wait_healthy(f"http://127.0.0.1:{port}", proc=proc)
        async with aiohttp.ClientSession() as http:
            assert health.get("status") == "ready", health
            assert "forwards padded to 80 ms" in str(health["reason"])
            ws = StreamWS(
                await http.ws_connect(
                    f"http://127.0.0.1:{port}/v1/session", protocols=(SUBPROTOCOL,)
                )
            )
            client = ProbeClient(ws)
            await client.hello(Hello(Fingerprint("null", 64, "null"), SamplingParams(1.0)))
            driver = Driver(client, 64, 3, np.random.default_rng(0))
            driver.fixed = [5, 6, 7]
            for _ in range(2):
                t0 = time.perf_counter()
                await driver.round()
                assert time.perf_counter() - t0 >= 0.078
            await ws.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_padding_is_not_a_product_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        verifier_main(["serve", "--model", "null:64", "--emulate-verify-ms", "10"])
    assert e.value.code == 2 and "--emulate-verify-ms" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        padded_verifier_main(["--model", "null:64", "--emulate-verify-ms", "-1"])
    assert e.value.code == 2 and "--emulate-verify-ms" in capsys.readouterr().err


def _spec_extra(**over: Any) -> dict[str, Any]:
    """A speculative run's ``extra`` as run_spec and _spec_run record it."""
    extra: dict[str, Any] = {
        "rounds": 10, "draft_tokens": 40, "accepted_tokens": 26, "rejections": 6,
        "uplink_bytes": 2000, "downlink_bytes": 500, "proposes": 10,
        "downlink_rejection_bytes": 120, "verdict_tokens": 32, "cogen_tokens": 0,
        "wire_bytes_up": 2100, "wire_bytes_down": 600, "draft_step_s_mean": 0.024,
        "verify_s_mean": 0.166, "gamma_mean": 4.0, "depth_mean": 4.0, "verifier_busy_s": 2.0,
        "stats": {"sources": {"edge_draft": 26, "correction": 6}},
    }  # fmt: skip
    return extra | over


def _summary_run(mode: str, draft: str | None, extra: dict[str, Any], tps: float = 10.0,
                 rtt: float = 100.0, reply: int = 32, prompt: int = 0) -> Run:  # fmt: skip
    spec = None if mode == "ar" else mode
    label = "ar" if mode == "ar" else parse_mode(mode).label
    return Run(regime="picospec", rtt_ms=rtt, mode=label, depth=None, dataset="gsm8k",
               tokens=32, wall_s=32 / tps, tokens_per_s=tps, decode_tokens_per_s=tps * 1.2,
               extra=extra, draft=draft, mode_spec=spec, prompt=prompt, reply_tokens=reply,
               ttft_s=0.5)  # fmt: skip


def _summary(runs: list[Run]) -> dict[tuple[str | None, str, int], dict[str, Any]]:
    reg = Regime("picospec", 24.0, 166.0, 146.0)
    cfg = BenchConfig(Path("x"), drafts=("real", "oracle:alpha=0.9"),
                      modes=("auto", "auto:predraft", "hybrid:predraft", "cloud-sd"),
                      oracle_modes=("auto",), regimes=(reg,))  # fmt: skip
    rows = summarise(runs, cfg, [reg], 256)
    return {(r["draft"], r["mode"], r["reply_tokens"]): r for r in rows}


def test_summary_keys_the_comparisons_by_draft_and_reply_length() -> None:
    """Defect c: an oracle has no cloud-sd of its own (None), and a row is compared with the
    cloud-sd and ar rows of its own draft and reply length only."""
    ar_extra = {"downlink_bytes": 128, "wire_bytes_up": 50, "wire_bytes_down": 300,
                "verifier_busy_s": 4.8}  # fmt: skip
    runs = [
        _summary_run("ar", None, ar_extra, tps=5.0),
        _summary_run("ar", None, ar_extra, tps=4.0, reply=256),
        _summary_run("auto", "real", _spec_extra(), tps=12.0),
        _summary_run("auto", "real", _spec_extra(), tps=11.0, reply=256),
        _summary_run("cloud-sd", "real", _spec_extra(proposes=0, uplink_bytes=300), tps=8.0),
        _summary_run("cloud-sd", "real", _spec_extra(proposes=0), tps=10.0, reply=256),
        _summary_run("auto", "oracle:alpha=0.9", _spec_extra(), tps=16.0),
    ]
    rows = _summary(runs)
    assert rows[("real", "auto", 32)]["speedup_vs_cloud_sd"] == pytest.approx(12 / 8)
    assert rows[("real", "auto", 256)]["speedup_vs_cloud_sd"] == pytest.approx(11 / 10)
    assert rows[("real", "auto", 256)]["speedup_vs_ar"] == pytest.approx(11 / 4)
    oracle = rows[("oracle:alpha=0.9", "auto", 32)]
    assert oracle["speedup_vs_cloud_sd"] is None
    assert oracle["speedup_vs_ar"] == pytest.approx(16 / 5)
    assert rows[("real", "auto", 32)]["ttft_s"] == 0.5


def test_summary_figures_fix_the_defects() -> None:
    """Defects a, b, d, e: cloud-sd sends no Propose (no rounds: None, not the total), ar's
    busy time is the one its service reported (the prefill step included), the per-token α
    beside the draft acceptance, and no ceiling for a mode outside its model."""
    ar_extra = {"downlink_bytes": 128, "wire_bytes_up": 50, "wire_bytes_down": 300,
                "verifier_busy_s": 4.8}  # fmt: skip
    runs = [
        _summary_run("ar", None, ar_extra, tps=5.0),
        _summary_run("auto", "real", _spec_extra()),
        _summary_run("auto:predraft", "real", _spec_extra()),
        _summary_run("hybrid:predraft", "real", _spec_extra()),
        _summary_run("cloud-sd", "real", _spec_extra(proposes=0, uplink_bytes=300)),
    ]
    rows = _summary(runs)
    assert rows[("real", "cloud-sd", 32)]["uplink_bytes_per_round"] is None  # a
    assert rows[("real", "auto", 32)]["uplink_bytes_per_round"] == pytest.approx(200)
    # b: 100 × busy / tokens, as every mode (not 100 / the decode rate, which left out the
    # prefill: 100 / 6 = 16.7 here)
    assert rows[(None, "ar", 32)]["verifier_busy_s_per_100_tokens"] == pytest.approx(15.0)
    auto = rows[("real", "auto", 32)]
    assert "acceptance" not in auto
    assert auto["draft_acceptance"] == pytest.approx(26 / 40)  # d
    assert auto["alpha_per_token"] == pytest.approx(26 / 32)
    assert auto["fraction_of_ceiling"] is not None and auto["ceiling_approx"]  # e
    for mode in ("auto predraft", "hybrid predraft", "cloud-sd"):
        row = rows[("real", mode, 32)]
        assert row["fraction_of_ceiling"] is None and row["ceiling_tokens_per_s"] is None, mode
    assert in_ceiling_model(parse_mode("pipe:4x4")) and in_ceiling_model(parse_mode("saw:4"))
    for spec in ("auto:predraft", "auto:tree", "pipe:4x4:hedge", "hybrid", "cloud-sd"):
        assert not in_ceiling_model(parse_mode(spec)), spec


async def test_ar_service_reports_its_busy_time_with_the_prefill(tiny_model_dir: Path) -> None:
    """Defect b: the AR service's reply ends with its busy seconds, every step padded, the
    prefill step (the one that yields the first token) included, on one kept-alive connection."""
    from aiohttp.test_utils import TestServer

    from bench.net.ar_server import ArClient, build_app
    from cloud_verifier.daemon.auth import Authenticator
    from shared.runtime.models import load_model

    app = build_app(load_model(str(tiny_model_dir)), Authenticator(["t"]), pad_ms=40.0)
    async with TestServer(app) as server:
        url = str(server.make_url("/v1/generate")).replace("http", "ws", 1)
        async with ArClient(url, "t") as client:
            one = await client.request([1, 7, 9, 11], 1, [])
            three = await client.request([1, 7, 9, 11], 3, [])
        assert client.connects == 1  # kept alive
    assert len(one.ids) == 1 and one.busy_s is not None and one.busy_s >= 0.039  # the prefill
    assert len(three.ids) == 3 and three.busy_s is not None and three.busy_s >= 3 * 0.039
    assert three.stamps[0] - three.sent_at < three.ended_at - three.sent_at


def _run(rtt: float, prompt: int) -> Run:
    return Run(regime="picospec", rtt_ms=rtt, mode="auto", depth=None, dataset="gsm8k",
               tokens=8, wall_s=1.0, tokens_per_s=8.0, decode_tokens_per_s=9.0,
               extra={"text_ids": [1, 2]}, draft="d", mode_spec="auto", scale=6.0,
               prompt=prompt, reply_tokens=32)  # fmt: skip


def test_journal_resumes_the_runs_it_has_and_only_on_the_same_settings(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    header = {"settings": {"tokens": "48"}, "commit": "abc"}
    j = Journal(path, header, resume=False)
    j.add(_run(0.0, 0))
    j.add(_run(100.0, 1))
    # a stop part-way: the last line is cut
    path.write_bytes(path.read_bytes() + b'{"regime": "picos')
    fresh = Journal(path, header, resume=False)
    assert fresh.done == {}  # without --resume the grid starts again
    fresh.add(_run(0.0, 0))
    fresh.add(_run(100.0, 1))
    path.write_bytes(path.read_bytes() + b'{"regime": "picos')
    resumed = Journal(path, header, resume=True)
    assert set(resumed.done) == {_run(0.0, 0).key(), _run(100.0, 1).key()}
    assert resumed.done[_run(100.0, 1).key()] == _run(100.0, 1)
    resumed.add(_run(200.0, 0))
    again = Journal(path, header, resume=True)  # the rewritten journal has all three
    assert len(again.done) == 3
    again.finish()
    assert not path.exists()
    Journal(path, header, resume=False).add(_run(0.0, 0))
    with pytest.raises(SystemExit, match="other settings or another commit"):
        Journal(path, {"settings": {"tokens": "64"}, "commit": "abc"}, resume=True)


def test_bench_smoke_writes_all_outputs(tmp_path: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-m", "bench", "realtime", "--smoke", "--out", str(tmp_path)],
        capture_output=True, cwd=REPO, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    assert not (tmp_path / "runs.jsonl").exists()  # the journal goes once the results are in
    doc = orjson.loads((tmp_path / "results.json").read_bytes())
    assert {"machine", "settings", "regimes", "summary", "runs", "plots"} <= set(doc)
    assert_provenance(doc)
    rows = doc["summary"]
    assert all("draft" in r for r in rows)
    drafts = doc["settings"]["drafts"]
    assert len(drafts) == 2 and drafts[1] == "oracle:alpha=0.75"
    model, oracle = drafts
    modes = {(r["regime"], r["draft"], r["mode"]) for r in rows}
    for regime in ("raw", "picospec"):
        assert (regime, None, "ar") in modes  # once per RTT, for every draft
        for mode in ("stop-and-wait", "pipelined γ=4 D=2", "auto", "hybrid", "hybrid predraft",
                     "hybrid tree", "cloud-sd", "cloud-sd ngram"):  # fmt: skip
            assert (regime, model, mode) in modes
        for mode in ("pipelined γ=4 D=2 no-cogen", "auto"):
            assert (regime, oracle, mode) in modes
    pre = [r for r in rows if r["mode"] == "hybrid predraft"]
    assert pre and all(r["predraft"] == 8 and "predraft_hit_rate" in r for r in pre)
    tree = [r for r in rows if r["mode"] == "hybrid tree"]
    assert tree and all(r["tree"] and "tree_open_rate" in r for r in tree)
    assert ("raw", model, "assisted") in modes
    assert {r["rtt_ms"] for r in rows} == {0.0, 50.0}
    assert {r["reply_tokens"] for r in rows} == {4, 6}  # each prompt at each length
    assert doc["settings"]["draft_batch_cost"] == DRAFT_BATCH_COST
    # on warm links: every run found its connection open
    assert all(r["reconnects"] == 0 for r in rows if r["mode"] != "assisted")
    # the oracle ran at its own time scale, the model draft and ar at theirs
    scales = {(r["regime"], r["draft"]): r["time_scale"] for r in rows if r["mode"] != "assisted"}
    assert scales[("picospec", oracle)] == 2.0 and scales[("picospec", model)] == 1.0
    assert scales[("picospec", None)] == 1.0
    for row in rows:
        assert row["tokens_per_s"] > 0
        same = (row["regime"], row["rtt_ms"], row["reply_tokens"])
        if row["mode"] != "assisted":
            # the first token comes after the request went up, before the whole reply
            assert 0 < row["ttft_s"] < row["reply_tokens"] / row["tokens_per_s"]
        if row["mode"] == "ar":
            assert row["verifier_busy_s_per_100_tokens"] > 0
        if row["mode"] != "ar" and row["regime"] == "picospec":
            ar = [r for r in rows if (r["regime"], r["rtt_ms"], r["reply_tokens"]) == same
                  and r["mode"] == "ar"]  # fmt: skip
            assert row["speedup_vs_ar"] == pytest.approx(
                row["tokens_per_s"] / ar[0]["tokens_per_s"]
            )
        if row["regime"] == "picospec" and row["draft"] == model:
            sd = [r for r in rows if (r["regime"], r["rtt_ms"], r["reply_tokens"]) == same
                  and r["mode"] == "cloud-sd"]  # fmt: skip
            assert row["speedup_vs_cloud_sd"] == pytest.approx(
                row["tokens_per_s"] / sd[0]["tokens_per_s"]
            )
        if row["draft"] == oracle:
            assert row["speedup_vs_cloud_sd"] is None  # no cloud-sd of its own
        if row["mode"].startswith("cloud-sd"):
            # no edge draft: every token but the prompt's bonus is the verifier's
            shares = row["token_sources"]
            assert shares.get("edge_draft", 0) == 0 and shares.get("correction", 0) == 0
            assert sum(shares.values()) == pytest.approx(1.0)
            assert row["verifier_busy_s_per_100_tokens"] > 0
            assert row["uplink_bytes_per_round"] is None  # credits only: no Propose, no round
        elif row["mode"] not in ("ar", "assisted"):
            assert sum(row["token_sources"].values()) == pytest.approx(1.0)
            # what the verifier's engine spent on the text (forwards, pads included)
            assert row["verifier_busy_s_per_100_tokens"] > 0
            if row["cogen"] and row["draft_acceptance"] is None:
                # the verifier co-generated the whole (6-token) text before any edge batch
                assert row["token_sources"].get("edge_draft", 0) == 0
            else:
                keys = ["draft_acceptance", "alpha_per_token", "mean_accepted_per_round",
                        "uplink_bytes_per_round", "bytes_per_token"]  # fmt: skip
                modelled = in_ceiling_model(parse_mode(row["mode_spec"]))
                for key in keys + ["ceiling_tokens_per_s", "fraction_of_ceiling"] * modelled:
                    assert row[key] is not None, key
                assert row["alpha_per_token"] >= row["draft_acceptance"]
                if not modelled:
                    assert row["fraction_of_ceiling"] is None
                # ids + q, not distributions (one is |V| × 4 = 1024 B here); with co-generation
                # a 6-token generation may send a single Propose, whose fixed tokens are the
                # prompt. Hedges and tree branches ride the uplink too (hedge_bytes, part of
                # it): the tree branches within their budget, branch_uplink (256 B) a Propose
                # sent plus a first Propose's worth.
                branches = row["branch_bytes_per_round"] or 0.0
                assert row["uplink_bytes_per_round"] - branches < 400
                if not row["hedge"]:
                    assert branches <= 2 * 256
        if row["draft"] == oracle:
            assert row["oracle_on_path"] == 1.0  # the verified text is the precomputed greedy one
    md = (tmp_path / "results.md").read_text()
    assert "PicoSpec regime" in md and "| RTT ms | mode |" in md and "oracle:alpha=0.75" in md
    assert "× cloud-sd" in md and "verifier_busy_per_token.png" in doc["plots"]
    for png in doc["plots"]:
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_ttft_bench_smoke(tmp_path: Path) -> None:
    """bench.studies.ttft end to end at a small shape: the daemon on its warm link, cold connections
    and the kept-alive AR baseline through the emulator at two RTTs; 1 and 2 concurrent
    requests in the emulated regime; every figure with its interval, and the plot."""
    run = subprocess.run(
        [sys.executable, "-m", "bench", "ttft", "--smoke", "--out", str(tmp_path)],
        capture_output=True, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=900,
        check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    doc = orjson.loads((tmp_path / "ttft.json").read_bytes())
    cells = doc["latency"]["cells"]
    assert {(c["kind"], c["rtt_ms"]) for c in cells} == {
        (k, r) for k in ("warm", "cold", "ar") for r in (0.0, 100.0)
    }
    for c in cells:
        lo_mid_hi = c["ttft_s"]
        assert lo_mid_hi[1] <= lo_mid_hi[0] <= lo_mid_hi[2] and 0 < lo_mid_hi[0] < c["reply_s"][0]
        assert all(t == 8 for t in c["tokens_received"])  # every reply whole
    extra = doc["latency"]["targets"]["ttft_extra_per_rtt"][0]
    assert {"warm_ttft_minus_rtt0_over_rtt", "cold_ttft_minus_rtt0_over_rtt"} <= set(extra)
    con = doc["concurrency"]["summary"]
    assert [r["concurrency"] for r in con] == [1, 2] and con[0]["aggregate_over_one"][0] == 1.0
    assert (tmp_path / "ttft.png").read_bytes()[:4] == b"\x89PNG"
    assert_provenance(doc)


@pytest.mark.slow
def test_federate_eval_smoke(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench", "federate", "--smoke", "--prompts", "1",
         "--tokens", "16", "--out", str(tmp_path)],
        capture_output=True, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"), timeout=600,
        check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    doc = orjson.loads((tmp_path / "federated.json").read_bytes())
    for block in doc["results"].values():
        for row in block["rows"]:
            # the measured bias never exceeds its bound at any position
            assert row["bias_max_over_bound"] <= 1e-4
            assert row["bias_bar"] <= row["two_eps_bar"] + 1e-6
            assert row["d_alpha_bar"] <= row["eps_bar"] + 1e-6
        by = {(r["K"], r["reconstruction"]): r for r in block["rows"]}
        for (k, how), r in by.items():
            if how == "B":
                assert r["bias_bar"] <= by[(k, "A")]["bias_bar"] + 1e-9  # B never above A
    assert (tmp_path / "federated.md").exists()
    assert_provenance(doc)
    assert (tmp_path / "federated.png").read_bytes()[:4] == b"\x89PNG"


def test_gpu_bench_refuses_without_cuda_and_runs_small_on_the_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.studies.gpu import main as gpu_main

    if not torch.cuda.is_available():
        assert gpu_main(["--out", str(tmp_path / "no.json")]) == 2
        assert "CUDA device" in capsys.readouterr().err
        assert not (tmp_path / "no.json").exists()
    out = tmp_path / "gpu.json"
    args = ["--small", "--device", "cpu", "--no-compile", "--reps", "2", "--batches", "1,2"]
    args += ["--trees", "0,4", "--branches", "1,2"]
    assert gpu_main([*args, "--context", "16", "--out", str(out)]) == 0
    result = orjson.loads(out.read_bytes())
    # the same format as the committed docs/results/gpu_costs.json, every cost re-measured
    committed = orjson.loads((REPO / "docs" / "results" / "gpu_costs.json").read_bytes())
    assert {"what", "command", "setup", "measured", "costs", "provenance"} <= set(result)
    assert set(result["costs"]) == set(committed["costs"])
    measured = result["measured"]
    for key in ("verify_eager_b1_ms", "verify_eager_b2_ms", "tree_eager_n0_ms",
                "tree_eager_n4_ms", "draft_step_eager_ms", "draft_batch_eager_b1_ms",
                "draft_batch_eager_b2_ms"):  # fmt: skip
        assert measured[key] > 0, key
    assert result["costs"]["draft_batch_cost"]["basis"].startswith("slope of draft_batch")
    assert result["costs"]["tree_token_cost"]["basis"].startswith("slope of tree")
    assert result["costs"]["cloud_draft_per_verify"]["value"] == pytest.approx(
        measured["draft_step_eager_ms"] / measured["verify_eager_b1_ms"]
    )
    assert result["setup"]["target_shape"]["name"] == "small"
    assert_provenance(result)


def test_verifier_load_smoke(tmp_path: Path) -> None:
    """Every engine (cloud-sd: cloud-only sessions, tail and ngram drafts), N = 1 and 3,
    against null:256: the keys docs/benchmarks/verifier.md's table is built from."""
    out = tmp_path / "load.json"
    cmd = [sys.executable, "-m", "bench", "verifier_load", "--model", "null:256",
           "--sessions", "1,3", "--seconds", "0.5", "--min-rounds", "2", "--out", str(out),
           "--engines", "batched,serial,cloud-sd", "--cloud-model", ""]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = orjson.loads(out.read_bytes())
    assert result["sessions"] == [1, 3]
    for key in ("batched_tokens_per_s", "serial_tokens_per_s", "batched_p99_ms", "serial_p99_ms",
                "cloud-sd_tokens_per_s"):  # fmt: skip
        assert len(result[key]) == 2 and all(x > 0 for x in result[key]), key
    assert all(0 <= x <= 1 for x in result["cloud-sd_cloud_share"])
    assert out.with_suffix(".png").stat().st_size > 1000
    assert_provenance(result)


def test_prefix_bench_smoke(tmp_path: Path) -> None:
    """bench.studies.prefix against null:512: the conversation's later turns and the later sessions
    of the shared system prompt compute only what the cache lacks (prefix_cache = tenant), and
    everything without it; the keys docs/how-it-works/engine.md's line is built from."""
    out = tmp_path / "prefix.json"
    cmd = [sys.executable, "-m", "bench", "prefix", "--model", "null:512", "--turns", "3",
           "--sessions", "3", "--system-tokens", "100", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = orjson.loads(out.read_bytes())
    on, off = result["tenant"], result["off"]
    assert [t["cached_tokens"] for t in off["conversation"]] == [0, 0, 0]
    turns = on["conversation"]
    assert turns[0]["cached_tokens"] == 0 and all(t["cached_tokens"] > 0 for t in turns[1:])
    # every later turn computes less than its prompt: the conversation so far is cached
    assert all(t["computed_tokens"] < t["prompt_tokens"] for t in turns[1:])
    shared = on["shared_system_prompt"]
    assert shared[0]["computed_tokens"] == shared[0]["prompt_tokens"]
    assert all(s["cached_tokens"] >= 96 for s in shared[1:])  # the system prompt, in pages
    assert (
        on["summary"]["shared_prompt_tokens_computed"]
        < off["summary"]["shared_prompt_tokens_computed"]
    )
    assert all(t["ttft_s"] > 0 for t in turns)
    assert_provenance(result)


def test_tree_cost_measures_a_verify_with_and_without_tree_tokens(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """``python -m bench tree_cost`` on the tiny target: a chain's verify forward and the same
    with tree tokens, the fitted cost per tree token beside the emulated one."""
    from bench.studies.tree_cost import main as tree_cost_main

    out = tmp_path / "tree_cost.json"
    args = ["--target", str(tiny_model_dir), "--trees", "0,4,8", "--steps", "2", "--warmup", "1"]
    assert tree_cost_main([*args, "--context", "16", "--out", str(out)]) == 0
    doc = orjson.loads(out.read_bytes())
    assert set(doc["median_forward_s"]) == {"0", "4", "8"}
    assert doc["cost_per_tree_token"] is not None
    assert doc["emulated_cost_per_tree_token"] == pytest.approx(TREE_TOKEN_COST)
    assert_provenance(doc)
