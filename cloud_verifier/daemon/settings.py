"""The verifier's settings (``cloud-verifier serve``), read by
``shared.service.config.load_settings``.

Sources, highest first: command line, ``WANSPEC_*`` environment variables, a TOML file
(``--config F``: its ``[verifier]`` table; a setting at its top level is refused), these
defaults. Each setting is declared once below (:func:`~shared.service.config.setting`: type,
default, bounds, help); the flags, their ``--help`` and docs/reference/verifier-settings.md
(``python -m cloud_verifier.daemon.settings docs/reference/verifier-settings.md``) are derived
from it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cloud_verifier.engine.prefix_cache import PrefixCache
from cloud_verifier.session.cloud_draft import CloudDraftError, DraftLength, parse_cloud_drafts
from shared.service.config import (
    ConfigError,
    Device,
    DType,
    LogLevel,
    Switch,
    header_timeout_setting,
    log_level_setting,
    max_pending_connections_setting,
    max_pending_per_address_setting,
    setting,
    threads_setting,
)
from shared.service.settings_doc import main, settings_page

#: Environment prefix and TOML table of the verifier's settings.
ENV_PREFIX = "WANSPEC_"
TOML_SECTION = "verifier"


@dataclass(frozen=True)
class VerifierSettings:
    """Everything ``serve`` needs. Limits are per process unless they say per session."""

    model: str = setting(
        "default",
        help="target model: default, a Hugging Face folder, a .gguf file, a hub id already in "
        "the local cache, or null:VOCAB (no model: deterministic pseudo-random logits)",
    )
    host: str = setting("127.0.0.1", help="address to listen on")
    port: int = setting(8765, min=0, max=65535, help="TCP port (0: any free port)")
    token_file: Path | None = setting(
        None,
        help="file of bearer tokens, one per line (# comments and blank lines ignored); "
        "re-read when it changes",
    )
    insecure_no_auth: bool = setting(
        False, help="serve without a token file: nobody is authenticated (trusted networks only)"
    )
    tls_cert: Path | None = setting(
        None, help="PEM certificate (chain): serve wss:// and https:// only (with tls_key)"
    )
    tls_key: Path | None = setting(None, help="PEM private key of tls_cert")
    device: Device = setting(Device.AUTO, help="where the model runs (auto: CUDA if torch sees it)")
    dtype: DType = setting(
        DType.AUTO, help="the model weights' dtype (auto: float32 on the CPU, bfloat16 on CUDA)"
    )
    threads: int | None = threads_setting()
    compile: Switch = setting(
        Switch.AUTO,
        help="torch.compile the batched forward (shapes bucketed; CUDA graphs where torch uses "
        "them): auto = on for CUDA, off on the CPU (there compiled was faster for one session "
        "and slower for 8, after 80-90 s of compilation per shape)",
    )
    tp: int = setting(
        1,
        min=1,
        max=64,
        help="tensor parallelism: one target over this many ranks (GPUs of one node, or CPU "
        "processes over gloo), started with torchrun (rank 0 serves); the heads must divide "
        "by it",
    )
    max_sessions: int = setting(
        64,
        min=1,
        help="concurrent sessions, and the engine's session slots (more sessions wait in the "
        "admission line, admission_queue); connections are bounded by max_sessions + "
        "admission_queue (more: HTTP 503 busy before the upgrade)",
    )
    admission_queue: int = setting(
        256,
        min=0,
        max=1 << 16,
        help="sessions that may wait in the admission line for a slot, KV pages or a shorter "
        "model queue (served in arrival order, fairly between tokens, told their place and "
        "expected wait in Progress frames); past it a new session is refused 503 overloaded "
        "with Retry-After. 0 = no line: refused at once",
    )
    admission_queue_per_token: int = setting(
        192,
        min=1,
        max=1 << 16,
        help="sessions of one bearer token that may wait in the admission line (a fleet whose "
        "edges share a token is one tenant); past it that token's new session is refused 503 "
        "overloaded",
    )
    max_streams: int = setting(
        64,
        min=1,
        max=65536,
        help="sessions (streams) one connection may carry at once: an edge keeps one connection "
        "warm and opens each request's session on it (more: that session is refused, busy)",
    )
    stream_window: int = setting(
        1 << 20,
        min=4096,
        max=1 << 30,
        help="bytes of session frames one stream may have sent and its session not yet read "
        "(HTTP/2's per-stream window; at least twice max_frame): a flood past it ends that "
        "session alone (flow_control)",
    )
    max_batch_sessions: int = setting(
        64,
        min=1,
        help="sessions one batched forward holds at most (1: the serial engine, one session per "
        "forward)",
    )
    max_batch_tokens: int = setting(
        4096, min=1, help="padded tokens (sessions × longest row) one batched forward holds at most"
    )
    batch_wait_ms: float = setting(
        2.0,
        min=0,
        max=1000,
        help="milliseconds a step waits at most for the other open sessions' Proposes (none "
        "when all have one queued): stop-and-wait edges then share steps instead of alternating",
    )
    kv_cache_tokens: int = setting(
        0,
        min=0,
        help="the KV cache: one pool of this many tokens over all sessions, preallocated at "
        "start (a session that finds no free page gets a model error); 0 = auto: 16384 on the "
        "CPU but at most a tenth of the machine's memory (at least 1024), 80% of the GPU "
        "memory free after loading on CUDA; the start-up line says what was reserved",
    )
    kv_page_size: int = setting(16, min=1, max=4096, help="tokens per page of the KV pool")
    prefix_cache: PrefixCache | Literal["auto"] = setting(
        "auto",
        help="who shares cached prompt prefixes (full KV pages kept, keyed by their text, so a "
        "session whose text begins like an earlier one's computes only the rest): tenant (the "
        "sessions of one bearer token: no other token learns that a prefix was sent), global "
        "(all), off; auto: tenant, off with tp > 1",
    )
    prefill_chunk: int = setting(
        512,
        min=0,
        max=1 << 20,
        help="chunked prefill: while other sessions are active, a step computes at most this "
        "many prompt (fixed) tokens, shared fairly between tenants, the rest in the next steps "
        "(alone on the engine a prompt gets the whole step); 0 = no chunking",
    )
    prefill_share: float = setting(
        0.25,
        min=0.0,
        max=10.0,
        help="the share one tenant's prompt tokens may add to the step time of other tenants' "
        "rounds (by the measured step time a + b·tokens): what one bearer token's long prompts "
        "cost the others; 0 = prefill_chunk alone bounds it",
    )
    ration: bool = setting(
        True,
        help="rationing speculation: under load a step verifies the draft tokens most likely "
        "to be accepted while each pays for its step time, and tells each edge how many draft "
        "tokens a round it will verify (the law stays the target's); off: every draft whole",
    )
    ration_share: float = setting(
        0.5,
        min=0.05,
        max=10.0,
        help="with ration: the most the draft tokens past each round's promised budget, and the "
        "step's prefill before them, may add to a step, as a share of one forward's measured "
        "overhead (by the step time a + b·tokens): a loaded step stays short, so a new "
        "prompt's first token waits little",
    )
    service_rate: float = setting(
        5.0,
        min=0.0,
        max=10_000.0,
        help="the service level every session is owed, tokens/s (reading speed by default): "
        "each step's room goes first to the sessions furthest below it (by the rate each has "
        "attained since its first round), then to the rest by how likely their draft tokens "
        "are to be accepted; a session whose batches were deferred 4 steps in a row is served "
        "whole in the next. 0 = no level: every session ranks alike",
    )
    max_sessions_per_token: int = setting(
        32,
        min=0,
        help="concurrent sessions per bearer token, those kept for resumption included (a new "
        "one drops the token's oldest kept session; live ones alone at the cap: HTTP 429 "
        "before the upgrade); 0 = only max_sessions",
    )
    max_context: int = setting(
        8192, min=2, help="tokens per session (also capped by the model and the KV pool)"
    )
    max_gamma: int = setting(16, min=1, max=4096, help="draft tokens per Propose")
    max_fixed: int = setting(8192, min=1, help="fixed (prompt, correction) tokens per Propose")
    max_k: int = setting(
        1024, min=1, help="entries of a sparse distribution (Hello.k and Hello.m; more: bad_hello)"
    )
    max_frame: int = setting(
        1 << 20,
        min=4096,
        max=1 << 30,
        help="bytes per frame (aiohttp's max_msg_size: a larger one closes the session, 1009)",
    )
    max_bad_frames: int = setting(16, min=1, help="refused frames per session before it is closed")
    max_resamples: int = setting(64, min=0, help="Resample requests per rejection")
    max_coalesced: int = setting(
        64,
        min=0,
        max=65536,
        help="coalescing: Proposes queued behind a running one that continue it share its next "
        "forward, up to this many draft tokens in all (one Verdict each); 0 = off",
    )
    cogen_ahead: int = setting(
        64,
        min=0,
        max=65536,
        help="co-generation, for edges that ask for it: with no valid draft of a session "
        "queued, the verifier decodes that session's next tokens itself, at most this many "
        "past the end of its last Propose, only in room the drafts to verify leave in a step; "
        "0 = off",
    )
    cloud_draft: str = setting(
        "ngram",
        help="cloud-side speculation in co-generation (and so for edges with no draft model): "
        "each co-generation forward verifies up to cloud_draft_tokens draft tokens of the "
        "verifier's own, exactly. Sources, comma-separated, tried in this order: tail (the rest "
        "of a rejected draft), ngram (prompt lookup over the session's own text: no model, no "
        "draft forward), then cloud_draft_model; off alone: none of the first two",
    )
    cloud_draft_model: str = setting(
        "",
        help="a draft model on the verifier's device, batched across sessions, greedy: a model "
        "spec (self:skip=N shares the target's weights, or a folder or .gguf of the same "
        'tokenizer); "" = none; needs tp = 1',
    )
    cloud_draft_tokens: int = setting(
        8, min=1, max=64, help="at most this many tokens per cloud draft"
    )
    cloud_draft_length: DraftLength = setting(
        DraftLength.AUTO,
        help="the model draft's length per co-generation: auto picks, per session and step, "
        "the γ ≤ cloud_draft_tokens that maximises expected tokens per unit of verifier time, "
        "(1 - α^(γ+1)) / ((1 - α)(1 + γc)) (Leviathan et al., Theorem 3.8), from the session's "
        "measured acceptance α of its model drafts and the measured cost c of a draft forward "
        "against a target forward; γ = 0 (no draft) where α ≤ c, tried again as old evidence "
        "fades; fixed: always cloud_draft_tokens",
    )
    tree_tokens: int = setting(
        32,
        min=0,
        max=256,
        help="token trees: a batch is verified with the edge's hedges that fork inside it (its "
        "pre-drafted branches) in one forward with a tree mask, up to this many branch tokens; "
        "a rejection whose recovered token opens a branch commits the branch's accepted tokens "
        "at once. 0 = off (hedges wait for co-generation); off with tp > 1",
    )
    handshake_timeout: float = setting(10.0, min=0.1, help="seconds a client has to send Hello")
    idle_timeout: float = setting(
        60.0,
        min=0,
        help="seconds an open session may go without model work (no valid Propose, Rollback or "
        "Resample; pings do not count) before it is closed (1008, idle_timeout) and its slot "
        "freed; 0 = never",
    )
    header_timeout: float = header_timeout_setting()
    max_pending_connections: int = max_pending_connections_setting()
    max_pending_per_address: int = max_pending_per_address_setting()
    token_reload_interval: float = setting(
        1.0,
        min=0,
        help="seconds: the token file is re-read (and compared by content) at most this often "
        "while requests come in, and polled this often in the background (revoked tokens' "
        "sessions are closed); SIGHUP re-reads it at once. 0 = only on SIGHUP or a changed "
        "size/mtime",
    )
    heartbeat: float = setting(20.0, min=0, help="WebSocket ping interval in seconds (0: off)")
    close_timeout: float = setting(2.0, min=0.1, help="seconds to wait for a client's close reply")
    send_timeout: float = setting(
        15.0,
        min=0.1,
        help="seconds a frame may wait to be written to a client that does not read; then its "
        "session is closed (memory stays bounded)",
    )
    max_send_buffer: int = setting(
        4 << 20,
        min=1 << 16,
        help="unread bytes queued for a client before its session is closed",
    )
    shutdown_timeout: float = setting(
        10.0, min=0.1, help="seconds to let handlers finish on SIGTERM"
    )
    drain_timeout: float = setting(
        0.0,
        min=0.0,
        max=3600.0,
        help="behind a load balancer: on SIGTERM, first drain for up to this many seconds "
        "(/health answers 503 stopping, so the balancer stops routing here; new sessions are "
        "refused with 503; open sessions go on), ending early once no session is left; then "
        "the rest are closed with GOING_AWAY (their edges reconnect elsewhere). 0 = no drain",
    )
    max_queue_delay: float = setting(
        15.0,
        min=0,
        help="admission control: while the engine's queueing delay (estimated from its queue "
        "and step times, or seen by recent steps) exceeds this many seconds and other sessions "
        "are being served, a new session waits in the admission line (a lone session is always "
        "admitted: a slow step is not overload); open sessions go on being served. 0 = off",
    )
    progress_interval: float = setting(
        1.0,
        min=0.05,
        max=60,
        help="Progress frames (edges that ask): at most one per this many seconds per session, "
        "the first once its model work has waited this long; a slow engine is then never taken "
        "for a dead one",
    )
    stall_timeout: float = setting(
        30.0,
        min=1,
        max=86_400,
        help="seconds: a running engine step counts as stalled (its sessions get no more "
        "Progress frames, so their edges leave) once it has run 8 times its estimated time and "
        "at least this long; stalled this long more, it no longer feeds the systemd watchdog",
    )
    resume_grace: float = setting(
        30.0,
        min=0,
        max=3600,
        help="session resumption: a session whose connection is lost (not closed by its edge) "
        "keeps its KV cache for this many seconds, for its edge to resume with the Welcome's "
        "token (same bearer token only); kept sessions count against max_sessions_per_token, "
        "one that holds no page is not kept, and an edge resuming one is never refused busy "
        "or overloaded. 0 = off",
    )
    resume_pages_share: float = setting(
        0.25,
        min=0,
        max=1,
        help="the share of the KV pool sessions kept for resumption may hold (the pages they "
        "hold now), oldest dropped first; none is kept when a new session needs the pages",
    )
    kv_session_share: float = setting(
        0.5,
        min=0.001,
        max=1,
        help="the share of the KV pool one session may hold (1: no own limit)",
    )
    kv_token_share: float = setting(
        0.75,
        min=0.001,
        max=1,
        help="the share of the KV pool the sessions of one bearer token may hold together "
        "(1: no own limit; a fleet whose edges share one token is one tenant)",
    )
    max_frame_rate: float = setting(
        1000.0,
        min=0,
        help="frames per second one session may send, sustained (a flood past it closes only "
        "that session: rate_limited); the same budget bounds, per connection, the frames no "
        "session counts: WebSocket pings and pongs, stream opens, control frames (past it the "
        "connection is closed, 1008 rate_limited). 0 = no limit",
    )
    frame_burst: int = setting(
        2000, min=1, help="frames at once past max_frame_rate (a session's, and a connection's)"
    )
    log_level: LogLevel = log_level_setting()

    def __post_init__(self) -> None:
        try:
            parse_cloud_drafts(self.cloud_draft)
        except CloudDraftError as e:
            raise ConfigError("cloud_draft", str(e)) from None
        if self.cloud_draft_model and self.tp > 1:
            raise ConfigError("cloud_draft_model", "a cloud draft model needs tp = 1")
        if self.prefix_cache in (PrefixCache.TENANT, PrefixCache.GLOBAL) and self.tp > 1:
            raise ConfigError("prefix_cache", "the prefix cache needs tp = 1 (use auto or off)")
        # Neither set is refused by `serve` only: tests and the demo pass a generated token.
        if self.token_file is not None and self.insecure_no_auth:
            raise ConfigError("insecure_no_auth", "cannot be combined with a token_file (pick one)")
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = "tls_key" if self.tls_key is None else "tls_cert"
            raise ConfigError(missing, "tls_cert and tls_key must be given together")


REFERENCE_INTRO = f"""
Every setting of `cloud-verifier serve` is a command-line flag (`--max-sessions` for
`max_sessions`), an environment variable `{ENV_PREFIX}<NAME>` (`{ENV_PREFIX}MAX_SESSIONS`) and a
key of the `[{TOML_SECTION}]` table of a TOML file (`--config F` or `${ENV_PREFIX}CONFIG`); the
command line wins, then the environment, then the file, then the default. See
[Verifier service](../cloud/service.md#settings) for how they are read and checked.
"""


def reference_page() -> str:
    """docs/reference/verifier-settings.md."""
    return settings_page(
        VerifierSettings,
        title="Verifier settings",
        intro=REFERENCE_INTRO,
        regenerate=".venv/bin/python -m cloud_verifier.daemon.settings "
        "docs/reference/verifier-settings.md",
    )


if __name__ == "__main__":
    sys.exit(main(reference_page(), sys.argv[1:]))
