"""Live verifiers for the tests: start one, and return once it is ready.

A verifier answers /health 200 once its model has loaded (``status`` ``ready``); every helper here
returns only then, or fails with the reason it was not ready, within a deadline:

* :func:`serve_verifier`: in this process, on the ``aiohttp_server`` fixture's loopback port,
  once /health answers 200 over HTTP;
* :func:`verifier_app` and :func:`ready`: for the ``aiohttp_client`` fixture or a runner of a
  test's own (``ready`` reads the state /health reports);
* :func:`guarded_verifier`: in this process as ``cloud-verifier serve`` runs it (its runner and
  guarded listener);
* :func:`serve_process` and :func:`wait_healthy`: ``cloud-verifier serve`` as a child process.

And :class:`KillAfter`, links to a verifier that die on cue.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_lib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from cloud_verifier.daemon.app import build_app, make_runner
from cloud_verifier.daemon.auth import Authenticator
from cloud_verifier.daemon.settings import VerifierSettings
from cloud_verifier.daemon.state import STATE, VerifierState
from cloud_verifier.engine.targets import NullTarget, Target
from edge_agent.session.transport import LinkClosed, Transport
from shared.service.http_guard import Listener
from shared.service.status import ServiceStatus
from tests.waits import POLL_S

REPO = Path(__file__).resolve().parent.parent
#: A tiny model loads in well under a second; a loaded CI machine may take many times that.
READY_TIMEOUT_S = 60.0


def verifier_app(
    loader: Callable[[], Target] | None,
    *,
    auth: Authenticator | Sequence[str],
    model: str = "tiny",
    **settings: Any,
) -> web.Application:
    """The verifier app on ``loader``'s target (None: it loads ``model``), heartbeat off unless
    ``settings`` say otherwise; ``auth``: an Authenticator or the bearer tokens it accepts.
    ``engine`` (an Engine to observe) goes to ``build_app``, the rest to VerifierSettings."""
    engine = settings.pop("engine", None)
    settings.setdefault("heartbeat", 0.0)
    if not isinstance(auth, Authenticator):
        auth = Authenticator(list(auth))
    return build_app(
        VerifierSettings(model=model, **settings), auth=auth, engine=engine, loader=loader
    )


async def ready(
    app: web.Application | VerifierState, timeout: float = READY_TIMEOUT_S
) -> VerifierState:
    """Once the verifier's model has loaded (what /health reports as 200): its state. Raises
    with the verifier's reason if the load failed or did not end within ``timeout`` s."""
    state = app[STATE] if isinstance(app, web.Application) else app
    deadline = time.monotonic() + timeout
    while state.status != ServiceStatus.READY:
        if state.status == ServiceStatus.FAILED:
            raise AssertionError(f"the verifier failed to load its model: {state.reason}")
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the verifier was not ready within {timeout:g} s: {state.status}, {state.reason}"
            )
        await asyncio.sleep(POLL_S)
    return state


def session_url(server: TestServer) -> str:
    """The ws:// (wss:// over TLS) URL of sessions on ``server``."""
    return str(server.make_url("/v1/session")).replace("http", "ws", 1)


async def serve_verifier(
    aiohttp_server: Any,
    loader: Callable[[], Target] | None,
    *,
    ssl: ssl_lib.SSLContext | None = None,
    timeout: float = READY_TIMEOUT_S,
    **kw: Any,
) -> TestServer:
    """A live verifier (``verifier_app(loader, **kw)``) on ``aiohttp_server``'s loopback port,
    once ready and answering /health 200 over HTTP, as an edge would see it.
    ``session_url(server)`` is where edges connect; ``server.app[STATE]`` its state."""
    app = verifier_app(loader, **kw)
    server: TestServer = await aiohttp_server(app, ssl=ssl)
    base = str(server.make_url("")).rstrip("/")
    await wait_healthy(base, state=app[STATE], ssl=False, timeout=timeout, interval=POLL_S)
    return server


@asynccontextmanager
async def guarded_verifier(
    auth: Authenticator | Sequence[str],
    loader: Callable[[], Target] | None = None,
    *,
    model: str = "null:64",
    timeout: float = READY_TIMEOUT_S,
    **settings: Any,
) -> AsyncIterator[tuple[VerifierState, str]]:
    """The verifier as ``serve`` runs it (its runner and guarded listener) on 127.0.0.1, by
    default on the null target; once ready, yields its state and http:// base URL."""
    if loader is None and model.startswith("null:"):
        vocab = int(model.split(":", 1)[1])

        def loader() -> Target:
            return NullTarget(vocab)

    app = verifier_app(loader, auth=auth, model=model, **settings)
    state = app[STATE]
    listener = Listener(state.guard, "127.0.0.1", 0)
    await listener.bind()
    runner = make_runner(app)
    await runner.setup()
    try:
        await listener.start(runner)
        await ready(app, timeout)
        host, port = listener.addresses[0]
        yield state, f"http://{host}:{port}"
    finally:
        listener.close()
        await runner.cleanup()
        await listener.wait_closed()


# ------------------------------------------------------------------------- a child process


def serve_process(
    *args: str, env: Mapping[str, str] | None = None, module: str = "cloud_verifier.daemon.cli"
) -> subprocess.Popen[str]:
    """``python -m cloud_verifier.daemon.cli serve --heartbeat 0 ARGS`` (``module`` another entry
    point with the same options, e.g. ``bench.net.verifier``, which has no ``serve`` word), run
    from the repository; stdout and stderr piped, as text."""
    cmd = [sys.executable, "-m", module]
    if module == "cloud_verifier.daemon.cli":
        cmd.append("serve")
    return subprocess.Popen(
        [*cmd, "--heartbeat", "0", *args],
        cwd=REPO,
        env=None if env is None else dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def wait_healthy(
    base: str,
    *,
    proc: subprocess.Popen[Any] | None = None,
    state: VerifierState | None = None,
    ssl: ssl_lib.SSLContext | bool = True,
    timeout: float = READY_TIMEOUT_S,
    interval: float = 0.05,
) -> dict[str, Any]:
    """Poll ``base``/health every ``interval`` s until it answers 200: its body. Fails at once
    if the verifier cannot get there (``proc``, its process, exited; ``state``, the state of
    one in this process, says its model failed to load), and after ``timeout`` s with what it
    last saw."""
    deadline = time.monotonic() + timeout
    last: object = "no answer"
    async with aiohttp.ClientSession() as http:
        while True:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"the verifier exited with {proc.returncode} ({last})")
            if state is not None and state.status == ServiceStatus.FAILED:
                raise AssertionError(f"the verifier failed to load its model: {state.reason}")
            try:
                async with http.get(
                    base + "/health", ssl=ssl, timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    body: dict[str, Any] = await r.json(content_type=None)
                    if r.status == 200:
                        return body
                    last = (r.status, body)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                last = e
            if time.monotonic() > deadline:
                raise AssertionError(f"{base}/health not 200 within {timeout:g} s (last: {last})")
            await asyncio.sleep(interval)


# ------------------------------------------------------------------------- links that die


class KillAfter:
    """Wraps connect(): the k-th session's link dies after ``after[k]`` received frames."""

    def __init__(self, connect: Any, after: list[int]) -> None:
        self.connect = connect
        self.after = list(after)
        self.kills = 0

    async def __call__(self) -> Transport:
        inner: Transport = await self.connect()
        budget = self.after.pop(0) if self.after else None
        outer = self

        class Dying:
            received = 0

            async def send(self, data: bytes) -> None:
                await inner.send(data)

            async def recv(self) -> bytes:
                if budget is not None and self.received >= budget:
                    outer.kills += 1
                    await inner.close()  # the real socket goes down
                    raise LinkClosed("killed by the test")
                self.received += 1
                return await inner.recv()

            async def close(self) -> None:
                await inner.close()

        return Dying()
