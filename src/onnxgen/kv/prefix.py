"""The prefix index: which pages hold the KV of which token prefixes, shared by every request and session.

A trie of pages, one tree per identity digest (the digest covers the package, every non-token input and
the tenant salt, so different identities never share a page):

    root[digest]
     ├─ (t0..t15) page 4 ─ (t16..t31) page 9 ─ (t32..t36) page 2      <- a partial page: always a leaf
     │                                   └──── (t32..t47) page 7
     └─ (u0..u15) page 5

Each node holds the tokens of one page (`page_size` of them, fewer only in a leaf) and the page id.
Indexed pages are immutable: a request that matches a page only partly (its tokens diverge inside the
page, or the node is a partial leaf) copies the matching positions into a page of its own (copy on write,
done by `kv/manager.py`) and never writes into the indexed one.

`match` finds the longest indexed prefix of a token sequence (up to a limit), `insert` adds a finished
request's pages (the index takes one reference on each page it keeps), `pin`/`unpin` protect a node and
so its whole path (a session pins the end of its last context), and `evict` frees least recently used
leaves that nothing else holds. The index never allocates: pages come from the caller.

Recency: a lookup or an insertion stamps the deepest node it reaches (and a partly matched leaf); a node
whose last child is removed inherits the child's stamp if it is newer. Only leaves are evicted, so a node's
recency matters only once it is a leaf, and by then it carries the newest stamp of its former subtree:
eviction order is least recently used, without walking a long path on every lookup.

An `Anchor` (a full-page node and its path's pages) lets a caller whose tokens are known to start with that
path (a session's next turn starts with its last context) look up and insert from there: a turn of a long
conversation then costs its new pages, not its whole context.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from onnxgen.kv.pages import PageAllocator
from onnxgen.kv.tiers import page_key

# called with the (key, page) of the full pages an eviction drops, before their pages are freed
OnEvict = Callable[[list[bytes], list[int]], None]


class Node:
    """One page of an indexed prefix. `tokens` has `page_size` ids except in a partial leaf."""

    __slots__ = ("children", "digest", "key", "page", "parent", "pins", "stamp", "tokens")

    def __init__(self, digest: bytes, page: int, tokens: tuple[int, ...], parent: Node | None) -> None:
        self.digest = digest
        self.page = page  # -1 for a root
        self.tokens = tokens
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.pins = 0
        self.stamp = 0
        self.key: bytes | None = None  # the path's key (`PrefixIndex.key`), computed when first asked

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def depth_tokens(self) -> int:
        """Tokens from the root to the end of this node."""
        n, node = 0, self
        while node.parent is not None:
            n += len(node.tokens)
            node = node.parent
        return n


@dataclass(frozen=True)
class Anchor:
    """A node whose tokens fill its page (or a root), and the pages of its path from the root in order (its
    own page last): where `match` and `insert` may start for tokens that begin with the path's tokens."""

    node: Node
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Match:
    """The result of `PrefixIndex.match`: `pages` are shared as they are (full pages); the first
    `partial_len` positions of `partial_page` match too (a request copies them into a page of its own).
    `node` is the deepest fully matched node (None when no full page matched)."""

    pages: tuple[int, ...]
    partial_page: int | None
    partial_len: int
    node: Node | None
    page_size: int

    @property
    def length(self) -> int:
        """Matched tokens: the full pages plus the partial positions."""
        return len(self.pages) * self.page_size + self.partial_len


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixIndex:
    """Radix index over (identity digest, tokens) at page granularity. Not thread-safe: the engine's
    step owns it."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self._roots: dict[bytes, Node] = {}
        self._leaves: set[Node] = set()
        self._clock = itertools.count(1)
        self.num_nodes = 0

    # --- lookup ------------------------------------------------------------------------------------

    def match(
        self,
        digest: bytes | None,
        tokens: Sequence[int],
        limit: int | None = None,
        start: Anchor | None = None,
    ) -> Match:
        """The longest indexed prefix of `tokens[:limit]` under `digest` (None: undigestable, matches
        nothing). Marks the matched end as recently used. Changes no reference counts. `start`: an anchor
        under `digest` whose path `tokens` are known to begin with (the caller checked); the walk begins
        there (ignored when the limit ends before it)."""
        P = self.page_size
        end = len(tokens) if limit is None else max(0, min(limit, len(tokens)))
        root = self._roots.get(digest) if digest is not None else None
        if root is None or end == 0:
            return Match((), None, 0, None, P)
        stamp = next(self._clock)
        full = end // P
        node, pages, deepest = root, [], None
        if start is not None and 0 < len(start.pages) <= full:
            assert start.node.digest == digest and len(start.node.tokens) == P, "an anchor of another path"
            node = deepest = start.node
            pages = list(start.pages)
        i = len(pages)
        it = iter(tokens[i * P : full * P])
        for chunk in zip(*[it] * P, strict=False):  # the full pages' token tuples, built in one pass
            child = node.children.get(chunk)
            if child is None:
                break
            pages.append(child.page)
            node = deepest = child
        node.stamp = stamp
        i = len(pages)
        chunk = tuple(tokens[i * P : min((i + 1) * P, end)])
        partial_page, partial_len = None, 0
        if chunk:  # the first page that is not wholly indexed: the longest partial match among the children
            best = None, 0
            for cand in node.children.values():
                k = _lcp(cand.tokens, chunk)
                if k > best[1]:
                    best = cand, k
            if best[0] is not None:
                best[0].stamp = stamp
                partial_page, partial_len = best[0].page, best[1]
        return Match(tuple(pages), partial_page, partial_len, deepest, P)

    # --- insertion ---------------------------------------------------------------------------------

    def insert(self, digest: bytes, tokens: Sequence[int], pages: Sequence[int]) -> Node:
        """Index `tokens` whose KV is in `pages` (page i holds positions [i*P, (i+1)*P)). Pages already
        indexed for the same tokens are kept and the caller's duplicates are not taken; every page the
        index does take gets one reference. A partial last page is indexed as a leaf unless an indexed
        page already starts with its tokens. Returns the node at the end of the path (to pin), or the
        digest's root when `tokens` is empty."""
        return self.insert_path(digest, tokens, pages)[0]

    def insert_path(
        self, digest: bytes, tokens: Sequence[int], pages: Sequence[int], start: Anchor | None = None
    ) -> tuple[Node, Anchor]:
        """`insert`, beginning at `start` (an anchor under `digest` whose path `tokens` begin with, and
        whose pages `pages` begin with: the request matched them), and also returning the anchor of the
        path's last full page covered by `tokens` (where the next lookup of a longer context may start)."""
        P = self.page_size
        need = -(-len(tokens) // P)
        assert len(pages) >= need, f"{len(tokens)} tokens need {need} pages, got {len(pages)}"
        stamp = next(self._clock)
        full = len(tokens) // P
        if start is not None and len(start.pages) <= full and start.node.parent is not None:
            assert start.node.digest == digest, "an anchor of another identity"
            node, path = start.node, list(start.pages)
        else:
            node = self._roots.get(digest)
            if node is None:
                node = self._roots[digest] = Node(digest, -1, (), None)
            path = []
        i0 = len(path)
        last_full = node  # the last node walked whose page is full (or the start)
        chunks = itertools.chain(
            zip(*[iter(tokens[i0 * P : full * P])] * P, strict=False),
            [tuple(tokens[full * P :])] if need > full else [],
        )
        for i, chunk in enumerate(chunks, i0):
            child = node.children.get(chunk)
            if child is None and len(chunk) < P:
                child = next((c for c in node.children.values() if c.tokens[: len(chunk)] == chunk), None)
            if child is None:
                child = Node(digest, pages[i], chunk, node)
                child.stamp = stamp
                self.allocator.incref([pages[i]])
                node.children[chunk] = child
                self._leaves.discard(node)
                self._leaves.add(child)
                self.num_nodes += 1
            if len(chunk) == P and len(node.children) > 1:
                self._drop_superseded(node, chunk)
            node = child
            if len(chunk) == P:
                path.append(child.page)
                last_full = child
        node.stamp = stamp
        return node, Anchor(last_full, tuple(path))

    # --- pins and eviction -------------------------------------------------------------------------

    def pin(self, node: Node) -> None:
        """Protect `node` and (since only leaves are evicted) its whole path from eviction."""
        node.pins += 1

    def unpin(self, node: Node) -> None:
        """Drop one pin. A partial leaf that a longer page of the same tokens has superseded meanwhile (a
        session's last page, completed by its next turn) goes at once when nothing else holds it
        (`_drop_superseded`)."""
        assert node.pins > 0, "unpin of a node that is not pinned"
        node.pins -= 1
        parent = node.parent
        if node.pins == 0 and parent is not None and len(node.tokens) < self.page_size:
            longer = next(
                (
                    k
                    for k in parent.children
                    if len(k) > len(node.tokens) and k[: len(node.tokens)] == node.tokens
                ),
                None,
            )
            if longer is not None:  # indexed positions that hold the same tokens and more
                self._drop_superseded(parent, longer)

    def _evictable(self, node: Node) -> bool:
        return (
            not node.children and not node.is_root and node.pins == 0 and self.allocator.refs(node.page) == 1
        )

    def evict(self, n: int, on_evict: OnEvict | None = None) -> int:
        """Free up to `n` pages by dropping least recently used leaves that only the index holds (no pin,
        no running request). A parent left without children becomes a candidate in turn. Returns the
        number of pages freed. `on_evict(keys, pages)`: told the full pages dropped (their keys, `key`),
        before any of them can be handed out again (the host tier copies them out)."""
        if n <= 0:
            return 0
        heap = [(leaf.stamp, id(leaf), leaf) for leaf in self._leaves if self._evictable(leaf)]
        heapq.heapify(heap)
        gone: list[Node] = []
        while heap and len(gone) < n:
            _, _, leaf = heapq.heappop(heap)
            if not self._evictable(leaf):  # a stale entry
                continue
            parent = self._drop(leaf, gone, on_evict)
            if parent is not None and self._evictable(parent):
                heapq.heappush(heap, (parent.stamp, id(parent), parent))
        return self._free(gone, on_evict)

    def evict_path(self, node: Node, on_evict: OnEvict | None = None) -> int:
        """Drop `node` and then each ancestor in turn while it is a leaf only the index holds (a session's
        context leaving the device: what other paths or holders share stays). Returns the pages freed."""
        gone: list[Node] = []
        current: Node | None = node
        while current is not None and self._evictable(current):
            current = self._drop(current, gone, on_evict)
        return self._free(gone, on_evict)

    def _drop(self, leaf: Node, gone: list[Node], on_evict: OnEvict | None) -> Node | None:
        if on_evict is not None and len(leaf.tokens) == self.page_size:
            self.key(leaf)  # NOTE: while the path to the root is still there
        gone.append(leaf)
        return self._remove_leaf(leaf)

    def _free(self, gone: list[Node], on_evict: OnEvict | None) -> int:
        if on_evict is not None:
            full = [g for g in gone if g.key is not None and len(g.tokens) == self.page_size]
            if full:
                on_evict([g.key for g in full], [g.page for g in full])  # type: ignore[misc]
        return len(self.allocator.decref([g.page for g in gone])) if gone else 0

    def key(self, node: Node) -> bytes:
        """The key of the path ending at `node`: its root's digest, then `kv.tiers.page_key` over each page's
        tokens in turn (the same tokens under the same identity give the same key in any index). Computed
        once per node."""
        todo = []
        while node.key is None and node.parent is not None:
            todo.append(node)
            node = node.parent
        key = node.key if node.key is not None else node.digest
        for n in reversed(todo):
            key = n.key = page_key(key, n.tokens)
        return key

    def clear(self) -> int:
        """Drop every unpinned path the index alone holds (as `evict` would, all of them). Returns pages freed."""
        return self.evict(self.num_nodes)

    def _drop_superseded(self, parent: Node, chunk: tuple[int, ...]) -> None:
        """Drop partial leaves under `parent` whose tokens start `chunk` (a full page just indexed holds the
        same positions and more: a session's last page before its next turn), when only the index holds them."""
        for key, leaf in list(parent.children.items()):
            if len(key) < len(chunk) and chunk[: len(key)] == key and self._evictable(leaf):
                self._remove_leaf(leaf)
                self.allocator.decref([leaf.page])

    def _remove_leaf(self, leaf: Node) -> Node | None:
        parent = leaf.parent
        assert parent is not None and not leaf.children
        del parent.children[leaf.tokens]
        parent.stamp = max(parent.stamp, leaf.stamp)  # a node's recency: the newest of its former subtree
        self._leaves.discard(leaf)
        self.num_nodes -= 1
        leaf.parent = None
        if parent.is_root:
            if not parent.children:
                del self._roots[parent.digest]
            return None
        if not parent.children:
            self._leaves.add(parent)
        return parent

    # --- inspection --------------------------------------------------------------------------------

    def pages(self) -> set[int]:
        """Every page the index holds."""
        out: set[int] = set()
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if not node.is_root:
                out.add(node.page)
            stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        """Structure and reference counts agree (tests call this): every non-root node holds a page with
        at least one reference, is keyed by its tokens under its parent, has `page_size` tokens unless it
        is a leaf, and the leaf set is exactly the childless non-root nodes."""
        P = self.page_size
        count = 0
        leaves: set[Node] = set()
        for digest, root in self._roots.items():
            assert root.is_root and root.digest == digest and root.children, "empty or foreign root"
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                count += 1
                assert node.parent is not None and node.parent.children.get(node.tokens) is node
                assert node.digest == digest and 0 < len(node.tokens) <= P
                assert len(node.tokens) == P or not node.children, "a partial page with children"
                assert self.allocator.refs(node.page) >= 1, f"indexed page {node.page} is free"
                if not node.children:
                    leaves.add(node)
                stack.extend(node.children.values())
        assert count == self.num_nodes, (count, self.num_nodes)
        assert leaves == self._leaves, "leaf set out of date"
