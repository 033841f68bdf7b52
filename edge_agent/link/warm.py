"""The warm link: the edge's connection to one verifier, kept open between requests.

A request's session is a stream on this connection (:mod:`shared.wire.mux`), so a request never
waits for a TCP, TLS or WebSocket handshake while the link is up: its Hello and first Propose
leave at once, and its first token arrives one round trip (plus the prefill) later.

:class:`WarmLink` owns one task, the keeper, which opens the connection and reopens it in the
background when it drops, with jittered exponential backoff (a busy verifier's Retry-After is
honoured; a refused token or a verifier of another protocol version is retried at the backoff's
ceiling, not hammered). Each Ready names the verifier's target (:attr:`WarmLink.announced`); a
link told that its target cannot pair with the edge's draft (:meth:`WarmLink.refuse`) stays
open but opens no session (:class:`ModelMismatch`) until a Ready announces another model.

A request that finds no connection waits for the attempt under way (one at a time, shared by
every caller), or starts one, and gets its error: the agent's retry policy
(:class:`~edge_agent.session.retry.RetryPolicy`) decides what then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable

from edge_agent.link.connection import (
    Connection,
    LinkRefused,
    LinkSettings,
    StreamTransport,
    TokenRefused,
)
from edge_agent.session.transport import LinkClosed, VerifierBusy
from shared.wire.messages import Fingerprint

#: Hears of the link's changes: None when a connection opened (its Ready came), the error
#: when an attempt failed, :class:`LinkLost` when the open connection went.
LinkObserver = Callable[[BaseException | None], None]


class LinkLost(LinkClosed):
    """The warm link's open connection went (its message names why)."""


class ModelMismatch(LinkRefused):
    """The verifier's target cannot pair with the edge's draft (the message says what to
    change): no session is opened on this link, and waiting does not help."""


log = logging.getLogger("wanspec.edge.link")


class WarmLink:
    """One verifier's connection, kept warm. ``stream()`` opens a session on it."""

    def __init__(
        self,
        settings: LinkSettings,
        *,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
        rng: random.Random | None = None,
        observer: LinkObserver | None = None,
    ) -> None:
        self.settings = settings
        self.observer = observer
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._rng = rng or random.Random()
        self._conn: Connection | None = None
        self._attempt: asyncio.Future[Connection] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._failures = 0
        self._kick = asyncio.Event()
        #: Connections opened (the first and every reconnection), for tests and metrics.
        self.connects = 0
        #: The verifier's context (tokens a session may hold): what its last Ready announced,
        #: or less where a session's own Welcome said less (:meth:`note_context`); kept while
        #: the link is down (None: no connection opened yet).
        self.max_context: int | None = None
        self._announced: int | None = None  # the last Ready's max_context
        #: The target fingerprint of the last Ready (None: no connection opened yet).
        self.announced: Fingerprint | None = None
        #: Why this link opens no session (:meth:`refuse`), None while it may.
        self.refusal: str | None = None

    @property
    def up(self) -> bool:
        return self._conn is not None and not self._conn.closed.is_set()

    def start(self) -> None:
        """Start the keeper (needs a running loop); idempotent."""
        if self._keeper is None:
            self._keeper = asyncio.ensure_future(self._keep())

    async def stream(self) -> StreamTransport:
        """A new session's stream: at once while the link is up, else after a connection
        attempt (raising its LinkClosed / VerifierBusy / TokenRefused / LinkRefused)."""
        conn = self._conn
        if conn is None or conn.closed.is_set():
            conn = await self._connect()
        if self.refusal is not None:
            raise ModelMismatch(self.refusal)
        return conn.open_stream()

    def refuse(self, reason: str | None) -> None:
        """``reason``: why the target :attr:`announced` cannot serve this edge (its sessions
        would be refused), or None when it can. Set by the link's owner when it compares
        fingerprints; a new Ready clears it (the observer then hears of the new target)."""
        self.refusal = reason

    async def _connect(self) -> Connection:
        if self._attempt is None:
            self._attempt = asyncio.ensure_future(self._open())
            # (retrieved here, so that an attempt nobody awaits any more logs nothing)
            self._attempt.add_done_callback(lambda f: None if f.cancelled() else f.exception())
        # Shielded: a caller that gives up does not cancel the attempt the others wait on.
        return await asyncio.shield(self._attempt)

    async def _open(self) -> Connection:
        t0 = time.perf_counter()
        try:
            conn = await Connection.connect(self.settings)
        except (LinkClosed, OSError, LinkRefused) as e:
            self._failures += 1
            self._tell(e)
            raise
        except BaseException:
            self._failures += 1
            raise
        finally:
            self._attempt = None
        took = time.perf_counter() - t0  # TCP, TLS, the upgrade, the Ready
        self._failures = 0
        self.connects += 1
        announced = conn.ready.max_context
        if announced != self._announced or self.max_context is None:
            # A verifier that announces something new (a restart with other settings) is
            # taken at its word again; the same Ready keeps what its sessions showed.
            self._announced, self.max_context = announced, announced
        if conn.ready.fingerprint != self.announced:
            self.announced, self.refusal = conn.ready.fingerprint, None
        self._tell(None)  # (the observer compares the announced target with its draft)
        old, self._conn = self._conn, conn
        if old is not None:
            await old.close()
        log.info("link to %s up (%.0f ms to connect)", self.settings.url, 1000 * took)
        self._kick.set()
        return conn

    def _delay(self, err: BaseException) -> float:
        """Full jitter over the exponential backoff; at least a busy verifier's Retry-After;
        the ceiling for failures that waiting is unlikely to clear."""
        cap = min(self.backoff_max_s, self.backoff_initial_s * 2 ** max(0, self._failures - 1))
        if isinstance(err, (TokenRefused, LinkRefused)):
            cap = self.backoff_max_s
        delay = self._rng.uniform(cap / 2, cap)
        if isinstance(err, VerifierBusy):
            delay = max(delay, err.retry_after * self._rng.uniform(1.0, 1.2))
        return delay

    async def _keep(self) -> None:
        """Keep a connection open: open one, wait for it to drop, reopen after a backoff."""
        while True:
            conn = self._conn
            if conn is not None and not conn.closed.is_set():
                await conn.closed.wait()
                log.info("link to %s lost (%s); reconnecting", self.settings.url, conn.why)
                if self._conn is conn:  # (not a connection a newer one replaced)
                    self._tell(LinkLost(f"connection to {self.settings.url} lost: {conn.why}"))
                continue
            try:
                await self._connect()
            except (LinkClosed, OSError, LinkRefused) as e:
                delay = self._delay(e)
                log.debug("link to %s: %s; next attempt in %.1f s", self.settings.url, e, delay)
                self._kick.clear()
                # A request's own attempt may succeed meanwhile: wake up for it. (asyncio.wait,
                # not wait_for, which can swallow the keeper's cancellation on Python <= 3.11.)
                waiter = asyncio.ensure_future(self._kick.wait())
                try:
                    await asyncio.wait({waiter}, timeout=delay)
                finally:
                    waiter.cancel()

    def note_context(self, max_context: int) -> None:
        """A session's Welcome said its context: the link's limit is never more than that."""
        if self.max_context is None or max_context < self.max_context:
            self.max_context = max_context

    def _tell(self, err: BaseException | None) -> None:
        if self.observer is not None:
            self.observer(err)

    async def close(self) -> None:
        """Stop the keeper and close the connection (its sessions end)."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        if self._attempt is not None:
            self._attempt.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._attempt
        if self._conn is not None:
            await self._conn.close()
            self._conn = None
