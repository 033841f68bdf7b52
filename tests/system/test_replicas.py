"""Several verifier replicas behind HAProxy, with the shipped balancer config
(``systemd/haproxy-wanspec.cfg``, only its listen address, its certificate's path and the server
addresses replaced), all on loopback. TLS ends at the balancer, as docs/cloud/replicas.md has
it: edges connect with wss:// and check its certificate (a test CA); the replicas listen without
TLS (``install.sh cloud --behind-proxy``).

* failover: an edge generating through the balancer loses its replica (SIGKILL mid-generation),
  reconnects through the balancer to the other one and resumes from its committed text; the
  text equals target-only greedy decoding, and the failover time (kill → next committed token)
  is measured;
* drain: a replica sent SIGTERM (``drain_timeout``) answers /health 503 while it still serves
  its open session; sessions opened through the balancer meanwhile all land on the other
  replica; once its last session closes it exits 0.

``.ci/run`` installs HAProxy (Debian's package) when it is missing; without it these tests fail
with that instruction rather than skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from edge_agent.runtime.agent import RetryPolicy
from edge_agent.session.events import Committed, GenerationEvent
from edge_agent.session.pipeline_config import PipelineConfig
from shared.maths.sampling import SamplingParams
from shared.runtime.models import LoadedModel, load_model
from shared.wire.messages import SUBPROTOCOL, Hello
from testkit.harness import REPO, VerifierProcess, free_port, make_agent, target_greedy
from testkit.net.stream_ws import StreamWS
from testkit.probe import ProbeClient, auth_headers
from testkit.tiny_models import build_tiny_model
from tests.tls import self_signed
from tests.waits import until

TOKEN = "replica-token-0123456789abcdef"
PROMPT = [1, 10, 20, 30, 40]
SHIPPED = REPO / "systemd" / "haproxy-wanspec.cfg"


def balancer_config(listen: int, servers: list[int], pem: Path) -> str:
    """The shipped config with this test's address, certificate and ports (its log to stdout
    kept)."""
    text = SHIPPED.read_text()
    text, n = re.subn(
        r"(?m)^    bind :443 ssl crt \S+ alpn http/1\.1$",
        f"    bind 127.0.0.1:{listen} ssl crt {pem} alpn http/1.1",
        text,
    )
    assert n == 1, "the shipped config's frontend bind line changed"
    lines = [ln for ln in text.splitlines() if not re.match(r"^    server v\d+ ", ln)]
    lines += [f"    server v{i + 1} 127.0.0.1:{p} check" for i, p in enumerate(servers)]
    return "\n".join(lines) + "\n"


def health(port: int) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sessions_total(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        text = r.read().decode()
    m = re.search(r"(?m)^wanspec_sessions_total (\S+)$", text)
    assert m is not None
    return float(m.group(1))


def refused(port: int, reason: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        text = r.read().decode()
    m = re.search(rf'(?m)^wanspec_sessions_refused_total{{reason="{reason}"}} (\S+)$', text)
    return float(m.group(1)) if m else 0.0


@dataclass
class Fleet:
    replicas: list[VerifierProcess]
    listen: int
    target: LoadedModel
    draft: LoadedModel
    ca: ssl.SSLContext  # trusts the balancer's certificate
    log: Path  # the balancer's

    def ups(self, i: int) -> int:
        """How often the balancer has marked replica ``i`` up."""
        return _read(self.log).count(f"verifiers/v{i + 1} is UP")

    @property
    def url(self) -> str:
        return f"wss://127.0.0.1:{self.listen}/v1/session"


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.fail("haproxy is not installed: apt-get install haproxy (make test installs it)")
    target_dir = build_tiny_model(tmp_path / "target", vocab_size=64, seed=0)
    draft_dir = build_tiny_model(tmp_path / "draft", vocab_size=64, seed=1)
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    replicas = [
        VerifierProcess(
            str(target_dir),
            free_port(),
            tokens,
            args=["--drain-timeout", "20", "--heartbeat", "0"],
            log_path=tmp_path / f"replica{i}.log",
        )
        for i in range(2)
    ]
    listen = free_port()
    cert, key = self_signed(tmp_path)
    pem = tmp_path / "wanspec.pem"  # HAProxy's crt: the chain, then the key
    pem.write_bytes(cert.read_bytes() + key.read_bytes())
    pem.chmod(0o600)
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(balancer_config(listen, [r.port for r in replicas], pem))
    check = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    for r in replicas:
        r.start()
    log = open(tmp_path / "haproxy.log", "wb")  # noqa: SIM115
    lb = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    try:
        for r in replicas:
            await r.wait_ready(120)
        # The balancer routes to a replica once its checks pass (rise 2 × inter 1 s).
        ups = [f"verifiers/v{i + 1} is UP" for i in range(len(replicas))]
        try:
            await until(lambda: all(up in _read(tmp_path / "haproxy.log") for up in ups), 30.0)
        except AssertionError as e:
            raise AssertionError(_read(tmp_path / "haproxy.log")) from e
        ca = ssl.create_default_context(cafile=str(cert))
        yield Fleet(
            replicas,
            listen,
            load_model(str(target_dir)),
            load_model(str(draft_dir)),
            ca,
            tmp_path / "haproxy.log",
        )
    finally:
        lb.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            lb.wait(10)
        if lb.poll() is None:
            lb.kill()
        log.close()
        for r in replicas:
            await r.stop()


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


async def test_an_edge_whose_replica_dies_resumes_on_another(fleet: Fleet) -> None:
    n, kill_at = 60, 12
    state = {"committed": 0.0}
    commits_after: list[float] = []

    def on_event(ev: GenerationEvent) -> None:
        if not isinstance(ev, Committed):
            return
        now = time.monotonic()
        if "killed_at" in state:
            commits_after.append(now)
            return
        state["committed"] += len(ev.ids)
        if state["committed"] >= kill_at:
            # The replica holding this session: the one with an open session.
            holder = next(r for r in fleet.replicas if health(r.port)[1].get("sessions") == 1)
            assert holder.proc is not None
            holder.proc.send_signal(signal.SIGKILL)
            state["killed_at"], state["port"] = now, float(holder.port)

    retry = RetryPolicy(backoff_initial_s=0.05, backoff_max_s=0.5, deadline_s=30.0)
    agent = make_agent(fleet.draft, fleet.url, TOKEN, retry=retry, ssl=fleet.ca)
    try:
        # No co-generation: with it, this tiny verifier decodes the whole text on its own and
        # streams it down before the kill lands (nothing would be left to fail over).
        cfg = PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(0.0), cogen=False)
        gen = await agent.generate(PROMPT, cfg, max_tokens=n, on_event=on_event)
    finally:
        agent.close()
    assert "killed_at" in state and commits_after, "the replica was not killed mid-generation"
    assert gen.generated == target_greedy(fleet.target, PROMPT, n)
    assert gen.stats.reconnects >= 1
    survivor = next(r for r in fleet.replicas if r.port != state["port"])
    assert sessions_total(survivor.port) >= 1
    failover = commits_after[0] - state["killed_at"]
    print(f"failover: replica killed → next committed token {failover * 1000:.0f} ms")
    assert failover < 10.0


async def test_a_draining_replica_gets_no_new_sessions(fleet: Fleet) -> None:
    a, b = fleet.replicas
    # A session held open on replica a (directly), so that its drain lasts.
    async with aiohttp.ClientSession() as http:
        ws = StreamWS(
            await http.ws_connect(
                a.url.replace("ws://", "http://"),
                headers=auth_headers(TOKEN),
                protocols=(SUBPROTOCOL,),
            )
        )
        await ProbeClient(ws).hello(Hello(fleet.target.fingerprint, SamplingParams(0.0)))
        before_a, before_b = sessions_total(a.port), sessions_total(b.port)
        assert a.proc is not None
        a.proc.send_signal(signal.SIGTERM)
        await until(lambda: health(a.port)[0] == 503, 10.0, "a 503 from /health while draining")
        status, body = health(a.port)
        assert status == 503 and body["status"] == "stopping"
        # New sessions through the balancer, at once (before its check marks a down: any that
        # reach a are refused with 503 and retried elsewhere) and after.
        for _ in range(4):
            agent = make_agent(fleet.draft, fleet.url, TOKEN, ssl=fleet.ca)
            try:
                cfg = PipelineConfig(gamma=2, depth=1, sampling=SamplingParams(0.0))
                gen = await agent.generate(PROMPT, cfg, max_tokens=8)
            finally:
                agent.close()
            assert gen.generated == target_greedy(fleet.target, PROMPT, 8)
        assert sessions_total(a.port) == before_a  # the draining replica took none
        print(f"refused while draining: {refused(a.port, 'stopping'):.0f}")
        assert sessions_total(b.port) == before_b + 4
        assert a.alive()  # still draining: its session is open
        await ws.close()
    rc = await a._reap(30.0)
    assert rc == 0, (Path(str(a.log_path)).read_text())[-2000:]


async def test_a_warm_link_keeps_serving_across_a_drain_and_a_death(fleet: Fleet) -> None:
    """An edge daemon's warm link through the balancer: one kept connection carries every
    request's session, so the balancer places the edge, not its sessions. Several requests go
    over it; the replica holding it drains (SIGTERM): its connection is closed once it carries
    no session, the link reconnects through the balancer to the other replica and the next
    request is served there at once (not when the drain ends, which another edge's session
    holds open for up to 20 s); the drained replica comes back; the one now holding the link
    dies mid-generation (SIGKILL): the session resumes on the other through the balancer. Every
    text is the target's."""
    from edge_agent.link.connection import LinkSettings
    from edge_agent.link.warm import WarmLink
    from edge_agent.model.drafter import Drafter
    from edge_agent.runtime.agent import EdgeAgent

    warm = WarmLink(
        LinkSettings(url=fleet.url, token=TOKEN, heartbeat_s=0, ssl=fleet.ca),
        backoff_initial_s=0.05,
        backoff_max_s=0.5,
    )
    warm.start()
    retry = RetryPolicy(backoff_initial_s=0.05, backoff_max_s=0.5, deadline_s=30.0)
    agent = EdgeAgent(Drafter(fleet.draft), fleet.draft.fingerprint, warm.stream, retry=retry)
    expected = target_greedy(fleet.target, PROMPT, 40)
    cfg = PipelineConfig(gamma=3, depth=2, sampling=SamplingParams(0.0), cogen=False)

    def holder() -> VerifierProcess:
        """The replica that served the link's sessions: the one with sessions opened."""
        return max(fleet.replicas, key=lambda r: sessions_total(r.port) if r.alive() else -1)

    try:
        for _ in range(3):
            gen = await agent.generate(PROMPT, cfg, max_tokens=40)
            assert gen.generated == expected
        assert warm.connects == 1  # three requests, one connection
        first = holder()
        other = next(r for r in fleet.replicas if r is not first)
        before = sessions_total(other.port)
        assert first.proc is not None
        async with aiohttp.ClientSession() as http:
            # Another edge's session, open on `first` (directly): its drain lasts.
            ws = StreamWS(
                await http.ws_connect(
                    first.url.replace("ws://", "http://"),
                    headers=auth_headers(TOKEN),
                    protocols=(SUBPROTOCOL,),
                )
            )
            await ProbeClient(ws).hello(Hello(fleet.target.fingerprint, SamplingParams(0.0)))
            first.proc.send_signal(signal.SIGTERM)  # drain_timeout 20 s
            await until(lambda: health(first.port)[0] == 503, 10.0, "draining")
            t0 = time.monotonic()
            gen = await agent.generate(PROMPT, cfg, max_tokens=40)
            took = time.monotonic() - t0
            assert gen.generated == expected
            assert sessions_total(other.port) == before + 1 and warm.connects == 2
            assert took < 10.0, f"{took:.1f} s: the request waited for the drain"
            assert first.alive()  # still draining: the other edge's session is open
            await ws.close()
        assert await first._reap(30.0) == 0  # the drain ended with its last session
        ups = fleet.ups(fleet.replicas.index(first))
        first.start()  # back, at the same address
        await first.wait_ready(120)
        await until(
            lambda: fleet.ups(fleet.replicas.index(first)) > ups, 30.0, "the balancer's check"
        )
        # The link is on `other` now: it dies mid-generation; the session resumes on `first`.
        state = {"committed": 0}

        def kill(ev: GenerationEvent) -> None:
            if isinstance(ev, Committed) and other.alive():
                state["committed"] += len(ev.ids)
                if state["committed"] >= 12 and other.proc is not None:
                    other.proc.send_signal(signal.SIGKILL)

        gen = await agent.generate(PROMPT, cfg, max_tokens=40, on_event=kill)
        assert not other.alive() and gen.generated == expected
        assert gen.stats.reconnects >= 1 and warm.connects >= 3
        gen = await agent.generate(PROMPT, cfg, max_tokens=40)  # and after: on `first`
        assert gen.generated == expected
    finally:
        agent.close()
        await warm.close()


class _Draining:
    """What :func:`cloud_verifier.daemon.lifecycle.drain` reads of the service state; ``looks``
    counts its reads of ``streams``."""

    def __init__(self, streams: int) -> None:
        self._streams = streams
        self.looks = 0
        self.status: object = None
        self.conns: set[object] = set()  # (drain closes those that carry no session)
        self.closers: set[asyncio.Task[None]] = set()

    @property
    def streams(self) -> int:
        self.looks += 1
        return self._streams

    @streams.setter
    def streams(self, n: int) -> None:
        self._streams = n

    def set_status(self, status: object, reason: str) -> None:
        self.status = status


async def test_drain_ends_with_the_last_session_or_at_its_deadline() -> None:
    from cloud_verifier.daemon.lifecycle import drain
    from shared.service.status import ServiceStatus

    state = _Draining(2)
    task = asyncio.create_task(drain(state, 30.0, poll_s=0.01))  # type: ignore[arg-type]
    await until(lambda: state.status == ServiceStatus.STOPPING, 5.0, "draining")
    await until(lambda: state.looks >= 4, 5.0, "a few of drain's polls")  # it waits for them
    assert not task.done()
    state.streams = 0
    await asyncio.wait_for(task, 1.0)  # ends at once, long before its 30 s
    stuck = _Draining(1)
    t0 = time.monotonic()
    await drain(stuck, 0.2, poll_s=0.01)  # type: ignore[arg-type]
    assert 0.2 <= time.monotonic() - t0 < 1.0
    none = _Draining(1)
    await drain(none, 0.0)  # type: ignore[arg-type]
    assert none.status is None  # drain_timeout 0: no drain at all
