"""Paged KV shared across requests and sessions: the scheduler's KV adapter over `kv.KVManager` and a
batched runner (`backends.batch.BatchRunner`).

A request's pages come from the prefix index when it is admitted (the longest indexed prefix of its
tokens under its identity digest, capped at len - 1; a partly matched page is copied) and from the pool
as it grows. Each step runs every scheduled chunk in one ragged batch. On success the request's pages
join the index (`finish`), so any later request with the same identity and prefix shares them: another
turn of the same session, or another session under the same system prompt. A failed, cancelled or
preempted request only releases its pages: nothing of it is ever indexed (docs/reuse.md, invariant 3).

A session keeps `Pinned(node, identity, anchor)`: a pin on the end of its last context's path in the
index, so the pages of that context stay while the session does; the next turn matches them exactly as a
retained decoder would, and when its tokens start with that context (a conversation growing), the lookup
and the indexing start at the context's last full page: a turn costs its new tokens, not its context.

LongRoPE (`BatchRunner.rope_switch`): keys computed with the short rotary factors differ from the same
tokens' keys with the long ones, so the regime is part of the identity the pages are indexed and shared
under (`_digest`): a request whose tokens exceed the switch when admitted computes (or finds) long keys from
position 0, as a fresh run of all its tokens would; one admitted below it holds short keys valid up to the
switch (`Request.kv_limit`), and the scheduler recomputes it when it grows past (`Scheduler._recompute`).

The host tier (`kv/tiers.py`, `CacheConfig.host_kv_bytes`): pages the index evicts are copied to host memory
under their path's key, and a waiting request whose tokens continue its indexed prefix into pages the tier
holds gets them copied back before it is admitted (`defer`: the copy runs while the other requests step; the
request waits for it alone, and waits on the host only when nothing else runs). A session pushed out of the
registry (`offload`) unpins its context and has its pages copied out ahead of their eviction.

Sliding windows: where every layer of the model attends within a window (the runner's `kv_window`, e.g.
Mistral; not Gemma, whose global layers read the whole context), a request that no session keeps gives back
the pages that fell out of the window as it runs (`KVManager.trim`, before each step it is scheduled in), so a
long generation holds about a window of KV. Its context is then indexed only up to its first hole (the
pages still there; usually only what it shared from the index), and running requests share only present
pages: no request is ever given KV that is gone. A session's requests keep every page: their context is
what the session retains and reuses.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from onnxgen.backends.batch import BatchRunner, BatchStep, SeqChunk
from onnxgen.engine.identity import Identity
from onnxgen.engine.request import Request
from onnxgen.engine.scheduler import Chunk
from onnxgen.errors import DeviceOutOfMemory
from onnxgen.kv.manager import InFlight, KVManager, Landing, PageTable, common_pages
from onnxgen.kv.pages import PageAllocator
from onnxgen.kv.prefix import Anchor, Node, PrefixIndex
from onnxgen.kv.staging import DeviceStaging
from onnxgen.kv.storage import PageStorage
from onnxgen.kv.tiers import HostPages
from onnxgen.sampling.choice import RowChooser


def _regime(digest: bytes, long: bool) -> bytes:
    """The digest pages of a LongRoPE package are indexed under: the identity's, or for the long regime its
    own (keys computed with the long factors are never shared with short-regime requests)."""
    return hashlib.blake2b(digest + b"|longrope", digest_size=16).digest() if long else digest


@dataclass(frozen=True)
class Pinned:
    """A session's hold on the pages of its last context: the pinned end of its path, what it holds, and the
    anchor of the path's last full page (`kv.prefix.Anchor`)."""

    node: Node
    identity: Identity
    anchor: Anchor | None = None


@dataclass
class _Run:
    """A launched run of decode steps: the runner's handle and the choice it continues with."""

    inner: Any
    choose: Any


class PagedKV:
    """The scheduler's KV adapter and the step's executor over a paged pool and a batched runner."""

    paged = True

    def __init__(
        self, runner: BatchRunner, host_bytes: int = 0, on_close: Callable[[], None] | None = None
    ) -> None:
        """`host_bytes`: the host tier's bound (0: evicted pages are dropped). `on_close`: called last by `close`
        (a tensor-parallel runner's workers stop there)."""
        self.runner = runner
        self._on_close = on_close
        self.page_size = runner.page_size
        allocator = PageAllocator(runner.num_pages)
        self.index = PrefixIndex(allocator, runner.page_size)
        self.tier = HostPages(runner.storage, host_bytes) if host_bytes > 0 else None
        self.kv = KVManager(allocator, self.index, runner.storage, self.tier)
        self._landing: dict[int, Landing] = {}  # waiting requests' pages on their way back, by id(request)
        self._admitted = 0  # requests holding pages now
        self.bytes_per_page = runner.storage.nbytes() // runner.num_pages
        self.pinned_sessions = 0
        self._running: dict[bytes, list[Request]] = {}  # admitted requests that may share, by identity digest
        self.rope_switch: int | None = getattr(runner, "rope_switch", None)
        # the window every layer attends within (0: some layer reads the whole context): pages below a
        # request's next position's window are never read again
        self.window = int(getattr(runner, "kv_window", 0) or 0)
        self.trimmed_pages = 0
        storage = runner.storage
        # a session file on a CUDA pool is read straight to the device (`kv/staging.py`; its pinned ring is
        # host memory, kept while the executor is); the tensor-parallel runner's storage spans several devices
        # and is fed from host memory
        on_cuda = type(storage) is PageStorage and storage.device.type == "cuda"
        self.file_sink: DeviceStaging | None = DeviceStaging(storage.device) if on_cuda else None

    @property
    def verify_sizes(self) -> tuple[int, ...]:
        """The runner's (`BatchRunner.verify_sizes`, asked each time: a failed capture turns graphs off),
        what a new request's draft lengths are raised to fill."""
        return tuple(self.runner.verify_sizes)

    @property
    def capacity_tokens(self) -> int:
        return self.runner.num_pages * self.page_size

    # --- the scheduler's calls ---------------------------------------------------------------------

    def _digest(self, req: Request) -> bytes | None:
        """The digest `req`'s pages are indexed and shared under: its identity's, and with LongRoPE its rotary
        regime's too (long: its tokens exceeded the switch when admitted, or will when it is; `kv_limit` None)."""
        switch = self.rope_switch
        if req.digest is None or switch is None:
            return req.digest
        return _regime(req.digest, req.num_tokens > switch if req.kv is None else req.kv_limit is None)

    def admit(self, req: Request) -> bool:
        # LongRoPE: a request admitted at most as long as the switch computes short keys, valid up to it
        switch = self.rope_switch
        req.kv_limit = switch if switch is not None and req.num_tokens <= switch else None
        digest = self._digest(req) if req.reuse else None
        peers = self._running.get(digest, ()) if digest is not None else ()
        inflight = [
            InFlight(
                r.prompt if r.computed <= len(r.prompt) else r.tokens,
                r.computed,
                r.kv.pages[: r.kv.present()],
            )
            for r in peers
        ]
        table, cached = self.kv.open(digest, req.tokens, inflight, self._anchor(req, digest))
        req.kv = table
        req.computed = cached
        self._admitted += 1
        if digest is not None:
            self._running.setdefault(digest, []).append(req)
        return True

    def _anchor(self, req: Request, digest: bytes | None) -> Anchor | None:
        """The anchor of the context the request's session holds, when the request's tokens start with that
        context's full pages (compared here: the index walks on from the anchor without looking back)."""
        held = req.held
        if not isinstance(held, Pinned) or held.anchor is None or digest != held.identity.digest:
            return None
        n = len(held.anchor.pages) * self.page_size
        tokens = req.prompt
        if n == 0 or len(tokens) <= n or tuple(tokens[:n]) != held.identity.tokens[:n]:
            return None
        return held.anchor

    def defer(self, req: Request) -> bool:
        """Whether `req` should wait rather than be admitted now: a running request of its identity is still
        prefilling, and has yet to compute at least a page of the prefix the two share beyond what it has
        computed (32 agents arriving under one system prompt: the first computes it, the others then share
        its pages, `admit`). The running request moves on every step, so the wait ends."""
        if not req.reuse or req.digest is None:
            return False
        if self.tier is not None and self._landing_wait(req):
            return True
        tokens, P = req.tokens, self.page_size
        most = (len(tokens) - 1) // P
        for r in self._running.get(self._digest(req), ()):
            if r.pending <= 1 or r.computed // P >= most:  # decoding, or already past what req can share
                continue
            if r.kv.first_hole is not None:  # trimmed: its leading pages are gone, nothing to wait for
                continue
            if common_pages(tokens, r.prompt, most, P) > r.computed // P:
                return True
        return False

    def _landing_wait(self, req: Request) -> bool:
        """Start copying back the pages of `req`'s tokens the host tier holds, and whether `req` must wait for
        that copy (it waits alone: other requests step meanwhile; with none running, the wait is here)."""
        landing = self._landing.get(id(req))
        if landing is None:
            digest = self._digest(req)
            assert digest is not None
            landing = self.kv.plan_restore(digest, req.tokens, start=self._anchor(req, digest))
            if landing is None:
                return False
            self._landing[id(req)] = landing
        if not landing.ready() and self._admitted > 0:
            return True
        del self._landing[id(req)]
        self.kv.land(landing)
        return False

    def _forget(self, req: Request) -> None:
        digest = self._digest(req)
        peers = self._running.get(digest) if digest is not None else None
        if peers is not None and req in peers:
            peers.remove(req)
            if not peers:
                del self._running[digest]

    def reserve(self, req: Request, total: int) -> bool:
        if self.window and req.owner is None:  # positions below the next query's window: never read again
            self.trimmed_pages += self.kv.trim(req.kv, req.computed - self.window + 1)
        if total <= len(req.kv.pages) * self.page_size:  # NOTE: most decode steps need no new page
            return True
        return self.kv.grow(req.kv, total)

    def release(self, req: Request) -> None:
        self._forget(req)
        landing = self._landing.pop(id(req), None)
        if landing is not None:  # its pages are indexed all the same
            self.kv.land(landing)
        if req.kv is not None:
            self.kv.release(req.kv)
            req.kv = None
            self._admitted -= 1

    # --- the engine's calls ------------------------------------------------------------------------

    def run(self, chunks: Sequence[Chunk]) -> list[Any]:
        """All chunks in one batch. Per chunk: its last position's logits (a row of one `[R, vocab]`
        tensor) when it samples (with drafts: the `[1 + drafts, vocab]` rows of every fed position), else
        None. A failure of the batch raises (every request in it fails)."""
        step = BatchStep(
            tuple(
                SeqChunk(
                    [*c.req.token_slice(c.start, c.n), *c.draft],
                    c.start,
                    c.req.kv.pages,
                    (1 + len(c.draft)) if c.sample else 0,
                    c.req.num_tokens,  # a prompt's chunk is computed for the whole prompt (LongRoPE)
                )
                for c in chunks
            )
        )
        rows = self.runner.run(step)
        out: list[Any] = []
        i = 0
        for c in chunks:
            if c.draft:  # every fed position's logits, to verify the drafts
                out.append(rows[i : i + 1 + len(c.draft)])
                i += 1 + len(c.draft)
            elif c.sample:
                out.append(rows[i])
                i += 1
            else:
                out.append(None)
        return out

    def launch_decodes(self, chunks: Sequence[Chunk], k: int, offset: int = 0, after: Any = None) -> Any:
        """Enqueue `k` decode steps of `chunks` (each a plain decode with pages for `offset + k` positions past
        its start) back to back on the runner, the tokens chosen on the device by each request's sampling
        settings exactly as `sampling.choose_rows` would at those steps. `after` (with `offset` = the steps
        it and the runs before it fed): a launched run of the same chunks whose tokens are not read yet;
        this run continues from its last tokens. Returns a handle for `collect_decodes`."""
        if after is None:
            step = BatchStep(
                tuple(SeqChunk(c.req.token_slice(c.start, 1), c.start, c.req.kv.pages, 1) for c in chunks)
            )
            choose = self._chooser(chunks)
        else:  # the ids come from `after`'s last tokens on the device; the choice continues its offsets
            step = BatchStep(tuple(SeqChunk([0], c.start + offset, c.req.kv.pages, 1) for c in chunks))
            choose = after.choose
        return _Run(
            self.runner.launch_decodes(step, k, choose, offset, after.inner if after else None), choose
        )

    def choose_first(self, chunks: Sequence[Chunk], rows: Sequence[Any]) -> Any:
        """The next token of each sampled chunk (no processors) chosen on the device from its logits row
        (`run`'s), as `sampling.sample_rows` chooses it, and not read: a handle that `launch_decodes` continues
        from (`after`, with `offset` 1 and the chunks as decodes of their last prompt position: the choice
        was that position's step) and `chosen` reads."""
        import torch

        choose = self._chooser(chunks)
        toks = choose(torch.stack([r.reshape(-1).float() for r in rows]), 0)
        return _Run(self.runner.stage_tokens(toks.view(1, -1)), choose)

    def _chooser(self, chunks: Sequence[Chunk]) -> RowChooser:
        """The device choice of `chunks`' rows by each request's sampling settings, from its next step on."""
        samplers = [c.req.sampler for c in chunks]
        return RowChooser(
            [s.params for s in samplers],
            [s.seed for s in samplers],
            [s.step for s in samplers],
            self.runner.device,
        )

    def chosen(self, first: Any) -> list[int]:
        """The tokens of a `choose_first` handle: waits for the step that chose them, not for the runs
        launched after it."""
        return self.runner.collect_decodes(first.inner)[-1]

    def decode_parts(self, run: Any) -> tuple[int, ...]:
        """`BatchRunner.decode_parts` of a launched run."""
        return self.runner.decode_parts(run.inner)

    def collect_decodes(self, run: Any, rows: int | None = None) -> list[list[int]]:
        """The first `rows` (default: all) of a launched run's `[k][B]` tokens (`BatchRunner.collect_decodes`)."""
        return self.runner.collect_decodes(run.inner, rows)

    def discard(self, req: Request, keep: int) -> None:
        """Rejected drafts: nothing to undo. Their keys sit in the request's own pages past position
        `keep`, where attention never reads (each sequence reads up to its length) and the next step
        writes first; the pages stay the request's until it finishes (`commit` indexes `fed` only)."""

    def finish(self, req: Request) -> Pinned | None:
        """After success: index the request's pages (its fed tokens) and drop its hold; return the pin a
        session keeps, or None."""
        self._forget(req)
        digest = self._digest(req)
        table: PageTable = req.kv
        req.kv = None
        self._admitted -= 1
        if not req.reuse or digest is None:
            self.kv.release(table)
            return None
        fed = req.fed
        node = self.kv.commit(table, fed)
        if node is None or req.owner is None:
            return None
        self.index.pin(node)
        self.pinned_sessions += 1
        return Pinned(node, Identity(tuple(fed), digest), table.anchor)

    def drop(self, state: Pinned | None) -> None:
        """A session lets go of its context: unpin it (its pages stay indexed until evicted)."""
        if state is not None:
            self.index.unpin(state.node)
            self.pinned_sessions -= 1

    def offload(self, state: Pinned, now: bool = False) -> None:
        """A session's context leaves the device: unpinned, its full pages copied to the host tier (ahead of
        their eviction, on the copy stream), and with `now` the pages only the index holds freed at once, the
        copies waited for (the context is in host memory when this returns)."""
        nodes, node = [], state.node
        while node.parent is not None:
            if len(node.tokens) == self.page_size:
                nodes.append(node)
            node = node.parent
        self.drop(state)
        if self.tier is None:
            return
        self.tier.backup([self.index.key(n) for n in reversed(nodes)], [n.page for n in reversed(nodes)])
        if now:
            self.index.evict_path(state.node, self.tier.save)
            self.tier.settle()

    def state_bytes(self, state: Pinned | None) -> int:
        """The bytes of the pages a pinned context spans (shared pages counted in full)."""
        if state is None:
            return 0
        return -(-len(state.identity.tokens) // self.page_size) * self.bytes_per_page

    def export(self, state: Pinned) -> list[tuple[Any, Any]]:
        """Host copies of a pinned context's KV, per layer `(k, v)` `[kv_heads, n, head_size]`, read from the
        pages of its indexed path, for a session file."""
        import torch

        from onnxgen.kv.storage import host_copy

        pages, node = [], state.node
        while node.parent is not None:
            pages.append(node.page)
            node = node.parent
        n = len(state.identity.tokens)
        assert state.node.depth_tokens() == n, "a pinned path covers its context"
        storage = self.runner.storage
        table = torch.tensor(pages[::-1], dtype=torch.int64, device=storage.device)
        out = []
        for layer in range(storage.num_layers):
            k, v = storage.gather(layer, table, n)
            out.append((host_copy(k), host_copy(v)))
        return out

    def restore(self, identity: Identity, layers: Sequence[tuple[Any, Any]]) -> Pinned:
        """Index `layers` (the KV of `identity.tokens`, as `export` gives) in the pool under the identity (and
        its LongRoPE regime) and pin them for a session; pages the index already holds for a prefix of
        them are shared, not written. Raises `DeviceOutOfMemory` when the pool cannot hold them."""
        import torch

        from onnxgen.kv.storage import from_host

        assert identity.digest is not None
        tokens, n, switch = identity.tokens, len(identity.tokens), self.rope_switch
        digest = _regime(identity.digest, n > switch) if switch is not None else identity.digest
        table, cached = self.kv.open(digest, tokens, whole=True)
        if not self.kv.grow(table, n):
            self.kv.release(table)
            raise DeviceOutOfMemory(
                f"the KV pool cannot hold a restored context of {n} tokens: load the model with a larger "
                f"kv_bytes, or end other sessions"
            )
        storage, ps = self.runner.storage, self.page_size
        if cached < n:
            pos = torch.arange(cached, n)
            pages = torch.tensor(table.pages, dtype=torch.int64)
            slots = (pages[pos // ps] * ps + pos % ps).to(storage.device)
            like = storage.data
            for layer, (k, v) in enumerate(layers):
                hk = from_host(k[:, cached:n], like).transpose(0, 1)
                hv = from_host(v[:, cached:n], like).transpose(0, 1)
                storage.write(layer, slots, hk, hv)
        node = self.kv.commit(table, tokens)
        assert node is not None
        self.index.pin(node)
        self.pinned_sessions += 1
        return Pinned(node, Identity(tuple(tokens), digest), table.anchor)

    def stats(self) -> dict[str, int]:
        """Pool occupancy (pages in all, free, used, held by the index, shared by more than one holder),
        pinned sessions, prefix-cache lookups and hits, pages given back as they fell out of every layer's
        window, and whether decode steps replay CUDA graphs."""
        alloc = self.kv.allocator
        c = self.kv.counters
        return {
            "pages_total": alloc.num_pages,
            "pages_free": alloc.num_free,
            "pages_used": alloc.num_used,
            "pages_indexed": self.index.num_nodes,
            "pages_shared": alloc.num_shared,
            "page_size": self.page_size,
            "pinned_sessions": self.pinned_sessions,
            "prefix_lookups": c.lookups,
            "prefix_lookup_tokens": c.looked_up_tokens,
            "prefix_hit_tokens": c.hit_tokens,
            "prefix_inflight_hits": c.inflight_hits,
            "pages_trimmed": self.trimmed_pages,
            "prefix_restored_tokens": c.restored_tokens,
            "cuda_graphs": bool(getattr(self.runner, "cuda_graphs", False)),
        } | (self.tier.stats() if self.tier is not None else {})

    def close(self) -> None:
        """Drop every unpinned indexed page (the sessions' pins are dropped first by the engine) and the host
        tier's pages, then call `on_close`."""
        for landing in self._landing.values():
            landing.wait()
        self.index.clear()
        if self.tier is not None:
            self.tier.clear()
        if self._on_close is not None:
            self._on_close()
