"""``edge-agent`` as a user meets it: mistakes are one line and exit status 2 before torch is
imported; a real ``generate`` and ``serve`` name the draft's device and draw no progress bars."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from edge_agent.daemon.cli import _UNLISTED, build_parser
from edge_agent.daemon.progress import check_cuda
from edge_agent.runtime.loading import device_line
from edge_agent.runtime.settings import EdgeSettings
from shared.runtime.device import cuda_hint
from shared.runtime.models import LoadedModel, load_model
from shared.service.cli_args import parse_args
from shared.service.config import ConfigError
from tests.edge_helpers import Servers, clean_env

REPO = Path(__file__).resolve().parents[2]

# Runs main() once per argv in one fresh interpreter; reports each exit status and stderr, and
# whether torch/transformers were imported by the end.
_RUNNER = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from edge_agent.daemon.cli import main
    out = []
    for argv in json.loads(sys.argv[1]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code
        out.append({"argv": argv, "rc": rc, "stderr": err.getvalue()})
    heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
    print(json.dumps({"runs": out, "heavy": heavy}))
    """
)


# ``edge-agent ARGS`` that also says on stderr whether tqdm (which reads TQDM_* once, when first
# imported; transformers' GGUF conversion draws its bar with it) was imported with its bars off.
_MAIN_WITH_TQDM_SPY = textwrap.dedent(
    """
    import os, sys
    class Spy:
        def find_spec(self, name, path=None, target=None):
            if name == "tqdm":
                off = os.environ.get("TQDM_DISABLE")
                sys.stderr.write(f"<<tqdm imported, TQDM_DISABLE={off}>>\\n")
                sys.meta_path.remove(self)
            return None
    sys.meta_path.insert(0, Spy())
    from edge_agent.daemon.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)
TQDM_OFF = "<<tqdm imported, TQDM_DISABLE=1>>"


def run_mains(argvs: list[list[str]], env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(argvs)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_mistakes_are_one_line_and_status_2_before_torch_is_imported(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret\n")
    token.chmod(0o600)
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("gama = 4\n")
    missing = str(tmp_path / "missing.gguf")
    tok = ["--token-file", str(token)]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        cases: list[tuple[list[str], str]] = [
            (["serve", "--draft", missing, *tok], "setting 'draft' (from command line --draft)"),
            (["generate", "hi", "--draft", missing, *tok], "setting 'draft'"),
            (["demo", "--draft", missing], "setting 'draft'"),
            (["chat", "--draft", missing, "--port", str(free_port()), *tok], "setting 'draft'"),
            (["serve", "--draft-base", missing, *tok], "setting 'draft_base'"),
            (["demo", "--target", missing], "setting 'target'"),
            (["serve", "--port", port, *tok], "Address already in use"),
            (["generate", "hi", "--token-file", str(tmp_path / "none")], "setting 'token_file'"),
            (["generate", "hi", "--verifier", "http://x:1/v1/session"], "not a ws:// or wss://"),
            (["generate", "hi", "--config", str(bad_toml)], "setting 'gama'"),
            (["chat", "--config", str(bad_toml)], "setting 'gama'"),
            (["serve", "--port", "99999"], "above the maximum 65535"),
            # A byte that is not UTF-8 reaches argv as U+DC80-U+DCFF (surrogateescape).
            (["generate", "ab\udcffcd", *tok], "the prompt is not UTF-8: byte 0xff at character 2"),
            (["demo", "\ud800"], "the prompt holds a lone UTF-16 surrogate U+D800 at character 0"),
        ]
        t0 = time.monotonic()
        result = run_mains([argv for argv, _ in cases], clean_env(tmp_path))
        wall = time.monotonic() - t0
    runs = result["runs"]
    assert isinstance(runs, list)
    for (argv, fragment), run in zip(cases, runs, strict=True):
        lines = run["stderr"].splitlines()
        assert run["rc"] == 2, (argv, run)
        assert len(lines) == 1 and lines[0].startswith("edge-agent: error: "), (argv, lines)
        assert fragment in lines[0], (argv, lines)
    # Nothing heavy was imported to find any of these (a model load takes seconds).
    assert result["heavy"] == [], result["heavy"]
    assert wall < 60


def test_retired_variables_warn_and_a_missing_token_file_is_said(tmp_path: Path) -> None:
    env = clean_env(tmp_path, WANSPEC_VERIFIER="http://old:1", WANSPEC_EDGE_GAMMA="0")
    result = run_mains([["generate", "hi"]], env)
    (run,) = result["runs"]  # type: ignore[misc]
    assert run["rc"] == 2
    assert "setting 'gamma' (from environment variable WANSPEC_EDGE_GAMMA)" in run["stderr"]
    assert "WANSPEC_VERIFIER is not read" not in run["stderr"]  # the settings failed first
    env["WANSPEC_EDGE_GAMMA"] = "4"
    env["WANSPEC_EDGE_DRAFT"] = str(tmp_path / "none.gguf")  # stop before loading
    (run,) = run_mains([["generate", "hi"]], env)["runs"]  # type: ignore[misc]
    warnings = [ln for ln in run["stderr"].splitlines() if "warning" in ln]
    assert any("WANSPEC_VERIFIER is not read" in w for w in warnings), run
    assert any("no token_file" in w for w in warnings), run
    assert run["stderr"].splitlines()[-1].startswith("edge-agent: error: setting 'draft'")


def test_command_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["demo"]).chat is True
    assert parser.parse_args(["demo", "--no-chat-template"]).chat is False
    assert parser.parse_args(["generate", "x"]).chat is False
    assert parser.parse_args(["generate", "x", "--chat"]).chat is True
    assert parser.parse_args(["generate", "x", "--chat-template"]).chat is True
    # Flags a command does not list are still settings it accepts (one settings story).
    names = {f.name for f in __import__("dataclasses").fields(EdgeSettings)}
    for command, unlisted in _UNLISTED.items():
        assert unlisted <= names, command
    args = parser.parse_args(["demo", "--port", "1", "--verifier", "ws://a:1/v1/session"])
    assert (args.port, args.verifier) == ("1", "ws://a:1/v1/session")
    # A switch goes both ways (a file or the environment may have turned it on), and says what
    # it does.
    assert parser.parse_args(["generate", "x", "--no-cogen"]).cogen is False
    assert parser.parse_args(["generate", "x", "--cogen"]).cogen is True
    assert parser.parse_args(["generate", "x"]).cogen is None  # not given: lower sources decide
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--no-cogen", "--hedge", "--predraft"):
        assert flag in text
    assert "co-generation: the verifier decodes" in text and "hedging: tokens drafted" in text
    # An unknown flag is answered with the subcommand's usage, not the top level's.
    with pytest.raises(SystemExit) as exit_:
        parse_args(parser, ["generate", "x", "--bogus"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--hedge" in err
    assert "edge-agent generate: error: unrecognized arguments: --bogus" in err


# ---------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("cli_servers"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def verifier_url(servers: Servers, tiny_model_dir: Path) -> str:
    target: LoadedModel = load_model(str(tiny_model_dir))
    return servers.verifier(target)


def test_generate_names_the_device_and_draws_no_progress_bars(
    tmp_path: Path, servers: Servers, verifier_url: str, tiny_draft_dir: Path
) -> None:
    config = tmp_path / "edge.toml"
    config.write_text(
        f'verifier = "{verifier_url}"\ntoken_file = "{servers.token_file}"\n'
        f'draft = "{tiny_draft_dir}"\ndevice = "cpu"\nthreads = 1\n'
    )
    cmd = [sys.executable, "-c", _MAIN_WITH_TQDM_SPY, "generate", "t1 t2", "--config", str(config)]
    cmd += ["--max-tokens", "6", "--json"]
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=clean_env(tmp_path), timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tokens"] > 0 and result["verified"] is True
    assert "[edge] draft " in out.stderr and " on cpu (float32, 1 thread)" in out.stderr, out.stderr
    assert "Loading weights" not in out.stderr and "it/s]" not in out.stderr, out.stderr
    assert TQDM_OFF in out.stderr, out.stderr
    if result["finish_reason"] == "length":
        assert "[cut at max_tokens = 6]" in out.stderr


def test_serve_names_the_device_draws_no_bars_and_a_second_one_is_refused(
    tmp_path: Path, servers: Servers, verifier_url: str, tiny_draft_dir: Path
) -> None:
    port = free_port()
    config = tmp_path / "edge.toml"
    config.write_text(
        f'verifier = "{verifier_url}"\ntoken_file = "{servers.token_file}"\n'
        f'draft = "{tiny_draft_dir}"\ndevice = "cpu"\nport = {port}\nmodel_id = "tiny"\n'
    )
    cmd = [sys.executable, "-m", "edge_agent.daemon.cli", "serve", "--config", str(config)]
    env = clean_env(tmp_path)
    spied = [sys.executable, "-c", _MAIN_WITH_TQDM_SPY, *cmd[3:]]
    proc = subprocess.Popen(spied, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        while not any("ready:" in ln for ln in lines):
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        log = "".join(lines)
        assert "on cpu (float32" in log, log
        assert "Loading weights" not in log and "it/s]" not in log, log
        assert TQDM_OFF in log, log
        # Another daemon on the same port: one line, status 2, and no model load.
        second = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=60, check=False
        )
        assert second.returncode == 2, second.stderr
        (line,) = second.stderr.splitlines()
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------- the draft's device


def test_when_cuda_is_expected(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    assert cuda_hint({}, dev) is None
    assert cuda_hint({"CUDA_VISIBLE_DEVICES": ""}, dev) is None  # hides every GPU
    assert cuda_hint({"CUDA_VISIBLE_DEVICES": "-1"}, dev) is None
    assert cuda_hint({"CUDA_VISIBLE_DEVICES": "0"}, dev) == "CUDA_VISIBLE_DEVICES=0"
    (dev / "nvhost-ctrl").touch()  # a Jetson
    assert cuda_hint({}, dev) == f"{dev / 'nvhost-ctrl'} exists"
    (dev / "nvhost-ctrl").unlink()
    (dev / "nvidia0").touch()  # a GPU box
    assert cuda_hint({}, dev) == f"{dev / 'nvidia0'} exists"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_missing_is_an_error_when_asked_for_and_a_warning_when_expected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ConfigError, match=r"setting 'device'.*cuda was asked for but torch"):
        check_cuda("cuda")
    assert check_cuda("cpu") is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    warning = check_cuda("auto")
    assert warning is not None
    assert warning.startswith("CUDA was expected (CUDA_VISIBLE_DEVICES=0) but torch ")
    assert warning.endswith("the draft runs on the CPU, slowly")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    if cuda_hint() is None:  # no NVIDIA device nodes here either
        assert check_cuda("auto") is None


def test_device_line_names_the_device(tiny_draft_dir: Path) -> None:
    loaded = load_model(str(tiny_draft_dir))
    n = torch.get_num_threads()
    assert device_line(loaded) == (
        f"draft {loaded.name} on cpu (float32, {n} thread{'' if n == 1 else 's'})"
    )


#: A generation's statistics, as ``--json`` and the daemon's "wanspec" object give them.
STATS: dict[str, Any] = {
    "tokens": 42, "wall_s": 1.9349, "tokens_per_s": 21.707, "ttft_ms": 310.42, "rtt_ms": 101.26,
    "acceptance_rate": 0.78, "mean_accepted_per_round": 2.75, "rounds": 12, "rejections": 1,
    "discarded_batches": 1, "uplink_bytes": 189, "uplink_bytes_per_round": 15.75,
    "downlink_bytes": 622, "downlink_bytes_per_rejection": 41.0, "bytes_per_token": 19.31,
    "mode": "pipelined", "gamma": 12, "depth": 8, "gamma_mean": 8.0, "depth_mean": 6.0,
    "verified": True, "unverified_tokens": 0, "finish_reason": "stop",
    "token_sources": {"edge_draft": 33, "correction": 1, "bonus": 0, "cogenerated": 8,
                      "cloud_draft": 0, "local_draft": 0},
}  # fmt: skip


def test_the_stats_line_is_plain_words_and_the_internals_a_second_line() -> None:
    from edge_agent.runtime.report import detail_line, plain_line

    assert plain_line(STATS) == (
        "42 tokens in 1.93 s (21.7 tok/s) · first token 310 ms · the cloud agreed with 78% of the "
        "edge's drafts · 9 of 42 tokens written by the cloud · round trip 101 ms"
    )
    assert detail_line(STATS) == (
        "pipelined γ=12 D=8 (mean 8/6) · acceptance 78%, 2.75 accepted/round over 12 rounds"
        " · 1 rejection, 1 discarded batch · up 189 B (15.75 B/round), down 622 B"
        " (41 B/rejection) · 19.3 B/token · tokens from: edge drafts 33 (79%),"
        " co-generated 8 (19%), corrections 1 (2%)"
    )
    # Text the draft wrote alone (no verifier) says so, in capitals.
    alone = {**STATS, "verified": False, "unverified_tokens": 1}
    assert " · UNVERIFIED: 1 token from the edge's draft alone (no verifier) · " in plain_line(
        alone
    )


def test_the_details_say_no_rejection_and_a_rejection_with_no_correction_frame() -> None:
    """No rejection: no per-rejection figure (not "n/a", not "None"); a rejection that no
    correction frame answered (co-generated tokens made it known): said, not "0.0 B"."""
    from edge_agent.runtime.report import detail_line

    none = {**STATS, "rejections": 0, "discarded_batches": 0, "downlink_bytes_per_rejection": None}
    line = detail_line(none)
    assert " · 0 rejections, 0 discarded batches · " in line
    assert line.count("down 622 B · ") == 1 and "rejection)" not in line and "None" not in line
    free = {**STATS, "downlink_bytes_per_rejection": 0.0}
    line = detail_line(free)
    assert "down 622 B (no correction frame: co-generated tokens made the rejection known)" in line
    assert "B/rejection" not in line
    line = detail_line({**free, "rejections": 2, "rounds": 1, "discarded_batches": 2})
    assert "over 1 round · 2 rejections, 2 discarded batches · " in line
    assert "(no correction frames: co-generated tokens made the rejections known)" in line


def test_plural_counts() -> None:
    from edge_agent.runtime.report import plural

    assert [plural(n, "answer") for n in (0, 1, 2)] == ["0 answers", "1 answer", "2 answers"]
    assert plural(1, "batch", "batches") == "1 batch" and plural(3, "batch", "batches") == (
        "3 batches"
    )


@pytest.mark.parametrize("verbose", [False, True])
def test_finish_prints_the_details_with_verbose(
    verbose: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    from edge_agent.daemon.cli import _finish

    args = build_parser().parse_args(["generate", "x", *(["-v"] if verbose else [])])
    assert args.verbose is verbose
    _finish(args, {**STATS, "finish_reason": "length", "tokens": 1}, max_tokens=8)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[cut at 1 token: the context is full]"
    assert err[1].startswith("[stats] 1 token in 1.93 s (21.7 tok/s) · first token 310 ms")
    if verbose:
        assert err[2].startswith("[details] pipelined γ=12 D=8 (mean 8/6) · ") and len(err) == 3
    else:
        assert len(err) == 2


def test_verbose_goes_before_or_after_the_command_and_reaches_the_repl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import edge_agent.daemon.chat as chat
    from edge_agent.daemon.cli import _chat

    parser = build_parser()
    for argv, verbose in [
        (["chat"], False),
        (["-v", "chat"], True),
        (["chat", "--verbose"], True),
        (["demo", "-v"], True),
    ]:
        assert parser.parse_args(argv).verbose is verbose, argv
    seen: list[bool] = []

    def run_chat(settings: EdgeSettings, *, progress: Any, verbose: bool = False) -> int:
        progress.stop(True)
        seen.append(verbose)
        return 0

    monkeypatch.setattr(chat, "run_chat", run_chat)
    for argv in (["chat"], ["chat", "-v"]):
        assert _chat(parser.parse_args(argv), EdgeSettings()) == 0
    assert seen == [False, True]


def test_the_first_load_of_a_gguf_says_it_converts_it_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The first start with a GGUF (the default model is one) converts it, which takes a while:
    the progress line says so, and where later starts find it; once converted, the usual line.
    (A fake GGUF: the conversion fails, after the line.)"""
    from edge_agent.runtime.loading import converting_line, load_draft_model
    from shared.runtime.gguf import conversion_folder

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANSPEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF, not really")
    folder, cached = conversion_folder(gguf)
    assert not cached and folder.parent == tmp_path / "cache" / "converted"
    converting = (
        f"converting {gguf} (m.gguf) to a Hugging Face folder, once: later starts load it from "
        f"the cache (~/cache/converted/{folder.name})"
    )
    # A GGUF draft, and a self-draft sharing a GGUF's weights.
    for settings in [
        EdgeSettings(draft=str(gguf), device="cpu"),
        EdgeSettings(draft="self:skip=1", draft_base=str(gguf), device="cpu"),
    ]:
        lines: list[str] = []
        with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
            load_draft_model(settings, lines.append)
        assert lines == [converting]
    # Converted (the folder complete, as converted_gguf_folder leaves it): the usual line.
    folder.mkdir(parents=True)
    (folder / "wanspec-converted.json").write_text("{}")
    assert conversion_folder(gguf) == (folder, True) and converting_line(str(gguf)) is None
    lines = []
    with pytest.raises(Exception):  # noqa: B017 - the folder holds no model
        load_draft_model(EdgeSettings(draft=str(gguf), device="cpu"), lines.append)
    assert lines == [f"loading draft {gguf} (cpu, float32)"]
    assert converting_line("self:skip=1") is None
