"""Carrying out an edge core's events in tests as :mod:`edge_agent.link.driver` does."""

from __future__ import annotations

from edge_agent.session.core import SingleCore
from edge_agent.session.events import Count, Drop, EdgeEvent, Fail, RejectionGap, Round, Send
from shared.wire.codec import encode


def sent(core: SingleCore, events: list[EdgeEvent]) -> list[bytes]:
    """The frames a driver writes for ``core``'s ``events``, in order, counted in its stats as
    the driver counts them, with what the core reports (Committed and Finished are the
    consumer's); a :class:`Fail` raises its error (as the single-session driver does) and a
    :class:`Drop` is refused (a single session has none)."""
    out = []
    for event in events:
        if isinstance(event, Fail):
            raise event.error
        if isinstance(event, Drop):
            raise AssertionError(f"unexpected {event}")
        if isinstance(event, (Count, Round, RejectionGap)):
            core.gen.stats.apply(event)
        if not isinstance(event, Send):
            continue  # Committed, Finished: the consumer's; tallies: counted above
        data = encode(event.msg, core.ctx)
        core.gen.stats.sent(event.msg, len(data))
        out.append(data)
    return out
