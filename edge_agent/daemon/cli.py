"""``edge-agent`` command line: ``serve`` (the local OpenAI-compatible daemon), ``chat`` (a REPL),
``generate`` against a verifier, ``demo`` with a local one, ``check`` whether the draft pairs with
a target (its tokenizer only: no weights, no GPU, offline) or with each verifier's.

Every command reads one :class:`~edge_agent.runtime.settings.EdgeSettings`: flags >
``WANSPEC_EDGE_*`` environment variables > the TOML file (``--config``, default
``~/.config/wanspec/edge.toml``) > defaults, with the same checks everywhere. The order of work
is the same too: settings are loaded and checked (model specs, token and key files, the API's
address) before torch is imported, so a mistake is one line (``edge-agent: error: ...``, exit
status 2) within a fraction of a second; then torch, then the model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from shared.service.cli_args import add_setting_flags, parse_args, setting_values

if TYPE_CHECKING:
    from edge_agent.daemon.progress import Progress
    from edge_agent.runtime.service import EdgeService
    from edge_agent.runtime.settings import EdgeSettings
    from shared.wire.messages import Fingerprint

DEFAULT_TARGET = "default"
DEMO_PROMPT = "Explain in two sentences why the sky is blue."
COMMANDS = ("generate", "demo", "serve", "chat", "check")

# Flags a command accepts (one settings story) but does not list in its --help: they do not
# concern it.
_HTTP = {"header_timeout", "max_pending_connections", "max_pending_per_address"}
_API = {
    "host", "port", "api_key_file", "model_id", "max_queue", "max_body", "probe_interval", *_HTTP,
    "max_concurrent", "stream_keepalive", "write_timeout",
}  # fmt: skip
_LINK = {
    "verifier", "failover", "weights", "k", "eps_target", "reconstruction", "round_deadline",
    "token_file", "ca_file", "insecure_skip_verify", "heartbeat", "verifier_wait",
    "link_down_deadline", "link_down_fail_fast", "verdict_timeout", "fallback",
}  # fmt: skip
#: Renamed settings (edge_agent.runtime.settings.RENAMED): still accepted, listed in no --help.
_DEPRECATED = {"link_down_deadline"}
_UNLISTED: dict[str, set[str]] = {
    "generate": _API,
    "demo": _API | _LINK,  # the demo starts its own verifier
    "serve": set(),
    "chat": {
        "max_queue",
        "max_body",
        "probe_interval",
        "max_concurrent",
        "stream_keepalive",
        "write_timeout",
        *_HTTP,
    },
    "check": _API,
}


VERBOSE_HELP = (
    "after each answer, the speculation's internals too (mode, gamma, depth, acceptance, "
    "rounds, rejections, bytes, token sources); and debug logs"
)


def _add_settings_args(p: argparse.ArgumentParser, command: str = "serve") -> None:
    """``--config``, ``-v``/``--verbose`` (as before the command: ``edge-agent generate -v``
    is ``edge-agent -v generate``) and one flag per EdgeSettings field (None = not given)."""
    from edge_agent.runtime.settings import (
        CONFIG_ENV,
        ENV_PREFIX,
        EdgeSettings,
        default_config_path,
    )

    p.add_argument(
        "--config",
        default=None,
        help=f"TOML settings file (env {CONFIG_ENV}; default {default_config_path()} if present)",
    )
    # (SUPPRESS: not given here, the top level's value stands)
    p.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP
    )
    g = p.add_argument_group("settings (also WANSPEC_EDGE_<NAME> or the TOML file)")
    unlisted = _UNLISTED.get(command, set()) | _DEPRECATED
    add_setting_flags(g, EdgeSettings, ENV_PREFIX, unlisted=unlisted)


def _cli_values(args: argparse.Namespace) -> dict[str, Any]:
    from edge_agent.runtime.settings import EdgeSettings

    return setting_values(args, EdgeSettings)


def load_cli_settings(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> EdgeSettings:
    """EdgeSettings from the parsed flags, ``env`` (default ``os.environ``) and the TOML file."""
    from edge_agent.runtime.settings import load_edge_settings

    return load_edge_settings(config=args.config, env=env, cli=_cli_values(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-agent",
        description="wanspec edge agent: drafts locally, verified in the cloud over a WAN. "
        "Every command reads the same settings: flags > WANSPEC_EDGE_* > --config FILE > "
        "defaults.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for PROMPT against a verifier")
    gen.add_argument("prompt")
    _add_settings_args(gen, "generate")
    gen.add_argument(
        "--chat-template",
        "--chat",
        dest="chat",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="wrap PROMPT in the model's chat template (default: off)",
    )
    gen.add_argument("--json", action="store_true", help="last stdout line: one JSON summary")
    demo = sub.add_parser(
        "demo", help="start a local verifier with the default target and generate against it"
    )
    demo.add_argument("prompt", nargs="?", default=DEMO_PROMPT)
    _add_settings_args(demo, "demo")
    demo.add_argument("--target", default=DEFAULT_TARGET, help="verifier model spec")
    demo.add_argument(
        "--chat-template",
        "--chat",
        dest="chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wrap PROMPT in the model's chat template (default: on; --no-chat-template: "
        "plain text completion)",
    )
    demo.add_argument("--json", action="store_true", help="last stdout line: one JSON summary")
    serve = sub.add_parser(
        "serve",
        help="run the local OpenAI-compatible API (/v1/chat/completions, /v1/completions, ...)",
    )
    _add_settings_args(serve, "serve")
    chat = sub.add_parser(
        "chat",
        help="interactive chat; uses a running `edge-agent serve`, else runs the agent here",
    )
    _add_settings_args(chat, "chat")
    check = sub.add_parser(
        "check",
        help="check that the draft shares its tokenizer with a target (--target) or with each "
        "verifier's; exit status 0: they pair, 1: one does not",
        description="Load the tokenizer of the draft (draft_base's for a self-draft or draft "
        "none) and of each --target (no weights, no GPU, offline: a local folder, a .gguf, or "
        "a hub id already in the Hugging Face cache) and compare their fingerprints; without "
        "--target, compare with the target each configured verifier announces. One line per "
        "target; exit status 0 when all pair, 1 when one does not, 2 on an error.",
    )
    check.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="MODEL",
        help="a target model spec to compare with (repeatable); without it, each verifier's",
    )
    _add_settings_args(check, "check")
    return parser


# ---------------------------------------------------------------------------- output


def _write(s: str) -> None:
    sys.stdout.write(s)
    sys.stdout.flush()


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _warn(text: str) -> None:
    _say(f"edge-agent: warning: {text}")


def _error(e: BaseException) -> int:
    _say(f"edge-agent: error: {e}")
    return 2


def _finish(args: argparse.Namespace, result: dict[str, Any], max_tokens: int) -> None:
    """After the text: why it stopped short, the statistics in plain words (``[stats]``) and,
    with ``--verbose``, the speculation's internals (``[details]``); ``--json``: every one."""
    from edge_agent.runtime.report import detail_line, plain_line, plural

    sys.stdout.write("\n")
    if result.get("finish_reason") == "length":
        if result["tokens"] < max_tokens:  # the context (the draft's or the verifier's) ended it
            _say(f"[cut at {plural(result['tokens'], 'token')}: the context is full]")
        else:
            _say(f"[cut at max_tokens = {result['tokens']}]")
    _say(f"[stats] {plain_line(result)}")
    if args.verbose:
        _say(f"[details] {detail_line(result)}")
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------- torch and the model


def _prepare_torch(settings: EdgeSettings) -> None:
    """After the checks: import torch, set its threads, and fail (``device = "cuda"``) or warn
    (``auto``) when CUDA was expected and is not there."""
    from edge_agent.daemon.progress import check_cuda

    if settings.threads is not None:
        import torch

        torch.set_num_threads(max(1, settings.threads))
    warning = check_cuda(settings.device)
    if warning:
        _warn(warning)


async def _load(settings: EdgeSettings, progress: Progress) -> EdgeService:
    from edge_agent.runtime.loading import loading_line
    from edge_agent.runtime.service import EdgeService

    service = EdgeService(settings)
    try:
        progress.report(loading_line(settings))
        async with progress.spinner():
            await service.load(progress.report)
        line = service.describe()
    except BaseException:
        await service.close()
        raise
    _say(f"[edge] {line}")
    return service


async def _generate_once(
    service: EdgeService, prompt: str, chat: bool, write: Callable[[str], None]
) -> dict[str, Any]:
    from edge_agent.runtime.events import Failed, Finished, Piece
    from edge_agent.runtime.service import GenRequest
    from edge_agent.runtime.text import encode_prompt

    s = service.settings
    loaded, _ = service.require()
    prompt_ids = encode_prompt(loaded, prompt, chat=chat)
    max_tokens = s.max_tokens
    context = service.context_limit()
    limit = context.tokens
    if limit is not None:
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"the prompt ({len(prompt_ids)} tokens) fills the context: {context.words('is')}"
            )
        max_tokens = min(max_tokens, limit - len(prompt_ids))
    req = GenRequest(prompt_ids, s.pipeline(), max_tokens, seed=s.seed)
    result: dict[str, Any] | None = None
    async with contextlib.aclosing(service.stream(req)) as events:
        async for ev in events:
            if isinstance(ev, Finished):
                result = {"text": ev.text, **ev.stats}
            elif isinstance(ev, Failed):
                raise ev.error()
            elif isinstance(ev, Piece):
                write(ev.text)
    if result is None:  # pragma: no cover - stream() always ends with Finished
        raise RuntimeError("the generation ended without a result")
    return result


# ---------------------------------------------------------------------------- the commands


def _generate(args: argparse.Namespace, settings: EdgeSettings) -> int:
    from edge_agent.daemon.progress import Progress

    _prepare_torch(settings)

    async def run() -> dict[str, Any]:
        service = await _load(settings, Progress())
        try:
            return await _generate_once(service, args.prompt, args.chat, _write)
        finally:
            await service.close()

    _finish(args, asyncio.run(run()), settings.max_tokens)
    return 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _demo(args: argparse.Namespace, settings: EdgeSettings) -> int:
    from edge_agent.daemon.progress import Progress
    from edge_agent.runtime.settings import EdgeSettings
    from shared.service.status import wait_healthy

    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="wanspec-demo-") as tmp:
        token_file = Path(tmp) / "token"
        token_file.write_text(secrets.token_urlsafe(24) + "\n")
        token_file.chmod(0o600)
        # The user's settings, but one verifier: the local one.
        settings = dataclasses.replace(
            settings,
            verifier=f"ws://127.0.0.1:{port}/v1/session",
            failover=False,
            weights="",
            k=EdgeSettings.k,
            token_file=token_file,
            # Two processes share this machine's cores: `threads` torch threads each (1 by
            # default; torch's own choice, a thread per core in each, oversubscribes them).
            threads=1 if settings.threads is None else settings.threads,
        )
        _prepare_torch(settings)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(settings.threads))
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")  # (and no progress bars: main())
        cmd = [
            sys.executable,
            "-c",
            "import sys; from cloud_verifier.daemon.cli import main; sys.exit(main())",
            "serve",
            "--model",
            args.target,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--token-file",
            str(token_file),
            "--log-level",
            "warning",
            "--threads",
            str(settings.threads),
        ]
        if settings.cloud_only:
            # No draft on the edge: the verifier drafts for itself (the edge's default draft,
            # on the verifier), so the demo is cloud-only speculative decoding.
            cmd += ["--cloud-draft", "tail,ngram", "--cloud-draft-model", EdgeSettings.draft]
        _say(f"[demo] starting a local verifier ({args.target}) on 127.0.0.1:{port} …")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)

        async def run() -> dict[str, Any]:
            # The draft loads here while the verifier loads there.
            service = await _load(settings, Progress())
            try:
                url = f"http://127.0.0.1:{port}/health"
                await asyncio.to_thread(wait_healthy, proc, url, 600, "the local verifier")
                how = "cloud-only" if settings.cloud_only else f"drafting with {settings.draft}"
                _say(f"[demo] verifier ready; {how}\n")
                return await _generate_once(service, args.prompt, args.chat, _write)
            finally:
                await service.close()

        try:
            result = asyncio.run(run())
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    _finish(args, result, settings.max_tokens)
    return 0


def _serve(args: argparse.Namespace, settings: EdgeSettings) -> int:
    _prepare_torch(settings)
    from edge_agent.daemon.server import serve

    return asyncio.run(serve(settings))


def _chat(args: argparse.Namespace, settings: EdgeSettings) -> int:
    from edge_agent.daemon.progress import Progress

    # Something on the screen at once: importing torch alone takes seconds.
    progress = Progress()
    progress.report("starting edge-agent chat")
    progress.start()
    try:
        from edge_agent.daemon.chat import run_chat
    except BaseException:
        progress.stop(False)
        raise
    return run_chat(settings, progress=progress, verbose=args.verbose)


async def _announced_targets(settings: EdgeSettings) -> list[tuple[str, Fingerprint | str]]:
    """Each verifier's target, from the Ready its connection starts with (no session is
    opened), or why it could not be reached."""
    from edge_agent.link.connection import Connection, LinkRefused, LinkSettings
    from edge_agent.link.tls import ssl_context
    from edge_agent.runtime.settings import read_secret_file
    from edge_agent.session.transport import LinkClosed

    token = read_secret_file(settings.token_file, "token_file") if settings.token_file else ""
    tls = ssl_context(
        str(settings.ca_file) if settings.ca_file else None, settings.insecure_skip_verify
    )
    out: list[tuple[str, Fingerprint | str]] = []
    for url in settings.verifier_urls:
        link = LinkSettings(url=url, token=token, heartbeat_s=0, ssl=tls)
        try:
            conn = await Connection.connect(link)
        except (LinkClosed, LinkRefused, OSError, PermissionError) as e:
            out.append((url, str(e) or type(e).__name__))
            continue
        try:
            out.append((url, conn.ready.fingerprint))
        finally:
            await conn.close()
    return out


def _pair_check(args: argparse.Namespace, settings: EdgeSettings) -> int:
    """``check``: one line per target on stdout; 0 when every one pairs with the draft, 1 when
    one does not, 2 when a verifier could not be asked."""
    from edge_agent.runtime.loading import pairing_setting, settings_place, tokenizer_spec
    from shared.runtime.models import load_tokenizer
    from shared.runtime.pairing import fingerprint_words, mismatch_line

    setting = pairing_setting(settings)
    edge = load_tokenizer(tokenizer_spec(settings)).fingerprint
    targets: list[tuple[str, Fingerprint | str]]
    if args.target:
        targets = [("", load_tokenizer(t).fingerprint) for t in args.target]
    else:
        targets = asyncio.run(_announced_targets(settings))
    status = 0
    for url, fp in targets:
        if isinstance(fp, str):
            print(f"edge: cannot ask {url}: {fp} (check offline: edge-agent check --target MODEL)")
            status = 2
            continue
        whose = f"{url}'s target" if url else "the target"
        line = mismatch_line(
            edge, fp, target_of=whose, setting=setting, config=settings_place(os.environ)
        )
        if line is None:
            print(f"ok: {setting} {fingerprint_words(edge)} pairs with {whose} {fp.model_name}")
        else:
            print(line)
            status = max(status, 1)
    sys.stdout.flush()
    return status


_RUN: dict[str, Callable[[argparse.Namespace, EdgeSettings], int]] = {
    "generate": _generate,
    "demo": _demo,
    "serve": _serve,
    "chat": _chat,
    "check": _pair_check,
}


def _daemon_answers(s: EdgeSettings) -> bool:
    """Whether an ``edge-agent serve`` answers /health at the configured address (a quick,
    blocking twin of :func:`edge_agent.daemon.chat.probe_server`, which needs the heavy imports)."""
    try:
        with urllib.request.urlopen(s.api_url + "/health", timeout=2) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:  # 503 while loading: still an edge-agent
        body = e.read()
    except (OSError, ValueError):
        return False
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(data, dict) and "link" in data


def _check(args: argparse.Namespace, env: Mapping[str, str]) -> EdgeSettings:
    """Load and check the settings; nothing heavy is imported (ConfigError on a fault)."""
    from edge_agent.daemon.unicode_text import text_error
    from edge_agent.runtime.settings import (
        check_before_loading,
        check_link_files,
        check_model_specs,
        load_edge_settings,
        retired_env_warnings,
        setting_sources,
    )
    from shared.runtime.model_spec import ModelSpecError, parse_model_spec
    from shared.service.config import ConfigError

    cli = _cli_values(args)
    settings = load_edge_settings(config=args.config, env=env, cli=cli)
    sources = setting_sources(config=args.config, env=env, cli=cli)
    for text in retired_env_warnings(env, sources):
        _warn(text)
    if args.command in ("generate", "serve") and settings.token_file is None:
        _warn(
            "no token_file: the verifier must then run with --insecure-no-auth "
            "(set --token-file, WANSPEC_EDGE_TOKEN_FILE or token_file in the config file)"
        )
    check_before_loading(settings, args.command, sources)
    if args.command == "chat":
        # The model and the link matter when chat runs the agent itself: not when a daemon
        # answers on the configured address (chat then talks to it).
        try:
            check_model_specs(settings, sources)
            check_link_files(settings, sources)
        except ConfigError:
            if not _daemon_answers(settings):
                raise
    if args.command == "demo":
        try:
            parse_model_spec(args.target)
        except ModelSpecError as e:
            raise ConfigError("target", str(e), "command line --target") from None
    if args.command == "check":
        check_model_specs(settings, sources)
        for target in args.target:
            try:
                parse_model_spec(target)
            except ModelSpecError as e:
                raise ConfigError("target", str(e), "command line --target") from None
        if not args.target:
            check_link_files(settings, sources)
    if args.command in ("generate", "demo"):  # before any model loads
        err = text_error(args.prompt)
        if err is not None:
            raise ValueError(f"the prompt {err}")
    return settings


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = _check(args, dict(os.environ))
    except ValueError as e:  # ConfigError, ModelSpecError
        return _error(e)
    from edge_agent.daemon.progress import quiet_hub_progress

    quiet_hub_progress()  # before torch and transformers are imported
    level: int = getattr(logging, settings.log_level.upper())
    if args.command != "serve":  # the daemon logs at its level; the others say what goes wrong
        level = max(level, logging.WARNING)
    logging.getLogger().setLevel(logging.DEBUG if args.verbose else level)
    try:
        return _RUN[args.command](args, settings)
    except (ValueError, RuntimeError, OSError) as e:
        # ConfigError, ModelSpecError, no verifier, refused token, unreadable file, ...
        logging.getLogger("wanspec.edge").debug("details", exc_info=e)
        return _error(e)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
