"""``python -m bench overload --quick``: the keys the results are read by, end to end (~25 s), and
the edge tap that the benchmark's round times and its reconnect-without-resumption rest on; the
tenants study (``python -m bench tenants``) beside it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from bench.lib.verifier_state import parse_metrics
from bench.studies import overload, tenants
from bench.studies.overload import Tap, saturation
from bench.studies.tenants import (
    ARMS,
    Arm,
    Refusal,
    Round,
    TenantsConfig,
    bootstrap_ratios,
    summarize,
    targets,
)
from edge_agent.session.transport import Transport
from shared.maths.sampling import SamplingParams
from shared.wire.codec import decode, encode
from shared.wire.messages import Fingerprint, Hello, Propose, Resumed, Verdict, Welcome
from shared.wire.packing import WireContext

REPO = Path(__file__).resolve().parents[2]
LOAD_KEYS = {
    "offered_sessions",
    "completed",
    "failed",
    "goodput_tokens_per_s",
    "p99_round_ms",
    "recovery_s",
}


def _study(out: Path, *args: str) -> dict[str, Any]:
    """``python -m bench ARGS --out OUT`` (under 180 s), its results."""
    cmd = [sys.executable, "-m", "bench", *args, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = orjson.loads(out.read_bytes())
    return result


def test_overload_quick_writes_every_key(tmp_path: Path) -> None:
    out = tmp_path / "overload.json"
    result = _study(out, "overload", "--quick")
    assert {"setup", "unloaded", "loads", "reconnect"} <= set(result)
    loads = result["loads"]
    assert [r["offered_sessions"] for r in loads] == [1, 3] == result["offered_sessions"]
    for key in ("completed", "failed", "goodput_tokens_per_s", "p99_round_ms", "recovery_s"):
        assert result[key] == [r[key] for r in loads], key  # one entry per offered load
    for r in loads:
        assert set(r) >= LOAD_KEYS, r
        assert r["completed"] > 0 and r["failed"] == 0, r
        assert r["goodput_tokens_per_s"] > 0 and r["p99_round_ms"] > 0
        assert r["recovery_s"] is not None and r["recovery_s"] >= 0
    # Three users on two session slots: sessions wait in the verifier's admission line, and
    # none fails for it; the wait and the line's length are reported beside each other.
    assert result["offered_x"] == [0.5, 1.5]
    queued = loads[1]
    assert queued["queued_sessions"] >= 1 and queued["line_max"] >= 1, queued
    assert queued["admission_wait_ms_p99"] > 0, queued
    assert loads[0]["admission_wait_ms_p99"] == 0.0 and loads[0]["line_max"] <= 1
    sat = result["saturation"]
    assert sat["failed_while_line_had_room"] == 0 and len(sat["goodput_vs_peak"]) == 2
    assert sat["peak_goodput_tokens_per_s"] == max(result["goodput_tokens_per_s"])
    setup = result["setup"]
    assert setup["quick"] and setup["verify_ms"] == 20 and "sources" in setup
    assert setup["max_sessions"] == 2 and setup["admission_queue"] == 256
    rc = result["reconnect"]
    for variant in ("with_resume", "without_resume"):
        v = rc[variant]
        assert v["text_unchanged"] and v["drop_to_verdict_s"] > 0, v
        assert all(n >= 1 for n in v["reconnects"]), v
    # Without resumption the prompt and the committed text are run again; with it (when the
    # verifier offers it), none of them.
    assert rc["without_resume"]["reprefilled_tokens"] >= rc["prompt_tokens"]
    if rc["resumption_offered"]:
        assert rc["with_resume"]["resumed_sessions"] >= 1
        assert rc["with_resume"]["reprefilled_tokens"] < rc["prompt_tokens"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Pipe:
    """A transport whose replies are scripted; what is sent is kept."""

    def __init__(self, replies: list[bytes]) -> None:
        self.replies = replies
        self.sent: list[bytes] = []

    async def send(self, data: bytes) -> None:
        self.sent.append(data)

    async def recv(self) -> bytes:
        return self.replies.pop(0)

    async def close(self) -> None:
        pass


async def test_tap_times_rounds_and_can_hide_the_resume_token() -> None:
    fp = Fingerprint("m", 64, "t")
    hello = Hello(fingerprint=fp, sampling=SamplingParams(0.0))
    welcome = Welcome(fp, "s1", 8, 4096, 4096, 1 << 20, resume="secret", resumed=Resumed(3, 7))
    # a greedy session: q in four bits
    ctx = WireContext(vocab_size=64, max_gamma=8, max_fixed=4096, max_frame=1 << 20, coarse_q=True)
    propose = Propose(0, 5, 3, np.array([7, 8]), np.array([0.5, 0.5], np.float32))
    verdict = Verdict(0, 5, 2, None, None, None)
    for strip in (False, True):
        tap = Tap(strip_resume=strip)
        inner = _Pipe([encode(welcome), encode(verdict, ctx)])
        t: Transport = tap.wrap(inner)
        await t.send(encode(hello))
        got = decode(await t.recv())
        assert isinstance(got, Welcome) and got.resume == (None if strip else "secret")
        assert got.resumed == welcome.resumed
        await t.send(encode(propose, ctx))
        assert isinstance(decode(await t.recv(), ctx), Verdict)
        assert len(tap.rounds) == 1 and len(tap.verdicts) == 1 and tap.resume_offered == 1
        assert len(inner.sent) == 2 and tap.undecoded == 0


def test_saturation_reads_goodput_past_its_peak_against_the_peak() -> None:
    def load(n: int, goodput: float, failed: int, line_max: int) -> dict[str, Any]:
        return {
            "offered_sessions": n,
            "offered_x": n / 4,
            "goodput_tokens_per_s": goodput,
            "failed": failed,
            "line_max": line_max,
        }

    loads = [load(1, 5.0, 0, 0), load(4, 13.0, 0, 1), load(8, 12.0, 0, 5), load(16, 11.0, 2, 8)]
    sat = saturation(loads, max_sessions=4, admission_queue=8)
    assert sat["peak_goodput_tokens_per_s"] == 13.0
    assert sat["saturated_at_sessions"] == 4 and sat["saturated_at_x"] == 1.0
    assert sat["goodput_vs_peak"] == [round(5 / 13, 3), 1.0, round(12 / 13, 3), round(11 / 13, 3)]
    assert sat["min_goodput_vs_peak_past_saturation"] == round(11 / 13, 3)
    assert sat["within_10pct_of_peak"] is False  # 11 / 13 < 0.9
    # The last load filled the line (8 of 8): its failures are the bound's, not counted.
    assert sat["failed_while_line_had_room"] == 0 and sat["loads_whose_line_had_room"] == 3
    assert saturation(loads[:3], 4, 8)["within_10pct_of_peak"] is True
    empty = saturation([], 4, 8)
    assert (
        empty["min_goodput_vs_peak_past_saturation"] is None and not empty["within_10pct_of_peak"]
    )


def test_parse_metrics_keeps_labels() -> None:
    text = (
        "# HELP x y\n# TYPE x counter\nwanspec_fixed_tokens_total 12\n"
        'wanspec_sessions_refused_total{reason="overloaded"} 3\n'
    )
    m = parse_metrics(text)
    assert m["wanspec_fixed_tokens_total"] == 12
    assert m['wanspec_sessions_refused_total{reason="overloaded"}'] == 3


def test_one_tenants_long_prompts_leave_the_others_rounds_flowing(tmp_path: Path) -> None:
    """``tenants --smoke`` (issue 38): two sessions of one token looping the longest prompts
    the tiny verifier takes, beside four honest users. Behaviour: the honest rounds keep
    flowing (their verdicts a second at least half of what they are without the attacker, their
    p99 round at most 3 times: before the fair scheduler, 0.17 and 4.5; with it, 0.87 and 1.3),
    with no failure and no refusal; and the output has every key, the ratios their intervals,
    the attacker's prompt cut to the tiny model's context."""
    out = tmp_path / "tenants.json"
    result = _study(out, "tenants", "--smoke")
    assert {"targets", "ratios", "arms", "setup"} <= set(result)
    tg = result["targets"]
    for key in ("goodput_ratio", "p99_round_ratio"):
        assert tg[key]["value"] > 0 and isinstance(tg[key]["met"], bool), tg[key]
        lo, hi = tg[key]["ci95"]
        assert lo <= hi, tg[key]
    for key in ("honest_failures", "honest_refusals_while_prefilling"):
        assert tg[key]["value"] >= 0 and isinstance(tg[key]["met"], bool), tg[key]
    assert tg["all_met"] == all(v["met"] for k, v in tg.items() if k != "all_met")
    assert tg["goodput_ratio"]["value"] >= 0.5, tg
    assert tg["p99_round_ratio"]["value"] <= 3.0, tg
    assert tg["honest_failures"]["value"] == 0 and tg["honest_refusals_while_prefilling"]["met"]
    assert "over honest users" in result["ratios"]["interval"]
    assert set(result["arms"]) == set(ARMS)
    for name in ARMS:
        arm = result["arms"][name]
        h, a = arm["honest"], arm["attacker"]
        assert h["verdicts"] > 0 and h["verdicts_per_s"] > 0 and h["committed_tokens_per_s"] > 0
        assert 0 < h["p50_round_ms"] <= h["p99_round_ms"], h
        assert h["failures"] == len(h["failure_list"]) and h["refusals"] >= 0
        assert h["round_ms_quantiles"]["99"] == h["p99_round_ms"]
        tl = arm["timeline"]
        assert len(tl["honest_verdicts_per_s"]) >= 1 and tl["queue_delay_s"]
        assert a["prompts_answered"] <= a["prompts_sent"]
    assert result["arms"]["honest_only"]["attacker"]["prompts_sent"] == 0
    assert result["arms"]["with_attacker"]["attacker"]["prompts_sent"] > 0
    s = result["setup"]
    assert s["smoke"] and s["commit"] and s["date"] and s["host"]["cpus"]
    # The tiny model's context is 512 tokens: the attacker's 8,000 are cut to fit, and said so.
    assert s["attack_prompt_requested"] == 8000
    assert s["attack_prompt_tokens"] == s["max_context"] - s["gamma"] - 1 < 8000
    assert "max_context" in s["attack_prompt_note"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _arm(name: str, verdicts_per_user: list[int], round_s: float) -> Arm:
    arm = Arm(name, 0.0, 10.0, 20.0)
    for user, n in enumerate(verdicts_per_user):
        for k in range(n):
            arm.rounds.append(Round(user, k * 9.0 / n, round_s, k == 0, 1))
    return arm


def test_tenants_ratios_intervals_and_targets() -> None:
    """The ratios of the honest figures b / a, their bootstrap intervals over users, and the
    targets, on made-up arms: half the verdicts at three times the round time."""
    cfg = TenantsConfig(honest=4, duration_s=10.0, bootstrap=300)
    a = _arm(ARMS[0], [40, 44, 36, 40], 0.1)
    b = _arm(ARMS[1], [20, 22, 18, 20], 0.3)
    b.refusals.append(Refusal("honest", 3.0, "overloaded", 4.0, attack_prompts_in_flight=2))
    b.refusals.append(Refusal("attacker", 4.0, "overloaded", 4.0, attack_prompts_in_flight=2))
    ratios = bootstrap_ratios(a, b, cfg)
    assert ratios["goodput"]["value"] == pytest.approx(0.5)
    lo, hi = ratios["goodput"]["ci95"]
    assert lo <= 0.5 <= hi and hi - lo < 0.2
    assert ratios["p99_round"]["value"] == pytest.approx(3.0)
    arms = {a.name: summarize(a, cfg), b.name: summarize(b, cfg)}
    assert arms[ARMS[1]]["honest"]["refusals"] == 1  # the attacker's own are apart
    assert arms[ARMS[1]]["attacker"]["refusals"] == 1
    tg = targets(ratios, arms)
    assert not tg["goodput_ratio"]["met"] and not tg["p99_round_ratio"]["met"]
    assert tg["honest_failures"]["met"]
    assert tg["honest_refusals_while_prefilling"]["value"] == 1
    assert not tg["all_met"]


def test_tenants_refuses_the_sweeps_settings(capsys: pytest.CaptureFixture[str]) -> None:
    """A setting of the offered-load sweep alone is refused by the tenants study, and one of
    the tenants study's alone by the sweep, not ignored; the tenants' own go over the preset."""
    with pytest.raises(SystemExit):
        tenants.build_parser().parse_args(["--window", "3"])
    assert "--window" in capsys.readouterr().err
    cfg = tenants.config_from_args(tenants.build_parser().parse_args(["--smoke", "--honest", "3"]))
    assert cfg.smoke and cfg.model == "tiny" and cfg.honest == 3 and cfg.attackers == 2
    for argv in (["--smoke"], ["--honest", "3"]):
        with pytest.raises(SystemExit):
            overload.main(argv)
        assert argv[0] in capsys.readouterr().err
