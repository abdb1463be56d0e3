"""Automatic prefix caching of full KV pages (vLLM / SGLang style), pure Python.

A *full* page (``page_size`` tokens) is identified by a hash chained over the
token ids of every page before it::

    h_0 = ROOT
    h_i = blake2b(h_{i-1} || page i's token ids as little-endian int64)

so two requests whose first ``k`` pages hold the same ids find the same ``k``
hashes. The hash is only the dictionary key: every cached page also stores its
token ids and the identity of the entry it extends (its parent), and a lookup
accepts an entry only when both match. A matched chain therefore holds exactly
the query's ids, whatever the hash does (tests pass a hash that always
collides). Entries whose parent is later evicted become unreachable and go
the way of any unreferenced page: evicted in LRU order.

Design: the cache *attaches to* the ``PageAllocator`` as its evictor (one
allocator, one cache). The allocator owns the refcounts; the cache owns the
hash table and the LRU of unreferenced cached pages:

- ``match(ids)`` returns the physical pages of the longest cached full-page
  prefix and retains each (refcount + 1) for the caller; a cached page whose
  refcount was 0 leaves the LRU (it can no longer be evicted).
- ``insert(ids, pages)`` registers a request's full pages (after their KV was
  written). A page whose content is already cached under another physical page
  (two requests prefilled the same prompt at once) is not registered; it stays
  a private page and is freed normally.
- When a registered page's refcount drops to 0 it stays cached and joins the
  LRU tail; ``allocate`` evicts from the LRU head (least recently released
  first) only when the free list runs short. A page with refcount >= 1 is never
  evicted. Release a request's pages tail first (``reversed(page_ids)``) so a
  chain's last pages are evicted before its first ones.

Hit accounting in tokens: every ``match`` adds ``len(ids)`` to ``queries`` and
the matched tokens to ``hits``; ``hit_rate = hits / queries``.

Recurrent-state models (Qwen3.5) cannot resume from a KV prefix alone: the
scheduler resumes them only where a recurrent-state snapshot holds the state at
the prefix's end (executor/state_snapshots.py).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from executor.page_allocator import PageAllocator

ROOT_HASH = b"\x00" * 16

HashFn = Callable[[bytes, tuple[int, ...]], bytes]


def page_hash(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """Stable 128-bit chained hash of one full page (blake2b; not Python's randomized ``hash``)."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.digest()


@dataclass(eq=False)
class _Entry:
    uid: int  # unique per registration (never reused): children name their parent by it
    page: int
    key: bytes
    tokens: tuple[int, ...]
    parent_uid: int  # 0 for the first page of a sequence


@dataclass
class CacheChain:
    """Progress of ``insert`` along one request (so each page is hashed once).

    ``num_pages`` pages were inserted; ``key``/``parent_uid`` describe the last one.
    """

    num_pages: int = 0
    key: bytes = ROOT_HASH
    parent_uid: int = 0


class PrefixCache:
    """Hash table of full KV pages plus the LRU of unreferenced ones; the allocator's evictor."""

    def __init__(self, allocator: PageAllocator, page_size: int, *, hash_fn: HashFn = page_hash):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._hash = hash_fn
        self._buckets: dict[bytes, list[_Entry]] = {}
        self._by_page: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, LRU first
        self._next_uid = 1
        self.hits = 0
        self.queries = 0
        self.evictions = 0
        allocator.set_evictor(self)

    # ------------------------------------------------------------------ counts
    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def num_cached_pages(self) -> int:
        """Registered pages (referenced or not)."""
        return len(self._by_page)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    def is_cached(self, page: int) -> bool:
        return page in self._by_page

    def entry_uid(self, page: int) -> int:
        """The uid of the entry that registered ``page``: it names the page's whole chain of token ids
        (executor/state_snapshots.py keys the recurrent-state snapshots by it)."""
        return self._by_page[page].uid

    def evictable_pages(self) -> list[int]:
        """Unreferenced cached pages in eviction order (least recently released first)."""
        return list(self._lru)

    # ------------------------------------------------------------------ lookup
    def lookup(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Pages of the longest cached full-page prefix of ``token_ids[:max_tokens]``.

        Pure: retains nothing, counts nothing, leaves the LRU alone.
        """
        limit = len(token_ids) if max_tokens is None else max(0, min(max_tokens, len(token_ids)))
        size = self.page_size
        pages: list[int] = []
        key, parent_uid = ROOT_HASH, 0
        for start in range(0, limit - size + 1, size):
            tokens = tuple(token_ids[start:start + size])
            key = self._hash(key, tokens)
            entry = self._find(key, tokens, parent_uid)
            if entry is None:
                break
            pages.append(entry.page)
            parent_uid = entry.uid
        return pages

    def match(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """``lookup`` and retain the pages for the caller; counts ``queries``/``hits`` in tokens.

        ``max_tokens`` caps the matched length (a request must still compute at
        least its last prompt token to get logits: pass ``len(ids) - 1``).
        """
        pages = self.lookup(token_ids, max_tokens)
        for page in pages:
            self.allocator.retain(page)
        self.queries += len(token_ids)
        self.hits += len(pages) * self.page_size
        return pages

    # ------------------------------------------------------------------ insert
    def insert(self, token_ids: Sequence[int], page_ids: Sequence[int], chain: CacheChain | None = None,
               num_tokens: int | None = None) -> CacheChain:
        """Register the full pages of ``token_ids[:num_tokens]`` (all of them by default) held in
        ``page_ids`` (their KV is written).

        Pages already registered (a matched prefix) are walked over; a page whose
        content is cached under another physical page is left unregistered. With
        ``chain`` (returned by the previous call for the same request) only the
        pages after ``chain.num_pages`` are hashed. Returns the updated chain.
        ``num_tokens`` spares the caller a copy of a long token list: only the new
        pages' tokens are read.
        """
        chain = CacheChain() if chain is None else chain
        size = self.page_size
        count = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
        full = min(count // size, len(page_ids))
        for index in range(chain.num_pages, full):
            tokens = tuple(token_ids[index * size:(index + 1) * size])
            key = self._hash(chain.key, tokens)
            page = page_ids[index]
            entry = self._find(key, tokens, chain.parent_uid)
            if entry is None:
                existing = self._by_page.get(page)
                if existing is not None:
                    # Registered under another chain: cannot happen for pages this request
                    # wrote or matched; keep the old entry and stop extending the chain.
                    break
                if self.allocator.refcount(page) < 1:
                    raise ValueError(f"insert: page {page} is not referenced by the caller")
                entry = _Entry(self._next_uid, page, key, tokens, chain.parent_uid)
                self._next_uid += 1
                self._buckets.setdefault(key, []).append(entry)
                self._by_page[page] = entry
            chain.num_pages = index + 1
            chain.key = key
            chain.parent_uid = entry.uid
        return chain

    # ------------------------------------------------------------------ evictor protocol
    def on_unreferenced(self, page: int) -> bool:
        if page not in self._by_page:
            return False
        self._lru[page] = None  # most recently released: evicted last
        return True

    def on_referenced(self, page: int) -> None:
        del self._lru[page]

    def evict(self, count: int) -> list[int]:
        """Forget the ``count`` least recently released unreferenced pages; return them."""
        pages = []
        while len(pages) < count and self._lru:
            page, _ = self._lru.popitem(last=False)
            self._forget(page)
            pages.append(page)
        self.evictions += len(pages)
        return pages

    def clear(self) -> int:
        """Drop every unreferenced cached page back to the free list; referenced pages stay registered."""
        pages = self.evict(len(self._lru))
        self.evictions -= len(pages)
        self.allocator.free_cached(pages)
        return len(pages)

    # ------------------------------------------------------------------ internals
    def _find(self, key: bytes, tokens: tuple[int, ...], parent_uid: int) -> _Entry | None:
        for entry in self._buckets.get(key, ()):
            if entry.parent_uid == parent_uid and entry.tokens == tokens:
                return entry
        return None

    def _forget(self, page: int) -> None:
        entry = self._by_page.pop(page)
        bucket = self._buckets[entry.key]
        bucket.remove(entry)
        if not bucket:
            del self._buckets[entry.key]

    def check(self) -> None:
        """Assert the cache's invariants against the allocator (tests)."""
        refcount, is_free = self.allocator.refcount, self.allocator.is_free
        for page in self._lru:
            assert page in self._by_page
        for page, entry in self._by_page.items():
            assert entry.page == page and not is_free(page)
            assert (refcount(page) == 0) == (page in self._lru)
        assert sum(len(b) for b in self._buckets.values()) == len(self._by_page)
        assert all(entry in self._buckets[entry.key] for entry in self._by_page.values())
