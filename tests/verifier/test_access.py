"""Only the entitled get in: tokens from a file (rotation), constant-time comparison before the
upgrade, per-token session limits (429), and TLS with certificate verification at the edge."""

from __future__ import annotations

import hmac
import os
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from cloud_verifier.daemon.auth import Authenticator
from cloud_verifier.daemon.cli import main as verifier_main
from cloud_verifier.daemon.settings import VerifierSettings
from cloud_verifier.daemon.state import STATE
from cloud_verifier.daemon.tls import server_context
from cloud_verifier.engine.targets import NullTarget
from edge_agent.link.connection import LinkSettings, UntrustedCertificateError, WebSocketTransport
from edge_agent.link.driver import handshake
from shared.errors import ErrorCode
from shared.maths.sampling import SamplingParams
from shared.service.config import ConfigError
from shared.wire.messages import SUBPROTOCOL, Fingerprint, Hello, Welcome
from testkit.harness import free_port
from testkit.net.stream_ws import StreamWS
from testkit.probe import auth_headers
from tests.tls import self_signed
from tests.verifiers import serve_process, serve_verifier, wait_healthy
from tests.waits import until

NULL_FP = Fingerprint("null", 64, "null")


async def serve(aiohttp_server: Any, auth: Authenticator, **settings: Any) -> Any:
    return await serve_verifier(
        aiohttp_server, lambda: NullTarget(64), auth=auth, model="null:64", **settings
    )


async def status_of(server: Any, token: str | None) -> int:
    """HTTP status of a session request (101 = upgraded; the socket is then closed)."""
    headers = auth_headers(token) if token is not None else {}
    url = str(server.make_url("/v1/session"))
    async with aiohttp.ClientSession() as http:
        try:
            ws = StreamWS(await http.ws_connect(url, headers=headers, protocols=(SUBPROTOCOL,)))
        except aiohttp.WSServerHandshakeError as e:
            return e.status
        await ws.close()
        return 101


async def test_tokens_rotate_through_the_file(aiohttp_server: Any, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# current and next\nold-token\nnew-token\n")
    server = await serve(aiohttp_server, Authenticator(token_file=tokens))
    assert await status_of(server, "old-token") == 101
    assert await status_of(server, "new-token") == 101
    assert await status_of(server, "never") == 401
    assert await status_of(server, None) == 401
    # Rotation: the old token is retired, a third one added; no restart.
    tokens.write_text("new-token\nnewer-token-with-another-length\n")
    os.utime(tokens, ns=(1, 1))  # a different mtime even on coarse-grained file systems
    assert await status_of(server, "old-token") == 401
    assert await status_of(server, "new-token") == 101
    assert await status_of(server, "newer-token-with-another-length") == 101
    m = server.app[STATE].metrics.render()
    assert f'wanspec_sessions_refused_total{{reason="{ErrorCode.UNAUTHORIZED}"}} 3' in m
    # Refused before the upgrade: nothing was created for them.
    assert "wanspec_sessions_total 0" in m


def test_token_check_is_constant_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every configured token is compared (with hmac.compare_digest), whichever matches."""
    auth = Authenticator(["a" * 20, "b" * 20, "c" * 20])
    calls: list[bytes] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for presented in ("a" * 20, "c" * 20, "x" * 20, "a"):
        calls.clear()
        auth.check(f"Bearer {presented}")
        assert len(calls) == 3, presented
    assert auth.identify("Bearer " + "a" * 20) != auth.identify("Bearer " + "b" * 20)
    assert auth.identify("Bearer zz") is None and auth.identify("Basic " + "a" * 20) is None


async def test_sessions_per_token_are_limited_before_the_upgrade(aiohttp_server: Any) -> None:
    auth = Authenticator(["token-a", "token-b"])
    server = await serve(aiohttp_server, auth, max_sessions_per_token=2)
    url = str(server.make_url("/v1/session"))
    async with aiohttp.ClientSession() as http:

        async def open_ws(token: str) -> aiohttp.ClientWebSocketResponse:
            return StreamWS(
                await http.ws_connect(url, headers=auth_headers(token), protocols=(SUBPROTOCOL,))
            )

        a1, a2 = await open_ws("token-a"), await open_ws("token-a")
        with pytest.raises(aiohttp.WSServerHandshakeError) as exc:
            await open_ws("token-a")
        assert exc.value.status == 429
        assert exc.value.headers is not None and exc.value.headers.get("Retry-After") == "1"
        b1 = await open_ws("token-b")  # another token is not affected
        await a1.close()
        key = auth.identify("Bearer token-a") or ""
        await until(lambda: server.app[STATE].per_token.get(key) == 1, 5.0, "the close noticed")
        a3 = await open_ws("token-a")
        for ws in (a2, a3, b1):
            await ws.close()
    m = server.app[STATE].metrics.render()
    assert 'wanspec_sessions_refused_total{reason="token_limit"} 1' in m
    # no entry left behind per token ever seen
    await until(lambda: server.app[STATE].per_token == {}, 5.0, "no per-token entry left")


# ---------------------------------------------------------------------------------------- TLS


async def test_tls_edge_verifies_the_certificate(aiohttp_server: Any, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    server = await serve(
        aiohttp_server, Authenticator(["tls-token"]), ssl=server_context(cert, key)
    )
    url = f"wss://127.0.0.1:{server.port}/v1/session"
    # Default: the certificate must be trusted; a self-signed one is not. Not retried.
    assert LinkSettings(url=url, token="tls-token").ssl is True
    with pytest.raises(UntrustedCertificateError, match="not trusted"):
        await WebSocketTransport.connect(LinkSettings(url=url, token="tls-token"))
    # Given the CA, the link works: a full Hello/Welcome over TLS.
    trusted = ssl.create_default_context(cafile=str(cert))
    link = LinkSettings(url=url, token="tls-token", heartbeat_s=0, ssl=trusted)
    transport = await WebSocketTransport.connect(link)
    try:
        welcome = await handshake(transport, Hello(NULL_FP, SamplingParams(0.0)), 5.0)
        assert isinstance(welcome, Welcome)
    finally:
        await transport.close()
    # Plain ws:// to a TLS port does not get in either.
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientError):
            StreamWS(
                await http.ws_connect(
                    f"ws://127.0.0.1:{server.port}/v1/session",
                    headers=auth_headers("tls-token"),
                    protocols=(SUBPROTOCOL,),
                )
            )


def test_tls_settings_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="tls_key"):
        VerifierSettings(tls_cert=tmp_path / "cert.pem")
    cert, key = self_signed(tmp_path)
    with pytest.raises(ConfigError, match="tls_cert"):
        server_context(cert, cert)  # a certificate is not its key
    with pytest.raises(ConfigError, match="not a readable file"):
        server_context(tmp_path / "missing.pem", key)
    tokens = tmp_path / "tokens"
    tokens.write_text("t\n")
    argv = ["serve", "--model", "null:64", "--token-file", str(tokens)]
    assert verifier_main([*argv, "--tls-cert", str(cert)]) == 2
    assert "tls_key" in capsys.readouterr().err
    assert verifier_main([*argv, "--tls-cert", str(key), "--tls-key", str(key)]) == 2
    assert "'tls_cert'" in capsys.readouterr().err


async def test_serve_with_tls_flags(tmp_path: Path) -> None:
    """``cloud-verifier serve --tls-cert --tls-key``: https /health, wss sessions."""
    cert, key = self_signed(tmp_path)
    (tmp_path / "tokens").write_text("svc-token\n")
    port = free_port()
    proc = serve_process(
        "--model", "null:64", "--port", str(port), "--token-file", str(tmp_path / "tokens"),
        "--tls-cert", str(cert), "--tls-key", str(key),
    )  # fmt: skip
    try:
        trusted = ssl.create_default_context(cafile=str(cert))
        await wait_healthy(f"https://127.0.0.1:{port}", proc=proc, ssl=trusted)
        link = LinkSettings(
            url=f"wss://127.0.0.1:{port}/v1/session", token="svc-token", ssl=trusted
        )
        transport = await WebSocketTransport.connect(link)
        try:
            welcome = await handshake(transport, Hello(NULL_FP, SamplingParams(0.0)), 5.0)
            assert isinstance(welcome, Welcome)
        finally:
            await transport.close()
    finally:
        proc.terminate()
        out = "".join(proc.communicate(timeout=20))
    assert "(https/wss)" in out, out
