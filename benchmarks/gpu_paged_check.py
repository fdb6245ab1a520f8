"""Which tiles of the paged attention kernel agree with the torch path on this GPU (a diagnosis for
`tests/test_paged_attention.py::test_cuda_triton_kernel_equals_the_torch_path` failures).

    PYTHONPATH=src:tests python3 benchmarks/gpu_paged_check.py

For bfloat16 (float32 passes the GPU test), the tiles the kernel may take (`paged.tile_for`'s decode shapes
with 2 and 3 stages; the prefill chunks' 128 x 128 with 8 warps and 3 stages, and its neighbours), key splits
None / 1 / 3, and the test's step shapes, windows and soft-capping: the relative error of the Triton kernel
against `paged.attention_ref` (float64 norms). Prints each case over the test's
tolerance (1e-5 float32, 2e-2 bfloat16) and a count per tile last.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from onnxgen.backends.native import paged  # noqa: E402
from test_paged_attention import SHAPES, P, _batch  # noqa: E402

STEPS = (
    [*SHAPES, (700, 1), (64, 64), (1000, 1), (40, 60)],
    [(64, 64), (500, 17), (40, 60), (0, 130)],
    [(37, 5), (100, 8), (300, 3)],
    [(600, 3), (33, 2)],
    [(600, 1), (33, 1), (5, 1)],
)
TILES = [
    None,
    (16, 64, 4, 2),
    (16, 64, 4, 3),
    (32, 64, 4, 3),
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (128, 128, 8, 3),
    (128, 128, 8, 2),
    (128, 64, 4, 3),
    (64, 128, 4, 3),
]


def main() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU under TRITON_INTERPRET=1 (slow)
    bad: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for dt in (torch.bfloat16,):  # float32 passes the GPU test
        tol = 1e-5 if dt == torch.float32 else 2e-2
        for shapes in STEPS:
            st, step, q = _batch(dev, dt, shapes, seed=3)
            ps = paged.build_step(step, st, P, torch.device(dev))
            for tile in TILES:
                for nsplit in (None, 1, 3):
                    for window, softcap in ((-1, 0.0), (8, 0.0), (-1, 4.0)):
                        name = f"{str(dt)[6:]} tile {tile} nsplit {nsplit}"
                        got = paged.attention_triton(ps, 1, q, 0.2, softcap, window, nsplit=nsplit, tile=tile)
                        want = paged.attention_ref(ps, 1, q, 0.2, softcap, window).double()
                        err = float((got.double() - want).norm() / want.norm())
                        total[name] += 1
                        if not err < tol:
                            bad[name] += 1
                            rows = (got.double() - want).abs().amax(dim=(1, 2))
                            worst = int(rows.argmax())
                            print(
                                f"over: {name} step {shapes[0]}.. window {window} softcap {softcap}: rel err "
                                f"{err:.3g}; worst token row {worst} of {rows.numel()} (max abs {rows.max():.3g})"
                            )
    print("\n| case | over tolerance | of |")
    print("|---|---|---|")
    for name in total:
        print(f"| {name} | {bad[name]} | {total[name]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
