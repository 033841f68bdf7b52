"""The edge agent's settings (every ``edge-agent`` command: ``generate``, ``demo``, ``serve``,
``chat``): one frozen dataclass, one loader, one set of checks.

Sources, highest precedence first (:func:`shared.service.config.load_settings`):

1. command-line flags,
2. ``WANSPEC_EDGE_<NAME>`` environment variables (e.g. ``WANSPEC_EDGE_PORT``; the ``EDGE_`` infix
   keeps them apart from the verifier's ``WANSPEC_<NAME>`` when both run on one machine),
3. the TOML file: ``--config F``, else ``$WANSPEC_EDGE_CONFIG``, else :func:`default_config_path`
   (``$XDG_CONFIG_HOME/wanspec/edge.toml`` or ``~/.config/wanspec/edge.toml``) if it exists;
   top-level keys, spelled like the fields (``-`` or ``_``),
4. the defaults below.

Unknown keys and bad values raise :class:`~shared.service.config.ConfigError` naming the key and its
source. Secrets never live here: ``token_file`` and ``api_key_file`` name files that hold them.

:func:`check_before_loading` runs the checks a command can make before it imports torch or loads a
model (model specs, secret and CA files, the API's address), so a mistake costs a fraction of a
second, not a model load. Light on purpose: importing this module imports neither torch nor
transformers.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import ssl
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (the Jetson)
    import tomli as tomllib

from edge_agent.session.federation_core import ROUND_DEADLINE_S
from edge_agent.session.pipeline_config import Auto, Bounds, Mode, PipelineConfig, RequestOptions
from shared.enums import TextEnum
from shared.maths.compression import Reconstruction
from shared.maths.rejection import CorrectionMode
from shared.maths.sampling import MIN_TEMPERATURE, SamplingParams
from shared.runtime.model_spec import ModelSpecError, SpecKind, parse_model_spec
from shared.service.config import (
    ConfigError,
    Device,
    DType,
    LogLevel,
    Source,
    exposed_secret,
    header_timeout_setting,
    load_settings,
    log_level_setting,
    max_pending_connections_setting,
    max_pending_per_address_setting,
    setting,
    threads_setting,
)
from shared.service.settings_doc import main, settings_page

log = logging.getLogger(__name__)

ENV_PREFIX = "WANSPEC_EDGE_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
#: Variables older ``edge-agent generate`` read; no longer read by any edge command (the
#: verifier still reads its own ``WANSPEC_TOKEN_FILE``): name → the variable to use instead.
RETIRED_ENV = {
    "WANSPEC_VERIFIER": ENV_PREFIX + "VERIFIER",
    "WANSPEC_TOKEN_FILE": ENV_PREFIX + "TOKEN_FILE",
}


class Fallback(TextEnum):
    """What a request does when no verifier answers."""

    NONE = "none"  # it fails with 503 and Retry-After, with its text so far
    DRAFT = "draft"  # the draft alone writes on; the answer is marked unverified


#: The ``draft`` that names no draft model: the edge loads the tokenizer of ``draft_base`` only and
#: the verifier's co-generation, with its own drafts, writes the text (cloud-only speculation).
NO_DRAFT = "none"

#: The default of ``verifier_wait`` (seconds): a verifier restart takes a few.
DEFAULT_VERIFIER_WAIT = 60.0
#: Settings renamed: old name → new name (the old one is read, with a warning, once).
RENAMED = {"link_down_deadline": "verifier_wait"}
_warned: set[str] = set()


@dataclass(frozen=True)
class EdgeSettings:
    """Everything the daemon and the REPL need, each setting declared once (type, default,
    bounds, help): the flags, their ``--help`` and docs/reference/edge-settings.md
    (``python -m edge_agent.runtime.settings docs/reference/edge-settings.md``) are derived from
    these declarations."""

    # --- verifier link(s)
    verifier: str = setting(
        "ws://127.0.0.1:8765/v1/session",
        help="verifier WebSocket URL; several, comma-separated: every draft is verified by all "
        "of them (federated verification, SpecFed), or, with failover, the first is used and "
        "the others are fail-over targets tried in order",
    )
    failover: bool = setting(
        False, help="several verifiers are fail-over targets instead of a federation"
    )
    weights: str = setting(
        "",
        help="federation: one positive weight per verifier, comma-separated (normalised; "
        '"": equal)',
    )
    k: str = setting(
        "64",
        help="federation: top-k size of each verifier's distributions (one for all, or one per "
        "verifier, comma-separated); with eps_target, the cap of the adaptive K",
    )
    eps_target: float = setting(
        0.0,
        min=0.0,
        max=0.999,
        help="federation: adaptive K, the smallest K whose kept mass is at least 1 - eps (k "
        "caps it); 0 = off",
    )
    reconstruction: Reconstruction = setting(
        Reconstruction.RENORMALISED,
        help="federation: A (renormalised top-K) or B (residual mass redistributed)",
    )
    round_deadline: float = setting(
        ROUND_DEADLINE_S,
        min=0.01,
        help="federation: once one verifier has answered a round, the least seconds the round "
        "waits for the others (up to 4 × that answer's round time); a slower one is left out "
        "of rounds, not dropped, and readmitted when a probe shows it keeps up",
    )
    token_file: Path | None = setting(
        None, help="file holding the verifier's bearer token (its first non-comment line)"
    )
    ca_file: Path | None = setting(None, help="CA bundle to verify a wss:// verifier with")
    insecure_skip_verify: bool = setting(False, help="do not verify the verifier's TLS certificate")
    heartbeat: float = setting(
        10.0, min=0.5, help="WebSocket ping interval to the verifier, seconds"
    )
    verifier_wait: float = setting(
        DEFAULT_VERIFIER_WAIT,
        min=0.1,
        max=86_400,
        help="seconds a request may wait for a verifier without progress, whatever it meets "
        "(refused or lost connections, busy refusals with Retry-After, a full admission line, "
        "or these in turn, as a crash-looping verifier gives): then it fails with 503 and "
        "Retry-After, with its text so far (fallback none). A wait that makes progress (in the "
        "verifier's admission line, told its place) is not bounded by this but by "
        "request_timeout",
    )
    request_timeout: float = setting(
        600.0,
        min=Bounds.TIMEOUT.lo,
        max=Bounds.TIMEOUT.hi,
        help="seconds a request may take in all: its wait for one of the max_concurrent "
        "generations, its wait in the verifier's admission line (busy, not down: the verifier "
        "reports its place) and its generation; past it the request ends with 504 and its text "
        "so far. The default is the OpenAI client's own; per request: wanspec.timeout",
    )
    link_down_deadline: float | None = setting(
        None,
        min=0.1,
        max=86_400,
        help="deprecated: the old name of verifier_wait (which bounded a down link only); "
        "still read, with a warning, and moved to verifier_wait",
    )
    link_down_fail_fast: float = setting(
        3.0,
        min=0.0,
        max=86_400,
        help="seconds: with fallback none and every verifier known down (the probes or the "
        "last session said so), a request fails after this long instead of verifier_wait; "
        "0 = off",
    )
    verdict_timeout: float = setting(
        10.0,
        min=0.1,
        max=3600,
        help="seconds, the floor of the verdict deadline: a stalled verifier is left after "
        "max(this, 4 × RTT) without a Verdict (from the batch's sending, or from the "
        "verifier's last Progress frame)",
    )
    probe_interval: float = setting(
        10.0, min=0.2, help="seconds between probes of the verifier's /health (link state, RTT)"
    )
    fallback: Fallback = setting(
        Fallback.NONE,
        help="when no verifier answers: none (requests fail with 503) or draft (generate with "
        "the draft alone; the answer is marked unverified)",
    )
    # --- the draft model
    draft: str = setting(
        "self:skip=12",
        help="draft model spec (self:skip=N shares the weights of draft_base; a folder, a "
        ".gguf, a cached hub id), or none: no draft model, only the tokenizer of draft_base "
        "(the verifier drafts and writes the text: cloud-only, for devices too weak to draft; "
        "needs cogen)",
    )
    draft_base: str = setting(
        "default",
        help="the model whose weights a self:... draft shares (draft none: whose tokenizer is "
        "loaded)",
    )
    device: Device = setting(Device.AUTO, help="where the draft runs (auto: cuda when available)")
    dtype: DType = setting(
        DType.AUTO, help="the draft weights' dtype (auto: float16 on cuda, float32 on the CPU)"
    )
    threads: int | None = threads_setting()
    # --- speculation
    gamma: int | Auto = setting(
        "auto",
        min=Bounds.GAMMA.lo,
        max=Bounds.GAMMA.hi,
        help="draft length γ: auto (the online controller picks it from the session's own "
        "measurements) or a number",
    )
    depth: int | Auto = setting(
        "auto",
        min=Bounds.DEPTH.lo,
        max=Bounds.DEPTH.hi,
        help="batches in flight D: auto (the online controller) or a number",
    )
    cogen: bool = setting(
        True,
        help="co-generation: the verifier decodes on its own while no draft of this session is "
        "queued",
    )
    hedge: int = setting(
        0,
        min=0,
        max=64,
        help="hedging: tokens drafted after the draft's second choice at its least confident "
        "position while the pipeline is full, for the verifier to go on after a rejection "
        "there; 0 = off",
    )
    predraft: int = setting(
        8,
        min=0,
        max=64,
        help="outcome pre-drafting: branches prepared at once, each γ tokens after a likely "
        "correction (the draft's runner-ups where a rejection is likely, by its confidence and "
        "this session's measured acceptance), grown in the same batched draft step as each "
        "batch and while the pipeline is full; a rejection whose correction opens one sends it "
        "at once; 0 = off",
    )
    branch_floor: float = setting(
        0.02,
        min=0.0,
        max=0.99,
        help="outcome pre-drafting: no branch for a correction less likely than this to be "
        "the next one (where the draft is sure, nothing is drafted)",
    )
    tree: bool = setting(
        True,
        help="token trees: the prepared branches also go to the verifier as they grow, ridden "
        "in the forward of the batch they fork from where its step has room, else verified in "
        "the co-generation step after a rejection there: no round trip either way (greedy "
        "decoding or the greedy_draft correction); needs predraft",
    )
    branch_uplink: int = setting(
        256,
        min=0,
        max=1 << 20,
        help="token trees: the bytes of branch frames sent per batch sent, on average (unspent "
        "bytes carry over up to four batches' worth); 0 = no bound",
    )
    mode: Mode = setting(
        Mode.PIPELINED,
        help="pipelined (up to D batches in flight) or stop-and-wait (one batch, classic "
        "speculative decoding)",
    )
    correction: CorrectionMode = setting(
        CorrectionMode.CANDIDATES,
        help="how a rejection is corrected at T > 0: candidates (exact), greedy_draft (exact, "
        "ids only), topk (PicoSpec, lossy)",
    )
    # --- sampling defaults (a request's own values win; they have the same bounds)
    temperature: float = setting(
        0.0,
        min=Bounds.TEMPERATURE.lo,
        max=Bounds.TEMPERATURE.hi,
        help=f"default temperature (0 = greedy; else at least {MIN_TEMPERATURE:g})",
    )
    top_p: float = setting(
        1.0,
        min=Bounds.TOP_P.lo,
        max=Bounds.TOP_P.hi,
        help="default top-p (nucleus sampling; above 0)",
    )
    top_k: int = setting(
        0, min=Bounds.TOP_K.lo, max=Bounds.TOP_K.hi, help="default top-k (0 = off)"
    )
    max_tokens: int = setting(
        512,
        min=Bounds.MAX_TOKENS.lo,
        max=Bounds.MAX_TOKENS.hi,
        help="default completion length, tokens",
    )
    seed: int | None = setting(
        None,
        min=Bounds.SEED.lo,
        max=Bounds.SEED.hi,
        help="default seed (unset: a fresh one per request)",
    )
    # --- the local API
    host: str = setting("127.0.0.1", help="address the API listens on (loopback by default)")
    port: int = setting(8760, min=0, max=65535, help="TCP port of the API")
    api_key_file: Path | None = setting(
        None, help="file holding the API key clients must send as a Bearer token on /v1/*"
    )
    model_id: str = setting("wanspec", help="the model id the API offers (/v1/models)")
    max_concurrent: int = setting(
        4,
        min=1,
        max=64,
        help="generations served at once (their draft steps share batched forwards); more "
        "requests wait, first come first served, up to max_queue of them, each at most until "
        "its deadline (request_timeout)",
    )
    max_queue: int = setting(
        32, min=1, help="requests allowed to wait for a generation; one more gets 429 at once"
    )
    stream_keepalive: float = setting(
        15.0,
        min=0.1,
        max=3600,
        help="seconds of silence before a streaming response gets an SSE comment (the stream "
        "stays open through proxies)",
    )
    write_timeout: float = setting(
        30.0,
        min=0.1,
        max=3600,
        help="seconds a client may take to take any of a write before it is dropped (its "
        "generation cancelled), never holding the others",
    )
    max_body: int = setting(1 << 20, min=1024, max=1 << 30, help="largest request body, bytes")
    header_timeout: float = header_timeout_setting()
    max_pending_connections: int = max_pending_connections_setting()
    max_pending_per_address: int = max_pending_per_address_setting()
    log_level: LogLevel = log_level_setting()

    def __post_init__(self) -> None:
        self._move_renamed()
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
        for key in ("top_p", "temperature"):  # bounds load_settings' min and max cannot say
            try:
                Bounds.of(key).check(key, getattr(self, key))
            except ValueError as e:
                raise ConfigError(key, str(e)) from None
        if not self.model_id.strip():
            raise ConfigError("model_id", "must not be empty")
        if self.tree and not self.predraft:
            raise ConfigError("tree", "sends the prepared branches: it needs predraft > 0")
        if self.cloud_only:
            self._check_cloud_only()

    def _move_renamed(self) -> None:
        """``link_down_deadline`` (deprecated) becomes ``verifier_wait``, with one warning per
        process; both set to different values is an error naming the new one. Invariant after
        it: ``link_down_deadline`` is None, so copies (``dataclasses.replace``) carry the value
        in ``verifier_wait`` alone."""
        old = self.link_down_deadline
        if old is None:
            return
        if self.verifier_wait not in (old, DEFAULT_VERIFIER_WAIT):
            raise ConfigError(
                "link_down_deadline",
                f"is the old name of verifier_wait, and both are set ({old:g} and "
                f"{self.verifier_wait:g}): set verifier_wait only",
            )
        if "link_down_deadline" not in _warned:
            _warned.add("link_down_deadline")
            log.warning(
                "setting link_down_deadline is deprecated: use verifier_wait (it bounds a "
                "request's whole wait for a verifier, down or busy); verifier_wait = %g",
                old,
            )
        object.__setattr__(self, "verifier_wait", old)
        object.__setattr__(self, "link_down_deadline", None)

    def _check_cloud_only(self) -> None:
        """``draft = "none"``: what needs a draft model on the edge is refused, one line each."""
        if not self.cogen:
            raise ConfigError(
                "cogen", "must be true with draft = none (the verifier writes the text)"
            )
        if self.fallback == Fallback.DRAFT:
            raise ConfigError(
                "fallback",
                "cannot be 'draft' with draft = none (no draft model to answer alone while the "
                "link is down)",
            )
        if self.federated:
            raise ConfigError(
                "verifier",
                "draft = none needs one verifier (several only with failover = true): "
                "federated verification needs a draft model on the edge",
            )
        if self.draft_base.strip().startswith("self:"):
            raise ConfigError(
                "draft_base",
                f"{self.draft_base!r} is a self-draft; draft = none loads the tokenizer of "
                "draft_base, which must name a model (default, a folder, a .gguf, a hub id)",
            )

    @property
    def cloud_only(self) -> bool:
        """``draft = "none"``: no draft model on the edge; the verifier writes the text."""
        return self.draft.strip().lower() == NO_DRAFT

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
    def api_url(self) -> str:
        """Where a client on this machine reaches the API (a wildcard address → loopback)."""
        host = self.host
        if host in ("0.0.0.0", "", "::"):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def pipeline(self, request: RequestOptions | None = None) -> PipelineConfig:
        """These defaults with a request's own values (``request``: None, or None fields: not
        given) on top: the one place the daemon's defaults meet a request's (the API's, the
        REPL's). Raises ValueError for a bad combination."""
        r = request or RequestOptions()

        def pick(v: Any, default: Any) -> Any:
            return default if v is None else v

        g, d = pick(r.gamma, self.gamma), pick(r.depth, self.depth)
        return PipelineConfig(
            gamma=4 if g == "auto" else g,
            depth=4 if d == "auto" else d,
            auto_gamma=g == "auto",
            auto_depth=d == "auto",
            cogen=self.cogen,
            hedge=self.hedge,
            predraft=self.predraft,
            branch_floor=self.branch_floor,
            tree=self.tree,
            branch_uplink=self.branch_uplink,
            mode=pick(r.mode, self.mode),
            correction=pick(r.correction, self.correction),
            reconstruction=self.reconstruction,
            sampling=SamplingParams(
                pick(r.temperature, self.temperature),
                pick(r.top_k, self.top_k),
                pick(r.top_p, self.top_p),
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


def setting_sources(
    *,
    config: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Where each explicitly given setting came from (the winner of CLI > environment > file), as
    :class:`~shared.service.config.ConfigError` spells it; settings left at their default are
    absent. Call it after :func:`load_edge_settings` succeeded with the same arguments."""
    e = dict(os.environ) if env is None else dict(env)
    out: dict[str, str] = {}
    path = config_path(config, e)
    if path is not None:
        with path.open("rb") as fh:
            for key in tomllib.load(fh):
                out[key.replace("-", "_")] = Source.file(path, None, key)
    names = {f.name for f in fields(EdgeSettings)}
    for name in names:
        if ENV_PREFIX + name.upper() in e:
            out[name] = Source.env(ENV_PREFIX + name.upper())
    for key, value in (cli or {}).items():
        if value is not None and key in names:
            out[key] = Source.cli(key)
    return out


def retired_env_warnings(env: Mapping[str, str], settings_sources: Mapping[str, str]) -> list[str]:
    """Warnings for set variables that no edge command reads any more (see :data:`RETIRED_ENV`),
    when the setting they meant was not given another way."""
    out = []
    for old, new in RETIRED_ENV.items():
        key = new.removeprefix(ENV_PREFIX).lower()
        if env.get(old) and key not in settings_sources:
            out.append(
                f"{old} is not read by edge-agent (it was by older `generate`); "
                f"use {new}, --{key.replace('_', '-')} or {key} in the config file"
            )
    return out


def read_secret_file(path: Path, key: str) -> str:
    """The first non-empty, non-comment line of a secret file; ConfigError naming ``key``."""
    try:
        lines = path.read_text().splitlines()
        warning = exposed_secret(path.stat().st_mode, path, key)
    except OSError as e:
        raise ConfigError(key, f"cannot read {path}: {e.strerror or e}") from None
    if warning is not None:
        log.warning("%s", warning)
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#"):
            return line
    raise ConfigError(key, f"{path} holds no secret (only blank or # comment lines)")


# ---------------------------------------------------------------------------- checks before loading


def check_model_specs(s: EdgeSettings, sources: Mapping[str, str] | None = None) -> None:
    """The draft (and, for a ``self:`` draft or draft none, its base) names a model that is
    there: parsing a spec resolves paths and the local hub cache only, nothing is loaded."""
    src = sources or {}
    uses_base = s.cloud_only  # draft none: only draft_base's tokenizer is loaded
    if not s.cloud_only:
        try:
            uses_base = parse_model_spec(s.draft).kind == SpecKind.SELF
        except ModelSpecError as e:
            raise ConfigError("draft", str(e), src.get("draft", "")) from None
    if uses_base:
        try:
            parse_model_spec(s.draft_base)
        except ModelSpecError as e:
            raise ConfigError("draft_base", str(e), src.get("draft_base", "")) from None


def check_link_files(s: EdgeSettings, sources: Mapping[str, str] | None = None) -> str:
    """The verifier's bearer token ("" without ``token_file``), and a readable CA bundle."""
    src = sources or {}
    token = ""
    if s.token_file is not None:
        try:
            token = read_secret_file(s.token_file, "token_file")
        except ConfigError as e:
            raise e.with_source(src.get("token_file", "")) from None
    if s.ca_file is not None:
        try:
            ssl.create_default_context(cafile=str(s.ca_file))
        except (OSError, ssl.SSLError) as e:
            why = getattr(e, "strerror", None) or str(e)
            raise ConfigError(
                "ca_file", f"cannot use {s.ca_file} as a CA bundle: {why}", src.get("ca_file", "")
            ) from None
    return token


def check_api_key_file(s: EdgeSettings, sources: Mapping[str, str] | None = None) -> None:
    if s.api_key_file is not None:
        try:
            read_secret_file(s.api_key_file, "api_key_file")
        except ConfigError as e:
            raise e.with_source((sources or {}).get("api_key_file", "")) from None


def _addr_text(addr: Iterable[Any]) -> str:
    host, port = list(addr)[:2]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def check_listen(s: EdgeSettings, sources: Mapping[str, str] | None = None) -> None:
    """``host``:``port`` can be listened on now (the daemon binds it the same way: address
    reuse on, so a port in TIME_WAIT passes; one with a listener does not). Port 0: any."""
    src = sources or {}
    if s.port == 0:
        return
    try:
        infos = socket.getaddrinfo(
            s.host or None, s.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        text = f"cannot resolve {s.host!r}: {e.strerror}"
        raise ConfigError("host", text, src.get("host", "")) from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                raise listen_error(s, addr, e, src) from None


def listen_error(
    s: EdgeSettings, addr: Iterable[Any], e: OSError, sources: Mapping[str, str] | None = None
) -> ConfigError:
    """The one-line error for an address the API cannot listen on."""
    why = e.strerror or str(e)
    if e.errno == errno.EADDRINUSE:
        why += " (another edge-agent serve? choose another port)"
    key = "port" if e.errno in (errno.EADDRINUSE, errno.EACCES) else "host"
    text = f"cannot listen on {_addr_text(addr)}: {why}"
    return ConfigError(key, text, (sources or {}).get(key, ""))


def check_before_loading(
    s: EdgeSettings, command: str, sources: Mapping[str, str] | None = None
) -> None:
    """Every check ``command`` can make before torch is imported; ConfigError on the first fault.

    ``serve``: model specs, token and CA files, the API key file, the address to listen on;
    ``generate``: model specs, token and CA files; ``demo``: model specs (it starts its own
    verifier); ``chat``: the API key file (the model and the link are checked when it runs the
    agent itself, not when it talks to a running daemon).
    """
    if command in ("serve", "generate", "demo"):
        check_model_specs(s, sources)
    if command in ("serve", "generate"):
        check_link_files(s, sources)
    if command in ("serve", "chat"):
        check_api_key_file(s, sources)
    if command == "serve":
        check_listen(s, sources)


REFERENCE_INTRO = f"""
Every setting of the `edge-agent` commands (`serve`, `chat`, `generate`, `demo`) is a
command-line flag (`--verifier-wait` for `verifier_wait`), an environment variable
`{ENV_PREFIX}<NAME>` (`{ENV_PREFIX}VERIFIER_WAIT`) and a top-level key of the TOML file
(`--config F`, else `${CONFIG_ENV}`, else `~/.config/wanspec/edge.toml` if it exists; `-` or `_`
in keys); the command line wins, then the environment, then the file, then the default. See
[Edge daemon](../edge/daemon.md#settings) for how they are read and checked. A request's own
`temperature`, `top_p`, `top_k`, `max_tokens`, `seed`, `gamma`, `depth`, `mode` and `correction`
(the API's body, the REPL's `/set`) take the same values as these defaults.
"""


def reference_page() -> str:
    """docs/reference/edge-settings.md."""
    return settings_page(
        EdgeSettings,
        title="Edge settings",
        intro=REFERENCE_INTRO,
        regenerate=(
            ".venv/bin/python -m edge_agent.runtime.settings docs/reference/edge-settings.md"
        ),
    )


if __name__ == "__main__":
    sys.exit(main(reference_page(), sys.argv[1:]))
