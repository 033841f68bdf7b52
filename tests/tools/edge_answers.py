"""The edge daemon's answers to a fixed set of requests, good and bad, on both APIs (OpenAI and
Ollama; with a verifier and with none), one JSON line each, normalized: ids, times and durations
removed, the ``wanspec`` statistics reduced to their keys (their values are timings).

    .venv/bin/python -m tests.tools.edge_answers > answers.jsonl

Run it in two checkouts and diff the files: a refactoring leaves them equal (tiny models,
greedy requests and fixed seeds, so the texts are the same).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from tests.edge_helpers import edge_settings
from tests.tools import tiny_verifier

VOLATILE = {
    "id",
    "created",
    "created_at",
    "total_duration",
    "load_duration",
    "prompt_eval_duration",
    "eval_duration",
    "system_fingerprint",
}


def norm(o: Any) -> Any:
    if isinstance(o, dict):
        out = {}
        for k, v in o.items():
            if k in VOLATILE:
                continue
            out[k] = sorted(v) if k == "wanspec" and isinstance(v, dict) else norm(v)
        return out
    if isinstance(o, list):
        return [norm(x) for x in o]
    if isinstance(o, float):
        return round(o, 3)
    return o


def call(base: str, path: str, body: Any) -> dict[str, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, text, ctype = r.status, r.read().decode(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        status, text, ctype = e.code, e.read().decode(), e.headers.get("Content-Type", "")
    answer: Any
    if "event-stream" in ctype:
        events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        answer = [e if e == "[DONE]" else norm(json.loads(e)) for e in events]
    elif "ndjson" in ctype:
        answer = [norm(json.loads(line)) for line in text.splitlines() if line.strip()]
    else:
        try:
            answer = norm(json.loads(text))
        except ValueError:
            answer = text
    return {"path": path, "status": status, "body": answer}


def main() -> None:
    with tiny_verifier() as (servers, url, draft_dir):
        base, _ = servers.edge(edge_settings(draft_dir, url, servers.token_file))
        nowhere = "ws://127.0.0.1:9/v1/session"  # (nothing listens on port 9)
        down_settings = edge_settings(
            draft_dir, nowhere, servers.token_file, link_down_deadline=1.0
        )
        down, _ = servers.edge(down_settings, wait=False)
        msgs = [{"role": "user", "content": "a b c"}]
        g = {"temperature": 0, "seed": 1}
        chat, cmpl = "/v1/chat/completions", "/v1/completions"
        cases: list[tuple[str, str, Any]] = [
            (base, chat, {"model": "tiny", "messages": msgs, "max_tokens": 8, **g}),
            (
                base,
                chat,
                {
                    "model": "tiny",
                    "messages": msgs,
                    "max_tokens": 8,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    **g,
                },
            ),
            (
                base,
                chat,
                {
                    "model": "tiny",
                    "messages": msgs,
                    "max_tokens": 6,
                    "logprobs": True,
                    "top_logprobs": 2,
                    **g,
                },
            ),
            (base, cmpl, {"model": "tiny", "prompt": "a b", "max_tokens": 8, **g}),
            (
                base,
                cmpl,
                {
                    "model": "tiny",
                    "prompt": [5, 6, 7],
                    "max_tokens": 5,
                    "logprobs": 1,
                    "stream": True,
                    **g,
                },
            ),
            (base, chat, {"model": "tiny", "messages": msgs, "max_tokens": 8, "stop": ["c"], **g}),
            (base, chat, {"model": "tiny", "messages": msgs, "max_tokens": -1}),
            (base, chat, {"model": "tiny", "messages": msgs, "frobnicate": 1}),
            (base, chat, {"model": "nope", "messages": msgs}),
            (base, chat, {"model": "tiny", "messages": msgs, "max_tokens": 100000}),
            (base, cmpl, {"model": "tiny", "prompt": "a " * 5000, "max_tokens": 4}),
            (base, chat, {"model": "tiny", "messages": msgs, "wanspec": {"gamma": 0}}),
            (
                base,
                "/api/generate",
                {
                    "model": "tiny",
                    "prompt": "a b",
                    "stream": False,
                    "options": {"num_predict": 6, **g},
                },
            ),
            (
                base,
                "/api/chat",
                {"model": "tiny", "messages": msgs, "options": {"num_predict": 6, **g}},
            ),
            (
                base,
                "/api/generate",
                {"model": "tiny", "prompt": "a b", "stream": False, "options": {"num_predict": 0}},
            ),
            (down, chat, {"model": "tiny", "messages": msgs, "max_tokens": 4}),
            (
                down,
                "/api/generate",
                {"model": "tiny", "prompt": "a b", "stream": False, "options": {"num_predict": 4}},
            ),
            (base, chat, b"{not json"),
        ]
        for where, path, body in cases:
            print(json.dumps(call(where, path, body), sort_keys=True))


if __name__ == "__main__":
    main()
