"""How conversion reports progress: a small protocol owned by `convert/`, with a logging default.

    rep = as_reporter(progress)            # True: LogReporter, False: SILENT, or a Reporter instance
    rep.notice("building the default model (1-2 minutes)")
    with rep.bar("Downloading", total=n, unit="B") as bar:
        bar.update(completed=k)

A `Reporter` has `info(message)` (a line of progress), `notice(message)` (a line the user should see even
when progress is not displayed, e.g. that a long build starts) and `bar(description, total, unit)` (a
context manager yielding a `Bar` with `update(completed=, total=, description=)` and `advance(n)`). The
library's default, `LogReporter`, logs to the `onnxgen.convert` logger (progress at INFO, notices at WARNING,
so they reach stderr even when logging is not configured). The CLI passes a reporter that draws rich bars
(`onnxgen.cli.progress.RichReporter`). Nothing here imports the CLI.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

log = logging.getLogger("onnxgen.convert")


class Bar(Protocol):
    def update(
        self, *, completed: float | None = None, total: float | None = None, description: str | None = None
    ) -> None: ...

    def advance(self, amount: float = 1) -> None: ...


class Reporter(Protocol):
    def info(self, message: str) -> None: ...

    def notice(self, message: str) -> None: ...

    def bar(
        self, description: str, *, total: float | None = None, unit: str = ""
    ) -> AbstractContextManager[Bar]: ...


class _CountingBar:
    """A `Bar` that only keeps count (and hands description changes to `on_phase`)."""

    def __init__(self, description: str, total: float | None, on_phase: object = None) -> None:
        self.description, self.total, self.completed = description, total, 0.0
        self._on_phase = on_phase

    def update(
        self, *, completed: float | None = None, total: float | None = None, description: str | None = None
    ) -> None:
        if completed is not None:
            self.completed = completed
        if total is not None:
            self.total = total
        if description is not None and description != self.description:
            self.description = description
            if callable(self._on_phase):
                self._on_phase(description)

    def advance(self, amount: float = 1) -> None:
        self.completed += amount


class SilentReporter:
    """Reports nothing."""

    def info(self, message: str) -> None:
        return None

    def notice(self, message: str) -> None:
        return None

    @contextmanager
    def bar(self, description: str, *, total: float | None = None, unit: str = "") -> Iterator[Bar]:
        yield _CountingBar(description, total)


class LogReporter:
    """Progress to the `onnxgen.convert` logger: each bar's start, phases and end (with the time taken) at
    INFO, notices at WARNING."""

    def info(self, message: str) -> None:
        log.info("%s", message)

    def notice(self, message: str) -> None:
        log.warning("%s", message)

    @contextmanager
    def bar(self, description: str, *, total: float | None = None, unit: str = "") -> Iterator[Bar]:
        t0 = time.perf_counter()
        log.info("%s ...", description)
        handle = _CountingBar(description, total, on_phase=lambda d: log.info("  %s ...", d))
        try:
            yield handle
        except BaseException:
            log.info("%s: failed after %.1f s", description, time.perf_counter() - t0)
            raise
        log.info("%s: done in %.1f s", description, time.perf_counter() - t0)


SILENT = SilentReporter()


def as_reporter(progress: bool | Reporter) -> Reporter:
    """`True` -> a LogReporter, `False` -> SILENT, a Reporter -> itself."""
    if progress is True:
        return LogReporter()
    if progress is False:
        return SILENT
    return progress
