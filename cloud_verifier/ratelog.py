"""Rate-limited logging: moved to :mod:`shared.service.ratelog` (the edge's HTTP guard uses it too);
this name stays for the verifier's imports."""

from __future__ import annotations

from shared.service.ratelog import LogLimiter

__all__ = ["LogLimiter"]
