"""A Triton kernel's sm_90 machine code, summarised, with no GPU: what its loops cost per iteration.

    PYTHONPATH=src:benchmarks python3 benchmarks/sass_stats.py MODULE:KERNEL SIGNATURE CONSTEXPRS [--warps 4]
        [--not-divisible NAME,...] [--arch 90] [--dump DIR]

    e.g. onnxgen.backends.native.triton_int4:int4_gemv_kernel \\
         '{"X":"*bf16","W":"*i32","S":"*bf16","Z":"*bf16","Y":"*bf16","K":"i32","N":"i32","NB":"i32",
           "sxm":"i32","sym":"i32","ONE_BITS":"i32"}' \\
         '{"BLOCK":32,"BLOCK_N":32,"BK8":64,"ZP":0,"EVEN":true,"SCHEME":1}'

Compiles the kernel with Triton's own toolchain for the target (`triton.compile` with a `GPUTarget`: no
driver needed) the way a launch would specialise it — every pointer 16-byte aligned and every integer
divisible by 16 unless named in `--not-divisible` — disassembles the cubin with the `cuobjdump` that
Triton's package carries, and prints the registers, the instruction histogram, and for each loop (a
backward branch) its instruction count and histogram. What to look for in a memory-bound kernel's loop:
vector loads (`LDG.E.128`), and no `BAR.SYNC`, `SHFL` or `LDS`/`STS` (layout conversions through shared
memory). `--dump DIR` keeps the TTGIR, PTX, cubin and SASS. Triton must be installed (not a CI dependency).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def compile_kernel(
    target: str,
    signature: dict[str, str],
    constexprs: dict[str, object],
    warps: int,
    not_divisible: set[str],
    arch: int,
) -> object:
    """The compiled kernel (`triton.compile`'s), specialised as a launch with aligned arguments would be."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    sig = dict(signature) | {k: "constexpr" for k in constexprs}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (n, t) in enumerate(sig.items())
        if t != "constexpr" and t != "fp32" and n not in not_divisible
    }
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def instructions(cubin: Path) -> list[tuple[int, str]]:
    """(address, instruction) of the cubin's SASS."""
    out = subprocess.run(
        [_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    found = []
    for line in out.splitlines():
        m = re.match(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            found.append((int(m.group(1), 16), m.group(2)))
    return found


def opcode(ins: str) -> str:
    parts = ins.split()
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def histogram(ins: list[tuple[int, str]], top: int = 40) -> str:
    c = collections.Counter(opcode(i) for _, i in ins)
    return " ".join(f"{o}:{n}" for o, n in c.most_common(top))


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int, list[tuple[int, str]]]]:
    """(start, end, body) of each backward branch's range."""
    out = []
    for addr, i in ins:
        if opcode(i) == "BRA":
            m = re.search(r"0x([0-9a-f]+)", i)
            if m and int(m.group(1), 16) < addr:
                start = int(m.group(1), 16)
                out.append((start, addr, [x for x in ins if start <= x[0] <= addr]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernel", help="MODULE:KERNEL")
    ap.add_argument("signature", help="JSON: argument name -> Triton type (*bf16, i32, fp32, ...)")
    ap.add_argument("constexprs", help="JSON: constexpr name -> value")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--not-divisible", default="", help="integer or pointer arguments not divisible by 16")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dump", type=Path, default=None)
    a = ap.parse_args()
    k = compile_kernel(
        a.kernel,
        json.loads(a.signature),
        json.loads(a.constexprs),
        a.warps,
        set(filter(None, a.not_divisible.split(","))),
        a.arch,
    )
    out = a.dump or Path("/tmp/sass_stats")
    out.mkdir(parents=True, exist_ok=True)
    cubin = out / "kernel.cubin"
    cubin.write_bytes(k.asm["cubin"])
    for key, ext in (("ttgir", "ttgir"), ("ptx", "ptx")):
        (out / f"kernel.{ext}").write_text(k.asm[key])
    ins = instructions(cubin)
    (out / "kernel.sass").write_text("\n".join(f"{a_:#06x} {i}" for a_, i in ins))
    res = subprocess.run([_cuobjdump(), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    print(f"{a.kernel}: {len(ins)} instructions, {regs.group(1) if regs else '?'} registers per thread")
    print("  all:", histogram(ins))
    for start, end, body in loops(ins):
        bad = [o for o in ("BAR.SYNC", "SHFL", "LDS", "STS") if any(opcode(i).startswith(o) for _, i in body)]
        print(
            f"  loop {start:#x}..{end:#x}: {len(body)} instructions"
            + (f" (has {', '.join(bad)})" if bad else "")
        )
        print("    ", histogram(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
