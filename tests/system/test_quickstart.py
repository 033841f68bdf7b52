"""The README's quick start, run as a newcomer would: its commands verbatim, from the checkout.

The only changes a test needs: ``HOME`` is a temporary folder (the token goes to its
``~/.config/wanspec``), the converted model comes from the usual cache (``WANSPEC_CACHE_DIR``,
so nothing is converted twice), and the two ports are free ones, given through the settings'
environment variables (below the commands' own flags, which name no port) and in the URL of the
request. The curl request is sent with its own body (no curl needed), the REPL line is fed a
question and ``/bye`` on its standard input, and the documentation site's OpenAI-client example
runs after them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.runtime.model_cache import cache_dir
from testkit.harness import REPO, free_port

EDGE_PORT = "8760"  # the daemon's port as the README says; a free one here
#: How long one model load may take on a slow 2-core machine, the first conversion included.
READY_S = 240.0


def quick_start_blocks(page: Path) -> list[str]:
    """The ``bash`` blocks of the page's quick-start section."""
    text = page.read_text(encoding="utf-8")
    section = re.search(r"^## Quick start.*?\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section is not None, f"{page.name} has no quick-start section"
    return list(re.findall(r"```bash\n(.*?)```", section.group(1), re.S))


def commands(block: str) -> list[str]:
    """A block's command lines: comments dropped, continued lines (an open quote) joined."""
    lines: list[str] = []
    pending = ""
    for line in block.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending = f"{pending}\n{line}" if pending else line
        if pending.count("'") % 2 == 0:
            lines.append(pending)
            pending = ""
    assert not pending, f"an unclosed quote: {pending!r}"
    return lines


@pytest.fixture
def newcomer(tmp_path: Path) -> Iterator[dict[str, str]]:
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANSPEC_")}
    env.update(
        HOME=str(home),
        WANSPEC_CACHE_DIR=str(cache_dir()),
        HF_HUB_OFFLINE="1",
        WANSPEC_PORT=str(free_port()),
        WANSPEC_EDGE_PORT=str(free_port()),
    )
    env["WANSPEC_EDGE_VERIFIER"] = f"ws://127.0.0.1:{env['WANSPEC_PORT']}/v1/session"
    yield env


def wait_for_line(log: Path, proc: subprocess.Popen[bytes], needle: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if needle in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            pytest.fail(f"exited ({proc.returncode}) before {needle!r}:\n{log.read_text()}")
        time.sleep(0.2)
    pytest.fail(f"no {needle!r} within {READY_S:.0f} s:\n{log.read_text()}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_readme_quick_start_works_as_written(newcomer: dict[str, str], tmp_path: Path) -> None:
    blocks = quick_start_blocks(REPO / "README.md")
    assert len(blocks) == 3, blocks
    (setup, serve_verifier), (serve_edge,), (request, repl) = map(commands, blocks)
    # The documentation site's quick start gives the same two terminals.
    assert quick_start_blocks(REPO / "docs" / "getting-started.md")[:2] == blocks[:2]

    def shell(cmd: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", cmd], cwd=REPO, env=newcomer, text=True, capture_output=True, **kw
        )

    done = shell(setup, timeout=60)
    assert done.returncode == 0, done.stderr
    token = Path(newcomer["HOME"]) / ".config" / "wanspec" / "token"
    assert token.stat().st_mode & 0o077 == 0 and len(token.read_text().strip()) >= 32

    procs: list[subprocess.Popen[bytes]] = []
    try:
        logs = []
        for name, cmd in (("verifier", serve_verifier), ("edge", serve_edge)):
            log = tmp_path / f"{name}.log"
            logs.append(log)
            argv = ["bash", "-c", f"exec {cmd}"]
            with log.open("wb") as f:
                proc = subprocess.Popen(
                    argv, cwd=REPO, env=newcomer, stdout=f, stderr=subprocess.STDOUT
                )
            procs.append(proc)
        deadline = time.monotonic() + READY_S
        # What the README tells the reader to wait for.
        wait_for_line(logs[0], procs[0], "model ready", deadline)
        wait_for_line(logs[1], procs[1], "ready: serving", deadline)
        assert "on cpu (float32, 1 thread)" in logs[0].read_text()  # --threads 1 taken

        # The request, its URL on this test's port, its body verbatim.
        m = re.search(r"curl -s (\S+) -H '([^']*)' -d '(.*)'", request, re.S)
        assert m is not None, request
        url = m.group(1).replace(f":{EDGE_PORT}/", f":{newcomer['WANSPEC_EDGE_PORT']}/")
        name, _, value = m.group(2).partition(": ")
        req = urllib.request.Request(url, data=m.group(3).encode(), headers={name: value})
        # The verifier's link may come up a moment after the daemon says ready.
        answer: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    answer = json.loads(resp.read())
                break
            except urllib.error.HTTPError as e:
                if e.code != 503:
                    raise
                time.sleep(0.5)
        choice = answer["choices"][0]
        assert "Paris" in choice["message"]["content"], answer
        stats = answer["wanspec"]
        assert stats["verified"] is True and stats["tokens"] >= 1, stats

        # The REPL line, talking to the same daemon.
        assert repl.split("#")[0].strip() == ".venv/bin/edge-agent chat"
        chat = shell(repl, input="What is the capital of France?\n/bye\n", timeout=180)
        assert chat.returncode == 0, chat.stderr
        assert "edge-agent serve at http://127.0.0.1:" in chat.stdout, chat.stdout
        assert "Paris" in chat.stdout, chat.stdout

        # The docs site's OpenAI-client example, on the same daemon.
        pages = quick_start_blocks(REPO / "docs" / "getting-started.md")
        client = next(b for b in pages if "from openai import OpenAI" in b)
        port = newcomer["WANSPEC_EDGE_PORT"]
        done = shell(client.replace(f":{EDGE_PORT}/", f":{port}/"), timeout=180)
        assert done.returncode == 0, done.stderr
        assert "Mars" in done.stdout and "'edge_draft':" in done.stdout, done.stdout
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
