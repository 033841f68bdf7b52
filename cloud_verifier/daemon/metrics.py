"""The verifier's Prometheus metrics (names are stable; docs/cloud/metrics.md documents each
with a query).

Spec-decode names follow vLLM's (``vllm:spec_decode_num_drafts`` → ``wanspec_spec_decode_...``).
Only verdict-mode rounds count as drafts: in federated mode the edge decides acceptance.
"""

from __future__ import annotations

from cloud_verifier.engine.work import FailureKind
from shared.service.metrics import Counter, Gauge, Histogram, HttpMetrics, Registry

#: Buckets for per-round and per-forward times (seconds).
_TIME_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
)  # fmt: skip


class VerifierMetrics:
    def __init__(self) -> None:
        r = self.registry = Registry()
        self.num_drafts = Counter(
            r, "wanspec_spec_decode_num_drafts_total", "Draft batches verified (verdict mode)."
        )
        self.num_draft_tokens = Counter(
            r, "wanspec_spec_decode_num_draft_tokens_total", "Draft tokens verified (verdict mode)."
        )
        self.num_accepted_tokens = Counter(
            r, "wanspec_spec_decode_num_accepted_tokens_total", "Draft tokens accepted."
        )
        self.accepted_per_pos = Counter(
            r,
            "wanspec_spec_decode_num_accepted_tokens_per_pos_total",
            "Draft tokens accepted, by position in the batch (0 = first draft token).",
            labels=("position",),
        )
        self.corrections = Counter(
            r,
            "wanspec_corrections_total",
            "Rejections answered, by correction kind (sparse, candidates, token).",
            labels=("kind",),
        )
        self.bonus_tokens = Counter(r, "wanspec_bonus_tokens_total", "Bonus tokens sent.")
        self.resamples = Counter(r, "wanspec_resamples_total", "Resample requests answered.")
        self.federated_rounds = Counter(
            r, "wanspec_federated_rounds_total", "Proposes answered with a FederatedReply."
        )
        self.fixed_tokens = Counter(
            r,
            "wanspec_fixed_tokens_total",
            "Fixed tokens (prompt, corrections) run through the model.",
        )
        self.rollbacks = Counter(r, "wanspec_rollbacks_total", "Rollback frames applied.")
        self.stale_dropped = Counter(
            r,
            "wanspec_stale_proposes_dropped_total",
            "Proposes of an old epoch dropped without model work.",
        )
        self.bytes_received = Counter(
            r, "wanspec_bytes_received_total", "WebSocket payload bytes received."
        )
        self.bytes_sent = Counter(r, "wanspec_bytes_sent_total", "WebSocket payload bytes sent.")
        self.frames_received = Counter(
            r, "wanspec_frames_received_total", "WebSocket data frames received."
        )
        self.frames_sent = Counter(r, "wanspec_frames_sent_total", "WebSocket data frames sent.")
        self.bad_frames = Counter(
            r,
            "wanspec_bad_frames_total",
            "Frames refused with a non-fatal error (bad_frame, bad_seq, bad_pos, ...).",
        )
        self.errors_sent = Counter(
            r, "wanspec_errors_sent_total", "Error frames sent, by code.", labels=("code",)
        )
        self.model_errors = Counter(
            r,
            "wanspec_model_errors_total",
            "Model work not done (an Error model_error, or a co-generation paused), by failure "
            f"kind ({', '.join(FailureKind.choices())}).",
            labels=("kind",),
        )
        self.slow_readers = Counter(
            r,
            "wanspec_slow_readers_total",
            "Sessions closed because the peer stopped reading (send_timeout, max_send_buffer).",
        )
        self.connections_rate_limited = Counter(
            r,
            "wanspec_connections_rate_limited_total",
            "Connections closed because their WebSocket pings, pongs or control frames passed "
            "max_frame_rate / frame_burst (1008 rate_limited).",
        )
        self.sessions_active = Gauge(r, "wanspec_sessions_active", "Open sessions.")
        self.slots_used = Gauge(
            r,
            "wanspec_session_slots_used",
            "Session slots held (sessions open or upgrading), against max_sessions.",
        )
        self.slots_total = Gauge(r, "wanspec_session_slots_total", "max_sessions.")
        self.idle_closed = Counter(
            r,
            "wanspec_sessions_idle_closed_total",
            "Sessions closed after idle_timeout s without model work (their slot freed).",
        )
        self.sessions_revoked = Counter(
            r,
            "wanspec_sessions_revoked_total",
            "Sessions closed because their token was removed from the token file.",
        )
        self.http = HttpMetrics.declare(r, "wanspec_", "connections")
        self.tokens_configured = Gauge(
            r, "wanspec_tokens_configured", "Bearer tokens accepted now."
        )
        self.token_file_ok = Gauge(
            r,
            "wanspec_token_file_ok",
            "1 when the token file was last read fine; 0 when it is empty, unparsable or "
            "unreadable (the previous tokens are kept).",
        )
        self.token_reloads = Counter(
            r, "wanspec_token_reloads_total", "Token file reloads that changed the tokens."
        )
        self.token_file_errors = Counter(
            r,
            "wanspec_token_file_errors_total",
            "Token file reads that failed (empty, unparsable, unreadable; tokens kept).",
        )
        self.sessions = Counter(r, "wanspec_sessions_total", "Sessions established (Welcome sent).")
        self.sessions_refused = Counter(
            r,
            "wanspec_sessions_refused_total",
            "Session requests refused, by reason: the refusal's ErrorCode (unauthorized, "
            "loading, stopping, internal, busy, overloaded, kv_full, token_limit, bad_header, "
            "not_websocket, bad_upgrade, subprotocol, bad_handshake, bad_hello, "
            "fingerprint_mismatch).",
            labels=("reason",),
        )
        self.sessions_resumed = Counter(
            r,
            "wanspec_sessions_resumed_total",
            "Sessions that resumed a lost session's KV cache (no prefill of what it held).",
        )
        self.resumed_tokens = Counter(
            r, "wanspec_resumed_tokens_total", "Cached tokens kept by resumed sessions."
        )
        self.resume_misses = Counter(
            r,
            "wanspec_resume_misses_total",
            "Resume requests answered with a new session, by reason (unknown: no such lost "
            "session or expired; tenant: another bearer token's).",
            labels=("reason",),
        )
        self.parked = Gauge(
            r, "wanspec_parked_sessions", "Lost sessions whose KV cache is kept for resumption."
        )
        self.parked_dropped = Counter(
            r,
            "wanspec_parked_dropped_total",
            "Lost sessions' caches dropped, by reason (expired; budget: their pages passed "
            "resume_pages_share; pressure: a new session needed the slot or pages; token: a "
            "new session of the same token needed its room under max_sessions_per_token).",
            labels=("reason",),
        )
        self.progress_frames = Counter(
            r,
            "wanspec_progress_frames_total",
            "Progress frames sent (model work waiting or running).",
        )
        self.sessions_queued = Counter(
            r,
            "wanspec_sessions_queued_total",
            "New sessions that waited in the admission line (they could not start at once).",
        )
        self.admission_waiting = Gauge(
            r,
            "wanspec_admission_waiting",
            "Sessions waiting in the admission line now (at most admission_queue).",
        )
        self.admission_wait = Histogram(
            r,
            "wanspec_admission_wait_seconds",
            "Time a session waited in the admission line before it started.",
            buckets=_TIME_BUCKETS,
        )
        self.queue_delay = Gauge(
            r,
            "wanspec_queue_delay_seconds",
            "The engine's queueing delay as admission control last saw it.",
        )
        self.model_forwards = Counter(
            r,
            "wanspec_model_forwards_total",
            "Session rows in target forwards (one per verified Propose; a batched forward "
            "carries several).",
        )
        self.coalesced = Counter(
            r,
            "wanspec_coalesced_proposes_total",
            "Proposes verified in the forward of the Propose queued before them (coalescing).",
        )
        self.busy_seconds = Counter(
            r,
            "wanspec_engine_busy_seconds_total",
            "Seconds the engine spent in steps (target forwards and decisions, co-generation "
            "included): the verifier's GPU time; per committed token, divide by the tokens.",
        )
        self.cogen_tokens = Counter(
            r,
            "wanspec_cogen_tokens_total",
            "Tokens the verifier co-generated (decoded on its own while a session had no valid "
            "draft queued).",
        )
        self.hedge_tokens = Counter(
            r,
            "wanspec_hedge_tokens_total",
            "Co-generated tokens that were a hedge's draft tokens, accepted in one forward.",
        )
        self.tree_branches = Counter(
            r,
            "wanspec_tree_branches_total",
            "Token-tree branches verified in the forward of the batch they fork from.",
        )
        self.tree_branches_opened = Counter(
            r,
            "wanspec_tree_branches_opened_total",
            "Of those, opened by the recovered token (their tokens committed in that forward).",
        )
        self.tree_tokens = Counter(
            r,
            "wanspec_tree_tokens_total",
            "Draft tokens of opened token-tree branches accepted in the forward of their batch.",
        )
        self.cloud_draft_proposed = Counter(
            r,
            "wanspec_cloud_draft_tokens_proposed_total",
            "Draft tokens the verifier made for itself (cloud_draft), verified in co-generation.",
        )
        self.cloud_draft_tokens = Counter(
            r,
            "wanspec_cloud_draft_tokens_accepted_total",
            "Of those, accepted (co-generated in one forward with the next token).",
        )
        self.cloud_drafts_withheld = Counter(
            r,
            "wanspec_cloud_drafts_withheld_total",
            "Co-generations that asked for a cloud model draft and decoded one token instead: "
            "reason=load (the step verified edge drafts), reason=cost (the session's acceptance "
            "did not pay for the draft forwards).",
            labels=("reason",),
        )
        self.draft_cut_rounds = Counter(
            r,
            "wanspec_draft_cut_rounds_total",
            "Rounds whose first batch the step's ration cut short (a batch longer than the "
            "budget its session was told, its tail's survival below the step's price under "
            "load): the tail is void, a bonus token follows the kept tokens.",
        )
        self.draft_deferred_batches = Counter(
            r,
            "wanspec_draft_deferred_batches_total",
            "Batches the step's ration left queued for a later step (coalesced behind a "
            "verified one past the step's price or room under load).",
        )
        self.draft_cut_tokens = Counter(
            r,
            "wanspec_draft_cut_tokens_total",
            "Draft tokens the ration left unverified.",
        )
        self.cogen_skipped = Counter(
            r,
            "wanspec_cogen_skipped_total",
            "Co-generation steps given no forward: the engine's step was full of drafts to verify.",
        )
        self.batch_sessions = Histogram(
            r,
            "wanspec_batch_sessions",
            "Sessions in one batched forward of the engine.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )
        self.prefix_hit_tokens = Counter(
            r,
            "wanspec_prefix_cache_hit_tokens_total",
            "Prompt tokens new sessions took from the prefix cache instead of computing them.",
        )
        self.prefix_cached_pages = Gauge(
            r,
            "wanspec_prefix_cache_pages",
            "KV pages in the prefix cache (held by sessions or idle; idle ones are evicted, "
            "least recently used first, when a page is needed).",
        )
        self.prefix_evictions = Counter(
            r,
            "wanspec_prefix_cache_evictions_total",
            "Cached KV pages evicted because a page was needed and none was free.",
        )
        self.kv_bytes_total = Gauge(
            r, "wanspec_kv_cache_bytes_total", "KV cache memory preallocated (kv_cache_tokens)."
        )
        self.kv_bytes_used = Gauge(
            r, "wanspec_kv_cache_bytes_used", "KV cache memory in pages held by sessions."
        )
        self.kv_pages_total = Gauge(r, "wanspec_kv_cache_pages_total", "KV cache pages.")
        self.kv_pages_used = Gauge(r, "wanspec_kv_cache_pages_used", "KV cache pages held.")
        self.model_ready = Gauge(
            r,
            "wanspec_model_ready",
            "1 once the target model is loaded; 0 again if the engine's thread dies.",
        )
        self.verify_seconds = Histogram(
            r,
            "wanspec_verify_seconds",
            "Worker time of one Propose: forward, sampling transform and decision.",
            buckets=_TIME_BUCKETS,
        )
        self.forward_seconds = Histogram(
            r,
            "wanspec_forward_seconds",
            "Worker time of the model forward alone.",
            buckets=_TIME_BUCKETS,
        )
        self.queue_seconds = Histogram(
            r,
            "wanspec_worker_queue_seconds",
            "Time a job waited for the model worker (other sessions' work ahead of it).",
            buckets=_TIME_BUCKETS,
        )
        self.round_seconds = Histogram(
            r,
            "wanspec_round_seconds",
            "Propose taken up → reply sent, in the session handler (taken up: received, or, "
            "for one read ahead while the session's previous work ran, its own work started).",
            buckets=_TIME_BUCKETS,
        )

    def render(self) -> str:
        return self.registry.render()
