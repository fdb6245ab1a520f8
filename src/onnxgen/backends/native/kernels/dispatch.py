"""Whether the native kernels run in Triton, and how they are launched.

`use_triton(t)` decides per tensor: CUDA with Triton importable, or any tensor with `ONNXGEN_FORCE_TRITON`
(the tests run the kernels under `TRITON_INTERPRET=1` on the CPU); never with `ONNXGEN_NO_TRITON`.
`launch_options(t)` gives every launch its programmatic-dependent-launch options (`ONNXGEN_PDL`). These three
switches are read when a program is loaded (`load_switches`, called by `device.shared_program`) or at their
first use, not at import and not per call: `use_triton` runs once per op on every path, the CPU's included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import onnxgen.envs as envs


@dataclass(frozen=True)
class Switches:
    """The dispatch switches as read from the environment (`onnxgen.envs`)."""

    force: bool  # FORCE_TRITON: Triton kernels on CPU tensors too (under TRITON_INTERPRET=1)
    disabled: bool  # NO_TRITON: the torch paths everywhere
    pdl: bool  # PDL: programmatic dependent launch where the device has it


_switches: Switches | None = None
_TRITON_OK: bool | None = None  # Triton imported and its kernels built (None: not tried yet)
_PDL_DEVICES: dict[int, bool] = {}

KERNELS: dict[str, Any] = {}
"""The compiled Triton kernels by name (`build`; filled in place on first use, so a module may bind the
dict itself). Each launch site looks its kernel up here at launch time."""


def load_switches() -> Switches:
    """Read FORCE_TRITON, NO_TRITON and PDL from the environment now and keep them for later launches.
    Raises `ValueError` naming a variable whose text cannot be read."""
    global _switches
    _switches = Switches(envs.read("FORCE_TRITON"), envs.read("NO_TRITON"), envs.read("PDL"))
    return _switches


def switches() -> Switches:
    """The switches in force (read by `load_switches`, or now if never read)."""
    return _switches if _switches is not None else load_switches()


def use_triton(t: torch.Tensor) -> bool:
    """Whether `t`'s kernels run in Triton (CUDA with Triton importable, or `FORCE_TRITON`)."""
    global _TRITON_OK
    s = _switches if _switches is not None else load_switches()
    if s.disabled or not (t.is_cuda or s.force):
        return False
    # pragma: cuda-begin (a CUDA tensor, or the Triton interpreter)
    if _TRITON_OK is None:
        try:
            build()
            _TRITON_OK = True
        except Exception:  # triton missing or broken: torch path
            _TRITON_OK = False
    return bool(_TRITON_OK)
    # pragma: cuda-end


def launch_options(t: torch.Tensor) -> dict[str, Any]:
    """The Triton launch options every kernel of this package takes for tensors on `t`'s device: with
    programmatic dependent launch (Hopper and later; `PDL`) a kernel may start while the previous one on the
    stream finishes — each kernel waits for it (`triton.core.pdl_begin`) before touching anything it
    wrote, so only the launch latency and the first constant-weight loads overlap. Elsewhere (older GPUs,
    the interpreter) `PDL=False` compiles the waits out."""
    if not (switches().pdl and t.is_cuda):
        return {"PDL": False}
    # pragma: cuda-begin
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _PDL_DEVICES:
        from onnxgen.backends.native.kernels.triton import core

        _PDL_DEVICES[idx] = core.HAS_PDL and torch.cuda.get_device_capability(idx) >= (9, 0)
    return {"PDL": True, "launch_pdl": True} if _PDL_DEVICES[idx] else {"PDL": False}
    # pragma: cuda-end


def triton_available() -> bool:
    """Whether Triton kernels run on this machine's CUDA device (False without one)."""
    return use_triton(torch.empty(0, device="cuda")) if torch.cuda.is_available() else False


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def build() -> None:  # pragma: cuda (Triton only)
    """Import the Triton device code and fill `KERNELS` (once; raises when Triton is missing or broken)."""
    if KERNELS:
        return
    from onnxgen.backends.native.kernels.triton import advance, core, gemv, skinny

    KERNELS.update(
        {
            "rms": core.rms_kernel,
            "silu_mul": core.silu_mul_kernel,
            "attn_split": core.attn_split_kernel,
            "attn_combine": core.attn_combine_kernel,
            "rope_qkv": core.rope_qkv_kernel,
            "gemv": gemv.gemv_kernel,
            "argmax_part": advance.argmax_part_kernel,
            "silu_halves": gemv.silu_mul_halves_kernel,
            "decode_advance": advance.decode_advance_kernel,
            "skinny": skinny.skinny_kernel,
            "copy_prefix": advance.copy_prefix_kernel,
            "embedding": core.embedding_kernel,
        }
    )
