"""Tensor parallelism on the CPU (``cloud-verifier serve --tp N``: torchrun ranks over gloo,
transformers' own TP, :mod:`cloud_verifier.engine.tp`), against the same model unsharded in the same
test:

* 2 ranks, a tiny Llama (4 heads, 2 KV heads): the edge's greedy text through the sharded
  service equals target-only greedy decoding; the per-position probabilities the service
  returns (federated replies: exact p(x_j) of each draft token, and the top-k of p at every
  position) equal the unsharded service's within 1e-5; SIGTERM stops every rank, exit 0;
* 3 ranks, the default model (SmolLM2-135M: 9 heads, 3 KV heads, so 3 is the smallest
  split it allows; 2 is refused with a clear error): the same two checks;
* the death of a rank stops the service (torchrun ends the group, exit status non-zero).

The wire between ranks (rows encoded as int64 tensors) is tested as a pure function.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from cloud_verifier.engine.tp import Rank, decode_rows, encode_rows, rank_from_env, torchrun_args
from edge_agent.session.pipeline_config import PipelineConfig
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import SamplingParams
from shared.runtime.batched_lm import Row
from shared.runtime.kv_pool import SlotPages
from shared.runtime.models import LoadedModel, check_tp_size, load_model
from shared.wire.messages import SUBPROTOCOL, FederatedReply, Hello, Propose, ReplyMode, Welcome
from testkit.harness import REPO, VerifierProcess, free_port, make_agent, target_greedy
from testkit.net.stream_ws import StreamWS
from testkit.probe import ProbeClient, auth_headers
from testkit.tiny_models import build_tiny_model

TOKEN = "tp-token-0123456789abcdef"
PROMPT = [1, 10, 20, 30, 40]
#: Sharded and unsharded float32 forwards differ by reduction order only.
PROB_TOL = 1e-5


# ------------------------------------------------------------------------------ pure parts


def test_rows_round_trip_between_ranks() -> None:
    rows = [
        Row(SlotPages([3, 7], 20), 18, (5, 6, 7), 2),
        Row(SlotPages([0], 1), 0, (9,), 1),
    ]
    back = decode_rows(encode_rows(rows))
    assert [(r.start, r.ids, r.keep, r.slot.pages) for r in back] == [
        (r.start, r.ids, r.keep, r.slot.pages) for r in rows
    ]


def test_rank_from_env_and_the_torchrun_line() -> None:
    assert rank_from_env({}) is None
    assert rank_from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == Rank(1, 2, 1)
    with pytest.raises(ValueError, match="outside"):
        rank_from_env({"RANK": "2", "WORLD_SIZE": "2"})
    assert torchrun_args(4, ["serve", "--tp", "4"]) == [
        "--standalone", "--nproc-per-node=4", "-m", "cloud_verifier.daemon.cli", "serve", "--tp",
        "4",
    ]  # fmt: skip


def test_the_launcher_hands_the_systemd_watchdog_to_rank_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under systemd, WATCHDOG_PID names the launcher; rank 0 (a child) must ping instead."""
    import torch.distributed.run

    from cloud_verifier.engine.tp import launch_ranks
    from shared.service.sdnotify import Notifier

    seen: dict[str, object] = {}

    def fake_torchrun(argv: list[str]) -> None:
        seen["argv"] = argv
        seen["interval"] = Notifier.from_env(dict(os.environ)).watchdog_interval

    monkeypatch.setattr(torch.distributed.run, "main", fake_torchrun)
    monkeypatch.setenv("WATCHDOG_USEC", "60000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/none")
    assert launch_ranks(2, ["serve", "--tp", "2"]) == 0
    assert seen["argv"] == torchrun_args(2, ["serve", "--tp", "2"])
    assert seen["interval"] == 20.0  # a child process would ping every 20 s


def test_heads_that_do_not_divide_are_refused_before_loading() -> None:
    class Cfg:
        num_attention_heads, num_key_value_heads = 9, 3

    check_tp_size(Cfg(), 3)
    with pytest.raises(ValueError, match=r"heads \(9\) and the KV heads \(3\) to divide by 2"):
        check_tp_size(Cfg(), 2)


# ------------------------------------------------------------------------------ services


async def _federated_probs(
    port: int, model: LoadedModel, fixed: list[int], draft: list[int]
) -> FederatedReply:
    """One federated round: p(x_j) of each draft token and the top-k of p at each position."""
    hello = Hello(
        model.fingerprint,
        SamplingParams(1.0),
        ReplyMode.FEDERATED,
        CorrectionMode.TOPK,
        k=16,
    )
    async with aiohttp.ClientSession() as http:
        ws = StreamWS(
            await http.ws_connect(
                f"ws://127.0.0.1:{port}/v1/session",
                headers=auth_headers(TOKEN),
                protocols=(SUBPROTOCOL,),
            )
        )
        client = ProbeClient(ws)
        welcome = await client.hello(hello)
        assert isinstance(welcome, Welcome)
        q = np.full(len(draft), 0.5, np.float32)
        await client.send(Propose(0, 0, 0, np.array(draft), q, np.array(fixed)))
        reply = await client.recv_as(FederatedReply, timeout=120.0)
        await ws.close()
    return reply


def _max_prob_diff(a: FederatedReply, b: FederatedReply) -> float:
    diff = float(np.max(np.abs(a.p_draft - b.p_draft)))
    for da, db in zip(a.dists, b.dists, strict=True):
        assert da.ids[:3].tolist() == db.ids[:3].tolist()  # the same most likely tokens
        diff = max(diff, float(np.max(np.abs(da.probs[:3] - db.probs[:3]))))
    return diff


def _ranks(torchrun_pid: int) -> dict[int, int]:
    """rank → pid of the worker processes torchrun (``torchrun_pid``) started."""
    out: dict[int, int] = {}
    for child in Path(f"/proc/{torchrun_pid}/task").glob("*/children"):
        for pid in child.read_text().split():
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            if b"RANK" in env:
                out[int(env[b"RANK"])] = int(pid)
    return out


async def _check_against_unsharded(
    tmp_path: Path, model_spec: str, target: LoadedModel, draft: LoadedModel, tp: int, n: int
) -> tuple[float, int]:
    """Start the unsharded and the ``tp``-rank service side by side; returns (max |Δp|, forwards
    rank 1 ran) after checking the greedy text and a clean SIGTERM."""
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    single = VerifierProcess(model_spec, free_port(), tokens, log_path=tmp_path / "single.log")
    sharded = VerifierProcess(
        model_spec, free_port(), tokens, args=["--tp", str(tp)], log_path=tmp_path / "tp.log"
    )
    single.start()
    sharded.start()
    try:
        await single.wait_ready(300)
        await sharded.wait_ready(300)
        # Ready (/health 200) only once every rank has loaded its shards and met rank 0.
        met = (tmp_path / "tp.log").read_text().count("following rank 0")
        assert met == tp - 1 and len(_ranks(sharded.pid)) == tp
        agent = make_agent(draft, sharded.url, TOKEN)
        try:
            # No co-generation: on a loaded machine the verifier could write the whole text
            # before the edge's first batch, and the rounds (with their rollbacks) are the point.
            cfg = PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(0.0), cogen=False)
            gen = await agent.generate(PROMPT, cfg, max_tokens=n)
        finally:
            agent.close()
        assert gen.generated == target_greedy(target, PROMPT, n)
        assert gen.stats.rejections > 0  # rejections and rollbacks crossed the ranks too
        fixed, drafted = PROMPT + gen.generated[:4], gen.generated[4:10]
        a = await _federated_probs(single.port, target, fixed, drafted)
        b = await _federated_probs(sharded.port, target, fixed, drafted)
        diff = _max_prob_diff(a, b)
        rc, _ = await sharded.terminate(60.0)
        assert rc == 0, (tmp_path / "tp.log").read_text()[-3000:]
        log = (tmp_path / "tp.log").read_text()
        stopped = [ln for ln in log.splitlines() if "stopped after" in ln]
        assert len(stopped) == tp - 1, log[-3000:]  # every follower left on STOP
        forwards = int(stopped[0].split("stopped after ")[1].split()[0])
        return diff, forwards
    finally:
        await sharded.stop()
        await single.stop()


async def test_two_ranks_tiny_model_equal_the_unsharded_run(tmp_path: Path) -> None:
    target_dir = build_tiny_model(tmp_path / "target", vocab_size=64, seed=0)
    draft_dir = build_tiny_model(tmp_path / "draft", vocab_size=64, seed=1)
    target, draft = load_model(str(target_dir)), load_model(str(draft_dir))
    diff, forwards = await _check_against_unsharded(
        tmp_path, str(target_dir), target, draft, tp=2, n=30
    )
    print(f"tp=2 tiny: max |Δp| = {diff:.2e}, rank 1 ran {forwards} forwards")
    assert diff <= PROB_TOL and forwards > 10


async def test_three_ranks_default_model_equal_the_unsharded_run(tmp_path: Path) -> None:
    target = load_model("default")
    draft = load_model("self:skip=12", base=target)
    diff, forwards = await _check_against_unsharded(tmp_path, "default", target, draft, tp=3, n=12)
    print(f"tp=3 default: max |Δp| = {diff:.2e}, rank 1 ran {forwards} forwards")
    assert diff <= PROB_TOL and forwards > 3


def test_two_ranks_of_the_default_model_is_a_clear_error(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "cloud_verifier.daemon.cli", "serve", "--tp", "2", "--port",
           str(free_port()), "--token-file", str(tokens)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "KV heads (3) to divide by 2" in proc.stdout + proc.stderr


async def test_the_death_of_a_rank_stops_the_service(tmp_path: Path) -> None:
    target_dir = build_tiny_model(tmp_path / "target", vocab_size=64, seed=0)
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    sharded = VerifierProcess(
        str(target_dir), free_port(), tokens, args=["--tp", "2"], log_path=tmp_path / "tp.log"
    )
    sharded.start()
    try:
        await sharded.wait_ready(300)
        ranks = _ranks(sharded.pid)
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        rc = await sharded._reap(60.0)
        assert rc not in (None, 0), (tmp_path / "tp.log").read_text()[-3000:]
        print(f"rank 1 killed: service exited {rc} after {time.monotonic() - t0:.1f} s")
        for pid in ranks.values():
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid)
    finally:
        await sharded.stop()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True
