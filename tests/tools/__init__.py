"""Tools run by hand to check a change (not tests: pytest collects nothing here)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from shared.runtime.models import load_model
from testkit.tiny_models import build_tiny_model
from tests.edge_helpers import Servers


@contextlib.contextmanager
def tiny_verifier() -> Iterator[tuple[Servers, str, Path]]:
    """A live verifier of a tiny random target on loopback: the servers (start edges with
    ``servers.edge``; all stop at the end), the verifier's URL and a tiny draft's folder
    (same tokenizer, other weights)."""
    tmp = Path(tempfile.mkdtemp())
    target = load_model(str(build_tiny_model(tmp / "t", vocab_size=64, seed=0)))
    draft_dir = build_tiny_model(tmp / "d", vocab_size=64, seed=1)
    servers = Servers(tmp)
    try:
        yield servers, servers.verifier(target), draft_dir
    finally:
        servers.close()
