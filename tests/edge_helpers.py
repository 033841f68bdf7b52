"""Live servers for the edge daemon tests: a verifier and an edge API on loopback ports, run by
an event loop in a background thread (so blocking clients — the ``openai`` package, pexpect,
raw sockets — can drive them from the test)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from aiohttp import web

from bench.net.verifier import WrappedTarget
from cloud_verifier.engine.targets import TorchTarget
from edge_agent.daemon.server import build_app as build_edge_app
from edge_agent.daemon.server import make_runner
from edge_agent.runtime.service import EdgeService
from edge_agent.runtime.settings import EdgeSettings
from shared.runtime.batched_lm import Row
from shared.runtime.models import LoadedModel
from tests.verifiers import READY_TIMEOUT_S, ready, verifier_app

T = TypeVar("T")
TOKEN = "edge-test-token-0123456789"


def clean_env(tmp: Path, **extra: str) -> dict[str, str]:
    """No WANSPEC_* variable and no default config file from the machine running the tests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANSPEC_")}
    env["XDG_CONFIG_HOME"] = str(tmp / "xdg")
    env.update(extra)
    return env


class LoopThread:
    """An event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class SlowTarget(WrappedTarget):
    """A target whose every forward takes ``delay`` seconds more (a far-away verifier)."""

    def __init__(self, inner: TorchTarget, delay: float) -> None:
        super().__init__(inner, inner.description + f" (+{delay * 1000:.0f} ms)")
        self.delay = delay

    def forward(self, rows: Sequence[Row]) -> torch.Tensor:
        time.sleep(self.delay)  # runs on the verifier's engine thread
        return self.inner.forward(rows)


def wait_http(url: str, timeout: float = 60.0, status: int = 200) -> None:
    """Until ``url`` answers ``status`` (a server in this process's loop thread or elsewhere)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == status:
                    return
                last = resp.status
        except urllib.error.HTTPError as e:
            last = e.code
            if e.code == status:
                return
        except OSError as e:
            last = e
        time.sleep(0.05)
    raise AssertionError(f"{url} did not answer {status} within {timeout} s (last: {last})")


class Servers:
    """Start verifiers and edge APIs on loopback; stop them all at the end."""

    def __init__(self, tmp: Path) -> None:
        self.lt = LoopThread()
        self.runners: list[web.AppRunner] = []
        self.token_file = tmp / "verifier.token"
        self.token_file.write_text("# the edge's bearer token\n" + TOKEN + "\n")
        self.token_file.chmod(0o600)  # as an operator keeps it (else a warning is logged)

    async def _start(self, runner: web.AppRunner) -> str:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    def verifier(self, target: LoadedModel, delay: float = 0.0) -> str:
        """A live verifier; returns its ws:// URL once healthy."""

        async def start() -> str:
            base: Any = TorchTarget(target)
            loaded = base if delay <= 0 else SlowTarget(base, delay)
            app = verifier_app(lambda: loaded, auth=[TOKEN])
            http = await self._start(web.AppRunner(app, access_log=None))
            await ready(app)
            return http

        http = self.lt.run(start(), timeout=READY_TIMEOUT_S + 10)
        return http.replace("http://", "ws://") + "/v1/session"

    def edge(
        self, settings: EdgeSettings, *, api_key: str | None = None, wait: bool = True
    ) -> tuple[str, EdgeService]:
        """A live edge API; returns its base URL (and service) once healthy."""
        service = EdgeService(settings)

        async def start() -> str:
            app = build_edge_app(service, api_key=api_key)
            return await self._start(make_runner(app, access_log=None))

        base = self.lt.run(start())
        if wait:
            wait_http(base + "/health")
        return base, service

    def close(self) -> None:
        async def stop() -> None:
            for r in reversed(self.runners):
                await r.cleanup()

        try:
            self.lt.run(stop(), timeout=30)
        finally:
            self.lt.close()


def edge_settings(
    draft_dir: Path, verifier: str, token_file: Path | None, **overrides: Any
) -> EdgeSettings:
    base: dict[str, Any] = {
        "verifier": verifier,
        "token_file": token_file,
        "draft": str(draft_dir),
        "device": "cpu",
        "model_id": "tiny",
        "probe_interval": 0.3,
        "link_down_deadline": 3.0,
        "max_tokens": 24,
        "heartbeat": 5.0,
    }
    base.update(overrides)
    return EdgeSettings(**base)
