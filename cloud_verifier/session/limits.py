"""What bounds one verifier session: its limits (:class:`SessionLimits`, filled from the
settings by :mod:`cloud_verifier.daemon.limits`), what the core knows of the target model
(:class:`TargetInfo`) and the context one session may hold (:func:`context_limit`, the one
rule for it). Plain data.

Invariant: a session's bounds are fixed for its life (frozen): its core holds the edge's frames
(refusing one past them) and its own work within them, never stretches them.
"""

from __future__ import annotations

from dataclasses import dataclass

from cloud_verifier.session.cloud_draft import CloudDraft, DraftLength
from shared.wire.messages import SEQ_MODULUS, Fingerprint


@dataclass(frozen=True)
class SessionLimits:
    """One session's bounds, filled from the settings (``cloud_verifier.daemon.limits.limits_from``)
    but for the protocol's own (``max_queued``, ``max_stale_per_epoch``, ``max_hedges``); the
    defaults are the settings' defaults (tests/verifier/test_limits_derived.py holds them
    equal)."""

    max_gamma: int = 16
    max_fixed: int = 8192
    max_context: int = 8192
    max_frame: int = 1 << 20
    max_k: int = 1024
    max_bad_frames: int = 16
    max_resamples: int = 64
    #: Frames decoded while model work runs, waiting their turn (a flood beyond is refused).
    max_queued: int = 256
    #: Seconds an open session may go without model work (no valid Propose, Rollback or
    #: Resample) before it is closed and its slot freed; 0 = never.
    idle_timeout_s: float = 60.0
    #: Stale Proposes (of an old epoch) accepted per epoch: an honest edge has at most its
    #: in-flight depth (< 128) of them after a rejection; every one beyond is a bad frame.
    max_stale_per_epoch: int = SEQ_MODULUS
    #: Coalescing: Proposes queued behind the one being started that continue it (same epoch,
    #: next position, no fixed tokens) join its forward, up to this many draft tokens in all;
    #: 0 = off.
    max_coalesced: int = 64
    #: Co-generation (when the Hello asks for it): tokens the verifier may decode on its own
    #: beyond the end of the last Propose it received (a silent edge holds at most this much
    #: model work); 0 = never co-generate.
    max_cogen_ahead: int = 64
    #: Hedges (side drafts for likely rejection points) kept per session, the newest (one per
    #: position and token: a newer version of a branch replaces the older).
    max_hedges: int = 16
    #: Token trees: a Verify also verifies, in the same forward (a tree row), the hedges that
    #: fork inside its draft, up to this many tree tokens in all (each branch's token and its
    #: draft); 0 = off (hedges then wait for co-generation after the rejection). Only where the
    #: verifier draws corrections itself (greedy sampling or the greedy-draft mode) and no
    #: log-probabilities are asked for; set to 0 where the model side cannot move keys
    #: (tensor parallelism).
    max_tree_tokens: int = 32
    #: Cloud-side speculation in co-generation (no matching hedge): the verifier's own draft,
    #: at most ``cloud_draft_tokens`` tokens, verified in the co-generation forward. Sources
    #: without a model (:mod:`cloud_verifier.session.cloud_draft`), tried in the order tail, ngram;
    #: then, with ``cloud_model``, the model side's draft model.
    cloud_draft: frozenset[CloudDraft] = frozenset({CloudDraft.NGRAM})
    cloud_model: bool = False
    cloud_draft_tokens: int = 8
    cloud_draft_length: DraftLength = DraftLength.AUTO
    #: Frames a session may send per second, sustained, and in a burst (a token bucket over
    #: the ``now`` passed in); past it the session is closed (rate_limited). 0 = no limit.
    max_frame_rate: float = 1000.0
    frame_burst: int = 2000
    #: Progress frames (Hello.progress): at most one per this many seconds, the first once the
    #: session's model work has waited this long.
    progress_interval_s: float = 1.0
    #: The service level every session is owed, tokens/s (:mod:`cloud_verifier.session.pace`):
    #: the scheduler serves first the sessions furthest below it; 0 = every session weighs 1.
    service_rate: float = 5.0


@dataclass(frozen=True)
class TargetInfo:
    """What the core needs to know of the target model."""

    fingerprint: Fingerprint
    vocab_size: int
    max_length: int | None = None  # the model's own context limit, if any


def context_limit(limits: SessionLimits, engine_limit: int | None) -> int:
    """Tokens one session may hold: the ``max_context`` setting, capped by what the engine
    gives a session (the model's limit and its share of the KV pool). The Welcome and the
    connection's Ready announce it; the core refuses a Propose past it (``context_full``)."""
    return min(limits.max_context, engine_limit or limits.max_context)
