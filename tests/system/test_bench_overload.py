"""``python -m bench.overload --quick``: the keys the results are read by, end to end (~25 s), and
the edge tap that the benchmark's round times and its reconnect-without-resumption rest on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson

from bench.overload import Tap, parse_metrics
from edge_agent.transport import Transport
from shared.wire.params import SamplingParams
from shared.wire.protocol import (
    Fingerprint,
    Hello,
    Propose,
    Resumed,
    Verdict,
    Welcome,
    WireContext,
    decode,
    encode,
)

REPO = Path(__file__).resolve().parents[2]
LOAD_KEYS = {
    "offered_sessions",
    "completed",
    "failed",
    "goodput_tokens_per_s",
    "p99_round_ms",
    "recovery_s",
}


def test_overload_quick_writes_every_key(tmp_path: Path) -> None:
    out = tmp_path / "overload.json"
    cmd = [sys.executable, "-m", "bench.overload", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = orjson.loads(out.read_bytes())
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
    setup = result["setup"]
    assert setup["quick"] and setup["verify_ms"] == 20 and "sources" in setup
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
    ctx = WireContext(vocab_size=64, max_gamma=8, max_fixed=4096, max_frame=1 << 20)
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


def test_parse_metrics_keeps_labels() -> None:
    text = (
        "# HELP x y\n# TYPE x counter\nwanspec_fixed_tokens_total 12\n"
        'wanspec_sessions_refused_total{reason="overloaded"} 3\n'
    )
    m = parse_metrics(text)
    assert m["wanspec_fixed_tokens_total"] == 12
    assert m['wanspec_sessions_refused_total{reason="overloaded"}'] == 3
