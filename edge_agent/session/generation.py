"""One generation's committed text (the source of truth) and its counters.

The committed ids are all that a new verifier session needs to resume (it re-prefills them), so a
lost connection or a restarted verifier loses nothing; a session only ever appends to them.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from edge_agent.session.events import (
    Committed,
    Count,
    Finished,
    GenerationEvent,
    RejectionGap,
    Tally,
    TokenLogprob,
)
from shared.enums import TextEnum
from shared.wire.messages import Hedge, Logprobs, Message


class TokenSource(TextEnum):
    """Where a committed token came from. Every generated token has exactly one source, counted
    where it is committed (:meth:`Generation.commit`), so the counts add up to the text."""

    EDGE_DRAFT = "edge_draft"  # an edge draft token the target accepted
    CORRECTION = "correction"  # the recovered token of a rejection (from the target's residual)
    BONUS = "bonus"  # the target's token after a fully accepted batch
    COGENERATED = "cogenerated"  # decoded by the verifier while no edge draft was queued
    CLOUD_DRAFT = "cloud_draft"  # the verifier's own draft token, accepted (co-generation)
    LOCAL_DRAFT = "local_draft"  # the draft's own, no verifier (link-down fallback = draft)


class LogprobBook:
    """The Logprobs frames of a generation, by absolute position: the log-probability of each
    scored id there, and the position's likeliest alternatives. A position's entries describe
    the committed text before it (a verifier scores only verified prefixes), so they never go
    stale; the committed token looks its own up (:meth:`entry`)."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end  # the positions it keeps: [start, end)
        self._at: dict[int, tuple[dict[int, float], tuple[tuple[int, float], ...]]] = {}

    def note(self, msg: Logprobs) -> None:
        """Keep a frame's entries; raises ValueError for positions outside [start, end)."""
        p = msg.positions
        if msg.pos < self.start or msg.pos + p > self.end:
            raise ValueError(
                f"log-probabilities for positions {msg.pos}..{msg.pos + p - 1} outside "
                f"{self.start}..{self.end - 1}"
            )
        n = len(msg.top_ids) // p
        ids, lp = msg.ids.tolist(), msg.lp.tolist()
        top_ids, top_lp = msg.top_ids.tolist(), msg.top_lp.tolist()
        for i in range(p):
            hi = i + 1 if i < p - 1 else len(ids)
            scores = dict(zip(ids[i:hi], lp[i:hi], strict=True))
            top = tuple(zip(top_ids[i * n : (i + 1) * n], top_lp[i * n : (i + 1) * n], strict=True))
            self._at[msg.pos + i] = (scores, top)

    def entry(self, pos: int, token: int) -> TokenLogprob:
        scores, top = self._at.get(pos, ({}, ()))
        return TokenLogprob(token, scores.get(token), top)


@dataclass
class Stats:
    """Counters of one generation, across sessions (reconnects). The cores write none of the
    per-step ones: they report them as events, which the drivers count here (:meth:`apply`,
    :meth:`sent`); the agent counts its own (reconnects, busy refusals, the draft's cache)."""

    rounds: int = 0  # verdicts received
    draft_tokens: int = 0  # draft tokens verified (in verdicts received)
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    rejections: int = 0
    recovered_tokens: int = 0
    bonus_tokens: int = 0
    cogen_tokens: int = 0  # tokens the verifier co-generated (Generated frames)
    hedges_sent: int = 0  # Hedge frames sent
    hedge_bytes: int = 0  # their bytes (part of uplink_bytes)
    hedge_hits: int = 0  # co-generated tokens that continue a hedge sent (as it drafted them)
    #: Outcome pre-drafting (PipelineConfig.predraft): branches prepared, their draft tokens,
    #: the batches sent from one (a rejection answered from memory) and the tokens they carried.
    predraft_branches: int = 0
    predraft_tokens: int = 0
    predraft_hits: int = 0
    predraft_used_tokens: int = 0
    #: Rejections no branch answered, by why: the correction was not among the draft's known
    #: alternatives at that position; it was, but the branch budget was full; it was, with room
    #: left, but its branch was not planned (less likely than the floor, or no room to step it)
    #: or not finished before the verdict (time).
    predraft_miss_not_alternative: int = 0
    predraft_miss_cap: int = 0
    predraft_miss_time: int = 0
    #: Token trees: branch frames held back, the branch uplink budget (branch_uplink) spent.
    branch_frames_held: int = 0
    #: The gap a rejection leaves: from its Verdict (or the co-generated token that dooms a
    #: batch) to the next batch sent, summed, and the rejections so measured.
    rejection_gap_s: float = 0.0
    rejection_gaps: int = 0
    depth_sum: int = 0  # Σ over verdicts of the pipeline depth then (mean D = depth_sum / rounds)
    gamma_sum: int = 0  # Σ over verdicts of the draft length γ then (mean γ = gamma_sum / rounds)
    discarded_batches: int = 0
    discarded_tokens: int = 0
    resamples: int = 0
    proposes_sent: int = 0
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    downlink_rejection_bytes: int = 0
    #: Rationing (Verdict.budget): rounds the verifier cut short and their unjudged drafts.
    cut_rounds: int = 0
    cut_tokens: int = 0
    reconnects: int = 0
    #: Progress frames received (the verifier's word that work waits or runs; busy, not dead).
    progress_frames: int = 0
    #: Seconds sessions waited in the verifier's admission line (from its first Progress
    #: before the Welcome to the Welcome): busy, not down; bounded by the request's deadline.
    admission_wait_s: float = 0.0
    #: Session requests a busy verifier refused (503/429 with Retry-After), each waited out.
    busy_refusals: int = 0
    #: Cached tokens the verifier kept across reconnects (resumed sessions: no prefill of them).
    resumed_tokens: int = 0
    #: Prompt tokens the verifier took from its prefix cache (Verdict.cached): not prefilled.
    prompt_cached_tokens: int = 0
    #: Prompt tokens the edge's draft model held in its cache already (a chat's next turn).
    draft_prompt_cached_tokens: int = 0
    drafter_wait_s: float = 0.0  # time the drafter sat idle (queue full / stop-and-wait)
    #: Committed generated tokens by source (they add up to the generated text).
    sources: dict[TokenSource, int] = field(default_factory=lambda: dict.fromkeys(TokenSource, 0))
    gamma_last: int = 0  # γ when the last verdict came (the controller's, in auto mode)
    depth_last: int = 0  # D when the last verdict came

    def apply(self, tally: Tally) -> None:
        """Count what a core reported (its driver calls this for each :data:`Tally` event)."""
        if isinstance(tally, Count):
            setattr(self, tally.counter.value, getattr(self, tally.counter.value) + tally.n)
        elif isinstance(tally, RejectionGap):
            self.rejection_gap_s += tally.seconds
            self.rejection_gaps += 1
        else:
            # γ and D in effect for this round (before the controller moves them for the next).
            self.depth_sum += tally.depth
            self.gamma_sum += tally.gamma
            self.gamma_last, self.depth_last = tally.gamma, tally.depth
            self.rounds += 1
            self.draft_tokens += tally.drafted
            self.accepted_tokens += tally.accepted
            self.count_accepted(tally.accepted, tally.drafted)

    def sent(self, msg: Message, size: int) -> None:
        """A frame of ``size`` bytes went up (a core's Send, carried out by its driver)."""
        self.uplink_bytes += size
        if isinstance(msg, Hedge):
            self.hedges_sent += 1
            self.hedge_bytes += size

    def count_accepted(self, n: int, gamma: int) -> None:
        if len(self.accepted_per_position) < gamma:
            self.accepted_per_position += [0] * (gamma - len(self.accepted_per_position))
        for i in range(n):
            self.accepted_per_position[i] += 1


@dataclass(frozen=True)
class Summary:
    """One generation's outcome, as :meth:`Generation.summary` snapshots it (the runtime
    reports it: the statistics, the metrics): the generated ids, why it finished (None: it did
    not), its counters, the spans no verifier checked and the federation's measurements."""

    prompt_tokens: int
    generated: tuple[int, ...]
    finish_reason: str | None
    stats: Stats
    unverified: tuple[tuple[int, int], ...] = ()
    federation: Any = None

    @property
    def unverified_tokens(self) -> int:
        return sum(b - a for a, b in self.unverified)


class Generation:
    """One request's committed ids (prompt + generated), the source of truth.

    It calls nothing out: :meth:`commit` returns the events that tell the consumer (the cores
    return them, their drivers hand them on)."""

    def __init__(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        eos_ids: Sequence[int] = (),
        *,
        scored: bool = False,
    ) -> None:
        """``scored``: every :class:`Committed` carries its ids' log-probabilities (a session
        that asks the verifier for them: ``PipelineConfig.logprobs``)."""
        if not prompt:
            raise ValueError("the prompt must contain at least one token")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.committed: list[int] = [int(t) for t in prompt]
        self.prompt_len = len(self.committed)
        self.max_tokens = max_tokens
        self.eos_ids = frozenset(int(t) for t in eos_ids)
        self.scored = scored
        self.done = False
        self.finish_reason: str | None = None
        self.stats = Stats()
        #: [start, end) spans of ``generated`` that no verifier checked (draft-only fallback).
        self.unverified: list[tuple[int, int]] = []
        #: Federated mode only: the federation's measurements (edge_agent.link.federation).
        self.federation: Any = None
        #: The target's log-probabilities (sessions that ask for them: Hello.logprobs). Up to
        #: γ + 1 positions past the end may be scored (a batch the token limit cut short).
        self.logprobs = LogprobBook(self.prompt_len, self.prompt_len + max_tokens + 129)

    @property
    def generated(self) -> list[int]:
        return self.committed[self.prompt_len :]

    @property
    def end(self) -> int:
        """The position the generation stops at, at the latest (prompt + ``max_tokens``): a
        session's Hello names it (``cogen_end``) as the bound of co-generation."""
        return self.prompt_len + self.max_tokens

    @property
    def room(self) -> int:
        """How many more tokens may be generated."""
        return self.max_tokens - (len(self.committed) - self.prompt_len)

    @property
    def unverified_tokens(self) -> int:
        return sum(b - a for a, b in self.unverified)

    def commit(self, ids: Sequence[int], source: TokenSource) -> list[GenerationEvent]:
        """Append ids from ``source``, stopping at an end-of-sequence id or the token limit.
        Returns what the consumer is told: the ids committed (none once done) and, when they
        end the generation, that it finished.

        :attr:`TokenSource.LOCAL_DRAFT` ids are the draft's own (link-down fallback): they are
        committed like any other, and recorded in :attr:`unverified`.
        """
        start = len(self.generated)
        new: list[int] = []
        for t in ids:
            if self.done:
                break
            self.committed.append(int(t))
            new.append(int(t))
            if int(t) in self.eos_ids:
                self.done, self.finish_reason = True, "stop"
            elif self.room <= 0:
                self.done, self.finish_reason = True, "length"
        self.stats.sources[source] += len(new)
        if new and source == TokenSource.LOCAL_DRAFT:
            end = start + len(new)
            if self.unverified and self.unverified[-1][1] == start:
                self.unverified[-1] = (self.unverified[-1][0], end)
            else:
                self.unverified.append((start, end))
        scores = tuple(self.token_logprobs(start, start + len(new))) if self.scored else ()
        out: list[GenerationEvent] = [Committed(tuple(new), scores)] if new else []
        if self.done and self.finish_reason is not None and new:
            out.append(Finished(self.finish_reason))
        return out

    def token_logprobs(self, start: int, end: int) -> list[TokenLogprob]:
        """Entries of generated tokens ``start`` .. ``end − 1`` (indices into :attr:`generated`)."""
        return [
            self.logprobs.entry(self.prompt_len + j, self.committed[self.prompt_len + j])
            for j in range(start, end)
        ]

    def summary(self) -> Summary:
        """What the generation did, as a value: a snapshot its caller may keep (the driver goes
        on mutating the generation itself)."""
        return Summary(
            prompt_tokens=self.prompt_len,
            generated=tuple(self.generated),
            finish_reason=self.finish_reason,
            stats=copy.deepcopy(self.stats),
            unverified=tuple(self.unverified),
            federation=copy.deepcopy(self.federation),
        )

    def finish(self, reason: str) -> Finished:
        """End the generation for ``reason``; returns the event that tells the consumer."""
        self.done, self.finish_reason = True, reason
        return Finished(reason)
