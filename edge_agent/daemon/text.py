"""Text in, text out, statistics: the pieces every edge front end shares.

Prompts to token ids (:func:`encode_prompt`, with or without the chat template), committed ids to
streamed text (:class:`TextStreamer`), the statistics of one generation (:func:`result_json`,
the daemon's ``"wanspec"`` object and the ``--json`` line of ``edge-agent generate``/``demo``),
the TLS context of a verifier link. The commands themselves run on
:class:`~edge_agent.daemon.service.EdgeService`, like the daemon.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

from edge_agent.session.generation import Generation, TokenSource
from edge_agent.session.pipeline_config import PipelineConfig
from shared.runtime.models import LoadedModel, LoadedTokenizer


def eos_ids(loaded: LoadedModel | LoadedTokenizer) -> list[int]:
    """The ids that end a generation: the tokenizer's and the generation config's."""
    ids: set[int] = set()
    tok_eos = loaded.tokenizer.eos_token_id
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    if isinstance(loaded, LoadedTokenizer):
        ids.update(loaded.generation_eos_ids)
        return sorted(ids)
    gen_cfg = getattr(loaded.model, "generation_config", None)
    cfg_eos = getattr(gen_cfg, "eos_token_id", None)
    if isinstance(cfg_eos, int):
        ids.add(cfg_eos)
    elif isinstance(cfg_eos, list):
        ids.update(int(t) for t in cfg_eos)
    return sorted(ids)


def encode_prompt(loaded: LoadedModel | LoadedTokenizer, prompt: str, *, chat: bool) -> list[int]:
    tok: Any = loaded.tokenizer
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"{loaded.name} has no chat template; use --no-chat-template")
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    ids = tok(prompt, add_special_tokens=True)["input_ids"]
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    return [int(t) for t in ids]


class TextStreamer:
    """Turns committed token ids into text increments (whole characters only)."""

    def __init__(self, tokenizer: Any, write: Callable[[str], None]) -> None:
        self.tok = tokenizer
        self.write = write
        self.ids: list[int] = []
        self.emitted = 0

    def __call__(self, new_ids: list[int]) -> None:
        self.ids += new_ids
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        # Hold back a trailing partial UTF-8 sequence until its next token arrives.
        if text.endswith("\ufffd"):
            return
        if len(text) > self.emitted:
            self.write(text[self.emitted :])
            self.emitted = len(text)

    def text(self) -> str:
        out: str = self.tok.decode(self.ids, skip_special_tokens=True)
        return out


def ssl_context(ca_file: str | None, insecure: bool) -> ssl.SSLContext | bool:
    if insecure:
        return False
    if ca_file:
        return ssl.create_default_context(cafile=ca_file)
    return True


def ratio(num: float, den: float, digits: int) -> float | None:
    """``num / den`` rounded to ``digits``, or None when there is nothing to divide by
    (``den`` ≤ 0: no rounds, no tokens, no time)."""
    return round(num / den, digits) if den > 0 else None


def result_json(
    gen: Generation, text: str, wall_s: float, cfg: PipelineConfig, *, cloud_only: bool = False
) -> dict[str, Any]:
    """The ``--json`` summary of one generation. ``cloud_only``: the edge had no draft model
    (``draft = "none"``; the verifier's own drafts are counted in ``token_sources``)."""
    st = gen.stats
    n = len(gen.generated)
    out = {
        "text": text,
        "tokens": n,
        # the generated token ids (no need to re-tokenize the text: a sampled text may split
        # into other tokens than it was generated as)
        "token_ids": gen.generated,
        "cloud_only": cloud_only,
        "finish_reason": gen.finish_reason,
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
        "verified": gen.unverified_tokens == 0,
        "unverified_tokens": gen.unverified_tokens,
        "unverified_spans": [list(span) for span in gen.unverified],
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
            ratio(st.downlink_rejection_bytes, st.rejections, 2) if gen.federation is None else None
        ),
        "bytes_per_token": ratio(st.uplink_bytes + st.downlink_bytes, n, 2),
        "drafter_idle_s": round(st.drafter_wait_s, 4),
        "federation": federation_json(gen),
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


def federation_json(gen: Generation) -> dict[str, Any] | None:
    """The SpecFed measurements of a federated generation (None in single-verifier mode)."""
    fed = gen.federation
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
