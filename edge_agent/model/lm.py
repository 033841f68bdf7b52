"""Incremental decoding of one sequence over a KV cache (the edge's drafter, reference runs).

One :class:`CausalLM` holds one sequence (batch size 1) on the verifier's runtime
(:class:`shared.runtime.batched_lm.BatchedLM` over a :class:`shared.runtime.kv_pool.PagedKV`): the
token ids in its KV cache, the cache itself (one slot; rolling back moves its length pointer,
nothing is copied or recomputed) and the logits of the most recent positions so that, after rolling
back with :meth:`CausalLM.crop`, the distribution for the next token is available without
recomputing. The pool starts at ``capacity`` tokens and doubles when the sequence outgrows it
(up to the model's context); with ``compile_forward`` (default: on CUDA) the forward goes
through ``torch.compile``.

Logits memory: a full ``[length, vocab]`` float32 buffer costs 192 KiB per token at vocab 49152
(~390 MiB at 2k tokens), so only the rows of the last ``logits_window`` positions are kept
(default 256: more than any number of tokens a speculative round rolls back). If a crop goes
further back than that, :attr:`CausalLM.last_logits` recomputes the missing row with one
single-token forward (crop one more token, extend it again). ``logits_window=None`` keeps all rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from shared.errors import WanspecError
from shared.runtime.batched_lm import BatchedLM, Row
from shared.runtime.kv_pool import OutOfPages, SlotPages

__all__ = ["CausalLM", "ContextLengthError", "SupportsCausalLM"]

_PAGE = 64  # tokens per page of a CausalLM's pool (one slot: its pages stay consecutive)


class ContextLengthError(WanspecError, ValueError):
    """Extending would exceed the model's maximum context (max_position_embeddings)."""


class SupportsCausalLM(Protocol):
    """What :class:`CausalLM` needs from a loaded model (e.g.
    ``shared.runtime.models.LoadedModel``)."""

    @property
    def model(self) -> Any: ...

    @property
    def vocab_size(self) -> int: ...


class CausalLM:
    """Single-sequence incremental runner over a transformers causal LM.

    Invariants: the slot's tokens are the cache's (the pool moves them with its length:
    ``PagedKV.commit`` / ``crop``); ``self._rows[i]`` holds the
    float32 logits for position ``self._rows_start + i`` (predicting the token after it) and the
    rows cover a suffix of positions ``[self._rows_start, length)``.
    """

    def __init__(
        self,
        loaded: SupportsCausalLM,
        *,
        logits_window: int | None = 256,
        capacity: int = 1024,
        compile_forward: bool | None = None,
    ) -> None:
        if logits_window is not None and logits_window < 1:
            raise ValueError(f"logits_window must be >= 1 or None, got {logits_window}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.model: Any = loaded.model
        self.vocab_size: int = int(loaded.vocab_size)
        self.logits_window = logits_window
        self.device: torch.device = next(self.model.parameters()).device
        if compile_forward is None:
            compile_forward = self.device.type == "cuda"
        self._lm = BatchedLM(self.model, self.vocab_size, compile_forward=compile_forward)
        self.max_length: int | None = self._lm.max_length
        if self.max_length is not None:
            capacity = min(capacity, self.max_length)
        self._pool = self._lm.allocate(-(-capacity // _PAGE), _PAGE)
        self._slot = SlotPages()
        self._rows: list[torch.Tensor] = []
        self._rows_start = 0

    # ------------------------------------------------------------------ state

    @property
    def length(self) -> int:
        """Number of tokens in the KV cache."""
        return self._slot.length

    @property
    def tokens(self) -> tuple[int, ...]:
        """Token ids in the KV cache, in order."""
        return tuple(self._slot.tokens)

    @property
    def kv_length(self) -> int:
        """Positions the KV cache holds (equals :attr:`length`; for tests)."""
        return self._slot.length

    @property
    def kv_capacity(self) -> int:
        """Tokens the KV pool can hold before it grows."""
        return self._pool.num_pages * self._pool.page_size

    def reset(self) -> None:
        """Empty the cache."""
        self.crop(0)

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
        start = self.length
        id_list = self._checked(start, ids)
        self._reserve(self._slot, start, start + n)
        keep = n if last_rows is None else last_rows
        # A failed forward commits nothing: the length pointer has not moved.
        logits = self._lm.forward([Row(self._slot, start, id_list, keep)])
        self._pool.commit(self._slot, start, id_list)
        self._store_rows(logits, first_pos=self.length - logits.shape[0])
        return logits

    def _checked(self, start: int, ids: Sequence[int]) -> tuple[int, ...]:
        """``ids`` as ints, to be written from position ``start``: each a token of the
        vocabulary, and the context still within the model's maximum (ContextLengthError)."""
        id_list = tuple(int(t) for t in ids)
        if min(id_list) < 0 or max(id_list) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {list(id_list)}")
        end = start + len(id_list)
        if self.max_length is not None and end > self.max_length:
            raise ContextLengthError(
                f"context of {end} tokens exceeds the model's maximum of {self.max_length}"
            )
        return id_list

    def _reserve(self, slot: SlotPages, start: int, length: int) -> None:
        """Pages for ``slot``'s positions up to ``length``, the one holding ``start`` its own
        (copied if a branch shares it), doubling the pool when it is too small."""
        for attempt in range(2):
            try:
                self._pool.reserve(slot, length)
                self._pool.writable(slot, start)
                return
            except OutOfPages:
                if attempt:
                    raise
                need = -(-length // self._pool.page_size) + 1  # + a page to copy into
                self._pool.grow(max(2 * self._pool.num_pages, self._pool.pages_used + need))

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

    def crop(self, n: int) -> None:
        """Roll the cache back to its first ``n`` tokens (0 <= n <= length): a pointer move."""
        if not 0 <= n <= self.length:
            raise ValueError(f"crop({n}) out of range 0..{self.length}")
        if n == self.length:
            return
        self._pool.crop(self._slot, n)
        if self._rows_start >= n:
            self._rows.clear()
            self._rows_start = n
        else:
            del self._rows[n - self._rows_start :]

    @property
    def last_logits(self) -> torch.Tensor:
        """float32 ``[vocab_size]`` logits predicting the token after the last cached one."""
        if self.length == 0:
            raise ValueError("no tokens in the cache: nothing to predict from")
        pos = self.length - 1
        if self._rows and self._rows_start <= pos < self._rows_start + len(self._rows):
            return self._rows[pos - self._rows_start].clone()
        # Row evicted (crop beyond the window): recompute it with a one-token forward.
        last = self._slot.tokens[-1]
        self.crop(pos)
        return self.extend([last])[0].clone()

    # ------------------------------------------------------------------ branches

    def fork(self, n: int) -> SlotPages:
        """A branch: a slot holding this sequence's first ``n`` tokens, sharing their pages
        (nothing copied). Extend it with :meth:`extend_branches`; give it back with
        :meth:`release`."""
        return self._pool.fork(self._slot, n)

    def crop_branch(self, slot: SlotPages, n: int) -> None:
        """Roll a branch back to its first ``n`` tokens (a pointer move)."""
        self._pool.crop(slot, n)

    def release(self, slot: SlotPages) -> None:
        """Give a branch's pages back (those the sequence or another branch shares stay)."""
        self._pool.release(slot)

    def extend_branches(self, items: Sequence[tuple[SlotPages, Sequence[int]]]) -> torch.Tensor:
        """Append each ``ids`` to its branch, all in one batched forward; returns float32
        ``[len(items), vocab_size]``: row b predicts the token after ``items[b]``'s last id."""
        rows = []
        for slot, ids in items:
            if not ids:
                raise ValueError("extend_branches() needs at least one token id per branch")
            start = slot.length
            id_list = self._checked(start, ids)
            self._reserve(slot, start, start + len(id_list))
            rows.append(Row(slot, start, id_list, 1))
        logits = self._lm.forward(rows)
        for row in rows:
            self._pool.commit(row.slot, row.start, row.ids)
        return logits

    def adopt(self, slot: SlotPages) -> SlotPages:
        """Make the branch ``slot`` the sequence (a verdict chose its outcome); returns the old
        sequence's slot, now a branch. The kept logits rows were the old sequence's: none is
        kept (:attr:`last_logits` recomputes the last row if asked before an extend)."""
        old, self._slot = self._slot, slot
        self._rows.clear()
        self._rows_start = self.length
        return old
