"""The request's sampling parameters as the wire carries them (the Hello) and every part
checks them: temperature, top-k, top-p. The transform they name is
:func:`shared.maths.sampling.transform`."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The smallest positive temperature: logits / T must stay finite in float64 (at 5e-324 every
#: logit becomes infinite and the transform a distribution with no mass). At 1e-4 sampling is
#: already the argmax for any logit gap above 0.01 (odds below e^-100); 0 is greedy.
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 means greedy (argmax), else at least :data:`MIN_TEMPERATURE`. top_k 0
    and top_p 1 disable those filters."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {self.temperature}"
            )
        if isinstance(self.top_k, bool) or not 0 <= self.top_k <= 2**24:
            raise ValueError(f"top_k must be an integer in [0, 2**24], got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
