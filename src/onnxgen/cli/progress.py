"""Progress display on stderr: a spinner per phase and a progress bar, both built on `rich`.

When stderr is a terminal these draw live; otherwise (pipes, CI logs, pytest's capture) they
degrade to one plain line when a phase starts and one when it ends, so logs stay readable.
`enabled=False` silences everything. Nothing here ever writes to stdout: stdout carries
generated text.

    with phase("Loading the GGUF"):
        ...
    with progress_bar("Downloading", total=n_bytes, unit="B") as bar:
        bar.update(completed=k)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID


def stderr_console() -> Console:
    """A rich Console writing to the current `sys.stderr` (looked up at call time, so tests can capture)."""
    from rich.console import Console

    return Console(file=sys.stderr, stderr=True, highlight=False)


def info(message: str, *, enabled: bool = True) -> None:
    """Print one line to stderr (no markup interpretation)."""
    if enabled:
        print(message, file=sys.stderr, flush=True)


def _fmt_seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def _fmt_amount(n: float, unit: str) -> str:
    if unit == "B":
        for u in ("B", "KB", "MB", "GB"):
            if abs(n) < 1000 or u == "GB":
                return f"{n:.0f} {u}" if u == "B" else f"{n:.1f} {u}"
            n /= 1000
    return f"{n:g}{(' ' + unit) if unit else ''}"


class Bar:
    """Handle of one progress bar (or spinner while `total` is None). Safe to call when disabled."""

    def __init__(
        self,
        description: str,
        total: float | None,
        unit: str,
        progress: Progress | None,
        task: TaskID | None,
        plain: bool,
    ) -> None:
        self.description = description
        self.total = total
        self.completed: float = 0
        self.unit = unit
        self._progress = progress
        self._task = task
        self._plain = plain

    def update(
        self, *, completed: float | None = None, total: float | None = None, description: str | None = None
    ) -> None:
        """Set the amount done, the total (None keeps it) and/or the description.

        In plain mode a changed description prints one line (so phases stay visible in logs).
        """
        new_phase = description is not None and description != self.description
        if total is not None or new_phase:
            self.total = total  # a new phase without a total is a spinner again
        if completed is not None:
            self.completed = completed
        if new_phase:
            assert description is not None
            self.description = description
            if self._plain:
                info(f"  {description} ...")
            if self._progress is not None and self._task is not None:
                self._progress.reset(
                    self._task, total=self.total, completed=self.completed, description=description
                )
                return
        if self._progress is not None and self._task is not None:
            self._progress.update(
                self._task,
                completed=self.completed,
                total=self.total,
                description=self.description,
            )

    def advance(self, amount: float = 1) -> None:
        self.update(completed=self.completed + amount)


@contextmanager
def progress_bar(
    description: str, *, total: float | None = None, unit: str = "", enabled: bool = True
) -> Iterator[Bar]:
    """Show a bar (a spinner while `total` is None) until the block ends; yield its `Bar` handle.

    On a terminal the bar draws live on stderr and stays as a finished line. Otherwise one line
    is printed at the start and one at the end (with the elapsed time, or "failed" if the block
    raised). The exception, if any, propagates unchanged.
    """
    t0 = time.perf_counter()
    if not enabled:
        yield Bar(description, total, unit, None, None, plain=False)
        return
    console = stderr_console()
    if not console.is_terminal:
        info(f"{description} ...")
        bar = Bar(description, total, unit, None, None, plain=True)
        try:
            yield bar
        except BaseException:
            info(f"{description}: failed after {_fmt_seconds(time.perf_counter() - t0)}")
            raise
        amount = f", {_fmt_amount(bar.completed, unit)}" if unit and bar.completed else ""
        info(f"{description}: done in {_fmt_seconds(time.perf_counter() - t0)}{amount}")
        return

    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    amount_col = DownloadColumn() if unit == "B" else MofNCompleteColumn()
    progress = Progress(
        SpinnerColumn(finished_text="[green]✓[/]"),
        TextColumn("{task.description}"),
        BarColumn(),
        amount_col,
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )
    with progress:
        task = progress.add_task(description, total=total)
        bar = Bar(description, total, unit, progress, task, plain=False)
        try:
            yield bar
        except BaseException:
            progress.update(task, description=f"{bar.description} [red](failed)[/]")
            progress.stop_task(task)
            raise
        # A finished spinner (unknown total) is shown as complete.
        final_total = bar.total if bar.total is not None else max(bar.completed, 1)
        progress.update(task, total=final_total, completed=final_total)


@contextmanager
def phase(description: str, *, enabled: bool = True) -> Iterator[Bar]:
    """A spinner labelled `description` while the block runs (a `progress_bar` with no total)."""
    with progress_bar(description, total=None, enabled=enabled) as bar:
        yield bar


class RichReporter:
    """`onnxgen.convert.progress.Reporter` drawn on stderr: live bars on a terminal, one line per phase
    otherwise. What the CLI passes to conversions and to the default model's first build."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    def info(self, message: str) -> None:
        info(message, enabled=self.enabled)

    def notice(self, message: str) -> None:
        info(message, enabled=self.enabled)

    def bar(self, description: str, *, total: float | None = None, unit: str = "") -> Any:
        return progress_bar(description, total=total, unit=unit, enabled=self.enabled)
