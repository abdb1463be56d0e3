"""PrefixCache: chained page hashes, shared physical pages, LRU eviction, collision safety, hit accounting."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from executor.page_allocator import OutOfPagesError, PageAllocator
from executor.prefix_cache import ROOT_HASH, PrefixCache, page_hash

PAGE = 4


def _cache(num_pages: int = 17, **kwargs) -> tuple[PageAllocator, PrefixCache]:
    allocator = PageAllocator(num_pages)
    return allocator, PrefixCache(allocator, PAGE, **kwargs)


def _prefill(allocator: PageAllocator, cache: PrefixCache, ids: list[int]) -> list[int]:
    """What a request does: match, allocate the rest, 'write' the KV, insert its full pages."""
    pages = cache.match(ids, len(ids) - 1)
    pages += allocator.allocate(-(-len(ids) // PAGE) - len(pages))
    cache.insert(ids, pages)
    return pages


def _release(allocator: PageAllocator, pages: list[int]) -> None:
    for page in reversed(pages):
        allocator.release(page)


def test_page_hash_is_stable_blake2b_chained_over_parent():
    tokens = (1, 2, 3, 4)
    expected = hashlib.blake2b(ROOT_HASH + struct.pack("<4q", *tokens), digest_size=16).digest()
    assert page_hash(ROOT_HASH, tokens) == expected
    assert page_hash(expected, tokens) != expected  # the same ids under another parent differ


def test_page_hash_does_not_depend_on_pythonhashseed():
    code = "from executor.prefix_cache import page_hash, ROOT_HASH; print(page_hash(ROOT_HASH, (7, 8, 9, 10)).hex())"
    outputs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                                cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        outputs.add(result.stdout.strip())
    assert outputs == {page_hash(ROOT_HASH, (7, 8, 9, 10)).hex()}


def test_match_shares_physical_pages_and_refcounts_return_to_zero():
    allocator, cache = _cache()
    ids = list(range(100, 114))  # 3 full pages + 2 tokens
    first = _prefill(allocator, cache, ids)
    assert cache.num_cached_pages == 3  # the partial last page is not cached
    second = _prefill(allocator, cache, ids + [7, 7])
    assert second[:3] == first[:3] and second[3] != first[3]
    assert [allocator.refcount(p) for p in first[:3]] == [2, 2, 2]
    _release(allocator, first)
    _release(allocator, second)
    assert allocator.num_used == 0
    assert all(allocator.refcount(p) == 0 for p in first + second)
    assert allocator.num_free + allocator.num_cached == allocator.capacity
    cache.check()
    allocator.check()
    cached = allocator.num_cached
    assert cached == 4 and cache.clear() == cached  # second filled a 4th page
    assert allocator.num_free == allocator.capacity and cache.num_cached_pages == 0


def test_lookup_stops_at_the_first_different_page_and_at_max_tokens():
    allocator, cache = _cache()
    ids = list(range(12))
    pages = _prefill(allocator, cache, ids)
    assert cache.lookup(ids) == pages
    assert cache.lookup(ids, max_tokens=11) == pages[:2]  # keep one token to compute
    assert cache.lookup(ids[:4] + [99] + ids[5:]) == pages[:1]
    assert cache.lookup(ids[:7]) == pages[:1]  # a partial page never matches
    assert cache.lookup([0, 1, 2]) == []
    # The same ids at another position (another parent) are another page.
    assert cache.lookup(ids[4:8] + ids[4:8]) == []


def test_hit_accounting_in_tokens():
    allocator, cache = _cache()
    ids = list(range(9))
    _prefill(allocator, cache, ids)  # queries 9, hits 0
    _prefill(allocator, cache, ids)  # queries 9, hits 8 (max_tokens 8: 2 pages)
    assert (cache.hits, cache.queries) == (8, 18)
    assert cache.hit_rate == pytest.approx(8 / 18)
    cache.lookup(ids)  # pure: counts nothing
    assert (cache.hits, cache.queries) == (8, 18)


def test_unreferenced_pages_stay_cached_until_allocate_needs_them_lru_first():
    allocator, cache = _cache(num_pages=9)  # 8 usable pages
    a = _prefill(allocator, cache, list(range(0, 8)))  # 2 pages
    b = _prefill(allocator, cache, list(range(100, 108)))
    c = _prefill(allocator, cache, list(range(200, 208)))
    _release(allocator, b)
    _release(allocator, a)
    _release(allocator, c)
    # Tail first within a request, requests in release order.
    assert cache.evictable_pages() == [b[1], b[0], a[1], a[0], c[1], c[0]]
    assert allocator.num_free == 2 and allocator.num_available == 8
    fresh = allocator.allocate(3)  # 2 free pages, then evicts b's last page
    assert cache.evictable_pages() == [b[0], a[1], a[0], c[1], c[0]]
    assert b[1] in fresh and cache.evictions == 1
    # A hit on a cached page makes it referenced: it leaves the LRU.
    assert cache.match(list(range(200, 208)), 8) == c
    assert cache.evictable_pages() == [b[0], a[1], a[0]]
    more = allocator.allocate(3)
    assert set(more) == {b[0], a[1], a[0]}
    with pytest.raises(OutOfPagesError):
        allocator.allocate(1)  # c's pages are referenced: never evicted
    assert cache.lookup(list(range(200, 208))) == c
    assert cache.lookup(list(range(0, 8))) == []
    cache.check()
    allocator.check()


def test_an_evicted_parent_makes_its_children_unreachable():
    allocator, cache = _cache(num_pages=5)  # 4 usable pages
    ids = list(range(8))
    pages = _prefill(allocator, cache, ids)
    for page in pages:  # head first (the wrong order on purpose): the first page is evicted first
        allocator.release(page)
    assert cache.evictable_pages() == pages
    taken = allocator.allocate(allocator.num_free + 1)
    assert pages[0] in taken and not cache.is_cached(pages[0]) and cache.is_cached(pages[1])
    assert cache.lookup(ids) == []  # the second page is still cached but cannot be reached
    allocator.release_all(taken)
    # The same ids cached again on new pages: the orphan never answers for the new parent.
    again = _prefill(allocator, cache, ids)
    assert cache.lookup(ids) == again
    if again[1] != pages[1]:
        assert cache.is_cached(pages[1])  # the orphan waits for its LRU turn
    cache.check()
    allocator.check()


@pytest.mark.parametrize("weak_hash", [lambda parent, tokens: b"same", lambda parent, tokens: bytes([len(tokens)])])
def test_hash_collisions_never_match_different_ids(weak_hash):
    allocator, cache = _cache(hash_fn=weak_hash)
    first = _prefill(allocator, cache, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    second = _prefill(allocator, cache, [1, 2, 3, 9, 5, 6, 7, 8, 0])  # every key collides
    assert set(first).isdisjoint(second)
    third = _prefill(allocator, cache, [5, 6, 7, 8, 1, 2, 3, 4, 0])  # pages of first, swapped
    assert set(third).isdisjoint(first) and set(third).isdisjoint(second)
    # Same ids still share, pages keyed by a colliding hash included.
    again = cache.lookup([1, 2, 3, 9, 5, 6, 7, 8, 0])
    assert again == second[:2]
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8]) == first[:2]
    cache.check()


def test_duplicate_content_on_another_page_is_not_registered_and_is_freed():
    allocator, cache = _cache()
    ids = list(range(8))
    # Two requests prefilled at once: neither matched the other.
    a = allocator.allocate(2)
    b = allocator.allocate(2)
    cache.insert(ids, a)
    cache.insert(ids, b)
    assert cache.num_cached_pages == 2 and not cache.is_cached(b[0]) and not cache.is_cached(b[1])
    _release(allocator, b)
    assert allocator.is_free(b[0]) and allocator.is_free(b[1])
    assert cache.lookup(ids) == a
    _release(allocator, a)
    assert allocator.num_cached == 2
    cache.check()


def test_insert_is_incremental_with_the_returned_chain():
    allocator, cache = _cache()
    ids = list(range(16))
    pages = allocator.allocate(4)
    chain = cache.insert(ids[:5], pages[:2])
    assert chain.num_pages == 1
    chain = cache.insert(ids[:13], pages, chain)
    assert chain.num_pages == 3
    assert cache.lookup(ids) == pages[:3]
    chain = cache.insert(ids, pages, chain)
    assert cache.lookup(ids) == pages


def test_insert_reads_only_the_first_num_tokens():
    """The scheduler passes a request's whole token list and its cached count: the same pages are
    registered as for the list cut to that count, and none past it."""
    allocator, cache = _cache()
    ids = list(range(16))
    pages = allocator.allocate(4)
    chain = cache.insert(ids, pages, num_tokens=9)
    assert chain.num_pages == 2 and cache.lookup(ids) == pages[:2]
    chain = cache.insert(ids, pages, chain, num_tokens=16)
    assert chain.num_pages == 4 and cache.lookup(ids) == pages


def test_insert_refuses_pages_the_caller_does_not_hold():
    allocator, cache = _cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [1])
