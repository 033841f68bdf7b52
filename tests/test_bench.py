"""The benchmark: its analytical ceiling, the verifier's timing pad, and a smoke run end to end."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import pytest
import torch

from bench.probe import Driver, ProbeClient
from bench.run import ceiling
from bench.verifier import PaddedTarget
from bench.verifier import main as padded_verifier_main
from cloud_verifier.cli import main as verifier_main
from cloud_verifier.targets import NullTarget
from shared.batched_lm import Row
from shared.kv_pool import SlotPages
from shared.pipeline_config import Mode
from shared.protocol import SUBPROTOCOL, Fingerprint, Hello
from shared.sampling import SamplingParams

REPO = Path(__file__).resolve().parent.parent


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_padded_verifier_process_pads_forwards() -> None:
    """``python -m bench.verifier``: the product's serve path, every forward padded."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANSPEC_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.verifier", "--model", "null:64", "--insecure-no-auth",
         "--port", str(port), "--heartbeat", "0", "--log-level", "warning",
         "--emulate-verify-ms", "80"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            health: dict[str, object] = {}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/health") as r:
                        health = await r.json()
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.1)
            assert health.get("status") == "ready", health
            assert "forwards padded to 80 ms" in str(health["reason"])
            ws = await http.ws_connect(
                f"http://127.0.0.1:{port}/v1/session", protocols=(SUBPROTOCOL,)
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


@pytest.mark.slow
def test_bench_smoke_writes_all_outputs(tmp_path: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--out", str(tmp_path)],
        capture_output=True, cwd=REPO, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    doc = orjson.loads((tmp_path / "results.json").read_bytes())
    assert {"machine", "settings", "regimes", "summary", "runs", "plots"} <= set(doc)
    modes = {r["mode"] for r in doc["summary"]}
    assert {"ar", "assisted", "stop-and-wait", "pipelined D=1", "pipelined D=2"} <= modes
    assert {r["rtt_ms"] for r in doc["summary"]} == {0.0, 50.0}
    for row in doc["summary"]:
        assert row["tokens_per_s"] > 0
        if row["mode"] in ("stop-and-wait", "pipelined D=1", "pipelined D=2"):
            for key in (
                "acceptance",
                "mean_accepted_per_round",
                "uplink_bytes_per_round",
                "bytes_per_token",
                "ceiling_tokens_per_s",
                "fraction_of_ceiling",
            ):
                assert row[key] is not None, key
            assert row["uplink_bytes_per_round"] < 100  # ids + q, not distributions
    md = (tmp_path / "results.md").read_text()
    assert "PicoSpec regime" in md and "| RTT ms | mode |" in md
    for png in doc["plots"]:
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_federate_eval_smoke(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.federate_eval", "--smoke", "--prompts", "1",
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
    assert (tmp_path / "federated.png").read_bytes()[:4] == b"\x89PNG"


def test_gpu_bench_refuses_without_cuda_and_runs_small_on_the_cpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.gpu import main as gpu_main

    if not torch.cuda.is_available():
        assert gpu_main(["--out", str(tmp_path / "no.json")]) == 2
        assert "CUDA device" in capsys.readouterr().err
        assert not (tmp_path / "no.json").exists()
    out = tmp_path / "gpu.json"
    args = ["--small", "--device", "cpu", "--no-compile", "--reps", "2", "--batches", "1,2"]
    assert gpu_main([*args, "--context", "16", "--out", str(out)]) == 0
    result = orjson.loads(out.read_bytes())
    assert result["verify_eager_b1_ms"] > 0 and result["draft_step_eager_ms"] > 0


def test_verifier_load_smoke(tmp_path: Path) -> None:
    """Both engines, N = 1 and 3, against null:256: the keys the README table is built from."""
    out = tmp_path / "load.json"
    cmd = [sys.executable, "-m", "bench.verifier_load", "--model", "null:256", "--sessions", "1,3",
           "--seconds", "0.5", "--min-rounds", "2", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = orjson.loads(out.read_bytes())
    assert result["sessions"] == [1, 3]
    for key in ("batched_tokens_per_s", "serial_tokens_per_s", "batched_p99_ms", "serial_p99_ms"):
        assert len(result[key]) == 2 and all(x > 0 for x in result[key]), key
    assert out.with_suffix(".png").stat().st_size > 1000
