"""One bound on a request's wait for a verifier (issue 38, probe 4), as pure rules: no sockets,
no sleeps, the clock passed in.

A busy refusal used to restart the down clock and a failed connection the busy one, so a
verifier alternating "loading" 503s and refused connections tripped neither. Now every failure
without progress counts against ``RetryPolicy.deadline_s`` (the daemon's ``verifier_wait``);
only progress starts a new wait. And the limits a generation lives under: the verifier's
context (``fit_context``, ``ContextLimit``), the settings' one name for the bound.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_agent.daemon.api_errors import ApiError
from edge_agent.daemon.api_request import completion_budget
from edge_agent.runtime.context import ContextLimit
from edge_agent.runtime.service import retry_policy
from edge_agent.runtime.settings import DEFAULT_VERIFIER_WAIT, EdgeSettings, load_edge_settings
from edge_agent.session.generation import Generation, TokenSource
from edge_agent.session.opening import ContextExceeded, fit_context
from edge_agent.session.retry import GiveUp, LinkDownPolicy, Outage, RetryPolicy, WaitCause
from shared.service.config import ConfigError

URL = "ws://v:1/v1/session"


def alternate(outage: Outage, start: float, step: float, until: float) -> float:
    """Busy (Retry-After 1) and refused in turn every ``step`` s from ``start``; returns the
    time of the give-up (AssertionError if none came by ``until``)."""
    t, busy = start, True
    while t <= until:
        try:
            outage.failed(
                t,
                progressed=False,
                cause="loading" if busy else "connection refused",
                busy=busy,
                retry_after=1.0 if busy else None,
            )
        except GiveUp:
            return t
        t += step
        busy = not busy
    raise AssertionError(f"no give-up by {until} s")


# ---------------------------------------------------------------------------- the one bound


def test_a_verifier_alternating_busy_and_refused_gives_up_at_the_bound() -> None:
    """The issue's crash loop: 'loading' 503s and refused connections in turn. The old rule
    never gave up (each kind restarted the other's clock); the bound now holds."""
    outage = Outage(RetryPolicy(deadline_s=3.0))
    assert alternate(outage, 0.0, 0.25, 60.0) == 3.0
    o = Outage(RetryPolicy(deadline_s=3.0))
    o.failed(0.0, progressed=False, cause="loading", busy=True, retry_after=1.0)
    o.failed(1.0, progressed=False, cause="refused")
    with pytest.raises(GiveUp, match=r"no verifier made progress for 3 s \(deadline 3 s\)") as e:
        o.failed(3.0, progressed=False, cause="refused")
    assert "1 busy refusals and 2 failed sessions in turn; last: refused" in str(e.value)
    assert e.value.waited == 3.0


def test_busy_only_and_down_only_waits_say_which() -> None:
    policy = RetryPolicy(deadline_s=10.0, backoff_max_s=4.0)
    busy = Outage(policy)
    busy.failed(0.0, progressed=False, cause="overloaded", busy=True, retry_after=2.5)
    with pytest.raises(GiveUp, match=r"stayed busy for 10 s.*last: overloaded") as e:
        busy.failed(10.0, progressed=False, cause="overloaded", busy=True, retry_after=2.5)
    assert e.value.retry_after == 3  # the verifier's Retry-After, whole seconds
    down = Outage(policy)
    down.failed(0.0, progressed=False, cause="refused")
    with pytest.raises(GiveUp, match=r"no verifier reachable for 10 s.*last: refused") as e:
        down.failed(10.0, progressed=False, cause="refused")
    assert e.value.retry_after == 4  # down: the backoff's ceiling


def test_progress_starts_a_new_wait_and_nothing_else_does() -> None:
    outage = Outage(RetryPolicy(deadline_s=5.0))
    outage.failed(0.0, progressed=False, cause="refused")
    outage.failed(4.0, progressed=False, cause="busy", busy=True, retry_after=1.0)
    assert outage.waited(4.5) == 4.5 and outage.remaining(4.5) == 0.5
    outage.failed(4.9, progressed=True, cause="lost")  # that session committed tokens
    assert outage.since == 4.9 and outage.busy == 0 and outage.failures == 1
    outage.failed(9.0, progressed=False, cause="refused")  # 4.1 s into the new wait
    with pytest.raises(GiveUp):
        outage.failed(9.9, progressed=False, cause="refused")
    outage.succeeded()
    assert not outage.waiting and outage.remaining(100.0) == 5.0


def test_an_attempt_that_never_opened_counts_from_its_start() -> None:
    """A connection attempt that hung for its whole connect timeout was already waiting."""
    outage = Outage(RetryPolicy(deadline_s=5.0))
    outage.failed(4.0, progressed=False, cause="not ready within 4 s", began=0.0)
    assert outage.since == 0.0 and outage.remaining(4.0) == 1.0
    with pytest.raises(GiveUp, match="reachable for 5 s"):
        outage.failed(5.0, progressed=False, cause="again", began=4.0)  # (the wait goes on)


def test_the_pause_never_passes_the_bound_and_honours_retry_after() -> None:
    policy = RetryPolicy(deadline_s=3.0, backoff_initial_s=0.2, backoff_max_s=5.0)
    rng = random.Random(0)
    outage = Outage(policy)
    attempt = outage.failed(0.0, progressed=False, cause="busy", busy=True, retry_after=1.0)
    assert 1.0 <= outage.pause(attempt, rng, 0.0) <= 1.5  # at least the Retry-After
    attempt = outage.failed(2.5, progressed=False, cause="busy", busy=True, retry_after=1.0)
    assert outage.pause(attempt, rng, 2.5) == 0.5  # cut at the bound: one last attempt there
    draft = Outage(RetryPolicy(deadline_s=3.0, link_down=LinkDownPolicy.DRAFT_ONLY))
    attempt = draft.failed(2.5, progressed=False, cause="busy", busy=True, retry_after=1.0)
    assert draft.pause(attempt, rng, 2.5) >= 1.0  # the draft answers meanwhile: no bound


def test_only_failures_count_against_max_attempts_and_draft_only_never_gives_up() -> None:
    outage = Outage(RetryPolicy(deadline_s=100.0, max_attempts=2))
    for t in range(5):
        outage.failed(float(t), progressed=False, cause="busy", busy=True, retry_after=0.5)
    outage.failed(5.0, progressed=False, cause="refused")
    outage.failed(6.0, progressed=False, cause="refused")
    with pytest.raises(GiveUp, match="after 2 failed sessions"):
        outage.failed(7.0, progressed=False, cause="refused")
    draft = Outage(RetryPolicy(deadline_s=1.0, link_down=LinkDownPolicy.DRAFT_ONLY))
    for t in range(100):
        draft.failed(float(t), progressed=False, cause="refused", busy=t % 2 == 0)
    assert draft.last == WaitCause.DOWN


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 2.0),  # seconds since the previous failure
            st.sampled_from(list(WaitCause)),
            st.booleans(),  # the failed session had committed tokens
        ),
        min_size=1,
        max_size=60,
    )
)
def test_give_up_exactly_when_the_wait_reaches_the_bound(
    events: list[tuple[float, WaitCause, bool]],
) -> None:
    """Over any mix of busy refusals, failures, stalls and progress: the give-up comes at the
    first failure whose wait (since the first failure after the last progress) reaches the
    bound, and never earlier."""
    policy = RetryPolicy(deadline_s=5.0, stall_rebuilds=10**6)
    outage = Outage(policy)
    now, since = 0.0, None
    for dt, kind, progressed in events:
        now += dt
        if progressed or since is None:
            since = now
        expect = now - since >= policy.deadline_s
        try:
            outage.failed(
                now,
                progressed=progressed,
                cause=str(kind),
                busy=kind == WaitCause.BUSY,
                stalled=kind == WaitCause.STALLED,
                retry_after=1.0 if kind == WaitCause.BUSY else None,
            )
        except GiveUp as e:
            assert expect, (now, since)
            assert e.retry_after >= 1 and e.waited == pytest.approx(now - since)
            return
        assert not expect, (now, since)
        assert outage.remaining(now) == pytest.approx(since + policy.deadline_s - now)


def test_the_old_second_clock_is_refused_unless_it_agrees() -> None:
    with pytest.raises(ValueError, match=r"busy_deadline_s .* is gone.*deadline_s"):
        RetryPolicy(deadline_s=5.0, busy_deadline_s=60.0)
    assert RetryPolicy(deadline_s=5.0, busy_deadline_s=5.0).deadline_s == 5.0


# ---------------------------------------------------------------------------- the setting


def test_verifier_wait_is_the_one_setting_and_the_old_name_still_works() -> None:
    s = EdgeSettings(verifier=URL)
    assert s.verifier_wait == DEFAULT_VERIFIER_WAIT == 60.0 and s.link_down_deadline is None
    assert retry_policy(s).deadline_s == 60.0
    assert retry_policy(EdgeSettings(verifier=URL, verifier_wait=3.0)).deadline_s == 3.0
    old = load_edge_settings(env={"WANSPEC_EDGE_LINK_DOWN_DEADLINE": "7"})
    assert old.verifier_wait == 7.0 and old.link_down_deadline is None  # moved over
    assert load_edge_settings(env={"WANSPEC_EDGE_VERIFIER_WAIT": "9"}).verifier_wait == 9.0
    with pytest.raises(ConfigError, match=r"link_down_deadline.*old name of verifier_wait"):
        load_edge_settings(
            env={"WANSPEC_EDGE_LINK_DOWN_DEADLINE": "7", "WANSPEC_EDGE_VERIFIER_WAIT": "9"}
        )
    with pytest.raises(ConfigError, match=r"verifier_wait.*below the minimum"):
        load_edge_settings(env={"WANSPEC_EDGE_VERIFIER_WAIT": "0"})


# ---------------------------------------------------------------------------- the context


def test_a_generation_fits_the_verifiers_context() -> None:
    gen = Generation([1, 2, 3], 100)
    fit_context(gen, 10)
    assert gen.max_tokens == 7 and gen.room == 7 and not gen.done
    gen.commit([4] * 7, TokenSource.EDGE_DRAFT)
    assert gen.done and gen.finish_reason == "length" and len(gen.committed) == 10
    small = Generation([1, 2, 3], 100)
    small.commit([4, 5, 6], TokenSource.EDGE_DRAFT)
    fit_context(small, 6)  # a fail-over to a smaller verifier: the text ends where it is
    assert small.done and small.finish_reason == "length"
    with pytest.raises(ContextExceeded, match="prompt has 3 tokens; the verifier's context is 3"):
        fit_context(Generation([1, 2, 3], 5), 3)


def test_the_api_budget_names_both_limits() -> None:
    both = ContextLimit(draft=512, verifier=24)
    assert both.tokens == 24 and ContextLimit(None, None).tokens is None
    assert completion_budget(4, None, both, 512) == 20
    with pytest.raises(ApiError) as e:
        completion_budget(24, None, both, 512)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert e.value.message == (
        "the prompt has 24 tokens; the context is 24 (the draft's 512, the verifier's 24)"
    )
    with pytest.raises(ApiError) as e:
        completion_budget(4, 30, both, 512)
    assert e.value.message == (
        "max_tokens 30 + 4 prompt tokens exceed the context of 24 (the draft's 512, the "
        "verifier's 24)"
    )
    with pytest.raises(ApiError) as e:
        completion_budget(30, None, ContextLimit(None, 30), 512)
    assert e.value.message == "the prompt has 30 tokens; the verifier's context is 30"
    assert completion_budget(4, None, 100, 512) == 96  # a bare number: the draft's, as before
