"""``edge-agent`` command line: ``serve`` (the local OpenAI-compatible daemon), ``chat`` (a REPL),
``generate`` against a verifier, ``demo`` with a local one.

``serve`` and ``chat`` read :class:`~edge_agent.config.EdgeSettings`: flags > ``WANSPEC_EDGE_*``
environment variables > the TOML file (``--config``, default ``~/.config/wanspec/edge.toml``) >
defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from shared.compression import Reconstruction
from shared.pipeline_config import Mode, PipelineConfig
from shared.protocol import CorrectionMode

DEFAULT_TARGET = "default"
DEFAULT_DRAFT = "self:skip=12"
DEMO_PROMPT = "Explain in two sentences why the sky is blue."


def _positive_int(name: str, hi: int) -> Any:
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {v!r}") from None
        if not 1 <= n <= hi:
            raise argparse.ArgumentTypeError(f"{name} must be in 1..{hi}, got {n}")
        return n

    return parse


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("drafting and sampling")
    g.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model spec (default %(default)s)")
    g.add_argument(
        "--draft-base",
        default=DEFAULT_TARGET,
        help="model whose weights a self:... draft shares (default %(default)s)",
    )
    g.add_argument("--gamma", type=_positive_int("--gamma", 64), default=4, help="draft length γ")
    g.add_argument(
        "--depth", type=_positive_int("--depth", 127), default=2, help="in-flight batches D"
    )
    g.add_argument("--mode", choices=Mode.choices(), default=Mode.PIPELINED.value)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument(
        "--correction",
        choices=CorrectionMode.choices(),
        default=CorrectionMode.CANDIDATES.value,
        help="how a rejection is corrected at T > 0: candidates (exact, default), "
        "greedy_draft (exact, ids only), topk (PicoSpec, lossy)",
    )
    g.add_argument("--max-tokens", type=_positive_int("--max-tokens", 1 << 20), default=128)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--json", action="store_true", help="last stdout line: one JSON summary")


def _add_link_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("verifier link")
    g.add_argument(
        "--verifier",
        default=os.environ.get("WANSPEC_VERIFIER", "ws://127.0.0.1:8700/v1/session"),
        help="verifier WebSocket URL (env WANSPEC_VERIFIER); several, comma-separated, for "
        "federated verification (SpecFed)",
    )
    g.add_argument("--weights", default="", help="federation: weight per verifier, e.g. 0.5,0.5")
    g.add_argument("--k", default="64", help="federation: top-k size (one, or one per verifier)")
    g.add_argument(
        "--reconstruction",
        choices=Reconstruction.choices(),
        default=Reconstruction.RENORMALISED.value,
        help="federation: A renormalised top-K, B residual redistributed",
    )
    g.add_argument(
        "--token-file",
        default=os.environ.get("WANSPEC_TOKEN_FILE"),
        help="file holding the bearer token (env WANSPEC_TOKEN_FILE)",
    )
    g.add_argument("--ca-file", default=None, help="CA bundle to verify a wss:// verifier")
    g.add_argument(
        "--insecure-skip-verify", action="store_true", help="do not verify the TLS certificate"
    )


_SETTINGS_HELP: dict[str, str] = {
    "verifier": "verifier WebSocket URL; several, comma-separated: federated verification "
    "(SpecFed), or fail-over in order with --failover",
    "failover": "several verifiers are fail-over targets instead of a federation",
    "weights": "federation: comma-separated positive weight per verifier (default equal)",
    "k": "federation: top-k size of each verifier's distributions (one, or one per verifier)",
    "eps_target": "federation: adaptive K, smallest K whose kept mass is >= 1 - eps (k caps it)",
    "reconstruction": "federation: A (renormalised top-K) or B (residual redistributed)",
    "round_deadline": "federation: seconds to wait for a slow worker before leaving it out",
    "token_file": "file holding the verifier's bearer token",
    "ca_file": "CA bundle to verify a wss:// verifier",
    "insecure_skip_verify": "do not verify the verifier's TLS certificate",
    "heartbeat": "WebSocket ping interval to the verifier, seconds",
    "retry_attempts": "failed verifier sessions per request before giving up",
    "probe_interval": "seconds between probes of the verifier's /health",
    "fallback": "no verifier reachable: none (HTTP 503) or draft (unverified draft-only text)",
    "draft": "draft model spec (self:skip=..., a folder, a .gguf, a cached hub id)",
    "draft_base": "model whose weights a self:... draft shares",
    "device": "where the draft runs",
    "dtype": "draft weights' dtype (auto: float16 on cuda, float32 on the CPU)",
    "threads": "torch CPU threads",
    "gamma": "draft length γ",
    "depth": "batches in flight D",
    "mode": "pipelined or stop-and-wait",
    "correction": "how a rejection is corrected at T > 0",
    "temperature": "default temperature (0 = greedy)",
    "top_p": "default top-p",
    "top_k": "default top-k (0 = off)",
    "max_tokens": "default completion length",
    "seed": "default seed",
    "host": "address the API listens on (loopback by default)",
    "port": "TCP port of the API",
    "api_key_file": "file holding the API key clients must send as a Bearer token",
    "model_id": "model id the API offers",
    "max_queue": "requests allowed to wait before 429",
    "max_body": "largest request body, bytes",
    "log_level": "logging level",
}


def _add_settings_args(p: argparse.ArgumentParser) -> None:
    """``--config`` and one flag per EdgeSettings field (None = not given)."""
    from edge_agent.config import CONFIG_ENV, ENV_PREFIX, EdgeSettings, default_config_path

    p.add_argument(
        "--config",
        default=None,
        help=f"TOML settings file (env {CONFIG_ENV}; default {default_config_path()} if present)",
    )
    hints = typing.get_type_hints(EdgeSettings)
    g = p.add_argument_group("settings (also WANSPEC_EDGE_<NAME> or the TOML file)")
    for f in dataclasses.fields(EdgeSettings):
        flag = "--" + f.name.replace("_", "-")
        text = f"{_SETTINGS_HELP.get(f.name, '')} (default {f.default}; env {ENV_PREFIX}"
        text += f"{f.name.upper()})"
        tp = hints[f.name]
        if tp is bool:
            g.add_argument(flag, action="store_true", default=None, help=text)
            continue
        choices = typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None
        g.add_argument(flag, default=None, choices=choices, help=text)


def load_cli_settings(args: argparse.Namespace, env: dict[str, str] | None = None) -> Any:
    from edge_agent.config import EdgeSettings, load_edge_settings

    cli = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(EdgeSettings)}
    return load_edge_settings(config=args.config, env=env, cli=cli)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-agent",
        description="wanspec edge agent: drafts locally, verified in the cloud over a WAN.",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for PROMPT against a verifier")
    gen.add_argument("prompt")
    _add_generation_args(gen)
    _add_link_args(gen)
    demo = sub.add_parser(
        "demo", help="start a local verifier with the default target and generate against it"
    )
    demo.add_argument("prompt", nargs="?", default=DEMO_PROMPT)
    _add_generation_args(demo)
    demo.add_argument("--target", default=DEFAULT_TARGET, help="verifier model spec")
    demo.set_defaults(chat=True)
    serve = sub.add_parser(
        "serve",
        help="run the local OpenAI-compatible API (/v1/chat/completions, /v1/completions, ...)",
    )
    _add_settings_args(serve)
    chat = sub.add_parser(
        "chat",
        help="interactive chat; uses a running `edge-agent serve`, else runs the agent here",
    )
    _add_settings_args(chat)
    return parser


def _pipeline_config(args: argparse.Namespace) -> PipelineConfig:
    from shared.sampling import SamplingParams

    return PipelineConfig(
        gamma=args.gamma,
        depth=args.depth,
        mode=Mode.parse(args.mode, "--mode"),
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p),
        correction=CorrectionMode.parse(args.correction, "--correction"),
        # ``demo`` has no --reconstruction flag (one verifier: no federation).
        reconstruction=Reconstruction.parse(
            getattr(args, "reconstruction", Reconstruction.RENORMALISED), "--reconstruction"
        ),
    )


def _write(s: str) -> None:
    sys.stdout.write(s)
    sys.stdout.flush()


def _summary(r: dict[str, Any]) -> str:
    acc = r["acceptance_rate"]
    return (
        f"{r['tokens']} tokens in {r['wall_s']:.2f} s ({r['tokens_per_s']} tok/s) · "
        f"{r['mode']} γ={r['gamma']} D={r['depth']} · acceptance "
        f"{'n/a' if acc is None else f'{acc:.0%}'}, {r['mean_accepted_per_round']} accepted/round"
        f" over {r['rounds']} rounds · {r['rejections']} rejections, "
        f"{r['discarded_batches']} discarded batches · up {r['uplink_bytes']} B "
        f"({r['uplink_bytes_per_round']} B/round), down {r['downlink_bytes']} B "
        f"({r['downlink_bytes_per_rejection']} B/rejection)"
    )


async def _generate(args: argparse.Namespace, url: str, token: str) -> dict[str, Any]:
    from edge_agent.generate import (
        RunSettings,
        build_agent,
        encode_prompt,
        load_draft,
        run_generation,
        ssl_context,
    )

    settings = RunSettings(
        verifier_url=url,
        token=token,
        pipeline=_pipeline_config(args),
        max_new_tokens=args.max_tokens,
        seed=args.seed,
        ssl=ssl_context(
            getattr(args, "ca_file", None), getattr(args, "insecure_skip_verify", False)
        ),
    )
    loaded = await asyncio.to_thread(load_draft, args.draft, args.draft_base)
    prompt_ids = encode_prompt(loaded, args.prompt, chat=args.chat)
    agent = build_agent(loaded, settings)
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if len(urls) > 1:
        agent.federation = _workers(args, urls, token, settings.ssl)
    try:
        return await run_generation(agent, loaded, prompt_ids, settings, _write)
    finally:
        agent.close()


def _workers(args: argparse.Namespace, urls: list[str], token: str, ssl: Any) -> list[Any]:
    """SpecFed mode for ``generate``: one worker per URL (same token, weights and k from flags)."""
    from edge_agent.config import EdgeSettings
    from edge_agent.federation import WorkerSpec
    from edge_agent.link import LinkSettings, WebSocketTransport
    from edge_agent.transport import Transport

    checked = EdgeSettings(verifier=",".join(urls), weights=args.weights, k=args.k)
    out = []
    for u, w, k in zip(urls, checked.verifier_weights, checked.verifier_k, strict=True):
        link = LinkSettings(url=u, token=token, ssl=ssl)

        async def connect(link: LinkSettings = link) -> Transport:
            return await WebSocketTransport.connect(link)

        out.append(WorkerSpec(u, connect, weight=w, k=k))
    return out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    url = f"http://127.0.0.1:{port}/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the local verifier exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the local verifier was not ready within {timeout_s:.0f} s")


def _demo(args: argparse.Namespace) -> int:
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="wanspec-demo-") as tmp:
        token_file = Path(tmp) / "token"
        token = secrets.token_urlsafe(24)
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
        env = dict(os.environ)
        # Two processes share this machine's cores: one torch thread each.
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no progress bars in the demo
        env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        _quiet_transformers()
        cmd = [
            sys.executable,
            "-c",
            "import sys; from cloud_verifier.cli import main; sys.exit(main())",
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
        ]
        print(
            f"[demo] starting a local verifier ({args.target}) on 127.0.0.1:{port} …",
            file=sys.stderr,
        )
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
        try:
            _wait_healthy(proc, port, timeout_s=600)
            print(f"[demo] verifier ready; drafting with {args.draft}\n", file=sys.stderr)
            if args.threads is None:
                args.threads = 1
            _set_threads(args.threads)
            result = asyncio.run(_generate(args, f"ws://127.0.0.1:{port}/v1/session", token))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    _finish(args, result)
    return 0


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    from edge_agent.progress import quiet_hub_progress

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    quiet_hub_progress()


def _set_threads(n: int | None) -> None:
    if n is not None:
        import torch

        torch.set_num_threads(max(1, n))


def _finish(args: argparse.Namespace, result: dict[str, Any]) -> None:
    sys.stdout.write("\n")
    print(f"[stats] {_summary(result)}", file=sys.stderr)
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from edge_agent.agent import HandshakeError
    from edge_agent.link import AuthError
    from edge_agent.transport import LinkClosed
    from shared.model_spec import ModelSpecError

    if args.command in ("serve", "chat"):
        return _daemon_command(args)
    try:
        if args.command == "demo":
            return _demo(args)
        if not args.token_file:
            raise ValueError("--token-file (or WANSPEC_TOKEN_FILE) is required")
        from edge_agent.config import read_secret_file

        token = read_secret_file(Path(args.token_file), "token_file")
        _set_threads(args.threads)
        result = asyncio.run(_generate(args, args.verifier, token))
        _finish(args, result)
        return 0
    except (HandshakeError, AuthError, LinkClosed, ModelSpecError, ValueError, RuntimeError) as e:
        print(f"edge-agent: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _daemon_command(args: argparse.Namespace) -> int:
    from shared.config import ConfigError
    from shared.model_spec import ModelSpecError

    try:
        settings = load_cli_settings(args)
    except ConfigError as e:
        print(f"edge-agent: error: {e}", file=sys.stderr)
        return 2
    level = logging.DEBUG if args.verbose else getattr(logging, settings.log_level.upper())
    logging.getLogger().setLevel(level if args.command == "serve" else max(level, logging.WARNING))
    _set_threads(settings.threads)
    try:
        if args.command == "serve":
            from edge_agent.server import serve

            return asyncio.run(serve(settings))
        from edge_agent.chat import run_chat

        return run_chat(settings)
    except (ConfigError, ModelSpecError) as e:
        print(f"edge-agent: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
