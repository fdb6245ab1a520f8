"""The Triton int4 GEMV on packed MatMulNBits weights equals dequantize-then-MatMul (`ops.quant`): on the
GPU, and on the CPU under `TRITON_INTERPRET=1` where Triton is installed (skipped elsewhere)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from onnxgen.backends.native.ops.quant import dequant_matmul_nbits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the CPU runs Triton only under TRITON_INTERPRET=1", allow_module_level=True)

from onnxgen.backends.native.triton_int4 import int4_linear  # noqa: E402


def _weights(n: int, k: int, block: int, zp: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    nb = -(-k // block)
    packed = torch.randint(0, 256, (n, nb, block // 2), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n * nb, generator=g) * 0.02 + 0.001).to(torch.float32)
    if zp == "none":
        z = None
    elif zp == "packed":
        z = torch.randint(0, 256, (n, (nb + 1) // 2), generator=g, dtype=torch.uint8)
    else:
        z = torch.rand(n * nb, generator=g) * 15
    return packed, scales, z


@pytest.mark.parametrize("tile", [(8, None), (4, 1), (16, 4)])  # (rows per program, blocks per loop step)
@pytest.mark.parametrize("zp", ["none", "packed", "float"])
@pytest.mark.parametrize(("m", "n", "k", "block"), [(1, 96, 256, 32), (3, 40, 200, 32), (2, 64, 384, 128)])
def test_packed_gemv_equals_dequantize_then_matmul(zp: str, m: int, n: int, k: int, block: int, tile: tuple) -> None:
    packed, scales, z = _weights(n, k, block, zp)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    w = dequant_matmul_nbits(packed, scales, z, k, n, 4, block, torch.float32)  # [N, K]
    want = x.double() @ w.double().T
    got = int4_linear(x.to(DEVICE), packed.to(DEVICE), scales.to(DEVICE), None if z is None else z.to(DEVICE),
                      k, n, block, block_n=tile[0], blocks=tile[1]).cpu()  # fmt: skip
    assert got.shape == (m, n)
    assert float((got.double() - want).norm() / want.norm()) < 1e-5
