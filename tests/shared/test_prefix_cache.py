"""The KV pool's prefix cache (shared.runtime.kv_pool): publish, claim, reference counts,
copy on write, least-recently-used eviction. Pure bookkeeping on a small pool whose rows are
written by hand: no model."""

from __future__ import annotations

import pytest
import torch

from shared.runtime.kv_pool import OutOfPages, PagedKV, SlotPages, root_key

PS = 4
ROOT = root_key("m", "tenant:a")


def pool(pages: int = 8) -> PagedKV:
    return PagedKV(
        layers=1,
        kv_heads=1,
        head_dim=1,
        num_pages=pages,
        page_size=PS,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def fill(p: PagedKV, slot: SlotPages, tokens: list[int]) -> None:
    """As a forward would: reserve, write each token's id as its key, commit."""
    start = slot.length
    p.writable(slot, start)
    p.reserve(slot, start + len(tokens))
    for pos, t in zip(p.flat_rows(slot, start, start + len(tokens)), tokens, strict=True):
        p.keys[0][pos] = float(t)
    p.commit(slot, start, tokens)


def read(p: PagedKV, slot: SlotPages) -> list[int]:
    return [int(p.keys[0][r].item()) for r in p.flat_rows(slot, 0, slot.length)]


TEXT = list(range(10, 23))  # 13 tokens: 3 full pages and one token


def test_a_published_prefix_is_claimed_in_whole_pages_and_read_as_written() -> None:
    p = pool()
    a = SlotPages()
    fill(p, a, TEXT)
    p.publish(a, ROOT)
    assert p.pages_cached == 3 and len(a.keys) == 3  # the partial 4th page is not published
    b = SlotPages()
    # at most 12 tokens (a prefill keeps its last token to compute): all three pages
    assert p.claim(b, TEXT, ROOT, limit=len(TEXT) - 1) == 12
    assert b.pages == a.pages[:3] and b.tokens == TEXT[:12] and read(p, b) == TEXT[:12]
    assert [p.refs[x] for x in b.pages] == [2, 2, 2]
    c = SlotPages()  # a text that differs in its second page: only the first is shared
    other = [*TEXT[:4], 99, *TEXT[5:]]
    assert p.claim(c, other, ROOT, limit=12) == 4 and c.pages == a.pages[:1]
    d = SlotPages()  # another namespace shares nothing
    assert p.claim(d, TEXT, root_key("m", "tenant:b"), limit=12) == 0 and not d.pages


def test_a_shared_page_is_copied_before_a_write_and_rollback_never_touches_it() -> None:
    p = pool()
    a = SlotPages()
    fill(p, a, TEXT[:8])
    p.publish(a, ROOT)
    b = SlotPages()
    assert p.claim(b, TEXT[:8], ROOT, limit=8) == 8
    p.crop(b, 6)  # b rolls back into the second shared page...
    assert p.refs[a.pages[1]] == 2  # ...which it still holds (positions 4, 5)
    fill(p, b, [77, 78])  # and writes positions 6, 7: into a private copy
    assert b.pages[1] != a.pages[1] and p.copies == 1
    assert read(p, a) == TEXT[:8]  # the shared page is as a wrote it
    assert read(p, b) == [*TEXT[:6], 77, 78]
    assert p.refs[a.pages[1]] == 1 and len(b.keys) == 1  # b's chain ends before its copy
    p.release(b)
    assert p.refs[a.pages[0]] == 1  # b let go of the shared first page; a still holds it


def test_idle_cached_pages_are_evicted_least_recently_used_only_when_needed() -> None:
    p = pool(pages=4)
    a = SlotPages()
    fill(p, a, TEXT[:8])  # 2 pages
    p.publish(a, ROOT)
    p.release(a)
    assert p.pages_used == 0 and p.pages_cached == 2 and p.pages_available == 4
    b = SlotPages()
    fill(p, b, [1, 2, 3, 4, 5, 6, 7])  # 2 free pages first: nothing evicted
    assert p.evictions == 0 and p.pages_cached == 2
    c = SlotPages()
    assert p.claim(c, TEXT[:8], ROOT, limit=7) == 4  # a hit makes the first page recent
    p.release(c)
    d = SlotPages()
    fill(p, d, [9])  # needs a page: the least recently used idle one (the second) goes
    assert p.evictions == 1 and p.pages_cached == 1
    e = SlotPages()
    assert p.claim(e, TEXT[:8], ROOT, limit=8) == 4  # the first page is still cached
    with pytest.raises(OutOfPages):
        fill(p, SlotPages(), list(range(8)))  # 2 pages wanted, none free or idle left
    assert p.refs[e.pages[0]] == 1  # a held cached page is never evicted


def test_the_same_prefix_computed_twice_stays_private_and_chains_go_on() -> None:
    p = pool()
    a, b = SlotPages(), SlotPages()
    fill(p, a, TEXT[:8])
    fill(p, b, TEXT[:8])  # computed again (no claim)
    p.publish(a, ROOT)
    p.publish(b, ROOT)
    assert p.pages_cached == 2 and b.keys == a.keys  # b's pages stay private
    fill(p, b, TEXT[8:12])
    p.publish(b, ROOT)  # b's third page chains on from the keys it computed
    c = SlotPages()
    assert p.claim(c, TEXT, ROOT, limit=12) == 12
    assert c.pages == [*a.pages[:2], b.pages[2]]
    third = b.pages[2]
    p.release(b)  # b's private copies of the first two pages go back; c holds its third
    assert p.refs[third] == 1 and p.pages_used == 3 and p.pages_cached == 3


def test_common_prefix() -> None:
    from shared.runtime.kv_pool import common_prefix

    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3  # one extends the other
    assert common_prefix((1, 2, 3), [1, 9, 3]) == 1  # a tuple against a list
    assert common_prefix([], [1]) == 0 and common_prefix([5], [6]) == 0
