"""The verifier's KV manager: the one owner of the session slots and of who may hold which KV
pages (vLLM v1's KVCacheManager, on a small scale).

It keeps which slots are open and whose (the tenant: a bearer token's key), each session's and
each tenant's share of the pool, and does what touches pages for a row: prefix claims, tree
fitting and page reservation. The scheduler consults it (through :meth:`KVManager.pages_free`
and each slot's figures) to size a step's prefill chunks to the pages there are; the runner asks
it before a forward writes anything.

Threads: slots are opened on the event loop and handed back there (:meth:`open`,
:meth:`close`); pages are only touched on the engine's thread (everything that takes a
:class:`~shared.runtime.kv_pool.SlotPages`). The registry of open slots is guarded by a lock;
the pool needs none (one thread).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from cloud_verifier.engine.prefix_cache import PrefixCache
from shared.errors import WanspecError
from shared.runtime.kv_pool import OutOfPages, PagedKV, SlotPages, root_key
from shared.wire.messages import Fingerprint, Hello

__all__ = ["KVManager", "NoFreeSlot", "Shares", "Slot", "new_generator"]


class NoFreeSlot(WanspecError, RuntimeError):
    """Every session slot is taken."""


@dataclass(frozen=True)
class Shares:
    """Shares of the KV pool: one session may hold at most ``session`` of its pages, the
    sessions of one tenant together ``tenant`` (1.0: no own limit)."""

    session: float
    tenant: float


@dataclass(eq=False)
class Slot:
    """One session's model side: its pages and tokens in the pool, its RNG, the sampling
    parameters of its Hello, and p at the last rejected position (candidates mode, for Draw).
    Touched only on the engine's thread once opened."""

    index: int
    hello: Hello
    generator: torch.Generator | None
    #: Who holds it (the bearer token's key): the KV quota counts a tenant's slots together.
    tenant: str = ""
    pages: SlotPages = field(default_factory=SlotPages)
    #: The draft model's cache of this session's text (cloud_draft_model), lazily in step.
    draft_pages: SlotPages = field(default_factory=SlotPages)
    #: Prompt tokens its prefill took from the prefix cache, until a verdict reports them.
    claimed: int = 0
    kept: tuple[torch.Tensor, int] | None = None  # ([V] probs on the device, rejected id)
    #: The logits row at that position ([V], on the device) when the Hello asked for logprobs.
    kept_logits: torch.Tensor | None = None
    released: bool = False

    @property
    def length(self) -> int:
        return self.pages.length

    @property
    def tokens(self) -> list[int]:
        """The token ids the cache holds (the pool moves them with the length)."""
        return self.pages.tokens


def new_generator(hello: Hello, device: torch.device) -> torch.Generator | None:
    """The session's RNG on the target's device (None for greedy sampling)."""
    if hello.sampling.greedy:
        return None
    generator = torch.Generator(device=device)
    if hello.seed is None:
        generator.seed()
    else:
        generator.manual_seed(hello.seed % (1 << 63))
    return generator


class KVManager:
    """Slots and page shares (module docstring). ``slots``: how many sessions may be open."""

    def __init__(self, slots: int, shares: Shares, prefix_cache: PrefixCache) -> None:
        self.slots = slots
        self.shares = shares
        self.prefix_cache = prefix_cache
        self.pool: PagedKV | None = None
        self._fingerprint: Fingerprint | None = None
        self._lock = threading.Lock()
        self._free = list(range(slots - 1, -1, -1))
        self._tenants: dict[str, set[Slot]] = {}
        self.prefix_hit_tokens = 0  # prompt tokens claimed from the prefix cache

    def attach(self, pool: PagedKV, fingerprint: Fingerprint) -> None:
        """The pool, once the target is loaded (its fingerprint roots the prefix chains)."""
        self.pool, self._fingerprint = pool, fingerprint

    def require_pool(self) -> PagedKV:
        if self.pool is None:
            raise RuntimeError("the KV pool is not allocated yet")
        return self.pool

    # ------------------------------------------------------------------ slots (event loop)

    def open(self, hello: Hello, tenant: str, device: torch.device) -> Slot:
        """A slot for a session that said Hello (NoFreeSlot when all are taken)."""
        with self._lock:
            if not self._free:
                raise NoFreeSlot(f"all {self.slots} session slots are in use")
            slot = Slot(self._free.pop(), hello, new_generator(hello, device), tenant)
            self._tenants.setdefault(tenant, set()).add(slot)
        return slot

    def close(self, slot: Slot) -> bool:
        """Mark ``slot`` released and take it out of the registry (its pages go back with
        :meth:`free`, on the engine's thread); False if it was released already."""
        with self._lock:
            if slot.released:
                return False
            slot.released = True
            self._free.append(slot.index)
            held = self._tenants.get(slot.tenant)
            if held is not None:
                held.discard(slot)
                if not held:
                    del self._tenants[slot.tenant]
        return True

    @property
    def slots_used(self) -> int:
        with self._lock:
            return self.slots - len(self._free)

    # ------------------------------------------------------------------ shares

    @property
    def page_size(self) -> int:
        return self.require_pool().page_size

    @property
    def session_pages(self) -> int:
        """Pages one session may hold (its share of the pool)."""
        return max(1, int(self.require_pool().num_pages * self.shares.session))

    @property
    def tenant_limit(self) -> int:
        """Pages the sessions of one tenant may hold together."""
        return max(1, int(self.require_pool().num_pages * self.shares.tenant))

    def max_context(self, model_limit: int | None) -> int:
        """Tokens one session may hold: the model's limit, capped by its share of the pool."""
        tokens = self.session_pages * self.page_size
        return tokens if model_limit is None else min(model_limit, tokens)

    def tenant_pages(self, tenant: str) -> int:
        """Pages the open slots of ``tenant`` hold now, a page several of them share (a claimed
        prefix) counted once."""
        with self._lock:
            mates = list(self._tenants.get(tenant, ()))
        held: set[int] = set()
        for s in mates:
            if not s.released:
                held.update(s.pages.pages)
        return len(held)

    @staticmethod
    def pages_held(slot: Slot) -> int:
        """Pages ``slot`` holds now (a read of the engine thread's figure: a gauge)."""
        return len(slot.pages.pages)

    def pages_free(self) -> int:
        """Pages a slot may still get (free ones, then idle cached ones)."""
        return 0 if self.pool is None else self.pool.pages_available

    def pages_needed(self, slot: Slot, end: int) -> int:
        """New pages ``slot`` needs to hold ``end`` tokens."""
        return max(0, -(-end // self.page_size) - len(slot.pages.pages))

    def over_quota(self, slot: Slot, end: int) -> str | None:
        """Why growing ``slot`` to ``end`` tokens would pass its session's or its tenant's
        share of the pool (None: it would not)."""
        need = self.pages_needed(slot, end)
        if need <= 0:
            return None
        size = self.page_size
        if self.shares.session < 1.0 and len(slot.pages.pages) + need > self.session_pages:
            return (
                f"{end} tokens exceed this session's share of the KV cache "
                f"({self.session_pages * size} tokens)"
            )
        if self.shares.tenant >= 1.0:
            return None
        held = self.tenant_pages(slot.tenant)
        if held + need > self.tenant_limit:
            return (
                f"this token's sessions hold {held} of the {self.tenant_limit} KV pages "
                f"they may share; {need} more needed"
            )
        return None

    # ------------------------------------------------------------------ pages (engine thread)

    def root(self, slot: Slot) -> bytes:
        """The root of ``slot``'s prefix-cache chains: the model, and its namespace."""
        fp = self._fingerprint
        assert fp is not None
        space = "global" if self.prefix_cache == PrefixCache.GLOBAL else f"tenant:{slot.tenant}"
        return root_key(fp.model_name, fp.tokenizer_hash, str(fp.vocab_size), space)

    def claim(self, slot: Slot, fixed: list[int]) -> int:
        """A new session's prefill: the longest cached prefix of its text is claimed, not
        computed (at least its last fixed token is, for the row that scores draft[0]);
        returns the tokens claimed (0 with the prefix cache off or a non-empty slot)."""
        if self.prefix_cache == PrefixCache.OFF or slot.length or not fixed:
            return 0
        claimed = self.require_pool().claim(slot.pages, fixed, self.root(slot), len(fixed) - 1)
        self.prefix_hit_tokens += claimed
        slot.claimed = claimed
        return claimed

    def fits_tree(self, slot: Slot, end: int) -> bool:
        """May ``slot`` grow to ``end`` tokens for a token tree: within its shares and the free
        pages (a tree is a hedge: it never fails the work, it is left out)."""
        return not self.over_quota(slot, end) and self.pages_needed(slot, end) <= self.pages_free()

    def reserve_row(self, slot: Slot, start: int, end: int, before: int) -> str | None:
        """Pages for a row writing positions ``[start, end)`` (a shared page at ``start`` is
        copied first, never written); None when done, else why not, with the slot cropped
        back to ``before`` (a claim let go: a failed work leaves the cache as it found it)."""
        pool = self.require_pool()
        try:
            pool.writable(slot.pages, start)
            pool.reserve(slot.pages, end)
        except OutOfPages as e:
            pool.crop(slot.pages, before)
            slot.claimed = 0
            return str(e)
        return None

    def publish(self, slot: Slot) -> None:
        """The full pages of the text ``slot`` now holds, into the prefix cache."""
        if self.prefix_cache != PrefixCache.OFF:
            self.require_pool().publish(slot.pages, self.root(slot))

    def free(self, slot: Slot) -> None:
        """``slot``'s pages back to the pool (after :meth:`close`)."""
        self.require_pool().release(slot.pages)
