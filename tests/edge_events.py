"""Carrying out an edge core's events in tests as :mod:`edge_agent.link.driver` does."""

from __future__ import annotations

from edge_agent.session.events import Drop, EdgeEvent, Fail, Send


def sent(events: list[EdgeEvent], link: int = 0) -> list[bytes]:
    """The frames a driver writes on ``link``, in order; a :class:`Fail` raises its error (as the
    single-session driver does) and a :class:`Drop` is refused (a single session has none)."""
    out = []
    for event in events:
        if isinstance(event, Fail):
            raise event.error
        if isinstance(event, Drop):
            raise AssertionError(f"unexpected {event}")
        if isinstance(event, Send) and event.link == link:
            out.append(event.data)
    return out
