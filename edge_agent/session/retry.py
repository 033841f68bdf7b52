"""When to reconnect to a verifier and when to give up: one policy for every edge link.

Pure (no clock of its own: callers pass ``now``, a monotonic time in seconds, and a
``random.Random`` for the jitter), so the same rules serve the single-verifier agent and every
worker link of a federation, and tests run them without sleeping.

**One bound.** A request waits for a verifier at most ``RetryPolicy.deadline_s`` seconds
without progress (the daemon's ``verifier_wait``), whatever it meets meanwhile: refused
connections, lost sessions, busy refusals (503/429 with Retry-After), stalls, or any mix of
them, as a verifier that crash-loops between "loading" and "connection refused" gives. Each
kind of failure is still told apart (:class:`WaitCause`: the log line, ``/health``, the
backoff: a busy verifier's Retry-After is honoured), but no kind restarts the clock another
kind runs: only progress (a session that committed tokens) does.
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass, field

from shared.enums import TextEnum
from shared.errors import WanspecError


class LinkDownPolicy(TextEnum):
    """``wait``: retry with backoff and fail the generation once it has waited ``deadline_s``
    without progress; ``draft_only``: keep generating with the draft alone between attempts
    (those tokens are flagged unverified) and re-sync the verifier from the committed text."""

    WAIT = "wait"
    DRAFT_ONLY = "draft_only"


class WaitCause(TextEnum):
    """Why a session attempt came to nothing. All count against the one bound."""

    BUSY = "busy"  # refused with Retry-After: the verifier is alive and loaded (or loading)
    DOWN = "down"  # no connection, a lost one, a broken session
    STALLED = "stalled"  # connected, but no Verdict by its deadline


@dataclass(frozen=True)
class RetryPolicy:
    """Reconnect by time, not by count: a verifier restart (seconds) must not fail a request.

    ``deadline_s``: the one bound on a request's wait for a verifier: the time since the run
    started or last made progress (a session committed tokens) after which, under ``wait``,
    the generation fails (:class:`GiveUp`), whether the verifier was down, busy or both in
    turn. ``max_attempts``: an optional cap on consecutive failed sessions (None: time alone
    decides; busy refusals are not counted). ``verdict_timeout_s``: the floor of the verdict
    deadline; a batch with no Verdict past max(floor, 4 × the slowest recent round) means a
    stalled verifier, and the session is rebuilt from the committed ids.
    ``busy_deadline_s``: deprecated (a second clock for busy refusals, which a busy refusal
    and a refused connection in turn reset for each other): given, it must equal
    ``deadline_s``.
    """

    max_attempts: int | None = None
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    handshake_timeout_s: float = 30.0
    link_down: LinkDownPolicy = LinkDownPolicy.WAIT
    deadline_s: float = 60.0
    verdict_timeout_s: float = 10.0
    #: Sessions rebuilt after a stall (no Verdict by its deadline) before the generation fails:
    #: a stalled verifier still accepts connections, so waiting longer rarely helps, and a
    #: request must not hold the daemon's queue much beyond the verdict deadline.
    stall_rebuilds: int = 1
    busy_deadline_s: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "link_down", LinkDownPolicy.parse(self.link_down, "link_down"))
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {self.deadline_s}")
        if not self.verdict_timeout_s > 0:
            raise ValueError(f"verdict_timeout_s must be positive, got {self.verdict_timeout_s}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.busy_deadline_s is not None:
            if self.busy_deadline_s != self.deadline_s:
                raise ValueError(
                    f"busy_deadline_s ({self.busy_deadline_s:g}) is gone: one bound, deadline_s "
                    "(the daemon's verifier_wait), covers a busy verifier and a down one; "
                    "set deadline_s only"
                )
            warnings.warn(
                "RetryPolicy.busy_deadline_s is deprecated: deadline_s bounds every wait",
                DeprecationWarning,
                stacklevel=3,
            )

    def delay(self, attempt: int, rng: random.Random, retry_after: float | None = None) -> float:
        """Exponential backoff with jitter: attempt n waits in [cap/2, cap],
        cap = min(backoff_max_s, backoff_initial_s · 2^(n−1)). With the verifier's
        ``retry_after`` (a busy refusal): in [base, 1.5·base], base = max(retry_after, cap), so
        edges told the same Retry-After come back spread over half of it, never in lockstep."""
        cap = min(self.backoff_max_s, self.backoff_initial_s * 2 ** max(0, attempt - 1))
        if retry_after is not None:
            base = max(retry_after, cap)
            return rng.uniform(base, 1.5 * base)
        return rng.uniform(cap / 2, cap)


class GiveUp(WanspecError):
    """Waiting is over: the message names the time waited, the bound, what was met and the
    last cause. ``retry_after``: whole seconds after which a client may try again (the last
    busy refusal's Retry-After, else the backoff's ceiling); ``waited``: seconds waited."""

    def __init__(self, message: str, *, retry_after: int, waited: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.waited = waited


@dataclass
class Outage:
    """One request's wait for a verifier: since when it has made no progress and what it met.

    Invariants: ``since`` is None exactly while no wait is under way (no failure since the run
    started or last progressed); ``busy + failures`` counts the failed attempts of the current
    wait (``failures`` the consecutive ones that were not busy refusals, for ``max_attempts``);
    nothing but progress (:meth:`failed` with ``progressed``) moves ``since`` later.
    """

    policy: RetryPolicy
    failures: int = 0
    stalls: int = 0
    busy: int = 0
    since: float | None = None
    #: The last busy refusal's Retry-After (seconds), while the last failure was one.
    retry_after: float | None = None
    last: WaitCause | None = None

    @property
    def waiting(self) -> bool:
        return self.since is not None

    def waited(self, now: float) -> float:
        """Seconds the current wait has lasted (0 when none is under way)."""
        return 0.0 if self.since is None else now - self.since

    def remaining(self, now: float) -> float:
        """Seconds left of the bound at ``now`` (all of it while no wait is under way); never
        negative."""
        if self.since is None:
            return self.policy.deadline_s
        return max(0.0, self.since + self.policy.deadline_s - now)

    def failed(
        self,
        now: float,
        *,
        progressed: bool,
        cause: str,
        stalled: bool = False,
        busy: bool = False,
        retry_after: float | None = None,
        began: float | None = None,
    ) -> int:
        """Record a failed session; returns the attempt number (for :meth:`RetryPolicy.delay`).

        A session that made progress (committed something) ends the wait before this one
        starts a new one at ``now``. A failure that starts a wait starts it at ``began``, when
        the failed attempt began, if given (an attempt that never got going, no Welcome: its
        own time was already spent waiting), else at ``now``. ``retry_after``: a busy
        refusal's Retry-After (seconds), the least the next pause waits.

        Raises :class:`GiveUp` past ``max_attempts`` failures that were not busy refusals,
        past ``stall_rebuilds`` stalls or, under ``wait``, once the wait has lasted
        ``deadline_s``, whatever mix of busy refusals (``busy``), stalls and failures it saw."""
        if progressed:
            self.failures, self.stalls, self.busy, self.since = 0, 0, 0, now
        elif self.since is None:
            self.since = now if began is None else min(began, now)
        kind = WaitCause.BUSY if busy else WaitCause.STALLED if stalled else WaitCause.DOWN
        self.last = kind
        if busy:
            self.busy += 1
            self.retry_after = retry_after
        else:
            self.failures += 1
            self.retry_after = None
            if stalled:
                self.stalls += 1
                if self.stalls > self.policy.stall_rebuilds:
                    raise self._give_up(
                        now,
                        f"the verifier is stalled: {self.stalls} sessions in a row got no "
                        f"Verdict by their deadline; last: {cause}",
                    )
            cap = self.policy.max_attempts
            if cap is not None and self.failures > cap:
                raise self._give_up(
                    now, f"gave up after {self.failures - 1} failed sessions; last: {cause}"
                )
        waited = now - self.since
        if self.policy.link_down == LinkDownPolicy.WAIT and waited >= self.policy.deadline_s:
            raise self._give_up(now, f"{self._what(waited)}; last: {cause}")
        return self.busy if busy else self.failures

    def pause(self, attempt: int, rng: random.Random, now: float) -> float:
        """How long to wait before the next attempt: the policy's backoff (at least the last
        busy refusal's Retry-After), cut so that, under ``wait``, the next attempt starts no
        later than the bound (the last one is made at the bound, not skipped)."""
        delay = self.policy.delay(attempt, rng, self.retry_after)
        if self.policy.link_down == LinkDownPolicy.WAIT:
            delay = min(delay, self.remaining(now))
        return delay

    def succeeded(self) -> None:
        self.failures, self.stalls, self.busy, self.since = 0, 0, 0, None
        self.retry_after, self.last = None, None

    def _what(self, waited: float) -> str:
        """The wait in words: busy only, down only, or both (with their counts)."""
        bound = f"deadline {self.policy.deadline_s:g} s"
        if self.failures == 0:
            return f"the verifier stayed busy for {waited:.0f} s ({bound})"
        if self.busy == 0:
            return f"no verifier reachable for {waited:.0f} s ({bound})"
        return (
            f"no verifier made progress for {waited:.0f} s ({bound}): {self.busy} busy "
            f"refusals and {self.failures} failed sessions in turn"
        )

    def _give_up(self, now: float, message: str) -> GiveUp:
        if self.last == WaitCause.BUSY and self.retry_after is not None:
            after = self.retry_after
        else:
            after = self.policy.backoff_max_s
        return GiveUp(message, retry_after=max(1, math.ceil(after)), waited=self.waited(now))
