"""Which device a model loads on: one rule for the verifier's target and the edge's draft.

``auto`` means CUDA when torch sees a device, else the CPU; ``cuda`` without a device is an
error (:class:`DeviceUnavailable`); ``auto`` on a machine that looks like it has a GPU (NVIDIA
device nodes: ``/dev/nvidia*`` on a GPU box, ``/dev/nvhost*`` on a Jetson; or
``CUDA_VISIBLE_DEVICES`` set to something that does not hide every GPU) but where torch finds
none runs on the CPU with a warning. :func:`choose_device` is the pure rule; the others read
the machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shared.errors import WanspecError

log = logging.getLogger(__name__)

#: Device nodes that say "this machine has an NVIDIA GPU" (a GPU box; a Jetson).
NODE_PATTERNS = ("nvidia[0-9]*", "nvhost*")


class DeviceUnavailable(WanspecError, RuntimeError):
    """``device=cuda`` was asked for and torch finds no CUDA device."""


def gpu_nodes(dev: Path = Path("/dev")) -> list[str]:
    """The NVIDIA device nodes under ``dev`` (sorted paths; none on a machine without them)."""
    with contextlib.suppress(OSError):
        return sorted(str(p) for pattern in NODE_PATTERNS for p in dev.glob(pattern))
    return []


def hint_from(env: Mapping[str, str], nodes: Sequence[str]) -> str | None:
    """Why this machine should have CUDA, or None (pure): ``CUDA_VISIBLE_DEVICES`` set to
    something other than "" or -1 (which hide every GPU), or NVIDIA device nodes."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() not in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={visible}"
    if nodes:
        return f"{nodes[0]} exists"
    return None


def cuda_hint(env: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> str | None:
    """:func:`hint_from` this machine's environment and device nodes."""
    return hint_from(os.environ if env is None else env, gpu_nodes(dev))


def _why_no_cuda(torch_cuda: str | None) -> str:
    if torch_cuda is None:
        return "this torch is a CPU-only build"
    return (
        f"torch (CUDA {torch_cuda}) sees no device: check the driver, the device nodes' "
        "permissions and CUDA_VISIBLE_DEVICES"
    )


def choose_device(
    requested: str,
    *,
    cuda_available: bool,
    env: Mapping[str, str],
    nvidia_nodes: Sequence[str],
    torch_cuda: str | None = None,
) -> tuple[str, str | None]:
    """(device to load on, a warning to log or None). Pure. ``torch_cuda``: the CUDA version
    torch was built with (None: a CPU-only build). Raises :class:`DeviceUnavailable` for
    ``cuda`` without a CUDA device."""
    if requested == "cpu":
        return "cpu", None
    if cuda_available:
        return "cuda", None
    why = _why_no_cuda(torch_cuda)
    if requested == "cuda":
        raise DeviceUnavailable(f"device=cuda was asked for but no CUDA device is usable: {why}")
    hint = hint_from(env, nvidia_nodes)
    if hint is None:
        return "cpu", None
    return "cpu", f"device=auto: {hint} but no CUDA device is usable ({why}); running on the CPU"


def resolve_device(device: str) -> str:
    """The device a model loads on for the setting ``device`` (logs a warning when CUDA was
    expected and is missing; raises :class:`DeviceUnavailable` for ``cuda`` without one)."""
    if device == "cpu":
        return device
    import torch

    dev, warning = choose_device(
        device,
        cuda_available=torch.cuda.is_available(),
        env=os.environ,
        nvidia_nodes=gpu_nodes(),
        torch_cuda=torch.version.cuda,
    )
    if warning is not None:
        log.warning("%s", warning)
    return dev


def resolve_dtype(dtype: str, dev: str, *, on_cuda: str) -> str:
    """The dtype name a model loads in, for the setting ``dtype`` on device ``dev``: ``auto``
    is float32 on the CPU and ``on_cuda`` on a CUDA device (each end's own choice: float16 for
    the edge's draft, bfloat16 for the verifier's target); any other name is itself."""
    if dtype != "auto":
        return dtype
    return on_cuda if dev.startswith("cuda") else "float32"


def describe_device(dev: str) -> str:
    """``cpu`` or ``cuda:N (device name)``."""
    if not dev.startswith("cuda"):
        return dev
    import torch

    index = torch.device(dev).index
    if index is None:
        index = torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def placement(model: Any) -> str:
    """Where ``model`` (a ``torch.nn.Module``) runs, for a log line: ``cpu (float32, 4
    threads)`` (torch's CPU threads) or ``cuda:0 (Orin, float16)``."""
    import torch

    param = next(model.parameters())
    dtype = str(param.dtype).removeprefix("torch.")
    dev = param.device
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)}, {dtype})"
    n = torch.get_num_threads()
    return f"{dev.type} ({dtype}, {n} thread{'' if n == 1 else 's'})"
