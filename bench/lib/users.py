"""N users sharing one verifier in the simulation: what a run simulates (:class:`Plan`: the RTT,
reply length, users, requests per user, the verifier's prefill chunk), who asks what
(:func:`users`), the verifier's scheduler limits (:func:`batch_limits`) and one run's figures
(:func:`figures`), as the capacity study (:mod:`bench.studies.capacity`) counts users and its
real-time check (:mod:`bench.studies.capacity_validation`) compares against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from bench.lib import stats
from bench.lib.sim import SIM_BATCH, CloudDraftKind, Reply, Request, SimResult
from bench.lib.traces import Trace
from cloud_verifier.engine.scheduler import BatchLimits

RTT_MS = 100.0
REPLY_TOKENS = 256
EDGES = (1, 4, 16, 64)
REQUESTS_PER_USER = 4
#: cloud-sd under load: the single-user best (long drafts) is not an operator's best, so these
#: configurations are searched too and "best cloud-sd" here is the one serving the most users
#: at the capacity study's headline service level (chosen on the measured prompts: a choice that
#: favours the baseline).
CLOUD_CANDIDATES: tuple[tuple[CloudDraftKind, int], ...] = tuple(
    (kind, gamma)
    for kind in (CloudDraftKind.MODEL, CloudDraftKind.MIXED)
    for gamma in (2, 4, 8, 16, 32)
)
MAX_USERS = 2048
#: The users-at-a-service-level search resolves N to within 1/RESOLUTION (0: exactly).
RESOLUTION = 0
#: :attr:`Plan.prefill_chunk` (vLLM's chunked-prefill step budget on large GPUs is of this order).
PREFILL_CHUNK = 2048
SEED = 0


@dataclass(frozen=True)
class Plan:
    """What one capacity run simulates."""

    rtt_ms: float = RTT_MS
    tokens: int = REPLY_TOKENS
    edges: tuple[int, ...] = EDGES
    requests_per_user: int = REQUESTS_PER_USER
    max_users: int = MAX_USERS
    resolution: int = RESOLUTION
    seed: int = SEED
    cloud_candidates: tuple[tuple[CloudDraftKind, int], ...] = CLOUD_CANDIDATES
    #: The verifier's forwards cost by the roofline model (bench.lib.costs.ROOFLINE_RULE), not the
    #: linear one fitted to the two H200 points.
    roofline: bool = False
    #: The verifier's ``prefill_chunk`` here: an H200 prefills a prompt of up to this many
    #: tokens in one step beside the rounds (the product's default, 512, suits a CPU, where a
    #: forward's overhead is small against its tokens); every mode runs with it.
    prefill_chunk: int = PREFILL_CHUNK


def users(traces: Sequence[Trace], n: int, plan: Plan) -> list[list[Request]]:
    """User u's requests: prompts u, u + 1, ... (mod the prompt count), one after another."""
    return [
        [Request(traces[(u + i) % len(traces)], plan.tokens) for i in range(plan.requests_per_user)]
        for u in range(n)
    ]


def batch_limits(plan: Plan) -> BatchLimits:
    """The verifier's scheduler limits in this study (the simulation's, with the plan's
    prefill chunk)."""
    return replace(SIM_BATCH, prefill_chunk=plan.prefill_chunk)


def figures(result: SimResult) -> dict[str, float]:
    """One simulation's row figures."""
    replies = result.replies
    tokens = sum(r.tokens for r in replies)
    rates = [r.tokens_per_s for r in replies]
    rejections = sum(r.rejections for r in replies)
    rounds = sum(r.rounds for r in replies)
    return {
        "per_user_tokens_per_s_p50": stats.percentile(rates, 50),
        "per_user_tokens_per_s_p10": stats.percentile(rates, 10),
        "p10_over_p50": stats.percentile(rates, 10) / max(1e-9, stats.percentile(rates, 50)),
        "ttft_p99_s": stats.percentile([r.ttft_s for r in replies], 99),
        "goodput_tokens_per_s": tokens / result.span_s,
        "verifier_busy_s_per_100_tokens": 100.0 * result.busy_s / max(1, tokens),
        "verifier_utilisation": result.busy_s / result.span_s,
        "replies": len(replies),
        # rejections no branch answered (the edge's count) and the uplink a round carries,
        # branch frames included
        "no_branch_ready": _no_branch_ready(replies, rejections),
        "uplink_bytes_per_round": sum(r.uplink_bytes for r in replies) / max(1, rounds),
        "branch_bytes_per_round": sum(r.hedge_bytes for r in replies) / max(1, rounds),
        # what the same branches would cost a cloud that drafted them itself (its draft
        # forwards, a batched step a level), beside what the verifier spends
        "branch_cloud_s_per_100_tokens": 100.0
        * sum(r.branch_cloud_s for r in replies)
        / max(1, tokens),
    }


def _no_branch_ready(replies: Sequence[Reply], rejections: int) -> float:
    """The share of rejections no prepared branch answered (``predraft_miss_none``, the
    edge's count); every one where the edge prepares none (no hit or miss counted at all)."""
    none = sum(r.predraft_miss_none for r in replies)
    counted = none + sum(r.predraft_hits + r.predraft_miss_alternative for r in replies)
    if rejections and not counted:
        return 1.0
    return none / max(1, rejections)
