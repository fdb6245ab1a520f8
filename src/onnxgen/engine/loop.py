"""`EngineLoop`: the one thread that drives an engine's steps, and `on_passing_thread` for the work before it.

Callers never step: they submit (`Engine.submit`) and wait on their request's future; the loop steps while
any request is queued, waiting or running, and sleeps otherwise. It holds its engine only while stepping, so
an engine nobody uses any more is collected, and its loop's finalizer ends the thread.

The loop thread runs torch's CPU work (the native backend's steps). torch's OpenMP runtime (GNU libgomp)
keeps a pool of worker threads per thread that starts parallel work, for the life of that thread; once the
process holds more such workers than cores, every worker sleeps right after each parallel section instead
of spinning, and each of a step's hundreds of sections waits for a wake-up (a native CPU step at 2 threads
ran slower than at one). `on_passing_thread` runs a load's torch work (lowering, the pool's allocation) on a
thread that ends with it, which takes its pool along: the loop thread's is then the only one.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from onnxgen.engine.engine import Engine

log = logging.getLogger(__name__)
T = TypeVar("T")

_LIVE: weakref.WeakSet[EngineLoop] = weakref.WeakSet()


@atexit.register
def stop_all(timeout: float = 10.0) -> None:
    """Stop every live loop and wait for its thread (at interpreter exit: a daemon thread still inside a step's
    native code when the interpreter finalizes is unwound there and aborts the process)."""
    for loop in list(_LIVE):
        loop.stop(timeout)


class _Signal:
    """What an `EngineLoop` and its thread share: whether there is work, whether to stop."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.work = False
        self.stopping = False
        self.idle = True  # the thread holds no engine (waiting for work, or not started)

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()


def _drive(signal: _Signal, engine_ref: weakref.ref[Engine]) -> None:
    """The loop thread's body. It holds its engine only while stepping, so an engine nobody uses any more is
    collected (its loop's finalizer then stops the thread)."""
    while True:
        with signal.cv:
            while not signal.work and not signal.stopping:
                signal.cv.wait()
            if signal.stopping:
                return
            signal.work = False
            signal.idle = False
        engine = engine_ref()
        if engine is None:
            return
        while engine.has_work() and not signal.stopping:
            try:
                engine.step()
            except BaseException as exc:  # a bug in a step: its requests fail, the loop goes on
                log.exception("an engine step failed")
                engine.fail_all(exc)
        del engine
        with signal.cv:
            signal.idle = True
            signal.cv.notify_all()


class EngineLoop:
    """The one thread that drives an engine: it steps while there is work and sleeps otherwise. Started by the
    first `wake` (a model nobody asks anything starts no thread); `stop` ends it after the current step, and so
    does the loop's collection."""

    def __init__(self, engine: Engine, name: str = "onnxgen-engine") -> None:
        self.engine = engine
        self.name = name
        self._signal = _Signal()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        weakref.finalize(self, self._signal.stop)
        engine.notify = self.wake
        _LIVE.add(self)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def wake(self) -> None:
        """There may be work: step until there is none (starts the thread the first time). Any thread."""
        sig = self._signal
        with sig.cv:
            if sig.stopping:
                return
            sig.work = True
            sig.cv.notify_all()  # the thread, and not only a caller of `wait_idle`
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=_drive, args=(sig, weakref.ref(self.engine)), name=self.name, daemon=True
                    )
                    self._thread.start()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the thread holds no reference to the engine (between bursts of work it drops it; right
        after a request's result is delivered it may still be finishing that step). Returns whether it is
        idle. From the loop's own thread: returns at once."""
        if self._thread is threading.current_thread():
            return False
        sig = self._signal
        with sig.cv:
            return sig.cv.wait_for(lambda: sig.idle or sig.stopping, timeout)

    def stop(self, timeout: float | None = 10.0) -> None:
        """End the thread after the step it is in (requests still queued stay queued)."""
        self._signal.stop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


def on_passing_thread(fn: Callable[[], T], name: str = "onnxgen-load") -> T:
    """`fn()` run on a new thread that ends when it returns (see the module doc): its result, or its exception
    raised here. The caller waits."""
    box: dict[str, object] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
