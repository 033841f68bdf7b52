"""The KV manager: the one owner of the session slots and of who may hold which pages."""

from __future__ import annotations

import pytest
import torch

from cloud_verifier.engine.kv_manager import KVManager, NoFreeSlot, Shares
from cloud_verifier.engine.prefix_cache import PrefixCache
from shared.maths.sampling import SamplingParams
from shared.runtime.kv_pool import PagedKV
from shared.wire.messages import Fingerprint, Hello

pytestmark = pytest.mark.fast

FP = Fingerprint(model_name="m", tokenizer_hash="t" * 16, vocab_size=64)
HELLO = Hello(fingerprint=FP, sampling=SamplingParams(temperature=0.0))
CPU = torch.device("cpu")


#: No share of the pool below the whole of it.
UNSHARED = Shares(1.0, 1.0)


def _kv(
    slots: int = 4,
    pages: int = 8,
    shares: Shares = UNSHARED,
    prefix_cache: PrefixCache = PrefixCache.OFF,
) -> KVManager:
    kv = KVManager(slots, shares, prefix_cache)
    pool = PagedKV(
        layers=1,
        kv_heads=1,
        head_dim=2,
        num_pages=pages,
        page_size=4,
        dtype=torch.float32,
        device=CPU,
    )
    kv.attach(pool, FP)
    return kv


def test_slots_are_opened_and_closed_once() -> None:
    kv = _kv(slots=2)
    a, b = kv.open(HELLO, "x", CPU), kv.open(HELLO, "y", CPU)
    assert kv.slots_used == 2 and {a.index, b.index} == {0, 1}
    with pytest.raises(NoFreeSlot, match="all 2 session slots"):
        kv.open(HELLO, "x", CPU)
    assert kv.close(a) and not kv.close(a)  # a second close is a no-op
    assert a.released and kv.slots_used == 1
    assert kv.open(HELLO, "z", CPU).index == a.index


def test_a_shared_prefix_page_counts_once_against_its_tenant() -> None:
    """Two sessions of one tenant claiming the same cached prefix hold its pages once: the
    tenant's share is not spent twice."""
    kv = _kv(pages=8, shares=Shares(1.0, 0.5), prefix_cache=PrefixCache.TENANT)
    pool = kv.require_pool()
    first = kv.open(HELLO, "t", CPU)
    text = list(range(1, 13))  # three pages of 4
    pool.reserve(first.pages, 12)
    pool.commit(first.pages, 0, text)
    kv.publish(first)
    second = kv.open(HELLO, "t", CPU)
    assert kv.claim(second, [*text, 13]) == 12
    assert kv.tenant_pages("t") == 3  # not 6
    # the tenant may hold 4 pages: one more page fits, two do not
    assert kv.over_quota(second, 16) is None
    why = kv.over_quota(second, 20)
    assert why is not None and "hold 3 of the 4 KV pages" in why


def test_session_share_and_max_context() -> None:
    kv = _kv(pages=8, shares=Shares(0.25, 1.0))
    slot = kv.open(HELLO, "", CPU)
    assert kv.session_pages == 2 and kv.max_context(None) == 8 and kv.max_context(5) == 5
    why = kv.over_quota(slot, 9)
    assert why is not None and "share of the KV cache (8 tokens)" in why
    assert kv.fits_tree(slot, 8) and not kv.fits_tree(slot, 9)


def test_a_row_that_finds_no_pages_leaves_the_slot_as_it_was() -> None:
    kv = _kv(pages=2)
    slot = kv.open(HELLO, "", CPU)
    assert kv.reserve_row(slot, 0, 8, 0) is None and len(slot.pages.pages) == 2
    kv.require_pool().commit(slot.pages, 0, list(range(8)))
    why = kv.reserve_row(slot, 8, 12, 8)
    assert why is not None and "KV cache is full" in why
    assert slot.length == 8 and len(slot.pages.pages) == 2
    kv.close(slot)
    kv.free(slot)
    assert kv.pages_free() == 2
