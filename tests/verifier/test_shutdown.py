"""The verifier's shutdown (:func:`cloud_verifier.daemon.lifecycle.close_connections`) says what
it closes: connections, and apart the sessions they carry. An edge keeps its connection open
between sessions (a warm link), so after every session has ended a shutdown still closes one
connection, and carries no session."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest

from cloud_verifier.daemon.lifecycle import close_connections
from cloud_verifier.daemon.state import LOG_NAME, STATE
from cloud_verifier.engine.targets import NullTarget
from shared.maths.sampling import SamplingParams
from shared.wire.codec import encode
from shared.wire.messages import SUBPROTOCOL, Fingerprint, Hello
from testkit.net.stream_ws import StreamWS
from testkit.probe import ProbeClient, auth_headers
from tests.verifiers import ready, verifier_app
from tests.waits import until

V = 64
TOKEN = "shutdown-token"


@pytest.mark.parametrize(
    ("open_sessions", "waiting", "line"),
    [
        (0, 0, "closing 1 connection (no open session)"),
        (1, 0, "closing 2 connections (1 open session)"),
        (1, 1, "closing 3 connections (1 open session, 1 waiting in line)"),
    ],
)
async def test_the_shutdown_counts_connections_and_sessions_apart(
    aiohttp_client: Any,
    caplog: pytest.LogCaptureFixture,
    open_sessions: int,
    waiting: int,
    line: str,
) -> None:
    app = verifier_app(
        lambda: NullTarget(V),
        auth=[TOKEN],
        model=f"null:{V}",
        max_sessions=1,
        admission_queue=2,  # room for three connections: max_sessions + admission_queue
        close_timeout=0.5,
    )
    client = await aiohttp_client(app)
    await ready(app)
    state = app[STATE]
    hello = Hello(Fingerprint("null", V, "null"), SamplingParams(0.0))
    links = [
        StreamWS(
            await client.ws_connect(
                "/v1/session", headers=auth_headers(TOKEN), protocols=(SUBPROTOCOL,)
            )
        )
        for _ in range(1 + open_sessions + waiting)
    ]
    # links[0]: a warm connection with no session (its sessions have ended, or none began)
    for ws in links[1 : 1 + open_sessions]:
        await ProbeClient(ws).hello(hello)
    for ws in links[1 + open_sessions :]:
        await ws.send_bytes(encode(hello))  # no slot left: it waits in the admission line
    await until(
        lambda: (
            len(state.websockets) == len(links)
            and state.streams == open_sessions
            and len(state.waiting) == waiting
        ),
        10.0,
        "the connections and sessions open",
    )
    caplog.set_level(logging.INFO, logger=LOG_NAME)
    await asyncio.wait_for(close_connections(app), 10.0)
    assert [m for m in caplog.messages if m.startswith("closing ")] == [line]
    for ws in links:
        with contextlib.suppress(Exception):
            await ws.close()
