"""The engine's scheduler: what the next step runs. Pure: no torch, no threads, no clock (vLLM
v1's Scheduler → SchedulerOutput split, Sarathi-Serve's stall-free batching, on a small scale).

The engine's queue holds, in arrival order, calls to run between steps (load, warm-up, ping,
adopting a lost session, freeing a session's pages) and the sessions' model work, each described
here by a :class:`Queued`: its kind, its tenant, the fixed tokens it still has to cache and the
tokens of the row that decides it. :func:`plan_step` turns the queue into a :class:`StepPlan`
that names every row of the next step:

* **calls first.** Every queued call runs before the next step, whatever else is queued: a
  watchdog's ping, a session's release or a resume's adoption waits for the running step at
  most, never for a prefill;
* **decode work next, the sessions furthest behind first.** Every queued round whose fixed
  tokens are few (at most :data:`DECODE_FIXED`: the tokens committed since its last verdict)
  and every co-generation is in the step, up to ``max_sessions`` rows and ``max_tokens``
  tokens, taken in order of their sessions' weight (:mod:`cloud_verifier.session.pace`: the
  sessions furthest below the rate they are owed first; a round whose batches were deferred
  :data:`~cloud_verifier.engine.work.DEFER_BOUND` steps in a row counts as the furthest), then
  of arrival: one rule for every kind of session's work, so a co-generation for a session
  waiting on its edge is owed room like any round, and one left out is answered Skipped.
  Cheap work (Crop, Draw) is always in the step. The verifier's draft model runs only in
  steps with no edge-drafted work (:func:`model_drafts_allowed`);
* **prefills share what is left.** Work with more fixed tokens (a prompt, a re-prefill) is a
  *prefill*: computed in chunks, one a step, each chunk's row caching its tokens with no
  decision; the last one carries the draft and decides. A step's prefill budget
  (:func:`prefill_budget`) is ``prefill_chunk`` tokens while other sessions are active (they
  may send a round at any moment and must find a short step), ``max_tokens`` when the prefills
  are alone on the engine; never more than the rounds leave of ``max_tokens``, never less than
  :data:`MIN_PREFILL` (so prefill always moves). Beside *other tenants'* rounds, one tenant's
  prefill may add at most ``prefill_share`` of their step's time (:func:`tenant_cap`). The
  budget is shared **max-min fairly between tenants** (bearer tokens): each tenant with a
  prefill waiting gets an equal share, a tenant that needs less leaves the rest to the others;
  within a tenant the oldest prefill goes first (one prompt finished soon rather than all
  late). A re-queued prefill keeps its place in the queue but never goes ahead of a round;
* **a short row is not padded to a chunk's length** (:func:`group_rows`): the rounds share one
  forward, and the prefill rows run in a second one whenever padding the rounds to their
  length would cost more than a forward, by the step-time model ``a + b·tokens`` (one
  forward's overhead ``a`` in tokens: ``a / b``).

* **speculative slots by weighted survival** (:func:`_rationed`, :mod:`~cloud_verifier.engine.
  rationing`): a round's draft past its promise is verified where its survival times its
  session's weight pays the step's price; a token tree rides in its round's row where the
  step prices nothing or it pays like a slot (:func:`_trees`), else its branches wait for the
  co-generation after a rejection, as hedges.

A session has at most one request queued (its core waits for the result), so a step sees each
session at most once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from cloud_verifier.engine.rationing import Round, own_budget, ration, survival_of
from cloud_verifier.engine.step_times import StallRule, StepTimes
from cloud_verifier.engine.work import (
    DEFER_BOUND,
    MAX_WEIGHT,
    CoGenerate,
    Federate,
    Verify,
    Work,
    batch_ends,
    rationed,
)

#: Fixed tokens of a decode round: work with at most this many (the tokens committed since the
#: session's last verdict: up to depth × (γ + 1), well under this for the protocol's bounds) is
#: a round, served whole in the next step; more is a prefill, computed in fair chunks.
DECODE_FIXED = 64
#: The least prefill a step computes while prefills wait (tokens): the rounds never starve it.
MIN_PREFILL = 16


class Kind(Enum):
    CALL = "call"  # a function to run between steps
    FORWARD = "forward"  # Verify / Federate: a row in the step's forward
    COGEN = "cogen"  # CoGenerate: a row only where the step has room
    CHEAP = "cheap"  # Crop / Draw: no forward


@dataclass(frozen=True)
class Queued:
    """One queue entry as the scheduler sees it. Forwards: ``fixed`` tokens still to cache
    before the deciding row, ``decide`` the tokens after them (draft, tree, and the row that
    scores the first draft token), ``tenant`` who pays."""

    kind: Kind
    fixed: int = 0
    decide: int = 1
    tenant: str = ""
    #: Its slot in the KV cache: tokens cached, pages held (the KV manager's figures).
    cached: int = 0
    held: int = 0
    #: A Verify whose draft may be cut (:mod:`cloud_verifier.engine.rationing`): the survival
    #: s_i of each draft slot (one per draft token; empty: never cut).
    survival: tuple[float, ...] = ()
    #: â of an average draft token of its session (for the budget it is told).
    mean_token: float = 0.0
    #: The draft length at each of its batches' ends (() : one batch), and the draft tokens a
    #: round its session was promised (rationing.Round).
    ends: tuple[int, ...] = ()
    promised: int = 1
    #: Its session's weight (:mod:`cloud_verifier.session.pace`) and the steps in a row the
    #: ration deferred its batches.
    weight: float = 1.0
    waited: int = 0
    #: A Verify's token-tree branches: their tokens (beyond ``decide``, in the row only where
    #: the plan keeps the tree) and the tokens they are expected to add (what they are priced by).
    tree: int = 0
    tree_value: float = 0.0

    def pages(self, tokens: int, page_size: int) -> int:
        """New pages a row of ``tokens`` after the cache needs."""
        return max(0, -(-(self.cached + tokens) // page_size) - self.held)

    def fitting(self, pages: int, page_size: int) -> int:
        """The most tokens a row after the cache may have within ``pages`` new pages."""
        return max(0, (self.held + pages) * page_size - self.cached)

    @property
    def row(self) -> int:
        """Tokens of the row that caches what is left and decides."""
        return self.fixed + self.decide

    @property
    def priority(self) -> float:
        """How the scheduler ranks it (:mod:`cloud_verifier.session.pace`): its session's
        weight, the most once its batches were deferred for the bound."""
        return MAX_WEIGHT if self.waited >= DEFER_BOUND else self.weight

    @property
    def round(self) -> Round:
        """This round as the ration sees it (keyed 0: the caller re-keys it)."""
        return Round(
            0,
            self.row - len(self.survival),
            self.survival,
            self.ends,
            self.promised,
            self.weight,
            self.waited,
        )

    @property
    def base(self) -> int:
        """Tokens of the row no ration leaves out: fixed tokens, the scoring row, the slots its
        session was promised (the whole row where the draft may not be cut)."""
        if not self.survival:
            return self.row
        return self.round.base

    @property
    def prefill(self) -> bool:
        return self.kind == Kind.FORWARD and self.fixed > DECODE_FIXED


def forward_entry(
    work: Verify | Federate | CoGenerate, tenant: str = "", cached: int = 0, held: int = 0
) -> Queued:
    """A forward's work as the scheduler sees it: its fixed tokens, the row that decides (draft,
    tree tokens, and the row scoring the first draft token), what the ration ranks its draft
    slots by and what its session was promised; ``tenant``, ``cached`` and ``held`` are its
    slot's (the simulation's engine has no KV limits: none)."""
    kind = Kind.COGEN if isinstance(work, CoGenerate) else Kind.FORWARD
    survival, mean = survival_of(work)
    ends, promised = (batch_ends(work), work.promised) if isinstance(work, Verify) else ((), 1)
    tree, value, waited = (
        (work.tree_tokens, work.tree_value, work.waited)
        if isinstance(work, Verify)
        else (0, 0.0, 0)
    )
    weight = work.weight if isinstance(work, (Verify, CoGenerate)) else 1.0
    return Queued(
        kind,
        len(work.fixed),
        len(work.draft) + 1,
        tenant,
        cached,
        held,
        survival,
        mean,
        ends,
        promised,
        weight,
        waited,
        tree,
        value,
    )


@dataclass(frozen=True)
class BatchLimits:
    """The engine's limits a step's plan reads (``EngineLimits.batch``): no defaults of their
    own, they are the settings'."""

    max_sessions: int
    max_tokens: int
    #: Prefill tokens a step computes at most while other sessions are active (0: no chunking).
    prefill_chunk: int
    #: ... and at most this share of the step's time without them (0: no such bound).
    prefill_share: float
    #: Rationing speculation (:func:`_rationed`); False: every draft whole, as it came.
    #: ``ration_share``: rationing.ration's ``share``.
    ration: bool = True
    ration_share: float = 0.5


@dataclass(frozen=True)
class Pages:
    """The KV manager's word for a plan: pages a slot may still get, and their size."""

    free: int
    size: int


@dataclass(frozen=True)
class Row:
    """One row of the step: queue entry ``index``; ``chunk`` fixed tokens computed (== its
    ``fixed``: the whole row, decided this step; fewer: a chunk, cached, no decision);
    ``tokens`` the row's length; ``forward`` which of the step's forwards runs it."""

    index: int
    chunk: int
    tokens: int
    forward: int = 0
    pages: int = 0  # new KV pages it takes
    #: A Verify's draft tokens verified when the ration cut it (None: the whole draft).
    cut: int | None = None
    #: The draft tokens a round its session is told it may send (rationing.MAX_AHEAD: no bound).
    budget: int | None = None
    #: A Verify's token tree rides in the row (its tokens are in ``tokens``); False: the
    #: branches are left out (they wait for co-generation as hedges).
    tree: bool = False

    @property
    def decides(self) -> bool:
        return self.tokens > self.chunk


@dataclass(frozen=True)
class StepPlan:
    """The next step. ``calls`` run before it (queue indices); ``cheap`` and ``rows`` are its
    work; ``skipped`` co-generations found no room (answered at once); ``forwards`` the number
    of forwards the rows are grouped into; ``tokens`` what they compute, padding included
    (Σ rows × longest row per forward); ``model_drafts`` whether the verifier's own draft model
    may run. Everything in ``taken`` leaves the queue; a chunked row goes back to it."""

    calls: tuple[int, ...] = ()
    cheap: tuple[int, ...] = ()
    rows: tuple[Row, ...] = ()
    skipped: tuple[int, ...] = ()
    forwards: int = 0
    tokens: int = 0
    model_drafts: bool = True
    #: What each tenant held to a share beside other tenants' rounds has saved towards its next
    #: prefill chunk (:func:`tenant_allowance`): the next plan's ``credit``.
    credit: Mapping[str, float] = field(default_factory=dict)
    #: The step's price of a speculative token (rationing.Ration.price; 0: not priced).
    price: float = 0.0

    @property
    def taken(self) -> frozenset[int]:
        return frozenset((*self.calls, *self.cheap, *(r.index for r in self.rows), *self.skipped))

    @property
    def work(self) -> tuple[int, ...]:
        """The step's requests in the order they run: cheap ones, then the rows."""
        return (*self.cheap, *(r.index for r in self.rows))


def plan_step(
    queue: Sequence[Queued],
    limits: BatchLimits,
    active_sessions: int = 0,
    overhead_tokens: float = 0.0,
    pages: Pages | None = None,
    typical_rounds: Mapping[str, int] | None = None,
    typical_shape: tuple[int, int, int] = (0, 0, 0),
    credit: Mapping[str, float] | None = None,
) -> StepPlan:
    """The next step from ``queue`` (module docstring). ``active_sessions``: sessions with work
    queued, running or sent a moment ago (more than the prefilling ones: the prefill budget is
    :func:`prefill_budget`'s shared one); ``typical_rounds``: by tenant, the tokens of a recent
    step's rounds (what a step without their rounds queued yet will soon hold), and
    ``typical_shape`` its rows, longest row and longest cache; ``credit``: what each tenant has
    saved towards its next prefill chunk beside other tenants' rounds (the plan's ``credit``
    after it);
    ``overhead_tokens``: one forward's fixed cost in tokens (:func:`group_rows`); ``pages``:
    the KV pages there are (None: as many as needed). Rounds take their pages first; a prefill
    chunk is cut to the pages left (at least a page's worth, else planned as it is, so that it
    fails at once with the pool full instead of waiting without bound)."""
    calls = [i for i, q in enumerate(queue) if q.kind == Kind.CALL]
    cheap = [i for i, q in enumerate(queue) if q.kind == Kind.CHEAP]
    rounds: list[tuple[int, int]] = []  # (index, tokens): Verify / Federate decode rounds
    cogens: list[tuple[int, int]] = []  # co-generations
    skipped: list[int] = []
    used = 0

    def fits(n: int) -> bool:
        rows = len(rounds) + len(cogens)
        return rows < limits.max_sessions and used + n <= limits.max_tokens

    # Decode work, rounds and co-generations alike, the sessions furthest behind their rate
    # first (pace), then in arrival order: the first always fits, and where a step cannot take
    # every session's, those ahead wait (a co-generation left out is answered Skipped).
    for i in by_priority(queue):
        q = queue[i]
        if q.kind == Kind.FORWARD and not q.prefill:
            need = q.base if limits.ration else q.row
            if (not rounds and not cogens) or fits(need):
                rounds.append((i, need))
                used += need
        elif q.kind == Kind.COGEN:
            if (not rounds and not cogens) or fits(q.row):
                cogens.append((i, q.row))
                used += q.row
            else:
                skipped.append(i)
    # rounds and prefills that verify an edge's draft (a prompt's credit verifies none)
    edge_rounds = sum(1 for i, _ in rounds if queue[i].decide > 1)
    size = pages.size if pages is not None else 1
    decode = [*rounds, *cogens]
    left = pages.free - sum(queue[i].pages(n, size) for i, n in decode) if pages else 0
    prefills = [i for i, q in enumerate(queue) if q.prefill]
    by_tenant: dict[str, int] = {}
    for i, n in decode:
        by_tenant[queue[i].tenant] = by_tenant.get(queue[i].tenant, 0) + n
    shape = (
        (
            len(decode),
            max(n for _, n in decode),
            max(queue[i].cached + n for i, n in decode),
        )
        if decode
        else typical_shape
    )
    cost = (
        RoundsCost(*shape, overhead_tokens)
        if shape[0] > 0 and overhead_tokens != float("inf")
        else None
    )
    grants, saved = _prefill_grants(
        queue,
        prefills,
        limits,
        by_tenant,
        active_sessions,
        typical_rounds or {},
        cost,
        credit or {},
    )
    chunks: list[tuple[int, int, int]] = []  # (index, chunk, tokens)
    for i in prefills:
        q, g = queue[i], grants.get(i, 0)
        if g <= 0 or len(decode) + len(chunks) >= limits.max_sessions:
            continue
        if pages is not None:
            room = q.fitting(max(0, left), size) if left > 0 else 0
            if room >= size:
                g = min(g, room)
            left -= q.pages(min(g, q.row), size)
        if g >= q.row:  # the rest of it, and its decision
            chunks.append((i, q.fixed, q.row))
        else:  # a chunk: at least one fixed token is left for the deciding row
            n = min(g, q.fixed - 1)
            chunks.append((i, n, n))
        used += chunks[-1][2]
    rounds, used, priced, price = _rationed(
        queue, rounds, cogens, chunks, limits, used, overhead_tokens, active_sessions
    )
    rounds, used, trees = _trees(queue, rounds, limits, used, price)
    for i, _ in cogens:
        q = queue[i]
        if q.survival and limits.ration:
            # its cloud draft is not cut now; the next one is held to the budget
            priced[i] = (None, own_budget(price, q.survival, q.mean_token, q.priority))
    rounds += cogens
    far = bool(rounds) and any(
        not joins_rounds(queue[i].cached + n, shape[2]) for i, _, n in chunks
    )
    forwards = group_rows(
        [n for _, n in rounds], [n for _, _, n in chunks], overhead_tokens, apart=far
    )

    def new_pages(i: int, n: int) -> int:
        return queue[i].pages(n, size) if pages is not None else 0

    rows = [
        Row(
            i,
            queue[i].fixed,
            n,
            pages=new_pages(i, n),
            cut=priced.get(i, (None, None))[0],
            budget=priced.get(i, (None, None))[1],
            tree=i in trees,
        )
        for i, n in rounds
    ]
    rows += [Row(i, c, n, forwards - 1, new_pages(i, n)) for i, c, n in chunks]
    padded = sum(
        len(group) * max(r.tokens for r in group)
        for group in ([r for r in rows if r.forward == g] for g in range(forwards))
    )
    return StepPlan(
        tuple(calls),
        tuple(cheap),
        tuple(rows),
        tuple(skipped),
        forwards,
        padded,
        model_drafts_allowed(edge_rounds + sum(1 for i, _, _ in chunks if queue[i].decide > 1)),
        saved,
        price,
    )


def _rationed(
    queue: Sequence[Queued],
    rounds: list[tuple[int, int]],
    cogens: Sequence[tuple[int, int]],
    chunks: Sequence[tuple[int, int, int]],
    limits: BatchLimits,
    used: int,
    overhead: float,
    active_sessions: int,
) -> tuple[list[tuple[int, int]], int, dict[int, tuple[int | None, int]], float]:
    """The rounds' rows (index, tokens) once the ration (:func:`~cloud_verifier.engine.
    rationing.ration`) has added their speculative slots, the step's tokens, each cuttable
    round's (cut, budget) and the price. The slots come after the prefill chunks already
    planned (a first token never waits behind another session's speculative tokens), within
    ``max_tokens``; they are priced only where another session shares the verifier (a lone
    session's draft is its own controller's choice: cutting it buys no one anything)."""
    cuttable = [(i, n) for i, n in rounds if queue[i].survival]
    if not cuttable or not limits.ration:
        return rounds, used, {}, 0.0
    shared = active_sessions >= 2 or len(rounds) + len(cogens) + len(chunks) >= 2
    # rows whose draft is never cut here (co-generations among them): one token each, at least
    plain = [i for i, _ in rounds if not queue[i].survival] + [i for i, _ in cogens]
    decided = sum(1 for i, c, _ in chunks if c == queue[i].fixed)
    mine = {i: replace(queue[i].round, key=i) for i, _ in cuttable}
    prefill = sum(n for _, _, n in chunks)
    r = ration(
        list(mine.values()),
        used - sum(n for _, n in cuttable),
        float(len(plain) + decided),
        overhead if shared else float("inf"),
        limits.max_tokens,
        limits.ration_share,
        prefill,
    )
    # The price a session is told: its rounds' beside the step's rounds alone (a prompt's
    # prefill chunk takes this step's speculative share, not every session's next batches).
    told = r
    if prefill:
        told = ration(
            list(mine.values()),
            used - sum(n for _, n in cuttable) - prefill,
            float(len(plain)),
            overhead if shared else float("inf"),
            limits.max_tokens,
            limits.ration_share,
        )
    out: list[tuple[int, int]] = []
    info: dict[int, tuple[int | None, int]] = {}
    for i, n in rounds:
        q = queue[i]
        if not q.survival:
            out.append((i, n))
            continue
        k = r.keep[i]
        extra = k - mine[i].mandatory
        out.append((i, n + extra))
        used += extra
        cut = k if k < len(q.survival) else None
        info[i] = (cut, told.budget(mine[i], q.mean_token))
    return out, used, info, r.price


def as_planned(work: Work, row: Row) -> Work:
    """``work`` as its ``row`` of the plan runs it: a Verify's draft cut or its batches
    deferred where the ration left some out (:func:`~cloud_verifier.engine.work.rationed`,
    which drops the tree too), its tree's branches left out where the plan keeps none."""
    if not isinstance(work, Verify):
        return work
    if row.cut is not None:
        return rationed(work, row.cut)
    if work.branches and not row.tree:
        return replace(work, branches=(), tree_value=0.0)
    return work


def by_priority(queue: Sequence[Queued]) -> list[int]:
    """Queue indices, the sessions furthest behind their rate first (:attr:`Queued.priority`),
    then in arrival order: who gets a step's room first (:mod:`cloud_verifier.session.pace`)."""
    return sorted(range(len(queue)), key=lambda i: (-queue[i].priority, i))


def _trees(
    queue: Sequence[Queued],
    rounds: list[tuple[int, int]],
    limits: BatchLimits,
    used: int,
    price: float,
) -> tuple[list[tuple[int, int]], int, set[int]]:
    """The rounds with the token trees the step keeps, the step's tokens, and which rows carry
    one. A round verified whole (not cut, not deferred) keeps its tree where the step prices
    nothing (``price`` 0: an idle verifier, a lone session) or where the tree pays for its
    tokens like a slot would: its session's weight times the tokens it is expected to add is
    at least ``price`` per tree token; within ``max_tokens``. A tree left out costs nothing:
    its branches wait on the verifier as hedges, for the co-generation step after a
    rejection."""
    out: list[tuple[int, int]] = []
    kept: set[int] = set()
    for i, n in rounds:
        q = queue[i]
        whole = q.fixed + q.decide
        pays = price <= 0.0 or q.priority * q.tree_value >= price * q.tree
        if q.tree and n == whole and pays and used + q.tree <= limits.max_tokens:
            out.append((i, n + q.tree))
            used += q.tree
            kept.add(i)
        else:
            out.append((i, n))
    return out, used, kept


def prefill_budget(limits: BatchLimits, rounds_tokens: int, alone: bool) -> int:
    """Prefill tokens of the next step, over all tenants: alone on the engine (no other
    session active), all the room the rounds leave of ``max_tokens``; beside active sessions,
    ``prefill_chunk``. Never less than :data:`MIN_PREFILL`, so a prompt always moves."""
    room = max(MIN_PREFILL, limits.max_tokens - rounds_tokens)
    if limits.prefill_chunk <= 0 or alone:
        return room
    return max(MIN_PREFILL, min(limits.prefill_chunk, room))


def joins_rounds(kv: int, rounds_kv: int) -> bool:
    """May a prefill row reading ``kv`` cached positions share the forward of rounds reading at
    most ``rounds_kv``? Every row of a forward reads (gathers and masks) its longest row's cache:
    only within twice theirs."""
    return kv <= 2 * max(rounds_kv, 64)


@dataclass(frozen=True)
class RoundsCost:
    """What a tenant's prefill row costs a step of other tenants' rounds, in tokens of the
    step-time model a + b·tokens (``overhead``: a/b). The rounds: ``k`` rows, the longest ``m``
    tokens, reading at most ``kv`` cached positions. A prefill row of p tokens runs in a forward
    of its own (a/b + p) or, when it reads no more than twice their cache (the forward's key
    gather and mask grow to its longest row's cache), padded with them ((k+1)·max(p, m) − k·m)."""

    k: int
    m: int
    kv: int
    overhead: float

    @property
    def rounds(self) -> float:
        """The rounds' own step: a/b + k·m."""
        return self.overhead + self.k * self.m

    def joins(self, kv: int) -> bool:
        """May a prefill row reading ``kv`` cached positions share the rounds' forward?"""
        return joins_rounds(kv, self.kv)

    def cost(self, p: int, kv: int) -> float:
        apart = self.overhead + p
        if not self.joins(kv):
            return apart
        return min(apart, (self.k + 1) * max(p, self.m) - self.k * self.m)

    def most(self, budget: float, kv: int) -> int:
        """The longest prefill row within ``budget``."""
        apart = budget - self.overhead
        together = (budget + self.k * self.m) / (self.k + 1) if budget >= self.m else 0.0
        return int(max(apart, together if self.joins(kv) else 0.0))


def tenant_allowance(
    limits: BatchLimits, cost: RoundsCost, saved: float, kv: int
) -> tuple[int, float]:
    """Deficit round robin by time, between one tenant's prompts and other tenants' rounds
    (Sarathi-Serve's stall-free budget, kept on average): each step the tenant earns
    ``prefill_share`` of the rounds' step time (share·(a/b + k·m) tokens of b) onto what it has
    ``saved``, up to one rounds' step, or share of one above 1 (so a step grows by at most that
    factor plus one); it spends it on a prefill row
    when that buys at least :data:`MIN_PREFILL` tokens: on a CPU, where a forward's overhead is
    large against a few rounds, a chunk every few steps rather than a sliver every step.
    Returns (the most tokens it may prefill now, 0: none; its savings before spending)."""
    earned = saved + limits.prefill_share * cost.rounds
    ceiling = max(1.0, limits.prefill_share) * cost.rounds
    earned = min(earned, max(ceiling, cost.cost(MIN_PREFILL, kv)))
    p = cost.most(earned, kv)
    return (p if p >= MIN_PREFILL else 0), earned


def _prefill_grants(
    queue: Sequence[Queued],
    prefills: Sequence[int],
    limits: BatchLimits,
    rounds: dict[str, int],
    active_sessions: int,
    typical_rounds: Mapping[str, int],
    cost: RoundsCost | None,
    credit: Mapping[str, float],
) -> tuple[dict[int, int], dict[str, float]]:
    """Tokens each waiting prefill may compute in the next step, and the tenants' savings
    after it: the budget split max-min fairly between tenants, a tenant beside other tenants'
    rounds held to its :func:`tenant_allowance`, then oldest first within a tenant, each capped
    by ``prefill_chunk`` and by what it needs. ``rounds``: the step's rounds' tokens by tenant;
    ``cost``: what a prefill row costs the rounds (None: no share bound)."""
    if not prefills:
        return {}, {}
    alone = active_sessions <= len(prefills)
    budget = prefill_budget(limits, sum(rounds.values()), alone)
    cap = limits.prefill_chunk if limits.prefill_chunk > 0 and not alone else budget
    by_tenant: dict[str, list[int]] = {}
    for i in prefills:
        by_tenant.setdefault(queue[i].tenant, []).append(i)
    need: dict[str, int] = {}
    earned: dict[str, float] = {}
    kv_of: dict[str, int] = {}
    for t, ids in by_tenant.items():
        want = sum(min(queue[i].row, cap) for i in ids)
        others = any(n > 0 and u != t for u, n in (*rounds.items(), *typical_rounds.items()))
        if cost is None or limits.prefill_share <= 0 or not others:
            need[t] = want
            continue
        kv_of[t] = max(queue[i].cached + min(queue[i].row, cap) for i in ids)
        allowed, earned[t] = tenant_allowance(limits, cost, credit.get(t, 0.0), kv_of[t])
        need[t] = min(want, allowed)
    share = fair_shares(need, budget)
    grants: dict[int, int] = {}
    for tenant, ids in by_tenant.items():
        left = share[tenant]
        for i in ids:
            g = min(left, queue[i].row, cap)
            grants[i] = g
            left -= g
    saved: dict[str, float] = {}
    for t, e in earned.items():
        assert cost is not None
        spent = cost.cost(share[t], kv_of[t]) if share[t] > 0 else 0.0
        saved[t] = max(0.0, e - spent)
    return grants, saved


def fair_shares(need: dict[str, int], budget: int) -> dict[str, int]:
    """Max-min fair split of ``budget`` over ``need`` (water-filling): no tenant gets more than
    it needs, and no tenant gets less than another unless it needs less. The remainder of an
    uneven split goes to the tenants first in ``need``'s order."""
    out = dict.fromkeys(need, 0)
    left = budget
    hungry = [t for t in need if need[t] > 0]
    while left > 0 and hungry:
        each, extra = divmod(left, len(hungry))
        if each == 0:
            for t in hungry[:extra]:
                out[t] += 1
            break
        for t in hungry:
            out[t] += min(each, need[t] - out[t])
        left = budget - sum(out.values())
        hungry = [t for t in hungry if out[t] < need[t]]
    return out


def group_rows(
    rounds: Sequence[int], prefills: Sequence[int], overhead_tokens: float, apart: bool = False
) -> int:
    """How many forwards the step's rows take, 1 or 2: the rounds (``rounds``: their lengths)
    share one forward (they are short and alike); the prefill rows (``prefills``) join it, or
    take a forward of their own when padding the rounds to their length costs more than a
    forward's overhead (``overhead_tokens``, in tokens: large on a GPU, where all rows share
    one forward; small on a CPU, where a round padded to a chunk would cost the chunk), or
    when they read a much longer cache (``apart``: :meth:`RoundsCost.joins`)."""
    if not rounds or not prefills:
        return 1 if rounds or prefills else 0
    if apart:
        return 2
    if overhead_tokens == float("inf"):
        return 1
    r, p = max(rounds), max(prefills)
    together = (len(rounds) + len(prefills)) * max(r, p)
    split = len(rounds) * r + len(prefills) * p + overhead_tokens
    return 2 if split < together else 1


def model_drafts_allowed(edge_forwards: int) -> bool:
    """May the step's co-generations draft with the verifier's draft model? Capacity first:
    model drafting runs one draft forward per draft token before the step's target forward, so
    it delays every row of the step. It runs only in a step with no edge-drafted work (Verify
    or Federate rows with draft tokens, ``edge_forwards``; a prompt's prefill is none): a
    verifier busy with edge-drafted sessions gives them
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
    queue: Sequence[Queued],
    times: StepTimes,
    limits: BatchLimits,
    stall: StallRule,
    until: int | None = None,
    queued: bool = True,
) -> tuple[float, bool]:
    """Seconds until the running step has ended and the work at queue index ``until`` has been
    decided (None: a decode round submitted now), and whether the running step has stalled.

    A round waits for the rounds ahead of it, ``max_sessions`` a step; each step also computes
    the prefill budget while prefills wait. A prefill waits for its chunks: its share of the
    budget a step (the budget over the tenants with prefills waiting). Each step costs
    a + b·tokens (:class:`StepTimes`). ``queued`` False: the work is not queued (it runs, or
    is done): the running step's remainder alone."""
    remaining, stalled = 0.0, False
    if running is not None:
        elapsed = now - running.started
        remaining = max(0.0, times.estimate(running.tokens) - elapsed)
        stalled = times.stalled(running.tokens, elapsed, stall)
    if not queued or not times.known:
        return remaining, stalled
    a, b = times.coefficients()
    rounds = [q.row for q in queue if q.kind in (Kind.FORWARD, Kind.COGEN) and not q.prefill]
    prefills = [q for q in queue if q.prefill]
    target = queue[until] if until is not None else Queued(Kind.FORWARD)
    per_step_rounds = min(limits.max_tokens, sum(rounds[: limits.max_sessions]))
    budget = prefill_budget(limits, per_step_rounds, False) if prefills or target.prefill else 0
    step_s = a + b * (per_step_rounds + budget)
    if target.prefill:
        tenants = len({q.tenant for q in prefills} | {target.tenant})
        share = max(1, budget // tenants)
        steps = -(-target.row // share)
    else:
        ahead = (
            len(rounds)
            if until is None
            else sum(
                1 for j, q in enumerate(queue[:until]) if q.kind == Kind.FORWARD and not q.prefill
            )
        )
        steps = 1 + ahead // limits.max_sessions
    return remaining + steps * step_s, stalled
