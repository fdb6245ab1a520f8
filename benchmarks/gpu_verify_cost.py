"""What a speculative verify step costs on CUDA next to a decode step, and what its exactness costs.

    python3 benchmarks/gpu_verify_cost.py --tokenizer .carry/tok --shapes 0.5b,1b,8b16k
    python3 benchmarks/gpu_verify_cost.py --shapes /tmp/spkg_bf16        (any package folder)
    python3 benchmarks/gpu_verify_cost.py --tokenizer .carry/tok --shapes 0.5b --rows 1,4

For each shape (builder-made bf16 package, as gpu_decode.py makes them; synthetic without --tokenizer), one
sequence with a 512-token prompt on the paged runner, then, interleaved, median of 20 each:
- decode: one replay of the batch-1 decode graph at the prompt's end (GPU time, CUDA events; the graph the
  engine would replay there, its inputs those of a real step at 513 keys — until 2026-12-06 this timed the
  decode graph in its capture's state, a one-key attention, so earlier decode costs here are low by the
  attention's cost at 512 keys);
- verify n's graph alone: one replay of the verify graph it used (GPU time; the rest of the wall time is
  the host's);
- verify n: `NativeRunner.run` of one chunk of n tokens wanting every row's logits (n = 2, 4, 8, 16: the
  last sample and n - 1 drafts), wall time with the host's part (inputs, replay, logits copy), computed
  rowwise (each row the bits of a decode step: what speculative decoding uses) and, in a second runner
  sharing the weights, as an ordinary chunk (`runner.ROWWISE = False`: the few-row GEMM and block attention).
  With `--rows 1,4` one rowwise runner per value of `kernels.ROWS_PER_PROGRAM` (a GEMV program's rows of x),
  each set while its graphs are captured and its steps run, all interleaved in one process.
The ratio verify / decode is what a draft must save: a verify of n positions pays when more than
(ratio - 1) of its drafts are accepted on average.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

SIZES = (2, 4, 8, 16)


def _runner(spec: Any, rowwise: bool) -> Any:
    from onnxgen.backends.native import runner as rmod

    rmod.ROWWISE = rowwise  # read when a step (or a verify graph's capture) asks
    return rmod.NativeRunner(spec, "cuda", kv_bytes=2 << 30, max_batch=1)


def _replay_ms(g: Any) -> float:
    """GPU time of one replay of a captured step (CUDA events)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    g.graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _verify_ms(runner: Any, toks: list[int], start: int, pages: list[int], n: int, rowwise: bool) -> float:
    from onnxgen.backends.batch import BatchStep, SeqChunk
    from onnxgen.backends.native import runner as rmod

    rmod.ROWWISE = rowwise
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.run(BatchStep((SeqChunk(toks[start : start + n], start, pages, n),)))
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def run_shape(name: str, tokenizer: Path | None, rows: list[int]) -> list[list[str]]:
    from onnxgen.backends.batch import BatchStep, SeqChunk
    from onnxgen.backends.native import kernels
    from onnxgen.package.spec import load_spec

    if Path(name).is_dir():  # a package (e.g. the spec section's /tmp/spkg_bf16)
        pkg = Path(name)
    elif tokenizer is not None:
        from gpu_parity import package

        _hf, pkg = package(name, tokenizer)
    else:
        from gpu_decode import synthetic

        pkg = synthetic(name)
    spec = load_spec(pkg)
    toks = np.random.default_rng(1).integers(100, 32000, 600).tolist()
    pages = list(range(0, 40))
    keep = kernels.ROWS_PER_PROGRAM
    decode = BatchStep((SeqChunk([toks[512]], 512, pages),))  # one decode step at the prompt's end
    # (rowwise, rows per GEMV program) -> runner; the ordinary runner keeps the default rows
    runners = {(True, rb): _runner(spec, True) for rb in rows} | {(False, keep): _runner(spec, False)}
    try:
        for (rowwise, rb), r in runners.items():
            kernels.ROWS_PER_PROGRAM = rb  # read at each launch: what the graphs capture
            r.run(BatchStep((SeqChunk(toks[:512], 0, pages),)))  # the prompt's KV, then every graph once
            r.run(decode)  # the decode graph's inputs: a real step
            for n in SIZES:
                _verify_ms(r, toks, 512, pages, n, rowwise)
        samples: dict[tuple[Any, ...], list[float]] = {}
        for _ in range(20):  # interleaved
            for (rowwise, rb), r in runners.items():
                kernels.ROWS_PER_PROGRAM = rb
                samples.setdefault(("decode", rowwise, rb), []).append(_replay_ms(r._decode_graph(decode, 1)))
                for n in SIZES:
                    samples.setdefault((n, rowwise, rb), []).append(
                        _verify_ms(r, toks, 512, pages, n, rowwise)
                    )
                    g = r._verify.get(max(n, 4))  # the verify graph the step replayed (GPU time alone)
                    if g is not None:
                        samples.setdefault((n, rowwise, rb, "gpu"), []).append(_replay_ms(g))
    finally:
        kernels.ROWS_PER_PROGRAM = keep
    med = {k: statistics.median(v) for k, v in samples.items()}
    out = []
    for rb in rows:
        dec = med[("decode", True, rb)]

        def cell(n: int, rb: int = rb, dec: float = dec) -> str:
            wall, gpu = med[(n, True, rb)], med.get((n, True, rb, "gpu"), float("nan"))
            return f"{wall:.3f} [{gpu:.3f}] ({wall / dec:.1f}x) / {med[(n, False, keep)]:.3f}"

        out.append([name, str(rb), f"{dec:.3f}", *[cell(n) for n in SIZES]])
    del runners
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument(
        "--shapes", default="0.5b,1b,8b16k", help="shape names or package folders, comma-separated"
    )
    ap.add_argument(
        "--rows",
        default=None,
        help="rows per GEMV program of the rowwise runners, comma-separated "
        "(default: kernels.ROWS_PER_PROGRAM)",
    )
    args = ap.parse_args()
    from onnxgen.backends.native import kernels

    rbs = [int(v) for v in args.rows.split(",")] if args.rows else [kernels.ROWS_PER_PROGRAM]
    rows = [r for s in args.shapes.split(",") for r in run_shape(s, args.tokenizer, rbs)]
    print(
        f"\n{torch.cuda.get_device_name()}; median of 20 interleaved; ms: verify rowwise [its graph's GPU time] "
        "(x decode) / ordinary\n"
    )
    print("| shape | rows per program | decode graph ms | " + " | ".join(f"verify {n}" for n in SIZES) + " |")
    print("|---|---|---|" + "---|" * len(SIZES))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
