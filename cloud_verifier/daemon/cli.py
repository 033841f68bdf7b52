"""``cloud-verifier`` command line: ``serve``, ``gen-token``, ``check`` (whether a draft pairs
with the configured target: their tokenizers only, no weights, no GPU, offline).

Every ``serve`` setting can also come from ``WANSPEC_<NAME>`` environment variables or the
``[verifier]`` table of a TOML file (``--config F`` or ``$WANSPEC_CONFIG``); the command line wins,
then the environment, then the file, then the defaults.

:func:`run_serve` is ``serve`` from parsed arguments; a caller may replace the model loader
(``bench.net.verifier`` pads every forward this way).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloud_verifier.daemon.settings import ENV_PREFIX, TOML_SECTION, VerifierSettings
from shared.service.cli_args import add_setting_flags, parse_args, setting_values
from shared.service.config import ConfigError, load_settings

if TYPE_CHECKING:
    from cloud_verifier.engine.targets import Target
    from cloud_verifier.engine.tp import Rank

#: Builds the model loader (run on the model worker) from the resolved settings.
LoaderFactory = Callable[[VerifierSettings], Callable[[], "Target"]]
#: Builds the cloud draft model's loader (None: the default, from cloud_draft_model).
DraftLoaderFactory = Callable[[VerifierSettings], Callable[["Target"], "Target"] | None]

log = logging.getLogger("cloud_verifier")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``serve``: ``--config`` and one per settings field."""
    p.add_argument("--config", help=f"TOML file with a [{TOML_SECTION}] table")
    add_setting_flags(p, VerifierSettings, ENV_PREFIX)


def load_cli_settings(args: argparse.Namespace, env: dict[str, str]) -> VerifierSettings:
    cli = setting_values(args, VerifierSettings)
    config = args.config or env.get(ENV_PREFIX + "CONFIG")
    return load_settings(
        VerifierSettings,
        toml_path=Path(config).expanduser() if config else None,
        env=env,
        env_prefix=ENV_PREFIX,
        cli=cli,
        section=TOML_SECTION,
    )


def _check_model_spec(spec: str, key: str = "model") -> None:
    from cloud_verifier.engine.targets import parse_null_spec

    if key == "model" and parse_null_spec(spec) is not None:
        return
    from shared.runtime.model_spec import ModelSpecError, parse_model_spec

    try:
        parse_model_spec(spec)
    except ModelSpecError as e:
        raise ConfigError(key, str(e)) from None


async def serve(
    settings: VerifierSettings,
    auth: Any,
    ssl_context: Any = None,
    *,
    loader: Callable[[], Target] | None = None,
    draft_loader: Callable[[Target], Target] | None = None,
) -> int:
    """Run until SIGTERM/SIGINT. Returns the exit status (1 if the model failed to load).

    ``loader`` (run on the model worker) defaults to loading ``settings.model``,
    ``draft_loader`` to loading ``settings.cloud_draft_model`` (if any) beside it.
    """
    from cloud_verifier.daemon.admission import reload_tokens
    from cloud_verifier.daemon.app import build_app, make_runner
    from cloud_verifier.daemon.lifecycle import drain
    from cloud_verifier.daemon.state import STATE
    from shared.service.http_guard import Listener
    from shared.service.sdnotify import Notifier
    from shared.service.status import ServiceStatus, StopSignals

    notifier = Notifier.from_env()
    app = build_app(
        settings, auth=auth, loader=loader, draft_loader=draft_loader, notifier=notifier
    )
    state = app[STATE]
    listener = Listener(state.guard, settings.host, settings.port, ssl_context=ssl_context)
    try:
        await listener.bind()  # before the model load: a port in use ends here, quickly
    except OSError as e:
        # "Address already in use", "Permission denied", "Name or service not known", ...
        why = os.strerror(e.errno) if e.errno and e.errno > 0 else (e.strerror or str(e))
        print(
            f"cloud-verifier: error: cannot listen on {settings.host} port {settings.port}: "
            f"{why} (settings 'host', 'port')",
            file=sys.stderr,
        )
        return 2
    runner = make_runner(app)
    loop = asyncio.get_running_loop()
    stop = StopSignals(state.changed, log).install()
    loop.add_signal_handler(signal.SIGHUP, reload_tokens, state, "SIGHUP")
    rc = 0
    await runner.setup()  # starts the model load in the background
    try:
        await listener.start(runner)
        for host, port in listener.addresses:
            scheme = "https/wss" if ssl_context is not None else "http/ws"
            log.info("listening on %s port %d (%s)", host, port, scheme)
        announced = False
        while True:
            await state.changed.wait()
            state.changed.clear()
            if stop.stopping:
                await drain(state, settings.drain_timeout)
                break
            if state.status == ServiceStatus.FAILED:
                log.error("%s", state.reason)
                rc = 1
                break
            if state.status == ServiceStatus.READY and not announced:
                # Port listening and model loaded: only now is the service up.
                notifier.notify(f"READY=1\nSTATUS={state.reason}")
                announced = True
    finally:
        notifier.notify("STOPPING=1\nSTATUS=stopping")
        listener.close()
        await runner.cleanup()
        await listener.wait_closed()
        stop.remove()
        loop.remove_signal_handler(signal.SIGHUP)
    log.info("stopped")
    return rc


def _busy_threads(wait_s: float) -> list[threading.Thread]:
    """Non-daemon threads other than this one still running after up to ``wait_s`` seconds (an
    idle model worker exits at once after the engine's shutdown; a busy one does not)."""
    deadline = time.monotonic() + wait_s
    main = threading.current_thread()
    for t in threading.enumerate():
        if t is not main and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]


def run_serve(
    args: argparse.Namespace,
    *,
    make_loader: LoaderFactory | None = None,
    make_draft_loader: DraftLoaderFactory | None = None,
) -> int:
    """``serve`` from arguments parsed by :func:`add_serve_arguments`; ``make_loader`` builds
    the model loader from the resolved settings (default: load ``settings.model``),
    ``make_draft_loader`` the cloud draft model's (default: ``settings.cloud_draft_model``)."""
    from cloud_verifier.daemon.auth import Authenticator, AuthError

    try:
        settings = load_cli_settings(args, dict(os.environ))
        _check_model_spec(settings.model)
        if settings.cloud_draft_model:
            _check_model_spec(settings.cloud_draft_model, "cloud_draft_model")
        if settings.token_file is not None:
            try:
                auth = Authenticator(
                    token_file=settings.token_file, recheck_s=settings.token_reload_interval
                )
            except AuthError as e:
                raise ConfigError("token_file", str(e)) from None
        elif settings.insecure_no_auth:
            auth = Authenticator.insecure()
        else:
            raise ConfigError(
                "token_file",
                "no token file configured: pass --token-file F (see `cloud-verifier gen-token`) "
                "or, on a trusted network only, --insecure-no-auth",
            )
        ssl_context = None
        if settings.tls_cert is not None and settings.tls_key is not None:
            from cloud_verifier.daemon.tls import server_context

            ssl_context = server_context(settings.tls_cert, settings.tls_key)
    except ConfigError as e:
        print(f"cloud-verifier: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Model loading progress bars (transformers' "Loading weights", the GGUF conversion's
    # shards) are terminal animations: in a service log they are noise.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if settings.threads is not None:
        import torch

        torch.set_num_threads(settings.threads)
    if not auth.enabled:
        log.warning("authentication is OFF (--insecure-no-auth): anyone can open sessions")
    _check_open_files(settings)
    loader = make_loader(settings) if make_loader is not None else None
    draft_loader = make_draft_loader(settings) if make_draft_loader is not None else None
    from cloud_verifier.engine.tp import launch_ranks, rank_from_env, run_follower

    try:
        rank = rank_from_env(os.environ)
    except ValueError as e:
        print(f"cloud-verifier: error: {e}", file=sys.stderr)
        return 2
    if settings.tp > 1 and rank is None:
        # This process becomes torchrun's agent (same PID for systemd) and runs the ranks.
        return launch_ranks(settings.tp, sys.argv[1:])
    if rank is not None and rank.world > 1:
        if rank.world != settings.tp:
            print(
                f"cloud-verifier: error: started as {rank.world} ranks but tp = {settings.tp} "
                "(setting 'tp')",
                file=sys.stderr,
            )
            return 2
        if not rank.leader:
            return run_follower(rank, lambda: _load_shards(settings, rank))
        loader = _leader_loader(settings, rank)
    rc = asyncio.run(serve(settings, auth, ssl_context, loader=loader, draft_loader=draft_loader))
    busy = _busy_threads(1.0)
    if busy:
        # The model worker is still inside a load or a forward that cannot be interrupted;
        # Python would join it at exit and overrun the stop timeout. Everything else is closed.
        log.warning(
            "model worker still busy (%s): exiting without waiting for it",
            ", ".join(t.name for t in busy),
        )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _load_shards(settings: VerifierSettings, rank: Rank) -> Target:
    from cloud_verifier.engine.targets import load_target

    return load_target(
        settings.model,
        device=settings.device,
        dtype=settings.dtype,
        compile_forward=settings.compile,
        tp_size=rank.world,
        local_rank=rank.local_rank,
    )


def _leader_loader(settings: VerifierSettings, rank: Rank) -> Callable[[], Target]:
    """Rank 0's loader (on the engine's thread): join the group, load its shards, wait for
    every rank to have loaded (only then is the service ready), then serve through the
    followers."""

    from cloud_verifier.engine.tp import ShardedTarget, init_group, meet

    def load() -> Target:
        channel = init_group(rank)
        inner = _load_shards(settings, rank)
        meet(channel)
        return ShardedTarget(inner, channel, rank.world)

    return load


def _check_open_files(settings: VerifierSettings) -> None:
    """Warn when the descriptor limit cannot hold the configured connections."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = settings.max_pending_connections + settings.max_sessions + 64
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning(
            "open-file limit %d is below max_pending_connections + max_sessions + 64 = %d: "
            "raise it (LimitNOFILE=, ulimit -n) or lower max_pending_connections",
            soft,
            need,
        )


def _cmd_gen_token(args: argparse.Namespace) -> int:
    from cloud_verifier.daemon.auth import generate_token

    token = generate_token()
    if args.out is None:
        print(token)
        return 0
    path = Path(args.out).expanduser()
    try:
        write_secret(path, token + "\n", force=args.force)
    except FileExistsError:
        print(f"cloud-verifier: error: {path} exists (pass --force to replace it)", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"cloud-verifier: error: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote a new token to {path} (mode 0600)", file=sys.stderr)
    return 0


def write_secret(path: Path, text: str, *, force: bool = False) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600), never visible with other
    permissions. Without ``force`` an existing file is an error (FileExistsError); with it the
    file is replaced atomically."""
    data = text.encode()
    if not force:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _cmd_check(args: argparse.Namespace) -> int:
    """``check --draft MODEL``: one line, exit 0 when the draft pairs with the target of the
    settings (``model``), 1 when it does not, 2 on an error (a model not staged, a bad file)."""
    from cloud_verifier.engine.targets import parse_null_spec
    from shared.runtime.models import load_tokenizer
    from shared.runtime.pairing import fingerprint_words, mismatch_line

    def error(text: str) -> int:
        print(f"cloud-verifier: error: {text}", file=sys.stderr)
        return 2

    try:
        settings = load_cli_settings(args, dict(os.environ))
        if parse_null_spec(settings.model) is not None:
            return error(f"model {settings.model!r} has no tokenizer to compare with")
        _check_model_spec(settings.model)
        _check_model_spec(args.draft, "draft")
        target = load_tokenizer(settings.model).fingerprint
        draft = load_tokenizer(args.draft).fingerprint
    except (ValueError, OSError) as e:  # ConfigError, ModelSpecError, an unreadable file
        return error(str(e))
    line = mismatch_line(
        draft,
        target,
        target_of="this verifier's target",
        config="the edge's edge.toml",
        speaker="cloud-verifier",
    )
    if line is not None:
        print(line)
        return 1
    whose = f"this verifier's target {target.model_name}"
    print(f"ok: draft {fingerprint_words(draft)} pairs with {whose}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cloud-verifier", description="wanspec cloud verifier: verifies edge drafts."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="run the verifier service")
    add_serve_arguments(p_serve)
    p_serve.set_defaults(func=run_serve)

    p_tok = sub.add_parser("gen-token", help="print a new random bearer token")
    p_tok.add_argument(
        "--out", metavar="FILE", help="write the token to FILE (mode 0600) instead of printing it"
    )
    p_tok.add_argument("--force", action="store_true", help="replace FILE if it exists")
    p_tok.set_defaults(func=_cmd_gen_token)

    p_check = sub.add_parser(
        "check",
        help="check that a draft shares its tokenizer with the target (model); exit status 0: "
        "they pair, 1: they do not",
        description="Load the tokenizers of --draft and of the target the settings name "
        "(model: --config, WANSPEC_MODEL, --model) without weights, offline, and compare their "
        "fingerprints. Exit status 0 when they pair, 1 when they do not, 2 on an error.",
    )
    p_check.add_argument(
        "--draft", required=True, metavar="MODEL", help="the edge's draft model spec"
    )
    add_serve_arguments(p_check)
    p_check.set_defaults(func=_cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
