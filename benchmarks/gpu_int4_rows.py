"""Micro-benchmark (issue 13): a packed int4 product of a few rows — what a batched decode step of an 8B int4
package runs — on the 8B shapes (block 32, symmetric; 8 layers of distinct weights so the L2 cannot hold
them), GPU time per layer from CUDA-graph replays:

- `dense`: the bf16 weight dequantized at load, cuBLAS (`int4="dense"`'s product),
- `dequant`: `int4="packed"` today beyond 16 rows: `int4_dequant` to a dense bf16 weight, then cuBLAS,
- `gemm`: `triton_int4.int4_gemm` (`ops.quant.INT4_GEMM`): the weight dequantized tile by tile in registers,
- `gemv`: `triton_int4.int4_linear` (rows up to `ops.quant.GEMV_ROWS` only: the decode path),

for 1, 8, 16, 32 and 64 rows; the packed bytes and dense bytes per layer are printed for scale. Whether
packed int4 can become the default (`device.int4_mode`) rests on `gemm` against `dense` at 16-64 rows.

    PYTHONPATH=src python3 benchmarks/gpu_int4_rows.py [--rows 1,8,16,32,64] [--layers 8]

A table prints last.
"""

# ruff: noqa: B023  (each lambda is timed within the iteration that made it)

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _util import graph_replay_ms
from onnxgen.backends.native.ops.quant import GEMV_ROWS, dequant_kmajor, kmajor
from onnxgen.backends.native.triton_int4 import int4_dequant, int4_gemm, int4_linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate/up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
BLOCK = 32


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    table = []
    for name, (n, k) in SHAPES.items():
        nb = k // BLOCK
        layers = []
        for _ in range(a.layers):
            packed = torch.randint(0, 256, (n, nb, BLOCK // 2), generator=g, dtype=torch.uint8)
            scales = (torch.rand(n * nb, generator=g) * 0.02 + 0.001).to(torch.bfloat16)
            words, st, _ = kmajor(packed.to(dev), scales.to(dev), None, k, n, BLOCK)
            dense = dequant_kmajor(words, st, None, k, n, BLOCK, torch.bfloat16)  # [N, K]
            layers.append((words, st, dense))
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
            ways = {
                "dense": lambda: [torch.nn.functional.linear(x, d) for _, _, d in layers],
                "dequant": lambda: [torch.matmul(x, int4_dequant(w, s, None, k, n, BLOCK, x.dtype)) for w, s, _ in layers],
                "gemm": lambda: [int4_gemm(x, w, s, None, k, n, BLOCK) for w, s, _ in layers],
            }  # fmt: skip
            if m <= GEMV_ROWS:
                ways["gemv"] = lambda: [int4_linear(x, w, s, None, k, n, BLOCK) for w, s, _ in layers]
            ref = torch.nn.functional.linear(x, layers[0][2]).float()
            row = {}
            for way, fn in ways.items():
                ms, out = graph_replay_ms(fn)
                err = float((out[0].float() - ref).norm() / ref.norm())
                row[way] = (ms / a.layers * 1e3, err)
                print(f"{name} rows={m} {way}: {row[way][0]:.1f} us/layer, rel. err vs dense {err:.2e}", flush=True)
            table.append((name, m, n * k // 2 / 1e6, n * k * 2 / 1e6, row))
    print("\n| product | rows | packed MB | dense MB | dense us | dequant us | gemm us | gemv us | gemm / dense |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m, pmb, dmb, row in table:
        gv = f"{row['gemv'][0]:.1f}" if "gemv" in row else "-"
        print(f"| {name} | {m} | {pmb:.1f} | {dmb:.1f} | {row['dense'][0]:.1f} | {row['dequant'][0]:.1f} | "
              f"{row['gemm'][0]:.1f} | {gv} | {row['gemm'][0] / row['dense'][0]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
