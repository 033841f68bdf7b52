"""One batched forward of a transformers causal LM over a paged KV pool (the runtime of both the
verifier's engine and the edge's drafter).

:meth:`BatchedLM.forward` runs a list of :class:`Row` (a slot of the pool, the position of its
first new token, the new token ids, how many of the last logits rows it needs) in one forward
and returns those rows' float32 logits, ``[Σ keep, V]``, on the model's device, in row order.
Rows of different lengths and positions share the forward: ids padded to the longest row,
per-row ``position_ids``, a 4D additive mask (causal within the row's own positions, nothing past
them), the lm head applied only to the rows asked for. A *tree* row (``parents``) holds several
continuations of one prefix side by side: each token is placed at its depth and sees the cache
before the row and its own ancestors in the row (a tree attention mask, as in SpecInfer). The
caller owns the slots' lengths: a forward writes keys at the rows' positions and commits
nothing (:mod:`shared.runtime.kv_pool`).

``compile_forward``: the model call goes through ``torch.compile`` and shapes are bucketed
(batch and tokens to powers of two, key length to a multiple of 64) so that few graphs are
built.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shared.runtime.kv_pool import PagedKV, SlotPages, StepCache

log = logging.getLogger(__name__)

__all__ = ["BatchedLM", "Row"]


@dataclass(frozen=True)
class Row:
    """One sequence's part of a batched forward: write ``ids`` at positions ``start, start+1,
    ...`` of ``slot`` (whose pages cover them) and return the logits of the last ``keep`` (0: none,
    the row only caches its keys: a prefill chunk).

    ``parents`` (a tree row): for each id, the index in ``ids`` of the token it follows, −1 for
    the last token before the row (parents[i] < i). Id i's keys are still written at
    ``start + i`` (the row's layout), but its position (RoPE) is ``start + depth(i)`` and it
    attends to the cache before ``start`` and to its ancestors and itself only. None: a chain
    (parents (−1, 0, 1, ...))."""

    slot: SlotPages
    start: int
    ids: tuple[int, ...]
    keep: int
    parents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.ids or not 0 <= self.keep <= len(self.ids) or self.start < 0:
            raise ValueError(f"bad row: start {self.start}, {len(self.ids)} ids, keep {self.keep}")
        if self.parents is not None and (
            len(self.parents) != len(self.ids)
            or any(not -1 <= a < i for i, a in enumerate(self.parents))
        ):
            raise ValueError(f"bad tree row: parents {self.parents} for {len(self.ids)} ids")

    def depths(self) -> list[int]:
        """Each id's depth: its position is ``start + depth``."""
        if self.parents is None:
            return list(range(len(self.ids)))
        out: list[int] = []
        for a in self.parents:
            out.append(0 if a < 0 else out[a] + 1)
        return out

    def ancestors(self) -> list[list[bool]]:
        """[n, n]: entry [i][j] says whether id j is id i or one of its ancestors."""
        n = len(self.ids)
        if self.parents is None:
            return [[j <= i for j in range(n)] for i in range(n)]
        out: list[list[bool]] = []
        for i, a in enumerate(self.parents):
            row = list(out[a]) if a >= 0 else [False] * n
            row[i] = True
            out.append(row)
        return out


def _text_config(model: Any) -> Any:
    getter = getattr(model.config, "get_text_config", None)
    return getter() if callable(getter) else model.config


class BatchedLM:
    """A transformers causal LM (eval mode) and the KV pool its forwards use."""

    def __init__(self, model: Any, vocab_size: int, *, compile_forward: bool = False) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.device: torch.device = next(model.parameters()).device
        self.dtype: torch.dtype = next(model.parameters()).dtype
        cfg = _text_config(model)
        limit = getattr(cfg, "max_position_embeddings", None)
        self.max_length: int | None = int(limit) if limit is not None else None
        window = int(getattr(cfg, "sliding_window", None) or 0)
        layer_types = getattr(cfg, "layer_types", None) or ()
        sliding = window > 0 and any("sliding" in str(t) for t in layer_types)
        # One mask serves every layer: past the window, sliding layers would see too much.
        if sliding and (self.max_length is None or window < self.max_length):
            log.warning("sliding-window layers: context per sequence capped at %d", window)
            self.max_length = window
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in ("sdpa", "eager"):
            # The batched forward hands attention an explicit 4D mask: sdpa and eager honour it.
            model.set_attn_implementation("sdpa")
        self._base = getattr(model, model.base_model_prefix)
        self._head = model.get_output_embeddings()
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        self._layers = int(cfg.num_hidden_layers)
        heads = int(cfg.num_attention_heads)
        self._kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        # Tensor parallelism (transformers' own): each rank computes and caches its share of
        # the KV heads; the pool holds only those.
        tp = int(getattr(model, "_tp_size", None) or 1)
        if self._kv_heads % tp:
            raise ValueError(f"{self._kv_heads} KV heads do not divide over {tp} ranks")
        self._kv_heads //= tp
        self.tp_size = tp
        self._head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self.compiled = compile_forward
        self._run: Any = torch.compile(self._run_eager) if compile_forward else self._run_eager
        self.pool: PagedKV | None = None

    def allocate(self, num_pages: int, page_size: int) -> PagedKV:
        """Preallocate the KV pool (once, before the first forward)."""
        self.pool = PagedKV(
            layers=self._layers,
            kv_heads=self._kv_heads,
            head_dim=self._head_dim,
            num_pages=num_pages,
            page_size=page_size,
            dtype=self.dtype,
            device=self.device,
        )
        return self.pool

    def kv_bytes_per_token(self) -> int:
        size = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self._layers * self._kv_heads * self._head_dim * size

    def _run_eager(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: StepCache,
        pick_b: torch.Tensor,
        pick_t: torch.Tensor,
    ) -> torch.Tensor:
        out = self._base(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            cache=cache,
            use_cache=True,
        )
        hidden = out.last_hidden_state[pick_b, pick_t]  # [rows, hidden]
        logits: torch.Tensor = self._head(hidden).float()
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def forward(self, rows: Sequence[Row]) -> torch.Tensor:
        """float32 logits [Σ row.keep, V] on the model's device (module docstring)."""
        pool = self.pool
        if pool is None:
            raise RuntimeError("allocate() the KV pool before the first forward")
        dev, p = self.device, pool.page_size
        b = len(rows)
        n = max(len(r.ids) for r in rows)
        kv_len = max(r.start + len(r.ids) for r in rows)
        if self.compiled:  # few distinct shapes for the compiled graph
            b_pad, n = 1 << (b - 1).bit_length(), 1 << (n - 1).bit_length()
            kv_len = -(-kv_len // 64) * 64
        else:
            b_pad = b
        ids = [[0] * n for _ in range(b_pad)]
        starts = [0] * b_pad
        lens = [0] * b_pad
        write = [pool.trash] * (b_pad * n)
        for i, r in enumerate(rows):
            m = len(r.ids)
            ids[i][:m] = r.ids
            starts[i], lens[i] = r.start, m
            write[i * n : i * n + m] = pool.flat_rows(r.slot, r.start, r.start + m)
        pos_t = torch.arange(kv_len, device=dev)
        first = pool.contiguous(rows[0].slot) if b_pad == 1 else None
        read: torch.Tensor | tuple[int, int]
        if first is not None and first + kv_len <= pool.trash:
            read = (first, kv_len)  # one slot, consecutive pages: a view of the pool
        else:
            pages = -(-kv_len // p)
            table = pool.page_table([r.slot for r in rows] + [SlotPages()] * (b_pad - b), pages)
            # read[b, t] = flat row of position t of slot b (trash past its pages; masked).
            page_of = table[:, pos_t // p]  # [B, L]
            read = torch.where(page_of >= 0, page_of * p + pos_t % p, pool.trash)
        start_t = torch.tensor(starts, dtype=torch.int64, device=dev)[:, None]  # [B, 1]
        len_t = torch.tensor(lens, dtype=torch.int64, device=dev)[:, None]
        q = torch.arange(n, device=dev)[None]  # [1, n]
        if any(r.parents is not None for r in rows):
            depth = [[0] * n for _ in range(b_pad)]
            anc = torch.zeros((b_pad, n, n), dtype=torch.bool)
            for i, r in enumerate(rows):
                m = len(r.ids)
                depth[i][:m] = r.depths()
                anc[i, :m, :m] = torch.tensor(r.ancestors(), dtype=torch.bool)
            position_ids = start_t + torch.tensor(depth, dtype=torch.int64, device=dev)
            # Query i of slot b sees the cache before start_b and, of the row's own layout
            # positions start_b + j, its ancestors-or-self j only.
            rel = pos_t[None] - start_t  # [B, L]: layout index in the row (< 0: the cache)
            in_row = (rel >= 0) & (rel < len_t)
            anc_dev = anc.to(dev)
            seen = torch.gather(anc_dev, 2, rel.clamp(0, n - 1)[:, None].expand(-1, n, -1))
            sees = (rel < 0)[:, None] | (in_row[:, None] & seen)  # [B, n, L]
        else:
            position_ids = start_t + q  # [B, n]
            # Row i of slot b sees positions <= start_b + i.
            sees = pos_t[None, None] <= position_ids[:, :, None]  # [B, n, L]
        # Padded queries see position 0 only (any non-empty set: their outputs are dropped,
        # and an empty row would give NaN).
        sees = torch.where((q < len_t)[:, :, None], sees, pos_t[None, None] == 0)
        mask = torch.zeros(sees.shape, dtype=self.dtype, device=dev)
        mask.masked_fill_(~sees, torch.finfo(self.dtype).min)
        pick_b = [i for i, r in enumerate(rows) for _ in range(r.keep)]
        pick_t = [t for r in rows for t in range(len(r.ids) - r.keep, len(r.ids))]
        cache = StepCache(pool, torch.tensor(write, dtype=torch.int64, device=dev), read)
        args = (
            torch.tensor(ids, dtype=torch.int64, device=dev),
            position_ids,
            mask[:, None],
            cache,
            torch.tensor(pick_b, dtype=torch.int64, device=dev),
            torch.tensor(pick_t, dtype=torch.int64, device=dev),
        )
        with torch.inference_mode():
            try:
                logits: torch.Tensor = self._run(*args)
            except Exception as e:
                if self._run == self._run_eager:
                    raise
                # A backend that cannot compile this model (e.g. no Triton for this GPU): say
                # so once and run eager from now on; the failed call committed nothing.
                log.warning("torch.compile failed (%s: %s); running eager", type(e).__name__, e)
                self._run, self.compiled = self._run_eager, False
                logits = self._run(*args)
        return logits[:, : self.vocab_size]
