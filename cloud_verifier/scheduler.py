"""The engine's scheduler: which queued requests make the next step. Pure: no torch, no
threads, no clock (vLLM v1's Scheduler → SchedulerOutput split, on a small scale).

The engine's queue holds, in arrival order, calls to run between steps (load, warm-up, ping,
adopting a lost session) and the sessions' model work, each described here by its
:class:`Kind` and, for work that needs a forward, its row's token count (fixed + draft + 1).
:func:`plan_step` takes a prefix of the queue:

* every call and cheap request (Crop, Draw) up to the first forward that does not fit, and the
  forwards of one step: at most ``max_sessions`` rows and ``max_tokens`` padded tokens (rows ×
  longest row). The oldest forward always fits, so no session starves; what does not fit is
  first in the next step. A call after work in the prefix ends it (it runs between steps);
* co-generation gives way: a CoGenerate in the prefix joins the step only in the room the other
  forwards leave, and one that finds none is answered Skipped at once;
* so does the verifier's own draft model (:func:`model_drafts_allowed`): only in steps with no
  edge-drafted work;
* a long prefill is chunked (:func:`prefill_chunk`): a forward whose fixed tokens pass the chunk
  budget computes only a chunk of them in a step (its row that long) and is queued again, first,
  for the rest; so one long prompt never pads every session's row of a step to its length.

A session has at most one request queued (its core waits for the result), so a step sees each
session at most once, in arrival order: every open session gets its turn each step (its fair
share of the engine); a long row only makes that step slower for all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from cloud_verifier.step_times import StallRule, StepTimes


class Kind(Enum):
    CALL = "call"  # a function to run between steps
    FORWARD = "forward"  # Verify / Federate: a row in the step's forward
    COGEN = "cogen"  # CoGenerate: a row only where the step has room
    CHEAP = "cheap"  # Crop / Draw: no forward


@dataclass(frozen=True)
class Queued:
    """One queue entry as the scheduler sees it: its kind and its row's tokens (forwards)."""

    kind: Kind
    tokens: int = 0


@dataclass(frozen=True)
class BatchLimits:
    max_sessions: int
    max_tokens: int


@dataclass(frozen=True)
class StepPlan:
    """The next step, as indices into the queue it was planned from. ``taken``: the length of
    the prefix that leaves the queue (all of it is in ``calls``, ``batch`` or ``skipped``);
    ``batch``: the step's requests in the order they run (cheap ones and forwards in queue
    order, then the admitted co-generations); ``padded_tokens``: rows × longest row."""

    taken: int
    calls: tuple[int, ...]
    batch: tuple[int, ...]
    skipped: tuple[int, ...]
    padded_tokens: int


def plan_step(queue: Sequence[Queued], limits: BatchLimits) -> StepPlan:
    """The next step from the head of ``queue`` (module docstring)."""
    calls: list[int] = []
    batch: list[int] = []
    cogen: list[int] = []
    forwards, longest, taken = 0, 0, 0

    def fits(n: int) -> bool:
        return forwards < limits.max_sessions and (
            (forwards + 1) * max(longest, n) <= limits.max_tokens
        )

    for i, item in enumerate(queue):
        if item.kind == Kind.COGEN:
            cogen.append(i)
            taken = i + 1
            continue
        if item.kind == Kind.FORWARD:
            if forwards and not fits(item.tokens):
                break
            forwards, longest = forwards + 1, max(longest, item.tokens)
        if item.kind == Kind.CALL and batch:
            break  # a call runs between steps: after the step queued before it
        taken = i + 1
        (calls if item.kind == Kind.CALL else batch).append(i)
    skipped: list[int] = []
    for i in cogen:
        n = queue[i].tokens
        if forwards == 0 or fits(n):
            forwards, longest = forwards + 1, max(longest, n)
            batch.append(i)
        else:
            skipped.append(i)
    return StepPlan(taken, tuple(calls), tuple(batch), tuple(skipped), forwards * longest)


def prefill_chunk(fixed: int, budget: int) -> int:
    """How many of a forward's ``fixed`` tokens its next step computes: all of them (and its
    draft) when they fit the chunk ``budget`` (0: no chunking), else ``budget`` alone, with no
    decision (the rest, and the draft, in later steps)."""
    return fixed if budget <= 0 or fixed <= budget else budget


def row_tokens(fixed: int, draft: int, budget: int) -> int:
    """The row a forward puts in its next step: a chunk of its fixed tokens, or all of them
    with its draft and the row that scores the first draft token."""
    n = prefill_chunk(fixed, budget)
    return n if n < fixed else fixed + draft + 1


def model_drafts_allowed(edge_forwards: int) -> bool:
    """May the step's co-generations draft with the verifier's draft model? Capacity first:
    model drafting runs one draft forward per draft token before the step's target forward, so
    it delays every row of the step. It runs only in a step with no edge-drafted work (Verify
    or Federate rows, ``edge_forwards``): a verifier busy with edge-drafted sessions gives them
    the room (their drafts cost it nothing to make), and its own drafting fills idle capacity.
    Drafts without a model (tail, ngram) cost no forward and always run."""
    return edge_forwards == 0


def should_gather(queue: Sequence[Queued], open_sessions: int, limits: BatchLimits) -> bool:
    """Should a step with work queued wait (``batch_wait``) for the other open sessions'
    forwards? Not when no forward is queued, nor when every open session (up to a full step)
    already has one: sessions that just got their verdicts send their next Propose a moment
    later, and a step started at once would hold only the stragglers of the last one."""
    forwards = sum(1 for q in queue if q.kind in (Kind.FORWARD, Kind.COGEN))
    return 0 < forwards < min(open_sessions, limits.max_sessions)


@dataclass(frozen=True)
class RunningStep:
    """The step on the engine's thread: when it started, its padded tokens, its slots."""

    started: float
    tokens: int
    slots: frozenset[int]


def queue_eta(
    running: RunningStep | None,
    now: float,
    ahead: Sequence[int],
    times: StepTimes,
    limits: BatchLimits,
    stall: StallRule,
) -> tuple[float, bool]:
    """Seconds until the running step ends and the forwards of token counts ``ahead`` (queue
    order) have run, and whether the running step has stalled. Steps hold
    ``limits.max_sessions`` rows; each costs a + b·tokens (:class:`StepTimes`)."""
    remaining, stalled = 0.0, False
    if running is not None:
        elapsed = now - running.started
        remaining = max(0.0, times.estimate(running.tokens) - elapsed)
        stalled = times.stalled(running.tokens, elapsed, stall)
    if ahead:
        a, b = times.coefficients()
        steps = -(-len(ahead) // limits.max_sessions)
        remaining += steps * a + b * sum(ahead)
    return remaining, stalled
