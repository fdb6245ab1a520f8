"""Every `ONNXGEN_*` environment variable onnxgen reads, and the only module that reads them.

    import onnxgen.envs as envs
    envs.HOME            # read when asked (each access reads the environment anew)
    envs.describe()      # every variable with its default and what it does (`onnxgen show --env`)

Most of these are switches for kernel experiments and benchmarks: the defaults are what the project
measured best, and an ordinary user sets none of them. Policy that a user chooses (steps per run, sessions,
batch sizes, speculation) lives in `onnxgen.config`, not here. A variable is read at each access, so a test
or a benchmark can set it before the code that reads it runs (kernel options are read when a program is
loaded or a kernel is chosen, not at import).

`tests/test_architecture.py` checks that no other module of `src/onnxgen` reads the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _flag(default: bool) -> Callable[[str | None], bool]:
    """A boolean variable: "1"/"true"/"yes"/"on" are true, "0"/"false"/"no"/"off" false, unset the default."""

    def parse(raw: str | None) -> bool:
        if raw is None or raw == "":
            return default
        v = raw.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected 1/0, true/false, yes/no or on/off, got {raw!r}")

    return parse


def _int(default: int, least: int) -> Callable[[str | None], int]:
    def parse(raw: str | None) -> int:
        if raw is None or raw == "":
            return default
        v = int(raw)
        if v < least:
            raise ValueError(f"must be >= {least}, got {v}")
        return v

    return parse


def _home(raw: str | None) -> Path:
    return Path(raw or Path.home() / ".cache" / "onnxgen").expanduser()


@dataclass(frozen=True)
class Var:
    """One environment variable: its name (`ONNXGEN_` + key), how its text is read, what it does."""

    key: str
    parse: Callable[[str | None], Any]
    default: str
    doc: str

    @property
    def name(self) -> str:
        return f"ONNXGEN_{self.key}"


# NOTE: one entry per variable; the comment is the `doc` string (listed by `describe()` and in the README).
_VARS: tuple[Var, ...] = (
    Var("HOME", _home, "~/.cache/onnxgen", "where onnxgen keeps built models and downloaded sources"),
    Var(
        "FORCE_TRITON",
        _flag(False),
        "0",
        "run the Triton kernels on CPU tensors too (with TRITON_INTERPRET=1)",
    ),
    Var("NO_TRITON", _flag(False), "0", "never run Triton kernels (the torch paths everywhere)"),
    Var("PDL", _flag(True), "1", "programmatic dependent launch between the decode step's kernels (sm_90)"),
    Var("GEMV_ROWS", _int(4, 1), "4", "rows of a few-row product computed per program over one weight tile"),
    Var(
        "NORM_LATE",
        _flag(True),
        "1",
        "a norm folded into the product that follows scales its result, not its input",
    ),
    Var("FOLD_NORMS", _flag(False), "0", "fold every RMSNorm into its product (not only where timed faster)"),
    Var("GEMV_X2D", _flag(True), "1", "the one-row product may load its input in the weight tile's shape"),
    Var(
        "EMBEDDING_KERNEL",
        _flag(True),
        "1",
        "the token embedding's gather runs its Triton kernel (part of programmatic dependent launch); 0: torch's",
    ),
    Var(
        "SHORT_BLOCKS",
        _int(2, 0),
        "2",
        "decode attention runs unpipelined while each key split holds at most this many key blocks (0: never)",
    ),
    Var(
        "RESIDUAL_INTO_PRODUCT",
        _flag(True),
        "1",
        "a skip-norm's sum is formed by the product that feeds it (read when a graph is lowered)",
    ),
    Var(
        "GREEDY_IN_ADVANCE",
        _flag(True),
        "1",
        "a greedy decode step chooses its token inside the advance kernel",
    ),
    Var(
        "RUN_GRAPH_STEPS",
        _int(4, 1),
        "4",
        "decode steps per CUDA graph replay for small greedy batches (1: one)",
    ),
    Var(
        "ROWWISE",
        _flag(True),
        "1",
        "verify steps compute each row exactly as a one-token step (exact speculation)",
    ),
    Var(
        "CPU_PREPACK",
        _flag(False),
        "0",
        "CPU float32 products of several rows (verify steps) run oneDNN over weights prepacked at load: faster "
        "speculative verify steps for a second copy of every product weight in memory (off by default)",
    ),
    Var(
        "CPU_KERNELS",
        _flag(True),
        "1",
        "CPU float32 decode work (products of up to 16 rows, rotary + KV write, attention of decode and verify "
        "steps) runs onnxgen's C kernels, compiled at first use with the system's C compiler (0: torch's ops)",
    ),
    Var(
        "CPU_SPLIT",
        _flag(True),
        "1",
        "CPU float32 product weights split at load into a block of columns per torch thread, so a decode "
        "step's one-row products run on every thread (read when a graph is lowered)",
    ),
)
VARS: dict[str, Var] = {v.key: v for v in _VARS}


def read(key: str) -> Any:
    """The value of `ONNXGEN_<key>` now (its default when unset). Raises `ValueError` naming the variable
    when its text cannot be read."""
    var = VARS[key]
    raw = os.environ.get(var.name)
    try:
        return var.parse(raw)
    except ValueError as exc:
        raise ValueError(f"{var.name}={raw!r}: {exc}") from None


def is_set(key: str) -> bool:
    """Whether `ONNXGEN_<key>` is set (to anything) in the environment."""
    return VARS[key].name in os.environ


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment a child process of onnxgen gets: this one's, with `extra` set."""
    return {**os.environ, **extra}


# Not onnxgen's: set (never read) in every process of a tensor-parallel group on CUDA, before its communicator
# starts: NVLink multicast (NVLS, symmetric-memory multicast) stays off on the machines the project runs on.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def set_in_process(values: dict[str, str]) -> None:
    """Set variables in this process's environment (inherited by the processes it starts later)."""
    os.environ.update(values)


def describe() -> list[tuple[str, str, str]]:
    """(name, default, what it does) of every variable, in registry order."""
    return [(v.name, v.default, v.doc) for v in _VARS]


def __getattr__(key: str) -> Any:
    if key in VARS:
        return read(key)
    raise AttributeError(f"module 'onnxgen.envs' has no attribute {key!r}")
