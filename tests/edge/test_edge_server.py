"""``edge-agent serve``: the OpenAI-compatible API against a live verifier (tiny random models).

The client is the official ``openai`` package; raw sockets where it cannot go (bad JSON, a
client that disconnects mid-stream).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import numpy as np
import openai
import pytest
import torch
from aiohttp import ClientConnectionResetError

from edge_agent.daemon.ollama_api import COMPLETION_TOKENS
from edge_agent.runtime.events import Finished, Piece, RuntimeEvent
from edge_agent.runtime.queue import FairQueue, QueueFull, RequestTimeout
from edge_agent.runtime.service import EdgeService
from edge_agent.runtime.settings import EdgeSettings
from edge_agent.runtime.text import StopScanner
from edge_agent.session.pipeline_config import PipelineConfig
from shared.maths.sampling import SamplingParams
from shared.runtime.models import LoadedModel, load_model
from testkit.harness import target_greedy
from tests.edge_helpers import TOKEN, Servers, edge_settings, wait_http
from tests.waits import poll, until

PROMPT_IDS = [1, 10, 20, 30, 40]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("edge_servers"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def verifier_url(servers: Servers, target: LoadedModel) -> str:
    return servers.verifier(target)


@pytest.fixture(scope="module")
def edge(servers: Servers, verifier_url: str, tiny_draft_dir: Path) -> tuple[str, EdgeService]:
    return servers.edge(edge_settings(tiny_draft_dir, verifier_url, servers.token_file))


@pytest.fixture(scope="module")
def client(edge: tuple[str, EdgeService]) -> openai.OpenAI:
    return openai.OpenAI(base_url=edge[0] + "/v1", api_key="unused", max_retries=0)


def post_raw(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get_json(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


# ---------------------------------------------------------------------------- pure pieces


def test_stop_scanner_holds_back_a_possible_stop_and_cuts_at_it() -> None:
    s = StopScanner(["END", "xy"])
    out = [s.feed(p) for p in ["ab", "cE", "N", "D more"]]
    assert out[:2] == ["", "ab"]  # "E" and "cE" might begin "END": held back
    assert "".join(out) == "abc" and s.hit
    assert s.feed("late") == "" and s.flush() == ""
    s = StopScanner(["zz"])
    assert s.feed("abz") == "ab" and s.flush() == "z" and not s.hit


async def test_fair_queue_is_fifo_and_a_cancelled_waiter_frees_its_place() -> None:
    q = FairQueue(max_waiting=2)
    order: list[str] = []
    gate = asyncio.Event()

    async def job(name: str) -> None:
        async with q.slot():
            order.append(name)
            await gate.wait()

    a = asyncio.create_task(job("a"))
    await until(lambda: order == ["a"], 5.0, "a holds the slot")
    b = asyncio.create_task(job("b"))
    c = asyncio.create_task(job("c"))
    await until(lambda: q.waiting == 2, 5.0, "b and c waiting")
    with pytest.raises(QueueFull):
        async with q.slot():
            pass
    b.cancel()
    await until(lambda: q.waiting == 1, 5.0, "the cancelled b's place freed")
    gate.set()
    await asyncio.gather(a, c)
    assert order == ["a", "c"] and not q.busy
    assert b.cancelled()


async def test_a_wait_for_a_place_ends_at_its_bound_and_loses_nothing() -> None:
    """Every wait has a deadline: a request waiting for a generation past ``wait_s`` (what is
    left of its own deadline) gets RequestTimeout (504) with a Retry-After, its place goes to
    nobody, and the next one still gets the slot when it frees."""
    q = FairQueue(max_waiting=4)
    gate = asyncio.Event()

    async def hold() -> None:
        async with q.slot():
            await gate.wait()

    holder = asyncio.create_task(hold())
    await until(lambda: q.busy, 5.0, "the slot held")
    with pytest.raises(RequestTimeout, match=r"waited 0\.05 s") as err:
        async with q.slot(0.05):
            pass
    assert err.value.retry_after == 1 and q.waiting == 0
    gate.set()
    await holder
    async with q.slot(0.05):
        assert q.active == 1
    assert q.active == 0


async def test_fair_queue_serves_max_active_at_once_then_in_arrival_order() -> None:
    q = FairQueue(max_waiting=2, max_active=2)
    order: list[str] = []
    gates = {name: asyncio.Event() for name in "abcd"}

    async def job(name: str) -> None:
        async with q.slot():
            order.append(name)
            await gates[name].wait()

    tasks = [asyncio.create_task(job(n)) for n in "ab"]
    await until(lambda: order == ["a", "b"] and q.busy, 5.0, "a and b hold both slots")
    tasks += [asyncio.create_task(job(n)) for n in "cd"]
    await until(lambda: q.waiting == 2, 5.0, "c and d wait")
    with pytest.raises(QueueFull) as full:
        q.check()
    assert full.value.retry_after == 1  # 429 with Retry-After
    gates["b"].set()
    await until(lambda: order == ["a", "b", "c"], 5.0, "c takes b's slot")
    for g in gates.values():
        g.set()
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c", "d"] and q.active == 0 and not q.busy


async def test_a_write_the_client_never_takes_ends_at_its_deadline() -> None:
    """A streaming client that reads nothing: the write is given up after write_timeout (the
    handler then leaves, cancelling that generation only)."""
    from edge_agent.daemon.http_stream import Writer

    class Stuck:
        async def write(self, data: bytes) -> None:
            await asyncio.Event().wait()  # a full socket buffer that never drains

    with pytest.raises(asyncio.TimeoutError):
        await Writer(Stuck(), 0.05).write(b"data: x\n\n")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the API


def test_concurrent_requests_get_the_target_text_with_draft_steps_batched(
    servers: Servers, verifier_url: str, target: LoadedModel, tiny_draft_dir: Path
) -> None:
    """Four requests at once (max_concurrent 4): each text is the target's greedy text, and
    their draft steps shared forwards."""
    base, service = servers.edge(
        edge_settings(tiny_draft_dir, verifier_url, servers.token_file, max_concurrent=4)
    )
    prompts = [PROMPT_IDS, [1, 3, 5], [1, 50, 51, 52, 53], [1, 9]]
    bodies = [
        {"model": "tiny", "prompt": p, "max_tokens": 32, "ignore_eos": True, "temperature": 0}
        for p in prompts
    ]
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda b: post_raw(base + "/v1/completions", json.dumps(b).encode()), bodies)
        )
    for p, (status, body) in zip(prompts, results, strict=True):
        assert status == 200, body
        want = target.tokenizer.decode(target_greedy(target, p, 32), skip_special_tokens=True)
        assert body["choices"][0]["text"] == want, p
    batching = service.batching
    assert batching is not None and batching.rows > batching.batches  # shared forwards


def test_a_stream_sends_its_headers_at_once_and_keeps_quiet_streams_alive(
    servers: Servers, target: LoadedModel, tiny_draft_dir: Path
) -> None:
    """Behind a busy request (max_concurrent 1) a streaming request gets its headers at once
    and SSE comments while it waits, then its text."""
    slow = servers.verifier(target, delay=0.02)
    base, _ = servers.edge(
        edge_settings(
            tiny_draft_dir, slow, servers.token_file, max_concurrent=1, stream_keepalive=0.2
        )
    )
    body = {"model": "tiny", "prompt": "t1", "stream": True, "ignore_eos": True}
    a = open_stream(base, {**body, "max_tokens": 200})
    read_until(a, b'"text": "t')  # A holds the one place
    b = open_stream(base, {**body, "max_tokens": 4})
    head = read_until(b, b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    read_until(b, b": keep-alive\n\n")  # while it waits for A
    a.close()
    rest = read_until(b, b"data: [DONE]")
    assert b'"finish_reason": "length"' in rest
    b.close()


def test_a_conversations_next_turn_reuses_both_caches(client: openai.OpenAI) -> None:
    """Through the daemon's API: turn 2 (the conversation so far and more) takes turn 1's full
    pages from the verifier's prefix cache, and the edge's draft model holds turn 1's text
    already; both say so in the wanspec object. Turn 1 got neither."""
    rng = np.random.default_rng(17)
    turn1 = [int(x) for x in rng.integers(4, 60, 40)]  # ids no other test sends
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    kw["extra_body"] = {"ignore_eos": True}
    first = client.completions.create(prompt=turn1, **kw)
    ws1 = first.model_extra["wanspec"]  # type: ignore[index]
    assert ws1["prompt_cached_tokens"] == 0
    turn2 = [*turn1, 7, 8, 9]
    second = client.completions.create(prompt=turn2, **kw)
    ws2 = second.model_extra["wanspec"]  # type: ignore[index]
    assert ws2["prompt_cached_tokens"] >= 32  # turn 1's two full pages of 16
    assert ws2["draft_prompt_cached_tokens"] >= len(turn1)
    # OpenAI's own field says the verifier's hits, read back typed by the official client
    for r, ws in ((first, ws1), (second, ws2)):
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        assert r.usage.prompt_tokens_details.cached_tokens == ws["prompt_cached_tokens"]


def _streamed_usage(stream: Any) -> tuple[Any, dict[str, Any]]:
    """The usage chunk of a stream (include_usage) and the wanspec object of its last chunk."""
    usage, ws = None, {}
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        elif chunk.choices[0].finish_reason:
            ws = chunk.model_extra["wanspec"]
    assert usage is not None
    return usage, ws


def test_cached_tokens_in_the_streamed_usage_of_both_endpoints(client: openai.OpenAI) -> None:
    """stream_options.include_usage: the usage chunk has prompt_tokens_details.cached_tokens,
    the verifier's prefix-cache hit, on chat and completions; a repeated prompt hits."""
    rng = np.random.default_rng(23)
    ids = [int(x) for x in rng.integers(4, 60, 40)]  # ids no other test sends
    words = " ".join(f"t{x}" for x in rng.integers(4, 60, 40))
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "temperature": 0, "stream": True}
    kw |= {"stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}
    msgs: Any = [{"role": "user", "content": words}]
    creates: list[Callable[[], Any]] = [
        lambda: client.completions.create(prompt=ids, **kw),
        lambda: client.chat.completions.create(messages=msgs, **kw),
    ]
    for create in creates:
        cold, ws_cold = _streamed_usage(create())
        warm, ws_warm = _streamed_usage(create())
        assert cold.prompt_tokens_details.cached_tokens == ws_cold["prompt_cached_tokens"] == 0
        assert warm.prompt_tokens_details.cached_tokens == ws_warm["prompt_cached_tokens"] >= 32
        assert warm.prompt_tokens_details.cached_tokens <= warm.prompt_tokens


def test_unknown_and_unsupported_keys_are_a_400_naming_them(client: openai.OpenAI) -> None:
    """Through the official client: keys the endpoint does not know are named together in one
    400 (OpenAI's shape, read back as BadRequestError); the ignored ones pass."""
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 2, "temperature": 0}
    msgs: Any = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            messages=msgs, extra_body={"min_p": 0.05, "mirostat": 2, "typical_p": 0.9}, **kw
        )
    assert (e.value.status_code, e.value.code, e.value.param) == (
        400, "unknown_parameter", "mirostat",
    )  # fmt: skip
    body: Any = e.value.body
    assert body["message"] == (
        "unrecognized request argument(s) supplied: mirostat, typical_p; not supported: min_p "
        "(vLLM's; min-p sampling is not implemented: only 0 is accepted, got 0.05)"
    )  # as docs/edge/api.md shows it
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(prompt=PROMPT_IDS, extra_body={"messages": msgs}, **kw)
    assert e.value.code == "unknown_parameter" and "/v1/chat/completions" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=msgs, response_format={"type": "json_object"}, **kw)
    assert (e.value.code, e.value.param) == ("unsupported_parameter", "response_format")
    r = client.chat.completions.create(
        messages=msgs,
        user="u-1",
        metadata={"k": "v"},
        tool_choice="none",
        response_format={"type": "text"},
        extra_body={"min_p": 0, "repetition_penalty": 1},
        **kw,
    )
    assert r.choices[0].finish_reason in ("length", "stop")


def test_models_and_health(edge: tuple[str, EdgeService], client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    status, body = get_json(edge[0] + "/health")
    assert status == 200 and body["status"] == "ready"
    assert body["link"]["state"] == "up" and body["link"]["verifiers"][0]["rtt_ms"] is not None


def test_greedy_completion_is_the_targets_text(client: openai.OpenAI, target: LoadedModel) -> None:
    """Through the whole stack (HTTP, queue, agent, WebSocket, verifier): greedy text equals
    target-only greedy decoding."""
    n = 30
    r = client.completions.create(
        model="tiny",
        prompt=PROMPT_IDS,
        max_tokens=n,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    expected = target.tokenizer.decode(
        target_greedy(target, PROMPT_IDS, n), skip_special_tokens=True
    )
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPT_IDS), n)
    ws = r.model_extra["wanspec"]  # type: ignore[index]
    # Every token has a source; the verifier may have written them all (it co-generates from
    # the prompt on while the edge drafts its first batch).
    assert ws["tokens"] == n and ws["verified"] is True and sum(ws["token_sources"].values()) == n
    assert ws["uplink_bytes"] > 0 and ws["downlink_bytes"] > 0 and ws["rtt_ms"] is not None


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "system", "content": "t3"}, {"role": "user", "content": "t1 t2"}],
        "max_tokens": 20,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    assert text and full.choices[0].message.role == "assistant"
    assert full.usage is not None and full.usage.completion_tokens == 20
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == text
    assert sum(1 for p in pieces if p) > 3  # streamed, not one lump
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "length"
    assert last.model_extra["wanspec"]["tokens"] == 20  # type: ignore[index]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20


def test_logprobs_and_token_ids_through_the_openai_client(
    client: openai.OpenAI, target: LoadedModel
) -> None:
    """Opt-in per request: chat's ``logprobs``/``top_logprobs`` and completions' ``logprobs``
    give the target's log-probability of every token (its own log softmax, teacher-forced
    here), streamed chunk by chunk alike; the ``wanspec`` object has the token ids."""
    from edge_agent.model.lm import CausalLM

    n = 12
    r = client.completions.create(
        model="tiny", prompt=PROMPT_IDS, max_tokens=n, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    ids = r.model_extra["wanspec"]["token_ids"]  # type: ignore[index]
    assert ids == target_greedy(target, PROMPT_IDS, n)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    with torch.inference_mode():
        logits = CausalLM(target, logits_window=None).extend(PROMPT_IDS + ids)
    ref = torch.log_softmax(logits[len(PROMPT_IDS) - 1 : -1].double(), dim=-1)
    want = [float(ref[j, t]) for j, t in enumerate(ids)]
    np.testing.assert_allclose(lp.token_logprobs, want, atol=1e-4)
    assert lp.tokens == [target.tokenizer.decode([t]) for t in ids]
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == 0

    kw: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "t1 t2"}],
        "max_tokens": n,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "extra_body": {"ignore_eos": True},
    }
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == n
    chat_ids = full.model_extra["wanspec"]["token_ids"]  # type: ignore[index]
    for c, t in zip(content, chat_ids, strict=True):
        assert c.token == target.tokenizer.decode([t]) and c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6
    streamed = [
        item
        for chunk in client.chat.completions.create(stream=True, **kw)
        if chunk.choices and chunk.choices[0].logprobs is not None
        for item in chunk.choices[0].logprobs.content or []
    ]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [
        (c.token, round(c.logprob, 4)) for c in content
    ]
    plain = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(**{**kw, "logprobs": False})
    assert br.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(**{**kw, "top_logprobs": 21})
    assert br.value.param == "top_logprobs"


def test_sampling_with_a_seed_is_reproducible(client: openai.OpenAI) -> None:
    """A seed with a fixed γ and one batch in flight gives the same text: the daemon runs a
    seeded request without co-generation, whose timing would change the verifier's draws
    (service.seeded; this failed now and then on a loaded machine before)."""
    kw: dict[str, Any] = {
        "model": "tiny",
        "prompt": "t5 t6",
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 0.9,
        "seed": 7,
        "extra_body": {"top_k": 20, "ignore_eos": True, "wanspec": {"gamma": 3, "depth": 1}},
    }
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    ws = a.model_extra["wanspec"]  # type: ignore[index]
    assert (ws["gamma"], ws["depth"], ws["temperature"]) == (3, 1, 1.0)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_cut_the_text(client: openai.OpenAI, stream: bool) -> None:
    kw: dict[str, Any] = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 30, "temperature": 0}
    kw["extra_body"] = {"ignore_eos": True}
    full = client.completions.create(**kw).choices[0].text
    words = full.split(" ")
    stop = " " + words[5] + " "
    expected = full[: full.index(stop)]
    if stream:
        chunks = list(client.completions.create(stop=[stop, "never-seen"], stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
        tokens = chunks[-1].model_extra["wanspec"]["tokens"]  # type: ignore[index]
    else:
        r = client.completions.create(stop=stop, **kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
        tokens = r.model_extra["wanspec"]["tokens"]  # type: ignore[index]
    assert text == expected and finish == "stop"
    assert tokens < 30  # the generation itself stopped, not just the text


def test_bad_requests_get_openai_errors(
    edge: tuple[str, EdgeService], client: openai.OpenAI
) -> None:
    base = edge[0]
    msgs = [{"role": "user", "content": "t1"}]
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-4o", messages=msgs)  # type: ignore[arg-type]
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=-3)  # type: ignore[arg-type]
    assert br.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model="tiny", messages=msgs, n=2)  # type: ignore[arg-type]
    assert br.value.param == "n"
    with pytest.raises(openai.BadRequestError) as br:
        client.completions.create(model="tiny", prompt="t1", temperature=5)
    assert br.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as br:
        client.completions.create(model="tiny", prompt="t1", max_tokens=10_000)
    assert br.value.code == "context_length_exceeded"

    status, body = post_raw(base + "/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert status == 400 and body["error"]["code"] == "invalid_json"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, body = post_raw(base + "/v1/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]
    huge = json.dumps({"model": "tiny", "prompt": "t1 " * 400_000}).encode()
    status, body = post_raw(base + "/v1/completions", huge)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, body = post_raw(base + "/v1/nothing", b"{}")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"
    status, body = get_json(base + "/v1/models/gpt-4o")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    # The daemon is still fine.
    ok = client.completions.create(model="tiny", prompt="t1", max_tokens=3)
    assert ok.usage is not None and ok.usage.completion_tokens >= 1


def test_metrics_count_requests_and_speculation(
    edge: tuple[str, EdgeService], client: openai.OpenAI
) -> None:
    base = edge[0]
    before = metric(base, "wanspec_edge_generated_tokens_total")
    client.completions.create(
        model="tiny", prompt="t1 t2", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert metric(base, "wanspec_edge_generated_tokens_total") == before + 8
    for name in (
        "wanspec_edge_draft_tokens_total",
        "wanspec_edge_rounds_total",
        "wanspec_edge_rollbacks_total",
        "wanspec_edge_uplink_bytes_total",
        "wanspec_edge_downlink_bytes_total",
        "wanspec_edge_accepted_per_round_count",
        'wanspec_edge_rtt_seconds_count{kind="handshake"}',
        'wanspec_edge_rtt_seconds_count{kind="probe"}',
        "wanspec_edge_tokens_per_second",
        'wanspec_edge_requests_total{endpoint="/v1/completions",code="200"}',
    ):
        assert metric(base, name) > 0, name
    assert metric(base, "wanspec_edge_accepted_tokens_total") >= 0
    # Every generated token is counted under one source.
    sources = ("edge_draft", "correction", "bonus", "cogenerated", "cloud_draft", "local_draft")
    by_source = [
        metric(base, f'wanspec_edge_tokens_by_source_total{{source="{s}"}}') for s in sources
    ]
    assert sum(by_source) == metric(base, "wanspec_edge_generated_tokens_total")


def test_api_key_is_required_when_configured(
    servers: Servers, verifier_url: str, tiny_draft_dir: Path
) -> None:
    base, _ = servers.edge(
        edge_settings(tiny_draft_dir, verifier_url, servers.token_file), api_key="s3cret"
    )
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0)
    assert good.completions.create(model="tiny", prompt="t1", max_tokens=2).choices
    assert get_json(base + "/health")[0] == 200  # health stays open for probes
    # A key with bytes that are not ASCII (0xff) is a 401, never a 500.
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cr\xffet\r\n"
            b"Connection: close\r\n\r\n"
        )
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 401"), head[:80]


# ---------------------------------------------------------------------------- disconnects


def open_stream(base: str, body: dict[str, Any]) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed before {marker!r}: {data!r}"
        data += chunk
    return data


def test_client_disconnect_cancels_its_generation_and_frees_its_place(
    servers: Servers, target: LoadedModel, tiny_draft_dir: Path
) -> None:
    slow = servers.verifier(target, delay=0.02)  # ~20 ms per verification: a long answer
    base, service = servers.edge(
        edge_settings(tiny_draft_dir, slow, servers.token_file, max_concurrent=1)
    )
    long_body = {
        "model": "tiny",
        "prompt": "t1",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }

    a = open_stream(base, long_body)
    read_until(a, b'"text": "t')  # A is generating
    b = open_stream(base, long_body)  # B waits behind A
    poll(lambda: metric(base, "wanspec_edge_queue_waiting") == 1)
    b.close()  # B leaves the queue
    poll(lambda: service.queue.waiting == 0)
    a.close()  # A disconnects mid-stream: its generation is cancelled
    poll(lambda: metric(base, 'wanspec_edge_generations_total{outcome="cancelled"}') == 1)
    assert not service.queue.busy
    assert metric(base, "wanspec_edge_generated_tokens_total") < 400
    # The verifier session closed too.
    vbase = slow.replace("ws://", "http://").removesuffix("/v1/session")
    poll(lambda: get_json(vbase + "/health")[1]["sessions"] == 0)
    # And the daemon goes on serving.
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    r = c.completions.create(
        model="tiny", prompt="t1", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 5


class FakeStream:
    """A streamed response's writes, as :class:`Writer` makes them: the ``fail_at``-th write
    (0 first) and ``write_eof`` (``fail_eof``) fail as a write to a closed connection does."""

    def __init__(self, fail_at: int | None = None, fail_eof: bool = False) -> None:
        self.fail_at, self.fail_eof = fail_at, fail_eof
        self.sent: list[bytes] = []
        self.store: dict[Any, Any] = {}

    async def write(self, data: bytes) -> None:
        if len(self.sent) == self.fail_at:
            raise ClientConnectionResetError("Cannot write to closing transport")
        self.sent.append(data)

    async def write_eof(self) -> None:
        if self.fail_eof:
            raise ClientConnectionResetError("Cannot write to closing transport")

    def __setitem__(self, key: Any, value: Any) -> None:
        self.store[key] = value


async def answer_events() -> AsyncIterator[RuntimeEvent]:
    yield Piece("t1 t2")
    yield Finished("t1 t2", "stop", 3, 2, {"tokens": 2})


@pytest.mark.parametrize(
    ("fail_at", "fail_eof", "dropped"),
    [
        (None, True, False),  # the client read [DONE] and closed (the REPL does): no drop
        (None, False, False),
        (1, False, True),  # gone mid-answer, at the first piece: a drop, as before
        (3, False, True),  # gone before [DONE] (role, piece, last chunk were written)
    ],
)
async def test_a_client_that_closes_after_done_dropped_nothing(
    caplog: pytest.LogCaptureFixture, fail_at: int | None, fail_eof: bool, dropped: bool
) -> None:
    """A stream whose client leaves before ``data: [DONE]`` is logged as a drop (INFO); one
    whose client closes once it has [DONE] (the chunked body's end then fails to go) is not:
    the answer was whole."""
    from edge_agent.daemon.http_stream import Writer
    from edge_agent.daemon.server import _Shape, _stream_events

    caplog.set_level(logging.INFO, logger="wanspec.edge")
    resp = FakeStream(fail_at, fail_eof)
    events = answer_events()
    # (returns normally either way: the handler answers what it had)
    await _stream_events(Writer(cast(Any, resp), 5.0), events, {}, _Shape(True), False, 5.0, "r1")
    drops = [r for r in caplog.records if "client of r1 dropped" in r.getMessage()]
    assert [r.levelno for r in drops] == ([logging.INFO] if dropped else [])
    if not dropped:
        assert resp.sent[-1] == b"data: [DONE]\n\n"
        assert resp.store[COMPLETION_TOKENS] == 2  # the access log's count


@pytest.mark.parametrize(
    ("fail_at", "fail_eof", "dropped"),
    [
        (None, True, False),  # the client read the done line and closed: no drop
        (None, False, False),
        (0, False, True),  # gone mid-answer, at the first line: a drop
        (1, False, True),  # gone before the done line
    ],
)
async def test_an_ollama_client_that_closes_after_its_last_line_dropped_nothing(
    caplog: pytest.LogCaptureFixture, fail_at: int | None, fail_eof: bool, dropped: bool
) -> None:
    """As the OpenAI stream's: Ollama's NDJSON stream is a drop (INFO) only when its client
    left before the last line."""
    from types import SimpleNamespace

    from edge_agent.daemon.http_stream import Writer
    from edge_agent.daemon.ollama_api import Reply, _stream_to_client

    caplog.set_level(logging.DEBUG, logger="wanspec.edge")
    resp = FakeStream(fail_at, fail_eof)
    hooks = SimpleNamespace(state=SimpleNamespace(settings=SimpleNamespace(stream_keepalive=5.0)))
    reply = Reply("tiny", False, 0)
    out = Writer(cast(Any, resp), 5.0)
    await _stream_to_client(cast(Any, hooks), out, answer_events(), reply, "/api/generate")
    drops = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert [r.levelno for r in drops] == ([logging.INFO] if dropped else [])
    if not dropped:
        assert b'"done":true' in resp.sent[-1].replace(b" ", b"")
        closed = [r for r in caplog.records if "closed at the end" in r.getMessage()]
        assert [r.levelno for r in closed] == ([logging.DEBUG] if fail_eof else [])


async def test_cancelling_a_generation_is_clean(
    aiohttp_server: Any, target: LoadedModel, tiny_draft_dir: Path
) -> None:
    """EdgeAgent.run cancelled mid-generation: no task left behind, the model worker and the
    draft cache still right (the next greedy generation equals a fresh agent's)."""
    from cloud_verifier.daemon.state import STATE
    from cloud_verifier.engine.targets import TorchTarget
    from edge_agent.link.connection import LinkSettings, WebSocketTransport
    from edge_agent.model.drafter import Drafter
    from edge_agent.runtime.agent import EdgeAgent, RetryPolicy
    from edge_agent.session.events import Committed
    from edge_agent.session.generation import Generation
    from tests.edge_helpers import SlowTarget
    from tests.verifiers import serve_verifier, session_url

    server = await serve_verifier(
        aiohttp_server, lambda: SlowTarget(TorchTarget(target), 0.01), auth=[TOKEN]
    )
    url = session_url(server)
    draft = load_model(str(tiny_draft_dir))

    async def connect() -> Any:
        return await WebSocketTransport.connect(LinkSettings(url=url, token=TOKEN, heartbeat_s=0))

    agent = EdgeAgent(Drafter(draft), draft.fingerprint, connect, retry=RetryPolicy(max_attempts=1))
    cfg = PipelineConfig(sampling=SamplingParams(0.0))
    started = asyncio.Event()
    gen = Generation(PROMPT_IDS, 300)
    before = asyncio.all_tasks()

    def on_event(ev: object) -> None:
        if isinstance(ev, Committed):  # (the first tokens: a round trip comes before them)
            started.set()

    task = asyncio.create_task(agent.run(gen, cfg, on_event=on_event))
    await asyncio.wait_for(started.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 0 < len(gen.generated) < 300

    def loops_left() -> list[asyncio.Task[Any]]:
        left = asyncio.all_tasks() - before - {asyncio.current_task()}
        return [t for t in left if "_loop" in repr(t.get_coro())]

    await until(lambda: not loops_left(), 2.0, "the agent's loops ended")
    sessions = server.app[STATE].sessions
    await until(lambda: not sessions, 2.0, "the WebSocket was closed")
    again = await agent.generate(PROMPT_IDS, cfg, max_tokens=20)
    fresh = EdgeAgent(Drafter(load_model(str(tiny_draft_dir))), draft.fingerprint, connect)
    try:
        expected = await fresh.generate(PROMPT_IDS, cfg, max_tokens=20)
    finally:
        fresh.close()
        agent.close()
    assert again.generated == expected.generated == target_greedy(target, PROMPT_IDS, 20)


# ---------------------------------------------------------------------------- the access log


def access_lines(caplog: pytest.LogCaptureFixture, path: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "wanspec.edge.access" and r.getMessage().split(" ")[1] == path
    ]


async def test_each_request_is_one_access_line_with_its_tokens(
    edge: tuple[str, EdgeService], caplog: pytest.LogCaptureFixture
) -> None:
    """One INFO line per request (method, path, status, completion tokens, seconds), from the
    daemon's own logger; a streamed answer the REPL reads to its end is no drop."""
    from edge_agent.daemon.chat import ChatOptions, RemoteBackend

    base, _ = edge
    caplog.set_level(logging.INFO, logger="wanspec.edge")
    # A streamed chat answer, read as the REPL reads it: up to [DONE], then closed.
    backend = RemoteBackend(base, None, "tiny")
    opts = ChatOptions.from_settings(EdgeSettings(max_tokens=6, temperature=0.0))
    try:
        got = [ev async for ev in backend.chat([{"role": "user", "content": "t1 t2"}], opts)]
    finally:
        await backend.close()
    finished = got[-1]
    assert isinstance(finished, Finished) and finished.completion_tokens > 0
    path = "/v1/chat/completions"
    await until(lambda: access_lines(caplog, path), 10.0, "the access line")
    [line] = access_lines(caplog, path)
    assert line.levelno == logging.INFO
    n = finished.completion_tokens
    word = "token" if n == 1 else "tokens"
    assert re.fullmatch(rf"POST {path} 200 {n} {word} \d+\.\d\d s", line.getMessage())
    assert not [r for r in caplog.records if "dropped" in r.getMessage()]
    # A request that generates nothing: no token count; a probe of /health: DEBUG, not INFO.
    status, _ = await asyncio.to_thread(get_json, base + "/v1/models")
    assert status == 200
    await until(lambda: access_lines(caplog, "/v1/models"), 10.0, "the models line")
    [models] = access_lines(caplog, "/v1/models")
    assert re.fullmatch(r"GET /v1/models 200 \d+\.\d\d s", models.getMessage())
    assert (await asyncio.to_thread(get_json, base + "/health"))[0] == 200
    status, body = await asyncio.to_thread(
        post_raw,
        base + "/v1/completions",
        json.dumps({"model": "tiny", "prompt": "t1", "max_tokens": 3, "ignore_eos": True}).encode(),
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    [completion] = access_lines(caplog, "/v1/completions")  # logged before the answer went
    assert completion.getMessage().startswith("POST /v1/completions 200 3 tokens ")
    assert access_lines(caplog, "/health") == []


def test_make_runner_leaves_aiohttps_own_access_log_off(
    edge: tuple[str, EdgeService],
) -> None:
    """The access log is the middleware's: aiohttp's own would repeat each line."""
    from edge_agent.daemon.server import build_app, make_runner

    runner = make_runner(build_app(edge[1]))  # (not set up: nothing starts)
    assert runner._kwargs["access_log"] is None


# ---------------------------------------------------------------------------- no verifier


def test_health_503_without_verifier_and_fallback_to_the_draft(
    servers: Servers, tiny_draft_dir: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"ws://127.0.0.1:{s.getsockname()[1]}/v1/session"  # nothing listens there
    base, _ = servers.edge(
        edge_settings(tiny_draft_dir, dead, servers.token_file, link_down_deadline=1.0),
        wait=False,
    )
    wait_http(base + "/health", status=503)
    poll(lambda: get_json(base + "/health")[1]["status"] == "unavailable")
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model="tiny", prompt="t1", max_tokens=4)
    assert e.value.status_code == 503 and e.value.code == "verifier_unavailable"

    base, _ = servers.edge(
        edge_settings(tiny_draft_dir, dead, servers.token_file, fallback="draft"), wait=False
    )
    wait_http(base + "/health")  # 200: degraded, but answering
    assert get_json(base + "/health")[1]["status"] == "degraded"
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    r = c.completions.create(
        model="tiny", prompt="t1", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert r.model_extra["wanspec"]["verified"] is False  # type: ignore[index]
    assert r.usage is not None and r.usage.completion_tokens == 4


def test_health_says_what_is_missing_without_a_usable_token(
    servers: Servers, verifier_url: str, tiny_draft_dir: Path, tmp_path: Path
) -> None:
    """Ready means able to serve: an edge with no token in front of a verifier that needs one
    answers /health 503 and says what is missing (it said 200, and the first request got 401);
    one whose token the verifier refuses says so as soon as its warm link is refused, before
    any request."""
    base, _ = servers.edge(edge_settings(tiny_draft_dir, verifier_url, None), wait=False)
    poll(lambda: "token" in str(get_json(base + "/health")[1].get("reason")))
    status, body = get_json(base + "/health")
    assert status == 503 and body["status"] == "unavailable"
    assert "none is configured (token_file)" in body["reason"]
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token-0123456789abcdef\n")
    base, _ = servers.edge(edge_settings(tiny_draft_dir, verifier_url, wrong), wait=False)
    poll(lambda: "refused the token" in str(get_json(base + "/health")[1].get("reason")))
    status, body = get_json(base + "/health")
    assert status == 503 and body["status"] == "unavailable", body
    c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError):
        c.completions.create(model="tiny", prompt="t1", max_tokens=4)
    status, body = get_json(base + "/health")
    assert status == 503 and "refused the token" in body["reason"]


# ---------------------------------------------------------------------------- the real command


def test_serve_command_listens_notifies_systemd_and_stops(
    tmp_path: Path, servers: Servers, verifier_url: str, tiny_draft_dir: Path
) -> None:
    """``edge-agent serve`` as a process: STATUS while loading, READY=1 once the API listens
    with the model loaded, answers the openai client, exits 0 on SIGTERM."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "edge.toml"
    config.write_text(
        f'verifier = "{verifier_url}"\ntoken_file = "{servers.token_file}"\n'
        f'draft = "{tiny_draft_dir}"\nmodel_id = "tiny"\ndevice = "cpu"\n'
    )
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind("\0wanspec-test-" + str(os.getpid()))
    notify.settimeout(60)
    env = {**os.environ, "NOTIFY_SOCKET": "@wanspec-test-" + str(os.getpid())}
    env["WATCHDOG_USEC"] = "3000000"
    env["WANSPEC_EDGE_PORT"] = str(port)  # env beats the file
    cmd = [sys.executable, "-m", "edge_agent.daemon.cli", "serve", "--config", str(config)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        messages: list[str] = []
        while not any("READY=1" in m for m in messages):
            messages.append(notify.recv(4096).decode())
        assert any(m.startswith("STATUS=load") for m in messages), messages
        # READY means: the port answers and the model is loaded.
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "t1"}], max_tokens=4
        )
        assert r.choices[0].message.content is not None
        while not any("WATCHDOG=1" in m for m in messages):
            messages.append(notify.recv(4096).decode())
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()
