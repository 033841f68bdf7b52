"""What a study reads off a running verifier: its ``/metrics`` (:func:`parse_metrics`,
:func:`scrape`, :func:`delta`), its ``/health`` (:func:`wait_idle`), and the fingerprint a
verifier of a model spec announces (:func:`fingerprint`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping

import aiohttp

from shared.wire.messages import Fingerprint


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {``name{labels}``: value} (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[key] = float(value)
    return out


async def scrape(http: aiohttp.ClientSession, port: int) -> dict[str, float]:
    async with http.get(
        f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=10)
    ) as r:
        return parse_metrics(await r.text())


def delta(after: Mapping[str, float], before: Mapping[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


async def wait_idle(http: aiohttp.ClientSession, port: int, timeout_s: float) -> bool:
    """Until the verifier's /health counts no session (True), or ``timeout_s`` (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            async with http.get(
                f"http://127.0.0.1:{port}/health", timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                if int((await r.json()).get("sessions", 1)) == 0:
                    return True
        await asyncio.sleep(0.2)
    return False


def fingerprint(spec: str) -> Fingerprint:
    """The fingerprint the verifier will announce (the edges' Hello must match it)."""
    from cloud_verifier.engine.targets import NullTarget, parse_null_spec

    vocab = parse_null_spec(spec)
    if vocab is not None:
        return NullTarget(vocab).fingerprint
    from shared.runtime.models import load_model

    return load_model(spec).fingerprint
