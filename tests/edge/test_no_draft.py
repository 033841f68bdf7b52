"""``draft = "none"``: an edge with no draft model (cloud-only speculative decoding).

The settings refuse what needs a draft on the edge; the tokenizer-only loader gives the fingerprint
and end-of-sequence ids a loaded model of the same spec gives; and every surface (the HTTP API,
``edge-agent generate``, the REPL) runs against a verifier that drafts for itself, with the
target's own greedy text and no edge draft token.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from cloud_verifier.engine.targets import TorchTarget
from edge_agent.daemon.chat import ChatOptions, LocalBackend, Repl
from edge_agent.daemon.cli import main
from edge_agent.daemon.server import build_app as build_edge_app
from edge_agent.model.lm import CausalLM
from edge_agent.runtime.report import detail_line, plain_line
from edge_agent.runtime.service import EdgeService
from edge_agent.runtime.settings import EdgeSettings, check_model_specs, load_edge_settings
from edge_agent.runtime.text import eos_ids
from shared.runtime.model_spec import ModelSpecError
from shared.runtime.models import LoadedModel, load_model, load_tokenizer
from shared.service.config import ConfigError
from testkit.harness import target_greedy
from tests.edge_helpers import clean_env
from tests.verifiers import serve_verifier, session_url
from tests.waits import until

TOKEN = "no-draft-token-0123456789"
PROMPT_IDS = [1, 10, 20, 30, 40]
URL = "ws://127.0.0.1:1/v1/session"


# ---------------------------------------------------------------------------- settings


def test_draft_none_settings_accepted() -> None:
    for spelling in ("none", "None", " NONE "):
        s = EdgeSettings(draft=spelling, verifier=URL)
        assert s.cloud_only
    assert not EdgeSettings(verifier=URL).cloud_only
    # Fail-over targets are one link at a time; hedging is irrelevant (ignored).
    s = EdgeSettings(draft="none", verifier=f"{URL},ws://127.0.0.1:2/v1/session", failover=True)
    assert s.cloud_only and not s.federated
    assert EdgeSettings(draft="none", verifier=URL, hedge=4).pipeline().cogen


@pytest.mark.parametrize(
    ("overrides", "key", "text"),
    [
        ({"cogen": False}, "cogen", "must be true with draft = none"),
        ({"fallback": "draft"}, "fallback", "cannot be 'draft' with draft = none"),
        (
            {"verifier": f"{URL},ws://127.0.0.1:2/v1/session"},
            "verifier",
            "federated verification needs a draft model",
        ),
        ({"draft_base": "self:skip=3"}, "draft_base", "is a self-draft"),
    ],
)
def test_draft_none_refusals_name_the_key(overrides: dict[str, Any], key: str, text: str) -> None:
    settings: dict[str, Any] = {"draft": "none", "verifier": URL, **overrides}
    with pytest.raises(ConfigError) as err:
        EdgeSettings(**settings)
    assert err.value.key == key and text in str(err.value)
    assert "\n" not in str(err.value)
    EdgeSettings(**{**settings, "draft": "self:skip=1"})  # fine with a draft model


def test_draft_none_refusal_names_the_source(tmp_path: Path) -> None:
    env = clean_env(tmp_path, WANSPEC_EDGE_DRAFT="none", WANSPEC_EDGE_COGEN="false")
    with pytest.raises(ConfigError, match="environment variable WANSPEC_EDGE_COGEN"):
        load_edge_settings(env=env)


def test_draft_none_checks_the_base_not_the_draft(tmp_path: Path, tiny_model_dir: Path) -> None:
    check_model_specs(EdgeSettings(draft="none", draft_base=str(tiny_model_dir), verifier=URL))
    missing = EdgeSettings(draft="none", draft_base=str(tmp_path / "nope"), verifier=URL)
    with pytest.raises(ConfigError, match="'draft_base'"):
        check_model_specs(missing)


def test_generate_refuses_draft_none_without_cogen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in clean_env(tmp_path, WANSPEC_EDGE_COGEN="0").items():
        monkeypatch.setenv(name, value)
    assert main(["generate", "hi", "--draft", "none", "--verifier", URL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "edge-agent: error: setting 'cogen' (from environment variable WANSPEC_EDGE_COGEN): "
        "must be true with draft = none (the verifier writes the text)"
    )


# ---------------------------------------------------------------------------- the loader


def test_tokenizer_only_loader_matches_the_loaded_model(
    tmp_path: Path, tiny_model_dir: Path, target: LoadedModel
) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    assert tok.fingerprint == target.fingerprint
    assert (tok.name, tok.vocab_size) == (target.name, target.vocab_size)
    assert eos_ids(tok) == eos_ids(target)
    assert tok.max_length == CausalLM(target).max_length
    # With no generation_config.json, end ids come from the model config, as a model's do.
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    (bare / "generation_config.json").unlink(missing_ok=True)
    assert eos_ids(load_tokenizer(str(bare))) == eos_ids(load_model(str(bare)))
    with pytest.raises(ModelSpecError, match="self-draft has no tokenizer"):
        load_tokenizer("self:skip=1")


@pytest.mark.slow
def test_tokenizer_only_loader_matches_the_default_model() -> None:
    tok = load_tokenizer("default")
    model = load_model("default")
    assert tok.fingerprint == model.fingerprint
    assert eos_ids(tok) == eos_ids(model)


# ---------------------------------------------------------------------------- the summaries


def test_cloud_only_summaries_say_so_not_zero_acceptance() -> None:
    st: dict[str, Any] = {
        "cloud_only": True, "tokens": 10, "wall_s": 1.0, "tokens_per_s": 10.0,
        "acceptance_rate": None, "mean_accepted_per_round": None, "bytes_per_token": 3.0,
        "rtt_ms": 2.0, "uplink_bytes": 20, "downlink_bytes": 10,
        "token_sources": {"edge_draft": 0, "cloud_draft": 6, "cogenerated": 3, "bonus": 1},
    }  # fmt: skip
    line = plain_line(st)
    assert line == (
        "10 tokens in 1.00 s (10.0 tok/s) · no draft model here: the cloud drafted for itself"
        " · round trip 2.0 ms"
    )
    details = detail_line(st)
    assert details == (
        "cloud-only: no edge drafts · up 20 B, down 10 B · 3.0 B/token · tokens from: "
        "cloud drafts 6 (60%), co-generated 3 (30%), bonus 1 (10%)"
    )
    assert "kept" not in line and "acceptance" not in details


# ---------------------------------------------------------------------------- end to end


async def cloud_verifier(aiohttp_server: Any, target: LoadedModel) -> str:
    """A verifier that drafts for itself (n-grams, then a self-draft of the target)."""
    server = await serve_verifier(
        aiohttp_server,
        lambda: TorchTarget(target),
        auth=[TOKEN],
        cloud_draft="ngram",
        cloud_draft_model="self:skip=1",
    )
    return session_url(server)


def no_draft_settings(url: str, tmp_path: Path, base: Path, **overrides: Any) -> EdgeSettings:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    values: dict[str, Any] = {
        "verifier": url,
        "token_file": token_file,
        "draft": "none",
        "draft_base": str(base),
        "model_id": "tiny",
        "probe_interval": 0.3,
        "link_down_deadline": 3.0,
        "heartbeat": 5.0,
        **overrides,
    }
    return EdgeSettings(**values)


def assert_cloud_written(ws: dict[str, Any], n: int) -> None:
    sources = ws["token_sources"]
    assert ws["cloud_only"] is True and ws["verified"] is True
    assert sum(sources.values()) == n
    assert sources["edge_draft"] == 0 and sources["cloud_draft"] > 0
    assert ws["acceptance_rate"] is None  # no edge drafts: nothing accepted or rejected


async def test_api_with_no_draft_writes_the_targets_greedy_text(
    aiohttp_server: Any, tmp_path: Path, tiny_model_dir: Path, target: LoadedModel
) -> None:
    url = await cloud_verifier(aiohttp_server, target)
    service = EdgeService(no_draft_settings(url, tmp_path, tiny_model_dir))
    edge = await aiohttp_server(build_edge_app(service))
    base = str(edge.make_url("")).rstrip("/")
    n = 30
    expected = target_greedy(target, PROMPT_IDS, n)
    async with aiohttp.ClientSession() as http:

        async def healthy() -> bool:
            async with http.get(base + "/health") as r:
                return r.status == 200

        await until(healthy, 60.0, "the edge API ready")
        assert service.drafter is None and service.ready
        async with http.get(base + "/health") as r:
            assert (await r.json())["draft"] == "none"
        async with http.get(base + "/v1/models") as r:
            assert (await r.json())["data"][0]["wanspec"]["draft"] == "none"
        body = {
            "model": "tiny",
            "prompt": PROMPT_IDS,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with http.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        assert out["choices"][0]["text"] == target.tokenizer.decode(
            expected, skip_special_tokens=True
        )
        assert out["usage"]["completion_tokens"] == n
        assert_cloud_written(out["wanspec"], n)

        # Streaming chat: the text is the non-streaming one, the stats in the last chunk.
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "t1 t2 t3"}],
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with http.post(base + "/v1/chat/completions", json=chat) as r:
            assert r.status == 200, await r.text()
            whole = await r.json()
        parts: list[str] = []
        stats: dict[str, Any] = {}
        async with http.post(base + "/v1/chat/completions", json={**chat, "stream": True}) as r:
            assert r.status == 200
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                stats = chunk.get("wanspec", stats)
                for choice in chunk["choices"]:
                    parts.append(choice["delta"].get("content") or "")
        assert "".join(parts) == whole["choices"][0]["message"]["content"]
        assert_cloud_written(stats, 12)


async def test_generate_command_with_no_draft(
    aiohttp_server: Any,
    tmp_path: Path,
    tiny_model_dir: Path,
    target: LoadedModel,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = await cloud_verifier(aiohttp_server, target)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    for name, value in clean_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    n = 16
    argv = [
        "generate", "t1 t2 t3", "--draft", "none", "--draft-base", str(tiny_model_dir),
        "--verifier", url, "--token-file", str(token_file), "--max-tokens", str(n),
        "--temperature", "0", "--threads", "1", "--json",
    ]  # fmt: skip
    # main() runs its own event loop: in a thread, while this loop serves the verifier.
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr()
    result = orjson.loads(out.out.strip().splitlines()[-1])
    prompt = target.tokenizer("t1 t2 t3", add_special_tokens=True)["input_ids"]
    expected = target_greedy(target, prompt, result["tokens"])
    assert result["text"] == target.tokenizer.decode(expected, skip_special_tokens=True)
    assert result["tokens"] == n or result["finish_reason"] == "stop"
    assert_cloud_written(result, result["tokens"])
    assert "[edge] no draft model (cloud-only" in out.err
    assert " · no draft model here: the cloud drafted for itself" in out.err
    assert "acceptance" not in out.err and "kept" not in out.err


async def test_repl_with_no_draft_shows_cloud_only_stats(
    aiohttp_server: Any, tmp_path: Path, tiny_model_dir: Path, target: LoadedModel
) -> None:
    url = await cloud_verifier(aiohttp_server, target)
    settings = no_draft_settings(url, tmp_path, tiny_model_dir, max_tokens=10)
    service = EdgeService(settings)
    await service.load()
    backend = LocalBackend(service)
    out = io.StringIO()
    repl = Repl(backend, ChatOptions.from_settings(settings), out)
    try:
        assert "in-process agent: no draft model (cloud-only" in backend.description
        await repl.answer("t1 t2 t3")
        assert repl.command("/stats")
    finally:
        await backend.close()
    text = out.getvalue()
    assert repl.last is not None
    assert_cloud_written(repl.last, repl.last["tokens"])
    assert " · no draft model here: the cloud drafted for itself" in text
    assert "acceptance 0%" not in text and "kept" not in text
    assert re.search(
        r"^  cloud-only: no edge drafts · .*tokens from: .*cloud drafts \d+ ", text, re.M
    )
    assert "session: 1 answer, 10 tokens, the cloud drafted for itself" in text
