"""The verifier's admission line: busy waits in line, it is not refused.

A session that cannot start now (every session slot taken, the KV pool full, or the engine's
queue past ``max_queue_delay`` while other sessions are being served) joins this line and is
started when its turn comes. Pure: no I/O and no clock (callers pass ``now``, monotonic
seconds), so its rules are tested as functions over event sequences.

**Order.** Within a bearer token, arrival order. Between tokens, fair (start-time fair
queueing, each session one unit): a ticket's ``tag`` is one past the later of its token's last
tag and the line's virtual clock (the tag of the last session started), and the line is served
by the key ``(tag + held, seq)``, ``held`` what the token holds now (its live sessions) and
``seq`` the arrival number. One token's backlog therefore interleaves with another's instead of
running ahead of it, a token that comes later is not put behind a backlog that arrived before
it, and a token that already holds many sessions waits behind one that holds none; with one
token the order is arrival order exactly.

**Bounds.** At most ``capacity`` sessions wait, at most ``per_tenant`` of one token
(:class:`LineFull` past either: then, and only then, the verifier answers 503 ``overloaded``
with Retry-After). A lone session is never in line: a line forms only behind sessions that are
being served, so nothing waits for a delay its own arrival would not cause.

**The estimate.** ``eta_s(place, live)``: sessions leave at about ``live / mean_s`` a second
(``mean_s`` the exponentially weighted mean of served sessions' durations), so the one with
``place`` sessions before it starts in about ``(place + 1) · mean_s / live`` seconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.errors import WanspecError

#: Weight of the newest session's duration in the running mean (about the last 10 sessions).
EWMA_WEIGHT = 0.1
#: The mean session duration assumed before any session ended (seconds).
PRIOR_SESSION_S = 10.0


class LineFull(WanspecError):
    """The admission line holds its bound (``capacity`` in all, or ``per_tenant`` of this
    token): the session is refused, 503 ``overloaded`` with Retry-After."""


@dataclass(frozen=True)
class Ticket:
    """A session waiting for its turn: its bearer token's key, its arrival number (the order
    within a token), when it arrived (monotonic seconds) and its fair-queueing tag."""

    tenant: str
    seq: int
    at: float
    tag: int = 0


@dataclass
class AdmissionLine:
    """The sessions waiting to start, bounded, served fairly between tokens (module doc)."""

    capacity: int
    per_tenant: int
    waiting: list[Ticket] = field(default_factory=list)  # arrival order
    #: Mean duration of served sessions (seconds), for the wait estimate.
    mean_s: float = PRIOR_SESSION_S
    #: The virtual clock: the tag of the last session started from the line.
    clock: int = 0
    _seq: int = 0
    #: Each token's last tag, while it is ahead of the clock (at most one entry per ticket).
    _last: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity < 0 or self.per_tenant < 1:
            raise ValueError("capacity must be >= 0 and per_tenant >= 1")

    def __len__(self) -> int:
        return len(self.waiting)

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def of(self, tenant: str) -> int:
        """How many of ``tenant``'s sessions wait."""
        return sum(1 for t in self.waiting if t.tenant == tenant)

    def full_for(self, tenant: str) -> str | None:
        """The bound a new session of ``tenant`` would pass (in words), or None: there is
        room for it."""
        if len(self.waiting) >= self.capacity:
            return (
                f"the admission line is full ({len(self.waiting)} sessions wait; "
                f"admission_queue {self.capacity})"
            )
        if self.of(tenant) >= min(self.per_tenant, self.capacity):
            return (
                f"{self.of(tenant)} sessions of this token wait already "
                f"(admission_queue_per_token {self.per_tenant})"
            )
        return None

    def join(self, tenant: str, now: float) -> Ticket:
        """A place at the end of the line (raises :class:`LineFull` past a bound)."""
        full = self.full_for(tenant)
        if full is not None:
            raise LineFull(full)
        self._seq += 1
        tag = max(self._last.get(tenant, 0), self.clock) + 1
        self._last[tenant] = tag
        ticket = Ticket(tenant, self._seq, now, tag)
        self.waiting.append(ticket)
        return ticket

    def start(self, ticket: Ticket) -> None:
        """``ticket``'s session starts: it leaves the line and the virtual clock reaches its
        tag (tokens whose last tag it passed are forgotten: they are level with everyone)."""
        self.leave(ticket)
        self.clock = max(self.clock, ticket.tag)
        self._last = {t: tag for t, tag in self._last.items() if tag > self.clock}

    def leave(self, ticket: Ticket) -> bool:
        """Take ``ticket`` out of the line (admitted, or its stream ended while it waited);
        False if it was not in it."""
        try:
            self.waiting.remove(ticket)
        except ValueError:
            return False
        return True

    def order(self, held: Mapping[str, int]) -> list[Ticket]:
        """The waiting tickets in serving order, given the live sessions each token holds."""
        return sorted(self.waiting, key=lambda t: (t.tag + held.get(t.tenant, 0), t.seq))

    def place(self, ticket: Ticket, held: Mapping[str, int]) -> int:
        """How many sessions will start before ``ticket`` (0: it is next)."""
        return self.order(held).index(ticket)

    def served(self, duration_s: float) -> None:
        """A served session ended after ``duration_s`` seconds: the estimate learns from it."""
        if duration_s >= 0:
            self.mean_s += EWMA_WEIGHT * (duration_s - self.mean_s)

    def eta_s(self, place: int, live: int) -> float:
        """Seconds until the session with ``place`` sessions before it starts, about."""
        return (place + 1) * self.mean_s / max(1, live)
