"""The draft model's steps (edge_agent.drafter.Drafter) on a tiny real model: the rival a
hedge or a pre-drafted branch goes after."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge_agent.drafter import Drafter
from shared.maths.sampling import transform
from shared.runtime.models import load_model
from shared.wire.params import SamplingParams


def test_the_rival_is_the_likeliest_other_token_and_conf_the_drafted_ones_probability(
    tiny_model_dir: Path,
) -> None:
    drafter = Drafter(load_model(str(tiny_model_dir)))
    rng = np.random.default_rng(0)
    seen_off_argmax = False
    for i in range(40):
        seq = [1, 2 + i % 7, 3 + i % 11]
        params = SamplingParams(0.0 if i % 2 else 1.0)
        step = drafter.draft(seq, params, rng, deterministic=i % 2 == 1, rival=True)
        assert step.rival is not None
        p1 = transform(drafter._logits(seq), SamplingParams(1.0))  # temperature 1
        assert step.rival.token != step.token
        others = np.delete(np.arange(len(p1)), step.token)
        assert step.rival.token == int(others[np.argmax(p1[others])])
        assert np.isclose(step.rival.conf, p1[step.token], rtol=1e-5)
        seen_off_argmax |= step.token != int(np.argmax(p1))
    # Sampled steps that drew another token than q's argmax: their rival is still another
    # token (the argmax, here), never the drafted one.
    assert seen_off_argmax
