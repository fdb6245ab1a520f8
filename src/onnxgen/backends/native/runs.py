"""Runs of decode steps on the runner's CUDA graphs: the run's tokens (`DecodeRun`) and its schedule
(`replay_plan`: which graph each step replays, when the graph's token record is flushed into the run's tokens
and which rows go to the host after each replay). Host arithmetic only: tested on the CPU.

    steps      0 1 2 3 | 4 5 6 7 | 8          (k = 9, greedy, 4-step graph, part_steps = 4)
    replays    [0..3]    [4..7]    [8]        (`Replay.first`, `Replay.steps`)
    parts      rows 0-3  rows 4-7  row 8      (`Part`: staged to the host behind an event each)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from onnxgen.backends.batch import DeviceTokens
from onnxgen.backends.native.step_buffers import RUN_TOKENS

PART_STEPS = 4  # the default `part_steps` of a runner


@dataclass
class DecodeRun(DeviceTokens):
    """A launched run of decode steps (`NativeRunner.launch_decodes`): its `[k, B]` tokens on the device and,
    on CUDA, their pinned host copy, filled part by part: `parts` holds (rows, event) in order — the first
    `rows` rows are on the host once `event` has completed."""

    host: torch.Tensor | None = None
    parts: list[tuple[int, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Part:
    """Rows `start:end` of a run staged to the host after a replay: read from the run's tokens when
    `from_run` (they are all there), else from the graph's token record (all in its current window)."""

    start: int
    end: int
    from_run: bool


@dataclass(frozen=True)
class Replay:
    """One graph replay of a run: its first step `first` and its `steps` (more than one: the several-step
    graph); `flush`: for greedy runs, the first step whose recorded tokens this replay copies into the run's
    tokens (at the end of each record window of `RUN_TOKENS` steps and of the run), else None; `part`: the
    rows staged to the host after it, or None."""

    first: int
    steps: int
    flush: int | None
    part: Part | None

    @property
    def last(self) -> int:
        """The replay's last step."""
        return self.first + self.steps - 1


def replay_plan(
    k: int, greedy: bool, multi: bool, *, depth: int, first_multi: bool = True, part_steps: int = PART_STEPS
) -> list[Replay]:
    """How a run of `k` decode steps replays the decode graph. A replay covers `depth` steps (the graph's
    several-step form) for `greedy` runs of a graph that has one (`multi`) where its steps fit before the
    run's end and within one token record window, the run's first replay included only with `first_multi`;
    otherwise one step. Parts end past each `part_steps` boundary (0: none), at each flush and at the run's
    end, and cover the run's rows in order."""
    plan = []
    j = staged = 0
    while j < k:
        deep = (
            greedy
            and multi
            and j + depth <= k
            and j % RUN_TOKENS + depth <= RUN_TOKENS
            and (j > 0 or first_multi)
        )
        n = depth if deep else 1
        last = j + n - 1
        flush = (
            last - last % RUN_TOKENS if greedy and ((last + 1) % RUN_TOKENS == 0 or last == k - 1) else None
        )
        flushed = not greedy or flush is not None
        part = None
        if last == k - 1 or flush is not None or (part_steps and (last + 1) // part_steps > j // part_steps):
            part, staged = Part(staged, last + 1, flushed), last + 1
        plan.append(Replay(j, n, flush, part))
        j += n
    return plan


def even_parts(k: int, part_steps: int) -> tuple[int, ...]:
    """The row ends of a run of `k` steps read in parts of `part_steps` (0: one part): what a run of greedy
    several-step replays stages, and what the CPU reports for its runs (computed already), so that the host
    reads runs alike everywhere."""
    return (*range(part_steps, k, part_steps), k) if part_steps else (k,)
