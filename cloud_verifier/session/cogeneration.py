"""Co-generation: the tokens a verifier decodes on its own while a session has no valid edge
draft queued (negotiated by Hello.cogen_end), and :class:`CoGeneration`, the one owner of what
it decides from: the edge's hedges, the rest of the last rejected draft (the cloud draft tail),
how far the edge has read, whether co-generation waits for the edge and whether cloud drafts are
still tried; and :class:`TokenCounts`, the tokens the verifier commits on its own (co-generated,
or a hedge's taken as a tree branch). No I/O, no clock, no model.

Each step is one :class:`~cloud_verifier.engine.work.CoGenerate`: the next token after the known
text, with a draft verified in the same forward where there is one: the newest hedge that
continues the text, else the verifier's own (:mod:`cloud_verifier.session.cloud_draft`: tail,
ngram, then the model side's draft model). Hedges also ride in a Verify's forward as token-tree
branches (:meth:`CoGeneration.branches`). The core
(:class:`~cloud_verifier.session.core.VerifierCore`) owns one :class:`CoGeneration`, decides
when a step may start (no work running, nothing queued, no token of the edge's unknown) and
commits what it returns.

Invariants: at most ``max_cogen_ahead`` tokens past the end of the last Propose received, never
past ``cogen_end`` or the context; every draft verified here is fixed before the verifier draws
any of the positions it drafts (a hedge is matched against the text, never trusted), so the
greedy-draft rule keeps the target's law.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import astuple, dataclass

import numpy as np
import numpy.typing as npt

from cloud_verifier.engine.work import NO_IDS, NO_PROBS, Branch, CoGenerate, Verified
from cloud_verifier.session.cloud_draft import (
    CloudDraft,
    DraftAcceptance,
    DraftLength,
    ngram_draft,
    tail_draft,
)
from cloud_verifier.session.limits import SessionLimits
from shared.maths.rejection import CorrectionMode
from shared.wire.messages import Hedge, Hello, Propose


@dataclass(frozen=True)
class TokenCounts:
    """Tokens the verifier committed on its own in a session (or the difference of two such
    counts): the one count, kept by the core; the daemon's metrics add what each result
    added."""

    cogen: int = 0  # co-generated tokens (each a draft token accepted, or a recovered / bonus)
    hedge: int = 0  # of those, hedge draft tokens accepted (co-generated in one forward)
    cloud_draft: int = 0  # of those, the verifier's own draft tokens accepted (cloud_draft)
    tree: int = 0  # tree-branch draft tokens accepted (in the forward of their chain)

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


class CoGeneration:
    """One session's co-generation (module docstring): what it keeps of the edge's frames, the
    next step's work, and what a step's result commits."""

    def __init__(self, limits: SessionLimits) -> None:
        self.limits = limits
        self.on = False  # negotiated in the Hello
        #: Waiting for the edge: a step was skipped or failed (any frame from the edge resumes).
        self.paused = False
        self.proposed_end = 0  # end of the last Propose received (co-generation bound)
        self.edge_drafts = False  # the last Propose carried a draft (not a credit)
        #: Side drafts from the edge (Hedge frames), newest last; matched against the text.
        self.hedges: deque[Hedge] = deque(maxlen=limits.max_hedges)
        self.cloud_off = False  # a cloud draft's work failed: this session co-generates without
        self.model_alpha = DraftAcceptance()  # its model drafts' acceptance (cloud_draft_length)
        #: The rest of the last rejected draft: (its position, its tokens) (cloud_draft tail).
        self.tail: tuple[int, list[int]] | None = None

    # ------------------------------------------------------------------ the edge's frames

    def proposed(self, p: Propose) -> None:
        """A valid Propose of the current epoch: where the edge has read to, and whether it
        drafts."""
        self.proposed_end = p.pos + len(p.fixed) + len(p.draft)
        self.edge_drafts = len(p.draft) > 0

    def keep(self, h: Hedge, max_context: int) -> str | None:
        """Keep a side draft (no reply, no model work); or why it is refused (bad_hedge)."""
        if not self.on:
            return "hedges need co-generation (Hello.cogen_end > 0)"
        if h.pos == 0 or h.pos + 1 + len(h.draft) > max_context:
            return f"hedge at {h.pos} with {len(h.draft)} tokens outside [1, {max_context})"
        # One per position and token: a branch sent again as it grew replaces its older version
        # (which the newest ``max_hedges`` would otherwise spend their room on).
        for old in [o for o in self.hedges if (o.pos, o.token) == (h.pos, h.token)]:
            self.hedges.remove(old)
        self.hedges.append(h)
        return None

    def rolled_back(self) -> None:
        """A Rollback: the hedges and the tail were drafted after text that is gone."""
        self.hedges.clear()
        self.tail = None

    def branches(
        self, p: Propose, more: Sequence[Propose], hello: Hello, max_context: int
    ) -> tuple[Branch, ...]:
        """The hedges that fork inside this forward's draft (newest first, one per position
        and token, none that agrees with the draft token it replaces), as tree branches within
        ``max_tree_tokens`` and the context. Only where the verifier draws the recovered token
        itself (else a branch could never open) and sends no log-probabilities."""
        budget = self.limits.max_tree_tokens
        h = hello
        if not (
            budget > 0
            and self.hedges
            and h.logprobs is None
            and (h.sampling.greedy or h.correction == CorrectionMode.GREEDY_DRAFT)
        ):
            return ()
        draft = [int(t) for s in (p, *more) for t in s.draft.tolist()]
        base = p.pos + len(p.fixed)
        end = base + len(draft)  # where the tree's layout starts
        out: list[Branch] = []
        seen: set[tuple[int, int]] = set()
        for hg in reversed(self.hedges):
            at = hg.pos - base
            if not 0 <= at < len(draft) or hg.token == draft[at] or (at, hg.token) in seen:
                continue
            room = min(budget - 1, max_context - end - 1)
            if room < 0:
                break
            seen.add((at, hg.token))
            out.append(Branch(at, hg.token, hg.draft[:room].astype(np.int64)))
            budget -= 1 + len(out[-1].draft)
            end += 1 + len(out[-1].draft)
        return tuple(out)

    # ------------------------------------------------------------------ steps

    def next_work(
        self, text: list[int], cache_len: int, budget: int, end: int
    ) -> CoGenerate | None:
        """The next step after ``text`` (the cache holds its first ``cache_len`` tokens), with
        ``budget`` the draft budget rationing set and ``end`` the co-generation bound
        (``cogen_end`` within the context); None: no step now."""
        if not (self.on and not self.paused and text):
            return None
        known = len(text)
        if known >= end:
            return None
        ahead = self.limits.max_cogen_ahead - (known - self.proposed_end)
        if ahead <= 0:
            return None
        fixed = np.array(text[cache_len:], np.int64)
        # A hedge's continuation may be verified in the same forward (bonus after it): at most
        # ``ahead`` tokens in all, within the co-generation bound and the context.
        room = min(ahead, end - known) - 1
        draft, q = self._hedge_draft(text, room)
        if len(draft) or self.cloud_off or room <= 0:
            return CoGenerate(cache_len, fixed, draft, q)
        # Rationing: the verifier's own drafts obey the budget its scheduler set (under load a
        # short draft, the GPU's time going to the edges' drafts first).
        n = min(room, self.limits.cloud_draft_tokens, budget)
        ids = self._own_draft(text, n)
        if ids:
            draft, q = np.array(ids, np.int64), np.ones(len(ids), np.float32)
            return CoGenerate(cache_len, fixed, draft, q, cloud=True)
        model = n if self.limits.cloud_model else 0
        alpha = (
            self.model_alpha.alpha
            if model and self.limits.cloud_draft_length == DraftLength.AUTO
            else None
        )
        return CoGenerate(cache_len, fixed, cloud=model > 0, model_tokens=model, model_alpha=alpha)

    def _own_draft(self, text: list[int], n: int) -> list[int]:
        """Up to ``n`` draft tokens of the verifier's own without a model (tail, then ngram);
        empty: none of them has one."""
        sources = self.limits.cloud_draft
        ids = tail_draft(self.tail, text, n) if CloudDraft.TAIL in sources else []
        if not ids and CloudDraft.NGRAM in sources:
            ids = ngram_draft(text, n)
        return ids

    def _hedge_draft(
        self, text: list[int], room: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
        """The draft tokens of the newest hedge that agrees with the text and continues past
        it (at most ``room``): empty if none.

        Exact: a hedge is drafted greedily (q a point mass) by the draft model after the text
        up to its position (the match checks it), before the verifier drew anything past the
        text's end; CoGenerate verifies it by the greedy-draft rule."""
        if room <= 0:
            return NO_IDS, NO_PROBS
        known = len(text)
        for h in reversed(self.hedges):
            ids = [h.token, *h.draft.tolist()]
            k = known - h.pos  # hedge tokens already in the text
            if 0 < k < len(ids) and text[h.pos : known] == ids[:k]:
                draft = h.draft[k - 1 : k - 1 + room]
                # A point mass whatever the frame's q says: the greedy-draft rule recovers from
                # p without x, which is exact only for q(x) = 1.
                return draft, np.ones(len(draft), np.float32)
        return NO_IDS, NO_PROBS

    # ------------------------------------------------------------------ results

    def done(self, work: CoGenerate, result: Verified) -> tuple[list[int], TokenCounts]:
        """Co-generated tokens: the hedge's *accepted* prefix (if any), then the *recovered* or
        *bonus* token, each drawn after the known text (law p, whatever the edge drafts for
        these positions later); and what they add to the session's counts."""
        d = result.decision
        draft = work.draft if result.drafted is None else result.drafted
        token = d.token if d.accepted < len(draft) else d.bonus
        if token is None:
            raise TypeError("a CoGenerate's result carries no token")
        tokens = [*draft[: d.accepted].tolist(), token]
        cloud = d.accepted if work.cloud else 0  # the accepted draft's: a hedge's, or our own
        if work.model_tokens:
            if len(draft):
                self.model_alpha.observe(len(draft), d.accepted)
            else:
                self.model_alpha.fade()
        return tokens, TokenCounts(cogen=len(tokens), hedge=d.accepted - cloud, cloud_draft=cloud)

    def skipped(self) -> None:
        """The engine gave a step no forward (it is saturated with drafts to verify)."""
        # An edge that drafts sends its next batch soon: co-generation waits for it rather
        # than queue again ahead of it. A credit (cloud-only) sends nothing until tokens
        # arrive: its co-generation queues again at once (paused, it would never resume).
        self.paused = self.edge_drafts

    def failed(self, work: CoGenerate) -> bool:
        """A step's work failed and the cache was restored: whether to try again at once."""
        if work.cloud and not self.cloud_off:
            # The draft's extra tokens may not fit the session's KV share: co-generation
            # goes on without cloud drafts in this session.
            self.cloud_off = True
            return True
        self.paused = True  # the edge asked for nothing: no error frame
        return False
