"""The real-time benchmark: wanspec against its baselines, in the same run, over an emulated WAN,
on the link a user has. It validates the simulation (:mod:`bench.lib.sim`,
:mod:`bench.studies.grid`) on a small set: the published grid is the simulation's.

    python -m bench realtime                            # docs/results/bench/real/ (see Budget)
    python -m bench realtime --smoke --out /tmp/smoke   # tiny models, 2 RTTs, a few tokens (CI)

Processes: the verifier (``python -m bench.net.verifier``: ``cloud-verifier serve`` with padded
forwards) and the cloud-only autoregressive baseline (``python -m bench.net.ar_server``) each run in
their own process on the same target model; the edge (drafts, pipeline) runs here, and so do
the WAN emulators (:mod:`testkit.net.wanem`), one in front of each cloud process, so every mode
crosses the same emulated link.

Warm links, as a user has them. The edge reaches each verifier through one
:class:`~edge_agent.link.warm.WarmLink` (what the daemon does: a session is a stream on a
connection kept open), opened before the first measured run and kept across runs; ``ar`` uses
one kept-alive WebSocket (:class:`bench.net.ar_server.ArClient`). No run pays TCP or the WebSocket
upgrade. What a speculative run still pays: its session's Hello, sent with its first Propose,
one round trip and the prefill before the first verdict, and its Close. What an ``ar`` run
pays: its request's way up, the prefill step, each token's way down. A link the verifier
dropped between runs is reopened by the link's keeper; each run records ``reconnects``.

Prompts (:mod:`bench.lib.prompts`): the measured split, ``--prompts N`` per dataset of
``--datasets``. Replies (``--tokens``, a comma list, default 32,256): each prompt runs at each
length. Every run records ``ttft_s`` (request sent to the first committed token at the edge),
``tokens_per_s`` (the whole reply: request sent to its last token) and ``decode_tokens_per_s``
(first committed token to last), all in emulated time.

Drafts (``--drafts``, comma-separated): a real draft model (``self:skip=12``, a path, ...) or an
oracle ``oracle:alpha=A`` (:mod:`bench.lib.oracle`: the target's own greedy token with probability
A, no compute), each padded to the regime's draft time. Modes (``--modes`` for model drafts,
``--oracle-modes`` for oracles), per draft, RTT and prompt:

* ``ar``: the target generates alone and streams each token to the edge (once per RTT and prompt,
  whatever the drafts: the baseline of every draft at that RTT; its rows have draft None);
* ``saw:G`` (``stop-and-wait``, or ``stop-and-wait γ=G``): classic speculative decoding, send G
  drafts, wait for the verdict (with its bonus token), repeat; no co-generation;
* ``pipe:GxD`` (``pipelined γ=G D=D``): wanspec, up to D batches of G in flight, with
  co-generation (the verifier decodes on its own while no valid draft is queued);
  ``pipe:GxD:nocogen`` (``... no-cogen``) without it;
* ``auto``: adaptive γ and D (``PipelineConfig(auto_gamma, auto_depth, gamma=4, depth=4)``);
  ``auto:predraft`` (``auto predraft``) with outcome pre-drafting (``PipelineConfig.predraft``:
  up to 8 branches prepared while the pipeline is full; its rows add ``predraft_hit_rate``,
  the rejections answered from a prepared branch, and ``gap_per_rejection_ms``, from a
  rejection's verdict at the edge to the next batch sent, in emulated ms); ``auto:tree``
  (``auto tree``) sends the branches to the verifier too (token trees, ``PipelineConfig.tree``:
  a batch is verified with the branches forking inside it in one forward, each tree token
  padded at :data:`bench.lib.costs.TREE_TOKEN_COST` of a verify; ``tree_open_rate``, the
  rejections whose recovered token opened a branch there);
* ``cloud-sd``: cloud-only speculative decoding, what a user would pick instead: no draft on
  the edge (credits only), a second verifier process of the regime that drafts for itself
  (``cloud_draft = tail,ngram`` and ``cloud_draft_model = --cloud-model``, ``--cloud-draft-tokens``
  a step, each draft step padded to ``--cloud-draft-ms-per-token``, by default verify ×
  :data:`bench.lib.costs.CLOUD_DRAFT_PER_VERIFY`, 2.7/24.6 from the H200 measurement in
  docs/results/gpu_costs.json; ``python -m bench gpu`` repeats it); ``cloud-sd:ngram``: a
  third, prompt lookup only;
* ``hybrid``: ``auto`` against the ``cloud-sd`` verifier (edge drafts, cloud drafts in the gaps);
  ``hybrid:predraft``, ``hybrid:tree`` as for ``auto``;
* ``assisted``: transformers' ``generate(assistant_model=...)`` with each model draft, one
  process, RTT 0 (raw regime only: its internals cannot be padded).

Device regimes (``--regimes``): ``picospec`` (default: each draft step, verify and
autoregressive step padded to PicoSpec's Llama 1B/70B timings, 24/166/146 ms, with real models
and real acceptance) and ``raw`` (these CPUs as they are). Padding can only lengthen a step, and
these CPUs are slower than a Jetson at drafting, so the emulated regime is run *time-dilated*:
every duration — pads, RTT, and the link's serialisation time (bandwidth / S) — is multiplied by
the same factor S, chosen so that real compute fits inside every pad; throughput is reported in
emulated time (measured tokens/s × S). A model draft needs S = ``--time-scale`` (4: about 61 ms
of CPU per draft token must fit in 24·S); an oracle computes nothing and runs at
S = ``--oracle-time-scale`` (1.5). The verifier's pad is fixed when it starts, so the cloud
processes are started once per (regime, S) group; ``ar`` runs in the group of the smallest S
(the cheapest: its emulated tokens/s does not depend on S while compute fits the pads).

Budget. The real draft runs at 6–15 emulated tokens/s at S = 4, i.e. 0.25–0.65 s of wall time
per token on this 2-core machine; a cell (one mode and RTT) of 8 datasets × 1 prompt × (32 +
256) tokens takes 10–20 minutes. The defaults (the real draft, ``auto``, ``auto:predraft``,
``hybrid:predraft``, ``cloud-sd`` and ``ar`` at RTTs 0, 100, 200, one prompt per dataset) are the
simulation's validation set; the estimate printed at the start of every run says how long.
``--draft-batch-cost`` prices the edge's batched branch step (default the GPU class,
:data:`bench.lib.costs.DRAFT_BATCH_COST`; 0.20 is this CPU's, docs/results/draft_batch.json).

Analytical ceiling (:func:`ceiling`, docs/benchmarks/index.md): with t_d the time per draft token,
T_v the verify time, R the RTT, γ, D, n̄ the measured tokens the verdicts commit per round and r
the measured fraction of rounds ending in a rejection, stop-and-wait needs γ t_d + R + T_v per
round; pipelined rounds arrive every max(γ t_d, (R + T_v)/D, T_v) while batches are accepted in
full, and after a rejection the pipeline refills in γ t_d + R + T_v. With co-generation the
verifier decodes (γ t_d + R)/T_v tokens of its own during a refill (see :func:`ceiling`). The
model covers stop-and-wait, pipelined and ``auto`` rounds on the plain verifier; a mode outside
it has no ceiling (None): outcome pre-drafting, token trees and hedges answer a rejection
without the γ t_d of a fresh refill, and a verifier that drafts for itself (``hybrid``,
``cloud-sd``) commits tokens no edge round accounts for (the committed run's ``hybrid
predraft`` reached 1.26 of the model, ``auto predraft`` 1.10).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.lib.cli import study_parser
from bench.lib.costs import CLOUD_DRAFT_PER_VERIFY, DRAFT_BATCH_COST
from bench.lib.edge import TimedDrafter, load_draft_model, open_warm, run_spec
from bench.lib.modes import CloudSide, ModeSpec, parse_modes
from bench.lib.oracle import GreedyPaths, OracleDrafter, is_oracle, parse_oracle
from bench.lib.prompts import DATASETS, Prompt, Split, encode, load_prompts
from bench.net.ar_server import ArClient
from bench.net.verifier import serving, verifier_command
from edge_agent.link.connection import LinkSettings
from edge_agent.link.warm import WarmLink
from edge_agent.model.drafter import Drafter, DraftModel
from edge_agent.runtime.agent import EdgeAgent, RetryPolicy
from edge_agent.runtime.text import eos_ids
from edge_agent.session.pipeline_config import Mode
from shared.runtime.models import LoadedModel, load_model
from shared.service.status import wait_healthy
from shared.wire.messages import Fingerprint
from testkit.harness import free_port, write_tokens
from testkit.net.wanem import LinkConfig, WanEmulator
from testkit.provenance import machine_info
from testkit.tiny_models import build_tiny_model

DEFAULT_OUT = Path("docs/results/bench/real")
DEFAULT_DRAFTS = "self:skip=12"
DEFAULT_MODES = "auto,auto:predraft,hybrid:predraft,cloud-sd"
DEFAULT_ORACLE_MODES = "auto:predraft"
DEFAULT_RTTS = "0,100,200"
DEFAULT_ORACLE_RTTS = "0,100,200"
DEFAULT_TOKENS = "32,256"
ASSISTED_GAMMA = 4


# ------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class Regime:
    name: str
    draft_ms: float = 0.0  # per draft token (emulated); 0 = no padding
    verify_ms: float = 0.0  # per verify (emulated)
    ar_ms: float = 0.0  # per autoregressive token (emulated)
    scale: float = 1.0  # time dilation S (model drafts, and the group being run)
    oracle_scale: float | None = None  # S of oracle drafts (None: ``scale``)
    #: Per draft token of the verifier's own draft model (emulated; cloud-sd, hybrid).
    cloud_draft_ms: float = 0.0

    @property
    def emulated(self) -> bool:
        return self.draft_ms > 0 or self.verify_ms > 0 or self.ar_ms > 0

    def scale_for(self, draft: str) -> float:
        if is_oracle(draft) and self.oracle_scale is not None:
            return self.oracle_scale
        return self.scale


@dataclass(frozen=True)
class BenchConfig:
    out: Path
    target: str = "default"
    drafts: tuple[str, ...] = ("self:skip=12",)
    modes: tuple[str, ...] = tuple(DEFAULT_MODES.split(","))
    oracle_modes: tuple[str, ...] = tuple(DEFAULT_ORACLE_MODES.split(","))
    rtts_ms: tuple[float, ...] = (0, 100, 200, 300)
    oracle_rtts_ms: tuple[float, ...] = (0, 100, 300)
    bandwidth_mbit: float = 10.0
    #: Reply lengths: each prompt runs at each.
    tokens: tuple[int, ...] = (32, 256)
    prompts_per_dataset: int = 1
    datasets: tuple[str, ...] = DATASETS
    regimes: tuple[Regime, ...] = ()
    assisted: bool = True
    smoke: bool = False
    seed: int = 0
    #: The verifier's own draft model in the cloud-sd and hybrid modes, and its draft length.
    cloud_model: str = "self:skip=12"
    cloud_draft_tokens: int = 4
    #: The edge's batched draft step of B rows costs draft · (1 + b · (B − 1)).
    draft_batch_cost: float = DRAFT_BATCH_COST

    def modes_for(self, draft: str) -> tuple[ModeSpec, ...]:
        return parse_modes(",".join(self.oracle_modes if is_oracle(draft) else self.modes))

    def rtts_for(self, draft: str) -> tuple[float, ...]:
        return self.oracle_rtts_ms if is_oracle(draft) else self.rtts_ms

    @property
    def all_rtts(self) -> tuple[float, ...]:
        return tuple(sorted({r for d in self.drafts for r in self.rtts_for(d)}))


# ------------------------------------------------------------------------------ prompts


def prompt_index(prompt: Prompt) -> int:
    """The prompt's index in its dataset (its name is ``dataset/index``)."""
    return int(prompt.name.rsplit("/", 1)[1])


def bench_prompts(cfg: BenchConfig) -> list[Prompt]:
    """The measured split's first ``prompts_per_dataset`` of each of ``cfg.datasets``."""
    prompts = load_prompts(Split.MEASURED, per_dataset=cfg.prompts_per_dataset, smoke=cfg.smoke)
    return [p for p in prompts if p.dataset in cfg.datasets]


# ------------------------------------------------------------------------------ processes


@contextlib.contextmanager
def cloud_processes(
    cfg: BenchConfig, token_file: Path, regime: Regime, sides: set[CloudSide]
) -> Iterator[tuple[dict[CloudSide, int], int]]:
    """The verifiers (one per ``sides``, :class:`CloudSide`) and the autoregressive service,
    each in its own single-threaded process, padded for ``regime`` at its time scale
    ``regime.scale``. Yields the verifiers' ports and the autoregressive service's."""
    s = regime.scale
    ports = {side: free_port() for side in sorted(sides | {CloudSide.PLAIN})}
    aport = free_port()

    def verifier(side: CloudSide, port: int) -> list[str]:
        args = [
            "--emulate-verify-ms", str(regime.verify_ms * s),
            # a co-generation step is one autoregressive step: padded like the AR baseline's
            "--emulate-decode-ms", str(regime.ar_ms * s),
            "--cloud-draft-tokens", str(cfg.cloud_draft_tokens),
            # a few sessions at a time: a small pool (the CPU default, 65536 tokens, is GBs)
            "--kv-cache-tokens", "16384",
        ]  # fmt: skip
        if side == CloudSide.NGRAM:
            args += ["--cloud-draft", "ngram"]
        elif side == CloudSide.SPEC:
            args += [
                "--cloud-draft", "tail,ngram", "--cloud-draft-model", cfg.cloud_model,
                "--emulate-cloud-draft-ms", str(regime.cloud_draft_ms * s),
            ]  # fmt: skip
        return verifier_command(cfg.target, port, token_file, args)

    ar = [
        sys.executable, "-m", "bench.net.ar_server", "--model", cfg.target, "--port", str(aport),
        "--token-file", str(token_file), "--pad-ms", str(regime.ar_ms * s),
    ]  # fmt: skip
    cmds = [ar] + [verifier(side, port) for side, port in ports.items()]
    with serving(cmds) as procs:
        wait_tcp(procs[0], aport, 900)
        for proc, port in zip(procs[1:], ports.values(), strict=True):
            wait_healthy(proc, f"http://127.0.0.1:{port}/health", 900, f"verifier {port}")
        yield ports, aport


def wait_tcp(proc: subprocess.Popen[bytes], port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"port {port} not open in {timeout:.0f} s")


@dataclass(frozen=True)
class VerifierCounts:
    """What the verifier's /metrics say about its model work so far."""

    verify_s: float  # wanspec_verify_seconds_sum
    verifies: float  # wanspec_verify_seconds_count
    #: wanspec_engine_busy_seconds_total: the engine's seconds in steps (target forwards and
    #: decisions, co-generation included; padded ones at their pad)
    busy_s: float
    #: wanspec_tree_branches_total, ..._opened_total, wanspec_tree_tokens_total (token trees)
    tree_branches: float = 0.0
    tree_opened: float = 0.0
    tree_tokens: float = 0.0


def verifier_counts(port: int) -> VerifierCounts:
    """One read of the verifier's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()

    def value(name: str) -> float:
        m = re.search(rf"^{name}\s+(\S+)", text, re.M)
        return float(m.group(1)) if m else 0.0

    return VerifierCounts(
        value("wanspec_verify_seconds_sum"),
        value("wanspec_verify_seconds_count"),
        value("wanspec_engine_busy_seconds_total"),
        value("wanspec_tree_branches_total"),
        value("wanspec_tree_branches_opened_total"),
        value("wanspec_tree_tokens_total"),
    )


# ------------------------------------------------------------------------------ the edge


@dataclass
class DraftEntry:
    """One draft of the grid: its (unpadded) drafter, fingerprint, modes and RTTs."""

    name: str
    drafter: DraftModel
    fingerprint: Fingerprint
    modes: tuple[ModeSpec, ...]
    rtts: tuple[float, ...]
    loaded: LoadedModel | None = None  # model drafts (for the assisted baseline)

    @property
    def oracle(self) -> OracleDrafter | None:
        return self.drafter if isinstance(self.drafter, OracleDrafter) else None


@dataclass
class Run:
    regime: str
    rtt_ms: float
    mode: str  # the summary's label: "ar", "stop-and-wait", "pipelined γ=4 D=4", "auto", ...
    depth: int | None
    dataset: str
    tokens: int  # committed (an EOS may end a reply before ``reply_tokens``)
    wall_s: float  # request sent to the last token at the edge, wall time
    tokens_per_s: float  # the whole reply, emulated time (× S)
    decode_tokens_per_s: float  # first committed token to last, emulated
    extra: dict[str, Any] = field(default_factory=dict)
    draft: str | None = None  # None: ar (no draft)
    mode_spec: str | None = None  # "saw:4", "pipe:4x4", "auto"; None: ar, assisted
    gamma: int | None = None
    cogen: bool | None = None
    scale: float = 1.0  # time dilation S of this run
    #: The prompt's index in its dataset (``bench.lib.prompts``: ``name`` is ``dataset/prompt``).
    prompt: int | None = None
    reply_tokens: int = 0  # the reply's length asked for (max_new_tokens)
    #: Request sent to the first committed token at the edge, emulated seconds.
    ttft_s: float | None = None

    @property
    def name(self) -> str:
        """The prompt's name in :mod:`bench.lib.prompts` (``gsm8k/3``)."""
        return f"{self.dataset}/{self.prompt}"

    def key(self) -> tuple[str, float, float, str | None, str, str, int]:
        """What identifies a run in a grid: a resumed bench skips the keys its journal has."""
        return (self.regime, self.scale, self.rtt_ms, self.draft, self.mode_spec or self.mode,
                self.name, self.reply_tokens)  # fmt: skip


class Journal:
    """``runs.jsonl`` in the output folder: a header (the settings and the commit), then one
    line per finished run, flushed as it finishes, so that a bench stopped part-way (a session's
    end, a crash) resumes with ``--resume`` where it stopped, on the same settings and code
    (:func:`code_commit`: a journal committed under docs/ between sessions stays valid);
    removed once ``results.json`` is written."""

    def __init__(self, path: Path, header: dict[str, Any], resume: bool) -> None:
        self.path = path
        self.done: dict[tuple[Any, ...], Run] = {}
        if resume and path.exists():
            lines = path.read_bytes().splitlines()
            old = orjson.loads(lines[0]) if lines else None
            if old != header:
                raise SystemExit(
                    f"--resume: {path} was written with other settings or another commit "
                    f"({old}); run without --resume to start again"
                )
            for line in lines[1:]:
                try:
                    run = Run(**orjson.loads(line))
                except (orjson.JSONDecodeError, TypeError):
                    break  # a line cut by the stop
                self.done[run.key()] = run
            print(f"resuming: {len(self.done)} runs from {path}", flush=True)
        self._f = path.open("wb")
        self._f.write(orjson.dumps(header) + b"\n")
        for run in self.done.values():
            self._write(run)

    def _write(self, run: Run) -> None:
        self._f.write(orjson.dumps(asdict(run), option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._f.flush()

    def add(self, run: Run) -> None:
        self.done[run.key()] = run
        self._write(run)

    def finish(self) -> None:
        self._f.close()
        self.path.unlink()


async def run_ar(client: ArClient, prompt: list[int], n: int, eos: list[int]) -> dict[str, Any]:
    """One ``ar`` reply on the kept-alive connection; ``busy_s``: the service's seconds in its
    steps, the prefill step included (wall time; the caller divides by S)."""
    connects = client.connects
    reply = await client.request(prompt, n, eos)
    return {
        "tokens": len(reply.stamps),
        "t0": reply.sent_at,
        "wall_s": (reply.stamps[-1] if reply.stamps else reply.ended_at) - reply.sent_at,
        "stamps": reply.stamps,
        "downlink_bytes": reply.down_bytes,
        "busy_s": reply.busy_s,
        "reconnects": client.connects - connects,
        "text_ids": reply.ids,
    }


def decode_rate(stamps: list[float]) -> float:
    """Tokens per second from the first committed token to the last (excludes setup+prefill)."""
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return float("nan")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def ceiling(
    mode: str,
    gamma: float,
    depth: float,
    t_d: float,
    t_v: float,
    rtt: float,
    n_bar: float,
    r: float,
    *,
    cogen: bool = False,
) -> float:
    """Analytical tokens/s; all times in seconds.

    Without co-generation (and for stop-and-wait), with the gap before each verdict:

    * stop-and-wait: every round takes ``refill = γ t_d + R + T_v``: ceiling = n̄ / refill;
    * pipelined: after a fully accepted round the next verdict follows in
      ``flow = max(γ t_d, (R + T_v)/D, T_v)``, after a rejection in ``refill`` (the pipeline is
      emptied: the verdict goes down, γ fresh drafts, up, verify):
      ceiling = n̄ / ((1 − r)·flow + r·refill).

    With co-generation (``cogen``, pipelined), the verifier, which would sit idle during the
    γ t_d + R of a refill, decodes on its own at one token per T_v: ``c = (γ t_d + R)/T_v``
    tokens per rejection, counted on top of n̄:

        ceiling = (n̄ + r·c) / ((1 − r)·flow + r·refill)

    Checks: r = 1 with n̄ = 1 (every draft wrong) gives 1/T_v, the target decoding alone, at
    any RTT; r = 0 gives the ceiling without co-generation. This is the model of the edge's
    controller (:mod:`edge_agent.session.controller`). The co-generated tokens themselves mostly
    coincide
    with drafts accepted later (the runs record ``cogen_overlap``); what they buy is time: each
    commits its position before the verdict, and one that contradicts a draft in flight voids
    that batch at once rather than a round trip later. Counting them as extra tokens prices
    that in; on the first measurements (oracle α = 0.75 and the self-draft, γ = 4, D = 4,
    R = 100 ms) the measured decode rate was within 5 % of this ceiling. n̄ counts what the
    batches yield: accepted drafts (those matching co-generated tokens included), one
    correction per rejection, bonus tokens.
    """
    refill = gamma * t_d + rtt + t_v
    if mode == Mode.STOP_AND_WAIT:
        return n_bar / refill
    flow = max(gamma * t_d, (rtt + t_v) / depth, t_v)
    gap = (1 - r) * flow + r * refill
    if not cogen or t_v <= 0:
        return n_bar / gap
    c = (gamma * t_d + rtt) / t_v
    return (n_bar + r * c) / gap


async def sweep(
    cfg: BenchConfig,
    regime: Regime,
    vports: dict[CloudSide, int],
    aport: int,
    token: str,
    entries: list[DraftEntry],
    prompts: list[tuple[Prompt, list[int]]],
    eos: list[int],
    rtts: Sequence[float],
    with_ar: bool,
    journal: Journal,
) -> list[Run]:
    """One (regime, S) group: for each RTT, prompt and reply length, ``ar`` (if ``with_ar``) and
    every mode of every draft in ``entries`` that runs at that RTT, each against its verifier
    (``vports``, by :class:`CloudSide`) on that verifier's warm link, ``ar`` on its kept-alive
    connection (both opened before the first run, kept to the last). Runs the ``journal`` has
    already are taken from it."""
    s = regime.scale
    runs: list[Run] = []
    link = LinkConfig(rtt_ms=0, bandwidth_bps=cfg.bandwidth_mbit * 1e6 / s, seed=cfg.seed)
    async with contextlib.AsyncExitStack() as stack:
        vemus = {
            side: await stack.enter_async_context(WanEmulator(("127.0.0.1", port), link))
            for side, port in vports.items()
        }
        aemu = await stack.enter_async_context(WanEmulator(("127.0.0.1", aport), link))
        # One warm link per verifier, shared by every agent of that verifier (the daemon's
        # ``connect = warm.stream``); the keeper reopens a dropped one.
        warms: dict[CloudSide, WarmLink] = {}
        for side, emu in vemus.items():
            warm = WarmLink(
                LinkSettings(
                    url=f"ws://127.0.0.1:{emu.port}/v1/session", token=token, heartbeat_s=0
                )
            )
            stack.push_async_callback(warm.close)
            await open_warm(warm)
            warms[side] = warm
        ar = ArClient(f"ws://127.0.0.1:{aemu.port}/v1/generate", token)
        if with_ar:
            await stack.enter_async_context(ar)

        # Per draft: its padded drafter; per draft and verifier, an agent with the drafter and
        # one without (cloud-sd).
        retry = RetryPolicy(max_attempts=2, handshake_timeout_s=120)
        timed = {
            e.name: TimedDrafter(e.drafter, regime.draft_ms * s / 1000, cfg.draft_batch_cost)
            for e in entries
        }
        agents: dict[tuple[str, CloudSide, bool], EdgeAgent] = {}
        for e in entries:
            for side, warm in warms.items():
                for edge_draft in (True, False):
                    drafter = timed[e.name] if edge_draft else None
                    agents[(e.name, side, edge_draft)] = EdgeAgent(
                        drafter, e.fingerprint, warm.stream, retry=retry
                    )

        def done(rtt: float, draft: str | None, mode: str, prompt: str, n: int) -> bool:
            run = journal.done.get((regime.name, s, rtt, draft, mode, prompt, n))
            if run is not None:
                runs.append(run)
            return run is not None

        def record(run: Run) -> None:
            runs.append(run)
            journal.add(run)
            print(
                f"[{regime.name} S={s:g}] rtt={run.rtt_ms:>5.0f} {run.draft or '-':<18.18} "
                f"{run.mode:<22} {run.dataset:<14} {run.tokens:>3}/{run.reply_tokens:<3} tok "
                f"{run.tokens_per_s:7.2f} tok/s (decode {run.decode_tokens_per_s:7.2f}, "
                f"TTFT {run.ttft_s or math.nan:5.2f} s)",
                flush=True,
            )

        try:
            for rtt in rtts:
                for emu in (*vemus.values(), aemu):
                    emu.set_link(rtt_ms=rtt * s)
                for p, ids in prompts:
                    i = prompt_index(p)
                    for n in cfg.tokens:
                        if with_ar and not done(rtt, None, "ar", p.name, n):
                            a_up0, a_down0 = aemu.stats.bytes_up, aemu.stats.bytes_down
                            res = await run_ar(ar, ids, n, eos)
                            extra: dict[str, Any] = {
                                "wire_bytes_up": aemu.stats.bytes_up - a_up0,
                                "wire_bytes_down": aemu.stats.bytes_down - a_down0,
                                # the service's busy seconds, emulated (its pads are × S)
                                "verifier_busy_s": res["busy_s"] / s
                                if res["busy_s"] is not None
                                else None,
                            }
                            for e in entries:
                                if e.oracle is not None and tuple(ids) in e.oracle.paths:
                                    extra["matches_oracle_path"] = e.oracle.on_path(
                                        ids, res["text_ids"]
                                    )
                                    break
                            run = measured_run(regime, rtt, p.dataset, res, extra, "ar", None)
                            record(replace(run, prompt=i, reply_tokens=n))
                        for e in entries:
                            if rtt not in e.rtts:
                                continue
                            for m in e.modes:
                                if done(rtt, e.name, m.spec, p.name, n):
                                    continue
                                agent = agents[(e.name, m.cloud, m.edge_draft)]
                                cell = Cell(vports[m.cloud], vemus[m.cloud], agent,
                                            timed[e.name], warms[m.cloud])  # fmt: skip
                                run = await _spec_run(cfg, regime, cell, e, m, p, ids, eos, rtt, n)
                                record(replace(run, prompt=i, reply_tokens=n))
        finally:
            for agent in agents.values():
                agent.close()
    return runs


def measured_run(
    regime: Regime,
    rtt: float,
    dataset: str,
    res: dict[str, Any],
    extra: dict[str, Any],
    mode: str,
    depth: int | None,
    *,
    prompt: int | None = None,
) -> Run:
    """The Run of one generation of ``regime`` at ``rtt``: ``res`` is run_ar's or run_spec's
    result (tokens, t0, wall_s, stamps, ...), its rates and TTFT in emulated time (× the
    regime's scale S); ``extra`` holds the rest of ``res`` and the caller's own measures."""
    s = regime.scale
    stamps = res["stamps"]
    return Run(
        regime=regime.name,
        rtt_ms=rtt,
        mode=mode,
        depth=depth,
        dataset=dataset,
        tokens=res["tokens"],
        wall_s=res["wall_s"],
        tokens_per_s=res["tokens"] / res["wall_s"] * s if res["wall_s"] > 0 else math.nan,
        decode_tokens_per_s=decode_rate(stamps) * s,
        extra={**{k: v for k, v in res.items() if k not in ("stamps", "t0")}, **extra},
        scale=s,
        prompt=prompt,
        ttft_s=(stamps[0] - res["t0"]) / s if stamps else None,
    )


@dataclass(frozen=True)
class Cell:
    """What one speculative run uses: its verifier's port, emulator and warm link, the agent,
    the drafter (its step times; unused by cloud-sd)."""

    vport: int
    vemu: WanEmulator
    agent: EdgeAgent
    timed: TimedDrafter
    warm: WarmLink


async def _spec_run(
    cfg: BenchConfig,
    regime: Regime,
    cell: Cell,
    entry: DraftEntry,
    mode: ModeSpec,
    prompt: Prompt,
    ids: list[int],
    eos: list[int],
    rtt: float,
    n: int,
) -> Run:
    vport, vemu, agent, timed = cell.vport, cell.vemu, cell.agent, cell.timed
    s = regime.scale
    before = verifier_counts(vport)
    up0, down0 = vemu.stats.bytes_up, vemu.stats.bytes_down
    connects = cell.warm.connects
    timed.times.clear()
    timed.compute.clear()
    oracle = entry.oracle
    o0 = replace(oracle.stats) if oracle is not None else None
    res = await run_spec(agent, mode.pipeline_config(), ids, n, eos)
    after = verifier_counts(vport)
    extra: dict[str, Any] = {"reconnects": cell.warm.connects - connects}
    # The verifier's GPU time for this generation, in emulated seconds (the pads are × S).
    extra["verifier_busy_s"] = (after.busy_s - before.busy_s) / s
    extra["tree_branches"] = after.tree_branches - before.tree_branches
    extra["tree_opened"] = after.tree_opened - before.tree_opened
    extra["tree_tokens"] = after.tree_tokens - before.tree_tokens
    extra["wire_bytes_up"] = vemu.stats.bytes_up - up0
    extra["wire_bytes_down"] = vemu.stats.bytes_down - down0
    nv = after.verifies - before.verifies
    extra["verify_s_mean"] = (after.verify_s - before.verify_s) / nv if nv else None
    extra["draft_step_s_mean"] = float(np.mean(timed.times)) if timed.times else None
    extra["draft_compute_s_mean"] = float(np.mean(timed.compute)) if timed.compute else None
    if oracle is not None and o0 is not None:
        hits = oracle.stats.hits - o0.hits
        misses = oracle.stats.misses - o0.misses
        extra["oracle_hits"] = hits
        extra["oracle_misses"] = misses
        extra["oracle_off_path"] = oracle.stats.off_path - o0.off_path
        extra["oracle_alpha_measured"] = hits / (hits + misses) if hits + misses else None
        on_path = oracle.on_path(ids, res["text_ids"])
        extra["oracle_on_path"] = on_path
        if not on_path:
            print(
                f"warning: {entry.name}: the verified text left the precomputed greedy path "
                "(a near-tie decided differently); the oracle's drafts after it are all wrong",
                flush=True,
            )
    measured = measured_run(regime, rtt, prompt.dataset, res, extra, mode.label, mode.depth)
    return replace(
        measured,
        draft=entry.name,
        mode_spec=mode.spec,
        gamma=mode.gamma,
        cogen=mode.cogen,
    )


def run_assisted(
    cfg: BenchConfig,
    target: LoadedModel,
    entry: DraftEntry,
    prompts: list[tuple[Prompt, list[int]]],
) -> list[Run]:
    import torch

    assert entry.loaded is not None
    runs = []
    eos = eos_ids(target)
    for (p, prompt_ids), length in ((x, n) for x in prompts for n in cfg.tokens):
        ids = torch.tensor([prompt_ids])
        kwargs: dict[str, Any] = dict(
            max_new_tokens=length,
            do_sample=False,
            assistant_model=entry.loaded.model,
            num_assistant_tokens=ASSISTED_GAMMA,
            pad_token_id=eos[0] if eos else None,
        )
        model: Any = target.model  # transformers' generate, untyped
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(ids, **kwargs)
            wall = time.perf_counter() - t0
            plain = model.generate(
                ids, max_new_tokens=length, do_sample=False, pad_token_id=kwargs["pad_token_id"]
            )
        n = out.shape[1] - ids.shape[1]
        same = bool(torch.equal(out, plain))
        runs.append(
            Run(
                regime="raw",
                rtt_ms=0.0,
                mode="assisted",
                depth=None,
                dataset=p.dataset,
                tokens=n,
                wall_s=wall,
                tokens_per_s=n / wall,
                decode_tokens_per_s=float("nan"),
                extra={"matches_plain_greedy": same},
                draft=entry.name,
                gamma=ASSISTED_GAMMA,
                prompt=prompt_index(p),
                reply_tokens=length,
            )
        )
        print(
            f"[raw] rtt=    0 {entry.name:<18.18} assisted {p.dataset:<14} {n:>3} tok  "
            f"{n / wall:7.2f} tok/s",
            flush=True,
        )
    return runs


# ------------------------------------------------------------------------------ analysis


def _mean(xs: Sequence[float]) -> float:
    vals = [x for x in xs if x is not None and not math.isnan(x)]
    return float(np.mean(vals)) if vals else float("nan")


def summarise(
    runs: list[Run], cfg: BenchConfig, regimes: Sequence[Regime], vocab: int
) -> list[dict[str, Any]]:
    """One row per (regime, draft, RTT, mode, reply length): means over prompts, speed-ups vs
    the ``ar`` rows of the same regime, RTT and length and vs the ``cloud-sd`` row of the same
    draft too (an oracle has none: None), ceiling, bytes. Every mode's verifier busy time is
    what its verifier reported (``ar``'s: the AR service's steps, the prefill included)."""
    reg_order = {r.name: i for i, r in enumerate(regimes)}
    draft_order: dict[str | None, int] = {None: -1}
    for i, d in enumerate(cfg.drafts):
        draft_order.setdefault(d, i)
    mode_order: dict[tuple[str | None, str], int] = {}  # (draft, mode) → rank
    specs: dict[str, ModeSpec] = {}
    for d in cfg.drafts:
        mode_order[(d, "assisted")] = 0
        for i, m in enumerate(cfg.modes_for(d)):
            mode_order[(d, m.label)] = i + 1
            specs.setdefault(m.spec, m)
    groups: dict[tuple[str, str | None, float, str, int], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.regime, r.draft, r.rtt_ms, r.mode, r.reply_tokens), []).append(r)
    ar_tps = {
        (k[0], k[2], k[4]): _mean([r.tokens_per_s for r in sel])
        for k, sel in groups.items()
        if k[3] == "ar"
    }
    # Cloud-only speculative decoding with the same draft model: the user's other choice.
    sd_tps = {
        (k[0], k[1], k[2], k[4]): _mean([r.tokens_per_s for r in sel])
        for k, sel in groups.items()
        if k[3] == "cloud-sd"
    }
    keys = sorted(
        groups,
        key=lambda k: (
            reg_order.get(k[0], 99),
            draft_order.get(k[1], 99),
            k[4],
            k[2],
            mode_order.get((k[1], k[3]), 99),
            k[3],
        ),
    )
    rows = []
    for key in keys:
        regime, draft, rtt, mode, length = key
        sel = groups[key]
        first = sel[0]
        tps = _mean([r.tokens_per_s for r in sel])
        dtps = _mean([r.decode_tokens_per_s for r in sel])
        ar = ar_tps.get((regime, rtt, length))
        sd = sd_tps.get((regime, draft, rtt, length))
        row: dict[str, Any] = {
            "regime": regime,
            "draft": draft,
            "rtt_ms": rtt,
            "mode": mode,
            "reply_tokens": length,
            "tokens_per_s": tps,
            "decode_tokens_per_s": dtps,
            "ttft_s": _mean([r.ttft_s for r in sel if r.ttft_s is not None]),
            "speedup_vs_ar": tps / ar if ar else None,
            "speedup_vs_cloud_sd": tps / sd if sd else None,
            "mode_spec": first.mode_spec,
            "time_scale": first.scale,
            "reconnects": sum(r.extra.get("reconnects", 0) for r in sel),
        }
        tokens = sum(r.tokens for r in sel)
        busy = [r.extra.get("verifier_busy_s") for r in sel]
        if mode != "assisted" and tokens and all(b is not None for b in busy):
            row["verifier_busy_s_per_100_tokens"] = 100 * sum(busy) / tokens  # type: ignore[arg-type]
        spec = specs.get(first.mode_spec or "")
        if spec is not None:
            row |= _spec_figures(sel, spec, rtt, tokens, dtps)
        elif mode == "ar":
            row["bytes_per_token"] = sum(r.extra["downlink_bytes"] for r in sel) / tokens
            row["wire_bytes_per_token"] = (
                sum(r.extra["wire_bytes_up"] + r.extra["wire_bytes_down"] for r in sel) / tokens
            )
        row["full_distribution_bytes_per_token"] = vocab * 4
        rows.append(row)
    return rows


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def in_ceiling_model(spec: ModeSpec) -> bool:
    """Whether :func:`ceiling` models ``spec``'s rounds: edge drafts on the plain verifier, each
    rejection refilled by γ fresh drafts. Pre-drafting, token trees and hedges answer a
    rejection sooner; a verifier drafting for itself commits tokens outside the edge's rounds."""
    return (
        spec.edge_draft
        and spec.cloud == CloudSide.PLAIN
        and not spec.predraft
        and not spec.tree
        and not spec.hedge
    )


def _spec_figures(
    sel: list[Run], spec: ModeSpec, rtt: float, tokens: int, dtps: float
) -> dict[str, Any]:
    ex = [r.extra for r in sel]
    s = sel[0].scale
    rounds = sum(e["rounds"] for e in ex)
    draft_t = sum(e["draft_tokens"] for e in ex)
    acc = sum(e["accepted_tokens"] for e in ex)
    rej = sum(e["rejections"] for e in ex)
    up = sum(e["uplink_bytes"] for e in ex)
    down = sum(e["downlink_bytes"] for e in ex)
    verdict_tokens = sum(e["verdict_tokens"] for e in ex)
    out: dict[str, Any] = {
        "gamma": spec.gamma,
        "depth": spec.depth,
        "cogen": spec.cogen,
        "auto": spec.auto,
        # Of the drafted tokens, those accepted (drafts after a rejected one are never judged).
        "draft_acceptance": acc / draft_t if draft_t else None,
        # The per-token α of Leviathan et al.: of the draft tokens the verifier judged (each
        # rejection judges one), those it accepted.
        "alpha_per_token": acc / (acc + rej) if acc + rej else None,
        "mean_accepted_per_round": acc / rounds if rounds else None,
        "cogen_tokens_per_generation": sum(e["cogen_tokens"] for e in ex) / len(ex),
        "hedge": spec.hedge,
        "hedges_per_generation": sum(e["stats"].get("hedges_sent", 0) for e in ex) / len(ex),
        "hedge_bytes_per_token": sum(e["stats"].get("hedge_bytes", 0) for e in ex) / tokens
        if tokens
        else None,
        "hedge_hits_per_generation": sum(e["stats"].get("hedge_hits", 0) for e in ex) / len(ex),
        "predraft": spec.predraft,
        "tree": spec.tree,
        # Token trees: rejections whose recovered token opened a branch in the batch's own
        # forward, and the branch draft tokens that committed.
        "tree_open_rate": _ratio(sum(e.get("tree_opened", 0) for e in ex), rej),
        "tree_branches_per_generation": sum(e.get("tree_branches", 0) for e in ex) / len(ex),
        "tree_tokens_per_generation": sum(e.get("tree_tokens", 0) for e in ex) / len(ex),
        # Rejections answered from a prepared branch (a batch sent from one, per rejection).
        "predraft_hit_rate": _ratio(sum(e["stats"].get("predraft_hits", 0) for e in ex), rej),
        "predraft_unused_tokens_per_generation": sum(
            e["stats"].get("predraft_tokens", 0) - e["stats"].get("predraft_used_tokens", 0)
            for e in ex
        )
        / len(ex),
        # From a rejection's verdict at the edge to the next batch sent, emulated ms.
        "gap_per_rejection_ms": _ratio(
            1000 * sum(e["stats"].get("rejection_gap_s", 0.0) for e in ex) / s,
            sum(e["stats"].get("rejection_gaps", 0) for e in ex),
        ),
        # Per Propose sent; None where none was (cloud-sd: credits are not rounds). The branch
        # frames (token trees) ride the uplink too: their share of it, per Propose.
        "uplink_bytes_per_round": _ratio(up, sum(e["proposes"] for e in ex)),
        "branch_bytes_per_round": _ratio(
            sum(e["stats"].get("hedge_bytes", 0) for e in ex), sum(e["proposes"] for e in ex)
        ),
        "downlink_bytes_per_rejection": sum(e["downlink_rejection_bytes"] for e in ex) / rej
        if rej
        else None,
        "bytes_per_token": (up + down) / tokens if tokens else None,
        "wire_bytes_per_token": sum(e["wire_bytes_up"] + e["wire_bytes_down"] for e in ex) / tokens
        if tokens
        else None,
    }
    sources: dict[str, int] = {}
    for e in ex:
        for name, n in e["stats"]["sources"].items():
            sources[name] = sources.get(name, 0) + n
    out["token_sources"] = {k: n / tokens for k, n in sources.items()} if tokens else None
    if "oracle_on_path" in ex[0]:
        hits = sum(e["oracle_hits"] for e in ex)
        n = hits + sum(e["oracle_misses"] for e in ex)
        out["oracle_alpha_measured"] = hits / n if n else None
        out["oracle_on_path"] = sum(bool(e["oracle_on_path"]) for e in ex) / len(ex)
    if not in_ceiling_model(spec):
        return out | {"ceiling_tokens_per_s": None, "ceiling_approx": None,
                      "fraction_of_ceiling": None}  # fmt: skip
    t_d = _mean([e["draft_step_s_mean"] or math.nan for e in ex]) / s
    t_v = _mean([e["verify_s_mean"] or math.nan for e in ex]) / s
    n_bar = verdict_tokens / rounds if rounds else math.nan
    gamma: float = spec.gamma
    depth: float = spec.depth
    # auto: γ and D change round by round; the ceiling at their means is approximate.
    approx = spec.auto
    if spec.auto:
        # The means the controller ran at: from the edge's stats where it reports them, γ
        # else from draft tokens per verified batch; D = 4 (and an approximate ceiling) else.
        gammas = [e.get("gamma_mean") for e in ex]
        depths = [e.get("depth_mean") for e in ex]
        if all(g is not None for g in gammas):
            gamma = float(np.mean([float(g) for g in gammas if g is not None]))
        elif rounds:
            gamma = draft_t / rounds
        else:
            gamma, approx = 4, True
        if all(d is not None for d in depths):
            depth = float(np.mean([float(d) for d in depths if d is not None]))
            out["depth_measured"] = depth
        else:
            depth, approx = 4, True
            out["depth_measured"] = None
        out["gamma_measured"] = gamma
    cap = ceiling(
        spec.kind,
        gamma,
        depth,
        t_d,
        t_v,
        rtt / 1000,
        n_bar,
        rej / rounds if rounds else 0.0,
        cogen=spec.cogen,
    )
    out |= {
        "t_draft_ms": t_d * 1000,
        "t_verify_ms": t_v * 1000,
        "ceiling_tokens_per_s": cap,
        "ceiling_approx": approx,
        "fraction_of_ceiling": dtps / cap if cap and not math.isnan(dtps) else None,
    }
    return out


# ------------------------------------------------------------------------------ time estimate

#: Guesses for the time estimate only. A real draft's per-token acceptance (0.73 measured for
#: ``self:skip=12``) comes in runs of easy tokens: an independent α = 0.8 reproduces its rate.
EST_REAL_ALPHA = 0.82
EST_EFFICIENCY = 1.0  # measured tokens/s over the ceiling, roughly (old runs: 0.95–1.1)
EST_RUN_OVERHEAD_S = 0.2  # per generation, emulated: prefill, Hello (plus one RTT)
EST_GROUP_START_S = 20.0  # starting the verifier and the AR service (wall)
EST_STEP_S = 0.07  # one token of the target on this CPU (greedy precompute, assisted)
EST_RAW = Regime("raw", draft_ms=60.0, verify_ms=80.0, ar_ms=65.0)  # unpadded step times


def expected_rate(regime: Regime, draft: str | None, mode: ModeSpec | None, rtt_s: float) -> float:
    """Rough emulated tokens/s of one generation (the ceiling × 0.9, for an independent α)."""
    t = regime if regime.emulated else EST_RAW
    if mode is None or draft is None:
        return 1000.0 / t.ar_ms
    alpha = parse_oracle(draft) if is_oracle(draft) else EST_REAL_ALPHA
    t_d = t.draft_ms / 1000 if regime.emulated or not is_oracle(draft) else 0.0
    gamma, depth = (4, 4) if mode.auto else (mode.gamma, mode.depth)
    full = alpha**gamma
    accepted = gamma if alpha >= 1 else alpha * (1 - full) / (1 - alpha)
    r = 1 - full
    n_bar = accepted + (1 if mode.kind == Mode.STOP_AND_WAIT else r)
    cap = ceiling(
        mode.kind, gamma, depth, t_d, t.verify_ms / 1000, rtt_s, n_bar, r, cogen=mode.cogen
    )
    return EST_EFFICIENCY * cap


def estimate(cfg: BenchConfig, n_prompts: int) -> tuple[float, list[str]]:
    """Rough wall time of a run (seconds) and one line per (regime, S) group."""
    total = 10.0  # loading models
    lines = []
    tokens = sum(cfg.tokens)  # per prompt, over the reply lengths
    if any(is_oracle(d) for d in cfg.drafts):
        total += n_prompts * (max(cfg.tokens) + 32) * EST_STEP_S
    for reg in cfg.regimes:
        if cfg.assisted and not reg.emulated:
            total += n_prompts * tokens * 2 * EST_STEP_S * sum(not is_oracle(d) for d in cfg.drafts)
        groups: dict[float, list[str]] = {}
        for d in cfg.drafts:
            groups.setdefault(reg.scale_for(d), []).append(d)
        ar_scale = min(groups, default=reg.scale)
        for scale, drafts in sorted(groups.items()):
            cells: list[tuple[str | None, ModeSpec | None, float]] = []
            if scale == ar_scale:
                cells += [(None, None, rtt) for rtt in cfg.all_rtts]
            for d in drafts:
                cells += [(d, m, rtt) for rtt in cfg.rtts_for(d) for m in cfg.modes_for(d)]
            secs = EST_GROUP_START_S
            for draft, mode, rtt in cells:
                rate = expected_rate(reg, draft, mode, rtt / 1000)
                runs = n_prompts * len(cfg.tokens)
                secs += (
                    n_prompts * tokens / rate + runs * (EST_RUN_OVERHEAD_S + rtt / 1000)
                ) * scale
            total += secs
            lines.append(
                f"  {reg.name} S={scale:g}: {len(cells)} cells × {n_prompts} prompts × "
                f"{'+'.join(map(str, cfg.tokens))} tokens ({', '.join(drafts)}"
                + (", ar" if scale == ar_scale else "")
                + f"): ~{secs / 60:.0f} min"
            )
    return total, lines


# ------------------------------------------------------------------------------ main


def build_regimes(args: argparse.Namespace) -> list[Regime]:
    out = []
    for name in args.regimes.split(","):
        if name == "raw":
            out.append(Regime("raw"))
        elif name == "picospec":
            out.append(
                Regime(
                    "picospec",
                    args.draft_ms_per_token,
                    args.verify_ms,
                    args.ar_ms_per_token,
                    args.time_scale,
                    args.oracle_time_scale,
                    cloud_draft_ms=args.cloud_draft_ms_per_token
                    if args.cloud_draft_ms_per_token is not None
                    else args.verify_ms * CLOUD_DRAFT_PER_VERIFY,
                )
            )
        else:
            raise SystemExit(f"unknown regime {name!r} (raw, picospec)")
    return out


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = study_parser("realtime", __doc__, paragraph=True)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--target", default="default")
    p.add_argument(
        "--drafts",
        default=DEFAULT_DRAFTS,
        help="comma-separated draft specs: a model (self:skip=12, a path, ...) or oracle:alpha=A",
    )
    p.add_argument("--draft", default=None, help="one draft (alias of --drafts with one entry)")
    p.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help="modes of model drafts: saw:G, pipe:GxD, pipe:GxD:nocogen, auto",
    )
    p.add_argument("--oracle-modes", default=DEFAULT_ORACLE_MODES, help="modes of oracle drafts")
    p.add_argument("--rtts", default=DEFAULT_RTTS, help="RTTs in ms (emulated)")
    p.add_argument(
        "--oracle-rtts",
        default=None,
        help=f"RTTs of oracle drafts in ms (default {DEFAULT_ORACLE_RTTS}, or --rtts if given)",
    )
    p.add_argument("--bandwidth-mbit", type=float, default=10.0)
    p.add_argument(
        "--tokens",
        default=DEFAULT_TOKENS,
        help="reply lengths, comma-separated: each prompt runs at each",
    )
    p.add_argument(
        "--prompts", type=int, default=1, help="prompts per dataset of the measured split"
    )
    p.add_argument(
        "--datasets",
        default=",".join(DATASETS),
        help="datasets, comma-separated (bench.lib.prompts: " + ", ".join(DATASETS) + ")",
    )
    p.add_argument("--regimes", default=None, help="picospec (default), raw, or both")
    p.add_argument("--draft-ms-per-token", type=float, default=24.0)
    p.add_argument("--verify-ms", type=float, default=166.0)
    p.add_argument("--ar-ms-per-token", type=float, default=146.0)
    p.add_argument(
        "--time-scale",
        type=float,
        default=4.0,
        help="time dilation S of the emulated regime for model drafts (real compute must fit)",
    )
    p.add_argument(
        "--oracle-time-scale",
        type=float,
        default=1.5,
        help="time dilation S of the emulated regime for oracle drafts (no draft compute)",
    )
    p.add_argument(
        "--cloud-draft-ms-per-token",
        type=float,
        default=None,
        help="the verifier's own draft step, emulated (default: verify × 2.7/24.6, "
        "docs/results/gpu_costs.json)",
    )
    p.add_argument(
        "--cloud-model",
        default="self:skip=12",
        help="the verifier's own draft model (cloud-sd, hybrid): a model spec",
    )
    p.add_argument("--cloud-draft-tokens", type=int, default=4)
    p.add_argument(
        "--draft-batch-cost",
        type=float,
        default=DRAFT_BATCH_COST,
        help="the edge's batched draft step of B rows costs draft × (1 + b (B − 1)): b "
        f"(default {DRAFT_BATCH_COST}, the GPU class; 0.20 is this CPU's, "
        "docs/results/draft_batch.json)",
    )
    p.add_argument("--no-assisted", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--resume",
        action="store_true",
        help="take the runs OUT/runs.jsonl has (a bench stopped part-way, same settings and "
        "commit) and run only the rest",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny random models, RTT 0 and 50, replies of 4 and 6 tokens, a model draft and an "
        "oracle (CI)",
    )
    args = p.parse_args(argv)
    try:
        args.tokens = tuple(int(x) for x in args.tokens.split(",") if x.strip())
    except ValueError:
        p.error(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
    if not args.tokens or min(args.tokens) < 1 or len(set(args.tokens)) != len(args.tokens):
        p.error(f"--tokens: expected distinct lengths >= 1, got {args.tokens}")
    args.datasets = tuple(d.strip() for d in args.datasets.split(",") if d.strip())
    unknown = sorted(set(args.datasets) - set(DATASETS))
    if unknown or not args.datasets:
        p.error(f"--datasets: unknown {unknown or 'none given'}; known: {', '.join(DATASETS)}")
    if args.prompts < 1:
        p.error(f"--prompts: expected >= 1, got {args.prompts}")
    if not 0 <= args.draft_batch_cost <= 1:
        p.error(f"--draft-batch-cost: expected 0..1, got {args.draft_batch_cost}")
    if args.resume and args.smoke:
        p.error("--resume: the smoke run builds its models anew in a temporary folder each time")
    if args.draft:
        args.drafts = args.draft
    if args.oracle_rtts is None:
        args.oracle_rtts = DEFAULT_ORACLE_RTTS if args.rtts == DEFAULT_RTTS else args.rtts
    if args.smoke:
        args.rtts = args.oracle_rtts = "0,50"
        args.tokens, args.prompts = (4, 6), 1
        args.datasets = ("gsm8k", "chat", "humaneval")
        args.modes = (
            "saw:4,pipe:4x2,pipe:4x2:hedge,auto,hybrid,hybrid:predraft,hybrid:tree,"
            "cloud-sd,cloud-sd:ngram"
        )
        args.oracle_modes = "pipe:4x2:nocogen,auto"
        args.draft_ms_per_token, args.verify_ms, args.ar_ms_per_token = 2.0, 10.0, 8.0
        args.time_scale, args.oracle_time_scale = 1.0, 2.0  # two groups: exercise the split
        args.regimes = args.regimes or "raw,picospec"
    args.regimes = args.regimes or "picospec"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    regimes = build_regimes(args)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wanspec-bench-") as tmp:
        target_spec = args.target
        drafts = [d.strip() for d in args.drafts.split(",") if d.strip()]
        if args.smoke:
            target_spec = str(build_tiny_model(Path(tmp) / "target", vocab_size=256, seed=0))
            tiny = str(build_tiny_model(Path(tmp) / "draft", vocab_size=256, seed=1))
            drafts = [tiny, "oracle:alpha=0.75"]
            args.cloud_model = tiny
        for d in drafts:
            if is_oracle(d):
                parse_oracle(d)
        cfg = BenchConfig(
            out=out,
            target=target_spec,
            drafts=tuple(drafts),
            modes=tuple(m.spec for m in parse_modes(args.modes)),
            oracle_modes=tuple(m.spec for m in parse_modes(args.oracle_modes)),
            rtts_ms=_floats(args.rtts),
            oracle_rtts_ms=_floats(args.oracle_rtts),
            bandwidth_mbit=args.bandwidth_mbit,
            tokens=args.tokens,
            prompts_per_dataset=args.prompts,
            datasets=args.datasets,
            regimes=tuple(regimes),
            assisted=not args.no_assisted,
            smoke=args.smoke,
            seed=args.seed,
            cloud_model=args.cloud_model,
            cloud_draft_tokens=args.cloud_draft_tokens,
            draft_batch_cost=args.draft_batch_cost,
        )
        prompts = bench_prompts(cfg)
        secs, lines = estimate(cfg, len(prompts))
        print(f"estimated wall time: ~{secs / 60:.0f} min (rough)", *lines, sep="\n", flush=True)
        token = secrets.token_urlsafe(16)
        token_file = write_tokens(Path(tmp) / "token", [token])
        target = load_model(cfg.target)
        eos = eos_ids(target)
        encoded = [(p, encode(target, p)) for p in prompts]
        entries = build_entries(cfg, target, eos, encoded)
        header = {
            "settings": {k: str(v) for k, v in asdict(cfg).items()},
            "commit": code_commit(),
        }
        journal = Journal(out / "runs.jsonl", header, args.resume)
        runs: list[Run] = []
        if cfg.assisted and any(not r.emulated for r in regimes):
            for e in entries:
                if e.loaded is not None:
                    runs += run_assisted(cfg, target, e, encoded)
        for regime in regimes:
            groups: dict[float, list[DraftEntry]] = {}
            for e in entries:
                groups.setdefault(regime.scale_for(e.name), []).append(e)
            ar_scale = min(groups)
            for scale, group in sorted(groups.items()):
                reg = replace(regime, scale=scale)
                with_ar = scale == ar_scale
                rtts = cfg.all_rtts if with_ar else sorted({r for e in group for r in e.rtts})
                sides = {m.cloud for e in group for m in e.modes}
                with cloud_processes(cfg, token_file, reg, sides) as (vports, aport):
                    runs += asyncio.run(
                        sweep(
                            cfg,
                            reg,
                            vports,
                            aport,
                            token,
                            group,
                            encoded,
                            eos,
                            rtts,
                            with_ar,
                            journal,
                        )
                    )
    from bench.lib.report import write_outputs

    rows = summarise(runs, cfg, regimes, target.vocab_size)
    write_outputs(out, cfg, regimes, runs, rows, machine_info())
    journal.finish()
    print(f"wrote {out / 'results.json'}, {out / 'results.md'} and plots")
    return 0


def build_entries(
    cfg: BenchConfig,
    target: LoadedModel,
    eos: list[int],
    prompts: list[tuple[Prompt, list[int]]],
) -> list[DraftEntry]:
    """The drafts of the grid; the oracles' greedy paths are computed here, once per prompt."""
    entries = []
    paths: GreedyPaths | None = None
    for d in cfg.drafts:
        modes, rtts = cfg.modes_for(d), cfg.rtts_for(d)
        if is_oracle(d):
            if paths is None:
                paths = GreedyPaths(target, max(cfg.tokens) + 32, eos)
                t0 = time.perf_counter()
                for _, ids in prompts:
                    paths.add(ids)
                print(
                    f"greedy paths of {len(prompts)} prompts for the oracle drafts: "
                    f"{time.perf_counter() - t0:.1f} s",
                    flush=True,
                )
            oracle = OracleDrafter(paths.paths, target.vocab_size, parse_oracle(d), seed=cfg.seed)
            fingerprint = replace(target.fingerprint, model_name=f"{target.name}:{d}")
            entries.append(DraftEntry(d, oracle, fingerprint, modes, rtts))
        else:
            loaded = load_draft_model(d, target)
            entries.append(DraftEntry(d, Drafter(loaded), loaded.fingerprint, modes, rtts, loaded))
    return entries


def code_commit() -> str:
    """The last commit that changed anything but ``docs/``: what a journal is bound to, so that
    committing a part-run's journal (or docs) between sessions does not void it."""
    return subprocess.run(
        ["git", "log", "-1", "--format=%h", "--", ".", ":(exclude)docs"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()


__all__ = [
    "CLOUD_DRAFT_PER_VERIFY",
    "DRAFT_BATCH_COST",
    "BenchConfig",
    "Regime",
    "Run",
    "asdict",
    "ceiling",
    "estimate",
    "main",
]
