"""The edge's side of a single-verifier session as a synchronous state machine
(:class:`SingleCore`): no I/O, no clock, no model.

Two pieces, composed by the single-verifier :class:`SingleCore` here and by the federated core
(:mod:`edge_agent.session.federation_core`):

* :class:`~edge_agent.session.pipeline.Pipeline` holds the rules every edge session shares:
  the text to draft from, when drafting may go on, and the one commit path of a round (accepted
  tokens, then a recovered or a bonus token); its prepared outcomes and hedges are a
  :class:`~edge_agent.session.branches.BranchBook`'s.
* :class:`~edge_agent.session.wire_state.WireState` holds one verifier session's wire
  state: its epoch, the next batch number and where the verifier's cache ends.

The session's opening (its Hello, the Welcome, the errors it ends with) is
:mod:`edge_agent.session.opening`; what a driver asks of the drafting,
:class:`~edge_agent.session.drafting.DraftingCore`.

Cloud-only speculative decoding (no draft model on the edge): the edge drafts nothing and the
verifier's co-generation (with its own cloud drafts) writes the text. The edge sends *credits*
(:meth:`SingleCore.credit`): empty Proposes at its committed end, the first carrying the prompt
and asking for the prefill's bonus token. Each tells the verifier how far the edge has read, so
its co-generation may run up to its ``max_cogen_ahead`` past it; at most one is in flight, the
next once :data:`CREDIT_EVERY` tokens more have come.

Invariant (the pipeline's): only a rejection or a differing co-generated token voids drafting
in progress; a driver checks :meth:`~edge_agent.session.pipeline.Pipeline.current` after
every draft step.

:class:`SingleCore` state table (frames from the verifier):

========== ===================================== =============================================
state      input                                 effect
========== ===================================== =============================================
RUNNING    Verdict for the head batch, all       commit the accepted tokens (and a bonus)
           accepted
RUNNING    Verdict for the head batch, rejected  commit accepted + recovered; discard the
           with the negotiated correction        batches behind, epoch + 1; or, when every
                                                 candidate fails, Resample → RECOVERING
RECOVERING Candidates for (epoch, pos)           commit a candidate → RUNNING, or Resample
any        Verdict for another batch, a missing  :class:`DesyncError` (rebuild the session)
           or foreign correction, a bonus with
           batches in flight; other frames
any        Error frame                           :class:`VerifierError`
FAILED     anything                              the same failure again
========== ===================================== =============================================

Every call returns :mod:`edge_agent.session.events`: the messages to send
(:class:`~edge_agent.session.events.Send`, encoded by the driver with :attr:`SingleCore.ctx`)
and, where the table says an error, a :class:`~edge_agent.session.events.Fail` carrying it (state
FAILED).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np

from edge_agent.session.branches import Growing, HedgePlan, PredraftPlan, Rival
from edge_agent.session.drafting import DraftingCore
from edge_agent.session.events import Counter, EdgeEvent, Fail, Send
from edge_agent.session.generation import Generation, TokenSource
from edge_agent.session.opening import (
    ContextExceeded,
    DesyncError,
    HandshakeError,
    VerifierError,
    check_welcome,
    queue_progress,
    resumed_length,
    wire_context,
)
from edge_agent.session.pipeline import Batch, DraftPlan, Pipeline
from edge_agent.session.pipeline_config import PipelineConfig
from edge_agent.session.transport import VerifierBusy
from edge_agent.session.wire_state import WireState
from shared.enums import TextEnum
from shared.maths.rejection import CorrectionMode, Decision, recover, try_candidates
from shared.maths.sampling import Probs
from shared.wire.codec import encode
from shared.wire.messages import (
    Candidates,
    Generated,
    Hedge,
    Hello,
    Logprobs,
    Progress,
    Resample,
    Verdict,
    Welcome,
)
from shared.wire.packing import ProtocolError, WireContext

#: A prepared branch goes to the verifier (PipelineConfig.tree) when it reaches each of these
#: lengths, and when it stops growing: early enough to ride in the forward of the batch it forks
#: from, and again as it grows (the verifier keeps a branch's newest version).
TREE_SENDS: Final = frozenset({1, 2, 4, 8, 16, 32, 64})

#: Cloud-only sessions: tokens received between credits (the verifier may co-generate its
#: ``max_cogen_ahead`` past the last credit, 64 by default, so it never waits on one).
CREDIT_EVERY: Final = 8


#: The Verdict field that carries a correction, per negotiated (wire) correction mode.
_CORRECTION_FIELD: Final = {
    CorrectionMode.TOPK: "sparse",
    CorrectionMode.CANDIDATES: "candidates",
    CorrectionMode.GREEDY_DRAFT: "token",
}


class EdgeState(TextEnum):
    RUNNING = "running"
    RECOVERING = "recovering"  # a rejection's recovered token waits for more candidates
    DONE = "done"
    FAILED = "failed"  # the session cannot go on (a Fail event said why)


def gen_at(gen: Generation, pos: int) -> int | None:
    """The committed token at ``pos``, if any."""
    return gen.committed[pos] if 0 <= pos < len(gen.committed) else None


class SingleCore(DraftingCore):
    """One generation over one verifier session that decides (PicoSpec). See the state table in
    the module docstring. ``propose``, ``hedge`` and ``receive`` return the events to carry out,
    in order (:mod:`edge_agent.session.events`)."""

    LINK: Final = 0

    def __init__(
        self,
        gen: Generation,
        cfg: PipelineConfig,
        rng: np.random.Generator,
        hello: Hello,
        welcome: Welcome,
        *,
        provisional: bool = False,
    ) -> None:
        """``provisional``: ``welcome`` is the one the connection announced (its Ready), and
        the session's own is still to come as its first frame (a session opened in the same
        flight as its first Propose: zero round trips); a new session only."""
        self.cfg = cfg
        self.hello = hello
        #: The session's own Welcome once it has come (None while provisional).
        self.welcome: Welcome | None = None if provisional else welcome
        self.pipe = Pipeline(
            gen,
            cfg,
            rng,
            gamma=min(cfg.gamma, welcome.max_gamma),
            deterministic_draft=cfg.deterministic_draft,
            max_gamma=welcome.max_gamma,
        )
        self.wire = WireState(wire_context(hello, welcome), self.pipe)
        self.wire.verifier_len = resumed_length(gen, welcome)
        if self.wire.verifier_len:  # reported by :meth:`opened`
            self.pipe.count(Counter.RESUMED_TOKENS, self.wire.verifier_len)
        # The kind negotiated in the Hello; a greedy target always sends the token itself.
        self._correction_field = (
            "token" if hello.sampling.greedy else _CORRECTION_FIELD[hello.correction]
        )
        self._resample: tuple[int, Probs] | None = None  # (pos, q) of the pending correction
        self._failed: Fail | None = None
        #: When its first Progress before the Welcome came (it waits in the admission line).
        self._queued_at: float | None = None
        self._credited: int | None = None  # the committed length at the last credit
        #: Token trees: the bytes of branch frames the session may still send
        #: (PipelineConfig.branch_uplink a batch sent, up to four batches' worth).
        self._branch_credit = float(cfg.branch_uplink)

    def opened(self) -> list[EdgeEvent]:
        """What the session's opening reports (the tokens a resumed session's verifier kept):
        its driver carries these out first, before any other call."""
        return [*self.pipe.news()]

    @property
    def ctx(self) -> WireContext:
        """The session's WireContext: the driver encodes the core's Sends with it."""
        return self.wire.ctx

    @property
    def resume_token(self) -> str | None:
        """The verifier's token to resume this session with, once its Welcome has come."""
        return None if self.welcome is None else self.welcome.resume

    @property
    def state(self) -> EdgeState:
        if self._failed is not None:
            return EdgeState.FAILED
        if self.gen.done:
            return EdgeState.DONE
        return EdgeState.RECOVERING if self.pipe.recovering else EdgeState.RUNNING

    # ---------------------------------------------------------------- drafting

    def may_draft(self) -> bool:
        return self._failed is None and self.pipe.may_draft()

    def prompt_unsent(self) -> bool:
        """Committed tokens the verifier lacks (a new session's prompt): a drafting edge with
        co-generation sends them at once in a credit (:meth:`credit`), asking for their token."""
        return self.wire.verifier_len < len(self.gen.committed)

    def propose(
        self,
        plan: DraftPlan,
        draft: list[int],
        q_rows: list[Probs],
        now: float = 0.0,
        rivals: Sequence[Rival] = (),
    ) -> list[EdgeEvent]:
        """Register a drafted batch and send its Propose; nothing if ``plan`` is void."""
        if self._failed is not None:
            return [self._failed]
        if not draft or not self.pipe.current(plan, draft):
            return []
        # Co-generated tokens committed while this batch was drafted agree with its head:
        # only the rest goes up.
        skip = len(self.gen.committed) - len(plan.context)
        if skip > 0:
            draft, q_rows, rivals = draft[skip:], q_rows[skip:], rivals[skip:]
            if not draft:
                return []
        b = self.pipe.push(plan, draft, q_rows, now, rivals)
        msg = self.wire.propose(self.gen.committed, b, self.LINK, self.ctx.draft_probs)
        up = self.cfg.branch_uplink
        self._branch_credit = min(4.0 * up, self._branch_credit + up)
        return [*self.pipe.news(), Send(msg)]

    def wants_credit(self) -> bool:
        """Cloud-only: is a credit due? None in flight, and none sent yet in this session or
        :data:`CREDIT_EVERY` tokens more committed since the last."""
        if self._failed is not None or self.gen.done or self.pipe.inflight:
            return False
        return self._credited is None or len(self.gen.committed) - self._credited >= CREDIT_EVERY

    def credit(self, now: float = 0.0, *, bonus: bool = True) -> list[EdgeEvent]:
        """Send a credit (module docstring): an empty Propose at the committed end; with
        tokens the verifier lacks (the prompt), they go as fixed tokens and the Propose asks
        for the bonus token of their forward (``bonus``; an edge that drafts too sends its
        prompt so before its first batch is drafted, so that the verifier prefills, and its
        forward's token comes back in one round trip, while the edge drafts: taken as a
        co-generated token by :meth:`_verdict`)."""
        if self._failed is not None:
            return [self._failed]
        if not self.cfg.cogen:
            raise ValueError("cloud-only sessions need co-generation (PipelineConfig.cogen)")
        committed = self.gen.committed
        self._credited = len(committed)
        b = self.pipe.push_credit(now)
        fixed = self.wire.verifier_len < len(committed)
        return [Send(self.wire.propose(committed, b, self.LINK, False, want_bonus=fixed and bonus))]

    def hedge(self, hp: HedgePlan, draft: list[int]) -> list[EdgeEvent]:
        """Send the Hedge frame of ``hp`` with its drafted continuation; nothing if it is void."""
        if self._failed is not None:
            return [self._failed]
        if not draft or not self.pipe.book.hedge_current(hp):
            return []
        return self._send_hedge(hp.pos, hp.token, draft)

    def grew(self, g: Growing) -> list[EdgeEvent]:
        """A branch grew by a token: with token trees, it goes to the verifier when it reaches
        a length of :data:`TREE_SENDS` and when it stops growing (:meth:`tree_branch`); then
        what every core does (:meth:`DraftingCore.grew`)."""
        sent: list[EdgeEvent] = []
        if self.cfg.tree and g.draft and (len(g.draft) in TREE_SENDS or not self.branch_open(g)):
            sent = self.tree_branch(g.pp, list(g.draft))
        return [*sent, *super().grew(g)]

    def tree_branch(self, pp: PredraftPlan, draft: list[int]) -> list[EdgeEvent]:
        """Send a prepared branch (``pp``'s token and ``draft``, drafted so far) as a Hedge
        (PipelineConfig.tree): the verifier verifies it in the forward of the batch it forks
        from where its step has room, or in co-generation after the rejection. Nothing if
        trees are off, the verifier would not recover tokens itself, the branch is void, or
        the frame would pass the branch uplink budget (``branch_uplink`` bytes a batch sent,
        counted ``branch_frames_held``)."""
        if self._failed is not None:
            return [self._failed]
        cfg, pipe = self.cfg, self.pipe
        if not (cfg.tree and cfg.cogen and pipe.deterministic_draft and draft):
            return []
        if not pipe.book.predraft_current(pp, draft):
            return []
        if cfg.branch_uplink:
            size = len(encode(self._hedge_frame(pp.pos, pp.token, draft), self.ctx))
            if size > self._branch_credit:
                pipe.count(Counter.BRANCH_FRAMES_HELD)
                return [*pipe.news()]
            self._branch_credit -= size
        return self._send_hedge(pp.pos, pp.token, draft)

    @staticmethod
    def _hedge_frame(pos: int, token: int, draft: list[int]) -> Hedge:
        return Hedge(pos, token, np.array(draft, np.int64), np.ones(len(draft), np.float32))

    def _send_hedge(self, pos: int, token: int, draft: list[int]) -> list[EdgeEvent]:
        """The Hedge frame for ``token`` at ``pos`` and ``draft`` after it (a point mass: q 1),
        kept to count the verifier's hits."""
        msg = self._hedge_frame(pos, token, draft)
        self.pipe.book.sent_hedge(pos, [token, *draft])
        return [Send(msg)]

    # ---------------------------------------------------------------- frames

    def receive(self, data: bytes, now: float = 0.0) -> list[EdgeEvent]:
        """One frame from the verifier, received at ``now``. An Error frame, a frame that does
        not decode or one that does not fit the session ends it: a :class:`Fail` with the
        VerifierError / ProtocolError / DesyncError."""
        if self._failed is not None:
            return [self._failed]
        try:
            events = self._opening(data, now) if self.welcome is None else self._receive(data, now)
            return [*self.pipe.news(), *events]
        except (
            VerifierError,
            DesyncError,
            ProtocolError,
            HandshakeError,
            VerifierBusy,
            ContextExceeded,
        ) as e:
            self._failed = Fail(e)
            return [*self.pipe.news(), self._failed]

    def _opening(self, data: bytes, now: float) -> list[EdgeEvent]:
        """The first frame of a session opened with its first Propose: its Welcome (checked as
        :func:`~edge_agent.session.opening.check_welcome` does), or the refusal that replaced
        it. Before it, Progress frames while the session waits in the verifier's admission line
        (its place, the expected wait): busy, not dead, they move the verdict deadline as a
        running round's do."""
        self.pipe.count(Counter.DOWNLINK_BYTES, len(data))
        queued = queue_progress(data)
        if queued is not None:
            self.pipe.on_progress(queued, now)
            if self._queued_at is None:
                self._queued_at = now
            return []
        welcome = check_welcome(self.hello, data)
        if self._queued_at is not None:
            self.gen.stats.admission_wait_s += max(0.0, now - self._queued_at)
        if welcome.resumed is not None:
            raise DesyncError("a new session's Welcome says it resumed one")
        ctx = self.wire.ctx
        if welcome.max_gamma < ctx.max_gamma or welcome.max_fixed < ctx.max_fixed:
            raise DesyncError("the session's Welcome grants less than its connection's Ready")
        self.pipe.fit_context(welcome.max_context)  # (the Ready's was applied already)
        self.welcome = welcome
        return []

    def _receive(self, data: bytes, now: float) -> list[EdgeEvent]:
        self.pipe.count(Counter.DOWNLINK_BYTES, len(data))
        msg = self.wire.decode(data)
        if isinstance(msg, Progress):
            self.pipe.on_progress(msg, now)
            return []
        if isinstance(msg, Logprobs) and self.cfg.logprobs is not None:
            try:
                self.gen.logprobs.note(msg)
            except ValueError as e:
                raise DesyncError(str(e)) from None
            return []
        if isinstance(msg, Verdict) and not self.pipe.recovering:
            return self._verdict(msg, len(data), now)
        if isinstance(msg, Generated) and not self.pipe.recovering:
            return self._commit_cogenerated(msg, now)
        if isinstance(msg, Candidates) and self._resample is not None:
            return self._candidates(msg)
        raise DesyncError(f"unexpected {type(msg).__name__} in state {self.state}")

    def _commit_cogenerated(self, g: Generated, now: float = 0.0) -> list[EdgeEvent]:
        """A co-generated token: commit it and rebase the tail on it. A draft in flight at its
        position that agrees stands; one that differs dooms its batch (the verifier will reject
        it there, at no model cost) and voids every batch behind it, like a rejection."""
        pipe, gen = self.pipe, self.gen
        if gen.done:
            return []
        c = len(gen.committed)
        # The verifier enters an epoch for each doomed batch only when it reaches it.
        epoch = self.wire.epoch - sum(1 for b in pipe.inflight if b.doomed_at >= 0)
        if (g.epoch, g.pos) != (epoch, c):
            raise DesyncError(f"Generated for epoch {g.epoch}, pos {g.pos}; expected {epoch}, {c}")
        pipe.count(Counter.COGEN_TOKENS)
        if pipe.book.hedge_hit(g.token):
            pipe.count(Counter.HEDGE_HITS)
        return self._commit_known(
            g.token, TokenSource.CLOUD_DRAFT if g.cloud else TokenSource.COGENERATED, now
        )

    def _commit_known(self, token: int, source: TokenSource, now: float) -> list[EdgeEvent]:
        """A token the verifier drew at the committed end on its own (co-generated, or the
        prompt credit's bonus) while batches may be in flight: commit it; a draft in flight
        at its position that agrees stands, one that differs dooms its batch."""
        pipe, gen = self.pipe, self.gen
        c = len(gen.committed)
        b = next((b for b in pipe.inflight if b.start <= c < b.start + len(b.live)), None)
        pipe.commit([token], source)
        if b is None:
            # Past every draft in flight: the batch being drafted (if any) goes on while it
            # agrees with the new token (Pipeline.current); the verifier knows the text to here.
            self.wire.verifier_len = max(self.wire.verifier_len, c + 1)
            return []
        if b.draft[c - b.start] == token:
            return []
        b.doomed_at = c - b.start
        pipe.book.classify_miss(b, b.doomed_at, token)
        pipe.on_rejection(now)
        # The verifier enters the next epoch when it rejects ``b``, before it reads anything
        # sent from now on; it knows the text up to the new token.
        pipe.discard_inflight(keep=b)
        self.wire.verifier_len = c + 1
        return []

    def _verdict(self, v: Verdict, size: int, now: float) -> list[EdgeEvent]:
        pipe = self.pipe
        if not pipe.inflight:
            raise DesyncError(f"Verdict seq {v.seq} with nothing in flight")
        b = pipe.inflight[0]
        if (v.seq, v.epoch) != (b.seqs[self.LINK], b.epoch):
            raise DesyncError(
                f"Verdict for seq {v.seq}/epoch {v.epoch}, expected {b.seqs[self.LINK]}/{b.epoch}"
            )
        gamma = len(b.draft)
        if v.accepted > gamma:
            raise DesyncError(f"Verdict accepts {v.accepted} of {gamma} draft tokens")
        if v.cached:
            pipe.count(Counter.PROMPT_CACHED_TOKENS, v.cached)
        if v.budget is not None:
            pipe.budget = v.budget
        if not b.draft and v.bonus is not None and len(pipe.inflight) > 1:
            # The prompt's credit (sent before the first batch was drafted) answered with its
            # forward's token while the batches drafted meanwhile are in flight: the token was
            # drawn from p before any of their drafts was looked at, exactly as a co-generated
            # one, and is taken as one (TTFT: one round trip and the prefill).
            if v.accepted or b.start != len(self.gen.committed):
                raise DesyncError(f"a credit's Verdict accepts {v.accepted} at {b.start}")
            pipe.commit_round(b, 0, now)
            if self.gen.done:
                return []
            pipe.count(Counter.BONUS_TOKENS)
            return self._commit_known(v.bonus, TokenSource.BONUS, now)
        if b.doomed_at >= 0:
            # The rejection a co-generated token announced: everything is committed already.
            at = b.start + b.doomed_at
            if v.accepted != b.doomed_at or v.token is None or v.token != gen_at(self.gen, at):
                raise DesyncError(f"Verdict for a batch doomed at {at} does not reject it there")
            pipe.commit_round(b, v.accepted, now)
            pipe.count(Counter.REJECTIONS)
            return []
        decision = Decision(v.accepted, v.sparse, v.candidates, v.token, v.bonus)
        if v.accepted < gamma and v.bonus is not None and not decision.rejected:
            return self._cut(b, v.accepted, v.bonus, now)
        # Checked before anything is committed: a rejection carries exactly one correction, of
        # the kind this session negotiated; a full acceptance carries none. (Committing only an
        # accepted prefix would leave every batch behind it drafted from void tokens.)
        if decision.rejected != (v.accepted < gamma):
            raise DesyncError(
                f"Verdict accepts {v.accepted} of {gamma} "
                + ("with a correction" if decision.rejected else "without a correction")
            )
        if decision.rejected and getattr(v, self._correction_field) is None:
            raise DesyncError(
                f"a correction other than {self._correction_field!r}, which this session uses"
            )
        if v.bonus is not None and len(pipe.inflight) > 1:
            raise DesyncError("a bonus token while batches are in flight")
        pipe.commit_round(b, v.accepted, now)
        if self.gen.done:
            return []
        if decision.rejected:
            if len(self.gen.committed) != b.start + v.accepted:
                raise DesyncError("a rejection behind a co-generated token")
            pipe.count(Counter.REJECTIONS)
            pipe.count(Counter.DOWNLINK_REJECTION_BYTES, size)
            q = b.q_rows[v.accepted]
            token = recover(decision, q, pipe.rng, reconstruction=self.cfg.reconstruction)
            if token is not None:
                pipe.book.classify_miss(b, v.accepted, token)
            pipe.on_rejection(now)
            # The verifier cropped its cache to the accepted prefix and entered the next epoch.
            pipe.discard_inflight()
            self.wire.verifier_len = len(self.gen.committed)
            if token is None:
                return self._ask_resample(q)
            pipe.commit_recovered(token)
        elif v.bonus is not None:
            end = b.start + gamma
            self.wire.verifier_len = end
            pipe.commit_bonus(v.bonus, end)
        return []

    def _cut(self, b: Batch, accepted: int, bonus: int, now: float) -> list[EdgeEvent]:
        """The verifier's ration verified only the first ``accepted`` draft tokens of ``b``
        (all accepted) and drew ``bonus`` from p after them: commit both; the rest of the
        draft and every batch behind it are void (a new epoch, on both sides)."""
        pipe = self.pipe
        pipe.commit_round(b, accepted, now, verified=accepted)
        pipe.count(Counter.CUT_ROUNDS)
        pipe.count(Counter.CUT_TOKENS, len(b.draft) - accepted)
        if self.gen.done:
            return []
        if len(self.gen.committed) != b.start + accepted:
            raise DesyncError("a cut behind a co-generated token")
        pipe.discard_inflight()
        self.wire.verifier_len = b.start + accepted
        pipe.commit_bonus(bonus, b.start + accepted)
        return []

    def _ask_resample(self, q: Probs) -> list[EdgeEvent]:
        """Every candidate failed: ask for more (drafting waits for the recovered token)."""
        pos = self.wire.verifier_len
        self._resample = (pos, q)
        self.pipe.recovering = True
        self.pipe.count(Counter.RESAMPLES)
        return [Send(Resample(self.wire.epoch, pos))]

    def _candidates(self, c: Candidates) -> list[EdgeEvent]:
        assert self._resample is not None
        pos, q = self._resample
        if (c.epoch, c.pos) != (self.wire.epoch, pos):
            raise DesyncError(
                f"Candidates for epoch {c.epoch}, pos {c.pos}; expected {self.wire.epoch}, {pos}"
            )
        token = try_candidates(c.candidates, q, self.pipe.rng)
        if token is None:
            return self._ask_resample(q)
        self._resample = None
        self.pipe.recovering = False
        self.pipe.commit_recovered(token)
        return []
