"""Incremental decoding over a KV cache, shared by the edge (draft) and the cloud (target).

One :class:`CausalLM` holds one sequence (batch size 1): the token ids in its KV cache, the cache
itself, and the logits of the most recent positions so that, after rolling back with
:meth:`CausalLM.crop`, the distribution for the next token is available without recomputing.

Logits memory: a full ``[length, vocab]`` float32 buffer costs 192 KiB per token at vocab 49152
(~390 MiB at 2k tokens), so only the rows of the last ``logits_window`` positions are kept
(default 256: more than any number of tokens a speculative round rolls back). If a crop goes
further back than that, :attr:`CausalLM.last_logits` recomputes the missing row with one
single-token forward (crop one more token, extend it again). ``logits_window=None`` keeps all rows.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from transformers import DynamicCache

__all__ = ["CausalLM", "ContextLengthError", "SupportsCausalLM"]


class ContextLengthError(ValueError):
    """Extending would exceed the model's maximum context (max_position_embeddings)."""


class SupportsCausalLM(Protocol):
    """What :class:`CausalLM` needs from a loaded model (e.g. ``shared.models.LoadedModel``)."""

    @property
    def model(self) -> Any: ...

    @property
    def vocab_size(self) -> int: ...


def _max_positions(model: Any) -> int | None:
    config = model.config
    getter = getattr(config, "get_text_config", None)
    text_config = getter() if callable(getter) else config
    value = getattr(text_config, "max_position_embeddings", None)
    return int(value) if value is not None else None


class CausalLM:
    """Single-sequence incremental runner over a transformers causal LM.

    Invariants: ``cache.get_seq_length() == len(self._tokens)``; ``self._rows[i]`` holds the
    float32 logits for position ``self._rows_start + i`` (predicting the token after it) and the
    rows cover a suffix of positions ``[self._rows_start, length)``.
    """

    def __init__(self, loaded: SupportsCausalLM, *, logits_window: int | None = 256) -> None:
        if logits_window is not None and logits_window < 1:
            raise ValueError(f"logits_window must be >= 1 or None, got {logits_window}")
        self.model: Any = loaded.model
        self.vocab_size: int = int(loaded.vocab_size)
        self.logits_window = logits_window
        self.max_length: int | None = _max_positions(self.model)
        self.device: torch.device = next(self.model.parameters()).device
        params = inspect.signature(self.model.forward).parameters
        # transformers >= 5.x names the cache kwarg `cache` (past_key_values is deprecated).
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._supports_logits_to_keep = "logits_to_keep" in params
        self._tokens: list[int] = []
        self._rows: list[torch.Tensor] = []
        self._rows_start = 0
        self._cache: Any = self._new_cache()

    # ------------------------------------------------------------------ state

    def _new_cache(self) -> Any:
        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # older transformers without the config argument
            cache = DynamicCache()
        # Sliding-window layers can only be rolled back if they record past states.
        activate = getattr(cache, "activate_past_recording", None)
        if callable(activate):
            activate()
        return cache

    @property
    def length(self) -> int:
        """Number of tokens in the KV cache."""
        return len(self._tokens)

    @property
    def tokens(self) -> tuple[int, ...]:
        """Token ids in the KV cache, in order."""
        return tuple(self._tokens)

    @property
    def cache(self) -> Any:
        """The underlying transformers cache (read-only use)."""
        return self._cache

    def reset(self) -> None:
        """Empty the cache."""
        self._tokens.clear()
        self._rows.clear()
        self._rows_start = 0
        self._cache = self._new_cache()

    # ------------------------------------------------------------------ forward

    def extend(self, ids: Sequence[int], *, last_rows: int | None = None) -> torch.Tensor:
        """Append ``ids`` to the cache with one forward; return their logits.

        Returns float32 ``[len(ids), vocab_size]`` (on the model's device); row j predicts the
        token after ``ids[j]``. With ``last_rows=k`` only the last k rows are computed and
        returned (``[k, vocab_size]``), e.g. for a long prefill where only the end matters.
        """
        n = len(ids)
        if n == 0:
            raise ValueError("extend() needs at least one token id")
        if last_rows is not None and not 1 <= last_rows <= n:
            raise ValueError(f"last_rows must be in 1..{n}, got {last_rows}")
        id_list = [int(t) for t in ids]
        if min(id_list) < 0 or max(id_list) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {id_list}")
        start = self.length
        if self.max_length is not None and start + n > self.max_length:
            raise ContextLengthError(
                f"context of {start + n} tokens exceeds the model's maximum of {self.max_length}"
            )
        input_ids = torch.tensor([id_list], dtype=torch.long, device=self.device)  # [1, n]
        position_ids = torch.arange(start, start + n, device=self.device).unsqueeze(0)  # [1, n]
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            self._cache_kwarg: self._cache,
            "use_cache": True,
        }
        if last_rows is not None and self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = last_rows
        try:
            with torch.inference_mode():
                out = self.model(**kwargs)
                logits: torch.Tensor = out.logits[0].float()  # [n or last_rows, vocab]
                if last_rows is not None:
                    logits = logits[-last_rows:]
                logits = logits[:, : self.vocab_size]
        except BaseException:
            self._rollback_layers(start)
            raise
        self._tokens.extend(id_list)
        seen = self._cache.get_seq_length()
        if seen != self.length:
            raise RuntimeError(f"KV cache holds {seen} tokens, expected {self.length}")
        self._store_rows(logits, first_pos=self.length - logits.shape[0])
        return logits

    def _store_rows(self, logits: torch.Tensor, first_pos: int) -> None:
        """Remember rows for positions [first_pos, length), trimmed to the window."""
        keep = logits.shape[0] if self.logits_window is None else self.logits_window
        if first_pos != self._rows_start + len(self._rows):
            # A gap (rows skipped via last_rows): older rows are no longer contiguous.
            self._rows.clear()
            self._rows_start = first_pos
        # Copy so the caller may modify the returned tensor, and so a long prefill's full
        # logits tensor is not kept alive by views of a few rows.
        kept = logits[-keep:].clone()
        self._rows.extend(kept.unbind(0))
        excess = len(self._rows) - keep
        if excess > 0:
            del self._rows[:excess]
            self._rows_start += excess
        self._rows_start = self.length - len(self._rows)

    def _rollback_layers(self, n: int) -> None:
        """After a failed forward, bring every cache layer back to ``n`` tokens (or reset)."""
        try:
            with torch.inference_mode():
                for layer in self._cache.layers:
                    extra = layer.get_seq_length() - n
                    if extra > 0:
                        layer.crop(-extra)
            ok = self._cache.get_seq_length() == n
        except Exception:
            ok = False
        if not ok:
            self.reset()  # cannot trust a half-updated cache: start over

    def crop(self, n: int) -> None:
        """Roll the cache back to its first ``n`` tokens (0 <= n <= length)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"crop({n}) out of range 0..{self.length}")
        if n == self.length:
            return
        if n == 0:
            self.reset()
            return
        with torch.inference_mode():
            # Negative = number of tokens to remove: the only form transformers 5.x accepts,
            # and also understood by 4.x (where a positive value meant the absolute length).
            self._cache.crop(n - self.length)
        del self._tokens[n:]
        if self._rows_start >= n:
            self._rows.clear()
            self._rows_start = n
        else:
            del self._rows[n - self._rows_start :]
        seen = self._cache.get_seq_length()
        if seen != n:
            raise RuntimeError(f"KV cache holds {seen} tokens after crop, expected {n}")

    @property
    def last_logits(self) -> torch.Tensor:
        """float32 ``[vocab_size]`` logits predicting the token after the last cached one."""
        if self.length == 0:
            raise ValueError("no tokens in the cache: nothing to predict from")
        pos = self.length - 1
        if self._rows and self._rows_start <= pos < self._rows_start + len(self._rows):
            return self._rows[pos - self._rows_start].clone()
        # Row evicted (crop beyond the window): recompute it with a one-token forward.
        last = self._tokens[-1]
        self.crop(pos)
        return self.extend([last])[0].clone()
