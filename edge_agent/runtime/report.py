"""The statistics of one generation, from its :class:`~edge_agent.session.generation.Summary`:
:func:`result_json` (the daemon's ``"wanspec"`` object, the ``--json`` line of
``edge-agent generate``/``demo``) and the words a person reads: :func:`plain_line` (the line
under an answer, in words a newcomer knows) and :func:`detail_line` (the speculation's
internals, with ``--verbose`` and in the REPL's ``/stats``), both read from that object.
"""

from __future__ import annotations

from typing import Any

from edge_agent.session.generation import Summary, TokenSource
from edge_agent.session.pipeline_config import PipelineConfig


def ratio(num: float, den: float, digits: int) -> float | None:
    """``num / den`` rounded to ``digits``, or None when there is nothing to divide by
    (``den`` ≤ 0: no rounds, no tokens, no time)."""
    return round(num / den, digits) if den > 0 else None


def result_json(
    summary: Summary, text: str, wall_s: float, cfg: PipelineConfig, *, cloud_only: bool = False
) -> dict[str, Any]:
    """The ``--json`` summary of one generation. ``cloud_only``: the edge had no draft model
    (``draft = "none"``; the verifier's own drafts are counted in ``token_sources``)."""
    st = summary.stats
    n = len(summary.generated)
    federated = summary.federation is not None
    out = {
        "text": text,
        "tokens": n,
        # the generated token ids (no need to re-tokenize the text: a sampled text may split
        # into other tokens than it was generated as)
        "token_ids": list(summary.generated),
        "cloud_only": cloud_only,
        "finish_reason": summary.finish_reason,
        "wall_s": round(wall_s, 4),
        "tokens_per_s": ratio(n, wall_s, 3),
        "rounds": st.rounds,
        "draft_tokens": st.draft_tokens,
        "accepted_tokens": st.accepted_tokens,
        "acceptance_rate": ratio(st.accepted_tokens, st.draft_tokens, 4),
        "mean_accepted_per_round": ratio(st.accepted_tokens, st.rounds, 4),
        "accepted_per_position": st.accepted_per_position,
        "rejections": st.rejections,
        "bonus_tokens": st.bonus_tokens,
        "discarded_batches": st.discarded_batches,
        "discarded_tokens": st.discarded_tokens,
        # Rationing: rounds the verifier cut short under load, and their unjudged drafts.
        "cut_rounds": st.cut_rounds,
        "cut_tokens": st.cut_tokens,
        "resamples": st.resamples,
        # Link-down fallback: tokens the draft produced alone, never checked by a verifier.
        "verified": summary.unverified_tokens == 0,
        "unverified_tokens": summary.unverified_tokens,
        "unverified_spans": [list(span) for span in summary.unverified],
        "reconnects": st.reconnects,
        "resumed_tokens": st.resumed_tokens,
        "prompt_cached_tokens": st.prompt_cached_tokens,
        "draft_prompt_cached_tokens": st.draft_prompt_cached_tokens,
        "busy_refusals": st.busy_refusals,
        "admission_wait_ms": round(1000 * st.admission_wait_s, 2),
        "progress_frames": st.progress_frames,
        "uplink_bytes": st.uplink_bytes,
        "downlink_bytes": st.downlink_bytes,
        "uplink_bytes_per_round": ratio(st.uplink_bytes, st.proposes_sent, 2),
        # Token trees: the branch frames sent (their bytes are part of uplink_bytes), and those
        # held back for the branch uplink budget (branch_uplink).
        "branch_frames": st.hedges_sent,
        "branch_bytes": st.hedge_bytes,
        "branch_frames_held": st.branch_frames_held,
        # (federated rounds carry distributions in every reply, not corrections on rejection)
        "downlink_bytes_per_rejection": (
            None if federated else ratio(st.downlink_rejection_bytes, st.rejections, 2)
        ),
        "bytes_per_token": ratio(st.uplink_bytes + st.downlink_bytes, n, 2),
        "drafter_idle_s": round(st.drafter_wait_s, 4),
        "federation": federation_json(summary),
        "token_sources": {str(s): n for s, n in st.sources.items()},
        "mode": cfg.mode,
        # The values used (in auto mode, the controller's): at the last verdict, and the mean
        # over verdicts; the configured start values before any verdict.
        "gamma": st.gamma_last or cfg.gamma,
        "depth": st.depth_last or cfg.effective_depth,
        "gamma_mean": ratio(st.gamma_sum, st.rounds, 3),
        "depth_mean": ratio(st.depth_sum, st.rounds, 3),
        "correction": cfg.wire_correction,
        "temperature": cfg.sampling.temperature,
    }
    return out


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, in the plural unless ``n`` is 1: ``1 token``, ``2 tokens``;
    ``many`` is the plural when adding an s does not make it (``batches``)."""
    return f"{n} {word if n == 1 else many or word + 's'}"


def _ms(v: float) -> str:
    """Milliseconds, to the unit once there are ten or more."""
    return f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


#: The token sources that are the cloud's writing: the target's own tokens (a rejection's
#: correction, a bonus, a co-generated token) and its own drafts (cloud-only).
_CLOUD_SOURCES = (
    TokenSource.CORRECTION,
    TokenSource.BONUS,
    TokenSource.COGENERATED,
    TokenSource.CLOUD_DRAFT,
)


def plain_line(st: dict[str, Any]) -> str:
    """The line under an answer, for anyone: its length and speed, the wait for the first
    token, how much of the edge's drafting the cloud kept and how many tokens the cloud wrote
    itself, the round trip; and, loudly, text no verifier checked. ``st``: a generation's
    statistics (:func:`result_json` and the service's ``ttft_ms``/``rtt_ms``)."""
    parts: list[str] = []
    if st.get("tokens") is not None:
        head = plural(int(st["tokens"]), "token")
        if st.get("wall_s") is not None:
            head += f" in {st['wall_s']:.2f} s"
        if st.get("tokens_per_s") is not None:
            head += f" ({st['tokens_per_s']:.1f} tok/s)"
        parts.append(head)
    if st.get("ttft_ms") is not None:
        parts.append(f"first token {_ms(st['ttft_ms'])}")
    sources = st.get("token_sources") or {}
    if st.get("cloud_only"):
        parts.append("no draft model here: the cloud drafted for itself")
    else:
        acc = st.get("acceptance_rate")
        if acc is None:
            parts.append("no edge draft checked")
        else:
            parts.append(f"the cloud agreed with {acc:.0%} of the edge's drafts")
        if sources:
            cloud = sum(int(sources.get(str(s), 0)) for s in _CLOUD_SOURCES)
            total = st.get("tokens")
            of = plural(cloud, "token") if total is None else f"{cloud} of {plural(total, 'token')}"
            parts.append(f"{of} written by the cloud")
    if st.get("verified") is False:
        n = st.get("unverified_tokens")
        what = "" if n is None else plural(int(n), "token") + " "
        parts.append(f"UNVERIFIED: {what}from the edge's draft alone (no verifier)")
    if st.get("rtt_ms") is not None:
        parts.append(f"round trip {_ms(st['rtt_ms'])}")
    return " · ".join(parts)


def detail_line(st: dict[str, Any]) -> str:
    """The speculation's internals (``--verbose``, ``/stats``): the mode, γ and D (the last
    and the mean), acceptance and tokens accepted per round, rounds, rejections and discarded
    batches, the bytes each way (per round up; per rejection down, where corrections came
    as frames), bytes per token, and every token source by its name."""

    def num(key: str, spec: str = "g") -> str:
        v = st.get(key)
        return "n/a" if v is None else f"{v:{spec}}"

    parts: list[str] = []
    up = f"up {num('uplink_bytes')} B"
    down = f"down {num('downlink_bytes')} B"
    if st.get("cloud_only"):
        parts.append("cloud-only: no edge drafts")
    else:
        means = ""
        if st.get("gamma_mean") is not None:
            means = f" (mean {num('gamma_mean')}/{num('depth_mean')})"
        parts.append(f"{st.get('mode', 'n/a')} γ={num('gamma')} D={num('depth')}{means}")
        rounds = int(st.get("rounds") or 0)
        parts.append(
            f"acceptance {num('acceptance_rate', '.0%')}, "
            f"{num('mean_accepted_per_round', '.2f')} accepted/round over "
            f"{plural(rounds, 'round')}"
        )
        rejections = int(st.get("rejections") or 0)
        discarded = int(st.get("discarded_batches") or 0)
        parts.append(
            f"{plural(rejections, 'rejection')}, "
            f"{plural(discarded, 'discarded batch', 'discarded batches')}"
        )
        if st.get("uplink_bytes_per_round") is not None:
            up += f" ({num('uplink_bytes_per_round')} B/round)"
        per_rejection = st.get("downlink_bytes_per_rejection")
        if rejections and per_rejection:
            down += f" ({per_rejection:g} B/rejection)"
        elif rejections and per_rejection is not None:
            # No correction frame came down: the co-generated tokens that overtook the drafts
            # had made each rejection known (0 B a rejection is not a free correction).
            down += (
                " (no correction frame: co-generated tokens made the rejection known)"
                if rejections == 1
                else " (no correction frames: co-generated tokens made the rejections known)"
            )
    parts.append(f"{up}, {down}")
    if st.get("bytes_per_token") is not None:
        parts.append(f"{num('bytes_per_token', '.1f')} B/token")
    if st.get("token_sources"):
        parts.append(f"tokens from: {sources_line(st['token_sources'])}")
    return " · ".join(parts)


#: How :func:`sources_line` names each token source.
_SOURCE_WORDS: dict[str, str] = {
    TokenSource.EDGE_DRAFT: "edge drafts",
    TokenSource.CORRECTION: "corrections",
    TokenSource.BONUS: "bonus",
    TokenSource.COGENERATED: "co-generated",
    TokenSource.CLOUD_DRAFT: "cloud drafts",
    TokenSource.LOCAL_DRAFT: "draft alone (unverified)",
}


def sources_line(sources: dict[str, int]) -> str:
    """``token_sources`` (:func:`result_json`) for people: each source with its count and share,
    the largest first, sources with no token left out."""
    total = sum(sources.values())
    if total == 0:
        return "none"
    parts = sorted(((n, s) for s, n in sources.items() if n), key=lambda x: -x[0])
    return ", ".join(f"{_SOURCE_WORDS.get(s, s)} {n} ({n / total:.0%})" for n, s in parts)


def federation_json(summary: Summary) -> dict[str, Any] | None:
    """The SpecFed measurements of a federated generation (None in single-verifier mode)."""
    fed = summary.federation
    if fed is None:
        return None
    n = max(1, fed.positions_measured)
    return {
        "positions_measured": fed.positions_measured,
        "mean_eps_per_worker": [round(e, 6) for e in fed.mean_eps()],
        "mean_bias_bound": round(fed.bias_bound_sum / n, 6),
        "mean_bias_upper": round(fed.bias_upper_sum / max(1, fed.bias_upper_count), 6),
        "bound_violations": fed.bound_violations,
        "rounds_with_missing_workers": fed.rounds_with_missing_workers,
        "worker_drops": fed.worker_drops,
        "worker_rejoins": fed.worker_rejoins,
    }
