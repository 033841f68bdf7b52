"""Sampling and rejection on the target's device, batched over sessions.

The torch twin of :mod:`shared.maths.sampling` + :mod:`shared.maths.rejection` + the verifier's
federated reply: the verifier runs one forward over many sessions, and everything that follows, from
the sampling transform to the per-session :class:`~shared.maths.rejection.Decision`, stays on the
device. Only ids, counts and the few correction values (top-K values, candidates' p(y), l1 scalars)
come back to the host, each call in one or two small copies (all through :func:`_to_host`);
no ``[rows, V]`` tensor is ever copied.

Layout (vLLM v1's rejection sampler): one flattened batch over sessions. Session b has γ_b
draft tokens and γ_b + 1 rows (row i scores draft[i], row γ_b is the bonus position), so with
``cu_draft = [0, γ_0, γ_0 + γ_1, ...]`` ([B + 1], the cumulative draft counts)

* draft tokens of b: ``draft_ids[cu_draft[b] : cu_draft[b + 1]]`` ([T], T = Σ γ_b);
* rows of b: ``probs[cu_draft[b] + b : cu_draft[b + 1] + b + 1]`` ([T + B, V]);
* draft token t of session b is scored by row t + b.

Per-session and per-row parameters (temperature, top-k, top-p, γ, modes, k, ε, m) are host
arrays: the host built the batch, and knowing them there costs no device synchronisation.

Semantics are :func:`shared.maths.sampling.transform` and
:func:`shared.maths.rejection.verify_batch` exactly (tests/verifier/test_device_sampling.py holds
them to it row by row and by chi-square):

* transform: temperature, then top-k (every logit >= the k-th largest kept, ties included), then
  top-p on the probabilities sorted ascending with a *stable* sort (ties: the lower id is
  dropped first), the most likely id always kept; T = 0 rows are the one-hot of the first argmax.
* acceptance: u·q(x) < p(x) with u ~ U[0, 1) from the session's generator; greedy targets accept
  on p(x) >= 1 (x is the argmax) and consume no random numbers.
* every draw (greedy-draft recovered token, candidates, bonus) is an inverse-CDF draw exactly as
  :func:`shared.maths.sampling.sample`: a float64 cumulative sum, u·total, the first index whose sum
  exceeds it, moved down to the last id with mass if rounding ran past it. One scan serves the
  m candidates of a row (an exponential race would need m·V exponentials for them).
* top-K corrections are :func:`shared.maths.compression.compress`: torch.topk, ids of equal
  probability in ascending order, adaptive K = the smallest K whose kept mass reaches
  1 − ε − 1e-12 capped at k, zero-probability ids dropped. Which of several ids tied *at* the
  K-th value is kept is the backend's choice, as it is numpy's argpartition's.

Random streams differ from the NumPy path (each session has a ``torch.Generator`` on the device,
seeded by the session); the distributions are the same.

Dtype: float64 on the device (:data:`DEVICE_DTYPE`); uniforms and every cumulative sum used
for a draw are float64 whatever the dtype. What tests/verifier/test_device_sampling.py shows (CPU):

* transform: float64 equals the NumPy reference to <= 5e-16 with the same support on every row
  (ties, T = 0, top-k and top-p included); float32 only to ~2.5e-7 (tested at 1e-6).
* federated replies: float64 l1 agrees with the NumPy path to float32 rounding; float32 is off by
  ~94% of itself at ε ~ 2e-8 (K = V) and the adaptive K of ~2% of rows (V = 4096, ε <= 1e-2)
  differs from :func:`~shared.maths.compression.compress`: a correction with a different support.
* the chi-square suites (28 cases, N = 20 000 each) pass in both dtypes with similar p-values,
  so they cannot decide it: a 1e-7 bias is far below what they see.

The verifier's engine calls :func:`verify_logits`: the same decisions, but p(x) of the draft
tokens from one float32 pass per row (max and sum of exps; the rest in float64), and the full
float64 transform only for the decision rows (at most one per session). At |V| = 151,936 that
is what keeps the non-model cost of a round near a millisecond on the CPU
(docs/benchmarks/verifier.md, Overhead);
the acceptance probabilities then carry float32 rounding (~1e-6 relative), which the suites
(run on this path too) cannot see and which no correction or bonus draw inherits.

So float64: the device path is then the reference's distribution to rounding, and the edge (which
transforms q with the same float64 NumPy code) stays consistent with it. Not measurable here but
in the same direction: torch's CPU kernels accumulate float32 sums in double, CUDA's in float32,
so a float32 path would be further from the reference on a GPU than on this CPU. The cost is
bandwidth: twice the bytes of float32 in a few passes over [rows, V] after a forward pass that
dominates. ``transform_rows(dtype=torch.float32)`` stays available for measurements; every other
function computes in the dtype of the probs it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from shared.maths.compression import SparseDist
from shared.maths.rejection import CorrectionMode, Decision
from shared.maths.sampling import SamplingParams
from shared.wire.messages import LOGPROB_FLOOR, Logprobs

#: The dtype probabilities are computed in on the device (module docstring: why float64).
DEVICE_DTYPE: Final = torch.float64

#: Federated reply for one session: γ+1 top-K dists, p_j(x_j) [γ] float32, l1 [γ+1, 2] float32.
FederatedRows = tuple[tuple[SparseDist, ...], npt.NDArray[np.float32], npt.NDArray[np.float32]]

_MODES: Final = frozenset(CorrectionMode)


def _to_host(t: torch.Tensor) -> npt.NDArray[Any]:
    """The only way a tensor leaves the device in this module (tests watch what passes here)."""
    out: npt.NDArray[Any] = t.detach().to("cpu").numpy()
    return out


# ------------------------------------------------------------------------------------ layout


def cu_from_gammas(gammas: Sequence[int] | npt.ArrayLike) -> npt.NDArray[np.int64]:
    """[γ_0, γ_1, ...] → cu_draft [B + 1] = [0, γ_0, γ_0 + γ_1, ...]."""
    g = np.asarray(gammas, dtype=np.int64).reshape(-1)
    if np.any(g < 0):
        raise ValueError(f"γ must be >= 0, got {g.tolist()}")
    out: npt.NDArray[np.int64] = np.concatenate([[0], np.cumsum(g)]).astype(np.int64)
    return out


def row_params(
    params: Sequence[SamplingParams], gammas: Sequence[int] | npt.ArrayLike
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Per-session sampling params → per-row (temperature, top_k, top_p), γ_b + 1 rows each."""
    reps = np.asarray(gammas, dtype=np.int64).reshape(-1) + 1
    if len(reps) != len(params):
        raise ValueError(f"{len(params)} params for {len(reps)} sessions")
    t = np.repeat(np.array([p.temperature for p in params], dtype=np.float64), reps)
    k = np.repeat(np.array([p.top_k for p in params], dtype=np.int64), reps)
    tp = np.repeat(np.array([p.top_p for p in params], dtype=np.float64), reps)
    return t, k, tp


def _cu(cu_draft: npt.ArrayLike) -> npt.NDArray[np.int64]:
    cu = np.asarray(cu_draft, dtype=np.int64).reshape(-1)
    if len(cu) < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_draft must start at 0 and not decrease, got {cu.tolist()}")
    return cu


def _per_session(value: Any, b: int, dtype: type, name: str) -> npt.NDArray[Any]:
    """A scalar broadcast to [B], or a length-B sequence, as a host array."""
    a: npt.NDArray[Any] = np.asarray(value, dtype=dtype)
    if a.ndim == 0:
        return np.full(b, a[()], dtype=dtype)
    a = a.reshape(-1)
    if len(a) != b:
        raise ValueError(f"{name} has {len(a)} entries for {b} sessions")
    return a


def _rows_and_tokens(
    probs: torch.Tensor, draft_ids: npt.ArrayLike, cu_draft: npt.ArrayLike
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Validated (cu [B+1], draft ids [T], the row scoring each draft token [T])."""
    cu = _cu(cu_draft)
    b, t = len(cu) - 1, int(cu[-1])
    if probs.ndim != 2 or probs.shape[0] != t + b or probs.shape[1] == 0:
        raise ValueError(f"probs {tuple(probs.shape)} for {b} sessions, {t} draft tokens")
    x = np.asarray(draft_ids, dtype=np.int64).reshape(-1)
    if len(x) != t:
        raise ValueError(f"{len(x)} draft ids for cu_draft ending at {t}")
    if np.any((x < 0) | (x >= probs.shape[1])):
        raise ValueError("a draft id is outside the vocabulary")
    rows = np.arange(t, dtype=np.int64) + np.repeat(np.arange(b, dtype=np.int64), np.diff(cu))
    return cu, x, rows


def _gen(generators: Sequence[torch.Generator | None], s: int) -> torch.Generator:
    g = generators[s]
    if g is None:
        raise ValueError(f"session {s} samples and has no generator")
    return g


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row of x ([N, V] → [N] int64, on x's device).

    On the CPU, NumPy's argmax (a view of the same memory, nothing copied: the CPU is the
    device there) measured 6× faster than torch's at V = 151,936 (0.08 vs 0.48 ms for 6 rows)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.ascontiguousarray(x.detach().numpy().argmax(axis=-1)))
    return x.argmax(dim=-1)


def _rows_tensor(values: npt.NDArray[np.float64], like: torch.Tensor) -> torch.Tensor:
    """[n, 1] of per-row values, in like's dtype and device (to scale rows)."""
    return torch.as_tensor(values, dtype=like.dtype, device=like.device)[:, None]


def _idx(a: npt.ArrayLike, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a, dtype=np.int64), device=device)


# --------------------------------------------------------------------------------- transform


def transform_rows(
    logits: torch.Tensor,
    temperature: npt.ArrayLike,
    top_k: npt.ArrayLike,
    top_p: npt.ArrayLike,
    *,
    dtype: torch.dtype = DEVICE_DTYPE,
) -> torch.Tensor:
    """:func:`shared.maths.sampling.transform` row by row on the logits' device.

    logits: [N, V] (any float dtype; not modified). temperature, top_k, top_p: host arrays [N]
    (or scalars), validated like :class:`SamplingParams`. Returns probs [N, V] in ``dtype``.
    """
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [N, V] with V > 0, got {tuple(logits.shape)}")
    n, v = int(logits.shape[0]), int(logits.shape[1])
    dev = logits.device
    t = _per_session(temperature, n, np.float64, "temperature")
    k = _per_session(top_k, n, np.int64, "top_k")
    tp = _per_session(top_p, n, np.float64, "top_p")
    if not np.all(np.isfinite(t) & (t >= 0.0)):
        raise ValueError("temperature must be finite and >= 0")
    if np.any(k < 0):
        raise ValueError("top_k must be >= 0")
    if not np.all(np.isfinite(tp) & (tp > 0.0) & (tp <= 1.0)):
        raise ValueError("top_p must be in (0, 1]")
    greedy = t == 0.0
    if np.all(greedy):  # one-hot rows: no transform to compute
        first_max = first_argmax(logits)  # first of ties
        onehot = torch.zeros(n, v, dtype=dtype, device=dev)
        return onehot.scatter_(1, first_max[:, None], 1.0)

    x = logits.to(dtype=dtype, copy=True)  # the only [N, V] buffer; the logits stay as they are
    x /= torch.as_tensor(np.where(greedy, 1.0, t), dtype=dtype, device=dev)[:, None]

    # top-k: keep every logit >= the k-th largest (ties at the threshold kept).
    rk = np.flatnonzero(~greedy & (k > 0) & (k < v))
    if rk.size:
        idx = _idx(rk, dev)
        xs = x.index_select(0, idx)
        kmax = int(k[rk].max())
        top = torch.topk(xs, kmax, dim=-1, largest=True, sorted=True).values  # [n, kmax]
        kth = top.gather(1, _idx(k[rk] - 1, dev)[:, None])
        x.index_copy_(0, idx, xs.masked_fill(xs < kth, float("-inf")))

    x -= x.amax(dim=-1, keepdim=True)
    p = x.exp_()
    p /= p.sum(dim=-1, keepdim=True)

    # top-p: drop the least likely ids whose ascending cumulative mass is <= 1 − top_p.
    rp = np.flatnonzero(~greedy & (tp < 1.0))
    if rp.size:
        idx = _idx(rp, dev)
        ps = p.index_select(0, idx)
        sorted_p, order = torch.sort(ps, dim=-1, stable=True)
        cum = sorted_p.cumsum(dim=-1)
        thr = torch.as_tensor(1.0 - tp[rp], dtype=dtype, device=dev)[:, None]
        drop_sorted = cum <= thr
        drop_sorted[:, -1] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        ps = ps.masked_fill(drop, 0.0)
        ps /= ps.sum(dim=-1, keepdim=True)
        p.index_copy_(0, idx, ps)

    rg = np.flatnonzero(greedy)
    if rg.size:
        idx = _idx(rg, dev)
        first_max = first_argmax(logits.index_select(0, idx))  # first of ties
        onehot = torch.zeros(len(rg), v, dtype=dtype, device=dev)
        p.index_copy_(0, idx, onehot.scatter_(1, first_max[:, None], 1.0))
    return p


# ------------------------------------------------------------------------------ device draws


def _draw(
    w: torch.Tensor, counts: Sequence[int], generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """counts[i] i.i.d. draws from row i of w ([n, V], >= 0, each row with mass), by the
    inverse CDF of :func:`shared.maths.sampling.sample`. Returns ids [n, max(counts)] (int64);
    entries past counts[i] are padding. Uniforms come from row i's generator."""
    n, v = int(w.shape[0]), int(w.shape[1])
    dev = w.device
    mmax = max(counts)
    cum = w.to(torch.float64).cumsum(dim=-1)  # [n, V]
    u = torch.zeros(n, mmax, dtype=torch.float64, device=dev)
    for i, (c, g) in enumerate(zip(counts, generators, strict=True)):
        u[i, :c] = torch.rand(c, generator=g, dtype=torch.float64, device=dev)
    ids = torch.searchsorted(cum, (u * cum[:, -1:]).contiguous(), right=True)
    # Rounding can run past the last id with mass (u·total == total); step back onto it.
    ar = torch.arange(v, device=dev)
    last = torch.where(w > 0, ar, -1).amax(dim=-1, keepdim=True)
    return torch.minimum(ids, last)


def _largest(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest values of each row of x and their ids, decreasing, ties by ascending id."""
    vals, ids = torch.topk(x, n, dim=-1, largest=True, sorted=True)
    order = ids.argsort(dim=-1)  # ascending id first, then a stable sort by value: ties by id
    ids, vals = ids.gather(1, order), vals.gather(1, order)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(1, order), ids.gather(1, order)


def _top_k(
    p: torch.Tensor, k: npt.NDArray[np.int64], eps: npt.NDArray[np.float64]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`shared.maths.compression.compress` of each row of p ([n, V]) with its own k and ε.

    Returns (values [n, kk] in p's dtype, ids [n, kk], K [n]) with kk = min(max k, V): row i
    keeps its first K[i] entries whose value is > 0 (decreasing, ties by ascending id)."""
    dev = p.device
    v = int(p.shape[1])
    kcap = np.minimum(k, v)
    vals, ids = _largest(p, int(kcap.max()))
    kcap_t = _idx(kcap, dev)
    if np.any(eps > 0.0):
        cum = vals.to(torch.float64).cumsum(dim=-1)
        target = torch.as_tensor(1.0 - eps - 1e-12, dtype=torch.float64, device=dev)[:, None]
        ka = torch.searchsorted(cum, target.contiguous(), right=False)[:, 0] + 1
        adaptive = torch.clamp(torch.minimum(ka, kcap_t), min=1)
        kcap_t = torch.where(torch.as_tensor(eps > 0.0, device=dev), adaptive, kcap_t)
    return vals, ids, kcap_t


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    """Flattened, as int64 bits (floats are widened to float64 and reinterpreted), so that one
    copy carries ids and values together."""
    if t.is_floating_point():
        return t.to(torch.float64).contiguous().view(torch.int64).reshape(-1)
    return t.to(torch.int64).reshape(-1)


class _Packed:
    """Host-side reader of one packed copy (:func:`_as_int64` pieces, in order)."""

    def __init__(self, pieces: list[torch.Tensor]) -> None:
        flat = torch.cat([_as_int64(x) for x in pieces]) if pieces else None
        self._buf: npt.NDArray[np.int64] = (
            np.zeros(0, np.int64) if flat is None else _to_host(flat).astype(np.int64)
        )
        self._at = 0

    def ints(self, *shape: int) -> npt.NDArray[np.int64]:
        size = math.prod(shape)
        out = self._buf[self._at : self._at + size].reshape(shape)
        self._at += size
        return out

    def floats(self, *shape: int) -> npt.NDArray[np.float64]:
        return self.ints(*shape).view(np.float64)


def _sparse(ids: npt.NDArray[np.int64], vals: npt.NDArray[np.float64], k: int) -> SparseDist:
    keep = vals[:k] > 0.0
    return SparseDist(ids[:k][keep].astype(np.int64), vals[:k][keep].astype(np.float32))


# ------------------------------------------------------------------------------------ verify


@dataclass(frozen=True)
class Corrections:
    """Per session, in row order: how a rejection is corrected (the correction mode) and
    whether a full acceptance takes a bonus token; its RNG (None only for a greedy session,
    which draws nothing); K and the ε target (top-K corrections) and M (candidates), one value
    for all or one per session."""

    correction: Sequence[str]
    want_bonus: Sequence[bool] | npt.ArrayLike
    generators: Sequence[torch.Generator | None]
    k: int | Sequence[int] = 10
    eps_target: float | Sequence[float] = 0.0
    m: int | Sequence[int] = 8


@dataclass(frozen=True)
class _Need:
    """What one session's decision row needs after acceptance (host bookkeeping)."""

    session: int
    row: int
    exclude: int = -1  # the rejected draft id, or -1
    count: int = 1  # draws


def verify(
    probs: torch.Tensor,
    draft_ids: npt.ArrayLike,
    q_draft: npt.ArrayLike,
    cu_draft: npt.ArrayLike,
    *,
    greedy: Sequence[bool] | npt.ArrayLike,
    corrections: Corrections,
) -> list[Decision]:
    """:func:`shared.maths.rejection.verify_batch` for B sessions at once, on probs' device.

    probs: [T + B, V] (after :func:`transform_rows`), laid out as the module docstring says.
    draft_ids, q_draft: host [T]. cu_draft: host [B + 1]. Per session: greedy (T = 0 target)
    and its :class:`Corrections` (generators on probs' device). Two small device→host copies:
    the accepted counts, then the ids and values of every correction and bonus.
    """
    cu, x, tok_rows = _rows_and_tokens(probs, draft_ids, cu_draft)
    dev = probs.device

    def token_px() -> torch.Tensor:
        return probs[_idx(tok_rows, dev), _idx(x, dev)]

    def rows(r: list[int]) -> torch.Tensor:
        return probs.index_select(0, _idx(r, dev))

    return _verify(
        token_px,
        rows,
        probs.dtype,
        probs,
        cu,
        x,
        q_draft,
        greedy=greedy,
        corrections=corrections,
    )


def _verify(
    token_px: Callable[[], torch.Tensor],
    decision_rows: Callable[[list[int]], torch.Tensor],
    dtype: torch.dtype,
    like: torch.Tensor,
    cu: npt.NDArray[np.int64],
    x: npt.NDArray[np.int64],
    q_draft: npt.ArrayLike,
    *,
    greedy: Sequence[bool] | npt.ArrayLike,
    corrections: Corrections,
    row_argmax: Callable[[list[int]], torch.Tensor] | None = None,
) -> list[Decision]:
    """The body of :func:`verify` over two views of the probabilities: ``token_px()`` gives p of
    every draft token ([T], float64 or dtype), ``decision_rows(rows)`` the transformed rows
    (in ``dtype``) of the given row indices; ``row_argmax(rows)``: the first argmax of those
    rows (default: of ``decision_rows``). ``like``: a tensor on the device (for its device)."""
    b = len(cu) - 1
    dev = like.device
    v = int(like.shape[1])
    gam = np.diff(cu)
    qx = np.asarray(q_draft, dtype=np.float64).reshape(-1)
    if len(qx) != len(x):
        raise ValueError(f"{len(qx)} q values for {len(x)} draft ids")
    gr = _per_session(greedy, b, np.bool_, "greedy")
    how = corrections
    bonus = _per_session(how.want_bonus, b, np.bool_, "want_bonus")
    ks = _per_session(how.k, b, np.int64, "k")
    eps = _per_session(how.eps_target, b, np.float64, "eps_target")
    ms = _per_session(how.m, b, np.int64, "m")
    modes, generators = list(how.correction), how.generators
    if len(modes) != b or len(generators) != b:
        raise ValueError(f"{len(modes)} modes, {len(generators)} generators for {b} sessions")
    for s in range(b):
        if gr[s]:
            continue
        if modes[s] not in _MODES:
            raise ValueError(f"unknown correction mode {modes[s]!r}")
        _gen(generators, s)
        if modes[s] == CorrectionMode.TOPK and (ks[s] <= 0 or not 0.0 <= eps[s] < 1.0):
            raise ValueError(f"session {s}: k = {ks[s]}, eps_target = {eps[s]}")
        if modes[s] == CorrectionMode.CANDIDATES and ms[s] <= 0:
            raise ValueError(f"session {s}: m = {ms[s]}")

    # ---- acceptance, all draft tokens at once
    tok_session = np.repeat(np.arange(b), gam)
    accepted_t = torch.as_tensor(gam, device=dev)
    if len(x):
        px = token_px()  # [T]
        us = [
            torch.ones(int(gam[s]), dtype=dtype, device=dev)
            if gr[s]
            else torch.rand(int(gam[s]), generator=_gen(generators, s), dtype=dtype, device=dev)
            for s in range(b)
        ]
        u = torch.cat(us).to(px.dtype)
        q_t = torch.as_tensor(qx, dtype=px.dtype, device=dev)
        ok = torch.where(torch.as_tensor(gr[tok_session], device=dev), px >= 1.0, u * q_t < px)
        pos = torch.as_tensor(np.arange(len(x)) - cu[tok_session], device=dev)
        first_rejected = torch.where(ok, accepted_t.max() + 1, pos)
        accepted_t = accepted_t.scatter_reduce(
            0, _idx(tok_session, dev), first_rejected, reduce="amin", include_self=True
        )
    accepted = _to_host(accepted_t).astype(np.int64)

    # ---- what each decision row needs
    argmax: list[_Need] = []
    draws: list[_Need] = []
    tops: list[_Need] = []
    for s in range(b):
        a = int(accepted[s])
        row = int(cu[s]) + s + a
        rejected = a < gam[s]
        if not rejected and not bonus[s]:
            continue
        if gr[s]:
            argmax.append(_Need(s, row))
        elif not rejected:
            draws.append(_Need(s, row))
        elif modes[s] == CorrectionMode.TOPK:
            tops.append(_Need(s, row))
        else:
            count = int(ms[s]) if modes[s] == CorrectionMode.CANDIDATES else 1
            draws.append(_Need(s, row, int(x[cu[s] + a]), count))

    pieces: list[torch.Tensor] = []
    if argmax:
        rows = [n.row for n in argmax]
        pieces.append(
            row_argmax(rows) if row_argmax is not None else first_argmax(decision_rows(rows))
        )
    if draws:
        p_rows = decision_rows([n.row for n in draws])
        ex = [(i, n.exclude) for i, n in enumerate(draws) if n.exclude >= 0]
        w = p_rows.clone()
        if ex:
            w[_idx([i for i, _ in ex], dev), _idx([e for _, e in ex], dev)] = 0.0
        mass = w.sum(dim=-1, keepdim=True) > 0
        # greedy-draft residual with no mass outside x: norm(p) (shared.maths.sampling.residual)
        w = torch.where(mass, w, p_rows)
        ids = _draw(w, [n.count for n in draws], [_gen(generators, n.session) for n in draws])
        pieces += [mass, ids, p_rows.gather(1, ids)]
    if tops:
        vals, ids_k, kt = _top_k(
            decision_rows([n.row for n in tops]),
            ks[[n.session for n in tops]],
            eps[[n.session for n in tops]],
        )
        pieces += [ids_k, vals, kt]
    host = _Packed(pieces)

    out = [Decision(int(a)) for a in accepted]
    if argmax:
        for n, tok in zip(argmax, host.ints(len(argmax)).tolist(), strict=True):
            a = int(accepted[n.session])
            rej = a < gam[n.session]
            out[n.session] = Decision(a, token=tok) if rej else Decision(a, bonus=tok)
    if draws:
        mmax = max(n.count for n in draws)
        has_mass = host.ints(len(draws))
        ids_h, py_h = host.ints(len(draws), mmax), host.floats(len(draws), mmax)
        for i, n in enumerate(draws):
            a = int(accepted[n.session])
            if n.exclude < 0:
                out[n.session] = Decision(a, bonus=int(ids_h[i, 0]))
            elif modes[n.session] == CorrectionMode.CANDIDATES:
                if not has_mass[i]:
                    raise ValueError("no mass outside the rejected token: rejection impossible")
                c = ids_h[i, : n.count].astype(np.int64)
                out[n.session] = Decision(
                    a, candidates=SparseDist(c, py_h[i, : n.count].astype(np.float32))
                )
            else:
                out[n.session] = Decision(a, token=int(ids_h[i, 0]))
    if tops:
        kk = min(int(ks[[n.session for n in tops]].max()), v)
        ids_h, vals_h = host.ints(len(tops), kk), host.floats(len(tops), kk)
        kh = host.ints(len(tops))
        for i, n in enumerate(tops):
            sparse = _sparse(ids_h[i], vals_h[i], int(kh[i]))
            out[n.session] = Decision(int(accepted[n.session]), sparse=sparse)
    return out


def verify_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    draft_ids: npt.ArrayLike,
    q_draft: npt.ArrayLike,
    cu_draft: npt.ArrayLike,
    corrections: Corrections,
) -> list[Decision]:
    """:func:`verify` of ``transform_rows(logits, …)`` without transforming every row.

    logits: [T + B, V] (the forward's rows, laid out as the module docstring says); params: one
    :class:`SamplingParams` per session. Acceptance needs only p(x) of each draft token:

    * greedy rows (T = 0): p(x) = 1 if x is the first argmax, else 0 (one pass, no exp);
    * rows with no top-k / top-p: p(x) = exp(l_x/T − logsumexp(l/T)), the max and the sum of
      exps over the row in the logits' float32 (one pass), the rest in float64: p(x) carries
      float32 rounding (relative error ~1e-6, far below what any test can see; the suites in
      tests/verifier/test_device_sampling.py run on this path too);
    * rows with top-k / top-p: the full :func:`transform_rows` of those rows.

    Only the decision rows (at most one per session: the rejected position or the bonus
    position) get the full float64 transform, from which every correction and bonus is drawn
    exactly as :func:`verify` draws them.
    """
    cu, x, tok_rows = _rows_and_tokens(logits, draft_ids, cu_draft)
    dev, v = logits.device, int(logits.shape[1])
    gammas = np.diff(cu)
    t, kk, tp = row_params(params, gammas)  # per row
    tt, tk, tpp = t[tok_rows], kk[tok_rows], tp[tok_rows]  # per draft token
    px = torch.zeros(len(x), dtype=DEVICE_DTYPE, device=dev)
    greedy_tok = tt == 0.0
    plain_tok = ~greedy_tok & ((tk == 0) | (tk >= v)) & (tpp >= 1.0)
    full_tok = ~greedy_tok & ~plain_tok
    # Greedy sessions: the first argmax of every row, in one pass over all rows (their draft
    # tokens' p(x) and their corrections / bonus tokens both come from it).
    first_max = first_argmax(logits) if any(p.greedy for p in params) else None
    g = np.flatnonzero(greedy_tok)
    if g.size:
        assert first_max is not None
        px[_idx(g, dev)] = (first_max[_idx(tok_rows[g], dev)] == _idx(x[g], dev)).to(DEVICE_DTYPE)
    pl = np.flatnonzero(plain_tok)
    if pl.size:
        # p(x) = exp(l_x/T − logsumexp(l/T)): one fused pass per row, no [rows, V] copy when
        # every token row is plain (then every row is scored, bonus rows too: no gather).
        if pl.size == len(x):
            scale = np.where(t > 0.0, t, 1.0)  # greedy rows: any finite scale, unused
            z = logits if np.all(scale == 1.0) else logits / _rows_tensor(scale, logits)
            rows_of = tok_rows[pl]
        else:
            z = logits.index_select(0, _idx(tok_rows[pl], dev))
            z = z / _rows_tensor(tt[pl], z)
            rows_of = np.arange(pl.size)
        zf = z.float()
        top = zf.amax(dim=-1, keepdim=True)
        # logsumexp by hand: measured faster than torch.logsumexp on the CPU (vectorised amax)
        lse = top[:, 0] + (zf - top).exp_().sum(dim=-1).log()  # [rows]
        ri = _idx(rows_of, dev)
        zx = z[ri, _idx(x[pl], dev)].to(torch.float64)
        px[_idx(pl, dev)] = torch.exp(zx - lse[ri].to(torch.float64))
    fu = np.flatnonzero(full_tok)
    if fu.size:
        rf = tok_rows[fu]
        probs = transform_rows(logits.index_select(0, _idx(rf, dev)), t[rf], kk[rf], tp[rf])
        px[_idx(fu, dev)] = probs.gather(1, _idx(x[fu], dev)[:, None])[:, 0]

    def decision_rows(rows: list[int]) -> torch.Tensor:
        r = np.asarray(rows, dtype=np.int64)
        return transform_rows(logits.index_select(0, _idx(r, dev)), t[r], kk[r], tp[r])

    return _verify(
        lambda: px,
        decision_rows,
        DEVICE_DTYPE,
        logits,
        cu,
        x,
        q_draft,
        greedy=[p.greedy for p in params],
        corrections=corrections,
        row_argmax=None if first_max is None else lambda rows: first_max[_idx(rows, dev)],
    )


@dataclass(frozen=True)
class VerifyBatch:
    """What :func:`verify_batch` decides, besides the logits: per session (in row order) its
    sampling parameters and :class:`Corrections`; and the concatenated draft ids, their q(x)
    and the cumulative draft lengths ``cu_draft`` ([B + 1])."""

    params: Sequence[SamplingParams]
    draft_ids: npt.ArrayLike
    q_draft: npt.ArrayLike
    cu_draft: npt.ArrayLike
    corrections: Corrections


def verify_batch(logits: torch.Tensor, batch: VerifyBatch) -> list[Decision]:
    """:func:`verify_logits` of one typed :class:`VerifyBatch` (the engine's call)."""
    b = batch
    return verify_logits(logits, b.params, b.draft_ids, b.q_draft, b.cu_draft, b.corrections)


def draw_candidates(
    p_row: torch.Tensor, exclude: int, m: int, generator: torch.Generator
) -> SparseDist:
    """:func:`shared.maths.rejection.draw_candidates` on the device (a Resample): m i.i.d. draws
    from p_row ([V]) with ``exclude`` removed, each with its p(y). One copy of 2·m numbers."""
    if p_row.ndim != 1 or not 0 <= exclude < p_row.shape[0] or m <= 0:
        raise ValueError(f"p_row {tuple(p_row.shape)}, exclude {exclude}, m {m}")
    p = p_row[None]
    w = p.clone()
    w[0, exclude] = 0.0
    mass = w.sum(dim=-1) > 0
    ids = _draw(torch.where(mass[:, None], w, p), [m], [generator])
    host = _Packed([mass, ids, p.gather(1, ids)])
    if not host.ints(1)[0]:
        raise ValueError("no mass outside the rejected token: a rejection was impossible")
    ids_h, py = host.ints(m), host.floats(m)
    return SparseDist(ids_h.astype(np.int64), py.astype(np.float32))


# --------------------------------------------------------------------------------- logprobs


@dataclass(frozen=True)
class LogprobAsk:
    """One session's log-probabilities to report (Hello.logprobs): ``rows`` of the logits, the
    ids wanted at each (one per row but the last, which may have several: a rejection's
    candidates or top-K), and ``n`` alternatives per row."""

    rows: Sequence[int]
    ids: Sequence[npt.NDArray[np.int64]]
    n: int


def logprobs(logits: torch.Tensor, asks: Sequence[LogprobAsk]) -> list[Logprobs]:
    """log softmax of the asked rows of ``logits`` (the model's own distribution, before any
    sampling transform), in float64 on the device: the asked ids' values and each row's n
    likeliest (ties by ascending id), floored at LOGPROB_FLOOR. One copy of Σ(ids + 2n)
    numbers to the host. Each result's ``pos`` is 0 (the caller places it)."""
    if not asks:
        return []
    dev = logits.device
    rows = np.concatenate([np.asarray(a.rows, np.int64) for a in asks])
    lsm = torch.log_softmax(logits.index_select(0, _idx(rows, dev)).to(torch.float64), dim=-1)
    lsm = lsm.clamp(min=LOGPROB_FLOOR)
    per_row = [np.asarray(x, np.int64) for a in asks for x in a.ids]  # aligned with rows
    if len(per_row) != len(rows):
        raise ValueError(f"{len(per_row)} id lists for {len(rows)} rows")
    at_row = np.concatenate([np.full(len(x), r, np.int64) for r, x in enumerate(per_row)])
    flat_ids = np.concatenate(per_row)
    pieces = [lsm[_idx(at_row, dev), _idx(flat_ids, dev)]]
    n = min(max(a.n for a in asks), int(lsm.shape[1]))
    if n:
        pieces += list(_largest(lsm, n))
    host = _Packed(pieces)
    lp_h = host.floats(len(flat_ids)).astype(np.float32)
    top_v = host.floats(len(rows), n).astype(np.float32) if n else None
    top_i = host.ints(len(rows), n) if n else None
    out = []
    at_id = at_r = 0
    for a in asks:
        k = sum(len(i) for i in a.ids)
        r = len(a.rows)
        lp = np.minimum(lp_h[at_id : at_id + k], 0.0)
        if a.n and top_v is not None and top_i is not None:
            tv = np.minimum(top_v[at_r : at_r + r, : a.n], 0.0).reshape(-1)
            ti = top_i[at_r : at_r + r, : a.n].reshape(-1)
        else:
            tv, ti = np.zeros(0, np.float32), np.zeros(0, np.int64)
        out.append(
            Logprobs(0, flat_ids[at_id : at_id + k], lp, len(a.ids[-1]), ti.astype(np.int64), tv)
        )
        at_id += k
        at_r += r
    return out


# ---------------------------------------------------------------------------------- federate


def federate_rows(
    probs: torch.Tensor,
    draft_ids: npt.ArrayLike,
    cu_draft: npt.ArrayLike,
    k: int | Sequence[int],
    eps_target: float | Sequence[float] = 0.0,
) -> list[FederatedRows]:
    """The federated (SpecFed) reply of every session, as ``SessionModel._federate`` builds it:
    per row the top-K (:func:`shared.maths.compression.compress`), p_j(x_j) of the draft tokens and
    ‖p̂ − p‖₁ of reconstructions A and B (computed on the device). One device→host copy."""
    cu, x, tok_rows = _rows_and_tokens(probs, draft_ids, cu_draft)
    b = len(cu) - 1
    dev = probs.device
    n, v = int(probs.shape[0]), int(probs.shape[1])
    ks = _per_session(k, b, np.int64, "k")
    eps = _per_session(eps_target, b, np.float64, "eps_target")
    if np.any(ks <= 0) or not np.all((eps >= 0.0) & (eps < 1.0)):
        raise ValueError(f"k must be > 0 and eps_target in [0, 1): {ks.tolist()}, {eps.tolist()}")
    reps = np.diff(cu) + 1
    vals, ids, kt = _top_k(probs, np.repeat(ks, reps), np.repeat(eps, reps))
    kk = int(vals.shape[1])

    # l1 of the reconstructions, from the float32 values the wire carries (compression.reconstruct)
    p64 = probs.to(torch.float64)
    valid = (torch.arange(kk, device=dev)[None] < kt[:, None]) & (vals > 0)
    kept = torch.where(valid, vals.to(torch.float32).to(torch.float64), 0.0)
    mass = kept.sum(dim=-1, keepdim=True)
    recon_a = torch.zeros(n, v, dtype=torch.float64, device=dev).scatter_(1, ids, kept / mass)
    l1_a = (recon_a - p64).abs().sum(dim=-1)
    del recon_a
    rest = v - valid.sum(dim=-1, keepdim=True)
    other = torch.where(rest > 0, (1.0 - mass).clamp(min=0.0) / rest.clamp(min=1), 0.0)
    recon_b = other.expand(n, v).clone().scatter_(1, ids, torch.where(valid, kept, other))
    recon_b /= recon_b.sum(dim=-1, keepdim=True)
    l1_b = (recon_b - p64).abs().sum(dim=-1)
    del recon_b
    l1 = torch.stack([l1_a, l1_b], dim=-1)  # [n, 2]
    p_draft = probs[_idx(tok_rows, dev), _idx(x, dev)] if len(x) else probs.new_zeros(0)

    host = _Packed([ids, vals, kt, l1, p_draft])
    ids_h, vals_h, kh = host.ints(n, kk), host.floats(n, kk), host.ints(n)
    l1_h, pd_h = host.floats(n, 2).astype(np.float32), host.floats(len(x)).astype(np.float32)
    out: list[FederatedRows] = []
    for s in range(b):
        r0, r1 = int(cu[s]) + s, int(cu[s + 1]) + s + 1
        dists = tuple(_sparse(ids_h[r], vals_h[r], int(kh[r])) for r in range(r0, r1))
        out.append((dists, pd_h[cu[s] : cu[s + 1]].copy(), l1_h[r0:r1].copy()))
    return out
