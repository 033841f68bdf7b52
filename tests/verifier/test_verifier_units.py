"""Small pure pieces of the verifier: metrics exposition, bearer tokens, the null target."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from cloud_verifier.daemon.auth import Authenticator, AuthError, parse_tokens
from cloud_verifier.daemon.metrics import VerifierMetrics
from cloud_verifier.engine.targets import NullTarget, compiles, parse_null_spec
from shared.runtime.batched_lm import Row
from shared.runtime.kv_pool import SlotPages
from shared.service.config import Switch
from shared.service.metrics import Counter, Gauge, Histogram, Registry

pytestmark = pytest.mark.fast


def test_metrics_render() -> None:
    reg = Registry()
    c = Counter(reg, "a_total", "A count.")
    lab = Counter(reg, "b_total", "Per thing.", labels=("thing",))
    g = Gauge(reg, "c", "A gauge.")
    h = Histogram(reg, "d_seconds", "Times.", buckets=(0.1, 1.0))
    c.inc()
    c.inc(2)
    lab.labels(thing='x"y\\z\n').inc()
    lab.inc(thing="b")
    g.set(3)
    g.dec(0.5)
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    text = reg.render()
    assert text.endswith("\n")
    assert "# HELP a_total A count.\n# TYPE a_total counter\na_total 3\n" in text
    assert 'b_total{thing="b"} 1\nb_total{thing="x\\"y\\\\z\\n"} 1' in text
    assert "c 2.5\n" in text
    assert 'd_seconds_bucket{le="0.1"} 1\nd_seconds_bucket{le="1"} 2\n' in text
    assert 'd_seconds_bucket{le="+Inf"} 3\nd_seconds_sum 5.55\nd_seconds_count 3\n' in text
    assert h.count() == 3 and h.sum() == pytest.approx(5.55)
    with pytest.raises(ValueError, match="decrease"):
        c.inc(-1)
    c.follow(7.5)  # a total another object owns: up to it, never down
    c.follow(4.0)
    lab.follow(2, thing="b")
    assert c.get() == 7.5 and lab.get(thing="b") == 2
    with pytest.raises(ValueError, match="labels"):
        lab.inc(other="x")
    with pytest.raises(ValueError, match="already"):
        Counter(reg, "a_total", "again")
    with pytest.raises(ValueError, match="invalid metric name"):
        Gauge(reg, "bad-name", "x")


def test_verifier_metric_names_are_stable() -> None:
    names = VerifierMetrics().registry.names()
    for required in (
        "wanspec_spec_decode_num_drafts_total",
        "wanspec_spec_decode_num_draft_tokens_total",
        "wanspec_spec_decode_num_accepted_tokens_total",
        "wanspec_spec_decode_num_accepted_tokens_per_pos_total",
        "wanspec_stale_proposes_dropped_total",
        "wanspec_bytes_received_total",
        "wanspec_bytes_sent_total",
        "wanspec_bad_frames_total",
        "wanspec_sessions_active",
        "wanspec_verify_seconds",
    ):
        assert required in names
    page = Path(__file__).resolve().parents[2] / "docs" / "cloud" / "metrics.md"
    text = page.read_text()
    undocumented = [n for n in names if f"`{n}`" not in text and f"`{n}{{" not in text]
    assert not undocumented, f"document these in {page}: {undocumented}"


def test_tokens(tmp_path: Path) -> None:
    assert parse_tokens("# c\n\n  a1 \nb2\n") == ("a1", "b2")
    with pytest.raises(AuthError, match="line 1"):
        parse_tokens("a b\n")
    f = tmp_path / "tokens"
    f.write_text("old\n")
    auth = Authenticator(token_file=f)
    assert auth.check("Bearer old") and auth.check("bearer old")
    assert not auth.check(None) and not auth.check("Bearer") and not auth.check("Basic old")
    assert not auth.check("Bearer new")
    f.write_text("old\nnew\n")  # rotation without a restart
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert auth.check("Bearer new") and auth.check("Bearer old")
    (tmp_path / "empty").write_text("# empty\n")
    with pytest.raises(AuthError, match="no bearer token"):
        Authenticator(token_file=tmp_path / "empty")
    with pytest.raises(AuthError, match="cannot read"):
        Authenticator(token_file=tmp_path / "absent")
    assert Authenticator.insecure().check(None)


def test_null_target_is_deterministic_and_fast() -> None:
    assert parse_null_spec("null:49152") == 49152 and parse_null_spec("default") is None
    t = NullTarget(49152)
    pool = t.allocate(8, 16)
    a, b = SlotPages(), SlotPages()
    pool.reserve(a, 7)
    pool.reserve(b, 6)
    t0 = time.perf_counter()
    la = t.forward([Row(a, 0, (1, 2, 3, 4, 5, 6), 6)])
    assert time.perf_counter() - t0 < 0.05
    assert la.shape == (6, 49152)
    # position and token pick the row, whatever the batch
    both = t.forward([Row(b, 0, (1, 2, 3, 4, 5, 6), 6), Row(a, 6, (7,), 1)])
    torch.testing.assert_close(both[:6], la)
    assert both.shape == (7, 49152) and not torch.equal(both[6], la[5])


def test_serve_flags_go_both_ways_and_an_unknown_one_gets_the_serve_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from cloud_verifier.daemon.cli import build_parser
    from shared.service.cli_args import parse_args

    parser = build_parser()
    assert parse_args(parser, ["serve", "--no-insecure-no-auth"]).insecure_no_auth is False
    assert parse_args(parser, ["serve"]).insecure_no_auth is None
    with pytest.raises(SystemExit) as exit_:
        parse_args(parser, ["serve", "--bogus"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "cloud-verifier serve: error: unrecognized arguments: --bogus" in err
    assert "--cloud-draft-length" in err  # the serve usage, which lists its flags


def test_a_token_file_others_can_read_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Accepted (the service still starts), with a warning naming the fix; a private file is
    read in silence. The edge's token file is checked the same way."""
    from edge_agent.runtime.settings import read_secret_file

    f = tmp_path / "tokens"
    f.write_text("secret-token\n")
    f.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        Authenticator(token_file=f)
        assert read_secret_file(f, "token_file") == "secret-token"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("readable by other users (mode 0644)" in w for w in warnings)
    assert all(f"chmod 600 {f}" in w for w in warnings)
    caplog.clear()
    f.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        Authenticator(token_file=f)
        read_secret_file(f, "token_file")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_compile_auto_is_on_for_cuda_only() -> None:
    """The one rule for the target and the cloud draft model (the ``compile`` setting)."""
    assert compiles(Switch.AUTO, "cuda:0") and compiles(Switch.AUTO, "cuda")
    assert not compiles(Switch.AUTO, "cpu") and not compiles(Switch.AUTO, "mps")
    assert compiles(Switch.ON, "cpu") and not compiles(Switch.OFF, "cuda:0")
