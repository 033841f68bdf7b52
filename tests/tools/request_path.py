"""Which ``edge_agent`` modules one streamed chat request runs code in, from the moment it is sent
until its first token's text reaches the client: the edge daemon's event-loop thread and its
model worker, traced with ``sys.setprofile`` (tiny models, a verifier on loopback).

    .venv/bin/python -m tests.tools.request_path

Run it in two checkouts to compare them (a worktree of the older commit uses its own helpers).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

from tests.edge_helpers import edge_settings
from tests.tools import tiny_verifier


def main() -> None:
    with tiny_verifier() as (servers, url, draft_dir):
        settings = edge_settings(draft_dir, url, servers.token_file, max_concurrent=1)
        base, service = servers.edge(settings)
        root = str(Path("edge_agent").resolve())
        seen: set[str] = set()

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            name = frame.f_code.co_filename
            if name.startswith(root):
                seen.add("edge_agent" + name[len(root) :])

        async def set_profile(fn: Any) -> None:
            sys.setprofile(fn)

        first_token(base)  # warm: the link, the draft's first forwards
        servers.lt.run(set_profile(profile))
        servers.lt.run(service.worker.run(sys.setprofile, profile))
        first_token(base)
        servers.lt.run(set_profile(None))
        servers.lt.run(service.worker.run(sys.setprofile, None))
        modules = sorted(
            m.removesuffix(".py").replace("/", ".").removesuffix(".__init__") for m in seen
        )
        print(len(modules))
        print("\n".join(modules))


def first_token(base: str) -> None:
    """A streamed chat request, read until its first chunk with text."""
    body = {
        "model": "tiny",
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "a b c"}],
    }
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[5:])
                if any(c.get("delta", {}).get("content") for c in chunk["choices"]):
                    return


if __name__ == "__main__":
    main()
