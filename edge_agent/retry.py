"""When to reconnect to a verifier and when to give up: one policy for every edge link.

Pure (no clock of its own: callers pass ``now``, a monotonic time in seconds, and a
``random.Random`` for the jitter), so the same rules serve the single-verifier agent and every
worker link of a federation, and tests run them without sleeping.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from shared.enums import TextEnum
from shared.errors import WanspecError


class LinkDownPolicy(TextEnum):
    """``wait``: retry with backoff and fail the generation once no session has made progress
    for ``deadline_s``; ``draft_only``: keep generating with the draft alone between attempts
    (those tokens are flagged unverified) and re-sync the verifier from the committed text."""

    WAIT = "wait"
    DRAFT_ONLY = "draft_only"


@dataclass(frozen=True)
class RetryPolicy:
    """Reconnect by time, not by count: a verifier restart (seconds) must not fail a request.

    ``deadline_s``: how long a link may stay down (no session committing anything) before the
    generation fails under ``wait``. ``max_attempts``: an optional cap on consecutive failed
    sessions (None: time alone decides). ``verdict_timeout_s``: the floor of the verdict
    deadline; a batch with no Verdict past max(floor, 4 × the slowest recent round) means a
    stalled verifier, and the session is rebuilt from the committed ids.
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
    #: How long a verifier may keep refusing new sessions as busy (Retry-After) before the
    #: generation fails: it is alive and answering, so this is not ``deadline_s``.
    busy_deadline_s: float = 600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "link_down", LinkDownPolicy.parse(self.link_down, "link_down"))
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {self.deadline_s}")
        if not self.verdict_timeout_s > 0:
            raise ValueError(f"verdict_timeout_s must be positive, got {self.verdict_timeout_s}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")

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
    """Reconnecting is over: the reason names the attempts, the time and the last cause."""


@dataclass
class Outage:
    """Consecutive failed sessions of one link, and since when (``now`` passed in)."""

    policy: RetryPolicy
    failures: int = 0
    stalls: int = 0
    since: float | None = None
    busy: int = 0  # consecutive busy refusals
    busy_since: float | None = None

    def failed(
        self,
        now: float,
        *,
        progressed: bool,
        cause: str,
        stalled: bool = False,
        busy: bool = False,
    ) -> int:
        """Record a failed session; returns the attempt number (for :meth:`RetryPolicy.delay`).
        A session that made progress (committed something) ends the outage. Raises
        :class:`GiveUp` past ``max_attempts``, past ``stall_rebuilds`` consecutive stalls or,
        under ``wait``, past ``deadline_s``. A ``busy`` refusal (the verifier answered, with
        Retry-After) is not the link being down: it counts apart, against
        ``busy_deadline_s``, and restarts the down clock."""
        if progressed or self.since is None:
            self.failures, self.stalls, self.since = 0, 0, now
            self.busy, self.busy_since = 0, None
        if busy:
            self.busy += 1
            if self.busy_since is None:
                self.busy_since = now
            busy_for = now - self.busy_since
            if busy_for > self.policy.busy_deadline_s:
                raise GiveUp(
                    f"the verifier stayed busy for {busy_for:.0f} s (busy_deadline "
                    f"{self.policy.busy_deadline_s:g} s); last: {cause}"
                )
            self.since = now
            return self.busy
        self.busy, self.busy_since = 0, None
        self.failures += 1
        if stalled:
            self.stalls += 1
            if self.stalls > self.policy.stall_rebuilds:
                raise GiveUp(
                    f"the verifier is stalled: {self.stalls} sessions in a row got no Verdict "
                    f"by their deadline; last: {cause}"
                )
        cap = self.policy.max_attempts
        if cap is not None and self.failures > cap:
            raise GiveUp(f"gave up after {self.failures - 1} failed sessions; last: {cause}")
        down_for = now - self.since
        if self.policy.link_down == LinkDownPolicy.WAIT and down_for > self.policy.deadline_s:
            raise GiveUp(
                f"no verifier reachable for {down_for:.0f} s (deadline "
                f"{self.policy.deadline_s:g} s); last: {cause}"
            )
        return self.failures

    def succeeded(self) -> None:
        self.failures, self.since = 0, None
        self.busy, self.busy_since = 0, None
