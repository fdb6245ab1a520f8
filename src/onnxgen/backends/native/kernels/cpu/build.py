"""The C kernels' shared library: compiled from `kernels.c` at first use with the system's C compiler, kept
under `$ONNXGEN_HOME/kernels/` by a digest of the source, the compiler and the flags, loaded with ctypes.

- `library()`: the loaded library, or None where it cannot run here (`ONNXGEN_CPU_KERNELS=0`, a CPU without
  AVX2 and FMA, no C compiler, a failed compile, or an OpenMP runtime other than torch's in the process);
  decided once per process, the reason logged once and kept in `unavailable()`.

The library is linked against `libgomp.so.1` and loaded after torch, so the dynamic loader gives it the
OpenMP runtime torch already loaded (the same soname): its parallel regions run on the calling thread's
pool, the one torch's own ops use, never a second pool beside it (`engine/loop.py` on why a second pool on
the same cores costs a wake-up per parallel section). A process where that does not hold (two `libgomp`
mapped after loading) does not use the library.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

import onnxgen.envs as envs
from onnxgen.package.home import onnxgen_home

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
COMPILERS = ("cc", "gcc", "clang")
VERSION = 8  # og_version() of the source this module's bindings expect

_reason: list[str] = []


def unavailable() -> str | None:
    """Why `library()` is None (after it was asked), else None."""
    return _reason[0] if _reason else None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot run here (see the module doc); the reason is logged
    once at INFO (off by the switch) or WARNING (wanted but unavailable)."""
    if not envs.read("CPU_KERNELS"):
        return _none("ONNXGEN_CPU_KERNELS=0", logging.INFO)
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return _none(f"this CPU lacks AVX2/FMA (torch sees {torch.backends.cpu.get_cpu_capability()})")
    compiler = next((c for c in map(shutil.which, COMPILERS) if c), None)
    if compiler is None:
        return _none(f"no C compiler on PATH (looked for {', '.join(COMPILERS)}): install gcc to enable them")
    try:
        path = _built(compiler)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        return _none(f"the kernels did not build or load ({exc})")
    if lib.og_version() != VERSION:
        return _none(f"{path} is version {lib.og_version()}, expected {VERSION}")
    runtimes = _openmp_runtimes()
    if len(runtimes) > 1:
        return _none(f"two OpenMP runtimes would run side by side ({', '.join(sorted(runtimes))})")
    _declare(lib)
    return lib


def _none(reason: str, level: int = logging.WARNING) -> None:
    _reason[:] = [reason]
    log.log(level, "onnxgen's CPU kernels are off: %s; torch's ops run instead", reason)
    return None


def _built(compiler: str) -> Path:
    """The library for this source, compiler and flags, compiled (atomically, under a file lock) if missing."""
    from filelock import FileLock

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    folder = onnxgen_home() / "kernels"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"cpu-{key}.so"
    with FileLock(str(path) + ".lock"):
        if path.exists():
            return path
        fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".so.tmp", dir=folder)
        os.close(fd)
        try:
            done = subprocess.run(
                [compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300
            )
            if done.returncode != 0:
                raise subprocess.SubprocessError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("compiled onnxgen's CPU kernels into %s", path)
    return path


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime files mapped into this process (Linux; empty elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    names = ("libgomp", "libiomp", "libomp")
    return {
        os.path.realpath(line.split()[-1])
        for line in maps.splitlines()
        if any(n in line.rsplit("/", 1)[-1] for n in names) and "/" in line
    }


def _declare(lib: ctypes.CDLL) -> None:
    """Argument and result types of the library's functions (pointers passed as integers)."""
    P, I, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float  # noqa: E741
    lib.og_linear.argtypes = [P, I, I, P, P, F, P, P, P, P, P, I, P, P, I]
    lib.og_rope_qkv_write.argtypes = [P, L, I, I, I, I, I, P, P, L, P, P, I, P, L, L, P, P, L, L]
    lib.og_attention.argtypes = [P, L, L, I, I, I, I, P, P, L, L, L, P, L, I, P, P, F, F, I, P, P, L, L, P, I]
    lib.og_layer.argtypes = [P]
    lib.og_layer_scratch.argtypes = [I, I, I, I, I, L]
    lib.og_layer_scratch.restype = L
    lib.og_attention_scratch.argtypes = [I, I, I]
    lib.og_attention_scratch.restype = L
    for f in (lib.og_linear, lib.og_rope_qkv_write, lib.og_attention, lib.og_layer, lib.og_version):
        f.restype = ctypes.c_int
