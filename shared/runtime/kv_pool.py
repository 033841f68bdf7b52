"""A KV cache in pages: one preallocated pool shared by slots (the verifier's sessions, or the
drafter's one sequence).

Layout (per layer, keys and values alike): ``[num_pages · page_size + 1, kv_heads, head_dim]``
on the model's device, preallocated once. Position ``t`` of a slot lives at flat row
``pages[t // page_size] · page_size + t % page_size`` of its page list; the last row is a trash
row that padding tokens write to. Invariants:

* a slot's ``length`` counts the positions that hold committed keys; rows at positions >= length
  may hold anything (an uncommitted forward, a rolled-back draft) and are never read unmasked;
* ``len(pages) · page_size >= length`` and at most one page past what ``length`` needs is kept
  (rollback frees whole pages beyond the new length);
* without the prefix cache, pages are owned by at most one slot; ``free`` (a min-heap) holds
  every other page, so a lone slot's pages are always ``0, 1, 2, …`` in order and its rows one
  contiguous range. With it, ``free`` holds the pages no slot holds that are not cached.

Prefix cache (the verifier's; vLLM's automatic prefix caching on a small scale). A slot may
*publish* its full pages (:meth:`PagedKV.publish`): each is keyed by a hash chain over the
tokens of every page up to it from a root key (the model and a namespace: a tenant, or one
shared by all), so a key names one prefix. A new slot *claims* the longest published prefix of
its first tokens (:meth:`PagedKV.claim`) instead of computing it. Pages are reference-counted:

* a page is held by ``refs`` slots; a published page that no slot holds stays cached, in
  least-recently-used order, and is evicted only when a page is needed and none is free, so the
  cache costs nothing under pressure;
* a shared or published page is read-only: before a forward writes into one, the slot gets a
  private copy (:meth:`PagedKV.writable`: copy on write), so rollback and rewrites never touch
  a page another slot reads.

Rollback is a pointer move (:meth:`PagedKV.crop`): no tensor is touched. A forward over a batch
of slots writes every new key once (:meth:`StepCache.update`) and reads, per layer, the slots'
rows ``[0, L)`` through one gather (``L`` the longest slot after the step), so attention sees a
dense ``[B, kv_heads, L, head_dim]`` tensor and a 4D mask hides what a row must not see.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.errors import WanspecError


class OutOfPages(WanspecError, RuntimeError):
    """The pool has no free page for a slot that grows (the KV memory budget is spent)."""


@dataclass
class SlotPages:
    """One slot's view of the pool (host bookkeeping only): its pages, the positions its KV
    holds and, where the owner records them (:meth:`PagedKV.commit`), the token ids at those
    positions. Invariant for a recording slot: ``len(tokens) == length``; the pool is the one
    place both move (commit, crop). A tensor-parallel follower's slot records no tokens."""

    pages: list[int] = field(default_factory=list)
    length: int = 0
    tokens: list[int] = field(default_factory=list)
    #: The prefix cache's chain keys of its first full pages (publish, claim), as far as known.
    keys: list[bytes] = field(default_factory=list)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens ``a`` and ``b`` share: what of a cached sequence a new one keeps.
    Divergence is almost always near the end (a rollback, a next turn): the whole shorter
    length is compared first."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def root_key(*parts: str) -> bytes:
    """The key a hash chain starts from (the model, a namespace)."""
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=16).digest()


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a page holding ``tokens`` after the prefix whose key is ``parent``."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens))
    return h.digest()


class PagedKV:
    """Preallocated key/value pools for ``layers`` layers, handed out in pages to slots."""

    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = device
        rows = num_pages * page_size + 1
        self.trash = rows - 1
        shape = (rows, kv_heads, head_dim)
        # Zeros, not empty: masked positions are still multiplied (by a zero weight), and
        # uninitialised memory may hold NaN, which a zero weight does not cancel.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.free: list[int] = list(range(num_pages))  # a heap: the lowest free page first
        size = torch.empty(0, dtype=dtype).element_size()
        self.bytes_per_token = 2 * layers * kv_heads * head_dim * size
        self.refs: list[int] = [0] * num_pages  # slots holding each page
        self._key_of: dict[int, bytes] = {}  # published page → its key
        self._page_of: dict[bytes, int] = {}  # key → its published page
        #: Published pages no slot holds, least recently used first (evicted first).
        self._idle: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0  # cached pages evicted for a page needed
        self.copies = 0  # pages copied on write

    @property
    def bytes_total(self) -> int:
        return self.bytes_per_token * self.num_pages * self.page_size

    @property
    def pages_used(self) -> int:
        """Pages some slot holds (cached pages no slot holds are as good as free)."""
        return self.num_pages - len(self.free) - len(self._idle)

    @property
    def pages_available(self) -> int:
        """Pages a slot may still get: free ones, then cached ones no slot holds (evicted)."""
        return len(self.free) + len(self._idle)

    @property
    def pages_cached(self) -> int:
        """Published pages (held by slots or idle)."""
        return len(self._key_of)

    def _take(self) -> int:
        """A page for a slot: the lowest free one, else the least recently used idle cached
        one (evicted: its key is forgotten)."""
        if self.free:
            page = heapq.heappop(self.free)
        else:
            page, _ = self._idle.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            self.evictions += 1
        self.refs[page] = 1
        return page

    def _drop(self, page: int) -> None:
        """A slot lets go of ``page``: it goes back to the pool when no slot holds it (kept
        cached, most recently used, if published)."""
        self.refs[page] -= 1
        if self.refs[page] > 0:
            return
        if page in self._key_of:
            self._idle[page] = None
        else:
            heapq.heappush(self.free, page)

    def reserve(self, slot: SlotPages, length: int) -> None:
        """Give ``slot`` pages for positions ``[0, length)``; all or nothing (OutOfPages)."""
        need = -(-length // self.page_size) - len(slot.pages)
        if need <= 0:
            return
        if need > self.pages_available:
            raise OutOfPages(
                f"the KV cache is full: {need} more pages of {self.page_size} tokens needed, "
                f"{self.pages_available} of {self.num_pages} free"
            )
        slot.pages.extend(self._take() for _ in range(need))

    def crop(self, slot: SlotPages, length: int) -> None:
        """Roll ``slot`` back to its first ``length`` positions (a pointer move); pages wholly
        past them go back to the pool (shared ones stay with their other holders)."""
        if not 0 <= length <= slot.length:
            raise ValueError(f"crop({length}) out of range 0..{slot.length}")
        slot.length = length
        del slot.tokens[length:]
        del slot.keys[length // self.page_size :]
        keep = -(-length // self.page_size)
        while len(slot.pages) > keep:
            self._drop(slot.pages.pop())

    # ------------------------------------------------------------------ the prefix cache

    def publish(self, slot: SlotPages, root: bytes) -> None:
        """Key every full page of ``slot`` (a recording slot) under the chain from ``root``; a
        page whose key another page already holds stays private (the same prefix, computed
        twice), the others become cached pages."""
        size = self.page_size
        full = slot.length // size
        while len(slot.keys) < full:
            i = len(slot.keys)
            parent = slot.keys[-1] if slot.keys else root
            key = chain_key(parent, slot.tokens[i * size : (i + 1) * size])
            slot.keys.append(key)
            page = slot.pages[i]
            if key not in self._page_of and page not in self._key_of:
                self._page_of[key] = page
                self._key_of[page] = key

    def claim(self, slot: SlotPages, tokens: Sequence[int], root: bytes, limit: int) -> int:
        """An empty ``slot`` takes the longest cached prefix of ``tokens`` (under ``root``), in
        whole pages and at most ``limit`` tokens; returns the tokens claimed."""
        if slot.length or slot.pages:
            raise ValueError("claim() needs an empty slot")
        size = self.page_size
        parent = root
        for i in range(min(limit, len(tokens)) // size):
            key = chain_key(parent, tokens[i * size : (i + 1) * size])
            page = self._page_of.get(key)
            if page is None:
                break
            if self.refs[page] == 0:
                del self._idle[page]
            self.refs[page] += 1
            slot.pages.append(page)
            slot.keys.append(key)
            parent = key
        n = len(slot.pages) * size
        slot.length = n
        slot.tokens[:] = [int(t) for t in tokens[:n]]
        return n

    def writable(self, slot: SlotPages, start: int) -> None:
        """Make the page that holds position ``start`` of ``slot`` its own before a forward
        writes there (copy on write): a page another slot holds, or a cached one, is copied
        into a fresh page (OutOfPages when none is left). Pages past it are the slot's own:
        reserved after ``start``'s page, or wholly past its length and so never published."""
        i = start // self.page_size
        if i >= len(slot.pages):
            return
        page = slot.pages[i]
        if self.refs[page] == 1 and page not in self._key_of:
            return
        if self.pages_available == 0:
            raise OutOfPages("the KV cache is full: no page to copy a shared page into")
        fresh = self._take()
        size = self.page_size
        src = slice(page * size, (page + 1) * size)
        dst = slice(fresh * size, (fresh + 1) * size)
        for pool in (self.keys, self.values):
            for layer in pool:
                layer[dst] = layer[src]
        slot.pages[i] = fresh
        del slot.keys[i:]
        self._drop(page)
        self.copies += 1

    def commit(self, slot: SlotPages, start: int, ids: Sequence[int]) -> None:
        """A forward wrote ``ids`` at positions ``start, start+1, ...`` of ``slot`` (within its
        reserved pages): they are its text from ``start`` on, and its length moves there."""
        if not 0 <= start <= len(slot.tokens):
            raise ValueError(f"commit at {start}: the slot records {len(slot.tokens)} tokens")
        end = start + len(ids)
        if -(-end // self.page_size) > len(slot.pages):
            raise ValueError(f"commit to {end}: the slot's pages end before it")
        del slot.tokens[start:]
        slot.tokens.extend(int(t) for t in ids)
        slot.length = end

    def move(self, slot: SlotPages, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the keys and values of positions ``src`` of ``slot`` to positions ``dst`` (in
        every layer; the sources are read before anything is written, so the ranges may
        overlap): a tree row's accepted branch moves from its layout to its depth. Both within
        the slot's pages; ``dst``'s pages must be private (:meth:`writable`)."""
        if len(src) != len(dst):
            raise ValueError(f"move of {len(src)} positions to {len(dst)}")
        if not src:
            return
        end = max(*src, *dst) + 1
        if -(-end // self.page_size) > len(slot.pages):
            raise ValueError(f"move past position {end - 1}: the slot's pages end before it")
        p = self.page_size
        s_t = torch.tensor([slot.pages[t // p] * p + t % p for t in src], device=self.device)
        d_t = torch.tensor([slot.pages[t // p] * p + t % p for t in dst], device=self.device)
        for pool in (*self.keys, *self.values):
            pool[d_t] = pool[s_t]  # advanced indexing reads a copy first

    def release(self, slot: SlotPages) -> None:
        self.crop(slot, 0)

    def fork(self, slot: SlotPages, length: int) -> SlotPages:
        """A new recording slot holding ``slot``'s first ``length`` positions by sharing its
        pages (each page's count of holders goes up; nothing is copied). Either slot writing
        into a shared page later copies it first (:meth:`writable`)."""
        if not 0 <= length <= slot.length:
            raise ValueError(f"fork({length}) out of range 0..{slot.length}")
        pages = slot.pages[: -(-length // self.page_size)]
        for page in pages:
            self.refs[page] += 1
        return SlotPages(
            pages=list(pages),
            length=length,
            tokens=list(slot.tokens[:length]),
            keys=list(slot.keys[: length // self.page_size]),
        )

    def grow(self, num_pages: int) -> None:
        """Enlarge the pool to ``num_pages`` (rows keep their place; the trash row moves to the
        end). Only between forwards; a fixed-size pool (the verifier's) never calls it."""
        if num_pages <= self.num_pages:
            return
        rows = num_pages * self.page_size + 1
        keep = self.num_pages * self.page_size
        for pool in (self.keys, self.values):
            for i, old in enumerate(pool):
                new = old.new_zeros((rows, *old.shape[1:]))
                new[:keep] = old[:keep]
                pool[i] = new
        for page in range(self.num_pages, num_pages):
            heapq.heappush(self.free, page)
        self.refs += [0] * (num_pages - self.num_pages)
        self.num_pages = num_pages
        self.trash = rows - 1

    def contiguous(self, slot: SlotPages) -> int | None:
        """The first flat row of ``slot`` when its pages are consecutive (else None)."""
        pages = slot.pages
        if pages and all(p == pages[0] + i for i, p in enumerate(pages)):
            return pages[0] * self.page_size
        return None

    def flat_rows(self, slot: SlotPages, start: int, stop: int) -> list[int]:
        """Flat pool rows of positions [start, stop) (the pages must be reserved)."""
        p = self.page_size
        return [slot.pages[t // p] * p + t % p for t in range(start, stop)]

    def page_table(self, slots: Sequence[SlotPages], pages: int) -> torch.Tensor:
        """[B, pages] int64 on the device: each slot's pages, padded with the trash page."""
        table = [(s.pages + [-1] * pages)[:pages] for s in slots]
        return torch.tensor(table, dtype=torch.int64, device=self.device)


class StepCache:
    """The cache object one batched forward sees (transformers calls ``update`` per layer).

    ``write``: [B·n] flat rows for the new keys (padding → the trash row); ``read``: [B, L] flat
    rows of positions 0..L-1 of each slot (beyond a slot's pages → the trash row), or, for one
    slot with consecutive pages, ``(first row, L)``: a view, no gather. Keys are written before
    they are read, so a row attends to its own new keys.
    """

    is_compileable = False

    def __init__(
        self, pool: PagedKV, write: torch.Tensor, read: torch.Tensor | tuple[int, int]
    ) -> None:
        self._pool = pool
        self._write = write
        self._read = read

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [B, kv_heads, n, head_dim] → pool rows; returns [B, kv_heads, L, head_dim].
        b, h, n, d = key_states.shape
        k_pool, v_pool = self._pool.keys[layer_idx], self._pool.values[layer_idx]
        k_pool.index_copy_(0, self._write, key_states.transpose(1, 2).reshape(b * n, h, d))
        v_pool.index_copy_(0, self._write, value_states.transpose(1, 2).reshape(b * n, h, d))
        if isinstance(self._read, tuple):
            first, length = self._read
            k, v = k_pool[first : first + length][None], v_pool[first : first + length][None]
            return k.transpose(1, 2), v.transpose(1, 2)
        return k_pool[self._read].transpose(1, 2), v_pool[self._read].transpose(1, 2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        length = self._read[1] if isinstance(self._read, tuple) else int(self._read.shape[1])
        return length, 0
