"""What the reliability, fuzz and load runs share: tiny models, random prompts and their
target-only greedy references, a real ``cloud-verifier serve`` process (start, SIGKILL, SIGTERM,
restart on the same port, its memory), that process behind the WAN emulator, an edge agent
pointed at a URL, and a run's command line, working folder and JSON report.

Everything listens on 127.0.0.1 only. Memory figures come from ``/proc/<pid>/status`` (Linux).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from ssl import SSLContext
from typing import Any, TypeVar

import aiohttp
import torch

from edge_agent.link.connection import LinkSettings, WebSocketTransport
from edge_agent.model.drafter import Drafter
from edge_agent.model.lm import CausalLM
from edge_agent.model.tasks import ModelWorker
from edge_agent.runtime.agent import EdgeAgent, RetryPolicy
from edge_agent.session.transport import Transport
from shared.runtime.models import LoadedModel, load_model
from testkit.net.wanem import LinkConfig, WanEmulator
from testkit.provenance import provenance
from testkit.tiny_models import build_tiny_model

REPO = Path(__file__).resolve().parent.parent
VOCAB = 64  # tiny models: word-level tokenizer of 64 ids; 0..3 are specials (2 = EOS)

R = TypeVar("R")
C = TypeVar("C")


def config_from_args(cls: type[C], args: argparse.Namespace) -> C:
    """A run's config (a dataclass): the fields the command line names (an option of the
    field's name), the others at their defaults."""
    given = vars(args)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]  # C: a dataclass
    return cls(**{name: given[name] for name in names if name in given})


def config_parser(
    prog: str, doc: str, cls: type[Any], *options: str | tuple[str, str]
) -> argparse.ArgumentParser:
    """A run's command line: ``--NAME`` for each named field of its config dataclass ``cls``
    (``(name, help)`` to explain one), of the type of the field's default (an int, float or
    str) and that default; ``--out`` (the JSON report) and ``--workdir``
    (:func:`run_in_workdir`). :func:`config_from_args` reads the fields back."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    defaults = cls()
    for option in options:
        name, explained = (option, None) if isinstance(option, str) else option
        default = getattr(defaults, name)
        assert isinstance(default, (int, float, str)) and not isinstance(default, bool), name
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=type(default), default=default, help=explained)
    p.add_argument("--out", type=Path, help="write the JSON report here")
    p.add_argument("--workdir", type=Path, help="keep the models and the verifier's log here")
    return p


def run_command(
    cls: type[C],
    args: argparse.Namespace,
    prefix: str,
    run: Callable[[C, Path], Coroutine[Any, Any, R]],
    summary: Callable[[R], str],
) -> tuple[C, R]:
    """A run as its command line (:func:`config_parser`) asks: its config, ``run`` in its working
    folder (:func:`run_in_workdir`), the report's summary printed and the report written to
    ``--out`` if given. Returns the config and the report."""
    cfg = config_from_args(cls, args)
    report = run_in_workdir(prefix, args.workdir, lambda folder: run(cfg, folder))
    print(summary(report))
    if args.out:
        write_json(args.out, report)
    return cfg, report


def run_in_workdir(
    prefix: str, workdir: Path | None, main: Callable[[Path], Coroutine[Any, Any, R]]
) -> R:
    """``asyncio.run(main(folder))``, where ``folder`` is ``workdir`` (made if missing, and kept:
    models and logs stay there to be read) or else a temporary folder named ``prefix...``,
    removed after."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        folder = workdir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        return asyncio.run(main(folder))


def record_run(
    prefix: str,
    workdir: Path | None,
    main: Callable[[Path], Coroutine[Any, Any, dict[str, Any]]],
    out: Path,
    plot: Callable[[Path, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """A study's run (:func:`run_in_workdir`) recorded: its result with its provenance
    (:func:`testkit.provenance.provenance`) written to ``out``, and drawn by ``plot`` (if
    given) next to it (``out`` with ``.png``). Returns the result."""
    result = run_in_workdir(prefix, workdir, main)
    result["provenance"] = provenance()
    write_json(out, result, indent=1)
    if plot is not None:
        plot(out.with_suffix(".png"), result)
    return result


def record_study(
    prefix: str,
    args: argparse.Namespace,
    cfg: C,
    run: Callable[[C, Path, Callable[[str], None]], Coroutine[Any, Any, dict[str, Any]]],
    out: Path,
    plot: Callable[[Path, dict[str, Any]], None],
) -> dict[str, Any]:
    """A study's ``main``: ``run(cfg, folder, log)`` recorded (:func:`record_run`) in
    ``args.workdir``, logging to stdout, drawn by ``plot`` unless ``args.no_plot``."""
    return record_run(
        prefix,
        args.workdir,
        lambda wd: run(cfg, wd, lambda s: print(s, flush=True)),
        out,
        None if args.no_plot else plot,
    )


def write_json(path: Path, doc: Any, *, indent: int = 2) -> None:
    """``doc`` as JSON at ``path`` (its folder made if missing); a dataclass as its fields."""
    path.parent.mkdir(parents=True, exist_ok=True)
    is_record = dataclasses.is_dataclass(doc) and not isinstance(doc, type)
    data = dataclasses.asdict(doc) if is_record else doc
    path.write_text(json.dumps(data, indent=indent) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class TinyPair:
    target_dir: Path
    draft_dir: Path
    target: LoadedModel
    draft: LoadedModel


def tiny_pair(folder: Path) -> TinyPair:
    """The tests' pair: a 2-layer random Llama target (seed 0) and draft (seed 1), vocab 64."""
    t = build_tiny_model(folder / "target", vocab_size=VOCAB, seed=0)
    d = build_tiny_model(folder / "draft", vocab_size=VOCAB, seed=1)
    return TinyPair(t, d, load_model(str(t)), load_model(str(d)))


def random_prompt(rng: random.Random, max_words: int) -> list[int]:
    """BOS (1), then 2 to ``max_words`` random word ids (never a special, 0..3)."""
    return [1] + [rng.randrange(4, VOCAB) for _ in range(rng.randint(2, max_words))]


def greedy_cases(
    target: LoadedModel, rng: random.Random, n: int, max_words: int, new_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """``n`` (prompt, reference): a :func:`random_prompt` and its ``new_tokens`` of
    :func:`target_greedy` (what an exact speculative decoding at T = 0 must generate)."""
    prompts = [random_prompt(rng, max_words) for _ in range(n)]
    return [(p, target_greedy(target, p, new_tokens)) for p in prompts]


def target_greedy(target: LoadedModel, prompt: Sequence[int], n: int) -> list[int]:
    """Target-only greedy decoding, one token per forward (the reference text at T = 0).
    Runs past an end-of-sequence id: callers generate with no EOS ids."""
    lm = CausalLM(target)
    with torch.inference_mode():
        logits = lm.extend(list(prompt))[-1]
        out: list[int] = []
        for _ in range(n):
            t = int(torch.argmax(logits))
            out.append(t)
            logits = lm.extend([t])[0]
    return out


def write_tokens(path: Path, tokens: Sequence[str]) -> Path:
    path.write_text("# bench tokens\n" + "".join(f"{t}\n" for t in tokens))
    path.chmod(0o600)  # a secret (a looser mode is warned about)
    return path


def rss_kib(pid: int) -> tuple[int, int]:
    """(current RSS, peak RSS) of ``pid`` in KiB, from /proc (VmRSS, VmHWM)."""
    cur = peak = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1])
    return cur, peak


class VerifierProcess:
    """``cloud-verifier serve`` as a child process on a fixed port, restartable."""

    def __init__(
        self,
        model: str,
        port: int,
        token_file: Path,
        *,
        args: Sequence[str] = (),
        log_path: Path | None = None,
        scheme: str = "http",
        threads: int = 1,
        command: Sequence[str] = ("-m", "cloud_verifier.daemon.cli", "serve"),
    ) -> None:
        """``command``: what runs the service after the interpreter (``-m bench.net.verifier``:
        ``serve`` with padded forwards)."""
        self.command = list(command)
        self.model = model
        self.threads = threads
        self.port = port
        self.token_file = token_file
        self.args = list(args)
        self.log_path = log_path
        self.scheme = scheme
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        ws = "wss" if self.scheme == "https" else "ws"
        return f"{ws}://127.0.0.1:{self.port}/v1/session"

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("verifier already running")
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), HF_HUB_OFFLINE="1")
        env.pop("WANSPEC_CONFIG", None)
        cmd = [
            sys.executable,
            *self.command,
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--token-file",
            str(self.token_file),
            *self.args,
        ]
        out = (
            open(self.log_path, "ab")  # noqa: SIM115  # closed in stop()
            if self.log_path is not None
            else subprocess.DEVNULL
        )
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        if self.log_path is not None:
            out.close()  # type: ignore[union-attr]  # the child holds its own descriptor
        self.starts += 1

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("verifier not started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def wait_ready(self, timeout: float = 120.0) -> float:
        """Poll /health until 200; returns the seconds waited. Raises if the process exits."""
        t0 = time.monotonic()
        url = f"{self.scheme}://127.0.0.1:{self.port}/health"
        async with aiohttp.ClientSession() as http:
            while time.monotonic() - t0 < timeout:
                if not self.alive():
                    rc = self.proc.returncode if self.proc is not None else None
                    raise RuntimeError(f"verifier exited with {rc} (log: {self.log_path})")
                with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    async with http.get(
                        url, ssl=False, timeout=aiohttp.ClientTimeout(total=2)
                    ) as r:
                        if r.status == 200:
                            return time.monotonic() - t0
                await asyncio.sleep(0.05)
        raise RuntimeError(f"verifier not ready within {timeout:.0f} s")

    async def kill(self) -> None:
        """SIGKILL and reap: the process state is simply gone, like a crashed host."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            await self._reap(30.0)

    async def terminate(self, timeout: float) -> tuple[int | None, float]:
        """SIGTERM; returns (exit status or None if it did not exit in ``timeout``, seconds)."""
        if self.proc is None or self.proc.poll() is not None:
            return (self.proc.returncode if self.proc else None), 0.0
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        rc = await self._reap(timeout)
        dt = time.monotonic() - t0
        if rc is None:
            await self.kill()
        return rc, dt

    async def _reap(self, timeout: float) -> int | None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                return rc
            await asyncio.sleep(0.02)
        return None

    def rss_kib(self) -> tuple[int, int]:
        return rss_kib(self.pid)

    async def stop(self) -> None:
        if self.alive():
            rc, _ = await self.terminate(15.0)
            if rc is None:
                await self.kill()


def make_agent(
    draft: LoadedModel,
    url: str,
    token: str,
    *,
    heartbeat_s: float = 0.0,
    retry: RetryPolicy | None = None,
    worker: ModelWorker | None = None,
    ssl: bool | SSLContext = False,
) -> EdgeAgent:
    """An edge agent whose every session is a fresh WebSocket to ``url``."""
    link = LinkSettings(url=url, token=token, heartbeat_s=heartbeat_s, ssl=ssl)

    async def connect() -> Transport:
        return await WebSocketTransport.connect(link)

    return EdgeAgent(Drafter(draft), draft.fingerprint, connect, retry=retry, worker=worker)


@dataclass(frozen=True)
class WanRig:
    """The tiny pair's target served by a verifier process, behind the WAN emulator."""

    pair: TinyPair
    verifier: VerifierProcess
    emu: WanEmulator

    @property
    def url(self) -> str:
        """The session endpoint through the emulator (what the edge connects to)."""
        return f"ws://127.0.0.1:{self.emu.port}/v1/session"

    def agent(
        self,
        token: str,
        *,
        heartbeat_s: float = 0.0,
        retry: RetryPolicy | None = None,
        worker: ModelWorker | None = None,
    ) -> EdgeAgent:
        """An edge agent of the pair's draft whose sessions go through the emulator
        (:func:`make_agent`)."""
        return make_agent(
            self.pair.draft, self.url, token, heartbeat_s=heartbeat_s, retry=retry, worker=worker
        )


@contextlib.asynccontextmanager
async def wan_rig(
    workdir: Path, tokens: Sequence[str], args: Sequence[str], link: LinkConfig
) -> AsyncIterator[WanRig]:
    """:func:`tiny_pair` in ``workdir/models``; its target served by a :class:`VerifierProcess`
    (bearer ``tokens``, options ``args``, its log ``workdir/verifier.log``) on a free port; a
    :class:`~testkit.net.wanem.WanEmulator` of ``link`` in front once it is ready. Both are stopped
    on leaving (the verifier after the emulator)."""
    pair = tiny_pair(workdir / "models")
    verifier = VerifierProcess(
        str(pair.target_dir),
        free_port(),
        write_tokens(workdir / "tokens", tokens),
        args=args,
        log_path=workdir / "verifier.log",
    )
    verifier.start()
    emu: WanEmulator | None = None
    try:
        await verifier.wait_ready()
        emu = WanEmulator(upstream=("127.0.0.1", verifier.port), link=link)
        await emu.start()
        yield WanRig(pair, verifier, emu)
    finally:
        if emu is not None:
            await emu.stop()
        await verifier.stop()
