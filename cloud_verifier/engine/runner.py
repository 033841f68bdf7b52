"""The engine's model runner: a step's requests → rows → one batched forward → decisions.

Runs on the engine's thread only (:mod:`cloud_verifier.engine.engine` owns the thread, the queue and
the futures; :mod:`cloud_verifier.engine.scheduler` picks the step). The runner owns the target, its
paged KV pool and every session slot's model state (pages, tokens, RNG, the p row kept for
Resamples), and answers each request of a step with its :data:`~cloud_verifier.engine.work.Result`:

* ``Crop`` (a pointer move in the pool) and ``Draw`` (a device draw from the kept row);
* ``CoGenerate`` with ``model_tokens``: first the draft model's greedy draft, every such
  session of the step batched (:mod:`cloud_verifier.engine.draft_model`);
* ``Verify``, ``Federate`` and ``CoGenerate`` in **one batched forward**, then, on the device and
  batched over the sessions (:mod:`cloud_verifier.engine.device_sampling`), the sampling transform
  and the
  decisions: *accepted* prefix, *recovered* correction or *bonus* token, or the federated rows.
  Only ids, counts and the few correction values reach the host.

The slot's length is the one owner of the cache length: work names where it starts and the
runner refuses work that does not start there; every result says the cache length after it,
by the one crop rule (:func:`~cloud_verifier.engine.work.cache_after`), which the session's core
adopts. A forward is committed (the slots' lengths moved) only once it returned; a failure
leaves each slot as it was before the request (:class:`~cloud_verifier.engine.work.Failed` says
so).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
import torch

from cloud_verifier.engine import device_sampling as ds
from cloud_verifier.engine.draft_length import draft_length
from cloud_verifier.engine.draft_model import CloudDrafter, DraftRequest
from cloud_verifier.engine.kv_manager import KVManager, Slot, new_generator
from cloud_verifier.engine.scheduler import model_drafts_allowed
from cloud_verifier.engine.step_times import DraftCost
from cloud_verifier.engine.targets import Target
from cloud_verifier.engine.work import (
    BranchTaken,
    CoGenerate,
    Crop,
    Cropped,
    Draw,
    Drawn,
    Failed,
    FailureKind,
    Federate,
    Federated,
    Result,
    Verified,
    Verify,
    Withheld,
    Work,
    cache_after,
)
from shared.maths.rejection import CorrectionMode, Decision
from shared.runtime.batched_lm import Row
from shared.runtime.kv_pool import OutOfPages, SlotPages
from shared.wire.messages import Hello, Logprobs

log = logging.getLogger(__name__)

#: Work that needs a forward of the target.
FORWARDS = (Verify, Federate, CoGenerate)


@dataclass(frozen=True)
class Timing:
    forward_s: float  # the step's batched forwards alone
    job_s: float  # the step: forwards + sampling transform + decisions
    batch: int  # sessions in the forwards
    padded_tokens: int  # Σ over the forwards of rows × longest row


@dataclass
class _Planned:
    index: int  # in the step's requests
    slot: Slot
    row: Row
    start: int  # the slot's length before the request
    work: Verify | Federate | CoGenerate
    chunk: bool = False  # a prefill chunk: cached, not decided (Prefilled)
    #: A tree row: the row index of the draft's first token (the chain's draft tokens follow
    #: it), then of each branch's first token (its token, its draft after it, in the layout).
    draft_at: int = 0
    branch_at: tuple[int, ...] = ()
    #: The plan's word: fixed tokens this step computes at most (None: all), and which of the
    #: step's forwards runs the row (:func:`~cloud_verifier.engine.scheduler.group_rows`).
    limit: int | None = None
    forward: int = 0

    @property
    def chain_rows(self) -> int:
        """Logits rows of the chain: the γ + 1 that decide it (the rest are the branches')."""
        return len(self.work.draft) + 1


@dataclass(frozen=True)
class Prefilled:
    """A chunk of a long prefill is cached (:func:`~cloud_verifier.engine.scheduler.prefill_chunk`):
    the slot holds ``cache_len`` tokens; the work goes on from there in a later step (the
    engine queues it again; the session's core never sees this)."""

    cache_len: int


def advance(work: Work, cache_len: int) -> Work:
    """``work`` once the cache holds its fixed tokens up to ``cache_len`` (a prefill chunk,
    and a claimed prefix): the same work from there."""
    if not isinstance(work, FORWARDS):
        raise TypeError(f"{type(work).__name__} has no fixed tokens to advance over")
    n = cache_len - work_start(work)
    if not 0 <= n <= len(work.fixed):
        raise ValueError(f"advance to {cache_len}: the work's fixed tokens do not reach it")
    if isinstance(work, CoGenerate):
        return replace(work, pos=cache_len, fixed=work.fixed[n:])
    return replace(work, propose=replace(work.propose, pos=cache_len, fixed=work.fixed[n:]))


def work_start(work: Verify | Federate | CoGenerate) -> int:
    """Where ``work`` says the cache ends (its first new token's position)."""
    return work.pos if isinstance(work, CoGenerate) else work.propose.pos


class Runner:
    """The target, its KV pool and the slots' model state (module docstring). ``kv``: who may
    hold which pages (shares, claims, reservations): the runner asks it before a forward writes
    anything."""

    def __init__(self, target: Target, kv: KVManager, drafter: CloudDrafter | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.kv = kv
        self.pool = kv.require_pool()
        self.forwards = 0  # batched forward passes
        self.drafts_deferred = 0  # model drafts not made: the step had edge-drafted work
        self.drafts_declined = 0  # model drafts not made: the session's acceptance did not pay
        #: c, a draft forward's time relative to a target forward's (the draft length's cost).
        self.draft_cost = DraftCost()
        self.rows_forwarded = 0  # session rows in them
        #: (padded tokens, seconds) of each forward of the last step: the step-time model's
        #: observations (the engine reads them after the step).
        self.last_forwards: list[tuple[int, float]] = []

    @property
    def max_context(self) -> int:
        """Tokens one session may hold: the model's limit, capped by its share of the pool."""
        return self.kv.max_context(self.target.max_length)

    @property
    def prefix_hit_tokens(self) -> int:
        return self.kv.prefix_hit_tokens

    # ------------------------------------------------------------------ slots

    def adopt(self, slot: Slot, hello: Hello, keep: int) -> list[int]:
        """Hand a lost session's ``slot`` to a new session of ``hello`` (its sampling, its RNG),
        its cache cut to at most ``keep`` tokens; returns the tokens kept."""
        keep = max(0, min(keep, slot.length))
        self.pool.crop(slot.pages, keep)
        slot.kept = None
        slot.hello = hello
        slot.generator = new_generator(hello, self.target.device)
        return list(slot.tokens)

    def free(self, slot: Slot) -> None:
        self.kv.free(slot)
        if self.drafter is not None:
            self.drafter.release(slot.draft_pages)
        slot.kept = None

    # ------------------------------------------------------------------ a step

    def step(
        self,
        requests: Sequence[tuple[Slot, Work]],
        plan: Sequence[tuple[int, int]] | None = None,
    ) -> list[tuple[Result | Prefilled, Timing | None]]:
        """Every request of one step, answered in order (cheap ones at once, the rest from the
        step's batched forwards). ``plan``: the scheduler's word on each request, (the fixed
        tokens it computes this step, which forward runs it); None: each whole, one forward."""
        out: list[tuple[Result | Prefilled, Timing | None] | None] = [None] * len(requests)
        planned: list[_Planned] = []
        self.last_forwards = []
        drafted = self._model_drafts(requests)
        for i, (slot, asked) in enumerate(requests):
            work = drafted.get(i, asked)
            if isinstance(work, Failed):
                out[i] = (work, None)
            elif slot.released:
                out[i] = (Failed("the session ended", slot.length, FailureKind.ENDED), None)
            elif isinstance(work, Crop):
                out[i] = (self._crop(slot, work.pos), None)
            elif isinstance(work, Draw):
                out[i] = (self._draw(slot, work.m), None)
            else:
                limit, forward = (None, 0) if plan is None else plan[i]
                row = self._plan(i, slot, work, limit, forward)
                if isinstance(row, Failed):
                    out[i] = (row, None)
                else:
                    planned.append(row)
        if planned:
            for i, answer in self._forward(planned):
                out[i] = answer
        assert all(a is not None for a in out)
        return [a for a in out if a is not None]

    def _model_drafts(
        self, requests: Sequence[tuple[Slot, Work]]
    ) -> dict[int, CoGenerate | Failed]:
        """The CoGenerates of the step that ask for a model draft, with the draft in place
        (one batched draft forward per token, every session together); Failed for each when
        the draft model fails (the session then co-generates without cloud drafts).

        Whether a session's co-generation gets a draft, and how long, is decided per session
        and per step: none in a step with edge-drafted work
        (:func:`~cloud_verifier.engine.scheduler.model_drafts_allowed`: capacity first), and none,
        or
        a shorter one, where the session's measured acceptance does not pay for the draft
        forwards at their measured cost (:func:`~cloud_verifier.engine.draft_length.draft_length`).
        A co-generation given no draft decodes one token, its ``withheld`` saying why."""
        todo: list[tuple[int, Slot, CoGenerate]] = [
            (i, slot, work)
            for i, (slot, work) in enumerate(requests)
            if isinstance(work, CoGenerate)
            and work.model_tokens > 0
            and not slot.released
            and work.pos == slot.length
        ]
        if not todo or self.drafter is None:
            return {}
        # rows that verify an edge's draft, as the scheduler counts them (a prompt's credit,
        # a Verify with no draft, is none)
        edge = sum(isinstance(w, (Verify, Federate)) and len(w.draft) > 0 for _, w in requests)
        if not model_drafts_allowed(edge):
            self.drafts_deferred += len(todo)
            return {i: replace(work, withheld=Withheld.LOAD) for i, _, work in todo}
        out: dict[int, CoGenerate | Failed] = {}
        asks: list[tuple[int, Slot, CoGenerate, int]] = []
        for i, slot, work in todo:
            n = work.model_tokens
            if work.model_alpha is not None:
                n = draft_length(work.model_alpha, self.draft_cost.ratio, n)
            if n > 0:
                asks.append((i, slot, work, n))
            else:
                self.drafts_declined += 1
                out[i] = replace(work, withheld=Withheld.COST)
        if not asks:
            return out
        forwards, t0 = self.drafter.forwards, time.perf_counter()
        try:
            drafts = self.drafter.draft(
                [
                    DraftRequest(slot.draft_pages, [*slot.tokens, *work.fixed.tolist()], n)
                    for _, slot, work, n in asks
                ]
            )
        except Exception as e:
            log.warning("the cloud draft model failed: %s: %s", type(e).__name__, e)
            why = f"cloud draft model: {type(e).__name__}: {e}"
            return {i: Failed(why, slot.length, FailureKind.DRAFT_MODEL) for i, slot, _ in todo}
        self.draft_cost.observe_draft(self.drafter.forwards - forwards, time.perf_counter() - t0)
        for (i, _, work, _), ids in zip(asks, drafts, strict=True):
            out[i] = replace(work, draft=np.array(ids, np.int64), q=np.ones(len(ids), np.float32))
        return out

    def _crop(self, slot: Slot, pos: int) -> Result:
        slot.kept = slot.kept_logits = None
        try:
            self.pool.crop(slot.pages, pos)
        except ValueError as e:
            return Failed(str(e), slot.length, FailureKind.BAD_WORK)
        return Cropped(cache_len=slot.length)

    def _draw(self, slot: Slot, m: int) -> Result:
        if slot.kept is None or slot.generator is None:
            return Failed(
                "no rejected row kept for a Resample",
                slot.length,
                FailureKind.BAD_WORK,
            )
        row, rejected = slot.kept
        try:
            drawn = ds.draw_candidates(row, rejected, m, slot.generator)
            lp = None
            n = slot.hello.logprobs
            if n is not None and slot.kept_logits is not None:
                ask = ds.LogprobAsk([0], [drawn.ids], n)
                lp = ds.logprobs(slot.kept_logits[None], [ask])[0]
            return Drawn(drawn, logprobs=lp)
        except Exception as e:
            return Failed(f"{type(e).__name__}: {e}", slot.length, FailureKind.MODEL)

    def _plan(
        self,
        index: int,
        slot: Slot,
        work: Verify | Federate | CoGenerate,
        limit: int | None = None,
        forward: int = 0,
    ) -> _Planned | Failed:
        """The forward row of one Verify/Federate/CoGenerate: fixed + draft after the cache; with
        no fixed tokens, the last cached token again (its row scores draft[0]; its keys are
        rewritten with the same values). ``limit``: the fixed tokens the plan gives it this
        step (fewer than it has: a chunk, cached with no decision)."""
        slot.kept = None
        start = before = slot.length
        if work_start(work) != start:
            return Failed(
                f"the work starts at {work_start(work)}, the cache holds {start} tokens",
                start,
                FailureKind.DESYNC,
            )
        fixed, draft = work.fixed.tolist(), work.draft.tolist()
        if not fixed and start == 0:
            return Failed(
                "no tokens in the cache: nothing to predict from",
                start,
                FailureKind.BAD_WORK,
            )
        target = self.target
        # The whole work's end (a chunked prefill is checked once, before its first chunk).
        full_end = start + len(fixed) + len(draft)
        if target.max_length is not None and full_end > target.max_length:
            return Failed(
                f"context of {full_end} tokens exceeds the model's maximum of {target.max_length}",
                start,
                FailureKind.CONTEXT,
            )
        new = fixed + draft
        if new and (min(new) < 0 or max(new) >= target.vocab_size):
            return Failed(
                f"token ids must be in [0, {target.vocab_size})",
                start,
                FailureKind.BAD_WORK,
            )
        quota = self.kv.over_quota(slot, full_end)
        if quota is not None:
            return Failed(quota, start, FailureKind.KV_QUOTA)
        if fixed and start == 0:
            claimed = self.kv.claim(slot, fixed)
            start, fixed = claimed, fixed[claimed:]
        chunk = len(fixed) if limit is None or limit >= len(fixed) else max(1, limit)
        parents: tuple[int, ...] | None = None
        branch_at: list[int] = []
        if chunk < len(fixed):  # a long prefill: this step caches a chunk of it, no decision
            row_start, ids, keep = start, fixed[:chunk], 0
        elif fixed:
            row_start, ids, keep = start, [*fixed, *draft], len(draft) + 1
        else:
            row_start, ids, keep = start - 1, [slot.tokens[-1], *draft], len(draft) + 1
        draft_at = len(ids) - len(draft)
        # A tree only where it fits: in the session's share and in free pages (else the chain
        # alone, as if no hedge had come).
        if isinstance(work, Verify) and work.branches:
            fits = self.kv.fits_tree(slot, row_start + len(ids) + work.tree_tokens)
            work = work if keep and fits else replace(work, branches=())
        if keep and isinstance(work, Verify) and work.branches:
            # A token tree: each branch after the chain in the layout, its token following
            # the chain token before draft[at] (so it sees the chain up to there), its draft
            # following it; every tree token's logits are kept.
            tree = list(range(-1, len(ids) - 1))
            for b in work.branches:
                branch_at.append(len(ids))
                tree.append(draft_at + b.at - 1)
                tree += range(len(ids), len(ids) + len(b.draft))
                ids += [b.token, *b.draft.tolist()]
            parents, keep = tuple(tree), keep + work.tree_tokens
        # A failed work leaves the cache as it found it (the core relies on it): a claim is let
        # go.
        short = self.kv.reserve_row(slot, row_start, row_start + len(ids), before)
        if short is not None:
            return Failed(short, before, FailureKind.OUT_OF_PAGES)
        row = Row(slot.pages, row_start, tuple(ids), keep, parents)
        # start: before any claim (an undo lets the claimed pages go, a replan claims again)
        return _Planned(
            index, slot, row, before, work, keep == 0, draft_at, tuple(branch_at), limit, forward
        )

    def _forward(
        self, planned: list[_Planned]
    ) -> list[tuple[int, tuple[Result | Prefilled, Timing | None]]]:
        t0 = time.perf_counter()
        # The plan's forwards, one after the other (rows of like length share one: a short
        # row is never padded to a prefill chunk's length); the rows in that order.
        planned = sorted(planned, key=lambda p: p.forward)
        parts: list[torch.Tensor] = []
        forwards: list[tuple[int, float]] = []
        try:
            for g in sorted({p.forward for p in planned}):
                batch = [p.row for p in planned if p.forward == g]
                tg = time.perf_counter()
                parts.append(self.target.forward(batch))  # [Σ keep, V]
                seconds = time.perf_counter() - tg
                forwards.append((len(batch) * max(len(r.ids) for r in batch), seconds))
                if any(
                    isinstance(p.work, CoGenerate) and p.work.model_tokens
                    for p in planned
                    if p.forward == g
                ):
                    # c is relative to the forwards that verify model drafts (no long prefills)
                    self.draft_cost.observe_target(seconds)
            logits = parts[0] if len(parts) == 1 else torch.cat(parts)
            forward_s = time.perf_counter() - t0
        except Exception as e:
            return self._failed(planned, e)
        self.last_forwards += forwards
        self.forwards += len(forwards)
        self.rows_forwarded += len(planned)
        for p in planned:  # commit
            self.pool.commit(p.slot.pages, p.row.start, p.row.ids)
        results: dict[int, Result | Prefilled] = {
            i: Prefilled(p.slot.length) for i, p in enumerate(planned) if p.chunk
        }
        # The decided rows, in order: each has its chain's γ+1 logits rows, then its tree's
        # (a prefill chunk has none).
        decided = [i for i, p in enumerate(planned) if not p.chunk]
        first = np.cumsum([0, *(planned[i].row.keep for i in decided)])
        verify = [j for j, i in enumerate(decided) if not isinstance(planned[i].work, Federate)]
        federate = [j for j, i in enumerate(decided) if isinstance(planned[i].work, Federate)]
        trees = any(planned[i].branch_at for i in decided)
        try:
            for group, decide in ((verify, self._decide), (federate, self._federate)):
                if not group:
                    continue
                rows = np.concatenate(
                    [np.arange(first[j], first[j] + planned[decided[j]].chain_rows) for j in group]
                )
                whole = len(group) == len(decided) and not trees
                sub = logits if whole else logits[torch.as_tensor(rows)]
                todo = [planned[decided[j]] for j in group]
                if decide == self._decide and trees:
                    done = self._decide(todo, sub, (logits, first[group].tolist()))
                else:
                    done = decide(todo, sub)
                results.update(zip((decided[j] for j in group), done, strict=True))
        except Exception as e:
            return self._failed(planned, e)
        for p in planned:  # the full pages of the text each slot now holds
            self.kv.publish(p.slot)
        padded = sum(tokens for tokens, _ in forwards)
        timing = Timing(forward_s, time.perf_counter() - t0, len(planned), padded)
        return [(p.index, (results[i], timing)) for i, p in enumerate(planned)]

    def _failed(
        self, planned: list[_Planned], error: Exception
    ) -> list[tuple[int, tuple[Result | Prefilled, Timing | None]]]:
        """A batch failed: undo it; one session fails alone, several are run again one by one
        so that only the session whose work fails gets the error."""
        for p in planned:
            self._undo(p)
        if len(planned) == 1:
            p = planned[0]
            failed = Failed(f"{type(error).__name__}: {error}", p.start, FailureKind.MODEL)
            return [(p.index, (failed, None))]
        log.info("a batch of %d sessions failed (%s); running them one by one", len(planned), error)
        out: list[tuple[int, tuple[Result | Prefilled, Timing | None]]] = []
        for p in planned:
            replanned = self._plan(p.index, p.slot, p.work, p.limit)
            if isinstance(replanned, Failed):
                out.append((p.index, (replanned, None)))
            else:
                out += self._forward([replanned])
        return out

    def _undo(self, p: _Planned) -> None:
        """Back to the slot's state before the request (its length never went below it)."""
        self.pool.crop(p.slot.pages, p.start)
        p.slot.kept = None

    def _decide(
        self,
        planned: list[_Planned],
        logits: torch.Tensor,
        tree: tuple[torch.Tensor, list[int]] | None = None,
    ) -> list[Result]:
        """Verdicts of the Verify/CoGenerate group: accepted prefix, then recovered or bonus
        (sampling transform on the device, only where a decision needs it: ``verify_logits``);
        a rejection crops the cache by the one rule (``cache_after``). ``logits``: the chain
        rows; ``tree``: the whole forward's logits and where each row's block starts, for the
        token-tree branches (:meth:`_open_branches`)."""
        hellos = [p.slot.hello for p in planned]
        gammas = [len(p.work.draft) for p in planned]
        decisions = ds.verify_batch(
            logits,
            _batch(
                [p.slot for p in planned],
                [p.work.draft for p in planned],
                [p.work.q for p in planned],
                # A CoGenerate's draft (a hedge's or the verifier's own) is deterministic: the
                # verifier draws its recovered token itself (the greedy-draft rule).
                [
                    CorrectionMode.GREEDY_DRAFT if isinstance(p.work, CoGenerate) else h.correction
                    for p, h in zip(planned, hellos, strict=True)
                ],
                [_wants_bonus(p.work) for p in planned],
            ),
        )
        lps = self._logprobs(planned, decisions, gammas, logits)
        opened = self._open_branches(planned, decisions, *tree) if tree is not None else {}
        out: list[Result] = []
        row = 0
        for p, d, g, h in zip(planned, decisions, gammas, hellos, strict=True):
            slot = p.slot
            kept = False
            length = cache_after(p.work, d.accepted)
            taken = opened.get(id(p))
            if taken is not None and isinstance(p.work, Verify):
                # The recovered token and the branch's accepted tokens move from the tree's
                # layout to their positions after the accepted chain; the rest is dropped.
                branch = p.work.branches[taken.index]
                k = taken.decision.accepted
                at = p.branch_at[taken.index]
                self.pool.move(
                    slot.pages,
                    [p.row.start + at + j for j in range(k + 1)],
                    [length + j for j in range(k + 1)],
                )
                self.pool.commit(slot.pages, length, [branch.token, *branch.draft[:k].tolist()])
                self.pool.crop(slot.pages, cache_after(p.work, d.accepted, taken))
            elif length < slot.length:  # a rejection
                self.pool.crop(slot.pages, length)
                if d.candidates is not None:
                    # p at the rejected position, for Resamples: one row, kept on the device
                    r = logits[row + d.accepted][None]
                    s = h.sampling
                    p_row = ds.transform_rows(r, s.temperature, s.top_k, s.top_p)[0]
                    slot.kept = (p_row, int(p.work.draft[d.accepted]))
                    if h.logprobs is not None:
                        slot.kept_logits = r[0].clone()  # a copy: not a view of the batch
                    kept = True
            drafted = (
                p.work.draft if isinstance(p.work, CoGenerate) and p.work.model_tokens else None
            )
            withheld = p.work.withheld if isinstance(p.work, CoGenerate) else None
            cached, slot.claimed = slot.claimed, 0
            out.append(
                Verified(
                    d,
                    kept_row=kept,
                    cache_len=slot.length,
                    drafted=drafted,
                    withheld=withheld,
                    cached=cached,
                    logprobs=lps.get(id(p)),
                    branch=taken,
                )
            )
            row += g + 1
        return out

    def _open_branches(
        self,
        planned: list[_Planned],
        decisions: list[Decision],
        logits: torch.Tensor,
        first: list[int],
    ) -> dict[int, BranchTaken]:
        """The token-tree branches the recovered tokens open (``id`` of the planned row → the
        branch and its decision), decided together in one device call: each as a
        deterministic draft after its token (the greedy-draft rule), with a bonus token after
        a full acceptance. ``logits``: the whole forward's; ``first``: where each row's block
        starts in it (its chain's γ + 1 rows, then its tree tokens' rows, in the layout)."""
        asks: list[tuple[_Planned, int]] = []
        rows: list[int] = []
        for p, d, f in zip(planned, decisions, first, strict=True):
            work = p.work
            if not isinstance(work, Verify) or d.token is None:
                continue
            for i, b in enumerate(work.branches):
                if b.opened_by(d):
                    # Its token's row (scoring draft[0]) and each draft token's, in the block.
                    top = f + p.chain_rows + (p.branch_at[i] - p.branch_at[0])
                    rows += range(top, top + len(b.draft) + 1)
                    asks.append((p, i))
                    break
        if not asks:
            return {}
        drafts = [p.work.branches[i].draft for p, i in asks if isinstance(p.work, Verify)]
        decisions = ds.verify_batch(
            logits[torch.as_tensor(rows, device=logits.device)],
            _batch(
                [p.slot for p, _ in asks],
                drafts,
                [np.ones(len(d), np.float32) for d in drafts],
                [CorrectionMode.GREEDY_DRAFT] * len(asks),
                [True] * len(asks),
            ),
        )
        return {id(p): BranchTaken(i, d) for (p, i), d in zip(asks, decisions, strict=True)}

    @staticmethod
    def _logprobs(
        planned: list[_Planned],
        decisions: list[Decision],
        gammas: list[int],
        logits: torch.Tensor,
    ) -> dict[int, Logprobs]:
        """The target's log-probabilities for the sessions whose Hello asked: each accepted
        draft token, then the decision row's ids (its recovered or bonus token, or the
        candidates / top-K the edge picks from). All sessions in one device call."""
        asks: dict[int, ds.LogprobAsk] = {}
        row = 0
        for p, d, g in zip(planned, decisions, gammas, strict=True):
            n = p.slot.hello.logprobs
            if n is not None:
                a = d.accepted
                ids = [np.asarray(p.work.draft[j : j + 1], np.int64) for j in range(a)]
                decided = d.token if d.token is not None else d.bonus
                if decided is not None:
                    ids.append(np.array([decided], np.int64))
                elif d.candidates is not None or d.sparse is not None:
                    offered = d.candidates if d.candidates is not None else d.sparse
                    assert offered is not None
                    ids.append(np.asarray(offered.ids, np.int64))
                if ids:
                    asks[id(p)] = ds.LogprobAsk(range(row, row + len(ids)), ids, n)
            row += g + 1
        return dict(zip(asks, ds.logprobs(logits, list(asks.values())), strict=True))

    def _federate(self, planned: list[_Planned], logits: torch.Tensor) -> list[Result]:
        """SpecFed replies of the Federate group: γ+1 top-K rows, p_j(x_j), the l1 of both
        reconstructions (every row transformed: the edge needs them all)."""
        hellos = [p.slot.hello for p in planned]
        gammas = [len(p.work.draft) for p in planned]
        temp, top_k, top_p = ds.row_params([h.sampling for h in hellos], gammas)
        rows = ds.federate_rows(
            ds.transform_rows(logits, temp, top_k, top_p),
            np.concatenate([p.work.draft for p in planned]),
            ds.cu_from_gammas(gammas),
            [h.k for h in hellos],
            [h.eps_target for h in hellos],
        )
        return [
            Federated(dists, p_draft, l1, cache_len=p.slot.length)
            for p, (dists, p_draft, l1) in zip(planned, rows, strict=True)
        ]

    # ------------------------------------------------------------------ warm-up

    def warm_up(self, max_batch: int) -> list[tuple[int, float]]:
        """One batched step (and, compiled, one per shape bucket up to ``max_batch`` rows) on
        scratch pages, so the first session does not pay for lazy initialisation or
        compilation; then the step-time anchors: (tokens, seconds) of one warm forward of 8
        tokens and one of up to 128."""
        target = self.target
        compiled = bool(getattr(target, "compiled", False))
        sizes = [1, 2, 4, 8, 16, 32, 64] if compiled else [1]
        for b in sizes:
            if b > max_batch:
                break
            slots = [SlotPages() for _ in range(b)]
            try:
                for s in slots:
                    self.pool.reserve(s, 8)
                target.forward([Row(s, 0, (0,) * 8, 8) for s in slots])
            except OutOfPages:
                log.info("warm-up stopped at batch %d: the KV pool is smaller", b)
                break
            finally:
                for s in slots:
                    self.pool.release(s)
        limit = min(128, self.pool.num_pages * self.pool.page_size)
        if target.max_length is not None:
            limit = min(limit, target.max_length)
        anchors: list[tuple[int, float]] = []
        for n in sorted({min(8, limit), limit}):
            pages = SlotPages()
            try:
                self.pool.reserve(pages, n)
                t0 = time.perf_counter()
                target.forward([Row(pages, 0, (0,) * n, min(n, 8))])
                anchors.append((n, time.perf_counter() - t0))
            except OutOfPages:
                break
            finally:
                self.pool.release(pages)
        return anchors


def _batch(
    slots: Sequence[Slot],
    drafts: Sequence[npt.NDArray[np.int64]],
    qs: Sequence[npt.NDArray[np.float32]],
    correction: Sequence[CorrectionMode],
    want_bonus: Sequence[bool],
) -> ds.VerifyBatch:
    """The device decision's input for these sessions' drafts (in row order), each with its
    own sampling, RNG, K, ε target and M from its Hello."""
    hellos = [s.hello for s in slots]
    return ds.VerifyBatch(
        params=[h.sampling for h in hellos],
        draft_ids=np.concatenate(drafts),
        q_draft=np.concatenate(qs),
        cu_draft=ds.cu_from_gammas([len(d) for d in drafts]),
        corrections=ds.Corrections(
            correction=correction,
            want_bonus=want_bonus,
            generators=[s.generator for s in slots],
            k=[h.k for h in hellos],
            eps_target=[h.eps_target for h in hellos],
            m=[h.m for h in hellos],
        ),
    )


def _wants_bonus(work: Work) -> bool:
    return isinstance(work, CoGenerate) or (isinstance(work, Verify) and work.want_bonus)
