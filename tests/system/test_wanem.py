"""The userspace WAN emulator: timing within tolerance, ordering, faults, transparency, cleanup.

Loopback only. Timings are measured against the configured link with generous bounds (these are
accuracy checks, not speed claims).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import statistics
import struct
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from testkit.net.wanem import DEFAULT_BANDWIDTH_BPS, LinkConfig, WanEmulator
from tests.waits import until

LOCAL = "127.0.0.1"
REPO = Path(__file__).resolve().parents[2]


# -- loopback servers and clients built on protocols (they create no tasks) ------------------


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)

    def eof_received(self) -> bool:
        return False  # close our side too


class _Sink(asyncio.Protocol):
    """Counts what arrives; ``done`` resolves when the connection ends (EOF, reset or close)."""

    def __init__(self, target: int | None = None) -> None:
        self.data = bytearray()
        self.target = target
        loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = loop.create_future()
        self.reached: asyncio.Future[float] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data += data
        if self.target is not None and len(self.data) >= self.target and not self.reached.done():
            self.reached.set_result(asyncio.get_running_loop().time())

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


@contextlib.asynccontextmanager
async def _server(factory: Callable[[], asyncio.Protocol]) -> AsyncIterator[int]:
    server = await asyncio.get_running_loop().create_server(factory, LOCAL, 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        await server.wait_closed()


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(LOCAL, port)


async def _echo_rtt(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
    loop = asyncio.get_running_loop()
    payload = b"ping-%08d" % int(loop.time() * 1000)
    start = loop.time()
    writer.write(payload)
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(len(payload)), 5) == payload
    return loop.time() - start


async def _is_dead(reader: asyncio.StreamReader, timeout: float = 2.0) -> bool:
    """True if the connection ends (EOF or reset) within ``timeout``."""
    try:
        return await asyncio.wait_for(reader.read(1 << 16), timeout) == b""
    except (ConnectionError, OSError):
        return True


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()


# -- config --------------------------------------------------------------------------------


def test_link_config_shorthands_and_validation() -> None:
    link = LinkConfig(rtt_ms=100, jitter_ms=5)
    assert (link.up_delay_ms, link.down_delay_ms, link.round_trip_ms) == (50, 50, 100)
    assert link.up_bandwidth_bps == link.down_bandwidth_bps == DEFAULT_BANDWIDTH_BPS
    both = LinkConfig(bandwidth_bps=None, up_delay_ms=10, down_delay_ms=30)
    assert both.up_bandwidth_bps is None and both.down_bandwidth_bps is None
    assert both.round_trip_ms == 40
    for bad in (
        {"rtt_ms": -1},
        {"jitter_ms": float("nan")},
        {"up_bandwidth_bps": 0},
        {"burst_bytes": 0},
        {"jitter_dist": "pareto"},
    ):
        with pytest.raises(ValueError):
            LinkConfig(**bad)
    emu = WanEmulator((LOCAL, 1), link)
    new = emu.set_link(rtt_ms=30, bandwidth_bps=8e6)
    assert (new.up_delay_ms, new.down_delay_ms, new.jitter_ms) == (15, 15, 5)
    assert new.up_bandwidth_bps == new.down_bandwidth_bps == 8e6
    assert emu.set_link(delay_ms=7).round_trip_ms == 14
    assert emu.set_link(down_bandwidth_bps=None).up_bandwidth_bps == 8e6


# -- timing ----------------------------------------------------------------------------------


async def test_rtt_matches_config_and_follows_set_link() -> None:
    async with _server(_Echo) as upstream:
        link = LinkConfig(rtt_ms=100)
        async with WanEmulator((LOCAL, upstream), link) as emu:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            reader, writer = await _connect(emu.port)
            first = await _echo_rtt(reader, writer)
            first_total = loop.time() - t0
            # The client's connect() is instant here, so the handshake RTT is charged to the
            # first exchange: ~2 RTT from connect() to the first reply, as over a real WAN.
            assert 0.195 <= first_total <= 0.30, first_total
            assert first >= 0.195
            rtts = [await _echo_rtt(reader, writer) for _ in range(5)]
            print(f"rtt 100 ms configured: measured {[round(r * 1000, 1) for r in rtts]} ms")
            assert all(0.095 <= r <= 0.150 for r in rtts), rtts

            emu.set_link(rtt_ms=40)  # sweep without restarting
            rtts = [await _echo_rtt(reader, writer) for _ in range(5)]
            print(f"rtt 40 ms configured: measured {[round(r * 1000, 1) for r in rtts]} ms")
            assert all(0.038 <= r <= 0.080 for r in rtts), rtts

            emu.set_link(rtt_ms=0)
            rtts = [await _echo_rtt(reader, writer) for _ in range(5)]
            print(f"rtt 0 ms configured: measured {[round(r * 1000, 2) for r in rtts]} ms")
            assert statistics.median(rtts) < 0.010, rtts
            await _close(writer)


async def test_zero_delay_is_fast_from_the_start() -> None:
    async with (
        _server(_Echo) as upstream,
        WanEmulator((LOCAL, upstream), LinkConfig(bandwidth_bps=None)) as emu,
    ):
        reader, writer = await _connect(emu.port)
        rtts = [await _echo_rtt(reader, writer) for _ in range(5)]
        assert max(rtts) < 0.015, rtts
        await _close(writer)


@pytest.mark.parametrize("direction", ["up", "down"])
async def test_bandwidth_cap_paces_a_megabyte(direction: str) -> None:
    """1 MB at 8 Mbit/s takes ~1 s (minus the 16 KiB burst), however fast the sender is."""
    size = 1_000_000
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    loop = asyncio.get_running_loop()
    sinks: list[_Sink] = []

    class _Sender(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            sender_start.set_result(loop.time())
            transport.write(payload)

    sender_start: asyncio.Future[float] = loop.create_future()

    def sink_factory() -> asyncio.Protocol:
        sinks.append(_Sink(size))
        return sinks[-1]

    factory: Callable[[], asyncio.Protocol] = sink_factory if direction == "up" else _Sender
    link = LinkConfig(
        up_bandwidth_bps=8e6 if direction == "up" else None,
        down_bandwidth_bps=8e6 if direction == "down" else None,
        handshake_rtt=False,
    )
    async with _server(factory) as upstream, WanEmulator((LOCAL, upstream), link) as emu:
        reader, writer = await _connect(emu.port)
        if direction == "up":
            start = loop.time()
            writer.write(payload)
            await until(lambda: bool(sinks))
            end = await asyncio.wait_for(sinks[0].reached, 5)
            assert bytes(sinks[0].data) == payload
        else:
            got = await asyncio.wait_for(reader.readexactly(size), 5)
            end = loop.time()
            start = await sender_start
            assert got == payload
        elapsed = end - start
        print(f"1 MB {direction} at 8 Mbit/s: {elapsed:.3f} s (ideal {(size - 16384) / 1e6:.3f})")
        assert 0.8 <= elapsed <= 1.6, elapsed
        assert getattr(emu.stats, f"bytes_{direction}") == size
        await _close(writer)


async def test_jitter_never_reorders_bytes() -> None:
    link = LinkConfig(rtt_ms=20, jitter_ms=15, jitter_dist="normal", bandwidth_bps=None, seed=7)
    async with _server(_Echo) as upstream, WanEmulator((LOCAL, upstream), link) as emu:
        reader, writer = await _connect(emu.port)
        await _echo_rtt(reader, writer)  # past the handshake
        rtts = [await _echo_rtt(reader, writer) for _ in range(15)]
        print(f"rtt 20 ms ± normal(15 ms) each way: {[round(r * 1000, 1) for r in rtts]} ms")
        assert statistics.pstdev(rtts) > 0.003  # jitter is really applied...
        assert 0.010 <= statistics.mean(rtts) <= 0.060

        # ...yet numbered chunks, written as separate reads, come back in order and intact.
        sent = bytearray()
        for i in range(300):
            chunk = struct.pack(">I", i) + bytes([i % 251]) * (i * 7 % 1500)
            writer.write(chunk)
            sent += chunk
            if i % 3 == 0:
                await asyncio.sleep(0.001)
        got = await asyncio.wait_for(reader.readexactly(len(sent)), 10)
        assert got == bytes(sent)

        # The same with a bandwidth cap: per-segment jitter, still ordered.
        emu.set_link(bandwidth_bps=50e6, jitter_dist="uniform")
        writer.write(bytes(sent))
        assert await asyncio.wait_for(reader.readexactly(len(sent)), 10) == bytes(sent)
        await _close(writer)


async def test_inflight_bytes_are_bounded_and_backpressure_reaches_the_sender() -> None:
    limit = 64 * 1024
    link = LinkConfig(bandwidth_bps=1e6, max_inflight_bytes=limit, handshake_rtt=False)
    sinks: list[_Sink] = []

    def factory() -> asyncio.Protocol:
        sinks.append(_Sink())
        return sinks[-1]

    async with _server(factory) as upstream, WanEmulator((LOCAL, upstream), link) as emu:
        _, writer = await _connect(emu.port)
        writer.write(b"x" * 8_000_000)  # far more than the link moves in the test's time
        peak = 0
        for _ in range(40):
            await asyncio.sleep(0.01)
            for info in emu.connections:
                peak = max(peak, info.queued_up)
        # One socket read (<= 256 KiB) may land on top of a full queue, no more.
        assert 0 < peak <= limit + 256 * 1024, peak
        assert writer.transport.get_write_buffer_size() > 0  # the client is being held back
        writer.transport.abort()


# -- faults --------------------------------------------------------------------------------


async def test_drop_all_then_reconnect() -> None:
    async with _server(_Echo) as upstream, WanEmulator((LOCAL, upstream)) as emu:
        reader, writer = await _connect(emu.port)
        await _echo_rtt(reader, writer)
        assert emu.drop_all() == 1
        assert await _is_dead(reader)
        reader2, writer2 = await _connect(emu.port)
        assert await _echo_rtt(reader2, writer2) < 0.05
        stats = emu.stats
        assert stats.faults_by_kind == {"drop_all": 1}
        assert (stats.connections_accepted, stats.connections_active) == (2, 1)
        await _close(writer2)
        writer.transport.abort()


@pytest.mark.parametrize("direction", ["up", "down"])
async def test_drop_after_bytes_cuts_exactly(direction: str) -> None:
    n = 12_345
    payload = bytes(i * 31 % 256 for i in range(100_000))
    loop = asyncio.get_running_loop()
    sinks: list[_Sink] = []

    def sink_factory() -> asyncio.Protocol:
        sinks.append(_Sink())
        return sinks[-1]

    factory: Callable[[], asyncio.Protocol] = sink_factory if direction == "up" else _Echo
    link = LinkConfig(rtt_ms=10)
    async with _server(factory) as upstream, WanEmulator((LOCAL, upstream), link) as emu:
        client = _Sink()
        if direction == "up":
            emu.drop_after_bytes("up", n, next_connection=True)
            transport, _ = await loop.create_connection(lambda: client, LOCAL, emu.port)
            assert isinstance(transport, asyncio.Transport)
            transport.write(payload)
            await until(lambda: bool(sinks))
            await asyncio.wait_for(sinks[0].done, 5)
            assert bytes(sinks[0].data) == payload[:n]
        else:
            transport, _ = await loop.create_connection(lambda: client, LOCAL, emu.port)
            assert isinstance(transport, asyncio.Transport)
            transport.write(b"hello")
            await until(lambda: len(client.data) == 5)
            emu.drop_after_bytes("down", n)  # the connection open now
            transport.write(payload)
        await asyncio.wait_for(client.done, 5)
        if direction == "down":
            assert bytes(client.data) == b"hello" + payload[:n]
        assert emu.stats.faults_by_kind == {"drop_after_bytes": 1}
        assert emu.stats.connections_active == 0


@pytest.mark.parametrize("direction", ["up", "down"])
async def test_stall_delays_delivery_by_the_stall(direction: str) -> None:
    link = LinkConfig(bandwidth_bps=None, handshake_rtt=False)
    async with _server(_Echo) as upstream, WanEmulator((LOCAL, upstream), link) as emu:
        reader, writer = await _connect(emu.port)
        await _echo_rtt(reader, writer)
        emu.stall(direction, 0.3)  # type: ignore[arg-type]
        stalled = await _echo_rtt(reader, writer)
        print(f"stall 300 ms {direction}: echo took {stalled * 1000:.1f} ms")
        assert 0.29 <= stalled <= 0.45, stalled
        assert await _echo_rtt(reader, writer) < 0.05  # the stall is over
        emu.stall("both", 5.0)
        writer.write(b"abc")
        await until(lambda: emu.connections[0].queued_up == 3, 5.0, "the bytes held")
        emu.stall("both", 0)  # ends early: held bytes flow at once
        assert await asyncio.wait_for(reader.readexactly(3), 1) == b"abc"
        assert emu.stats.faults_by_kind == {"stall": 2}
        await _close(writer)


async def test_refuse_then_recover() -> None:
    async with _server(_Echo) as upstream, WanEmulator((LOCAL, upstream)) as emu:
        emu.refuse(0.3)
        reader, writer = await _connect(emu.port)  # TCP accepts, then the proxy slams it shut
        assert await _is_dead(reader, 1.0)
        writer.transport.abort()
        assert emu.stats.connections_refused == 1
        await asyncio.sleep(0.35)
        reader, writer = await _connect(emu.port)
        await _echo_rtt(reader, writer)
        stats = emu.stats
        assert (stats.connections_accepted, stats.faults_by_kind) == (1, {"refuse": 1})
        await _close(writer)


async def test_random_faults_drop_connections_and_can_be_turned_off() -> None:
    async with _server(_Echo) as upstream, WanEmulator((LOCAL, upstream)) as emu:
        emu.random_faults(0.99, seed=3)  # hazard ~4.6/s: mean lifetime ~0.2 s
        clients = [await _connect(emu.port) for _ in range(4)]
        for reader, _ in clients:
            assert await _is_dead(reader, 4.0)
        assert emu.stats.faults_by_kind == {"random": 4}
        emu.random_faults(0.0)
        reader, writer = await _connect(emu.port)
        await asyncio.sleep(0.3)
        await _echo_rtt(reader, writer)
        assert emu.stats.connections_active == 1
        await _close(writer)
        for _, w in clients:
            w.transport.abort()


# -- transparency and hygiene ---------------------------------------------------------------


async def test_aiohttp_websocket_through_the_proxy() -> None:
    async def ws_echo(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                await ws.send_bytes(msg.data)
        return ws

    app = web.Application()
    app.router.add_get("/ws", ws_echo)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, LOCAL, 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        link = LinkConfig(rtt_ms=40, jitter_ms=2, bandwidth_bps=50e6)
        async with (
            WanEmulator((LOCAL, port), link) as emu,
            aiohttp.ClientSession() as session,
            session.ws_connect(f"http://{LOCAL}:{emu.port}/ws", max_msg_size=0) as ws,
        ):
            loop = asyncio.get_running_loop()
            rtts = []
            for i in range(6):
                start = loop.time()
                await ws.send_bytes(b"%d" % i)
                assert await ws.receive_bytes(timeout=5) == b"%d" % i
                rtts.append(loop.time() - start)
            print(f"WebSocket frame RTT, 40 ms link: {[round(r * 1000, 1) for r in rtts]} ms")
            assert all(0.034 <= r <= 0.090 for r in rtts), rtts
            sent = 0
            for size in (1, 125, 126, 65535, 65536, 300_000):
                frame = bytes(j * 7 % 256 for j in range(size))
                await ws.send_bytes(frame)
                assert await ws.receive_bytes(timeout=5) == frame
                sent += size
            await ws.close()
        assert emu.stats.bytes_up > sent and emu.stats.bytes_down > sent
        assert emu.stats.faults_injected == 0
    finally:
        await runner.cleanup()


async def test_stop_cancels_and_awaits_every_task() -> None:
    before = set(asyncio.all_tasks())
    async with _server(_Echo) as upstream:
        emu = WanEmulator((LOCAL, upstream), LinkConfig(rtt_ms=400, bandwidth_bps=1e6))
        await emu.start()
        clients = [await _connect(emu.port) for _ in range(3)]
        for _, writer in clients:
            writer.write(b"y" * 300_000)  # in flight, queued, paced
        emu.stall("down", 10)
        await until(lambda: len(emu.connections) == 3)
        # one writer per direction each
        await until(lambda: len(set(asyncio.all_tasks()) - before) == 6, 5.0, "6 writer tasks")
        await emu.stop()
        assert set(asyncio.all_tasks()) == before
        assert emu.stats.connections_active == 0
        for reader, writer in clients:
            assert await _is_dead(reader)
            writer.transport.abort()
        await emu.stop()  # idempotent
    assert set(asyncio.all_tasks()) == before


async def test_cli_runs_until_sigterm() -> None:
    async with _server(_Echo) as upstream:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "testkit.net.wanem",
            "--listen",
            f"{LOCAL}:0",
            "--upstream",
            f"{LOCAL}:{upstream}",
            "--rtt-ms",
            "20",
            "--jitter-ms",
            "1",
            "--bandwidth-mbit",
            "10",
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()
            assert "listening on" in line, line
            port = int(line.split(" -> ")[0].rsplit(":", 1)[1])
            reader, writer = await _connect(port)
            await _echo_rtt(reader, writer)
            assert 0.018 <= await _echo_rtt(reader, writer) <= 0.060
            await _close(writer)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 5) == 0
            assert b"stopping" in await proc.stdout.read()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_half_close_is_forwarded_after_the_data() -> None:
    async with (
        _server(_Echo) as upstream,
        WanEmulator((LOCAL, upstream), LinkConfig(rtt_ms=20)) as emu,
    ):
        reader, writer = await _connect(emu.port)
        writer.write(b"last words" * 1000)
        writer.write_eof()  # FIN travels behind the bytes; the echo server closes after it
        assert await asyncio.wait_for(reader.read(), 2) == b"last words" * 1000
        await until(lambda: emu.stats.connections_active == 0)
        await _close(writer)


async def test_upstream_down_resets_the_client() -> None:
    async with _server(_Echo) as dead_port:
        pass  # now closed: nothing listens there
    async with WanEmulator((LOCAL, dead_port)) as emu:
        reader, writer = await _connect(emu.port)
        assert await _is_dead(reader)
        assert emu.stats.upstream_connect_failures == 1
        writer.transport.abort()
