"""The verifier links' state as the daemon reports it (``/health``): one :class:`LinkInfo` per
verifier, marked by what the warm links and the sessions saw and by a probe of each verifier's
``/health``; the daemon's availability follows from them. Its metrics:
:mod:`edge_agent.runtime.metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from ssl import SSLContext
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import orjson

from edge_agent.runtime.metrics import EdgeMetrics
from shared.enums import TextEnum

if TYPE_CHECKING:
    from edge_agent.runtime.settings import EdgeSettings

log = logging.getLogger("wanspec.edge.link")


class VerifierLinkState(TextEnum):
    """What the edge knows of a verifier: answered (``up``), refusing new sessions as busy
    (503/429 with Retry-After), loading its model (its /health says 503), stalled, down."""

    UNKNOWN = "unknown"
    UP = "up"
    BUSY = "busy"  # refused a session with Retry-After: alive, loaded
    LOADING = "loading"
    STALLED = "stalled"  # answers /health and pings, but sent no Verdict by its deadline
    DOWN = "down"


class Availability(TextEnum):
    """A verifier link's state in three words (four before anything is known), as /health
    reports it per verifier and overall: it serves (``up``), it is alive but not taking this
    edge's work now (``busy``: refusing sessions, loading, stalled), or it does not answer."""

    UP = "up"
    BUSY = "busy"
    DOWN = "down"
    UNKNOWN = "unknown"


def availability(state: VerifierLinkState) -> Availability:
    if state == VerifierLinkState.UP:
        return Availability.UP
    if state == VerifierLinkState.DOWN:
        return Availability.DOWN
    if state == VerifierLinkState.UNKNOWN:
        return Availability.UNKNOWN
    return Availability.BUSY


def health_url(ws_url: str) -> str:
    """The verifier's ``/health`` next to its WebSocket endpoint (``.../v1/session``)."""
    p = urlsplit(ws_url)
    scheme = {"ws": "http", "wss": "https"}.get(p.scheme, p.scheme)
    path = p.path.removesuffix("/").removesuffix("/v1/session") + "/health"
    return urlunsplit((scheme, p.netloc, path, "", ""))


@dataclass
class LinkInfo:
    url: str
    state: VerifierLinkState = VerifierLinkState.UNKNOWN
    error: str | None = None
    rtt_ms: float | None = None
    checked_at: float | None = None  # time.time() of the last probe or session
    #: The verifier's /health says sessions need a bearer token (None: not said).
    auth: bool | None = None
    #: The verifier refused this edge's token (a session's handshake, 401/403): only a new
    #: token helps, so no probe clears it.
    token_refused: str | None = None
    #: While ``state`` is BUSY: the monotonic time its refusal's Retry-After ends. A /health
    #: 200 before then does not clear it (a verifier that refuses sessions as overloaded
    #: still answers /health 200); a session that commits does.
    busy_until: float | None = None
    #: The verifier's target cannot pair with this edge's draft (the line says what to
    #: change): the link is DOWN with this error whatever probes and sessions say, until a
    #: connection announces a target that pairs (:meth:`LinkMonitor.mark_incompatible`).
    incompatible: str | None = None


class LinkMonitor:
    """The state of each verifier link, from periodic probes and from real sessions."""

    def __init__(
        self, settings: EdgeSettings, metrics: EdgeMetrics, ssl: SSLContext | bool = True
    ) -> None:
        """``ssl``: the TLS context of the probes, the sessions' own (True: verify the
        verifier's certificate against the system's CAs)."""
        self.settings = settings
        self.metrics = metrics
        self.links = [LinkInfo(u) for u in settings.verifier_urls]
        self.changed: Callable[[], None] = lambda: None
        self.ssl = ssl

    @property
    def state(self) -> VerifierLinkState:
        """up if any link is up; else busy, loading, stalled, unknown (nothing known yet) or
        down."""
        states = {link.state for link in self.links}
        for s in (
            VerifierLinkState.UP,
            VerifierLinkState.BUSY,
            VerifierLinkState.LOADING,
            VerifierLinkState.STALLED,
            VerifierLinkState.UNKNOWN,
        ):
            if s in states:
                return s
        return VerifierLinkState.DOWN

    @property
    def availability(self) -> Availability:
        """The overall state in three words: up if any verifier serves, busy if any is alive."""
        return availability(self.state)

    def _set(self, link: LinkInfo, state: VerifierLinkState, error: str | None) -> None:
        before = link.state
        if link.incompatible is not None:
            state, error = VerifierLinkState.DOWN, link.incompatible
        link.state, link.error, link.checked_at = state, error, time.time()
        if state != VerifierLinkState.BUSY:
            link.busy_until = None
        self.metrics.verifier_up.set(1 if state == VerifierLinkState.UP else 0, url=link.url)
        if before != state:
            log.info("verifier %s: %s%s", link.url, state, f" ({error})" if error else "")
            self.changed()

    def mark_connected(self, url: str) -> None:
        """The warm link to ``url`` opened (the verifier's Ready came): up, unless a stall or a
        busy refusal still holds (as for a /health 200)."""
        now = time.monotonic()
        for link in self.links:
            busy = link.busy_until is not None and now < link.busy_until
            if link.url == url and link.state != VerifierLinkState.STALLED and not busy:
                self._set(link, VerifierLinkState.UP, None)

    def mark_incompatible(self, url: str, reason: str | None) -> None:
        """The target the verifier at ``url`` announced cannot pair with this edge's draft
        (``reason``: the line that says what to change; DOWN until cleared), or it can (None:
        the link's state is then what the next observation says)."""
        for link in self.links:
            if link.url == url:
                link.incompatible = reason
                if reason is not None:
                    self._set(link, VerifierLinkState.DOWN, reason)

    def mark_lost(self, url: str, error: str) -> None:
        """The warm link's connection to ``url`` went: down, unless stalled (a stalled
        verifier's connection may go with the session the edge left; only a session that
        commits, or a probe that cannot reach it, changes that)."""
        for link in self.links:
            if link.url == url and link.state != VerifierLinkState.STALLED:
                self._set(link, VerifierLinkState.DOWN, error)

    def mark_busy(self, url: str, error: str, retry_after: float) -> None:
        """A session on ``url`` was refused as busy (Retry-After ``retry_after`` s): the
        verifier is alive but takes no new session now. Until the Retry-After has passed, a
        /health probe does not turn this into ``up``."""
        until = time.monotonic() + retry_after
        for link in self.links:
            if link.url == url:
                self._set(link, VerifierLinkState.BUSY, error)
                link.busy_until = until

    def mark_stalled(self, url: str, error: str) -> None:
        """A session on ``url`` got no Verdict by its deadline. Probes of /health do not clear
        this (a stalled verifier still answers them); a session that commits does."""
        for link in self.links:
            if link.url == url:
                self._set(link, VerifierLinkState.STALLED, error)

    def mark_token_refused(self, url: str, error: str) -> None:
        """A session's handshake on ``url`` was refused for its token (401/403)."""
        for link in self.links:
            if link.url == url:
                link.token_refused = error
        self.changed()

    def missing_token(self, has_token: bool) -> str | None:
        """Why no request can succeed, whatever the verifiers do next (None: nothing says so):
        every verifier serves a target this edge's draft cannot pair with; a verifier refused
        this edge's token, or every verifier says it needs one and none is set."""
        mismatched = [x.incompatible for x in self.links if x.incompatible]
        if mismatched and len(mismatched) == len(self.links):
            return "; ".join(dict.fromkeys(mismatched))
        refused = [x.token_refused for x in self.links if x.token_refused]
        all_refused = bool(refused) and len(refused) == len(self.links)
        if not has_token and (all_refused or (self.links and all(x.auth for x in self.links))):
            return "the verifier requires a bearer token and none is configured (token_file)"
        if all_refused:
            return f"{refused[0]}: set a valid token_file"
        return None

    def mark(self, url: str | None, ok: bool, error: str | None = None) -> None:
        """After a real session: ``url`` None means the link in use (any/first)."""
        for link in self.links:
            if url is None or link.url == url:
                if ok and url is None and link.state == VerifierLinkState.DOWN:
                    continue  # a success elsewhere says nothing about this one
                if ok:
                    link.token_refused = None  # (the verifier's token file changed)
                self._set(link, VerifierLinkState.UP if ok else VerifierLinkState.DOWN, error)

    def describe(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "availability": self.availability,
            "verifiers": [
                {
                    "url": x.url,
                    "state": x.state,
                    "availability": availability(x.state),
                    "rtt_ms": x.rtt_ms,
                    "error": x.error,
                    "auth": x.auth,
                }
                for x in self.links
            ],
        }

    async def probe_once(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._probe(session, link) for link in self.links))

    async def _probe(self, session: aiohttp.ClientSession, link: LinkInfo) -> None:
        t0 = time.perf_counter()
        try:
            async with session.get(health_url(link.url), ssl=self.ssl) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            self._set(link, VerifierLinkState.DOWN, why)
            return
        rtt = time.perf_counter() - t0
        link.rtt_ms = round(rtt * 1000, 2)
        self.metrics.rtt.observe(rtt, kind="probe")
        link.auth = _auth_of(raw)
        if status == 200:
            # Only a working session clears a stall, and a busy refusal holds until its
            # Retry-After has passed: /health answers 200 while sessions are refused.
            busy = link.busy_until is not None and time.monotonic() < link.busy_until
            if link.state != VerifierLinkState.STALLED and not busy:
                self._set(link, VerifierLinkState.UP, None)
        elif status == 503:
            self._set(link, VerifierLinkState.LOADING, "the verifier is not ready (503)")
        else:
            self._set(link, VerifierLinkState.DOWN, f"GET /health answered {status}")

    async def run(self) -> None:
        """Probe every ``probe_interval`` seconds until cancelled.

        Each probe opens a fresh connection (``force_close``): a kept-alive one idles for
        ``probe_interval`` between probes, and the verifier closes idle connections after its
        ``header_timeout`` (10 s, the default probe interval too), so a probe on a reused
        connection would race that cut and read a healthy verifier as down."""
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.settings.probe_interval))
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            while True:
                await self.probe_once(session)
                await asyncio.sleep(self.settings.probe_interval)


def _auth_of(raw: bytes) -> bool | None:
    """The ``auth`` field of a verifier's /health body (None: not said, or not JSON)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    value = body.get("auth") if isinstance(body, dict) else None
    return value if isinstance(value, bool) else None
