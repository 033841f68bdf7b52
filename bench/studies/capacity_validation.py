"""Capacity under load, real against simulated: N users in real time on one real verifier, and
the simulation (:mod:`bench.lib.sim`) of the same users, costs and prompts, compared figure by
figure.

    python -m bench capacity_validation --out docs/results/capacity_validation.json
    python -m bench capacity_validation --out /tmp/cv.json --smoke   # N = 2, 8 tokens (tests)

The users. For each mode (``--modes``, :meth:`bench.lib.sim.SimMode.parse` forms; default
``auto:predraft`` and ``cloud-sd:model:2``) and N (``--edges``, default 4, 8, 16), N users each
send one request of ``--tokens`` (64) greedy tokens, all at once (``--start-spread-s`` > 0:
at the seeded offsets :func:`bench.lib.sim.simulate` draws, on both sides). User u of repeat r
(``--repeats``) has the measured prompt (u + r·N) mod P of the acceptance traces
(``--traces``: their prompt ids, as :func:`bench.lib.users.users` assigns them), P = 44.

Real. One verifier process (``python -m bench.net.verifier``: ``cloud-verifier serve`` on the
default target, SmolLM2-135M, one thread) started per mode and N; for cloud-sd:kind:G it drafts
for itself as the simulation's verifier does (``--cloud-draft`` of the kind's sources,
``--cloud-draft-model self:skip=12``, ``--cloud-draft-tokens G``). The scheduler runs with the
simulation's limits (:func:`bench.lib.users.batch_limits`: prefill chunk 2048, the product's
token bound, share and ration; sessions a step, per token and in all ≥ N; a KV pool that holds
every user, no per-session or per-token share, no prefix cache). Each user is an in-process
:class:`~edge_agent.runtime.agent.EdgeAgent` on a warm link of its own
(:class:`~edge_agent.link.warm.WarmLink`, opened before the first request, as
:func:`bench.lib.edge.open_warm`) through a WAN emulator of its own (:mod:`testkit.net.wanem`: RTT
100 ms, 10 Mbit/s each way, so users share no bandwidth); edge modes draft with
``self:skip=12``, one :class:`~edge_agent.model.drafter.Drafter` per user sharing the weights.

Costs and dilation. The emulated costs are the simulation's (:class:`bench.lib.sim.Costs` with
the token, cloud-draft and draft-batch costs of :mod:`bench.lib.costs`, as
:mod:`bench.studies.capacity` runs it), and time is dilated by S: every duration (pads, RTT, the
link's serialisation time, bandwidth / S) is multiplied by S so that the real compute (these 2 CPUs,
one verifier and N drafting users) fits inside every pad; figures are reported in emulated time. The
edge's draft steps are padded by :class:`bench.lib.edge.TimedDrafter` (24 ms × S a step, a batched
step of B branches × (1 + b (B − 1))); the verifier's forwards by the simulation's rule
(``--emulate-token-cost``: :meth:`bench.lib.sim.Costs.forward_s` of the rows' tokens, × S), its
draft model's steps by :meth:`bench.lib.sim.Costs.cloud_draft_step_s` of the rows, × S. S is per N:
max(``--min-time-scale`` 6, K·N), K (``--time-scale-per-edge``) 4 for every mode (cloud-sd
too: :data:`SCALE_PER_USER`). The product's own durations are scaled by S too: the
edge's verdict, handshake and wait deadlines; the verifier's queue delay for admission, its
idle, handshake, send, stall, progress and resumption timeouts, and its batch wait (2 ms: a
step waits that long, in emulated time, for open sessions' work). A pad that the
real compute overruns voids the emulation there: each row counts them (the edge's draft steps,
the verifier's target and draft forwards, one warm-up request included).

Simulated. :func:`bench.lib.sim.simulate` of the same users (prompts, tokens, mode), costs and link
(RTT 100 ms, :data:`bench.lib.cells.BANDWIDTH_BPS`), the scheduler at
:func:`bench.lib.users.batch_limits`, one simulation per repeat.

Written (``--out``, JSON, rewritten after every mode and N): per mode and N, measured and
simulated per-user tok/s p50 and p10, TTFT p99, goodput (tokens over the span from the first
request to the last reply; summed over repeats) as :func:`bench.lib.users.figures` has them,
sim / measured ratios with 95 % intervals of a bootstrap paired by user
(:func:`bench.lib.stats.paired_ratio_ci`: (repeat, user) pairs resampled, 2000 times, seed 0),
``within_15pct`` per figure (|ratio − 1| ≤ 0.15), the time scale, the overruns (and what they
added, in emulated seconds), the verifier's own-draft counters beside the simulation's, each
reply's figures and counts on both sides, the commands and
:func:`testkit.provenance.provenance`.

Where the two differ by construction (TTFT). Users who start together reach the verifier
microseconds apart (their prompts' bytes). The simulation's engine has no batch wait: it
prefills the first arrival's prompt alone and the others a step later. The verifier waits
(2 ms) only for sessions already open, and a warm link's session opens with its first frames,
so whether it takes them in one step is a race of the real arrivals: at N = 4 the measured
TTFT p99 came out at one prefill step (0.37 s) or two (0.54 s, the simulation's) from run to
run. ``--start-spread-s`` (1 s, say) avoids that knife-edge, as the capacity study's spread
starts do.

Time (this 2-core machine). About 20 s to load the models, 15 s to start each verifier; a cell
(mode and N) takes about 15 s + S · (R · (span + 0.2 s) + 1 s), the span a repeat's emulated
length (6-9 s for 64-token replies at N = 4-16). Measured: the smoke 20 s; N = 4, both modes,
32 tokens, one repeat 2 min 50 s. Extrapolated for 64 tokens, N = 4, 8 and 16 and both modes
(S = 16, 32, 64): about 35 min with one repeat, 60 with two, 90 with three.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import re
import secrets
import shlex
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib import stats
from bench.lib.cells import BANDWIDTH_BPS
from bench.lib.cli import study_parser
from bench.lib.costs import CLOUD_DRAFT_PER_VERIFY, DRAFT_BATCH_COST, TREE_TOKEN_COST
from bench.lib.edge import TimedDrafter, load_draft_model, open_warm, run_spec
from bench.lib.sim import Costs, Kind, Link, SimMode, simulate
from bench.lib.sim import Reply as SimReply
from bench.lib.stats import Array
from bench.lib.traces import Trace, load_traces
from bench.lib.users import Plan, batch_limits, users
from bench.net.verifier import serving, verifier_command
from cloud_verifier.daemon.settings import VerifierSettings
from edge_agent.link.connection import LinkSettings
from edge_agent.link.warm import WarmLink
from edge_agent.runtime.agent import EdgeAgent, RetryPolicy
from edge_agent.runtime.text import eos_ids
from shared.runtime.models import LoadedModel, load_model
from shared.service.status import wait_healthy
from testkit.harness import free_port, write_tokens
from testkit.net.wanem import LinkConfig, WanEmulator
from testkit.provenance import provenance

TRACES = Path("docs/results/bench/traces.json.gz")
TARGET = "default"
DRAFT = "self:skip=12"
EDGES = (4, 8, 16)
MODES = ("auto:predraft", "cloud-sd:model:2")
TOKENS = 64
RTT_MS = 100.0
SEED = 0
#: S = max(MIN_TIME_SCALE, K · N), K = SCALE_PER_USER: N drafting users share these 2 CPUs
#: with the verifier. cloud-sd too, though its edges draft nothing: the verifier's draft model
#: prefills every new session's prompt in one draft step (up to 1.7 s of CPU for 4 prompts);
#: at K = 2 a third of its draft steps overran their pads at N = 4 and the measured tok/s fell
#: 7-11 % below the simulated, at K = 4 one step in 26 overran and they agreed within 1 %.
MIN_TIME_SCALE = 6.0
SCALE_PER_USER = 4.0
#: The agreement asked of every figure: |sim / measured − 1| ≤ TOLERANCE.
TOLERANCE = 0.15
#: Tokens of the warm-up request (one user, before the measured runs).
WARMUP_TOKENS = 4
#: The verifier's settings that are durations (seconds): × S under dilation.
SCALED_SETTINGS = (
    "handshake_timeout", "idle_timeout", "header_timeout", "close_timeout", "send_timeout",
    "max_queue_delay", "progress_interval", "stall_timeout", "resume_grace",
)  # fmt: skip


def costs() -> Costs:
    """The emulated costs, as :func:`bench.studies.capacity.run_mode` has them (linear rule)."""
    return Costs(
        token_cost=TREE_TOKEN_COST,
        cloud_draft_per_verify=CLOUD_DRAFT_PER_VERIFY,
        draft_batch_cost=DRAFT_BATCH_COST,
    )


def time_scale(n: int, per_user: float = SCALE_PER_USER, floor: float = MIN_TIME_SCALE) -> float:
    """S for ``n`` users: max(``floor``, ``per_user`` · n)."""
    return max(floor, per_user * n)


def assigned(traces: Sequence[Trace], n: int, repeat: int) -> list[Trace]:
    """The prompts of ``n`` users in ``repeat``: user u has prompt (u + repeat · n) mod P, by
    :func:`bench.lib.users.users` over the prompts rotated by repeat · n."""
    k = repeat * n % len(traces)
    rotated = [*traces[k:], *traces[:k]]
    return [reqs[0].trace for reqs in users(rotated, n, Plan(requests_per_user=1))]


@dataclass(frozen=True)
class Cell:
    """One mode and N: the users' prompts in each repeat, their replies' length, the time scale
    of the real runs and the spread of the users' starts (emulated seconds into a repeat)."""

    mode: SimMode
    repeats: tuple[tuple[Trace, ...], ...]
    tokens: int
    scale: float
    start_spread_s: float = 0.0

    @property
    def edges(self) -> int:
        return len(self.repeats[0])

    @property
    def offsets(self) -> list[float]:
        """User u's start in each repeat: :func:`bench.lib.sim.simulate`'s seeded draws."""
        rng = random.Random(SEED)
        spread = self.start_spread_s
        return [rng.uniform(0.0, spread) if spread > 0 else 0.0 for _ in range(self.edges)]


# ------------------------------------------------------------------------------ figures

#: The columns of a reply's row (:func:`row`).
COUNT, SENT, FIRST, DONE, REPEAT = range(5)


def row(reply: SimReply, repeat: int) -> list[float]:
    """What the figures read of a reply: its tokens, when it was sent, its first token came
    and it ended (emulated seconds into its repeat), and the repeat."""
    return [reply.tokens, reply.sent_s, reply.first_s, reply.done_s, repeat]


def _rates(a: Array) -> Array:
    rates: Array = a[:, COUNT] / (a[:, DONE] - a[:, SENT])
    return rates


def goodput(a: Array) -> float:
    """Tokens over the span (first request to last reply), the spans of repeats summed."""
    span = sum(
        float(a[a[:, REPEAT] == r, DONE].max() - a[a[:, REPEAT] == r, SENT].min())
        for r in np.unique(a[:, REPEAT])
    )
    return float(a[:, COUNT].sum()) / span


#: The figures compared (:func:`bench.lib.users.figures`' names), each of rows of replies.
FIGURES: dict[str, Callable[[Array], float]] = {
    "per_user_tokens_per_s_p50": lambda a: stats.percentile(_rates(a).tolist(), 50),
    "per_user_tokens_per_s_p10": lambda a: stats.percentile(_rates(a).tolist(), 10),
    "ttft_p99_s": lambda a: stats.percentile((a[:, FIRST] - a[:, SENT]).tolist(), 99),
    "goodput_tokens_per_s": goodput,
}


def compare(measured: list[list[SimReply]], simulated: list[list[SimReply]]) -> dict[str, Any]:
    """Both sides' figures and sim / measured with the paired bootstrap's intervals; replies
    paired by (repeat, user)."""
    m = np.array([row(x, r) for r, rep in enumerate(measured) for x in rep])
    s = np.array([row(x, r) for r, rep in enumerate(simulated) for x in rep])
    out: dict[str, Any] = {"measured": {}, "simulated": {}, "ratio": {}, "within_15pct": {}}
    for name, stat in FIGURES.items():
        out["measured"][name] = stat(m)
        out["simulated"][name] = stat(s)
        value, ci = stats.paired_ratio_ci(s, m, stat, seed=SEED)
        out["ratio"][name] = {"value": value, "ci": ci}
        out["within_15pct"][name] = abs(value - 1.0) <= TOLERANCE
    return out


# ------------------------------------------------------------------------------ simulated


def simulated(cell: Cell) -> list[list[SimReply]]:
    """The simulation of each repeat's users (one request each)."""
    out = []
    link = Link(RTT_MS / 1000.0, BANDWIDTH_BPS)
    plan = Plan(tokens=cell.tokens, requests_per_user=1)
    for prompts in cell.repeats:
        res = simulate(
            cell.mode,
            users(prompts, len(prompts), plan),
            costs(),
            link,
            start_spread_s=cell.start_spread_s,
            seed=SEED,
            batch=batch_limits(Plan()),
        )
        out.append(sorted(res.replies, key=lambda r: r.user))
    return out


# ------------------------------------------------------------------------------ real


def verifier_args(mode: SimMode, n: int, s: float, kv_tokens: int) -> list[str]:
    """The padded verifier's settings for ``n`` users of ``mode`` at time scale ``s``."""
    c = costs()
    b = batch_limits(Plan())
    args = [
        "--threads", "1",
        "--emulate-verify-ms", f"{c.verify_s * s * 1000:g}",
        "--emulate-decode-ms", f"{c.ar_s * s * 1000:g}",
        "--emulate-token-cost", f"{c.token_cost!r}",
        "--max-batch-tokens", str(b.max_tokens),
        "--prefill-chunk", str(b.prefill_chunk),
        "--prefill-share", f"{b.prefill_share:g}",
        "--ration" if b.ration else "--no-ration",
        "--ration-share", f"{b.ration_share:g}",
        "--max-batch-sessions", str(max(n, 64)),
        "--max-sessions", str(max(n, 64)),
        "--max-sessions-per-token", "0",
        "--kv-cache-tokens", str(kv_tokens),
        "--kv-session-share", "1",
        "--kv-token-share", "1",
        "--prefix-cache", "off",
    ]  # fmt: skip
    defaults = VerifierSettings()
    # a step waits this long for other sessions' work, in emulated time (the simulation has no
    # such wait: its engine starts a step with what has arrived)
    args += ["--batch-wait-ms", f"{defaults.batch_wait_ms * s:g}"]
    bounds = {f.name: f.metadata.get("max", math.inf) for f in dataclasses.fields(defaults)}
    for name in SCALED_SETTINGS:
        # within the setting's declared bound (progress_interval: 60 s, reached at S = 64; a
        # Progress frame only says a session's work is waiting, which nothing here reads)
        value = min(getattr(defaults, name) * s, bounds[name])
        args += [f"--{name.replace('_', '-')}", f"{value:g}"]
    limits = mode.session_limits()
    if mode.kind in (Kind.CLOUD_SD, Kind.HYBRID):
        args += [
            "--cloud-draft", ",".join(sorted(str(d) for d in limits.cloud_draft)) or "off",
            "--cloud-draft-tokens", str(limits.cloud_draft_tokens),
        ]  # fmt: skip
        if limits.cloud_model:
            args += [
                "--cloud-draft-model", DRAFT,
                "--emulate-cloud-draft-ms", f"{c.cloud_draft_s * s * 1000:g}",
            ]  # fmt: skip
    return args


def kv_tokens(repeats: Sequence[Sequence[Trace]], tokens: int) -> int:
    """A KV pool that holds every user's prompt, reply and co-generation ahead at once."""
    longest = max(len(t.prompt) for prompts in repeats for t in prompts)
    n = max(len(prompts) for prompts in repeats)
    return max(8192, -(-n * (longest + tokens + 256) // 1024) * 1024)


def scaled_retry(s: float) -> RetryPolicy:
    """The edge's deadlines (verdict, handshake, wait for a verifier, backoff) × ``s``."""
    d = RetryPolicy(max_attempts=2)
    return replace(
        d,
        handshake_timeout_s=d.handshake_timeout_s * s,
        deadline_s=d.deadline_s * s,
        verdict_timeout_s=d.verdict_timeout_s * s,
        backoff_initial_s=d.backoff_initial_s * s,
        backoff_max_s=d.backoff_max_s * s,
    )


@dataclass(frozen=True)
class Edges:
    """What the in-process users share: the draft model (its weights), its fingerprint and the
    target's EOS ids."""

    draft: LoadedModel
    eos: list[int]


async def measure(
    cell: Cell, vport: int, token: str, edges: Edges
) -> tuple[list[list[SimReply]], dict[str, Any]]:
    """Each repeat's users in real time against the verifier at ``vport``: their replies in
    emulated seconds from the repeat's start, and the edge's counts."""
    mode, n, s, tokens, offsets = cell.mode, cell.edges, cell.scale, cell.tokens, cell.offsets
    c = costs()
    cfg = mode.pipeline_config()
    failures: list[str] = []
    timed: list[TimedDrafter] = []
    agents: list[EdgeAgent] = []
    out: list[list[SimReply]] = []
    off_trace = 0
    async with contextlib.AsyncExitStack() as stack:
        warms = []
        for u in range(n):
            link = LinkConfig(rtt_ms=RTT_MS * s, bandwidth_bps=BANDWIDTH_BPS / s, seed=SEED + u)
            emu = await stack.enter_async_context(WanEmulator(("127.0.0.1", vport), link))
            warm = WarmLink(
                LinkSettings(
                    url=f"ws://127.0.0.1:{emu.port}/v1/session",
                    token=token,
                    heartbeat_s=0,
                    connect_timeout_s=LinkSettings.connect_timeout_s * s,
                )
            )
            stack.push_async_callback(warm.close)
            warms.append(warm)
            drafter = None
            if mode.kind != Kind.CLOUD_SD:
                drafter = TimedDrafter(edges.draft, c.draft_s * s, c.draft_batch_cost)
                timed.append(drafter)
            agent = EdgeAgent(
                drafter,
                edges.draft.fingerprint,
                warm.stream,
                retry=scaled_retry(s),
            )
            stack.callback(agent.close)
            agents.append(agent)
        await asyncio.gather(*(open_warm(w) for w in warms))
        # One short request first: the verifier's first forwards and its step-time estimates.
        warmup = list(cell.repeats[-1][-1].prompt)
        await run_spec(agents[0], cfg, warmup, WARMUP_TOKENS, edges.eos)
        for d in timed:
            d.steps = d.overruns = 0
            d.overrun_s = 0.0

        async def user(u: int, prompt: Trace) -> dict[str, Any]:
            await asyncio.sleep(offsets[u] * s)
            return await run_spec(agents[u], cfg, list(prompt.prompt), tokens, edges.eos, failures)

        for r, prompts in enumerate(cell.repeats):
            origin = time.perf_counter()
            results = await asyncio.gather(*(user(u, p) for u, p in enumerate(prompts)))
            replies = []
            for u, (p, res) in enumerate(zip(prompts, results, strict=True)):
                if not res["stamps"]:
                    raise RuntimeError(f"user {u} ({p.name}): no token committed")
                ids = list(res["text_ids"])
                off_trace += ids != list(p.path[: len(ids)])
                replies.append(
                    SimReply(
                        u,
                        p.name,
                        p.dataset,
                        tokens=res["tokens"],
                        sent_s=(res["t0"] - origin) / s,
                        first_s=(res["stamps"][0] - origin) / s,
                        done_s=(res["stamps"][-1] - origin) / s,
                        rounds=res["rounds"],
                        drafted=res["draft_tokens"],
                        accepted=res["accepted_tokens"],
                        rejections=res["rejections"],
                        cogen_tokens=res["cogen_tokens"],
                        predraft_hits=res["stats"].get("predraft_hits", 0),
                    )
                )
            out.append(replies)
            print(f"  repeat {r}: {sum(x.tokens for x in replies)} tokens", flush=True)
            await asyncio.sleep(RTT_MS / 1000.0 * s)  # the sessions' closes reach the verifier
    counts = {
        "edge_draft_steps": sum(d.steps for d in timed),
        "edge_draft_overruns": sum(d.overruns for d in timed),
        "edge_draft_overruns_by_user": [d.overruns for d in timed],
        # what the overruns added to a reply's draft steps on average, in emulated seconds
        "edge_draft_overrun_s_per_reply": sum(d.overrun_s for d in timed)
        / s
        / (n * len(cell.repeats)),
        "session_failures": failures,
        # replies whose real greedy text left the trace's path (a near-tie decided otherwise
        # on this CPU): their acceptance differs from the simulated one from there on
        "replies_off_trace": off_trace,
    }
    return out, counts


def run_cell(cell: Cell, edges: Edges, work: Path) -> dict[str, Any]:
    """One mode and N: the real runs against a fresh verifier, the simulation, the comparison."""
    mode, n, s = cell.mode, cell.edges, cell.scale
    token = secrets.token_urlsafe(16)
    token_file = write_tokens(work / f"token-{n}", [token])
    report = work / f"report-{mode.spec.replace(':', '_')}-{n}.json"
    port = free_port()
    args = verifier_args(mode, n, s, kv_tokens(cell.repeats, cell.tokens))
    cmd = verifier_command(TARGET, port, token_file, [*args, "--emulate-report", str(report)])
    t0 = time.monotonic()
    log_path = work / "verifier.log"
    try:
        with log_path.open("wb") as log, serving([cmd], stderr=log) as procs:
            wait_healthy(procs[0], f"http://127.0.0.1:{port}/health", 900, "the verifier")
            measured, counts = asyncio.run(measure(cell, port, token, edges))
            metrics = verifier_metrics(port)
    except Exception:
        tail = log_path.read_text(errors="replace")[-3000:]
        print(f"the verifier's log (its end):\n{tail}", file=sys.stderr, flush=True)
        raise
    wall = time.monotonic() - t0
    padded = json.loads(report.read_text()) if report.exists() else {}
    sim = simulated(cell)
    shown = verifier_command(TARGET, 0, Path("TOKEN_FILE"), args)
    return {
        "mode": mode.label,
        "mode_spec": mode.spec,
        "edges": n,
        "time_scale": s,
        "repeats": len(cell.repeats),
        "start_spread_s": cell.start_spread_s,
        **compare(measured, sim),
        "overruns": {
            **{k: v for k, v in counts.items() if k.startswith("edge_")},
            **{
                f"verifier_{side}_{k}": sum(x[k] for x in padded.get(side, []))
                for side in ("target", "cloud_draft")
                for k in ("forwards", "overruns")
            },
            # what the overruns added to the verifier's steps, in emulated seconds
            "verifier_overrun_s": sum(x["overrun_s"] for v in padded.values() for x in v) / s,
            "verifier_worst_overrun_s": max(
                (x["worst_overrun_s"] for side in padded.values() for x in side), default=0.0
            ),
        },
        "replies_off_trace": counts["replies_off_trace"],
        # the verifier's own drafts: the simulation's, and the verifier's counters (its
        # /metrics, the warm-up request included)
        "cloud_drafts": {
            "measured": metrics,
            "simulated": {
                "proposed": sum(r.cloud_drafted for rep in sim for r in rep),
                "accepted": sum(r.cloud_accepted for rep in sim for r in rep),
            },
        },
        "session_failures": counts["session_failures"],
        "wall_s": wall,
        "verifier_command": shlex.join(shown).replace("--port 0", "--port PORT"),
        "replies": [
            {
                "repeat": r,
                "user": x.user,
                "prompt": x.name,
                "measured": _reply(x),
                "simulated": _reply(y),
            }
            for r, (mr, sr) in enumerate(zip(measured, sim, strict=True))
            for x, y in zip(mr, sr, strict=True)
        ],
    }


def verifier_metrics(port: int) -> dict[str, float]:
    """The verifier's counters of its own drafts and of the ration (its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = METRIC.match(line)
        if m:
            out[m["name"] + (f"_{m['reason']}" if m["reason"] else "")] = float(m["value"])
    return out


#: The /metrics lines :func:`verifier_metrics` keeps.
METRIC = re.compile(
    r"^wanspec_(?P<name>cloud_draft_tokens_proposed|cloud_draft_tokens_accepted|"
    r"cloud_drafts_withheld|draft_cut_tokens|draft_deferred_batches|cogen_skipped)_total"
    r'(?:\{reason="(?P<reason>\w+)"\})?\s+(?P<value>\S+)$'
)


#: What each reply records beside its figures (both sides).
REPLY_COUNTS = ("rounds", "drafted", "accepted", "rejections", "cogen_tokens", "predraft_hits")


def _reply(r: SimReply) -> dict[str, float]:
    return {
        "tokens": r.tokens,
        "ttft_s": r.ttft_s,
        "tokens_per_s": r.tokens_per_s,
        **{k: getattr(r, k) for k in REPLY_COUNTS},
    }


# ------------------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = study_parser("capacity_validation", __doc__, paragraph=True)
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument(
        "--traces", type=Path, default=TRACES, help="acceptance traces (bench.lib.traces)"
    )
    p.add_argument("--edges", default=",".join(map(str, EDGES)), help="users N, comma-separated")
    p.add_argument("--modes", default=",".join(MODES), help="bench.lib.sim modes, comma-separated")
    p.add_argument("--tokens", type=int, default=TOKENS, help="tokens a reply")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode and N, prompts rotated")
    p.add_argument(
        "--time-scale-per-edge",
        type=float,
        default=SCALE_PER_USER,
        help="K: the real runs are dilated by S = max(--min-time-scale, K·N)",
    )
    p.add_argument("--min-time-scale", type=float, default=MIN_TIME_SCALE)
    p.add_argument(
        "--start-spread-s",
        type=float,
        default=0.0,
        help="users start at seeded uniform offsets in [0, this) emulated seconds, as "
        "bench.lib.sim.simulate draws them (default 0: all at once)",
    )
    p.add_argument("--smoke", action="store_true", help="N = 2, auto:predraft, 8 tokens, S = 2")
    args = p.parse_args(argv)
    if args.smoke:
        args.edges, args.modes, args.tokens, args.repeats = "2", "auto:predraft", 8, 1
        args.time_scale_per_edge, args.min_time_scale = 1.0, 1.0
    try:
        args.edges = tuple(int(x) for x in args.edges.split(",") if x.strip())
        args.modes = tuple(SimMode.parse(x) for x in args.modes.split(",") if x.strip())
    except ValueError as e:
        p.error(str(e))
    if not args.edges or min(args.edges) < 1 or not args.modes:
        p.error("--edges: expected users >= 1; --modes: at least one mode")
    if any(m.kind == Kind.AR for m in args.modes):
        p.error("--modes: ar has no edge agent (bench.net.ar_server); not validated here")
    if min(args.tokens, args.repeats, args.min_time_scale, args.time_scale_per_edge) <= 0:
        p.error("--tokens, --repeats and the time scale's settings must be positive")
    if args.start_spread_s < 0:
        p.error("--start-spread-s must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    t0 = time.monotonic()
    traces = load_traces(args.traces)
    measured = traces.measured()
    target = load_model(TARGET)
    edges = Edges(load_draft_model(DRAFT, target), eos_ids(target))
    doc: dict[str, Any] = {
        "settings": {
            "edges": list(args.edges),
            "modes": [m.spec for m in args.modes],
            "tokens": args.tokens,
            "repeats": args.repeats,
            "rtt_ms": RTT_MS,
            "bandwidth_bps": BANDWIDTH_BPS,
            "start_spread_s": args.start_spread_s,
            "start": "user u at a seeded uniform offset in [0, start_spread_s) emulated "
            "seconds (bench.lib.sim.simulate's draws; 0: all at once)",
            "prompts": f"user u of repeat r: measured prompt (u + r·N) mod {len(measured)}",
            "traces": str(args.traces),
            "target": TARGET,
            "draft": DRAFT,
            "costs": {**asdict(costs()), "forward_rule": Costs.FORWARD_RULE},
            "time_scale": f"S = max({args.min_time_scale:g}, {args.time_scale_per_edge:g}·N)",
            "bootstrap": f"paired by (repeat, user), {stats.RESAMPLES} resamples, seed {SEED}, "
            f"{stats.LEVEL:.0%} percentile intervals",
            "tolerance": TOLERANCE,
            "smoke": args.smoke,
        },
        "command": shlex.join(
            ["python", "-m", "bench", "capacity_validation", *(argv or sys.argv[1:])]
        ),
        "rows": [],
        "complete": False,
        "provenance": provenance(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wanspec-cv-") as tmp:
        for mode in args.modes:
            for n in args.edges:
                cell = Cell(
                    mode,
                    tuple(tuple(assigned(measured, n, r)) for r in range(args.repeats)),
                    args.tokens,
                    time_scale(n, args.time_scale_per_edge, args.min_time_scale),
                    args.start_spread_s,
                )
                print(f"{mode.label}, N = {n}, S = {cell.scale:g}", flush=True)
                result = run_cell(cell, edges, Path(tmp))
                doc["rows"].append(result)
                _print(result)
                doc["elapsed_s"] = round(time.monotonic() - t0, 1)
                args.out.write_text(json.dumps(doc, indent=1) + "\n")
    doc["complete"] = True
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out} in {doc['elapsed_s']:.0f} s")
    return 0


def _print(cell: dict[str, Any]) -> None:
    for name in FIGURES:
        r, m, sim = cell["ratio"][name], cell["measured"][name], cell["simulated"][name]
        print(
            f"  {name:<26} measured {m:8.3f}  sim {sim:8.3f}"
            f"  ratio {r['value']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"
            + ("" if cell["within_15pct"][name] else "  (off by > 15 %)"),
            flush=True,
        )
    o = cell["overruns"]
    print(
        f"  overruns: edge {o['edge_draft_overruns']}/{o['edge_draft_steps']} steps, verifier "
        f"{o['verifier_target_overruns']}/{o['verifier_target_forwards']} forwards, draft "
        f"{o['verifier_cloud_draft_overruns']}/{o['verifier_cloud_draft_forwards']} (adding "
        f"{o['edge_draft_overrun_s_per_reply']:.3f} s a reply, {o['verifier_overrun_s']:.3f} s "
        "to the verifier's steps, emulated); "
        f"wall {cell['wall_s']:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
