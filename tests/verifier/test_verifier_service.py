"""`cloud-verifier serve` as a process: systemd notifications, watchdog, SIGTERM, CLI errors."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import pytest
from aiohttp import WSCloseCode, WSMsgType

from cloud_verifier.daemon.cli import main
from shared.maths.sampling import SamplingParams
from shared.service.sdnotify import Notifier
from shared.wire.messages import SUBPROTOCOL, Fingerprint, Hello
from testkit.net.stream_ws import StreamWS
from testkit.probe import ProbeClient, auth_headers

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _recv_all(sock: socket.socket, until: str, timeout: float) -> list[str]:
    """Datagrams received until one contains ``until``."""
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            break
        if until in got[-1]:
            return got
    raise AssertionError(f"no {until!r} within {timeout} s; got {got}")


def test_notifier_abstract_namespace() -> None:
    name = f"@wanspec-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name[1:])
        n = Notifier.from_env({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "3000000"})
        assert n.notify("READY=1\nSTATUS=x")
        assert sock.recv(100) == b"READY=1\nSTATUS=x"
        assert n.watchdog_interval == pytest.approx(1.0)
    assert not Notifier.from_env({}).notify("READY=1")
    other_pid = {"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "1", "WATCHDOG_PID": "1"}
    assert Notifier.from_env(other_pid).watchdog_interval is None


async def test_serve_process_notify_watchdog_sigterm(tmp_path: Path) -> None:
    token = "svc-token"
    (tmp_path / "tokens").write_text(f"# rotated weekly\n\nold-token\n{token}\n")
    port = _free_port()
    name = f"@wanspec-test-{uuid.uuid4().hex}"
    env = dict(os.environ, NOTIFY_SOCKET=name, WATCHDOG_USEC="300000", WANSPEC_PORT=str(port))
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name[1:])
        proc = subprocess.Popen(
            [sys.executable, "-m", "cloud_verifier.daemon.cli", "serve", "--model", "null:64",
             "--token-file", str(tmp_path / "tokens"), "--heartbeat", "0"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            got = _recv_all(sock, "READY=1", 20)
            assert any(m.startswith("STATUS=loading") for m in got)
            _recv_all(sock, "WATCHDOG=1", 5)
            async with aiohttp.ClientSession() as http:
                health = await http.get(f"http://127.0.0.1:{port}/health")
                assert health.status == 200
                ws = StreamWS(
                    await http.ws_connect(
                        f"http://127.0.0.1:{port}/v1/session",
                        headers=auth_headers(token),
                        protocols=(SUBPROTOCOL,),
                    )
                )
                await ProbeClient(ws).hello(
                    Hello(Fingerprint("null", 64, "null"), SamplingParams(0.0))
                )
                proc.send_signal(signal.SIGTERM)
                msg = await ws.receive(timeout=10)
                assert msg.type == WSMsgType.CLOSE and msg.data == WSCloseCode.GOING_AWAY
                await ws.close()
            assert proc.wait(timeout=15) == 0
            _recv_all(sock, "STOPPING=1", 5)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out = proc.stdout.read().decode() if proc.stdout else ""
    assert "SIGTERM: shutting down" in out, out


def test_serve_refuses_bad_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANSPEC_PORT", raising=False)
    assert main(["serve", "--model", "null:64"]) == 2
    assert "'token_file'" in capsys.readouterr().err
    monkeypatch.setenv("WANSPEC_PORT", "http")
    assert main(["serve", "--model", "null:64", "--insecure-no-auth"]) == 2
    err = capsys.readouterr().err
    assert "'port'" in err and "WANSPEC_PORT" in err
    monkeypatch.delenv("WANSPEC_PORT")
    assert main(["serve", "--model", str(tmp_path / "nope"), "--insecure-no-auth"]) == 2
    assert "'model'" in capsys.readouterr().err
    assert main(["serve", "--model", "null:64", "--insecure-no-auth", "--threads", "0"]) == 2
    assert "'threads'" in capsys.readouterr().err
    (tmp_path / "empty").write_text("# nothing\n")
    assert main(["serve", "--model", "null:64", "--token-file", str(tmp_path / "empty")]) == 2
    assert "no bearer token" in capsys.readouterr().err
