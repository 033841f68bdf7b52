"""Model pairs: the edge says in one line when its draft cannot pair with a verifier's target
(at start-up, from the target the connection's Ready announces), /health says so, requests
fail at once; ``edge-agent check`` compares tokenizers offline or with each verifier."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from cloud_verifier.daemon.cli import main as verifier_main
from cloud_verifier.engine.targets import TorchTarget
from edge_agent.daemon.cli import main
from edge_agent.daemon.server import build_app as build_edge_app
from edge_agent.runtime.service import EdgeService
from edge_agent.runtime.settings import EdgeSettings
from shared.runtime.models import LoadedModel
from shared.runtime.pairing import family_of, mismatch_line
from shared.wire.messages import Fingerprint
from testkit.tiny_models import build_tiny_model
from tests.edge_helpers import clean_env
from tests.verifiers import serve_verifier, session_url
from tests.waits import until

TOKEN = "pairs-token-0123456789abcdef"
SMOL = Fingerprint("a1" * 32, 49152, "SmolLM2-135M-Instruct.Q4_1:skip=12")
QWEN = Fingerprint("9f" * 32, 151936, "/srv/models/Qwen3-32B")


def test_the_mismatch_line_names_both_models_and_the_fix() -> None:
    line = mismatch_line(
        SMOL, QWEN, target_of="wss://gpu:8765/v1/session's target", config="/etc/wanspec/edge.toml"
    )
    assert line is not None and "\n" not in line
    assert line.startswith("edge: draft SmolLM2-135M-Instruct.Q4_1:skip=12 (tokenizer a1a1")
    assert "wss://gpu:8765/v1/session's target /srv/models/Qwen3-32B (tokenizer 9f9f" in line
    assert 'set draft = "Qwen/Qwen3-0.6B"' in line and "in /etc/wanspec/edge.toml" in line
    assert "docs/model-pairs.md" in line
    # A target of no documented family: generic advice, still naming the setting.
    other = Fingerprint("77" * 32, 32000, "my-model")
    line = mismatch_line(SMOL, other, setting="draft_base") or ""
    assert "set draft_base to a model that shares my-model's tokenizer" in line
    assert mismatch_line(QWEN, Fingerprint(QWEN.tokenizer_hash, 151936, "Qwen3-0.6B")) is None


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("Qwen/Qwen3-0.6B", "Qwen3"),
        ("/srv/models/Qwen3-32B", "Qwen3"),
        ("meta-llama/Llama-3.3-70B-Instruct", "Llama 3"),
        ("Llama-3.2-1B-Instruct", "Llama 3"),
        ("SmolLM2-135M-Instruct.Q4_1", "SmolLM2"),
        ("gpt2", None),
        ("Qwen2.5-7B", None),
    ],
)
def test_families_are_recognised_by_name(name: str, label: str | None) -> None:
    fam = family_of(name)
    assert (fam.label if fam else None) == label


def test_the_verifiers_refusal_says_what_to_change() -> None:
    why = SMOL.compatible_with(QWEN) or ""
    assert "draft SmolLM2" in why and "target /srv/models/Qwen3-32B" in why
    assert "set the edge's draft to a model that shares" in why and "docs/model-pairs.md" in why


# ---------------------------------------------------------------------------- the edge daemon


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose tokenizer differs from the conftest's (vocab 80, not 64)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_v80"), vocab_size=80, seed=2)


async def test_a_draft_of_another_tokenizer_is_one_line_and_a_clear_503(
    aiohttp_server: Any,
    tmp_path: Path,
    target: LoadedModel,
    other_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = await serve_verifier(aiohttp_server, lambda: TorchTarget(target), auth=[TOKEN])
    url = session_url(server)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    settings = EdgeSettings(
        verifier=url,
        token_file=token_file,
        draft=str(other_dir),
        device="cpu",
        model_id="tiny",
        probe_interval=0.3,
        verifier_wait=30.0,
        heartbeat=5.0,
    )
    service = EdgeService(settings)
    edge = await aiohttp_server(build_edge_app(service))
    base = str(edge.make_url("")).rstrip("/")
    caplog.set_level(logging.INFO, logger="wanspec.edge")
    async with aiohttp.ClientSession() as http:

        async def health() -> dict[str, Any]:
            async with http.get(base + "/health") as r:
                body: dict[str, Any] = await r.json()
                return body

        async def refused() -> bool:
            return service.ready and (await health())["link"]["verifiers"][0]["error"] is not None

        await until(refused, 60.0, "the edge loaded and compared the target")
        await asyncio.sleep(1.0)  # probes come and go: the verdict stays
        body = await health()
        entry = body["link"]["verifiers"][0]
        line = entry["error"]
        assert line.startswith(f"edge: draft {other_dir.name} (tokenizer ")
        assert f"does not share the tokenizer of {url}'s target {Path(target.name).name}" in line
        assert "set draft to a model that shares" in line and "docs/model-pairs.md" in line
        assert entry["state"] == "down" and body["status"] == "unavailable"
        assert body["reason"] == line
        for _ in range(2):  # requests fail at once, with the line; nothing waits verifier_wait
            t0 = time.monotonic()
            req = {"model": "tiny", "prompt": "t1 t2", "max_tokens": 4}
            async with http.post(base + "/v1/completions", json=req) as r:
                assert r.status == 503, await r.text()
                text = await r.text()
            assert time.monotonic() - t0 < 5.0
            assert "does not share the tokenizer" in text and "Retry-After" not in r.headers
    said = [r for r in caplog.records if "does not share the tokenizer" in r.getMessage()]
    logged = [r for r in said if r.name == "wanspec.edge.service"]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR
    assert logged[0].getMessage() == line
    await service.close()


# ---------------------------------------------------------------------------- edge-agent check


def _check(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> tuple[int, str, str]:
    for name, value in clean_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    rc = main(["check", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_check_offline_match_mismatch_and_missing(
    tmp_path: Path,
    tiny_model_dir: Path,
    tiny_draft_dir: Path,
    other_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    draft = ["--draft", str(tiny_draft_dir)]
    rc, out, _ = _check([*draft, "--target", str(tiny_model_dir)], tmp_path, monkeypatch, capsys)
    assert rc == 0
    assert out == (
        f"ok: draft {tiny_draft_dir.name} (tokenizer {out.split('tokenizer ')[1][:12]}…, vocab "
        f"64) pairs with the target {tiny_model_dir.name}\n"
    )
    argv = [*draft, "--target", str(other_dir), "--target", str(tiny_model_dir)]
    rc, out, _ = _check(argv, tmp_path, monkeypatch, capsys)
    lines = out.splitlines()
    assert rc == 1 and len(lines) == 2 and lines[1].startswith("ok: ")
    assert lines[0].startswith(f"edge: draft {tiny_draft_dir.name} (tokenizer ")
    assert f"the target {other_dir.name} (tokenizer " in lines[0] and "vocab 80" in lines[0]
    assert "set draft to a model that shares" in lines[0]
    # A model that is not staged: exit 2, and where to put it.
    rc, out, err = _check([*draft, "--target", "Qwen/Qwen3-32B"], tmp_path, monkeypatch, capsys)
    assert rc == 2 and out == ""
    assert "edge-agent: error: setting 'target'" in err
    assert "not in the local Hugging Face cache" in err and "hf download Qwen/Qwen3-32B" in err
    assert "HF_HOME=/var/cache/wanspec/hf" in err
    rc, _, err = _check(["--draft", str(tmp_path / "nowhere")], tmp_path, monkeypatch, capsys)
    assert rc == 2 and "setting 'draft'" in err


async def test_check_asks_each_verifier(
    aiohttp_server: Any,
    tmp_path: Path,
    target: LoadedModel,
    tiny_draft_dir: Path,
    other_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = await serve_verifier(aiohttp_server, lambda: TorchTarget(target), auth=[TOKEN])
    url = session_url(server)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    link = ["--verifier", url, "--token-file", str(token_file)]
    # main() runs its own event loop: in a thread, while this loop serves the verifier.
    for name, value in clean_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    rc = await asyncio.to_thread(main, ["check", "--draft", str(tiny_draft_dir), *link])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("ok: ") and f"pairs with {url}'s target" in out
    rc = await asyncio.to_thread(main, ["check", "--draft", str(other_dir), *link])
    out = capsys.readouterr().out
    assert rc == 1 and f"does not share the tokenizer of {url}'s target" in out
    dead = "ws://127.0.0.1:9/v1/session"
    argv = ["check", "--draft", str(tiny_draft_dir), "--verifier", dead]
    rc = await asyncio.to_thread(main, argv)
    out = capsys.readouterr().out
    assert rc == 2 and out.startswith(f"edge: cannot ask {dead}: ") and "--target MODEL" in out


def test_a_verifier_that_comes_back_with_a_target_that_pairs_is_used_again(
    tmp_path: Path,
) -> None:
    """The verdict follows the announced target: a restart with a target of the draft's
    family clears the refusal and the link is up again; the same mismatch is logged once."""
    url = "ws://127.0.0.1:9/v1/session"
    service = EdgeService(EdgeSettings(verifier=url, draft="none", draft_base=str(tmp_path)))
    try:
        service.loaded = SimpleNamespace(fingerprint=SMOL, name=SMOL.model_name)  # type: ignore[assignment]
        link = service.links[0]
        link.announced = QWEN  # (as a Ready sets it)
        service._on_link(url, None)
        info = service.monitor.links[0]
        assert link.refusal is not None and info.state == "down" and info.error == link.refusal
        assert 'set draft_base = "default"' not in link.refusal  # the target is Qwen3's
        assert 'set draft_base = "Qwen/Qwen3-0.6B"' in link.refusal
        service.monitor.mark(url, True)  # a probe's 200, a session elsewhere: still down
        assert info.state == "down" and service.monitor.missing_token(True) == link.refusal
        link.announced, link.refusal = Fingerprint(SMOL.tokenizer_hash, 49152, "default"), None
        service._on_link(url, None)
        assert link.refusal is None and info.incompatible is None and info.state == "up"
        assert service.monitor.missing_token(True) is None
    finally:
        service.worker.close()


def test_cloud_verifier_check_compares_a_draft_with_the_configured_target(
    tmp_path: Path,
    tiny_model_dir: Path,
    tiny_draft_dir: Path,
    other_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in clean_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    config = tmp_path / "verifier.toml"
    config.write_text(f'[verifier]\nmodel = "{tiny_model_dir}"\nhost = "0.0.0.0"\n')
    base = ["check", "--config", str(config), "--draft"]
    assert verifier_main([*base, str(tiny_draft_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ok: draft {tiny_draft_dir.name} (tokenizer ")
    assert out.endswith(f"pairs with this verifier's target {tiny_model_dir.name}\n")
    assert verifier_main([*base, str(other_dir)]) == 1
    line = capsys.readouterr().out
    assert line.startswith(f"cloud-verifier: draft {other_dir.name} (tokenizer ")
    assert f"this verifier's target {tiny_model_dir.name} (tokenizer " in line
    assert "set draft to a model that shares" in line and line.count("\n") == 1
    assert verifier_main([*base, "Qwen/Qwen3-0.6B"]) == 2
    err = capsys.readouterr().err
    assert "setting 'draft'" in err and "hf download Qwen/Qwen3-0.6B" in err
    assert verifier_main(["check", "--model", "null:64", "--draft", str(tiny_draft_dir)]) == 2
    assert "has no tokenizer to compare with" in capsys.readouterr().err
