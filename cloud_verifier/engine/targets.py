"""The target model behind the engine: one batched forward over many session slots.

A :class:`Target` runs :meth:`Target.forward` over a list of :class:`Row` (one per session in a
step: the slot, the position of its first new token, the new token ids, how many of the last
logits rows it needs) and returns those rows' float32 logits, ``[Σ keep, V]``, on its device, in
row order. It owns nothing per session but the slots' KV memory (:class:`~cloud_verifier.kv_pool.
PagedKV`); the engine owns the slots' lengths and commits a forward by moving them.

* :class:`TorchTarget`: a transformers causal LM over the paged pool. Rows of different lengths
  and positions share one forward: ids padded to the longest row, per-row ``position_ids``, a 4D
  additive mask (causal within the row's own positions, nothing past them), the lm head applied
  only to the rows asked for.
* :class:`NullTarget` (``null:VOCAB``): deterministic pseudo-random logits at no cost, for
  measuring everything but the model.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Sequence as Seq
from typing import Any, Protocol

import torch

from shared.runtime.batched_lm import BatchedLM, Row
from shared.runtime.device import describe_device, placement, resolve_device, resolve_dtype
from shared.runtime.kv_pool import PagedKV
from shared.service.config import Switch
from shared.wire.messages import Fingerprint

log = logging.getLogger(__name__)

_NULL_RE = re.compile(r"^null:(\d+)$")


class Target(Protocol):
    fingerprint: Fingerprint
    vocab_size: int
    max_length: int | None  # the model's context limit, None if unbounded
    description: str
    device: torch.device

    def allocate(self, num_pages: int, page_size: int) -> PagedKV:
        """Preallocate the KV pool (once, before the first forward)."""
        ...

    def kv_bytes_per_token(self) -> int: ...

    def forward(self, rows: Seq[Row]) -> torch.Tensor:
        """float32 logits [Σ row.keep, V] on ``device``; row r's block predicts the tokens
        after its last ``keep`` ids. Blocking: runs on the engine's thread."""
        ...


# ------------------------------------------------------------------------------ null target


class NullTarget:
    """``null:VOCAB``: no model; the logits of position t are row ``(token_t · 31 + t) mod R``
    of a fixed random pool (fingerprint hash "null"). Its KV pool holds nothing."""

    def __init__(self, vocab_size: int, *, pool: int = 64, seed: int = 0) -> None:
        if vocab_size < 2:
            raise ValueError(f"null model needs a vocabulary of at least 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.max_length: int | None = None
        self.fingerprint = Fingerprint("null", vocab_size, "null")
        self.description = f"null model, vocabulary {vocab_size}"
        self.device = torch.device("cpu")
        g = torch.Generator().manual_seed(seed)
        self._rows = torch.randn(pool, vocab_size, generator=g) * 3.0  # [R, V] float32

    def allocate(self, num_pages: int, page_size: int) -> PagedKV:
        return PagedKV(
            layers=0,
            kv_heads=0,
            head_dim=0,
            num_pages=num_pages,
            page_size=page_size,
            dtype=torch.float32,
            device=self.device,
        )

    def kv_bytes_per_token(self) -> int:
        return 0

    def forward(self, rows: Seq[Row]) -> torch.Tensor:
        picks: list[int] = []
        for r in rows:
            n, depth = len(r.ids), r.depths()  # a tree row's ids sit at their depth
            picks += [
                (r.ids[i] * 31 + r.start + depth[i]) % len(self._rows) for i in range(n - r.keep, n)
            ]
        return self._rows.index_select(0, torch.tensor(picks, dtype=torch.int64))


def parse_null_spec(spec: str) -> int | None:
    """VOCAB of a ``null:VOCAB`` spec, None for any other spec."""
    m = _NULL_RE.match(spec.strip())
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------ real target


class TorchTarget(BatchedLM):
    """A loaded transformers model (see ``shared.runtime.models.load_model``) run as a
    :class:`~shared.runtime.batched_lm.BatchedLM` over the engine's paged KV pool, with the
    identity a target carries (fingerprint, description)."""

    def __init__(self, loaded: Any, *, compile_forward: bool = False) -> None:
        super().__init__(loaded.model, int(loaded.vocab_size), compile_forward=compile_forward)
        self.loaded = loaded
        self.fingerprint: Fingerprint = loaded.fingerprint
        # On the CPU its dtype and threads too (the edge's draft is named so).
        where = placement(loaded.model) if self.device.type == "cpu" else str(loaded.device)
        self.description = f"{loaded.name} on {where}" + (", compiled" if compile_forward else "")


def compiles(switch: Switch, device: str) -> bool:
    """Whether a forward on ``device`` is torch.compiled under the ``compile`` setting: ``on``;
    ``auto``: on CUDA only; ``off``. The target's and the cloud draft model's rule."""
    return switch == Switch.ON or (switch == Switch.AUTO and device.startswith("cuda"))


def load_target(
    spec: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    compile_forward: Switch = Switch.AUTO,
    progress: bool | None = None,
    tp_size: int = 1,
    local_rank: int = 0,
) -> Target:
    """Load ``spec`` (blocking: call it on the engine's thread). ``null:VOCAB`` needs no model.

    Logs one line naming the device. ``compile_forward``: the ``compile`` setting
    (:func:`compiles`). ``progress``: transformers' progress bars (None: only on a terminal).
    ``tp_size`` > 1: this rank's shards of a tensor-parallel model
    (:mod:`cloud_verifier.engine.tp`),
    on ``cuda:local_rank`` with CUDA, else the CPU; not compiled."""
    vocab = parse_null_spec(spec)
    if vocab is not None:
        log.info("device: none (null model)")
        return NullTarget(vocab)
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    from shared.runtime.models import load_model

    dev = resolve_device(device)
    if tp_size > 1 and dev.startswith("cuda"):
        dev = f"cuda:{local_rank}"
    log.info("device: %s", describe_device(dev))
    dtype = resolve_dtype(dtype, dev, on_cuda="bfloat16")
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    compiled = compiles(compile_forward, dev)
    if tp_size > 1:
        compiled = False  # the sharded layers' hooks and collectives: eager only
    loaded = load_model(spec, device=dev, dtype=torch_dtype[dtype], tp_size=tp_size)
    return TorchTarget(loaded, compile_forward=compiled)
