"""Where a results file came from: the commit, the date and the machine, recorded by every
benchmark that writes one (under the key ``provenance``).

    {"commit": "<git rev-parse HEAD>[-dirty]", "date": "2026-12-03T19:40:00Z",
     "machine": {"platform": ..., "processor": ..., "cpus": ..., "python": ..., "torch": ...,
                 "gpu": "NVIDIA H200" or null}}
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: Where the studies write their results (relative to the repository).
RESULTS = "docs/results"


def git(*args: str) -> str:
    """``git ARGS`` in the repository: its output, stripped; ``""`` when git fails or is absent."""
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> str:
    """``git rev-parse HEAD`` of this tree, ``-dirty`` appended when tracked files differ from
    it (but for the results under :data:`RESULTS`, which the studies write: a study run after
    another is still of a clean tree); ``"unknown"`` outside a git checkout."""
    head = git("rev-parse", "HEAD")
    if not head:
        return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", f":!{RESULTS}")
    return f"{head}-dirty" if dirty else head


def machine() -> dict[str, Any]:
    """The platform, CPU count, Python, torch and the GPU torch sees (None when none)."""
    out: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": None,
        "gpu": None,
    }
    if "torch" in sys.modules or _importable("torch"):
        import torch

        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name()
    return out


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def provenance() -> dict[str, Any]:
    """``{"commit", "date" (ISO 8601, UTC), "machine"}`` of a run, for its results file."""
    return {
        "commit": commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
    }


def machine_info() -> dict[str, Any]:
    """The ``machine`` of the real-time and cost studies' records: :func:`machine`'s platform
    figures with the versions of torch, transformers and aiohttp, the short commit and the
    local date."""
    import aiohttp
    import torch
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "aiohttp": aiohttp.__version__,
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
