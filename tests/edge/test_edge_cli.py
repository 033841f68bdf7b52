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

import pytest
import torch

from edge_agent.daemon.cli import _UNLISTED, build_parser
from edge_agent.daemon.config import EdgeSettings
from edge_agent.daemon.progress import check_cuda, device_line
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


def test_summary_with_no_rejection_says_n_a_not_none() -> None:
    from edge_agent.daemon.cli import _summary

    r = {
        "acceptance_rate": 1.0, "tokens": 8, "wall_s": 1.0, "tokens_per_s": 8.0,
        "mode": "pipelined", "gamma": 4, "depth": 4, "mean_accepted_per_round": 4.0,
        "rounds": 2, "rejections": 0, "discarded_batches": 0, "uplink_bytes": 60,
        "uplink_bytes_per_round": 30.0, "downlink_bytes": 20,
        "downlink_bytes_per_rejection": None, "gamma_mean": 4.0, "depth_mean": 3.5,
        "token_sources": {"edge_draft": 2, "correction": 0, "bonus": 0, "cogenerated": 6,
                          "local_draft": 0},
    }  # fmt: skip
    line = _summary(r)
    assert "(n/a B/rejection)" in line and "None" not in line
    # Where the tokens came from, the largest source first; the values used, with their means.
    assert "tokens from: co-generated 6 (75%), edge drafts 2 (25%) · " in line
    assert "γ=4 D=4 (mean 4/3.5)" in line
