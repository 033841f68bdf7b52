"""The model side of the verifier: one worker thread that owns the target model.

Every model call (load, forward, crop) runs on the single worker thread of an :class:`Engine`;
sessions submit jobs with :meth:`Engine.call` and await them, so the event loop never blocks on a
forward and jobs of several sessions interleave in arrival order. A session holds one
:class:`Sequence` (its KV cache); the engine counts forwards so tests can prove that stale work
costs nothing.

Targets: a real model (:class:`TorchTarget`, any ``shared.models.load_model`` spec; torch is only
imported for it) or :class:`NullTarget` (``null:VOCAB``): deterministic pseudo-random logits at
no cost, for measuring everything but the model.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from shared.protocol import Fingerprint

log = logging.getLogger(__name__)

T = TypeVar("T")
Logits = npt.NDArray[np.float32]

_NULL_RE = re.compile(r"^null:(\d+)$")


class Sequence(Protocol):
    """One session's token sequence in the target's KV cache."""

    @property
    def length(self) -> int: ...

    def extend(self, ids: Seq[int], *, last_rows: int | None = None) -> Logits:
        """Append ids; return float32 logits [last_rows or len(ids), V] of the last positions."""
        ...

    def last_logits(self) -> Logits:
        """float32 [V]: logits predicting the token after the last cached one."""
        ...

    def crop(self, n: int) -> None: ...


class Target(Protocol):
    fingerprint: Fingerprint
    vocab_size: int
    max_length: int | None  # the model's context limit, None if unbounded
    description: str

    def new_sequence(self) -> Sequence: ...


# ------------------------------------------------------------------------------ null target


class NullSequence:
    """Tokens only; logits are a fixed pool of random rows picked by (token, position)."""

    def __init__(self, rows: Logits) -> None:
        self._rows = rows  # [R, V]
        self._tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self._tokens)

    def _row(self, pos: int) -> Logits:
        r: Logits = self._rows[(self._tokens[pos] * 31 + pos) % len(self._rows)]
        return r

    def extend(self, ids: Seq[int], *, last_rows: int | None = None) -> Logits:
        if not ids:
            raise ValueError("extend() needs at least one token id")
        start = len(self._tokens)
        self._tokens.extend(int(t) for t in ids)
        n = len(ids) if last_rows is None else last_rows
        return np.stack([self._row(p) for p in range(start + len(ids) - n, start + len(ids))])

    def last_logits(self) -> Logits:
        if not self._tokens:
            raise ValueError("no tokens in the cache: nothing to predict from")
        row: Logits = self._row(len(self._tokens) - 1).copy()
        return row

    def crop(self, n: int) -> None:
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"crop({n}) out of range 0..{len(self._tokens)}")
        del self._tokens[n:]


class NullTarget:
    """``null:VOCAB``: no model; deterministic random logits (fingerprint hash "null")."""

    def __init__(self, vocab_size: int, *, pool: int = 64, seed: int = 0) -> None:
        if vocab_size < 2:
            raise ValueError(f"null model needs a vocabulary of at least 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.max_length: int | None = None
        self.fingerprint = Fingerprint("null", vocab_size, "null")
        self.description = f"null model, vocabulary {vocab_size}"
        rng = np.random.default_rng(seed)
        self._rows = (rng.standard_normal((pool, vocab_size)) * 3.0).astype(np.float32)

    def new_sequence(self) -> NullSequence:
        return NullSequence(self._rows)


def parse_null_spec(spec: str) -> int | None:
    """VOCAB of a ``null:VOCAB`` spec, None for any other spec."""
    m = _NULL_RE.match(spec.strip())
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------ real target


class TorchSequence:
    """A :class:`shared.lm.CausalLM` with numpy outputs."""

    def __init__(self, lm: Any) -> None:
        self._lm = lm

    @property
    def length(self) -> int:
        return int(self._lm.length)

    def extend(self, ids: Seq[int], *, last_rows: int | None = None) -> Logits:
        out: Logits = self._lm.extend(ids, last_rows=last_rows).cpu().numpy()
        return out

    def last_logits(self) -> Logits:
        out: Logits = self._lm.last_logits.cpu().numpy()
        return out

    def crop(self, n: int) -> None:
        self._lm.crop(n)


class TorchTarget:
    """A loaded transformers model (see ``shared.models.load_model``)."""

    def __init__(self, loaded: Any) -> None:
        from shared.lm import CausalLM

        self.loaded = loaded
        self.vocab_size = int(loaded.vocab_size)
        self.fingerprint: Fingerprint = loaded.fingerprint
        self.max_length: int | None = CausalLM(loaded).max_length
        self.description = f"{loaded.name} on {loaded.device}"

    def new_sequence(self) -> TorchSequence:
        from shared.lm import CausalLM

        return TorchSequence(CausalLM(self.loaded))


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
    spec: str, *, device: str = "auto", dtype: str = "auto", progress: bool | None = None
) -> Target:
    """Load ``spec`` (blocking: call it on the worker). ``null:VOCAB`` needs no torch.

    Logs one line naming the device. ``progress``: transformers' progress bars (None: only on
    a terminal)."""
    vocab = parse_null_spec(spec)
    if vocab is not None:
        log.info("device: none (null model, no torch)")
        return NullTarget(vocab)
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch

    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    from shared.models import load_model

    dev = resolve_device(device)
    log.info("device: %s", describe_device(dev))
    if dtype == "auto":
        dtype = "bfloat16" if dev.startswith("cuda") else "float32"
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    return TorchTarget(load_model(spec, device=dev, dtype=torch_dtype[dtype]))


# ------------------------------------------------------------------------------ engine


class CountingSequence:
    """Counts forwards into its engine (only ever touched on the worker thread)."""

    def __init__(self, inner: Sequence, engine: Engine) -> None:
        self._inner = inner
        self._engine = engine

    @property
    def length(self) -> int:
        return self._inner.length

    def extend(self, ids: Seq[int], *, last_rows: int | None = None) -> Logits:
        self._engine.forwards += 1
        return self._inner.extend(ids, last_rows=last_rows)

    def last_logits(self) -> Logits:
        return self._inner.last_logits()

    def crop(self, n: int) -> None:
        self._inner.crop(n)


class EngineClosed(RuntimeError):
    """The engine was shut down; no more jobs run."""


class Engine:
    """The target model and the one thread that runs it.

    Invariants: ``target`` is set once, by :meth:`load`; every job runs on the worker thread, in
    submission order; ``forwards`` is written by the worker only.
    """

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wanspec-model")
        self._worker: threading.Thread | None = None
        self._closed = False
        self.target: Target | None = None
        self.forwards = 0

    @property
    def ready(self) -> bool:
        return self.target is not None

    def require_target(self) -> Target:
        if self.target is None:
            raise RuntimeError("the target model is not loaded yet")
        return self.target

    def _submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        if self._closed:
            raise EngineClosed("the model worker has been shut down")
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, fn)

    async def call(self, fn: Callable[[], T]) -> tuple[T, float]:
        """Run ``fn`` on the worker; return its result and the seconds it waited in the queue."""
        submitted = time.perf_counter()
        started: list[float] = []

        def job() -> T:
            started.append(time.perf_counter())
            return fn()

        result = await self._submit(job)
        return result, started[0] - submitted

    async def load(self, loader: Callable[[], Target]) -> Target:
        """Load the target on the worker thread (so it lives where it runs)."""

        def job() -> Target:
            self._worker = threading.current_thread()
            return loader()

        target = await self._submit(job)
        self.target = target
        return target

    def new_sequence(self) -> CountingSequence:
        return CountingSequence(self.require_target().new_sequence(), self)

    def worker_alive(self) -> bool:
        return self._worker is None or self._worker.is_alive()

    async def ping(self, timeout: float) -> bool:
        """True when a no-op job completes on the worker within ``timeout`` seconds."""
        if not self.worker_alive():
            return False
        try:
            await asyncio.wait_for(self._submit(lambda: None), timeout)
        except (asyncio.TimeoutError, EngineClosed, RuntimeError):
            return False
        return True

    def shutdown(self) -> None:
        """Stop accepting jobs; queued jobs are cancelled, a running one finishes on its own."""
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
