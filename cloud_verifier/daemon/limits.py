"""The limits the settings fill: a session's bounds
(:class:`~cloud_verifier.session.limits.SessionLimits`) and the engine's
(:class:`~cloud_verifier.engine.engine.EngineLimits`), each field the setting of its name unless
its table (:data:`SESSION_FILL`, :data:`ENGINE_FILL`) says otherwise. Invariants: every field is
filled from the settings or declared to keep its own default (None in its table), so a field with
neither is an AttributeError at start, never a silent default; pure functions of the settings (no
I/O, no state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Final, TypeVar

from cloud_verifier.daemon.settings import VerifierSettings
from cloud_verifier.engine.engine import EngineLimits
from cloud_verifier.engine.prefix_cache import PrefixCache
from cloud_verifier.engine.step_times import StallRule
from cloud_verifier.session.cloud_draft import parse_cloud_drafts
from cloud_verifier.session.limits import SessionLimits

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def prefix_cache(settings: VerifierSettings) -> PrefixCache:
    """The prefix cache's namespace: ``auto`` is per tenant, off under tensor parallelism."""
    if settings.prefix_cache == "auto":
        return PrefixCache.TENANT if settings.tp == 1 else PrefixCache.OFF
    return PrefixCache(settings.prefix_cache)


#: How a limit is filled from the settings where it is not the setting of its own name: the
#: setting it is under another name, a function of the settings (a conversion, or a rule across
#: settings), or None (the limit's own bound: no setting names it, its default stands). Every
#: other field is the setting of its name; a field with neither is an AttributeError at start,
#: never a silent default.
Fill = Mapping[str, "str | Callable[[VerifierSettings], object] | None"]

SESSION_FILL: Final[Fill] = {
    "idle_timeout_s": "idle_timeout",
    "max_cogen_ahead": "cogen_ahead",
    "progress_interval_s": "progress_interval",
    "cloud_draft": lambda s: parse_cloud_drafts(s.cloud_draft),
    "cloud_model": lambda s: bool(s.cloud_draft_model),
    # Taking a branch moves keys in the pool: rank 0's alone under tensor parallelism.
    "max_tree_tokens": lambda s: s.tree_tokens if s.tp == 1 else 0,
    "max_queued": None,
    "max_stale_per_epoch": None,
    "max_hedges": None,
}

ENGINE_FILL: Final[Fill] = {
    "slots": "max_sessions",
    "page_size": "kv_page_size",
    "kv_tokens": "kv_cache_tokens",
    "session_share": "kv_session_share",
    "tenant_share": "kv_token_share",
    "batch_wait_s": lambda s: s.batch_wait_ms / 1000.0,
    "stall": lambda s: StallRule(floor_s=s.stall_timeout),
    "prefix_cache": prefix_cache,
}

L = TypeVar("L", bound="DataclassInstance")


def fill(limits: type[L], settings: VerifierSettings, table: Fill) -> L:
    """``limits`` filled from ``settings`` by ``table`` (see :data:`Fill`)."""
    values: dict[str, object] = {}
    for f in dataclasses.fields(limits):
        how = table.get(f.name, f.name)
        if how is not None:
            values[f.name] = getattr(settings, how) if isinstance(how, str) else how(settings)
    return limits(**values)


def limits_from(settings: VerifierSettings) -> SessionLimits:
    return fill(SessionLimits, settings, SESSION_FILL)


def engine_limits(settings: VerifierSettings) -> EngineLimits:
    return fill(EngineLimits, settings, ENGINE_FILL)
