"""Session files for an engine: what its retained states become on disk, and back (`kv/files.py`'s format).

    save(engine, state, path, salt, name)   -> bytes written      (Engine.save_state: Session.save)
    load(engine, path, salt)                -> (header, state)    (Engine.load_state: restore_session, spills)
    export(engine, state) / attach(engine, tokens, salt, layers)  (the host tier, `engine/spill.py`)

A file is bound to the package (`package.fingerprint`), the backend and the salt; `read` checks all of it
against the engine before any KV is attached (`kv.files.read_session`), so a file of another package, backend
or tenant is a `SessionFileError` and the session simply starts empty. Contexts that depend on extra graph
inputs (their identity digests the inputs, which a file does not keep) are not saved.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from onnxgen.engine.loop import on_passing_thread
from onnxgen.errors import InvalidRequest
from onnxgen.kv.files import Expected, KVShape, SessionHeader, read_session, salt_tag, write_session
from onnxgen.package.attachments import has_keys
from onnxgen.package.fingerprint import package_fingerprint

T = TypeVar("T")


@dataclass
class FileCounters:
    """Session files an engine wrote and restored: how many, their bytes, and the seconds restores took
    (reading and checking the file; attaching the KV is `Engine.load_state`'s). Thread-safe."""

    saved: int = 0
    saved_bytes: int = 0
    restored: int = 0
    restored_bytes: int = 0
    restore_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "session_files_saved": self.saved,
                "session_files_saved_bytes": self.saved_bytes,
                "session_files_restored": self.restored,
                "session_files_restored_bytes": self.restored_bytes,
                "session_files_restore_s": self.restore_s,
            }


def _shape(engine: Any) -> KVShape:
    spec = engine.spec
    return KVShape(
        package_fingerprint(spec),
        engine.backend,
        spec.kv_dtype,
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_size,
    )


def write(
    engine: Any,
    tokens: tuple[int, ...],
    layers: Any,
    path: str | Path,
    salt: str | None,
    name: str,
    note: str,
) -> int:
    """Write `layers` (the KV of `tokens`, as the executor exports it) as a session file; returns its size."""
    if engine.spec.extra_inputs:
        names = ", ".join(i.name for i in engine.spec.extra_inputs)
        raise InvalidRequest(
            f"contexts that depend on extra graph inputs ({names}) cannot be saved", field="path"
        )
    if has_keys(tokens):  # an image's keys name it by a serial of this process only
        raise InvalidRequest("contexts that hold images cannot be saved", field="path")
    header = SessionHeader(_shape(engine), tokens=tuple(tokens), salt=salt_tag(salt), name=name, note=note)
    size = write_session(path, header, layers)
    c = engine.file_counters
    with c._lock:
        c.saved += 1
        c.saved_bytes += size
    return size


def read(engine: Any, path: str | Path, salt: str | None) -> tuple[SessionHeader, Any]:
    """A session file's header and KV, checked against `engine` and `salt` (raises `SessionFileError`)."""
    spec = engine.spec
    expect = Expected(_shape(engine), spec.vocab_size, spec.context_length, salt_tag(salt))
    t0 = time.perf_counter()
    header, layers = read_session(path, expect, getattr(engine.executor, "file_sink", None))
    c = engine.file_counters
    with c._lock:
        c.restored += 1
        c.restored_bytes += Path(path).stat().st_size
        c.restore_s += time.perf_counter() - t0
    return header, layers


def _kv_work(engine: Any, fn: Callable[[], T]) -> T:
    """`fn()` (torch work on the KV, called with the engine's lock held by this thread), on the CPU on a thread
    that ends with it while this one waits holding the lock: a caller's thread that ran torch's parallel work
    would keep an OpenMP pool beside the loop thread's, and every later step would pay for the
    oversubscription (`engine/loop.py`)."""
    return on_passing_thread(fn, "onnxgen-kv") if engine.device == "cpu" else fn()


def export(engine: Any, state: Any, drop: bool = False) -> list[tuple[Any, Any]]:
    """Host copies of `state`'s KV, taken under the engine's lock (`drop`: the state is freed then too)."""

    def run() -> list[tuple[Any, Any]]:
        try:
            return engine.executor.export(state)
        finally:
            if drop:
                engine.executor.drop(state)

    with engine.kv_lock:
        return _kv_work(engine, run)


def attach(engine: Any, tokens: tuple[int, ...], salt: str | None, layers: Any) -> Any:
    """A retained state holding `layers`, the KV of `tokens` under `salt`'s identity, attached under the lock."""
    identity = engine.inputs.identity(tokens, salt)
    with engine.kv_lock:
        return _kv_work(engine, lambda: engine.executor.restore(identity, layers))


def save(engine: Any, state: Any, path: Any, salt: str | None, name: str, note: str = "") -> int:
    """Write `state`'s KV as a session file (exported under the engine's lock, written outside it)."""
    return write(engine, state.identity.tokens, export(engine, state), path, salt, name, note)


def load(engine: Any, path: Any, salt: str | None) -> tuple[SessionHeader, Any]:
    """A session file's header and a retained state made from it: read and checked outside the engine's lock,
    attached under it (raises `SessionFileError`, `DeviceOutOfMemory`)."""
    header, layers = read(engine, path, salt)
    return header, attach(engine, header.tokens, salt, layers)
