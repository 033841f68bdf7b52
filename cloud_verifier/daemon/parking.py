"""Lost sessions kept for resumption: a session whose connection was lost keeps its engine slot
(its KV cache) for ``resume_grace`` seconds so that its edge can resume it, of the same tenant
only, within a page budget (``resume_pages_share`` of the pool); sessions that need the room drop
the oldest. Invariants: ``state.parked`` is ordered oldest first and changed only here (a slot
taken out is released unless a resuming session adopts it, :func:`adopt_parked`); the kept sessions'
pages, counted now, are within their budget after each park and each reap; the reaper task is
owned by :func:`parked_ctx`, which releases every kept session at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator

from aiohttp import web

from cloud_verifier.daemon.state import LOG_NAME, STATE, Parked, VerifierState
from cloud_verifier.engine.kv_manager import KVManager, Slot
from cloud_verifier.session.events import Adopt
from shared.service.status import ServiceStatus
from shared.wire.codec import decode
from shared.wire.messages import Hello
from shared.wire.packing import ProtocolError

log = logging.getLogger(LOG_NAME)

#: How often lost sessions past their grace period are dropped, and the kept ones' pages are
#: checked against their budget (seconds).
REAP_INTERVAL_S = 1.0


def unpark(state: VerifierState, token: str, reason: str | None) -> Parked | None:
    """Take a lost session out of the parking; with ``reason`` its slot is released too (the
    KV pages go back to the pool)."""
    parked = state.parked.pop(token, None)
    if parked is not None and reason is not None:
        state.engine.release(parked.slot)
        state.metrics.parked_dropped.inc(reason=reason)
    state.metrics.parked.set(len(state.parked))
    return parked


def park(state: VerifierState, token: str, slot: Slot, tenant: str) -> bool:
    """Keep a lost session's slot for ``resume_grace`` seconds, within the page budget (the
    oldest are dropped to make room). False when it cannot be kept (the caller releases it):
    its slot holds no page (its prefill never ran: there is nothing to resume), or more than
    the whole budget.

    The caller has cancelled the session's model work (its task awaiting ``Engine.run``), so
    nothing more is queued for it; a step already running for it may still add pages, which
    the budget counts at the next reap (:func:`_fit_budget`)."""
    s = state.settings
    if s.resume_grace <= 0 or state.status != ServiceStatus.READY:
        return False
    pages = KVManager.pages_held(slot)
    if pages == 0 or pages > _parked_budget(state):
        return False
    state.parked[token] = Parked(slot, tenant, time.monotonic() + s.resume_grace)
    _fit_budget(state)  # the new one is the newest: dropped last, and it fits alone
    state.metrics.parked.set(len(state.parked))
    return True


def _parked_budget(state: VerifierState) -> int:
    """KV pages the sessions kept for resumption may hold together (resume_pages_share)."""
    return int(state.engine.memory()["pages_total"] * state.settings.resume_pages_share)


def _fit_budget(state: VerifierState) -> None:
    """Drop the oldest kept sessions while the pages they hold now pass their budget."""
    budget = _parked_budget(state)
    while state.parked and sum(p.pages for p in state.parked.values()) > budget:
        unpark(state, next(iter(state.parked)), "budget")


def kept_count(state: VerifierState, key: str) -> int:
    """Sessions kept for resumption of token key ``key``."""
    return sum(1 for p in state.parked.values() if p.tenant == key)


def resumes_kept(state: VerifierState, payload: bytes, tenant: str) -> bool:
    """Whether a stream's first frame is a Hello resuming a session kept for ``tenant``, within
    its grace (decoded here for admission; the session's core decodes and checks it again)."""
    try:
        hello = decode(payload)
    except ProtocolError:
        return False
    if not isinstance(hello, Hello) or hello.resume is None:
        return False
    parked = state.parked.get(hello.resume.token)
    return (
        parked is not None
        and parked.until > time.monotonic()
        and secrets.compare_digest(parked.tenant, tenant)
    )


def drop_oldest_kept(state: VerifierState) -> bool:
    """A new session needs a slot or pages: drop the oldest lost session (False: none)."""
    if not state.parked:
        return False
    unpark(state, next(iter(state.parked)), "pressure")
    return True


def _reap(state: VerifierState, now: float) -> None:
    for token in [t for t, p in state.parked.items() if p.until <= now]:
        unpark(state, token, "expired")
    _fit_budget(state)


async def parked_ctx(app: web.Application) -> AsyncIterator[None]:
    """Owns the task that drops lost sessions past their grace period; at the end, every
    kept one is released."""
    state = app[STATE]

    async def reaper() -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            _reap(state, time.monotonic())

    task = asyncio.create_task(reaper(), name="wanspec-parked-reaper")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for token in list(state.parked):
            unpark(state, token, "expired")


async def adopt_parked(
    state: VerifierState, ask: Adopt, hello: Hello, tenant: str
) -> tuple[Slot, list[int]] | None:
    """The lost session ``ask`` names, if it is kept and of this tenant: its slot, handed to
    the new session with its cache cut to what the edge has committed, and the tokens kept."""
    parked = state.parked.get(ask.token)
    if parked is None:
        state.metrics.resume_misses.inc(reason="unknown")
        return None
    if not secrets.compare_digest(parked.tenant, tenant):
        # Never across tenants; the session stays kept for its own edge.
        state.metrics.resume_misses.inc(reason="tenant")
        return None
    unpark(state, ask.token, None)
    slot = parked.slot
    try:
        tokens = await state.engine.call(lambda: state.engine.adopt(slot, hello, ask.length))
    except Exception as e:
        log.info("resuming a lost session failed (%s): a new session instead", e)
        state.engine.release(slot)
        state.metrics.resume_misses.inc(reason="failed")
        return None
    state.metrics.sessions_resumed.inc()
    state.metrics.resumed_tokens.inc(len(tokens))
    return slot, tokens
