"""The edge agent's settings (``edge-agent serve`` / ``edge-agent chat``): one frozen dataclass.

Sources, highest precedence first (:func:`shared.config.load_settings`):

1. command-line flags,
2. ``WANSPEC_EDGE_<NAME>`` environment variables (e.g. ``WANSPEC_EDGE_PORT``; the ``EDGE_`` infix
   keeps them apart from the verifier's ``WANSPEC_<NAME>`` when both run on one machine),
3. the TOML file: ``--config F``, else ``$WANSPEC_EDGE_CONFIG``, else :func:`default_config_path`
   (``$XDG_CONFIG_HOME/wanspec/edge.toml`` or ``~/.config/wanspec/edge.toml``) if it exists;
   top-level keys, spelled like the fields (``-`` or ``_``),
4. the defaults below.

Unknown keys and bad values raise :class:`~shared.config.ConfigError` naming the key and its
source. Secrets never live here: ``token_file`` and ``api_key_file`` name files that hold them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from shared.compression import Reconstruction
from shared.config import ConfigError, load_settings
from shared.pipeline_config import Mode, PipelineConfig
from shared.protocol import CorrectionMode
from shared.sampling import SamplingParams

ENV_PREFIX = "WANSPEC_EDGE_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"

# Settings files and flags spell choices as strings (shared.config checks Literal choices): the
# values of Mode, CorrectionMode and Reconstruction (tests/test_edge_config.py keeps them equal).
ModeName = Literal["pipelined", "stop-and-wait"]
CorrectionName = Literal["candidates", "greedy_draft", "topk"]
ReconstructionName = Literal["A", "B"]
Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "float16", "bfloat16"]
Fallback = Literal["none", "draft"]
LogLevel = Literal["debug", "info", "warning", "error"]


def _b(lo: float, hi: float | None = None) -> dict[str, float]:
    return {"min": lo} if hi is None else {"min": lo, "max": hi}


@dataclass(frozen=True)
class EdgeSettings:
    """Everything the daemon and the REPL need (see the README section "Edge daemon")."""

    # --- verifier link(s)
    #: One WebSocket URL (PicoSpec mode), or several separated by commas: then every draft is
    #: verified by all of them (SpecFed mode) — or, with ``failover = true``, the first is used
    #: and the others are fail-over targets tried in order when it cannot be reached.
    verifier: str = "ws://127.0.0.1:8765/v1/session"
    failover: bool = False
    #: SpecFed mode: one positive weight per verifier (normalised; default equal), one top-k
    #: size per verifier (or one for all), or an ε target for adaptive K (then k is the cap).
    weights: str = ""
    k: str = "64"
    eps_target: float = field(default=0.0, metadata=_b(0.0, 0.999))
    reconstruction: ReconstructionName = "A"  # A renormalised top-K, B residual redistributed
    round_deadline: float = field(default=5.0, metadata=_b(0.01))  # s to wait for a worker
    token_file: Path | None = None  # bearer token for the verifier (first non-comment line)
    ca_file: Path | None = None  # CA bundle for a wss:// verifier
    insecure_skip_verify: bool = False
    heartbeat: float = field(default=10.0, metadata=_b(0.5))  # WebSocket ping interval, s
    retry_attempts: int = field(default=3, metadata=_b(1, 100))  # failed sessions per request
    probe_interval: float = field(default=10.0, metadata=_b(0.2))  # verifier /health probe, s
    #: What to do when no verifier answers: "none" (requests fail with 503) or "draft"
    #: (generate with the draft alone; the answer is marked unverified).
    fallback: Fallback = "none"
    # --- the draft model
    draft: str = "self:skip=12"  # model spec; self:... shares the weights of draft_base
    draft_base: str = "default"
    device: Device = "auto"  # auto: cuda when available
    dtype: DType = "auto"  # auto: float16 on cuda, float32 on the CPU
    threads: int | None = field(default=None, metadata=_b(1, 1024))  # torch CPU threads
    # --- speculation
    gamma: int = field(default=4, metadata=_b(1, 64))
    depth: int = field(default=2, metadata=_b(1, 127))
    mode: ModeName = "pipelined"
    correction: CorrectionName = "candidates"
    # --- sampling defaults (a request's own values win)
    temperature: float = field(default=0.0, metadata=_b(0.0, 100.0))
    top_p: float = field(default=1.0, metadata=_b(0.0, 1.0))
    top_k: int = field(default=0, metadata=_b(0))
    max_tokens: int = field(default=512, metadata=_b(1, 1 << 20))
    seed: int | None = None
    # --- the local API
    host: str = "127.0.0.1"
    port: int = field(default=8760, metadata=_b(0, 65535))
    api_key_file: Path | None = None  # Bearer key required on /v1/* when set
    model_id: str = "wanspec"  # the id /v1/models lists
    max_queue: int = field(default=32, metadata=_b(1))  # waiting requests before 429
    max_body: int = field(default=1 << 20, metadata=_b(1024, 1 << 30))  # request bytes
    log_level: LogLevel = "info"

    def __post_init__(self) -> None:
        urls = self.verifier_urls
        if not urls:
            raise ConfigError("verifier", "needs at least one ws:// or wss:// URL")
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("ws", "wss") or not parts.hostname:
                raise ConfigError("verifier", f"{url!r} is not a ws:// or wss:// URL")
        n = len(urls)
        weights = self.verifier_weights
        if len(weights) != n:
            raise ConfigError("weights", f"needs {n} comma-separated values (one per verifier)")
        if any(not w > 0 for w in weights):
            raise ConfigError("weights", f"must all be positive, got {self.weights!r}")
        ks = self.verifier_k
        if len(ks) != n or any(k < 1 for k in ks):
            raise ConfigError("k", f"needs one positive integer, or {n} (one per verifier)")
        if self.top_p <= 0.0:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not self.model_id.strip():
            raise ConfigError("model_id", "must not be empty")

    @property
    def verifier_urls(self) -> tuple[str, ...]:
        return tuple(u.strip() for u in self.verifier.split(",") if u.strip())

    @property
    def federated(self) -> bool:
        return len(self.verifier_urls) > 1 and not self.failover

    @property
    def verifier_weights(self) -> tuple[float, ...]:
        n = len(self.verifier_urls)
        if not self.weights.strip():
            return (1.0,) * n
        try:
            return tuple(float(w) for w in self.weights.split(","))
        except ValueError:
            raise ConfigError("weights", f"not numbers: {self.weights!r}") from None

    @property
    def verifier_k(self) -> tuple[int, ...]:
        n = len(self.verifier_urls)
        try:
            ks = tuple(int(k) for k in self.k.split(","))
        except ValueError:
            raise ConfigError("k", f"not integers: {self.k!r}") from None
        return ks * n if len(ks) == 1 else ks

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def pipeline(
        self,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        gamma: int | None = None,
        depth: int | None = None,
        mode: Mode | None = None,
        correction: CorrectionMode | None = None,
    ) -> PipelineConfig:
        """These defaults with a request's own values (None: not given) on top.
        Raises ValueError for a bad combination."""

        def pick(v: Any, default: Any) -> Any:
            return default if v is None else v

        return PipelineConfig(
            gamma=pick(gamma, self.gamma),
            depth=pick(depth, self.depth),
            mode=Mode.parse(pick(mode, self.mode), "mode"),
            correction=CorrectionMode.parse(pick(correction, self.correction), "correction"),
            reconstruction=Reconstruction.parse(self.reconstruction, "reconstruction"),
            sampling=SamplingParams(
                pick(temperature, self.temperature),
                pick(top_k, self.top_k),
                pick(top_p, self.top_p),
            ),
        )


def default_config_path(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CONFIG_HOME/wanspec/edge.toml``, else ``~/.config/wanspec/edge.toml``."""
    e = os.environ if env is None else env
    xdg = e.get("XDG_CONFIG_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".config"
    return base / "wanspec" / "edge.toml"


def config_path(explicit: str | os.PathLike[str] | None, env: Mapping[str, str]) -> Path | None:
    """The file to read: ``--config`` (must exist), ``$WANSPEC_EDGE_CONFIG`` (must exist), or
    the default location when a file is there."""
    if explicit:
        return Path(explicit).expanduser()
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]).expanduser()
    default = default_config_path(env)
    return default if default.is_file() else None


def load_edge_settings(
    *,
    config: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> EdgeSettings:
    """EdgeSettings from CLI > environment > TOML file > defaults."""
    e = dict(os.environ) if env is None else dict(env)
    return load_settings(
        EdgeSettings,
        toml_path=config_path(config, e),
        env=e,
        env_prefix=ENV_PREFIX,
        cli=cli,
    )


def read_secret_file(path: Path, key: str) -> str:
    """The first non-empty, non-comment line of a secret file; ConfigError naming ``key``."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(key, f"cannot read {path}: {e.strerror or e}") from None
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#"):
            return line
    raise ConfigError(key, f"{path} holds no secret (only blank or # comment lines)")
