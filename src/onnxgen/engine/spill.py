"""The disk tier: sessions pushed out of memory keep their KV in session files, and resume from them.

    registry over max_sessions / max_kv_bytes ── Session.spill ──> Spill.put(state) ──(spill thread)──>
        Engine.save_state(state, drop=True): exported and freed under the engine's lock, written outside it
    the session's next request (its caller's thread) ── Session._unspill ──> Spill.ready(path) ──>
        Engine.load_state(path, salt): checked, attached (paged: pages the index still holds are shared)

Without a spill tier (`CacheConfig.kv_dir` None) a session pushed out drops its KV and recomputes it. Files are
this process's (named by a random id, deleted when their session resumes, closes or the model closes) and
bounded together by `kv_dir_bytes`: the least recently spilled go first, and their sessions recompute. A file
that cannot be written or restored costs the speedup only (logged; the session recomputes).
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Spill:
    """Session files of spilled sessions under `folder`, at most `max_bytes` together. Thread-safe; one
    daemon thread writes them (started at the first spill)."""

    def __init__(self, engine: Any, folder: str | Path, max_bytes: int) -> None:
        self.engine = engine
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self._files: OrderedDict[Path, int] = OrderedDict()  # written, least recently spilled first
        self._pending: dict[Path, threading.Event] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[Any, Path, str | None, str]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.spills = self.unspills = self.dropped = 0

    def put(self, state: Any, salt: str | None, name: str) -> Path:
        """Hand `state` over (it is exported, then freed, on the spill thread) and return its file's path."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{uuid.uuid4().hex}.onnxgen"
        with self._lock:
            self._pending[path] = threading.Event()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="onnxgen-spill", daemon=True)
                self._thread.start()
        self._queue.put((state, path, salt, name))
        return path

    def _run(self) -> None:
        while True:
            state, path, salt, name = self._queue.get()
            try:
                size = self.engine.save_state(state, path, salt, name, drop=True)
            except Exception:
                log.exception("could not spill a session to %s (it will recompute)", path)
                path.unlink(missing_ok=True)
                size = None
            with self._lock:
                if size is not None:
                    self._files[path] = size
                    self.spills += 1
                    while sum(self._files.values()) > self.max_bytes:  # NOTE: the new file too, if need be
                        old, _ = self._files.popitem(last=False)
                        old.unlink(missing_ok=True)
                        self.dropped += 1
                self._pending.pop(path).set()

    def ready(self, path: Path, timeout: float = 600.0) -> bool:
        """Wait for `path` to be written; whether it is there (False: it failed, or was dropped for the bound)."""
        with self._lock:
            event = self._pending.get(path)
        if event is not None:
            event.wait(timeout)
        with self._lock:
            return path in self._files

    def restored(self, path: Path) -> None:
        with self._lock:
            self.unspills += 1
        self.discard(path)

    def discard(self, path: Path) -> None:
        """Delete `path` (its session resumed, cleared or closed); waits for its write first."""
        self.ready(path)
        with self._lock:
            self._files.pop(path, None)
        path.unlink(missing_ok=True)

    def wait(self, timeout: float = 600.0) -> None:
        """Wait until every state handed over so far is written (or failed)."""
        with self._lock:
            events = list(self._pending.values())
        for e in events:
            e.wait(timeout)

    def close(self) -> None:
        """Delete every file (the model closes: no session resumes from them)."""
        self.wait()
        with self._lock:
            paths, self._files = list(self._files), OrderedDict()
        for p in paths:
            p.unlink(missing_ok=True)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "spilled_sessions": len(self._files),
                "spilled_bytes": sum(self._files.values()),
                "spills": self.spills,
                "unspills": self.unspills,
                "spills_dropped": self.dropped,
            }
