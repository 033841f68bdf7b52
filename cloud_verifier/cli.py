"""``cloud-verifier`` command line: ``serve``, ``gen-token``.

Every ``serve`` setting can also come from ``WANSPEC_<NAME>`` environment variables or the
``[verifier]`` table of a TOML file (``--config F`` or ``$WANSPEC_CONFIG``); the command line wins,
then the environment, then the file, then the defaults.

:func:`run_serve` is ``serve`` from parsed arguments; a caller may replace the model loader
(``bench.verifier`` pads every forward this way).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloud_verifier.settings import ENV_PREFIX, TOML_SECTION, VerifierSettings
from shared.config import ConfigError, load_settings

if TYPE_CHECKING:
    from cloud_verifier.engine import Target

#: Builds the model loader (run on the model worker) from the resolved settings.
LoaderFactory = Callable[[VerifierSettings], Callable[[], "Target"]]

log = logging.getLogger("cloud_verifier")

_HELP: dict[str, str] = {
    "model": "target model: default, a HF folder, a .gguf file, a cached hub id, or null:VOCAB",
    "host": "address to listen on",
    "port": "TCP port (0: any free port)",
    "token_file": "file of bearer tokens, one per line (# comments and blank lines ignored)",
    "insecure_no_auth": "serve without authentication (trusted networks only)",
    "tls_cert": "PEM certificate (chain) to serve wss:// (needs --tls-key)",
    "tls_key": "PEM private key of --tls-cert",
    "device": "where the model runs",
    "dtype": "model weights' dtype (auto: float32 on CPU, bfloat16 on CUDA)",
    "max_sessions": "concurrent sessions",
    "max_sessions_per_token": "concurrent sessions per bearer token (0: only max_sessions)",
    "max_context": "tokens per session (also capped by the model)",
    "max_gamma": "draft tokens per Propose",
    "max_fixed": "fixed (prompt/correction) tokens per Propose",
    "max_k": "entries of a sparse distribution (Hello.k and Hello.m)",
    "max_frame": "bytes per WebSocket frame (larger frames close the session)",
    "max_bad_frames": "refused frames per session before it is closed",
    "max_resamples": "Resample requests per rejection",
    "handshake_timeout": "seconds a client has to send Hello",
    "heartbeat": "WebSocket ping interval in seconds (0: off)",
    "close_timeout": "seconds to wait for a client's close reply",
    "send_timeout": "seconds a frame may wait for a client that does not read, then it is closed",
    "max_send_buffer": "unread bytes queued for a client before it is closed",
    "shutdown_timeout": "seconds to let sessions finish on SIGTERM",
    "log_level": "logging level",
}


def _add_settings_args(p: argparse.ArgumentParser) -> None:
    """One option per settings field; None = not given (so lower sources can fill it)."""
    hints = typing.get_type_hints(VerifierSettings)
    for f in dataclasses.fields(VerifierSettings):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{_HELP.get(f.name, '')} (default: {f.default}; env {ENV_PREFIX}"
        help_text += f"{f.name.upper()})"
        tp = hints[f.name]
        if tp is bool:
            p.add_argument(flag, action="store_true", default=None, help=help_text)
            continue
        choices = None
        if typing.get_origin(tp) is typing.Literal:
            choices = typing.get_args(tp)
        p.add_argument(flag, default=None, choices=choices, metavar=None, help=help_text)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``serve``: ``--config`` and one per settings field."""
    p.add_argument("--config", help=f"TOML file with a [{TOML_SECTION}] table")
    _add_settings_args(p)


def load_cli_settings(args: argparse.Namespace, env: dict[str, str]) -> VerifierSettings:
    cli = {f.name: getattr(args, f.name) for f in dataclasses.fields(VerifierSettings)}
    config = args.config or env.get(ENV_PREFIX + "CONFIG")
    return load_settings(
        VerifierSettings,
        toml_path=Path(config).expanduser() if config else None,
        env=env,
        env_prefix=ENV_PREFIX,
        cli=cli,
        section=TOML_SECTION,
    )


def _check_model_spec(spec: str) -> None:
    from cloud_verifier.engine import parse_null_spec

    if parse_null_spec(spec) is not None:
        return
    from shared.model_spec import ModelSpecError, parse_model_spec

    try:
        parse_model_spec(spec)
    except ModelSpecError as e:
        raise ConfigError("model", str(e)) from None


async def serve(
    settings: VerifierSettings,
    auth: Any,
    ssl_context: Any = None,
    *,
    loader: Callable[[], Target] | None = None,
) -> int:
    """Run until SIGTERM/SIGINT. Returns the exit status (1 if the model failed to load).

    ``loader`` (run on the model worker) defaults to loading ``settings.model``.
    """
    from aiohttp import web

    from cloud_verifier.app import STATE, build_app
    from shared.sdnotify import Notifier
    from shared.service_status import ServiceStatus

    notifier = Notifier.from_env()
    app = build_app(settings, auth=auth, loader=loader, notifier=notifier)
    state = app[STATE]
    runner = web.AppRunner(app, shutdown_timeout=settings.shutdown_timeout, access_log=None)
    loop = asyncio.get_running_loop()
    stopping = False

    def on_signal(sig: signal.Signals) -> None:
        nonlocal stopping
        log.info("%s: shutting down", sig.name)
        stopping = True
        state.changed.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    rc = 0
    await runner.setup()  # starts the model load in the background
    try:
        site = web.TCPSite(runner, settings.host, settings.port, ssl_context=ssl_context)
        await site.start()
        for addr in runner.addresses:
            scheme = "https/wss" if ssl_context is not None else "http/ws"
            log.info("listening on %s port %d (%s)", addr[0], addr[1], scheme)
        announced = False
        while True:
            await state.changed.wait()
            state.changed.clear()
            if stopping:
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
        await runner.cleanup()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("stopped")
    return rc


def run_serve(args: argparse.Namespace, *, make_loader: LoaderFactory | None = None) -> int:
    """``serve`` from arguments parsed by :func:`add_serve_arguments`; ``make_loader`` builds
    the model loader from the resolved settings (default: load ``settings.model``)."""
    from cloud_verifier.auth import Authenticator, AuthError

    try:
        settings = load_cli_settings(args, dict(os.environ))
        _check_model_spec(settings.model)
        if settings.token_file is not None:
            try:
                auth = Authenticator(token_file=settings.token_file)
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
            from cloud_verifier.tls import server_context

            ssl_context = server_context(settings.tls_cert, settings.tls_key)
    except ConfigError as e:
        print(f"cloud-verifier: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not auth.enabled:
        log.warning("authentication is OFF (--insecure-no-auth): anyone can open sessions")
    loader = make_loader(settings) if make_loader is not None else None
    rc = asyncio.run(serve(settings, auth, ssl_context, loader=loader))
    if threading.active_count() > 1:
        # The model worker is still inside a load or a forward that cannot be interrupted;
        # Python would join it at exit and overrun the stop timeout. Everything else is closed.
        log.warning("model worker still busy: exiting without waiting for it")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _cmd_gen_token(args: argparse.Namespace) -> int:
    from cloud_verifier.auth import generate_token

    print(generate_token())
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
    p_tok.set_defaults(func=_cmd_gen_token)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
