"""Where sessions pushed out of memory go: host RAM, then disk; and how they come back.

    registry over max_sessions / max_kv_bytes ── Session.spill ──> Spill.put(state) ──(spill thread)──>
        persist.export(drop=True): the KV copied to host arrays and freed under the engine's lock, then
        host tier (`host_bytes`, least recently spilled first out) ──overflow──> disk tier (`kv_dir`: session
        files, `disk_bytes`) ──overflow──> dropped (the session recomputes)
    the session's next request (its caller's thread) ── Session._unspill ──> Spill.take(item): attached from
        the host arrays (`persist.attach`) or from its file (`persist.load`, checked first)

A paged pool has a host tier of its own (`kv/tiers.py`: pages, not sessions): there a session pushed out is
handed to `PagedKV.offload` (unpinned, its pages copied out ahead of their eviction, found again by its next
request's prefix lookup) unless a disk tier is given, and the session-level host tier here serves the decoder
per request executors (ort, the native decoder), whose copies out of the device are plain ones under the engine's
lock. `CacheConfig.host_kv_bytes` bounds either (none unless set; on the CPU the pool already is host memory
and the next tier is the disk). Files are this process's (named by a random id, deleted when their
session resumes, clears or closes, or the model closes). No tier ever holds more than its bound. A context that
cannot be written or restored costs the speedup only (logged; the session recomputes).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxgen.engine import persist

log = logging.getLogger(__name__)


@dataclass
class Spilled:
    """One session's context out of the device: its tokens and salt, and where it is now (`layers`: host
    arrays in the host tier; `path`: a session file in the disk tier; neither: dropped)."""

    tokens: tuple[int, ...]
    salt: str | None
    name: str
    key: int
    ready: threading.Event = field(default_factory=threading.Event)
    layers: Any = None
    path: Path | None = None
    nbytes: int = 0


class Spill:
    """The host and disk tiers of an engine's sessions (either may be off: `host_bytes` 0, `folder` None).
    Thread-safe; one daemon thread moves contexts down the tiers (started at the first spill)."""

    def __init__(self, engine: Any, folder: str | Path | None, disk_bytes: int, host_bytes: int) -> None:
        self.engine = engine
        self.folder = Path(folder) if folder is not None else None
        self.disk_bytes = disk_bytes
        self.host_bytes = host_bytes
        self._host: OrderedDict[int, Spilled] = OrderedDict()  # least recently spilled first
        self._disk: OrderedDict[int, Spilled] = OrderedDict()
        self._lock = threading.Lock()
        self._placed = threading.Condition(self._lock)  # notified as each handed-over state is placed
        self._keys = itertools.count()
        self._queue: queue.Queue[tuple[Any, Spilled]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pending: set[int] = set()
        self.spills = self.unspills = self.dropped = 0
        # a paged pool's own host tier takes sessions pushed out, when there is no disk tier
        self.pages = getattr(engine.executor, "tier", None) is not None and self.folder is None

    def put(self, state: Any, salt: str | None, name: str, now: bool = False) -> Spilled | None:
        """Hand `state` over (exported, then freed, on the spill thread); returns the handle it resumes by. With
        a paged pool's host tier: offloaded there at once (`now`: its device pages freed now, not when the pool
        needs them) and None (its next request finds the pages by its prefix)."""
        if self.pages:
            with self.engine.kv_lock:
                self.engine.executor.offload(state, now)
            with self._lock:
                self.spills += 1
            return None
        item = Spilled(tuple(state.identity.tokens), salt, name, next(self._keys))
        with self._lock:
            self._pending.add(item.key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="onnxgen-spill", daemon=True)
                self._thread.start()
        self._queue.put((state, item))
        return item

    def _run(self) -> None:
        while True:
            state, item = self._queue.get()
            try:
                item.layers = persist.export(self.engine, state, drop=True)
                item.nbytes = sum(k.nbytes + v.nbytes for k, v in item.layers)
                with self._lock:
                    self.spills += 1
                if self.host_bytes > 0:
                    self._to_host(item)
                else:
                    self._to_disk(item)
            except Exception:
                log.exception("could not spill session %s (it will recompute)", item.name)
                item.layers = None
            finally:
                with self._placed:
                    self._pending.discard(item.key)
                    self._placed.notify_all()
                item.ready.set()

    def _to_host(self, item: Spilled) -> None:
        with self._lock:
            self._host[item.key] = item
            out = []
            while sum(i.nbytes for i in self._host.values()) > self.host_bytes:
                old = self._host.popitem(last=False)[1]
                old.ready.clear()  # NOTE: in neither tier until written: a `take` waits for it
                out.append(old)
        for old in out:  # off the lock: a file write
            try:
                self._to_disk(old)
            finally:
                old.ready.set()

    def _to_disk(self, item: Spilled) -> None:
        layers, item.layers = item.layers, None
        if self.folder is None or layers is None:
            with self._lock:
                self.dropped += 1
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{uuid.uuid4().hex}.onnxgen"
        try:
            size = persist.write(self.engine, item.tokens, layers, path, item.salt, item.name, "")
        except Exception:
            log.exception("could not write session %s to %s (it will recompute)", item.name, path)
            path.unlink(missing_ok=True)
            with self._lock:
                self.dropped += 1
            return
        with self._lock:
            item.path, item.nbytes = path, size
            self._disk[item.key] = item
            gone = []
            while sum(i.nbytes for i in self._disk.values()) > self.disk_bytes:  # NOTE: the new file too
                gone.append(self._disk.popitem(last=False)[1])
                self.dropped += 1
        for old in gone:
            old.path.unlink(missing_ok=True)
            old.path = None

    def take(self, item: Spilled, timeout: float = 600.0) -> Any:
        """The retained state of `item` attached again (from host arrays, or its file: checked first), or None
        when it was dropped. Raises what `persist.load` raises (`SessionFileError` ...)."""
        item.ready.wait(timeout)
        with self._lock:
            host = self._host.pop(item.key, None)
            disk = self._disk.pop(item.key, None) if host is None else None
        try:
            if host is not None:
                state = persist.attach(self.engine, item.tokens, item.salt, host.layers)
            elif disk is not None and disk.path is not None:
                state = persist.load(self.engine, disk.path, item.salt)[1]
            else:
                return None
        finally:
            self._forget(item)
        with self._lock:
            self.unspills += 1
        return state

    def _forget(self, item: Spilled) -> None:
        item.layers = None
        if item.path is not None:
            item.path.unlink(missing_ok=True)
            item.path = None

    def discard(self, item: Spilled) -> None:
        """Let `item` go (its session cleared or closed); waits for it to be placed first."""
        item.ready.wait(600)
        with self._lock:
            self._host.pop(item.key, None)
            self._disk.pop(item.key, None)
        self._forget(item)

    def wait(self, timeout: float = 600.0) -> bool:
        """Wait until every state handed over so far is placed in a tier (or dropped); False on timeout."""
        with self._placed:
            return self._placed.wait_for(lambda: not self._pending, timeout)

    def close(self) -> None:
        """Free both tiers and delete every file (the model closes: no session resumes from them)."""
        self.wait()
        with self._lock:
            items = [*self._host.values(), *self._disk.values()]
            self._host.clear()
            self._disk.clear()
        for item in items:
            self._forget(item)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "host_sessions": len(self._host),
                "host_bytes": sum(i.nbytes for i in self._host.values()),
                "spilled_sessions": len(self._disk),
                "spilled_bytes": sum(i.nbytes for i in self._disk.values()),
                "spills": self.spills,
                "unspills": self.unspills,
                "spills_dropped": self.dropped,
            }
