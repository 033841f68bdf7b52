"""A userspace WAN emulator: an asyncio TCP proxy with delay, jitter, a bandwidth cap and faults.

The edge connects to the emulator instead of the verifier; every accepted connection is forwarded
to ``upstream``. Both ends see ordinary TCP (and so ordinary WebSocket framing): nothing in the
byte stream is changed, only *when* bytes arrive, and whether the connection survives.

Link model (per direction, "up" = client → upstream, "down" = upstream → client):

* **Bandwidth**: the direction is one link shared by all connections, shaped by a token bucket
  (``bandwidth_bps`` bits/s, ``burst_bytes`` of burst). Bytes are cut into ``segment_bytes``
  segments (packets); a segment's *transmit-finish* time is when the bucket lets its last byte
  through (serialization delay, queueing behind earlier segments of any connection).
* **Propagation**: a segment is delivered at
  ``max(finish + one_way_delay + jitter, previous delivery time on this connection)``, so jitter
  never reorders bytes within a connection (and never makes a delay negative).
* **Handshake**: the client's ``connect()`` completes locally at once, so (with ``handshake_rtt``)
  the first bytes of a connection are held as if the TCP three-way handshake had taken one RTT.
* **Buffering**: at most ``max_inflight_bytes`` are queued per direction per connection; beyond
  that the proxy stops reading the source socket, so TCP backpressure reaches the sender.

Each connection has exactly one writer task per direction (a delivery queue drained at scheduled
loop times, ``asyncio.get_running_loop().time()``); reading is done by protocol callbacks, so no
task is created per chunk. Every task the emulator creates is tracked and cancelled/awaited by
:meth:`WanEmulator.stop`.

Faults: :meth:`WanEmulator.drop_all`, :meth:`~WanEmulator.drop`,
:meth:`~WanEmulator.drop_after_bytes`, :meth:`~WanEmulator.stall`,
:meth:`~WanEmulator.refuse`, :meth:`~WanEmulator.random_faults`. The link can be changed while
running with :meth:`~WanEmulator.set_link` (bytes already in flight keep their schedule).

CLI::

    python -m testkit.net.wanem --listen 127.0.0.1:9000 --upstream 127.0.0.1:8000 \\
        --rtt-ms 100 --jitter-ms 5 --bandwidth-mbit 10
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import enum
import logging
import math
import random
import signal
import socket
import struct
import sys
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import InitVar, dataclass
from types import TracebackType
from typing import Any, Final, Literal

__all__ = [
    "DEFAULT_BANDWIDTH_BPS",
    "ConnectionInfo",
    "Crossing",
    "Direction",
    "JitterDist",
    "LinkConfig",
    "WanEmulator",
    "WanStats",
    "main",
    "round_trips",
]

log = logging.getLogger(__name__)

Direction = Literal["up", "down"]
"""``"up"``: client → upstream (edge → cloud); ``"down"``: upstream → client."""
DirectionArg = Literal["up", "down", "both"]
JitterDist = Literal["uniform", "normal"]
CloseMode = Literal["graceful", "fin", "rst"]

DEFAULT_BANDWIDTH_BPS: Final = 10_000_000
"""10 Mbit/s, the default cap in each direction."""

_DIRECTIONS: Final[tuple[Direction, Direction]] = ("up", "down")
_SLACK_S: Final = 0.0005  # segments due within this much are written together
_MAX_BATCH_BYTES: Final = 256 * 1024  # largest single write (then drain) of a writer
_MIN_SEGMENT_S: Final = 0.001  # segments carry at least this much transmission time
_FLUSH_BEFORE_DROP_S: Final = 1.0  # longest wait for a receiver to take bytes before a cut


class _Unset(enum.Enum):
    UNSET = enum.auto()


_UNSET: Final = _Unset.UNSET


def _check_nonneg(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_bandwidth(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be > 0 bits/s or None (unlimited), got {value!r}")


@dataclass(frozen=True)
class LinkConfig:
    """Parameters of the emulated link. Immutable; change a running emulator with ``set_link``.

    ``rtt_ms`` (init-only shorthand) sets both one-way delays to ``rtt_ms / 2``, overriding
    ``up_delay_ms``/``down_delay_ms``; ``bandwidth_bps`` (init-only) sets both directions'
    caps. Bandwidths are in **bits** per second; ``None`` means unlimited.
    """

    up_delay_ms: float = 0.0
    """One-way propagation delay client → upstream."""
    down_delay_ms: float = 0.0
    """One-way propagation delay upstream → client."""
    jitter_ms: float = 0.0
    """Uniform: delay ± jitter_ms; normal: standard deviation. Added per segment."""
    jitter_dist: JitterDist = "uniform"
    up_bandwidth_bps: float | None = DEFAULT_BANDWIDTH_BPS
    down_bandwidth_bps: float | None = DEFAULT_BANDWIDTH_BPS
    burst_bytes: int = 16 * 1024
    """Token-bucket depth: this many bytes pass an idle link without serialization delay."""
    segment_bytes: int = 1500
    """Packet size for serialization timing and per-packet jitter (capped links only). At high
    rates segments grow to 1 ms of transmission time, to keep the queues short."""
    max_inflight_bytes: int = 8 * 1024 * 1024
    """Bytes queued per direction per connection before the proxy stops reading the source."""
    handshake_rtt: bool = True
    """Hold a new connection's first bytes as if its TCP handshake had taken one RTT."""
    seed: int = 0
    """Seed of the jitter RNG (the random-fault RNG is seeded separately)."""
    rtt_ms: InitVar[float | None] = None
    bandwidth_bps: InitVar[float | _Unset | None] = _UNSET

    def __post_init__(self, rtt_ms: float | None, bandwidth_bps: float | _Unset | None) -> None:
        if rtt_ms is not None:
            _check_nonneg("rtt_ms", rtt_ms)
            object.__setattr__(self, "up_delay_ms", rtt_ms / 2)
            object.__setattr__(self, "down_delay_ms", rtt_ms / 2)
        if not isinstance(bandwidth_bps, _Unset):
            object.__setattr__(self, "up_bandwidth_bps", bandwidth_bps)
            object.__setattr__(self, "down_bandwidth_bps", bandwidth_bps)
        _check_nonneg("up_delay_ms", self.up_delay_ms)
        _check_nonneg("down_delay_ms", self.down_delay_ms)
        _check_nonneg("jitter_ms", self.jitter_ms)
        if self.jitter_dist not in ("uniform", "normal"):
            raise ValueError(f"jitter_dist must be 'uniform' or 'normal', got {self.jitter_dist!r}")
        _check_bandwidth("up_bandwidth_bps", self.up_bandwidth_bps)
        _check_bandwidth("down_bandwidth_bps", self.down_bandwidth_bps)
        for name in ("burst_bytes", "segment_bytes", "max_inflight_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @property
    def round_trip_ms(self) -> float:
        """Propagation RTT, ``up_delay_ms + down_delay_ms`` (no jitter, no serialization)."""
        return self.up_delay_ms + self.down_delay_ms

    def delay_s(self, direction: Direction) -> float:
        return (self.up_delay_ms if direction == "up" else self.down_delay_ms) / 1000.0

    def bandwidth(self, direction: Direction) -> float | None:
        return self.up_bandwidth_bps if direction == "up" else self.down_bandwidth_bps


@dataclass(frozen=True)
class WanStats:
    """A snapshot of the emulator's counters.

    ``bytes_up``/``bytes_down`` count bytes handed to the destination socket. A fault is counted
    when it takes effect: one per connection dropped (``drop_all``, ``drop``,
    ``drop_after_bytes``, ``random``), one per connection refused (``refuse``), one per
    ``stall`` call.
    """

    bytes_up: int
    bytes_down: int
    connections_accepted: int
    connections_refused: int
    connections_active: int
    upstream_connect_failures: int
    faults_injected: int
    faults_by_kind: Mapping[str, int]


@dataclass(frozen=True)
class Crossing:
    """Bytes that crossed the link: ``conn``'s bytes in ``direction``, handed to the emulator
    by their sender at ``fed_at`` (the latest of them) and delivered at ``delivered_at`` (loop
    time). The emulator keeps these when made with ``trace=True``."""

    conn: int
    direction: Direction
    fed_at: float
    delivered_at: float
    nbytes: int


def round_trips(crossings: Sequence[Crossing], conn: int, since: float, until: float) -> float:
    """Round trips on ``conn``'s critical path to the last downlink delivery at or before
    ``until``, counted back to ``since``: each step goes from a delivery to the latest delivery
    the other way that reached its sender before it sent it (what it may have waited for), and
    stops at bytes sent before ``since``. Two crossings are one round trip; a connection's TCP
    handshake (``handshake_rtt``) is not a crossing and is not counted here."""
    mine = [c for c in crossings if c.conn == conn]
    downs = [c for c in mine if c.direction == "down" and since <= c.delivered_at <= until]
    if not downs:
        return 0.0
    step: Crossing | None = downs[-1]
    n = 0
    while step is not None and step.fed_at >= since:
        n += 1
        other = "up" if step.direction == "down" else "down"
        before = [
            c for c in mine if c.direction == other and since <= c.delivered_at <= step.fed_at
        ]
        step = before[-1] if before else None
    return n / 2


@dataclass(frozen=True)
class ConnectionInfo:
    id: int
    peer: object
    opened_at: float
    bytes_up: int
    bytes_down: int
    queued_up: int
    queued_down: int


class _Marker:
    """A non-data item in a delivery queue: EOF (FIN), or a cut (close both sockets)."""

    __slots__ = ("fault", "kind", "mode")

    def __init__(
        self, kind: Literal["eof", "cut"], mode: CloseMode = "rst", fault: str = ""
    ) -> None:
        self.kind = kind
        self.mode: CloseMode = mode
        self.fault = fault  # counted when the cut takes effect; "" for a propagated reset


_EOF: Final = _Marker("eof")
_QueueItem = tuple[float, "memoryview | _Marker", float]  # (deliver at, item, fed at)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Alarm:
    """One task's sleep, until a loop time or until a callback wakes it early."""

    def __init__(self) -> None:
        self._fut: asyncio.Future[None] | None = None

    def wake(self) -> None:
        if self._fut is not None:
            _resolve(self._fut)

    async def sleep(self, until: float | None) -> None:
        """Until loop time ``until`` (None: no limit) or the next :meth:`wake`."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._fut = fut
        timer = loop.call_at(until, _resolve, fut) if until is not None else None
        try:
            await fut
        finally:
            self._fut = None
            if timer is not None:
                timer.cancel()


def _close_transport(transport: asyncio.BaseTransport | None, mode: CloseMode) -> None:
    if transport is None or transport.is_closing():
        return
    if mode == "graceful":
        transport.close()  # flushes what is buffered, then FIN
        return
    if mode == "rst":
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # SO_LINGER 0: close() sends RST
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert isinstance(transport, asyncio.Transport)
    transport.abort()


class _Endpoint(asyncio.Protocol):
    """One socket of a proxied connection: the accepted client, or the upstream connection."""

    def __init__(self, emu: WanEmulator, conn: _Conn | None = None) -> None:
        self.emu = emu
        self.conn = conn
        self.transport: asyncio.Transport | None = None
        self.paused_writing = False
        self.lost = False
        self._alarm = _Alarm()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.conn is None:
            self.emu._on_accept(self)

    def data_received(self, data: bytes) -> None:
        if self.conn is not None:
            self.conn.on_data(self, data)

    def eof_received(self) -> bool:
        if self.conn is not None:
            self.conn.on_eof(self)
        return True  # keep our half open: the FIN is forwarded after the link delay

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._alarm.wake()
        if self.conn is not None:
            self.conn.on_lost(self)

    def pause_writing(self) -> None:
        self.paused_writing = True

    def resume_writing(self) -> None:
        self.paused_writing = False
        self._alarm.wake()

    def writable(self) -> bool:
        return self.transport is not None and not self.lost and not self.transport.is_closing()

    async def wait_drained(self, deadline: float | None = None) -> bool:
        """Wait until the transport is below its high-water mark (or lost); False on timeout."""
        loop = asyncio.get_running_loop()
        while self.paused_writing and not self.lost:
            if deadline is not None and loop.time() >= deadline:
                return False
            await self._alarm.sleep(deadline)
        return True


class _Pipe:
    """One direction of one connection: a delivery queue and the task that drains it."""

    def __init__(self, conn: _Conn, direction: Direction, src: _Endpoint, dst: _Endpoint) -> None:
        self.conn = conn
        self.direction: Direction = direction
        self.src = src
        self.dst = dst
        self.queue: collections.deque[_QueueItem] = collections.deque()
        self.queued_bytes = 0
        self.forwarded = 0
        self.last_when = 0.0  # delivery time of the latest queued item (ordering floor)
        self.src_paused = False
        self.cut_remaining: int | None = None  # bytes still allowed before a scripted cut
        self.cut_mode: CloseMode = "rst"
        self.closed_for_input = False  # cut or reset queued: ignore further input
        self.eof_delivered = False
        self._alarm = _Alarm()

    # -- input side (protocol callbacks, synchronous) ------------------------------------------

    def feed(self, data: bytes) -> None:
        if self.conn.closed or self.closed_for_input:
            return
        cut = False
        if self.cut_remaining is not None:
            if len(data) >= self.cut_remaining:
                data = data[: self.cut_remaining]
                cut = True
            else:
                self.cut_remaining -= len(data)
        if data:
            self._schedule_data(data)
        if cut:
            self.push_cut(self.cut_mode, "drop_after_bytes")
        elif self.queued_bytes >= self.conn.emu.link.max_inflight_bytes:
            self._pause_source()

    def arm_cut(self, n_bytes: int, mode: CloseMode) -> None:
        self.cut_mode = mode
        if n_bytes == 0:
            self.push_cut(mode, "drop_after_bytes")
        else:
            self.cut_remaining = n_bytes

    def push_eof(self) -> None:
        if not self.closed_for_input:
            self._push(self._marker_time(), _EOF)

    def push_cut(self, mode: CloseMode, fault: str) -> None:
        """Queue "close both sockets" behind everything already queued in this direction."""
        if self.closed_for_input:
            return
        self.closed_for_input = True
        self.cut_remaining = None
        self._push(self._marker_time(), _Marker("cut", mode, fault))
        self._pause_source()

    def _marker_time(self) -> float:
        emu = self.conn.emu
        return emu.loop_time() + emu.link.delay_s(self.direction)

    def _schedule_data(self, data: bytes) -> None:
        emu = self.conn.emu
        link = emu.link
        now = emu.loop_time()
        delay = link.delay_s(self.direction)
        rate_bps = link.bandwidth(self.direction)
        view = memoryview(data)
        if rate_bps is None:
            self._push(now + max(0.0, delay + emu._jitter_s()), view)
            self.queued_bytes += len(view)
            return
        byte_rate = rate_bps / 8.0
        tau = link.burst_bytes / byte_rate
        seg = max(link.segment_bytes, int(byte_rate * _MIN_SEGMENT_S))
        tat = emu._tat[self.direction]
        for off in range(0, len(view), seg):
            piece = view[off : off + seg]
            # GCRA form of a token bucket: tat is when the link would finish at the pure rate;
            # the burst lets a segment finish up to tau earlier, but never before it arrived.
            tat = max(tat, now) + len(piece) / byte_rate
            finish = max(now, tat - tau)
            self._push(finish + max(0.0, delay + emu._jitter_s()), piece)
        emu._tat[self.direction] = tat
        self.queued_bytes += len(view)

    def _push(self, when: float, item: memoryview | _Marker) -> None:
        when = max(when, self.last_when)
        self.last_when = when
        was_empty = not self.queue
        self.queue.append((when, item, self.conn.emu.loop_time()))
        if was_empty:
            self.kick()  # the head changed; otherwise the writer's wake-up time stands

    def _pause_source(self) -> None:
        if not self.src_paused and self.src.writable():
            assert self.src.transport is not None
            self.src.transport.pause_reading()
            self.src_paused = True

    def maybe_resume_source(self) -> None:
        if (
            self.src_paused
            and not self.closed_for_input
            and self.queued_bytes <= self.conn.emu.link.max_inflight_bytes // 2
        ):
            self.src_paused = False
            if self.src.writable():
                assert self.src.transport is not None
                self.src.transport.resume_reading()

    # -- output side (the writer task) --------------------------------------------------------

    def kick(self) -> None:
        self._alarm.wake()

    async def run(self) -> None:
        emu = self.conn.emu
        queue = self.queue
        while not self.conn.closed:
            if not queue:
                await self._alarm.sleep(None)
                continue
            now = emu.loop_time()
            due = max(queue[0][0], emu._stall_until[self.direction])
            if due > now + _SLACK_S:
                await self._alarm.sleep(due)
                continue
            horizon = now + _SLACK_S
            parts: list[memoryview] = []
            nbytes = 0
            fed = 0.0
            marker: _Marker | None = None
            while queue and queue[0][0] <= horizon and nbytes < _MAX_BATCH_BYTES:
                _, item, fed_at = queue.popleft()
                if isinstance(item, _Marker):
                    marker = item
                    break
                parts.append(item)
                nbytes += len(item)
                fed = max(fed, fed_at)
            if nbytes:
                self._write(parts, nbytes)
                if emu.crossings is not None:
                    emu.crossings.append(Crossing(self.conn.id, self.direction, fed, now, nbytes))
            if marker is not None:
                await self._deliver(marker)
            elif nbytes:
                await self.dst.wait_drained()

    def _write(self, parts: list[memoryview], nbytes: int) -> None:
        self.queued_bytes -= nbytes
        if self.dst.writable():
            assert self.dst.transport is not None
            self.dst.transport.write(parts[0] if len(parts) == 1 else b"".join(parts))
            self.forwarded += nbytes
            self.conn.emu._bytes[self.direction] += nbytes
        self.maybe_resume_source()

    async def _deliver(self, marker: _Marker) -> None:
        if marker.kind == "eof":
            if self.dst.writable():
                assert self.dst.transport is not None
                if self.dst.transport.can_write_eof():
                    self.dst.transport.write_eof()
            self.conn.on_eof_delivered(self)
            return
        # A cut: get what was already written out of our buffer first (bounded wait), so the
        # receiver sees exactly the bytes before the cut.
        if self.dst.writable():
            assert self.dst.transport is not None
            self.dst.transport.set_write_buffer_limits(high=0)
            await self.dst.wait_drained(self.conn.emu.loop_time() + _FLUSH_BEFORE_DROP_S)
        self.conn.close(marker.mode, fault=marker.fault or None)


class _Conn:
    """A proxied connection: two endpoints, two pipes, a set-up task and two writer tasks."""

    def __init__(self, emu: WanEmulator, cid: int, client: _Endpoint, opened_at: float) -> None:
        self.emu = emu
        self.id = cid
        self.opened_at = opened_at
        self.client = client
        self.upstream = _Endpoint(emu, self)
        client.conn = self
        self.up = _Pipe(self, "up", src=client, dst=self.upstream)
        self.down = _Pipe(self, "down", src=self.upstream, dst=client)
        self.closed = False
        self.connected = False
        self.tasks: list[asyncio.Task[None]] = []
        self.fault_timer: asyncio.TimerHandle | None = None
        assert client.transport is not None
        self.peer: object = client.transport.get_extra_info("peername")
        if emu.link.handshake_rtt:
            floor = opened_at + emu.link.round_trip_ms / 1000.0
            self.up.last_when = floor + emu.link.delay_s("up")
            self.down.last_when = floor

    def pipes(self) -> tuple[_Pipe, _Pipe]:
        return (self.up, self.down)

    def pipe_from(self, ep: _Endpoint) -> _Pipe:
        return self.up if ep is self.client else self.down

    def pipe(self, direction: Direction) -> _Pipe:
        return self.up if direction == "up" else self.down

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        host, port = self.emu.upstream
        try:
            await loop.create_connection(lambda: self.upstream, host, port)
        except OSError as exc:
            log.warning("wanem: connection %d: upstream %s:%d: %s", self.id, host, port, exc)
            self.emu._upstream_failures += 1
            self.close("rst")
            return
        if self.closed:
            _close_transport(self.upstream.transport, "fin")
            return
        self.connected = True
        for pipe in self.pipes():
            self.tasks.append(self.emu._spawn(pipe.run(), f"wanem-{self.id}-{pipe.direction}"))

    def on_data(self, ep: _Endpoint, data: bytes) -> None:
        self.pipe_from(ep).feed(data)

    def on_eof(self, ep: _Endpoint) -> None:
        self.pipe_from(ep).push_eof()

    def on_eof_delivered(self, pipe: _Pipe) -> None:
        pipe.eof_delivered = True
        if self.up.eof_delivered and self.down.eof_delivered:
            self.close("graceful")

    def on_lost(self, ep: _Endpoint) -> None:
        """An endpoint's socket failed or was reset by its peer: reset the other side too, but
        only after the bytes already in flight towards it (a real RST travels the link)."""
        if self.closed:
            return
        other = self.upstream if ep is self.client else self.client
        if not self.connected or other.lost:
            self.close("rst")
            return
        self.pipe_from(ep).push_cut("rst", "")

    def close(self, mode: CloseMode, fault: str | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        _close_transport(self.client.transport, mode)
        _close_transport(self.upstream.transport, mode)
        if self.fault_timer is not None:
            self.fault_timer.cancel()
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()
        for pipe in self.pipes():
            self.emu._refund(pipe.direction, pipe.queued_bytes)
            pipe.kick()
        self.emu._conns.pop(self.id, None)
        if fault:
            self.emu._count_fault(fault)

    def random_fault(self) -> None:
        self.fault_timer = None
        self.close("rst", fault="random")

    def info(self) -> ConnectionInfo:
        return ConnectionInfo(
            id=self.id,
            peer=self.peer,
            opened_at=self.opened_at,
            bytes_up=self.up.forwarded,
            bytes_down=self.down.forwarded,
            queued_up=self.up.queued_bytes,
            queued_down=self.down.queued_bytes,
        )


class WanEmulator:
    """An emulated WAN link in front of ``upstream``: a TCP proxy on ``listen_host:listen_port``.

    Use ``async with WanEmulator(upstream=("127.0.0.1", port), link=LinkConfig(rtt_ms=100))
    as emu:`` and connect to ``("127.0.0.1", emu.port)``. All methods must be called from the
    event loop the emulator runs on.
    """

    def __init__(
        self,
        upstream: tuple[str, int],
        link: LinkConfig | None = None,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        trace: bool = False,
    ) -> None:
        """``trace``: keep every crossing (``crossings``), to count round trips."""
        self.upstream = upstream
        self.crossings: list[Crossing] | None = [] if trace else None
        self.listen_host = listen_host
        self.listen_port = listen_port
        self._link = link if link is not None else LinkConfig()
        self._rng = random.Random(self._link.seed)
        self._fault_rng = random.Random(f"wanem-faults-{self._link.seed}")
        self._fault_rate = 0.0  # hazard rate (1/s) of the random fault mode
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._conns: dict[int, _Conn] = {}
        self._next_id = 1
        self._tat: dict[Direction, float] = {"up": 0.0, "down": 0.0}
        self._stall_until: dict[Direction, float] = {"up": 0.0, "down": 0.0}
        self._refuse_until = 0.0
        self._pending_cuts: list[tuple[Direction, int, CloseMode]] = []
        self._bytes: dict[Direction, int] = {"up": 0, "down": 0}
        self._accepted = 0
        self._refused = 0
        self._upstream_failures = 0
        self._faults: collections.Counter[str] = collections.Counter()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> int:
        """Start listening; returns the bound port (an ephemeral one if ``listen_port`` is 0)."""
        if self._server is not None or self._closing:
            raise RuntimeError("WanEmulator.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(
            lambda: _Endpoint(self), self.listen_host, self.listen_port, reuse_address=True
        )
        self._port = int(self._server.sockets[0].getsockname()[1])
        return self._port

    async def stop(self) -> None:
        """Close the listener and every connection; cancel and await every task created."""
        if self._closing:
            return
        self._closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns.values()):
            conn.close("fin")
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        await asyncio.sleep(0)  # let the transports' connection_lost callbacks run

    async def __aenter__(self) -> WanEmulator:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("WanEmulator not started")
        return self._port

    @property
    def link(self) -> LinkConfig:
        return self._link

    def loop_time(self) -> float:
        if self._loop is None:
            raise RuntimeError("WanEmulator not started")
        return self._loop.time()

    # -- link --------------------------------------------------------------------------------

    def set_link(
        self,
        link: LinkConfig | None = None,
        *,
        rtt_ms: float | _Unset = _UNSET,
        delay_ms: float | _Unset = _UNSET,
        up_delay_ms: float | _Unset = _UNSET,
        down_delay_ms: float | _Unset = _UNSET,
        jitter_ms: float | _Unset = _UNSET,
        jitter_dist: JitterDist | _Unset = _UNSET,
        bandwidth_bps: float | _Unset | None = _UNSET,
        up_bandwidth_bps: float | _Unset | None = _UNSET,
        down_bandwidth_bps: float | _Unset | None = _UNSET,
        burst_bytes: int | _Unset = _UNSET,
        segment_bytes: int | _Unset = _UNSET,
        max_inflight_bytes: int | _Unset = _UNSET,
        handshake_rtt: bool | _Unset = _UNSET,
        seed: int | _Unset = _UNSET,
    ) -> LinkConfig:
        """Change the link while running; returns the new config.

        Starts from ``link`` (or the current config) and applies the given fields. ``delay_ms``
        is a one-way delay for both directions; ``rtt_ms`` sets each direction to half;
        ``bandwidth_bps`` sets both caps. Bytes already in flight keep their delivery times;
        ordering within a connection is preserved across the change. A new ``seed`` reseeds
        the jitter RNG.
        """
        changes: dict[str, Any] = {
            name: value
            for name, value in (
                ("rtt_ms", rtt_ms),
                ("up_delay_ms", up_delay_ms),
                ("down_delay_ms", down_delay_ms),
                ("jitter_ms", jitter_ms),
                ("jitter_dist", jitter_dist),
                ("bandwidth_bps", bandwidth_bps),
                ("up_bandwidth_bps", up_bandwidth_bps),
                ("down_bandwidth_bps", down_bandwidth_bps),
                ("burst_bytes", burst_bytes),
                ("segment_bytes", segment_bytes),
                ("max_inflight_bytes", max_inflight_bytes),
                ("handshake_rtt", handshake_rtt),
                ("seed", seed),
            )
            if not isinstance(value, _Unset)
        }
        if not isinstance(delay_ms, _Unset):
            changes.setdefault("up_delay_ms", delay_ms)
            changes.setdefault("down_delay_ms", delay_ms)
        new = dataclasses.replace(link if link is not None else self._link, **changes)
        if new.seed != self._link.seed:
            self._rng = random.Random(new.seed)
        self._link = new
        for conn in list(self._conns.values()):
            for pipe in conn.pipes():
                pipe.maybe_resume_source()
                if pipe.queued_bytes >= new.max_inflight_bytes:
                    pipe._pause_source()
        return new

    def _refund(self, direction: Direction, nbytes: int) -> None:
        """Give back link time booked for bytes that will never be sent (a closed connection),
        so later traffic does not queue behind phantom bytes. Approximate: some of them may
        already have left the bucket and be only propagating."""
        rate_bps = self._link.bandwidth(direction)
        if nbytes <= 0 or rate_bps is None or self._loop is None:
            return
        now = self._loop.time()
        self._tat[direction] = max(now, self._tat[direction] - nbytes * 8.0 / rate_bps)

    def _jitter_s(self) -> float:
        jitter = self._link.jitter_ms / 1000.0
        if jitter <= 0:
            return 0.0
        if self._link.jitter_dist == "uniform":
            return self._rng.uniform(-jitter, jitter)
        return self._rng.gauss(0.0, jitter)

    # -- faults ------------------------------------------------------------------------------

    def drop_all(self, *, rst: bool = True) -> int:
        """Close both sockets of every open connection now (RST, or FIN with ``rst=False``).

        Queued bytes are discarded. Returns how many connections were dropped.
        """
        conns = list(self._conns.values())
        for conn in conns:
            conn.close("rst" if rst else "fin", fault="drop_all")
        return len(conns)

    def drop(self, conn_id: int, *, rst: bool = True) -> None:
        """Close both sockets of one connection now (see :attr:`connections` for ids)."""
        self._conns[conn_id].close("rst" if rst else "fin", fault="drop")

    def drop_after_bytes(
        self,
        direction: Direction,
        n_bytes: int,
        *,
        conn_id: int | None = None,
        next_connection: bool = False,
        rst: bool = True,
    ) -> None:
        """Let exactly ``n_bytes`` more bytes through in ``direction``, then drop the connection.

        Applies to connection ``conn_id`` (``KeyError`` if not open); or, with
        ``next_connection``, to the next connection accepted (counting from its first byte);
        otherwise to every connection open now. Bytes already queued are delivered first and
        not counted. The cut happens once the last allowed byte has been delivered (after the
        link delay).
        """
        if direction not in _DIRECTIONS:
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        if n_bytes < 0:
            raise ValueError("n_bytes must be >= 0")
        mode: CloseMode = "rst" if rst else "fin"
        if next_connection:
            self._pending_cuts.append((direction, n_bytes, mode))
            return
        conns = [self._conns[conn_id]] if conn_id is not None else list(self._conns.values())
        for conn in conns:
            conn.pipe(direction).arm_cut(n_bytes, mode)

    def stall(self, direction: DirectionArg, duration_s: float) -> None:
        """Stop delivering in ``direction`` (all connections, new ones too) for ``duration_s``.

        Sockets stay open and reading continues until ``max_inflight_bytes`` are queued; when
        the stall ends, the backlog is delivered. ``duration_s=0`` ends a stall early.
        """
        _check_nonneg("duration_s", duration_s)
        until = self.loop_time() + duration_s if duration_s > 0 else 0.0
        for d in _DIRECTIONS if direction == "both" else (direction,):
            self._stall_until[d] = until
        if duration_s > 0:
            self._count_fault("stall")
        for conn in self._conns.values():
            for pipe in conn.pipes():
                pipe.kick()

    def refuse(self, duration_s: float) -> None:
        """For ``duration_s``, accept new connections and close them at once (RST).

        ``duration_s=0`` stops refusing; ``math.inf`` refuses until told otherwise.
        """
        if math.isnan(duration_s) or duration_s < 0:
            raise ValueError("duration_s must be >= 0")
        self._refuse_until = self.loop_time() + duration_s if duration_s > 0 else 0.0

    def random_faults(self, probability_per_s: float, *, seed: int | None = None) -> None:
        """Drop (RST) each connection, open or future, with ``probability_per_s`` per second.

        Lifetimes are exponential with hazard ``-ln(1 - p)`` (so a connection survives one
        second with probability ``1 - p``), drawn from an RNG seeded with ``seed`` (default:
        the link seed). ``p = 0`` turns the mode off; ``p = 1`` drops connections at once.
        """
        if not 0.0 <= probability_per_s <= 1.0:
            raise ValueError("probability_per_s must be in [0, 1]")
        if seed is not None:
            self._fault_rng = random.Random(f"wanem-faults-{seed}")
        self._fault_rate = math.inf if probability_per_s >= 1.0 else -math.log1p(-probability_per_s)
        for conn in list(self._conns.values()):
            self._schedule_random_fault(conn)

    def _schedule_random_fault(self, conn: _Conn) -> None:
        if conn.fault_timer is not None:
            conn.fault_timer.cancel()
            conn.fault_timer = None
        if self._fault_rate <= 0 or self._loop is None:
            return
        delay = (
            0.0 if math.isinf(self._fault_rate) else self._fault_rng.expovariate(self._fault_rate)
        )
        conn.fault_timer = self._loop.call_later(delay, conn.random_fault)

    def _count_fault(self, kind: str) -> None:
        self._faults[kind] += 1

    # -- observation -------------------------------------------------------------------------

    @property
    def stats(self) -> WanStats:
        return WanStats(
            bytes_up=self._bytes["up"],
            bytes_down=self._bytes["down"],
            connections_accepted=self._accepted,
            connections_refused=self._refused,
            connections_active=len(self._conns),
            upstream_connect_failures=self._upstream_failures,
            faults_injected=sum(self._faults.values()),
            faults_by_kind=dict(self._faults),
        )

    @property
    def connections(self) -> list[ConnectionInfo]:
        return [conn.info() for conn in self._conns.values()]

    # -- internals ---------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("wanem: task %s failed", task.get_name(), exc_info=task.exception())

    def _on_accept(self, ep: _Endpoint) -> None:
        now = self.loop_time()
        if self._closing:
            _close_transport(ep.transport, "fin")
            return
        if now < self._refuse_until:
            self._refused += 1
            self._count_fault("refuse")
            _close_transport(ep.transport, "rst")
            return
        cid = self._next_id
        self._next_id += 1
        conn = _Conn(self, cid, ep, now)
        self._conns[cid] = conn
        self._accepted += 1
        pending, self._pending_cuts = self._pending_cuts, []
        for direction, n_bytes, mode in pending:
            conn.pipe(direction).arm_cut(n_bytes, mode)
        self._schedule_random_fault(conn)
        conn.tasks.append(self._spawn(conn.connect(), f"wanem-{cid}-connect"))


# -- CLI -------------------------------------------------------------------------------------


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _mbit(value: float | None) -> float | None:
    return None if value is None or value <= 0 else value * 1_000_000


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m testkit.net.wanem",
        description="Userspace WAN emulator: a TCP proxy adding delay, jitter and a bandwidth cap.",
    )
    p.add_argument("--listen", type=_host_port, default=("127.0.0.1", 9000), help="HOST:PORT")
    p.add_argument("--upstream", type=_host_port, required=True, help="HOST:PORT to forward to")
    p.add_argument("--rtt-ms", type=float, default=None, help="RTT; half each way")
    p.add_argument("--up-delay-ms", type=float, default=0.0, help="one-way delay client→upstream")
    p.add_argument("--down-delay-ms", type=float, default=0.0, help="one-way delay upstream→client")
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--jitter-dist", choices=("uniform", "normal"), default="uniform")
    p.add_argument(
        "--bandwidth-mbit", type=float, default=10.0, help="cap both ways; 0 = unlimited"
    )
    p.add_argument("--up-bandwidth-mbit", type=float, default=None)
    p.add_argument("--down-bandwidth-mbit", type=float, default=None)
    p.add_argument("--burst-bytes", type=int, default=LinkConfig.burst_bytes)
    p.add_argument("--max-inflight-bytes", type=int, default=LinkConfig.max_inflight_bytes)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-handshake-rtt", action="store_true", help="connections open instantly")
    p.add_argument(
        "--fault-probability", type=float, default=0.0, help="random drops, per connection per s"
    )
    p.add_argument("--stats-interval-s", type=float, default=0.0, help="print counters; 0 = off")
    return p


async def _serve(args: argparse.Namespace) -> int:
    both = _mbit(args.bandwidth_mbit)
    link = LinkConfig(
        up_delay_ms=args.up_delay_ms,
        down_delay_ms=args.down_delay_ms,
        rtt_ms=args.rtt_ms,
        jitter_ms=args.jitter_ms,
        jitter_dist=args.jitter_dist,
        up_bandwidth_bps=both if args.up_bandwidth_mbit is None else _mbit(args.up_bandwidth_mbit),
        down_bandwidth_bps=(
            both if args.down_bandwidth_mbit is None else _mbit(args.down_bandwidth_mbit)
        ),
        burst_bytes=args.burst_bytes,
        max_inflight_bytes=args.max_inflight_bytes,
        handshake_rtt=not args.no_handshake_rtt,
        seed=args.seed,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # e.g. Windows
            loop.add_signal_handler(sig, stop.set)
    host, port = args.listen
    async with WanEmulator(args.upstream, link, listen_host=host, listen_port=port) as emu:
        if args.fault_probability > 0:
            emu.random_faults(args.fault_probability, seed=args.seed)
        print(
            f"wanem: listening on {host}:{emu.port} -> {args.upstream[0]}:{args.upstream[1]} "
            f"({link})",
            flush=True,
        )
        interval = args.stats_interval_s if args.stats_interval_s > 0 else None
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if interval is not None:
                print(f"wanem: {emu.stats}", flush=True)
        print(f"wanem: stopping; {emu.stats}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 0
    except ValueError as exc:
        print(f"wanem: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
