"""Page bookkeeping of the paged KV pool: which pages are free, and how many holders each page has.

A page holds the keys and values of `page_size` consecutive positions of one sequence, in every layer
(the tensors are `kv/storage.py`'s). This module only counts: it never touches device memory, so it is
tested with exact page ids and no torch.

    alloc(3)      -> [0, 1, 2]          refs 1 1 1      free: 3 4 5 ...
    incref([1])                         refs 1 2 1      (a second holder: the prefix index, or a request
                                                         that matched the page)
    decref([0,1]) -> [0]                refs 0 1 1      page 0 is free again (returned: freed ids)

Holders are the prefix index (one reference per indexed page) and running requests (one reference per
page in their page table). A page with one holder that is the index is what eviction can free.

Free pages are handed out lowest id first (deterministic ids for tests and for debugging); freed pages go
back to the free set at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from onnxgen.errors import OutOfPages


class PageAllocator:
    """Free set and reference counts of `num_pages` pages.

    Contract: `alloc(n)` returns `n` distinct free pages, each with one reference, or raises `OutOfPages`
    and changes nothing. `incref` adds a holder to pages in use; `decref` removes one and returns the
    pages that became free. Referencing a free page, or dropping a reference nobody holds, is a bug
    (AssertionError).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        self._free = list(range(num_pages))  # a heap: lowest id first
        self._free_count = num_pages
        self.num_shared = 0  # pages with more than one holder

    @property
    def num_free(self) -> int:
        return self._free_count

    @property
    def num_used(self) -> int:
        return self.num_pages - self._free_count

    def refs(self, page: int) -> int:
        return self._refs[page]

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"alloc({n})")
        if n > self._free_count:
            raise OutOfPages(f"{n} pages wanted, {self._free_count} free")
        out = [heapq.heappop(self._free) for _ in range(n)]
        for p in out:
            assert self._refs[p] == 0, f"page {p} was free with {self._refs[p]} references"
            self._refs[p] = 1
        self._free_count -= n
        return out

    def incref(self, pages: Iterable[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"incref of free page {p}"
            self._refs[p] += 1
            if self._refs[p] == 2:
                self.num_shared += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        freed = []
        for p in pages:
            assert self._refs[p] > 0, f"decref of free page {p}"
            self._refs[p] -= 1
            if self._refs[p] == 1:
                self.num_shared -= 1
            elif self._refs[p] == 0:
                heapq.heappush(self._free, p)
                freed.append(p)
        self._free_count += len(freed)
        return freed

    def check_integrity(self) -> None:
        """Every page is free xor referenced; the free set has no duplicates (tests call this)."""
        free = set(self._free)
        assert len(free) == len(self._free) == self._free_count, "duplicate or miscounted free pages"
        assert self.num_shared == sum(1 for r in self._refs if r > 1), "miscounted shared pages"
        for p, r in enumerate(self._refs):
            assert r >= 0
            assert (r == 0) == (p in free), f"page {p}: refs {r}, free {p in free}"
