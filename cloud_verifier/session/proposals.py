"""A Propose's way to the model, once its seq and epoch are the session's: whether it may start
where it does (:func:`misplaced`), what the verifier already knows of it (:func:`match`: a
Verdict at no model cost, or the part the model verifies) and the queued Proposes that share
its forward (:func:`coalesce`). Pure functions over what the
:class:`~cloud_verifier.session.core.VerifierCore` holds; it applies what they return.

Invariants: a Propose starts where the edge last knew the verifier to be (with co-generation,
anywhere from ``next_pos`` to the end of the known text); a token at a known position is never
verified again (a fixed token that differs is a bad frame, a draft token that differs a
rejection there); what the model verifies starts at the cache's end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from shared.errors import ErrorCode
from shared.wire.messages import SEQ_MODULUS, Message, Propose, Verdict
from shared.wire.packing import ProtocolError


def misplaced(
    p: Propose, next_pos: int, known: int, cogen: bool, federated: bool, max_context: int
) -> tuple[ErrorCode, str] | None:
    """Why a Propose of the session's epoch cannot be handled (the Error code and its message;
    ``context_full`` is not the edge's fault, every other code a bad frame), or None. ``known``:
    the length of the text the verifier knows; ``cogen``, ``federated``: the Hello's choices."""
    f, g = len(p.fixed), len(p.draft)
    if cogen and not next_pos <= p.pos <= known:
        # The edge starts where it last knew the verifier to be; co-generated tokens may
        # have moved the verifier on since.
        return ErrorCode.BAD_POS, f"pos {p.pos} outside [{next_pos}, {known}]"
    if not cogen and p.pos != next_pos:
        return ErrorCode.BAD_POS, f"pos {p.pos}, expected {next_pos}"
    if next_pos == 0 and f == 0:
        return ErrorCode.BAD_POS, "pos 0 needs at least one fixed token (the prompt)"
    if g == 0 and federated:
        return ErrorCode.BAD_FRAME, "a federated Propose needs draft tokens"
    if p.pos + f + g > max_context:
        return (
            ErrorCode.CONTEXT_FULL,
            f"{p.pos} + {f} fixed + {g} draft tokens exceed the context limit "
            f"{max_context}; start a new session",
        )
    return None


@dataclass(frozen=True)
class Known:
    """A Propose decided at no model cost: its Verdict and the session's ``next_pos`` after it;
    ``tail``, on a rejection (a new epoch), the rest of its draft (the cloud draft tail)."""

    verdict: Verdict
    next_pos: int
    tail: tuple[int, list[int]] | None = None


@dataclass(frozen=True)
class Unknown:
    """The part of a Propose the model verifies, from the cache's end (``propose``), and how
    many of its draft tokens matched the known text (``matched``)."""

    propose: Propose
    matched: int


def match(p: Propose, text: list[int], cache_len: int, bonus: bool) -> str | Known | Unknown:
    """A valid Propose of this epoch against the known ``text`` (the cache holds its first
    ``cache_len`` tokens; ``bonus``: the Hello asks a bonus of every batch): tokens at known
    positions are compared with it (a fixed token that differs is a bad frame: why, returned;
    a draft token that differs is a *rejection* there at no model cost, its correction the known
    token, which the edge already has); the rest is verified by the model."""
    f, g, known = len(p.fixed), len(p.draft), len(text)
    over = known - p.pos  # positions of this Propose the verifier already knows (>= 0)
    nf = min(f, over)
    if nf and p.fixed[:nf].tolist() != text[p.pos : p.pos + nf]:
        return f"fixed tokens at {p.pos} differ from the committed text"
    nd = min(g, max(0, over - f))
    base = p.pos + f
    for i in range(nd):
        if int(p.draft[i]) != text[base + i]:
            # Exact: the known token was sampled from p (co-generated, or the verifier's own
            # recovered / bonus token) before this draft token was looked at.
            verdict = Verdict(p.epoch, p.seq, accepted=i, token=text[base + i])
            return Known(verdict, base + i, (base + i + 1, p.draft[i + 1 :].tolist()))
    want_bonus = p.want_bonus or bonus
    # Every position of this Propose is known (its fixed tokens too): no model work.
    if nd == g and known >= base and (not want_bonus or known > base + g):
        bonus_token = text[base + g] if want_bonus else None
        return Known(Verdict(p.epoch, p.seq, accepted=g, bonus=bonus_token), base + g)
    if over > 0 or cache_len < p.pos:
        # Start at the cache's end: feed the known tokens it lacks as fixed tokens (every
        # known position of this Propose matched), then the new fixed tokens and the draft
        # tokens past the known text. (cache_len <= p.pos + nf + nd: that is known, or
        # less when the Propose ends inside the known text.)
        fixed = text[cache_len : p.pos + nf + nd] + p.fixed[nf:].tolist()
        p = Propose(
            epoch=p.epoch,
            seq=p.seq,
            pos=cache_len,
            draft=p.draft[nd:],
            q=p.q[nd:],
            fixed=np.array(fixed, np.int64),
            want_bonus=p.want_bonus,
        )
    return Unknown(p, nd)


def coalesce(
    p: Propose,
    queue: deque[Message | ProtocolError],
    seq: int,
    epoch: int,
    max_tokens: int,
    max_context: int,
) -> tuple[Propose, ...]:
    """The queued Proposes that continue ``p`` and may share its forward, taken off the head of
    ``queue`` while each is the expected seq (``seq``, then each one's successor) of ``epoch``,
    starts where the last ends, has no fixed tokens and its predecessor asked for no bonus (a
    bonus comes back as a fixed token), within ``max_tokens`` draft tokens (0: none) and the
    context. Taking them is handling them: their seq numbers are consumed, in order."""
    if max_tokens <= 0:
        return ()
    more: list[Propose] = []
    last, total = p, len(p.draft)
    end = p.pos + len(p.fixed) + len(p.draft)
    while queue:
        nxt = queue[0]
        if not (
            isinstance(nxt, Propose)
            and not last.want_bonus
            and nxt.seq == seq
            and nxt.epoch == epoch
            and nxt.pos == end
            and len(nxt.fixed) == 0
            and total + len(nxt.draft) <= max_tokens
            and end + len(nxt.draft) <= max_context
        ):
            break
        queue.popleft()
        seq = (nxt.seq + 1) % SEQ_MODULUS
        more.append(nxt)
        last, total, end = nxt, total + len(nxt.draft), end + len(nxt.draft)
    return tuple(more)
