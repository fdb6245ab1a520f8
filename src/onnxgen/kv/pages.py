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
from collections.abc import Sequence

import numpy as np

from onnxgen.errors import OutOfPages

_BULK = 32  # calls over more pages than this count in one vectorised pass (a long context's table)


class PageAllocator:
    """Free set and reference counts of `num_pages` pages.

    Contract: `alloc(n)` returns `n` distinct free pages, each with one reference, or raises `OutOfPages`
    and changes nothing. `incref` adds a holder to pages in use; `decref` removes one and returns the
    pages that became free. Referencing a free page, or dropping a reference nobody holds, is a bug
    (AssertionError). The pages of one `incref`/`decref` call are distinct (a page table's). A call over
    many pages (a long context's table: every turn of a conversation opens and releases one) counts them
    in one numpy pass, so it costs microseconds, not one Python step a page.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._refs = np.zeros(num_pages, dtype=np.int32)
        self._free = list(range(num_pages))  # a heap: lowest id first
        self._free_count = num_pages

    @property
    def num_free(self) -> int:
        return self._free_count

    @property
    def num_used(self) -> int:
        return self.num_pages - self._free_count

    @property
    def num_shared(self) -> int:
        """Pages with more than one holder."""
        return int(np.count_nonzero(self._refs > 1))

    def refs(self, page: int) -> int:
        return int(self._refs[page])

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"alloc({n})")
        if n > self._free_count:
            raise OutOfPages(f"{n} pages wanted, {self._free_count} free")
        out = [heapq.heappop(self._free) for _ in range(n)]
        refs = self._refs
        assert not refs[out].any(), f"a free page had references: {[p for p in out if refs[p]]}"
        refs[out] = 1
        self._free_count -= n
        return out

    def incref(self, pages: Sequence[int]) -> None:
        refs = self._refs
        if len(pages) > _BULK:
            idx = np.asarray(pages, dtype=np.int64)
            assert refs[idx].min() > 0, f"incref of a free page: {[int(p) for p in idx if refs[p] == 0]}"
            refs[idx] += 1  # NOTE: a call's pages are distinct (a table's, one page per position range)
            return
        for p in pages:
            assert refs[p] > 0, f"incref of free page {p}"
            refs[p] += 1

    def decref(self, pages: Sequence[int]) -> list[int]:
        refs = self._refs
        if len(pages) > _BULK:
            idx = np.asarray(pages, dtype=np.int64)
            after = refs[idx] - 1
            assert after.min() >= 0, f"decref of a free page: {[int(p) for p in idx[after < 0]]}"
            refs[idx] = after
            freed = idx[after == 0].tolist()
        else:
            freed = []
            for p in pages:
                assert refs[p] > 0, f"decref of free page {p}"
                refs[p] -= 1
                if refs[p] == 0:
                    freed.append(p)
        for p in freed:
            heapq.heappush(self._free, p)
        self._free_count += len(freed)
        return freed

    def check_integrity(self) -> None:
        """Every page is free xor referenced; the free set has no duplicates (tests call this)."""
        free = set(self._free)
        assert len(free) == len(self._free) == self._free_count, "duplicate or miscounted free pages"
        for p, r in enumerate(self._refs.tolist()):
            assert r >= 0
            assert (r == 0) == (p in free), f"page {p}: refs {r}, free {p in free}"
