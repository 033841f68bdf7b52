"""The verifier's admission line as a pure function over events (no I/O, no clock, no sleeps).

Busy is not dead: a session that cannot start waits in line in arrival order, fairly between
bearer tokens, told its place and an estimate of its wait; only a full line (a declared bound)
refuses it.
"""

from __future__ import annotations

import pytest

from cloud_verifier.session.admission import PRIOR_SESSION_S, AdmissionLine, LineFull

pytestmark = pytest.mark.fast


def _serve_all(line: AdmissionLine, held: dict[str, int] | None = None) -> list[str]:
    """Start the head of the line until it is empty; the order the sessions started in."""
    started: list[str] = []
    held = held or {}
    while line:
        head = line.order(held)[0]
        line.start(head)
        started.append(f"{head.tenant}{head.seq}")
    return started


def test_one_token_is_served_in_arrival_order() -> None:
    line = AdmissionLine(capacity=8, per_tenant=8)
    tickets = [line.join("a", float(i)) for i in range(5)]
    assert [line.place(t, {}) for t in tickets] == [0, 1, 2, 3, 4]
    assert _serve_all(line) == ["a1", "a2", "a3", "a4", "a5"]


def test_a_backlog_of_one_token_interleaves_with_another_that_comes_later() -> None:
    line = AdmissionLine(capacity=8, per_tenant=8)
    for i in range(3):
        line.join("a", float(i))
    line.join("b", 3.0)
    line.join("b", 4.0)
    # b's first session is not put behind all of a's backlog, and a's order is kept.
    assert _serve_all(line) == ["a1", "b4", "a2", "b5", "a3"]


def test_a_token_that_comes_after_the_clock_moved_is_not_put_behind_old_tags() -> None:
    line = AdmissionLine(capacity=8, per_tenant=8)
    for i in range(4):
        line.join("a", float(i))
    line.start(line.order({})[0])
    line.start(line.order({})[0])  # the clock is at a's second tag
    late = line.join("b", 9.0)
    # b's tag is one past the clock: level with a's next (arrival breaks the tie), ahead of
    # a's last.
    assert [f"{t.tenant}{t.seq}" for t in line.order({})] == ["a3", "b5", "a4"]
    assert line.place(late, {}) == 1


def test_a_token_that_holds_many_sessions_waits_behind_one_that_holds_none() -> None:
    line = AdmissionLine(capacity=8, per_tenant=8)
    a = line.join("a", 0.0)
    b = line.join("b", 1.0)
    assert line.order({})[0] == a
    assert line.order({"a": 3})[0] == b
    assert line.place(a, {"a": 3}) == 1


def test_the_line_is_bounded_in_all_and_per_token() -> None:
    line = AdmissionLine(capacity=3, per_tenant=2)
    line.join("a", 0.0)
    line.join("a", 0.0)
    with pytest.raises(LineFull, match="admission_queue_per_token 2"):
        line.join("a", 0.0)
    line.join("b", 0.0)
    with pytest.raises(LineFull, match="admission_queue 3"):
        line.join("c", 0.0)
    assert len(line) == 3


def test_a_line_of_capacity_zero_refuses_everyone() -> None:
    line = AdmissionLine(capacity=0, per_tenant=4)
    with pytest.raises(LineFull):
        line.join("a", 0.0)
    with pytest.raises(ValueError):
        AdmissionLine(capacity=-1, per_tenant=1)
    with pytest.raises(ValueError):
        AdmissionLine(capacity=4, per_tenant=0)


def test_leaving_frees_the_place_and_is_idempotent() -> None:
    line = AdmissionLine(capacity=2, per_tenant=2)
    first = line.join("a", 0.0)
    second = line.join("a", 1.0)
    assert line.leave(first) is True
    assert line.leave(first) is False
    assert line.place(second, {}) == 0
    line.join("a", 2.0)  # room again
    assert line.of("a") == 2 and line.of("b") == 0


def test_starting_forgets_tokens_the_clock_has_passed() -> None:
    line = AdmissionLine(capacity=8, per_tenant=8)
    t = line.join("a", 0.0)
    line.start(t)
    assert line.clock == t.tag and not line._last
    again = line.join("a", 5.0)
    assert again.tag == line.clock + 1


def test_the_wait_estimate_follows_served_sessions() -> None:
    line = AdmissionLine(capacity=8, per_tenant=8)
    assert line.eta_s(0, 1) == pytest.approx(PRIOR_SESSION_S)
    assert line.eta_s(3, 2) == pytest.approx(4 * PRIOR_SESSION_S / 2)
    assert line.eta_s(0, 0) == pytest.approx(PRIOR_SESSION_S)  # never divides by zero
    for _ in range(200):
        line.served(2.0)
    assert line.mean_s == pytest.approx(2.0, rel=1e-3)
    line.served(-1.0)  # a clock that went backwards teaches nothing
    assert line.mean_s == pytest.approx(2.0, rel=1e-3)
    assert line.eta_s(1, 4) == pytest.approx(1.0, rel=1e-3)
