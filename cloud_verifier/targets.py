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

import glob
import logging
import os
import re
import sys
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cloud_verifier.kv_pool import PagedKV, SlotPages, StepCache
from shared.protocol import Fingerprint

log = logging.getLogger(__name__)

_NULL_RE = re.compile(r"^null:(\d+)$")


@dataclass(frozen=True)
class Row:
    """One session's part of a batched forward: write ``ids`` at positions ``start, start+1,
    ...`` of ``slot`` (whose pages cover them) and return the logits of the last ``keep``."""

    slot: SlotPages
    start: int
    ids: tuple[int, ...]
    keep: int

    def __post_init__(self) -> None:
        if not self.ids or not 1 <= self.keep <= len(self.ids) or self.start < 0:
            raise ValueError(f"bad row: start {self.start}, {len(self.ids)} ids, keep {self.keep}")


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
            n = len(r.ids)
            picks += [(r.ids[i] * 31 + r.start + i) % len(self._rows) for i in range(n - r.keep, n)]
        return self._rows.index_select(0, torch.tensor(picks, dtype=torch.int64))


def parse_null_spec(spec: str) -> int | None:
    """VOCAB of a ``null:VOCAB`` spec, None for any other spec."""
    m = _NULL_RE.match(spec.strip())
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------ real target


def _text_config(model: Any) -> Any:
    getter = getattr(model.config, "get_text_config", None)
    return getter() if callable(getter) else model.config


class TorchTarget:
    """A loaded transformers model (see ``shared.models.load_model``) over a paged KV pool.

    ``bucket``: pad the batch and token dimensions to powers of two and the key length to a
    multiple of 64, so a compiled forward sees few shapes (on by default when compiled).
    """

    def __init__(self, loaded: Any, *, compile_forward: bool = False) -> None:
        self.loaded = loaded
        model = loaded.model
        self.model = model
        self.vocab_size = int(loaded.vocab_size)
        self.fingerprint: Fingerprint = loaded.fingerprint
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
            log.warning("sliding-window layers: context per session capped at %d", window)
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
        self._head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        self.compiled = compile_forward
        self._run: Any = self._run_eager
        if compile_forward:
            self._run = torch.compile(self._run_eager, dynamic=False)
        self.description = f"{loaded.name} on {loaded.device}" + (
            ", compiled" if compile_forward else ""
        )
        self.pool: PagedKV | None = None

    def allocate(self, num_pages: int, page_size: int) -> PagedKV:
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

    def forward(self, rows: Seq[Row]) -> torch.Tensor:
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
        pages = -(-kv_len // p)
        table = pool.page_table([r.slot for r in rows] + [SlotPages()] * (b_pad - b), pages)
        # read[b, t] = flat row of position t of slot b (trash past its pages; masked anyway).
        pos_t = torch.arange(kv_len, device=dev)
        page_of = table[:, pos_t // p]  # [B, L]
        read = torch.where(page_of >= 0, page_of * p + pos_t % p, pool.trash)
        start_t = torch.tensor(starts, dtype=torch.int64, device=dev)[:, None]  # [B, 1]
        len_t = torch.tensor(lens, dtype=torch.int64, device=dev)[:, None]
        q = torch.arange(n, device=dev)[None]  # [1, n]
        position_ids = start_t + q  # [B, n]
        # Row i of slot b sees positions <= start_b + i; padded queries see position 0 only
        # (any non-empty set: their outputs are dropped, and an empty row would give NaN).
        sees = pos_t[None, None] <= position_ids[:, :, None]  # [B, n, L]
        sees = torch.where((q < len_t)[:, :, None], sees, pos_t[None, None] == 0)
        mask = torch.zeros(sees.shape, dtype=self.dtype, device=dev)
        mask.masked_fill_(~sees, torch.finfo(self.dtype).min)
        pick_b = [i for i, r in enumerate(rows) for _ in range(r.keep)]
        pick_t = [t for r in rows for t in range(len(r.ids) - r.keep, len(r.ids))]
        cache = StepCache(pool, torch.tensor(write, dtype=torch.int64, device=dev), read)
        with torch.inference_mode():
            logits: torch.Tensor = self._run(
                torch.tensor(ids, dtype=torch.int64, device=dev),
                position_ids,
                mask[:, None],
                cache,
                torch.tensor(pick_b, dtype=torch.int64, device=dev),
                torch.tensor(pick_t, dtype=torch.int64, device=dev),
            )
        return logits[:, : self.vocab_size]


class DeviceUnavailable(RuntimeError):
    """``device=cuda`` was asked for and torch finds no CUDA device."""


def cuda_hint(env: Mapping[str, str], nvidia_nodes: Seq[str]) -> str | None:
    """Why this machine looks like it has a GPU (None: it does not)."""
    if nvidia_nodes:
        return f"{nvidia_nodes[0]} exists"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() not in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible} is set"
    return None


def choose_device(
    requested: str,
    *,
    cuda_available: bool,
    env: Mapping[str, str],
    nvidia_nodes: Seq[str],
    torch_cuda: str | None = None,
) -> tuple[str, str | None]:
    """(device to load on, a warning to log or None). Pure. ``torch_cuda``: the CUDA version
    torch was built with (None: a CPU-only build). Raises :class:`DeviceUnavailable` for
    ``cuda`` without a CUDA device."""
    why = (
        "this torch is a CPU-only build"
        if torch_cuda is None
        else (
            f"torch (CUDA {torch_cuda}) sees no device: check the driver, the device nodes' "
            "permissions and CUDA_VISIBLE_DEVICES"
        )
    )
    if requested == "cpu":
        return "cpu", None
    if cuda_available:
        return "cuda", None
    if requested == "cuda":
        raise DeviceUnavailable(f"device=cuda was asked for but no CUDA device is usable: {why}")
    hint = cuda_hint(env, nvidia_nodes)
    if hint is None:
        return "cpu", None
    return "cpu", f"device=auto: {hint} but no CUDA device is usable ({why}); running on the CPU"


def resolve_device(device: str) -> str:
    """The device ``load_target`` uses for ``device`` (logs a warning when CUDA was expected
    and is missing)."""
    if device == "cpu":
        return device
    import torch

    dev, warning = choose_device(
        device,
        cuda_available=torch.cuda.is_available(),
        env=os.environ,
        nvidia_nodes=sorted(glob.glob("/dev/nvidia[0-9]*")),
        torch_cuda=torch.version.cuda,
    )
    if warning is not None:
        log.warning("%s", warning)
    return dev


def describe_device(dev: str) -> str:
    """``cpu`` or ``cuda:N (device name)``."""
    if not dev.startswith("cuda"):
        return dev
    import torch

    index = torch.device(dev).index
    if index is None:
        index = torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def load_target(
    spec: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    compile_forward: str = "auto",
    progress: bool | None = None,
) -> Target:
    """Load ``spec`` (blocking: call it on the engine's thread). ``null:VOCAB`` needs no model.

    Logs one line naming the device. ``compile_forward``: ``auto`` (on for CUDA, off on the CPU),
    ``on`` or ``off``. ``progress``: transformers' progress bars (None: only on a terminal)."""
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
    from shared.models import load_model

    dev = resolve_device(device)
    log.info("device: %s", describe_device(dev))
    if dtype == "auto":
        dtype = "bfloat16" if dev.startswith("cuda") else "float32"
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    compiled = compile_forward == "on" or (compile_forward == "auto" and dev.startswith("cuda"))
    return TorchTarget(
        load_model(spec, device=dev, dtype=torch_dtype[dtype]), compile_forward=compiled
    )
