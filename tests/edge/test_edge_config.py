"""EdgeSettings: CLI > WANSPEC_EDGE_* environment > TOML file > defaults; errors name the key."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from edge_agent.daemon.cli import build_parser, load_cli_settings, main
from edge_agent.runtime.settings import (
    EdgeSettings,
    check_before_loading,
    check_link_files,
    check_listen,
    check_model_specs,
    default_config_path,
    load_edge_settings,
    retired_env_warnings,
    setting_sources,
)
from edge_agent.session.pipeline_config import Mode, RequestOptions
from shared.maths.compression import Reconstruction
from shared.maths.rejection import CorrectionMode
from shared.service.config import ConfigError

pytestmark = pytest.mark.fast


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_precedence_cli_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    cfg = write(
        tmp_path / "edge.toml",
        'port = 9001\ngamma = 6\ntemperature = 0.5\nverifier = "ws://file:1/v1/session"\n'
        'token-file = "~/tok"\n',
    )
    env = {"WANSPEC_EDGE_PORT": "9002", "WANSPEC_EDGE_GAMMA": "7", "WANSPEC_PORT": "1"}
    args = build_parser().parse_args(["serve", "--config", str(cfg), "--port", "9003"])
    s = load_cli_settings(args, env)
    assert s.port == 9003  # CLI
    assert s.gamma == 7  # env
    assert s.temperature == 0.5 and s.verifier == "ws://file:1/v1/session"  # file
    assert s.token_file == Path("~/tok").expanduser()
    assert s.depth == EdgeSettings().depth == "auto"  # default
    assert s.host == "127.0.0.1"  # loopback unless told otherwise


def test_defaults_and_default_location(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    assert default_config_path(env) == tmp_path / "wanspec" / "edge.toml"
    assert load_edge_settings(env=env) == EdgeSettings()  # no file there: defaults
    (tmp_path / "wanspec").mkdir()
    write(tmp_path / "wanspec" / "edge.toml", "depth = 5\n")
    assert load_edge_settings(env=env).depth == 5
    assert default_config_path({"HOME": "/x"}).name == "edge.toml"
    # $WANSPEC_EDGE_CONFIG points elsewhere.
    other = write(tmp_path / "other.toml", "depth = 3\n")
    assert load_edge_settings(env={**env, "WANSPEC_EDGE_CONFIG": str(other)}).depth == 3


@pytest.mark.parametrize(
    ("toml", "env", "cli", "key", "fragment"),
    [
        ("colour = 1\n", {}, {}, "colour", "unknown setting"),
        ("gamma = 0\n", {}, {}, "gamma", "below the minimum 1"),
        ('gamma = "4"\n', {}, {}, "gamma", "expected an integer"),
        ('gamma = "fast"\n', {}, {}, "gamma", "or 'auto'"),
        ('mode = "fast"\n', {}, {}, "mode", "not one of pipelined, stop-and-wait"),
        ("", {"WANSPEC_EDGE_PORT": "http"}, {}, "port", "WANSPEC_EDGE_PORT"),
        ("", {"WANSPEC_EDGE_TOP_P": "0"}, {}, "top_p", "(0, 1]"),
        ("", {}, {"verifier": "http://x/v1/session"}, "verifier", "not a ws:// or wss:// URL"),
        ("", {}, {"correction": "magic"}, "correction", "not one of"),
        ("", {}, {"depth": "200"}, "depth", "command line --depth"),
        ("tree = true\npredraft = 0\n", {}, {}, "tree", "needs predraft > 0"),
    ],
)
def test_errors_name_the_key_and_its_source(
    tmp_path: Path, toml: str, env: dict[str, str], cli: dict[str, str], key: str, fragment: str
) -> None:
    cfg = write(tmp_path / "edge.toml", toml)
    with pytest.raises(ConfigError) as e:
        load_edge_settings(config=cfg, env=env, cli=cli)
    assert e.value.key == key
    assert fragment in str(e.value)
    if toml:
        assert str(cfg) in str(e.value)


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_edge_settings(config=tmp_path / "missing.toml", env={})
    bad = write(tmp_path / "bad.toml", "port = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_edge_settings(config=bad, env={})


def test_several_verifiers_and_pipeline_overrides() -> None:
    s = EdgeSettings(verifier="ws://a:1/v1/session, wss://b:2/v1/session", temperature=0.8)
    assert s.verifier_urls == ("ws://a:1/v1/session", "wss://b:2/v1/session")
    p = s.pipeline(RequestOptions(gamma=8, top_k=5))
    assert (p.gamma, p.depth, p.sampling.temperature, p.sampling.top_k) == (8, 4, 0.8, 5)
    # a request's own γ fixes it; the default depth stays "auto" (the controller's, from 4)
    assert (p.auto_gamma, p.auto_depth, p.cogen) == (False, True, True)
    assert s.pipeline(RequestOptions(temperature=0.0)).sampling.greedy


def test_closed_sets_are_the_enums() -> None:
    """Settings files, variables and flags spell a closed set as its enum's values; the setting
    holds the member, and the pipeline gets it."""
    env = {"WANSPEC_EDGE_MODE": "stop-and-wait", "WANSPEC_EDGE_RECONSTRUCTION": "B"}
    s = load_edge_settings(env=env, cli={"correction": "topk"})
    assert s.mode is Mode.STOP_AND_WAIT and s.correction is CorrectionMode.TOPK
    p = s.pipeline()
    assert p.mode is Mode.STOP_AND_WAIT and p.correction is CorrectionMode.TOPK
    assert p.reconstruction is Reconstruction.REDISTRIBUTED
    with pytest.raises(ConfigError, match="'fast' is not one of pipelined, stop-and-wait"):
        load_edge_settings(env={"WANSPEC_EDGE_MODE": "fast"})
    request = RequestOptions(mode=Mode.STOP_AND_WAIT, correction=CorrectionMode.GREEDY_DRAFT)
    p = EdgeSettings().pipeline(request)
    assert (p.mode, p.correction) == (Mode.STOP_AND_WAIT, CorrectionMode.GREEDY_DRAFT)


def test_generate_flags_make_a_pipeline_config() -> None:
    args = build_parser().parse_args(
        ["generate", "hi", "--mode", "stop-and-wait", "--correction", "topk",
         "--reconstruction", "B"]
    )  # fmt: skip
    p = load_cli_settings(args, {}).pipeline()
    assert (p.mode, p.correction, p.reconstruction) == (
        Mode.STOP_AND_WAIT, CorrectionMode.TOPK, Reconstruction.REDISTRIBUTED,
    )  # fmt: skip
    demo = load_cli_settings(build_parser().parse_args(["demo"]), {}).pipeline()
    assert (demo.mode, demo.correction, demo.reconstruction) == (
        Mode.PIPELINED, CorrectionMode.CANDIDATES, Reconstruction.RENORMALISED,
    )  # fmt: skip
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--mode", "fast"])


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write(tmp_path / "edge.toml", "gama = 4\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "setting 'gama'" in err and "unknown setting" in err and str(cfg) in err


def test_several_verifiers_federate_unless_failover() -> None:
    urls = "ws://a:1/v1/session,ws://b:2/v1/session"
    s = EdgeSettings(verifier=urls, weights="3,1", k="16,32", eps_target=0.01)
    assert s.federated
    assert s.verifier_weights == (3.0, 1.0) and s.verifier_k == (16, 32)
    assert EdgeSettings(verifier=urls).verifier_k == (64, 64)  # one k for all
    assert not EdgeSettings(verifier=urls, failover=True).federated
    assert not EdgeSettings(verifier="ws://a:1/v1/session").federated
    for bad, key in [({"weights": "1"}, "weights"), ({"weights": "1,0"}, "weights"),
                     ({"weights": "1,x"}, "weights"), ({"k": "1,2,3"}, "'k'"),
                     ({"k": "0"}, "'k'")]:  # fmt: skip
        with pytest.raises(ConfigError, match=key):
            EdgeSettings(verifier=urls, **bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- one settings story


def test_every_command_reads_the_same_settings(tmp_path: Path) -> None:
    """generate, demo, serve and chat: the same --config file, WANSPEC_EDGE_* variables, flags
    and precedence, into the same EdgeSettings."""
    cfg = write(tmp_path / "edge.toml", 'verifier = "wss://file:1/v1/session"\ngamma = 6\n')
    env = {"WANSPEC_EDGE_GAMMA": "7", "WANSPEC_EDGE_DEPTH": "3"}
    argv = {
        "generate": ["generate", "hi"],
        "demo": ["demo"],
        "serve": ["serve"],
        "chat": ["chat"],
    }
    seen = []
    for command, head in argv.items():
        args = build_parser().parse_args([*head, "--config", str(cfg), "--depth", "5"])
        s = load_cli_settings(args, env)
        seen.append(s)
        assert (s.verifier, s.gamma, s.depth) == ("wss://file:1/v1/session", 7, 5), command
    assert all(s == seen[0] for s in seen)
    # The default verifier is the default cloud-verifier's address, for every command.
    assert load_cli_settings(build_parser().parse_args(["generate", "x"]), {}).verifier == (
        "ws://127.0.0.1:8765/v1/session"
    )


def test_generate_refuses_what_serve_refuses(tmp_path: Path) -> None:
    for argv in (["generate", "hi"], ["serve"]):
        args = build_parser().parse_args([*argv, "--verifier", "http://x:1/v1/session"])
        with pytest.raises(ConfigError, match="not a ws:// or wss:// URL"):
            load_cli_settings(args, {})


def test_sources_and_retired_variables(tmp_path: Path) -> None:
    cfg = write(tmp_path / "edge.toml", 'draft-base = "default"\ngamma = 6\n')
    env = {"WANSPEC_EDGE_GAMMA": "7", "WANSPEC_VERIFIER": "ws://old:1/v1/session"}
    src = setting_sources(config=cfg, env=env, cli={"depth": "3", "port": None})
    assert src == {
        "draft_base": f"config file {cfg} [draft-base]",
        "gamma": "environment variable WANSPEC_EDGE_GAMMA",
        "depth": "command line --depth",
    }
    (warning,) = retired_env_warnings(env, src)
    assert "WANSPEC_VERIFIER is not read" in warning and "WANSPEC_EDGE_VERIFIER" in warning
    assert retired_env_warnings(env, {**src, "verifier": "command line --verifier"}) == []


def test_checks_before_loading(tmp_path: Path) -> None:
    src = {"draft": "command line --draft"}
    with pytest.raises(ConfigError, match=r"setting 'draft' \(from command line --draft\)"):
        check_model_specs(EdgeSettings(draft=str(tmp_path / "none.gguf")), src)
    with pytest.raises(ConfigError, match="setting 'draft_base'"):
        check_model_specs(EdgeSettings(draft="self:skip=2", draft_base="/no/such/dir/x.gguf"))
    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(ConfigError, match=r"setting 'draft_base'.*not a model folder"):
        check_model_specs(EdgeSettings(draft="self:keep=2", draft_base=str(folder)))
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    check_model_specs(EdgeSettings(draft="self:keep=2", draft_base=str(folder)))  # a folder
    with pytest.raises(ConfigError, match=r"setting 'token_file'.*cannot read"):
        check_link_files(EdgeSettings(token_file=tmp_path / "missing"))
    token = write(tmp_path / "token", "# comment\nsecret\n")
    assert check_link_files(EdgeSettings(token_file=token)) == "secret"
    assert check_link_files(EdgeSettings()) == ""
    with pytest.raises(ConfigError, match="setting 'ca_file'"):
        check_link_files(EdgeSettings(ca_file=token))  # not a certificate
    with pytest.raises(ConfigError, match="setting 'api_key_file'"):
        check_before_loading(EdgeSettings(api_key_file=tmp_path / "nokey"), "chat")
    check_before_loading(EdgeSettings(draft=str(tmp_path / "none.gguf")), "chat")  # see cli


def test_the_api_address_is_checked_before_loading() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match="Address already in use") as e:
            check_listen(EdgeSettings(port=port), {"port": "command line --port"})
        assert e.value.key == "port" and "command line --port" in str(e.value)
    check_listen(EdgeSettings(port=port))  # free again
    check_listen(EdgeSettings(port=0))
    assert EdgeSettings(host="0.0.0.0", port=9).api_url == "http://127.0.0.1:9"
    assert EdgeSettings(host="::1", port=9).api_url == "http://[::1]:9"
