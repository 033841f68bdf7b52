"""The edge's side of a real-time study: a draft padded to an emulated device's step time
(:class:`TimedDrafter`), a draft model loaded beside its target, a warm link opened, and one
generation through the product's :class:`~edge_agent.runtime.agent.EdgeAgent`, timed token by
token (:func:`run_spec`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from bench.lib.costs import DRAFT_BATCH_COST
from edge_agent.link.warm import WarmLink
from edge_agent.model.drafter import BranchDrafting, Drafter, DraftModel, DraftRow, DraftStep
from edge_agent.model.lm import SupportsCausalLM
from edge_agent.runtime.agent import AgentEvent, EdgeAgent, SessionFailed
from edge_agent.session.events import Committed
from edge_agent.session.pipeline_config import PipelineConfig
from shared.maths.sampling import Probs, SamplingParams
from shared.runtime.models import LoadedModel, load_draft

#: Seconds to wait for a warm link's first connection.
LINK_OPEN_S = 120.0


class TimedDrafter:
    """Wraps any draft (a model's :class:`Drafter`, an :class:`~bench.lib.oracle.OracleDrafter`):
    pads each draft step to ``pad_s`` (a batched step of B rows to ``pad_s`` · (1 + ``batch_cost``
    · (B − 1))) and records the step times, its ``steps`` and the ``overruns`` among them (steps
    whose compute took longer than their pad: the emulation is void there). A
    :class:`~edge_agent.model.drafter.DraftModel` itself."""

    def __init__(
        self,
        inner: DraftModel | SupportsCausalLM,
        pad_s: float,
        batch_cost: float = DRAFT_BATCH_COST,
    ) -> None:
        """``inner``: a draft, or a loaded model (a :class:`Drafter` of it is built)."""
        if batch_cost < 0:
            raise ValueError(f"batch_cost must be >= 0, got {batch_cost}")
        self.inner: DraftModel = inner if isinstance(inner, DraftModel) else Drafter(inner)
        self.pad_s = pad_s
        self.batch_cost = batch_cost
        self.times: list[float] = []
        self.compute: list[float] = []
        self.steps = 0
        self.overruns = 0  # steps whose compute took longer than their pad
        self.overrun_s = 0.0  # their compute beyond their pads, summed

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def forwards(self) -> int:
        """The inner draft's model forwards (an oracle runs none)."""
        return int(getattr(self.inner, "forwards", 0))

    def next_dist(self, seq: Sequence[int], params: SamplingParams) -> Probs:
        return self.inner.next_dist(seq, params)

    def draft(self, row: DraftRow) -> DraftStep:
        t0 = time.perf_counter()
        out = self.inner.draft(row)
        self._pad(t0, self.pad_s)
        return out

    @property
    def branch_batch(self) -> int:
        """As the product's drafter takes them at the emulated batch cost (a GPU-class
        device's by default: the regime emulates a Jetson, not this CPU)."""
        return Drafter.branch_batch_for(self.batch_cost)

    def draft_many(self, rows: Sequence[DraftRow]) -> list[DraftStep]:
        """Branches (or concurrent generations' steps, :mod:`edge_agent.model.batching`)
        stepped together: one batched forward where the inner draft has one (else one step
        after another, computing nothing for an oracle), padded to a batched step's emulated
        time, ``pad_s`` · (1 + ``batch_cost`` · (B − 1))."""
        t0 = time.perf_counter()
        if isinstance(self.inner, BranchDrafting):
            out = self.inner.draft_many(rows)
        else:
            out = [self.inner.draft(row) for row in rows]
        self._pad(t0, self.pad_s * (1 + self.batch_cost * (len(rows) - 1)))
        return out

    def _pad(self, t0: float, pad_s: float) -> None:
        spent = time.perf_counter() - t0
        self.compute.append(spent)
        self.steps += 1
        if spent < pad_s:
            time.sleep(pad_s - spent)
        else:
            self.overruns += 1
            self.overrun_s += spent - pad_s
        self.times.append(time.perf_counter() - t0)


def stat_mean(st: object, name: str) -> float | None:
    """A mean the edge's stats report: ``mean_<name>``, ``<name>_mean``, or ``<name>_sum`` over
    ``<name>_samples``, ``<name>_count`` or ``rounds`` (``depth_sum`` is summed per verdict);
    None where they do not."""
    for key in (f"mean_{name}", f"{name}_mean"):
        v = getattr(st, key, None)
        if callable(v):
            v = v()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return float(v)
    total = getattr(st, f"{name}_sum", None)
    if not isinstance(total, (int, float)) or total <= 0:
        return None
    for key in (f"{name}_samples", f"{name}_count", "rounds"):
        count = getattr(st, key, None)
        if isinstance(count, (int, float)) and count > 0:
            return float(total) / float(count)
    return None


async def run_spec(
    agent: EdgeAgent,
    cfg: PipelineConfig,
    prompt: list[int],
    n: int,
    eos: list[int],
    failures: list[str] | None = None,
) -> dict[str, Any]:
    """One generation on ``agent``; ``failures``: where its failed sessions are noted."""
    stamps: list[float] = []

    def on_event(ev: AgentEvent) -> None:
        if isinstance(ev, Committed):
            stamps.extend([time.perf_counter()] * len(ev.ids))
        elif isinstance(ev, SessionFailed) and failures is not None:
            failures.append(f"{ev.cause}: {ev.detail}")

    t0 = time.perf_counter()
    gen = await agent.generate(prompt, cfg, max_tokens=n, eos_ids=eos, seed=0, on_event=on_event)
    wall = (stamps[-1] if stamps else time.perf_counter()) - t0
    st = gen.stats
    # What the batches yielded: accepted drafts, one correction per rejection (recovered, or a
    # co-generated token that doomed the batch), bonus tokens. With co-generation the verifier
    # also commits tokens of its own; drafts that matched them count as accepted.
    verdict_tokens = st.accepted_tokens + st.rejections + st.bonus_tokens
    cogen_tokens = getattr(st, "cogen_tokens", None)
    return {
        "tokens": len(gen.generated),
        "t0": t0,
        "wall_s": wall,
        "stamps": stamps,
        "rounds": st.rounds,
        "accepted_tokens": st.accepted_tokens,
        "draft_tokens": st.draft_tokens,
        "rejections": st.rejections,
        "discarded_batches": st.discarded_batches,
        "uplink_bytes": st.uplink_bytes,
        "downlink_bytes": st.downlink_bytes,
        "proposes": st.proposes_sent,
        "downlink_rejection_bytes": st.downlink_rejection_bytes,
        "drafter_idle_s": st.drafter_wait_s,
        "verdict_tokens": verdict_tokens,
        "cogen_tokens": cogen_tokens
        if isinstance(cogen_tokens, int)
        else max(0, len(gen.generated) - verdict_tokens),
        # co-generated tokens that coincide with drafts the verdicts accepted (or corrections)
        "cogen_overlap": verdict_tokens + cogen_tokens - len(gen.generated)
        if isinstance(cogen_tokens, int)
        else None,
        "gamma_mean": stat_mean(st, "gamma"),
        "depth_mean": stat_mean(st, "depth"),
        # (token sources keyed by their names: JSON keys are strings)
        "stats": {**asdict(st), "sources": {str(k): n for k, n in st.sources.items()}},
        "text_ids": gen.generated,
    }


async def open_warm(warm: WarmLink, deadline_s: float = LINK_OPEN_S) -> None:
    """Start ``warm``'s keeper and wait (at most ``deadline_s``) until its connection is up."""
    warm.start()
    deadline = time.monotonic() + deadline_s
    while not warm.up:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no link to {warm.settings.url} in {deadline_s:.0f} s")
        await asyncio.sleep(0.05)


def load_draft_model(spec: str, target: LoadedModel) -> LoadedModel:
    """A model draft; a ``self:...`` draft shares ``target``'s weights."""
    return load_draft(spec, lambda: target)
