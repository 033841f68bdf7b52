"""The verifier's draft model (``cloud_draft_model``): cloud-side speculation with a model.

A small model of the target's tokenizer on the target's device (``self:skip=N`` shares the
target's weights), with a paged KV pool of its own, run by the engine's thread like the target:
one greedy draft step is **one batched forward over every session** that drafts in this step.
Each session's draft cache follows its text lazily: before drafting, the cache is cropped to
its longest common prefix with the text (tokens drafted last time and not accepted go; the
target's accepted tokens are fed), then ``n`` tokens are drafted greedily, one batched forward
each. Only the drafted ids reach the host.

Exactness (Leviathan et al., with a deterministic draft): a drafted token is the argmax of the
draft model after the text before it, a function of that text alone, so q is a point mass and
the co-generation forward verifies it by the greedy-draft rule
(:class:`~cloud_verifier.engine.work.CoGenerate`).

A session whose draft cache finds no free page is not drafted for in that step (its
co-generation decodes one token): the draft pool never fails the target's work.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cloud_verifier.engine.targets import Target, TorchTarget
from shared.runtime.batched_lm import Row
from shared.runtime.kv_pool import OutOfPages, PagedKV, SlotPages, common_prefix

log = logging.getLogger(__name__)

__all__ = ["CloudDrafter", "DraftRequest", "load_draft_target"]


@dataclass(frozen=True)
class DraftRequest:
    """Draft up to ``n`` tokens after ``text`` in the draft cache ``pages``."""

    pages: SlotPages
    text: Sequence[int]
    n: int


class CloudDrafter:
    """A draft model and its KV pool (module docstring). ``vocab_size``: the target's; the
    argmax is taken over its ids only (a draft model's logits may be wider)."""

    def __init__(self, model: Target, pool: PagedKV, vocab_size: int) -> None:
        self.model = model
        self.pool = pool
        self.vocab_size = vocab_size
        self.description = model.description
        self.forwards = 0  # batched draft forwards

    def release(self, pages: SlotPages) -> None:
        self.pool.release(pages)

    def draft(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Greedy drafts for ``requests``, in order (empty: none drafted for that one)."""
        out: list[list[int]] = [[] for _ in requests]
        # (request index, the row to run) of the sessions still drafting
        live: list[tuple[int, Row]] = []
        for i, r in enumerate(requests):
            if r.n <= 0 or not r.text:
                continue
            # Feed at least the last token: its row predicts the first draft token.
            keep = min(common_prefix(r.pages.tokens, r.text), len(r.text) - 1)
            self.pool.crop(r.pages, keep)
            try:
                self.pool.reserve(r.pages, len(r.text) + r.n - 1)
            except OutOfPages:
                continue
            live.append((i, Row(r.pages, keep, tuple(r.text[keep:]), 1)))
        while live:
            logits = self.model.forward([row for _, row in live])  # [len(live), V]
            self.forwards += 1
            ids = torch.argmax(logits[:, : self.vocab_size], dim=-1).tolist()
            following: list[tuple[int, Row]] = []
            for (i, row), token in zip(live, ids, strict=True):
                self.pool.commit(row.slot, row.start, row.ids)
                out[i].append(token)
                if len(out[i]) < requests[i].n:
                    following.append((i, Row(row.slot, row.start + len(row.ids), (token,), 1)))
            live = following
        return out


def load_draft_target(spec: str, target: Target, *, compile_forward: bool = False) -> Target:
    """The draft model named by ``spec`` on ``target``'s device and dtype (blocking: on the
    engine's thread). ``self:...`` derives it from the target's weights (shared), so it needs
    a loaded transformers target; any other spec must share the target's tokenizer."""
    from shared.runtime.model_spec import SpecKind, parse_model_spec
    from shared.runtime.models import load_model

    parsed = parse_model_spec(spec)
    if parsed.kind == SpecKind.SELF:
        if not isinstance(target, TorchTarget):
            raise ValueError(f"cloud_draft_model {spec!r}: a self-draft needs a model target")
        loaded = load_model(parsed, base=target.loaded)
    else:
        dtype = target.dtype if isinstance(target, TorchTarget) else torch.float32
        loaded = load_model(parsed, device=str(target.device), dtype=dtype)
    draft = TorchTarget(loaded, compile_forward=compile_forward)
    why = draft.fingerprint.compatible_with(target.fingerprint)
    if why is not None:
        raise ValueError(f"cloud_draft_model {spec!r} does not fit the target: {why}")
    log.info("cloud draft model: %s", draft.description)
    return draft
