"""Where the time of one prefill chunk goes on CUDA (native backend, 8B shape): wall time vs GPU kernel
time vs host time, kernel launches, and the top host-side ops. Used to plan graph-captured prefill.

    PYTHONPATH=src python3 benchmarks/gpu_prefill_profile.py --pkg /tmp/onnxgen_bench/8b --context 8000 --chunk 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pkg", default="/tmp/onnxgen_bench/8b")
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--blas",
        choices=("default", "cublas", "cublaslt"),
        default="default",
        help="torch.backends.cuda.preferred_blas_library for the run",
    )
    ap.add_argument("--quiet", action="store_true", help="summary only (no profiler table)")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from onnxgen.backends.native.decoder import NativeDecoder
    from onnxgen.convert.synthetic import LLAMA_8B, write_package
    from onnxgen.package.spec import load_spec

    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    pkg = Path(args.pkg)
    if not (pkg / "genai_config.json").exists():
        write_package(pkg, LLAMA_8B)
    dec = NativeDecoder(load_spec(pkg), "cuda")
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(100, 128000, (args.context,), generator=g).tolist()
    chunk = torch.randint(100, 128000, (args.chunk,), generator=g).tolist()
    dec.forward(ctx, 0)
    for _ in range(3):  # warm-up
        dec.rewind_to(args.context)
        int(dec.forward(chunk, args.context).argmax())
    walls = []
    for _ in range(args.reps):
        dec.rewind_to(args.context)
        torch.cuda.synchronize()
        t = time.perf_counter()
        int(dec.forward(chunk, args.context).argmax())
        walls.append((time.perf_counter() - t) * 1000)
    host = []
    for _ in range(args.reps):  # host time to enqueue one forward (no sync inside)
        dec.rewind_to(args.context)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = dec.forward(chunk, args.context)
        host.append((time.perf_counter() - t) * 1000)
        torch.cuda.synchronize()
        del out
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.reps):
            dec.rewind_to(args.context)
            int(dec.forward(chunk, args.context).argmax())
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / args.reps
    launches = (
        sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        / args.reps
    )
    if not args.quiet:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(
        f"\n{args.chunk}-token forward after {args.context} cached tokens (8B shape, bf16, blas {args.blas}):"
    )
    print(f"  wall (incl. argmax sync)   {statistics.median(walls):7.2f} ms")
    print(f"  host time to enqueue       {statistics.median(host):7.2f} ms")
    print(f"  GPU kernel time            {kernel_us / 1000:7.2f} ms")
    print(f"  kernel launches            {launches:7.0f}")
    print(f"  lowered steps              {len(dec.program.steps):7d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
