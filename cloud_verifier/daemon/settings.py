"""The verifier's settings (``cloud-verifier serve``), read by
``shared.service.config.load_settings``.

Sources, highest first: command line, ``WANSPEC_*`` environment variables, a TOML file
(``--config F``: its ``[verifier]`` table; a setting at its top level is refused), these
defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cloud_verifier.session.cloud_draft import CloudDraftError, parse_cloud_drafts
from shared.service.config import ConfigError

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "float16", "bfloat16"]
Switch = Literal["auto", "on", "off"]

#: Environment prefix and TOML table of the verifier's settings.
ENV_PREFIX = "WANSPEC_"
TOML_SECTION = "verifier"


def _b(lo: float, hi: float | None = None) -> dict[str, float]:
    return {"min": lo} if hi is None else {"min": lo, "max": hi}


@dataclass(frozen=True)
class VerifierSettings:
    """Everything ``serve`` needs. Limits are per process unless they say per session."""

    model: str = "default"  # a spec for shared.runtime.models.load_model, or null:VOCAB
    host: str = "127.0.0.1"
    port: int = field(default=8765, metadata=_b(0, 65535))
    token_file: Path | None = None  # one bearer token per line; # comments, blank lines ignored
    insecure_no_auth: bool = False  # serve without a token file (nobody is authenticated)
    tls_cert: Path | None = None  # PEM certificate (chain): serve wss:// (with tls_key)
    tls_key: Path | None = None  # PEM private key of tls_cert
    device: Device = "auto"
    dtype: DType = "auto"  # auto: float32 on the CPU, bfloat16 on CUDA
    # torch CPU threads (None: torch's choice, one per core). Processes that share a machine's
    # cores (a local verifier beside the edge) each get their share, or both run slower.
    threads: int | None = field(default=None, metadata=_b(1, 1024))
    # torch.compile the batched forward (shapes bucketed; CUDA graphs where torch uses them):
    # auto = on for CUDA, off on the CPU (there compiled was faster for one session and slower
    # for 8, after 80-90 s of compilation per shape: docs/benchmarks/verifier.md).
    compile: Switch = "auto"
    # Tensor parallelism: one target over this many ranks (GPUs of one node, or CPU processes
    # over gloo), transformers' own TP, started with torchrun (cloud_verifier.engine.tp).
    tp: int = field(default=1, metadata=_b(1, 64))
    max_sessions: int = field(default=64, metadata=_b(1))  # also the engine's session slots
    # Sessions (streams) one connection may carry at once: an edge keeps one connection warm
    # and opens each request's session on it (more: that session is refused, busy).
    max_streams: int = field(default=64, metadata=_b(1, 65536))
    # Bytes of session frames one stream may have sent and not yet read by its session
    # (HTTP/2's per-stream window; at least twice max_frame): a flood past it ends that session
    # alone (flow_control), and a connection holds at most max_streams windows.
    stream_window: int = field(default=1 << 20, metadata=_b(4096, 1 << 30))
    # One batched forward holds at most this many sessions and this many padded tokens
    # (sessions × longest row); 1 = the serial engine (one session per forward).
    max_batch_sessions: int = field(default=64, metadata=_b(1))
    max_batch_tokens: int = field(default=4096, metadata=_b(1))
    # A step waits at most this long for the other open sessions' Proposes (none when all
    # have one queued): stop-and-wait edges then share steps instead of alternating.
    batch_wait_ms: float = field(default=2.0, metadata=_b(0, 1000))
    # The KV cache: one pool of this many tokens over all sessions, preallocated at start, in
    # pages of kv_page_size tokens (a session that finds no free page gets a model error).
    # 0 = auto: 16384 on the CPU but at most a tenth of the machine's memory, 80% of the GPU
    # memory free after loading on CUDA.
    kv_cache_tokens: int = field(default=0, metadata=_b(0))
    kv_page_size: int = field(default=16, metadata=_b(1, 4096))
    # Prefix cache: full KV pages are kept, keyed by their text, so that a session whose text
    # begins like an earlier one's (a chat's next turn, a shared system prompt) computes only
    # the rest. "tenant": shared among the sessions of one bearer token (a hit tells that the
    # prefix was sent before: no other token learns it); "global": among all; "auto": tenant,
    # off with tp > 1.
    prefix_cache: Literal["auto", "tenant", "global", "off"] = "auto"
    # Chunked prefill: while other sessions are active, a step computes at most this many
    # prompt (fixed) tokens, shared fairly between tenants, the rest in the next steps, so a
    # long prompt never holds another session's round up for its whole prefill (alone on the
    # engine, a prompt gets the whole step); 0 = no chunking.
    prefill_chunk: int = field(default=512, metadata=_b(0, 1 << 20))
    # ... and one tenant's prompt tokens may add at most this share to the step time of other
    # tenants' rounds (measured a + b·tokens; Sarathi-Serve's stall-free budget): the price one
    # bearer token's long prompts make the others pay; 0 = prefill_chunk alone bounds it.
    prefill_share: float = field(default=0.25, metadata=_b(0.0, 10.0))
    # Concurrent sessions per bearer token, those kept for resumption included (a new one drops
    # the token's oldest kept session; live ones alone at the cap: HTTP 429 before the upgrade);
    # 0 = no own limit.
    max_sessions_per_token: int = field(default=32, metadata=_b(0))
    max_context: int = field(default=8192, metadata=_b(2))  # tokens per session (capped by model)
    max_gamma: int = field(default=16, metadata=_b(1, 4096))  # draft tokens per Propose
    max_fixed: int = field(default=8192, metadata=_b(1))  # fixed tokens per Propose (prompt)
    max_k: int = field(default=1024, metadata=_b(1))  # top-K entries per sparse distribution
    max_frame: int = field(default=1 << 20, metadata=_b(4096, 1 << 30))  # bytes per frame
    max_bad_frames: int = field(default=16, metadata=_b(1))  # per session, then it is closed
    max_resamples: int = field(default=64, metadata=_b(0))  # Resample requests per rejection
    # Proposes queued behind a running one that continue it share its next forward, up to this
    # many draft tokens in all (coalescing; one Verdict each); 0 = off.
    max_coalesced: int = field(default=64, metadata=_b(0, 65536))
    # Co-generation, for edges that ask for it: with no valid draft of a session queued, the
    # verifier decodes that session's next tokens itself, at most this many beyond the end of
    # its last Propose, and only in room the drafts to verify leave in a step; 0 = off.
    cogen_ahead: int = field(default=64, metadata=_b(0, 65536))
    # Cloud-side speculation in co-generation (and so for edges with no draft model: cloud-only
    # speculative decoding): each co-generation forward verifies up to cloud_draft_tokens draft
    # tokens of the verifier's own, exactly (a deterministic draft). Sources, comma-separated,
    # tried in this order: "tail" (the rest of a rejected draft), "ngram" (prompt lookup over the
    # session's own text), then cloud_draft_model; "off" alone: none of the first two.
    cloud_draft: str = "off"
    # A draft model on the verifier's device (a model spec: self:skip=N shares the target's
    # weights, or a folder / .gguf of the same tokenizer), batched across sessions, greedy;
    # "" = none.
    cloud_draft_model: str = ""
    cloud_draft_tokens: int = field(default=8, metadata=_b(1, 64))
    # The model draft's length per co-generation: "auto" picks it per session, up to
    # cloud_draft_tokens, from the session's measured acceptance and the measured cost of a draft
    # forward against a target forward (none where drafting does not pay); "fixed": always
    # cloud_draft_tokens.
    cloud_draft_length: Literal["auto", "fixed"] = "auto"
    # Token trees: a batch is verified with the edge's hedges that fork inside it (its
    # pre-drafted branches) in one forward with a tree mask, up to this many branch tokens;
    # a rejection whose recovered token opens a branch commits the branch's accepted tokens
    # at once. 0 = off (hedges wait for co-generation); off with tp > 1.
    tree_tokens: int = field(default=32, metadata=_b(0, 256))
    handshake_timeout: float = field(default=10.0, metadata=_b(0.1))  # seconds to send Hello
    # An open session with no model work (no valid Propose, Rollback or Resample) for this many
    # seconds is closed (1008, idle_timeout) and its slot freed; 0 = never.
    idle_timeout: float = field(default=60.0, metadata=_b(0))
    # Before a request reaches a handler: a connection may idle header_timeout s (new, or in
    # keep-alive between requests), and a request's headers must be complete header_timeout s
    # after its first byte (else 408); at most max_pending_connections such
    # connections are held, max_pending_per_address of them per client address (more are
    # refused at once with 503, before any authentication work).
    header_timeout: float = field(default=10.0, metadata=_b(0.1))
    max_pending_connections: int = field(default=512, metadata=_b(1))
    max_pending_per_address: int = field(default=128, metadata=_b(1))
    # The token file is re-read (and compared by content) at most this often while requests
    # come in, and polled this often in the background (revoked tokens' sessions are closed);
    # SIGHUP re-reads it at once. 0 = only on SIGHUP or a changed size/mtime.
    token_reload_interval: float = field(default=1.0, metadata=_b(0))
    heartbeat: float = field(default=20.0, metadata=_b(0))  # WebSocket ping interval, 0 = off
    close_timeout: float = field(default=2.0, metadata=_b(0.1))  # wait for the peer's close
    # A peer that does not read: a frame not written within send_timeout s, or more than
    # max_send_buffer bytes waiting for it, closes its session (memory stays bounded).
    send_timeout: float = field(default=15.0, metadata=_b(0.1))
    max_send_buffer: int = field(default=4 << 20, metadata=_b(1 << 16))
    shutdown_timeout: float = field(default=10.0, metadata=_b(0.1))  # for handlers on SIGTERM
    # Behind a load balancer: on SIGTERM, first drain for up to this many seconds (/health
    # answers 503 "stopping", so the balancer stops routing here; new sessions are refused with
    # 503; open sessions go on), ending early once no session is left; then the rest are closed
    # with GOING_AWAY (their edges reconnect, through the balancer, elsewhere). 0 = no drain.
    drain_timeout: float = field(default=0.0, metadata=_b(0.0, 3600.0))
    # Admission control: while the engine's queueing delay (estimated from its queue and step
    # times, or seen by recent steps) exceeds this many seconds, new sessions get 503
    # "overloaded" with Retry-After; open sessions go on being served. 0 = off.
    max_queue_delay: float = field(default=15.0, metadata=_b(0))
    # Progress frames (edges that ask): at most one per this many seconds per session, the first
    # once its model work has waited this long; a slow engine is then never taken for a dead one.
    progress_interval: float = field(default=1.0, metadata=_b(0.05, 60))
    # A running engine step counts as stalled (its sessions get no more Progress frames, so
    # their edges leave) once it has run 8 times its estimated time and at least this long;
    # stalled this long more, it no longer feeds the systemd watchdog.
    stall_timeout: float = field(default=30.0, metadata=_b(1, 86_400))
    # Session resumption: a session whose connection is lost (not closed by its edge) keeps its
    # KV cache for this many seconds, for its edge to resume with the Welcome's token (same
    # bearer token only); at most resume_pages_share of the KV pool is held so (the pages they
    # hold now), oldest dropped first, and none is kept when a new session needs the pages.
    # Kept sessions count against max_sessions_per_token; one that holds no page is not kept;
    # an edge resuming one is never refused busy or overloaded. 0 = off.
    resume_grace: float = field(default=30.0, metadata=_b(0, 3600))
    resume_pages_share: float = field(default=0.25, metadata=_b(0, 1))
    # Shares of the KV pool: one session may hold kv_session_share of it, the sessions of one
    # bearer token together kv_token_share (1 = no own limit).
    kv_session_share: float = field(default=0.5, metadata=_b(0.001, 1))
    kv_token_share: float = field(default=0.75, metadata=_b(0.001, 1))
    # Frames one session may send per second, sustained, and in a burst (a flood past them
    # closes only that session: rate_limited). The same budget bounds, per connection, the
    # frames no session counts: WebSocket pings and pongs, stream opens, control frames (past
    # it the connection is closed, 1008 rate_limited). 0 = no limit.
    max_frame_rate: float = field(default=1000.0, metadata=_b(0))
    frame_burst: int = field(default=2000, metadata=_b(1))
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    def __post_init__(self) -> None:
        try:
            parse_cloud_drafts(self.cloud_draft)
        except CloudDraftError as e:
            raise ConfigError("cloud_draft", str(e)) from None
        if self.cloud_draft_model and self.tp > 1:
            raise ConfigError("cloud_draft_model", "a cloud draft model needs tp = 1")
        if self.prefix_cache in ("tenant", "global") and self.tp > 1:
            raise ConfigError("prefix_cache", "the prefix cache needs tp = 1 (use auto or off)")
        # Neither set is refused by `serve` only: tests and the demo pass a generated token.
        if self.token_file is not None and self.insecure_no_auth:
            raise ConfigError("insecure_no_auth", "cannot be combined with a token_file (pick one)")
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = "tls_key" if self.tls_key is None else "tls_cert"
            raise ConfigError(missing, "tls_cert and tls_key must be given together")
