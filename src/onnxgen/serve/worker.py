"""The engine workers of a model: `threads` threads that run requests in arrival order, behind a bounded
queue. Requests running on different threads at once are batched by the engine into the same steps
(`onnxgen.Model`: concurrent `generate` calls share steps); a server gives it as many threads as the
engine runs requests at once (`Model.max_running`).

`submit(fn)` enqueues a job and returns it at once; a full queue (`max_queue` jobs waiting for a
thread) raises `QueueFull` (the app answers 429 with Retry-After). Each job carries a `cancel` event: set before the job starts, the
job is skipped; set while it runs, the engine raises `Cancelled` at its next step and the session
drops its retained state (docs/reuse.md, invariant 2). The job's outcome lands in a
`concurrent.futures.Future` (await it with `asyncio.wrap_future`).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

from onnxgen.errors import Cancelled, QueueFull


class Job:
    def __init__(self, fn: Callable[[threading.Event], Any]) -> None:
        self.fn = fn
        self.cancel = threading.Event()
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()


class EngineWorker:
    """Runs jobs on `threads` dedicated threads. `max_queue` bounds the jobs waiting for a thread (not
    counting those running)."""

    def __init__(self, max_queue: int = 64, threads: int = 1, name: str = "onnxgen-engine") -> None:
        if max_queue < 1 or threads < 1:
            raise ValueError(f"max_queue and threads must be >= 1, got {max_queue}, {threads}")
        self.max_queue = max_queue
        self.threads = threads
        self._q: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._running = 0
        self._count = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    @property
    def waiting(self) -> int:
        """Jobs waiting for a thread."""
        return self._q.qsize()

    @property
    def running(self) -> int:
        """Jobs running now."""
        return self._running

    @property
    def depth(self) -> int:
        """Jobs waiting plus those running."""
        return self._q.qsize() + self._running

    def submit(self, fn: Callable[[threading.Event], Any]) -> Job:
        """Enqueue `fn(cancel_event)`; raises QueueFull when `max_queue` jobs already wait."""
        job = Job(fn)
        try:
            self._q.put_nowait(job)
        except queue.Full:
            raise QueueFull() from None
        return job

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            if job.cancel.is_set():
                job.future.set_exception(Cancelled("cancelled while queued"))
                continue
            with self._count:
                self._running += 1
            try:
                result = job.fn(job.cancel)
            except BaseException as exc:
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)
            finally:
                with self._count:
                    self._running -= 1

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop after the queued jobs (blocks while the queue is full)."""
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout)
