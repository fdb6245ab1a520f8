"""The packed int4 GEMV's error against float64, per nibble scheme (`triton_int4`'s SCHEME), beside torch's
float32 product: no GPU needed (the Triton interpreter), the numbers of triton_int4's docstring.

    TRITON_INTERPRET=1 PYTHONPATH=/tmp/tsite:src python3 benchmarks/int4_precision.py

One `[1, 4096]` float32 x (scale 3) times a random symmetric 4-bit `[32, 4096]` weight (block 32, scales
0.001..0.021); relative error ‖y - y64‖ / ‖y64‖.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from onnxgen.backends.native.ops.quant import dequant_matmul_nbits, kmajor
from onnxgen.backends.native.triton_int4 import int4_linear


def main() -> int:
    torch.manual_seed(1)
    n, k, block = 32, 4096, 32
    nb = k // block
    b = torch.randint(0, 256, (n, nb, block // 2), dtype=torch.uint8)
    s = torch.rand(n * nb) * 0.02 + 0.001
    x = torch.randn(1, k) * 3
    ref = x.double() @ dequant_matmul_nbits(b, s, None, k, n, 4, block, torch.float64).T
    f32 = x @ dequant_matmul_nbits(b, s, None, k, n, 4, block, torch.float32).T
    words, st, _ = kmajor(b, s, None, k, n, block)
    print("| product | relative error vs float64 |\n|---|---|")
    print(f"| torch float32 | {float((f32.double() - ref).norm() / ref.norm()):.1e} |")
    for scheme, what in (
        (0, "nibbles at bits 19..22 (float32 x)"),
        (1, "nibbles at bits 12..15 / 16..19 (half x)"),
    ):
        y = int4_linear(x, words, st, None, k, n, block, 16, 64, 4, scheme).double()
        print(f"| SCHEME {scheme}: {what} | {float((y - ref).norm() / ref.norm()):.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
