"""What the engine's results mean for a session: the cache length a result reports
(:func:`reported`) and what a :class:`~cloud_verifier.engine.work.Verified` decides for the
:class:`~cloud_verifier.engine.work.Verify` it answers (:func:`verified_outcome`): the text it
commits, where the session stands after it and the frames that tell the edge. Pure functions:
the :class:`~cloud_verifier.session.core.VerifierCore` applies what they return.

Invariants: one Verdict per segment (each Propose the Verify coalesced), in order: every segment
before the one holding the end of the accepted prefix is fully accepted (no correction, no
bonus); that one carries the decision's correction or bonus; the segments behind a rejection get
nothing (they are of an old epoch now, as if they had been queued and dropped). Batches the
ration deferred are queued again, as they came, only behind an acceptance of all it verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cloud_verifier.engine.work import (
    BranchTaken,
    CoGenerate,
    Crop,
    Federate,
    Verified,
    Verify,
    batch_ends,
    cache_after,
    deferred,
)
from cloud_verifier.session.events import Event, Note, NoteKind, Send, logprobs_at
from shared.wire.messages import Propose, Verdict


def reported(
    cache_len: int | None,
    work: Verify | Federate | CoGenerate | Crop,
    n: int = 0,
    branch: BranchTaken | None = None,
) -> int:
    """The cache length a result reports (the model side owns it), or the rule's."""
    return cache_after(work, n, branch) if cache_len is None else cache_len


@dataclass
class VerifiedOutcome:
    """What one Verify's result commits and sends (:func:`verified_outcome`, which fills it in
    as it decides)."""

    verified: int  # the draft tokens the step verified (rationing may verify fewer)
    #: The committed text from the Propose's position on: its fixed tokens, the accepted draft
    #: tokens, then the verifier's own recovered or bonus token, if any.
    text: list[int]
    #: The Logprobs frame (if asked), the Verdicts and the Notes of stale segments.
    frames: list[Event]
    cache_len: int = 0
    next_pos: int = 0
    #: The branch the recovered token opened: its accepted tokens, then its recovered / bonus
    #: one (empty: none).
    opened: list[int] = field(default_factory=list)
    edge_ahead: bool = False  # the edge draws the recovered token itself
    new_epoch: bool = False  # a rejection (or a cut): every batch the edge sent behind is stale
    tail: tuple[int, list[int]] | None = None  # with a new epoch: the cloud draft tail
    pending: bool = False  # a rejection whose p row the model side kept (a Resample draws on it)
    budget: int | None = None  # the draft budget the edge is told now (None: unchanged)
    requeue: tuple[Propose, ...] = ()  # deferred batches, to be queued again first, as they came
    #: The free bonus (Verify.free_bonus): the token after a draft accepted whole, committed by
    #: the verifier as a co-generated one (a Generated frame after the Verdicts), not in them.
    cogenerated: int | None = None


def verified_outcome(work: Verify, result: Verified, budget: int) -> VerifiedOutcome:
    """What ``result`` decides for ``work``, the edge having last been told ``budget``
    (module docstring). The text the verifier knows must reach the Propose's position."""
    p, d = work.propose, result.decision
    # Rationing verified the first ``g`` draft tokens only (engine.work.rationed): at a
    # batch's end the batches behind are deferred (queued again, as they came, if these
    # are accepted whole); inside the first batch a cut: a full acceptance of those is
    # followed by the bonus token, and the rest of the draft is void (a new epoch).
    g, n = (len(work.draft) if result.cut is None else result.cut), d.accepted
    later = deferred(work, g)
    cut = g < len(work.draft) and not later
    segments = work.segments
    if later:
        ends = batch_ends(work)
        segments, behind = segments[: ends.index(g) + 1], segments[ends.index(g) + 1 :]
    else:
        behind = ()
    o = VerifiedOutcome(
        g,
        [*p.fixed.tolist(), *work.draft[:n].tolist()],
        # (before the verdicts: the edge has them when it commits the tokens)
        logprobs_at(result.logprobs, p.pos + len(p.fixed)),
    )
    # The model side cropped the cache to the accepted prefix on a rejection (to the
    # recovered token and the accepted tokens of the branch it opened, if any).
    br = result.branch
    branch = work.branches[br.index] if br is not None else None
    if br is not None and branch is not None:
        if not (n < g and branch.opened_by(d)):
            raise TypeError("a branch taken where the recovered token does not open it")
        last = br.decision.token if br.decision.token is not None else br.decision.bonus
        if last is None:
            raise TypeError("a taken branch's decision carries no token")
        o.opened = [*branch.draft[: br.decision.accepted].tolist(), last]
    # Cached beyond the chain's accepted prefix: the recovered token and the accepted
    # branch tokens (as many as ``opened`` holds).
    taken = len(o.opened)
    o.cache_len = reported(result.cache_len, work, n, br)
    o.next_pos = o.cache_len - taken
    if n < g:
        # Rejection: every batch the edge sent behind this one is now of an old epoch.
        o.new_epoch, o.pending = True, result.kept_row
        o.tail = None if taken else (o.next_pos + 1, work.draft[n + 1 :].tolist())
        if d.token is not None:
            o.text.append(d.token)  # the verifier's own recovered token
        else:
            o.edge_ahead = True  # the edge draws it
    elif d.bonus is not None and work.free_bonus and not cut and not later:
        # The edge asked none (batches of it are in flight behind): the verifier commits it
        # itself, as a co-generated token, which they are matched against.
        o.cogenerated = d.bonus
    elif d.bonus is not None:
        # A bonus token is committed by the edge and comes back as a fixed token.
        o.text.append(d.bonus)
        if cut:
            o.new_epoch, o.tail = True, (o.next_pos + 1, work.draft[n + 1 :].tolist())
    elif cut:
        raise TypeError("a cut draft decided without its bonus token")
    told = result.budget if result.budget is not None and result.budget != budget else None
    o.budget = told
    left = n + work.matched
    for i, s in enumerate(segments):
        gs = len(s.draft) + (work.matched if i == 0 else 0)
        # (only the first segment carries fixed tokens: the prefix cache's share of them)
        cached = result.cached if i == 0 and result.cached else None
        if left >= gs and i < len(segments) - 1:
            o.frames.append(Send(Verdict(epoch=s.epoch, seq=s.seq, accepted=gs, cached=cached)))
            left -= gs
            continue
        verdict = Verdict(
            epoch=s.epoch,
            seq=s.seq,
            accepted=left,
            sparse=d.sparse,
            candidates=d.candidates,
            token=d.token,
            bonus=None if o.cogenerated is not None else d.bonus,
            cached=cached,
            budget=told,
        )
        o.frames.append(Send(verdict))
        o.frames += [Note(NoteKind.STALE)] * (len(segments) - 1 - i)
        break
    if behind and n == g:
        o.requeue = behind  # deferred behind an accepted whole: queued again
    else:
        o.frames += [Note(NoteKind.STALE)] * len(behind)
    return o
