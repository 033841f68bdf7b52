"""TEMPORARY facade: removed at integration (SamplingParams lives in shared.maths.sampling)."""

# TEMPORARY facade: removed at integration

from __future__ import annotations

from shared.maths.sampling import MIN_TEMPERATURE, SamplingParams

__all__ = ["MIN_TEMPERATURE", "SamplingParams"]
