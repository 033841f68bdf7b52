"""The edge daemon's Ollama-compatible routes against a live verifier (tiny random models),
through the official ``ollama`` client, as tests/edge/test_edge_server.py drives the OpenAI
routes through the ``openai`` client; raw HTTP where the client has no call (version, ``/``)."""

from __future__ import annotations

import json
import logging
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ollama
import pytest

from edge_agent.runtime.service import EdgeService
from shared.runtime.models import LoadedModel
from testkit.harness import target_greedy
from tests.edge_helpers import Servers, edge_settings, wait_http
from tests.waits import poll

GREEDY = {"temperature": 0}
EOS = 2  # the tiny models' </s>


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("ollama_servers"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def edge(servers: Servers, target: LoadedModel, tiny_draft_dir: Path) -> tuple[str, EdgeService]:
    url = servers.verifier(target)
    return servers.edge(edge_settings(tiny_draft_dir, url, servers.token_file))


@pytest.fixture(scope="module")
def client(edge: tuple[str, EdgeService]) -> ollama.Client:
    return ollama.Client(host=edge[0], timeout=60)


def expected_text(target: LoadedModel, prompt_ids: list[int], n: int) -> tuple[str, str, int]:
    """The target's own greedy text of ``prompt_ids`` (up to ``n`` tokens, ending at its end
    token), the reason it ends and its tokens (the end token counted)."""
    ids = target_greedy(target, prompt_ids, n)
    reason, count = "length", n
    if EOS in ids:
        ids, reason = ids[: ids.index(EOS)], "stop"
        count = len(ids) + 1
    return target.tokenizer.decode(ids, skip_special_tokens=True), reason, count


def chat_ids(target: LoadedModel, messages: list[dict[str, str]]) -> list[int]:
    ids: Any = target.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def post_lines(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON objects (one a line) of a 200 answer to ``body``."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        return [json.loads(line) for line in resp.read().splitlines() if line.strip()]


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.read().decode()


def test_list_show_version_and_the_probe(
    client: ollama.Client, edge: tuple[str, EdgeService]
) -> None:
    models = client.list().models
    assert [m.model for m in models] == ["tiny:latest"]
    assert models[0].digest and models[0].modified_at is not None
    shown = client.show("tiny")
    assert shown.capabilities == ["completion"] and shown.template  # the tiny chat template
    assert shown.details is not None and shown.details.family == "llama"
    assert shown.modelinfo is not None and shown.modelinfo["wanspec.verifiers"]
    assert client.show("tiny:latest").template == shown.template
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3:8b")
    assert e.value.status_code == 404 and "llama3:8b" in e.value.error
    status, body = get(edge[0] + "/api/version")
    assert status == 200 and json.loads(body)["version"]
    assert get(edge[0] + "/") == (200, "Ollama is running")
    head = urllib.request.Request(edge[0] + "/", method="HEAD")
    with urllib.request.urlopen(head, timeout=10) as resp:
        assert resp.status == 200


def test_greedy_generate_is_the_targets_text_streaming_or_not(
    client: ollama.Client, target: LoadedModel
) -> None:
    """Raw prompt, temperature 0: the target's own greedy text, through HTTP, the queue, the
    agent, the WebSocket and the verifier; streamed, the same text in pieces."""
    prompt, n = "t1 t10 t20 t30", 24
    ids = target.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    text, reason, count = expected_text(target, ids, n)
    assert text  # (a prompt whose greedy text does not end at once)
    opts = {**GREEDY, "num_predict": n}
    r = client.generate(model="tiny", prompt=prompt, raw=True, stream=False, options=opts)
    assert (r.response, r.done, r.done_reason) == (text, True, reason)
    assert r.prompt_eval_count == len(ids) and r.eval_count == count
    assert r.total_duration and r.eval_duration is not None and r.load_duration == 0

    parts = list(client.generate(model="tiny", prompt=prompt, raw=True, stream=True, options=opts))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.response or "" for p in parts) == text
    assert sum(1 for p in parts if p.response) > 3  # streamed, not one lump
    last = parts[-1]
    assert last.done_reason == reason and last.eval_count == r.eval_count


def test_the_last_object_carries_the_wanspec_statistics(
    edge: tuple[str, EdgeService], target: LoadedModel
) -> None:
    """(The client's models drop fields Ollama does not have: read the JSON itself.)"""
    body = {"model": "tiny", "prompt": "t1 t10", "raw": True, "options": {"num_predict": 6}}
    streamed = post_lines(edge[0] + "/api/generate", body)
    whole = post_lines(edge[0] + "/api/generate", {**body, "stream": False})
    assert len(whole) == 1 and len(streamed) > 1
    for last in (streamed[-1], whole[0]):
        ws = last["wanspec"]
        assert ws["verified"] is True and ws["uplink_bytes"] > 0 and ws["rtt_ms"] is not None
        assert ws["tokens"] == last["eval_count"] and last["done"] is True
    # The daemon's metrics count these requests as they count the OpenAI routes'.
    _, text = get(edge[0] + "/metrics")
    assert 'wanspec_edge_requests_total{endpoint="/api/generate",code="200"}' in text


def test_each_ollama_request_is_one_access_line_with_its_tokens(
    edge: tuple[str, EdgeService], caplog: pytest.LogCaptureFixture
) -> None:
    """The access log counts the Ollama routes' completion tokens too, streamed or not."""
    caplog.set_level(logging.INFO, logger="wanspec.edge.access")
    body = {"model": "tiny", "prompt": "t1 t10", "raw": True, "options": {"num_predict": 5}}
    counts = []
    for stream in (True, False):
        caplog.clear()
        last = post_lines(edge[0] + "/api/generate", {**body, "stream": stream})[-1]
        n = last["eval_count"]
        counts.append(n)

        def lines() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.name == "wanspec.edge.access"]

        poll(lambda: bool(lines()), what="the access line")
        [line] = lines()
        word = "token" if n == 1 else "tokens"
        assert re.fullmatch(rf"POST /api/generate 200 {n} {word} \d+\.\d\d s", line), line
    assert all(n > 0 for n in counts)


def test_greedy_chat_is_the_targets_text_through_the_chat_template(
    client: ollama.Client, target: LoadedModel
) -> None:
    messages = [{"role": "system", "content": "t3"}, {"role": "user", "content": "t1 t2"}]
    text, reason, _ = expected_text(target, chat_ids(target, messages), 20)
    assert text
    opts = {**GREEDY, "num_predict": 20}
    r = client.chat(model="tiny:latest", messages=messages, stream=False, options=opts)
    assert r.message.role == "assistant" and r.message.content == text
    assert r.done_reason == reason and r.model == "tiny:latest"
    parts = list(client.chat(model="tiny", messages=messages, stream=True, options=opts))
    assert "".join(p.message.content or "" for p in parts) == text
    assert parts[-1].done and parts[-1].done_reason == reason and parts[-1].eval_count

    # /api/generate's templated prompt (system + prompt) is the same conversation.
    g = client.generate(model="tiny", prompt="t1 t2", system="t3", stream=False, options=opts)
    assert g.response == text


def test_num_predict_stop_and_a_seeded_sample(
    client: ollama.Client, edge: tuple[str, EdgeService]
) -> None:
    r = client.generate(
        model="tiny", prompt="t5 t6", raw=True, stream=False, options={**GREEDY, "num_predict": 3}
    )
    assert r.eval_count is not None and r.eval_count <= 3
    # A seed with a fixed γ and one batch in flight (the "wanspec" extension, as on the OpenAI
    # routes; the client has no argument for it) gives the same text.
    body = {
        "model": "tiny",
        "prompt": "t5 t6",
        "raw": True,
        "stream": False,
        "options": {"temperature": 1.0, "top_k": 20, "seed": 11, "num_predict": 12},
        "wanspec": {"gamma": 3, "depth": 1},
    }
    a, b = (post_lines(edge[0] + "/api/generate", body)[0] for _ in range(2))
    assert a["response"] == b["response"]
    assert (a["wanspec"]["gamma"], a["wanspec"]["depth"], a["wanspec"]["temperature"]) == (
        3,
        1,
        1.0,
    )
    full = client.generate(
        model="tiny", prompt="t1 t10 t20 t30", raw=True, stream=False, options=GREEDY
    )
    words = (full.response or "").split()
    assert len(words) >= 2
    cut = client.generate(
        model="tiny",
        prompt="t1 t10 t20 t30",
        raw=True,
        stream=False,
        options={**GREEDY, "stop": [words[1]]},
    )
    assert cut.done_reason == "stop" and words[1] not in (cut.response or "")


def test_an_empty_prompt_loads_the_model(client: ollama.Client) -> None:
    r = client.generate(model="tiny", stream=False)
    assert (r.done, r.done_reason, r.response) == (True, "load", "")
    c = client.chat(model="tiny", messages=[], stream=False)
    assert c.done_reason == "load"


def test_unsupported_options_and_fields_get_a_400_naming_them(
    client: ollama.Client, edge: tuple[str, EdgeService]
) -> None:
    msgs = [{"role": "user", "content": "t1"}]
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=msgs, stream=False, options={"min_p": 0.1, "zz": 1})
    assert e.value.status_code == 400 and "min_p, zz" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=msgs, format="json", stream=False)
    assert e.value.status_code == 400 and "format" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:  # refused before any stream begins
        list(client.generate(model="tiny", prompt="t1", stream=True, options={"temperature": 9}))
    assert e.value.status_code == 400 and "temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="nope", prompt="t1", stream=False)
    assert e.value.status_code == 404 and "nope" in e.value.error
    # A body over max_body: 413, in Ollama's shape.
    big = {"model": "tiny", "prompt": "t1 " * (edge[1].settings.max_body // 3 + 1)}
    req = urllib.request.Request(
        edge[0] + "/api/generate", data=json.dumps(big).encode(), method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(req, timeout=30)
    assert http.value.code == 413 and "error" in json.loads(http.value.read())
    # Options that change no text, and those at their neutral value, are accepted.
    ok = client.chat(
        model="tiny",
        messages=msgs,
        stream=False,
        keep_alive="5m",
        options={**GREEDY, "num_predict": 2, "num_thread": 4, "repeat_penalty": 1.0},
    )
    assert ok.done


def test_api_key_is_required_when_configured(
    servers: Servers, edge: tuple[str, EdgeService], tiny_draft_dir: Path
) -> None:
    settings = edge[1].settings
    base, _ = servers.edge(
        edge_settings(tiny_draft_dir, settings.verifier_urls[0], servers.token_file),
        api_key="s3cret",
    )
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=base).list()
    assert e.value.status_code == 401
    good = ollama.Client(host=base, headers={"Authorization": "Bearer s3cret"})
    assert good.generate(model="tiny", prompt="t1", stream=False, options={"num_predict": 2}).done
    assert get(base + "/") == (200, "Ollama is running")  # the probe stays open


def test_a_stream_that_fails_ends_with_an_error_line(
    servers: Servers, tiny_draft_dir: Path
) -> None:
    """No verifier and no fallback: the stream's headers went out at once (200); its last
    line is Ollama's ``{"error": ...}``, which the client raises."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"ws://127.0.0.1:{s.getsockname()[1]}/v1/session"  # nothing listens there
    base, _ = servers.edge(
        edge_settings(tiny_draft_dir, dead, servers.token_file, link_down_deadline=1.0),
        wait=False,
    )
    wait_http(base + "/health", status=503)
    poll(lambda: json.loads(fetch_error(base + "/health"))["status"] == "unavailable")
    lines = post_lines(
        base + "/api/generate", {"model": "tiny", "prompt": "t1", "options": {"num_predict": 4}}
    )
    assert "no verifier could be used" in lines[-1]["error"]
    with pytest.raises(ollama.ResponseError) as e:
        list(ollama.Client(host=base).generate(model="tiny", prompt="t1", stream=True))
    assert "no verifier could be used" in e.value.error
    # Not streaming: the status says it (503), the body Ollama's error.
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=base).generate(model="tiny", prompt="t1", stream=False)
    assert e.value.status_code == 503 and "no verifier" in e.value.error


def fetch_error(url: str) -> str:
    """The body of ``url``, whatever its status."""
    try:
        return get(url)[1]
    except urllib.error.HTTPError as e:
        return str(e.read().decode())
