"""The session's and the engine's limits are the settings' (written once, in VerifierSettings,
and filled by one table each, ``SESSION_FILL`` and ``ENGINE_FILL``): their defaults equal what
the default settings give, and every limit is filled from a setting, but for the session rules'
own bounds, which no setting names. The step plan's BatchLimits are the engine's."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest

from cloud_verifier.daemon.limits import ENGINE_FILL, SESSION_FILL, engine_limits, limits_from
from cloud_verifier.daemon.settings import VerifierSettings
from cloud_verifier.engine.engine import EngineLimits
from cloud_verifier.engine.prefix_cache import PrefixCache
from cloud_verifier.engine.scheduler import BatchLimits
from cloud_verifier.engine.step_times import StallRule
from cloud_verifier.session.cloud_draft import CloudDraft, DraftLength
from cloud_verifier.session.limits import SessionLimits

pytestmark = pytest.mark.fast

#: SessionLimits fields that are the session rules' own bounds, not settings.
PROTOCOL_BOUNDS = {"max_queued", "max_stale_per_epoch", "max_hedges"}

#: A value other than the default for every setting the limits are filled from.
CHANGED = {
    "max_gamma": 9,
    "max_fixed": 100,
    "max_context": 200,
    "max_frame": 8192,
    "max_k": 7,
    "max_bad_frames": 3,
    "max_resamples": 2,
    "idle_timeout": 5.0,
    "max_coalesced": 4,
    "cogen_ahead": 5,
    "cloud_draft": "tail,ngram",
    "cloud_draft_model": "self:skip=1",
    "cloud_draft_tokens": 3,
    "cloud_draft_length": DraftLength.FIXED,
    "max_frame_rate": 10.0,
    "frame_burst": 20,
    "progress_interval": 0.5,
    "tree_tokens": 4,
    "max_sessions": 3,
    "max_batch_sessions": 2,
    "max_batch_tokens": 100,
    "kv_page_size": 8,
    "kv_cache_tokens": 4096,
    "batch_wait_ms": 1.0,
    "ration": False,
    "ration_share": 1.5,
    "kv_session_share": 0.25,
    "kv_token_share": 0.5,
    "stall_timeout": 7.0,
    "prefix_cache": PrefixCache.GLOBAL,
    "prefill_chunk": 64,
    "prefill_share": 0.5,
    "service_rate": 10.0,
}


def test_the_limits_defaults_are_the_settings_defaults() -> None:
    settings = VerifierSettings()
    assert limits_from(settings) == SessionLimits()
    assert engine_limits(settings) == EngineLimits()


def test_every_session_limit_is_filled_from_a_setting() -> None:
    limits = limits_from(dataclasses.replace(VerifierSettings(), **CHANGED))
    default = SessionLimits()
    same = {
        f.name
        for f in dataclasses.fields(SessionLimits)
        if getattr(limits, f.name) == getattr(default, f.name)
    }
    assert same == PROTOCOL_BOUNDS
    assert limits.cloud_draft == frozenset({CloudDraft.TAIL, CloudDraft.NGRAM})
    assert limits.cloud_model


def test_every_engine_limit_is_filled_from_a_setting() -> None:
    limits = engine_limits(dataclasses.replace(VerifierSettings(), **CHANGED))
    default = EngineLimits()
    same = [
        f.name
        for f in dataclasses.fields(EngineLimits)
        if getattr(limits, f.name) == getattr(default, f.name)
    ]
    assert not same, same
    assert limits.stall == StallRule(floor_s=7.0) and limits.batch_wait_s == 0.001


@pytest.mark.parametrize(
    ("fields", "table"),
    [
        (dataclasses.fields(SessionLimits), SESSION_FILL),
        (dataclasses.fields(EngineLimits), ENGINE_FILL),
    ],
)
def test_the_fill_tables_name_only_the_limits_fields_and_settings(
    fields: tuple[dataclasses.Field[object], ...], table: Mapping[str, object]
) -> None:
    settings = {f.name for f in dataclasses.fields(VerifierSettings)}
    assert set(table) <= {f.name for f in fields}
    assert {how for how in table.values() if isinstance(how, str)} <= settings


def test_the_step_plans_limits_are_the_engines() -> None:
    settings = dataclasses.replace(VerifierSettings(), **CHANGED)
    assert engine_limits(settings).batch == BatchLimits(
        max_sessions=settings.max_batch_sessions,
        max_tokens=settings.max_batch_tokens,
        prefill_chunk=settings.prefill_chunk,
        prefill_share=settings.prefill_share,
        ration=settings.ration,
        ration_share=settings.ration_share,
    )
