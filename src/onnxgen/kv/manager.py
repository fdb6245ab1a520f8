"""The KV manager: the only code that changes which pages a request holds.

It puts the page allocator (`kv/pages.py`), the prefix index (`kv/prefix.py`) and the page storage
(`kv/storage.py`) together behind four calls a scheduler makes for each request:

    table, cached = kv.open(digest, tokens)   # share the longest indexed prefix (capped at len - 1),
                                              # (from an `Anchor` the tokens start with, if given),
                                              # copy a partly matched page (copy on write); or, when
                                              # longer, the full pages a running request of the same
                                              # identity has computed for the same tokens (`InFlight`)
    kv.grow(table, total)                     # pages for positions [0, total); evicts LRU leaves when
                                              # short; False (nothing changed) when even that is not enough
    node = kv.commit(table, tokens)           # on success only: index the request's pages, drop its hold;
                                              # `table.anchor`: the committed path's, for the next turn
    kv.release(table)                         # on failure, cancellation or preemption: drop its hold;
                                              # nothing of the request becomes visible
    kv.trim(table, below)                     # sliding windows on every layer: give back the pages wholly
                                              # below `below` that only the request holds (HOLE entries)
    landing = kv.plan_restore(digest, tokens) # with a host tier (`kv/tiers.py`): the pages after the indexed
    kv.land(landing)                          # prefix that the tier holds, copied into new pages; once the
                                              # copy is done, indexed (then `open` shares them)

Pages the index evicts go to the host tier when there is one (full pages, under their path's key), so a later
request whose tokens continue an indexed prefix into them restores them instead of recomputing.

Pages a request shares from the index are never written: writes go to positions >= `cached`, which lie in
the request's own pages (allocated, or the copy of a partly matched page). A `PageTable` maps the
request's positions to slots: position p lives in page `pages[p // page_size]` at offset `p % page_size`.

Trimmed tables (a model whose every layer attends within a window: no step of the request reads a key below
its next position's window again) have holes: entries `HOLE` whose pages went back to the pool. Attention
never reads them (the kernels start at each query's window); nothing else may: a table's present prefix
(`PageTable.present`) is all that is ever shared with another request or indexed (`commit`), so no request
is ever given KV that is not there (docs/reuse.md). Pages the index or another request also holds are
never trimmed: they stay in the table, present.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from onnxgen.errors import OutOfPages
from onnxgen.kv.pages import PageAllocator
from onnxgen.kv.prefix import Anchor, Node, PrefixIndex
from onnxgen.kv.tiers import HostPages, page_key


class PageCopier(Protocol):
    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy positions [0, n) of page `src` into page `dst`, in every layer."""


HOLE = -1  # a page table entry whose page `KVManager.trim` gave back: never read, shared or indexed


@dataclass
class PageTable:
    """The pages one request holds, in position order, under its identity digest (None: undigestable,
    never matched or indexed). `anchor`: the deepest full indexed page its leading pages are (set by `open`
    when they came from the index, so `commit` walks only the rest; after `commit`, the committed path's).
    `trimmed`: the leading entries `KVManager.trim` has looked at; `first_hole`: the first `HOLE` entry (None:
    every page is present)."""

    digest: bytes | None
    pages: list[int] = field(default_factory=list)
    anchor: Anchor | None = None
    trimmed: int = 0
    first_hole: int | None = None

    def present(self) -> int:
        """How many leading pages are present (all of them, or those before the first hole)."""
        return len(self.pages) if self.first_hole is None else self.first_hole

    def slots(self, start: int, n: int, page_size: int) -> list[int]:
        """Slot ids (page * page_size + offset) of positions [start, start + n)."""
        pages = self.pages
        return [pages[p // page_size] * page_size + p % page_size for p in range(start, start + n)]


@dataclass
class KVCounters:
    """Running totals: prompt tokens looked up, tokens found cached (in the index or, `inflight_hits` of the
    lookups, in a running request's pages), copy-on-write page copies."""

    lookups: int = 0
    looked_up_tokens: int = 0
    hit_tokens: int = 0
    cow_copies: int = 0
    inflight_hits: int = 0
    restored_tokens: int = 0


class InFlight(NamedTuple):
    """A running request of the caller's identity: its tokens, how many leading positions its KV holds
    (written by steps that completed; never written again), and its pages."""

    tokens: Sequence[int]
    computed: int
    pages: Sequence[int]


def common_pages(a: Sequence[int], b: Sequence[int], most: int, page_size: int) -> int:
    """The largest k <= `most` with `a[:k * page_size] == b[:k * page_size]` (binary search over slices)."""
    lo, hi = 0, min(most, len(a) // page_size, len(b) // page_size)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * page_size] == b[: mid * page_size]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class Landing:
    """Pages on their way back from the host tier: `tokens` (whole pages) will be indexed under `digest` with
    `held` (the indexed prefix they continue, held so that it stays) followed by `pages` (new, copied into
    by the copy whose `event` is None once done)."""

    digest: bytes
    tokens: Sequence[int]
    held: list[int]
    pages: list[int]
    event: Any

    def ready(self) -> bool:
        """Whether the copy is done (never waits)."""
        if self.event is not None and self.event.query():
            self.event = None
        return self.event is None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class KVManager:
    """Pages for requests: open, grow, commit, release. Not thread-safe: the engine's step owns it."""

    def __init__(
        self, allocator: PageAllocator, index: PrefixIndex, storage: PageCopier, tier: HostPages | None = None
    ) -> None:
        """`tier`: where evicted pages go (None: they are dropped)."""
        assert index.allocator is allocator
        self.allocator = allocator
        self.index = index
        self.storage = storage
        self.tier = tier
        self.page_size = index.page_size
        self.counters = KVCounters()

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def open(
        self,
        digest: bytes | None,
        tokens: Sequence[int],
        inflight: Sequence[InFlight] = (),
        start: Anchor | None = None,
        whole: bool = False,
    ) -> tuple[PageTable, int]:
        """A page table for a request over `tokens` (`digest` None: a request that reuses nothing, not counted
        as a lookup), sharing the longest indexed prefix of at most
        `len(tokens) - 1` tokens (at least one token is always computed). Returns the table and how many
        leading positions it already holds. A partly matched page is copied into a new page when one can
        be had; otherwise the match stops at the last full page. `inflight`: running requests of the same
        identity; when one has computed more full pages of the same tokens than the index holds, those
        pages are shared instead (they are never written again: their holder writes past its computed
        positions, in pages of its own). `start`: an anchor of the index whose path `tokens` begin with (the
        caller checked; a session's last context): the lookup begins there. `whole`: all of `tokens` may be
        shared (a restored context: nothing of it is computed)."""
        most = len(tokens) if whole else len(tokens) - 1
        m = self.index.match(digest, tokens, most, start)
        shared = self._inflight_share(tokens, inflight, m.length) if digest is not None else None
        table = PageTable(digest, list(shared if shared is not None else m.pages))
        if shared is None and m.node is not None:
            table.anchor = Anchor(m.node, m.pages)
        self.allocator.incref(table.pages)
        cached = len(table.pages) * self.page_size
        if shared is not None:
            self.counters.inflight_hits += 1
        elif m.partial_page is not None and m.partial_len > 0:
            try:
                (page,) = self._alloc(1)
            except OutOfPages:
                page = None
            if page is not None:
                self.storage.copy_prefix(m.partial_page, page, m.partial_len)
                table.pages.append(page)
                cached += m.partial_len
                self.counters.cow_copies += 1
        if digest is not None:  # a request that reuses nothing (no identity) looks nothing up
            self.counters.lookups += 1
            self.counters.looked_up_tokens += len(tokens)
            self.counters.hit_tokens += cached
        return table, cached

    def _inflight_share(
        self, tokens: Sequence[int], inflight: Sequence[InFlight], have: int
    ) -> Sequence[int] | None:
        """The leading full pages of the running request that computed the most of `tokens` (at most
        `len(tokens) - 1` positions), when that beats the `have` positions the index supplies; else None."""
        P = self.page_size
        most = (len(tokens) - 1) // P
        best: Sequence[int] | None = None
        floor = have  # positions the best source so far supplies
        for other, computed, pages in inflight:
            k = min(most, computed // P, len(pages))
            if k * P <= floor:
                continue
            k = common_pages(tokens, other, k, P)
            if k * P > floor:
                best, floor = pages[:k], k * P
        return best

    def grow(self, table: PageTable, total: int) -> bool:
        """Make `table` cover positions [0, total), evicting unpinned LRU prefixes when pages are short.
        Returns False, with the table unchanged, when the pool cannot supply the pages."""
        need = self.pages_for(total) - len(table.pages)
        if need <= 0:
            return True
        try:
            table.pages.extend(self._alloc(need))
        except OutOfPages:
            return False
        return True

    def commit(self, table: PageTable, tokens: Sequence[int]) -> Node | None:
        """After a successful request: index `tokens` (the positions whose KV the table holds, in order)
        and drop the request's hold on its pages. Returns the end of the indexed path (for a session's
        pin), or None when nothing was indexed (undigestable identity or no tokens)."""
        node = None
        k = table.present()
        if k < len(table.pages):  # trimmed: only the pages before the first hole (whole pages) can be indexed
            tokens = tokens[: k * self.page_size]
        if table.digest is not None and tokens:
            node, table.anchor = self.index.insert_path(table.digest, tokens, table.pages, table.anchor)
        self.release(table)
        return node

    def release(self, table: PageTable) -> None:
        """Drop the request's hold on its pages (failure, cancellation, preemption, or after commit)."""
        pages = table.pages if table.first_hole is None else [p for p in table.pages if p != HOLE]
        self.allocator.decref(pages)
        table.pages = []
        table.trimmed, table.first_hole = 0, None

    def trim(self, table: PageTable, below: int) -> int:
        """Give back the pages of `table` that lie wholly below position `below` (no step of the request reads
        them again: every layer attends within a window, and its next query's window starts at `below`) and
        that only this request holds; their entries become `HOLE`. Pages the index or another request also
        holds stay (present). Each entry is looked at once. Returns the number of pages freed."""
        end = min(max(below, 0) // self.page_size, len(table.pages))
        if end <= table.trimmed:
            return 0
        pages, refs = table.pages, self.allocator.refs
        solo = [i for i in range(table.trimmed, end) if refs(pages[i]) == 1]
        table.trimmed = end
        if not solo:
            return 0
        freed = self.allocator.decref([pages[i] for i in solo])
        for i in solo:
            pages[i] = HOLE
        if table.first_hole is None:
            table.first_hole = solo[0]
        return len(freed)

    def _alloc(self, n: int) -> list[int]:
        short = n - self.allocator.num_free
        if short > 0:
            self.index.evict(short, self.tier.save if self.tier is not None else None)
        return self.allocator.alloc(n)

    # --- the host tier -------------------------------------------------------------------------------

    def plan_restore(
        self, digest: bytes, tokens: Sequence[int], most: int | None = None, start: Anchor | None = None
    ) -> Landing | None:
        """When the tier holds full pages of `tokens[:most]` (default: all but the last token) right after
        the prefix the index holds: new pages for them (evicting others if need be), their KV copied in, and
        the `Landing` to pass to `land` once `ready`. None when there is nothing to restore or no room."""
        tier, P = self.tier, self.page_size
        if tier is None or not len(tier):
            return None
        most = len(tokens) - 1 if most is None else most
        m = self.index.match(digest, tokens, most, start)
        key = self.index.key(m.node) if m.node is not None else digest
        i0, keys = len(m.pages), []
        for i in range(i0, most // P):
            key = page_key(key, tokens[i * P : (i + 1) * P])
            if key not in tier:
                break
            keys.append(key)
        if not keys or tier.find(keys) == 0:
            return None
        held = list(m.pages)
        self.allocator.incref(held)  # NOTE: the prefix the pages continue stays indexed while they land
        pages: list[int] = []
        try:
            pages = self._alloc(len(keys))
        except OutOfPages:  # as many as there is room for (`_alloc` evicted what it could)
            pages = self.allocator.alloc(min(self.allocator.num_free, len(keys)))
        n = tier.find(keys[: len(pages)])  # evictions while allocating may have pushed some keys out
        self.allocator.decref(pages[n:])
        if n == 0:
            self.allocator.decref(held)
            return None
        pages = pages[:n]
        event = tier.load(keys[:n], pages)
        self.counters.restored_tokens += n * P
        return Landing(digest, tokens[: (i0 + n) * P], held, pages, event)

    def land(self, landing: Landing) -> None:
        """Index a landing's pages (waiting for its copy first if it is not done) and drop its holds."""
        landing.wait()
        pages = landing.held + landing.pages
        self.index.insert_path(landing.digest, landing.tokens, pages)
        self.allocator.decref(pages)
