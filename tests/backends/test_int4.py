"""The int4 nibble layout (`onnxgen.package.int4`): exact bytes, round trips, numpy == torch; and the packed
GEMV's K-major words (`ops.quant.kmajor`)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgen.package.int4 import pack_nibbles, unpack_nibbles


def _devices() -> list[str]:
    torch = pytest.importorskip("torch")
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def test_low_nibble_first() -> None:
    q = np.array([1, 2, 3, 4, 15, 0], dtype=np.uint8)
    assert pack_nibbles(q).tolist() == [0x21, 0x43, 0x0F]
    assert unpack_nibbles(np.array([0x21, 0x43, 0x0F], dtype=np.uint8)).tolist() == q.tolist()


def test_odd_count_fills_the_last_high_nibble() -> None:
    q = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint8)
    assert pack_nibbles(q).tolist() == [[0x21, 0x03], [0x54, 0x06]]
    assert pack_nibbles(q, fill=8).tolist() == [[0x21, 0x83], [0x54, 0x86]]
    assert unpack_nibbles(pack_nibbles(q, fill=8), 3).tolist() == q.tolist()
    assert unpack_nibbles(pack_nibbles(q, fill=8)).tolist() == [[1, 2, 3, 8], [4, 5, 6, 8]]


@pytest.mark.parametrize("shape", [(7,), (3, 5, 32), (4, 3), (2, 3, 1), (5, 0)])
def test_round_trip(shape: tuple[int, ...]) -> None:
    q = np.random.default_rng(0).integers(0, 16, shape, dtype=np.uint8)
    packed = pack_nibbles(q, fill=15)
    assert packed.dtype == np.uint8 and packed.shape == (*shape[:-1], (shape[-1] + 1) // 2)
    np.testing.assert_array_equal(unpack_nibbles(packed, shape[-1]), q)


@pytest.mark.parametrize("shape", [(6, 3, 16), (9,), (4, 5)])
def test_torch_gives_the_numpy_bytes(shape: tuple[int, ...]) -> None:
    torch = pytest.importorskip("torch")
    q = np.random.default_rng(1).integers(0, 16, shape, dtype=np.uint8)
    want_packed = pack_nibbles(q, fill=8)
    want_values = unpack_nibbles(want_packed)
    for device in _devices():
        tq = torch.from_numpy(q).to(device)
        packed = pack_nibbles(tq, fill=8)
        assert isinstance(packed, torch.Tensor) and packed.dtype == torch.uint8
        assert packed.device == tq.device
        np.testing.assert_array_equal(packed.cpu().numpy(), want_packed)
        values = unpack_nibbles(packed)
        np.testing.assert_array_equal(values.cpu().numpy(), want_values)
        np.testing.assert_array_equal(unpack_nibbles(packed, shape[-1]).cpu().numpy(), q)
        np.testing.assert_array_equal(tq.cpu().numpy(), q)  # input untouched


def test_torch_unpack_matches_the_stack_formula() -> None:
    """The native backend's MatMulNBits / GatherBlockQuantized unpacking (stack(lo, hi)) is this layout."""
    torch = pytest.importorskip("torch")
    b = torch.randint(0, 256, (8, 3, 16), dtype=torch.uint8)
    stacked = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(8, 3, 32)
    assert torch.equal(unpack_nibbles(b), stacked)
    flat = b.reshape(-1)
    assert torch.equal(unpack_nibbles(flat, 2 * flat.numel() - 1), stacked.reshape(-1)[:-1])


def test_rejects_non_uint8_and_bad_arguments() -> None:
    with pytest.raises(TypeError, match="uint8"):
        pack_nibbles(np.zeros(4, dtype=np.int8))
    with pytest.raises(TypeError, match="uint8"):
        unpack_nibbles(np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match="fill"):
        pack_nibbles(np.zeros(3, dtype=np.uint8), fill=16)
    with pytest.raises(ValueError, match="n must be"):
        unpack_nibbles(np.zeros(3, dtype=np.uint8), 7)


@pytest.mark.parametrize("zp", ["none", "packed", "float"])
@pytest.mark.parametrize(("n", "k", "block"), [(6, 96, 32), (5, 200, 32), (4, 272, 16), (3, 384, 128)])
def test_kmajor_words_hold_matmul_nbits_bytes(zp: str, n: int, k: int, block: int) -> None:
    """`ops.quant.kmajor` (the packed GEMV's layout: int32 words `[K / 8, N]`, scales and zero points `[blocks,
    N]`) keeps the weight's bytes (same size, word (r, c) = bytes 4r .. 4r + 3 of row c), and
    `dequant_kmajor` gives `dequant_matmul_nbits`'s values exactly, partial last blocks included."""
    torch = pytest.importorskip("torch")
    from onnxgen.backends.native.ops.quant import dequant_kmajor, dequant_matmul_nbits, kmajor

    g = torch.Generator().manual_seed(n + k)
    nb = -(-k // block)
    b = torch.randint(0, 256, (n, nb, block // 2), generator=g, dtype=torch.uint8)
    sc = torch.rand(n * nb, generator=g) * 0.02 + 0.001
    z = {
        "none": None,
        "packed": torch.randint(0, 256, (n, (nb + 1) // 2), generator=g, dtype=torch.uint8),
        "float": torch.rand(n * nb, generator=g) * 15,
    }[zp]
    words, st, zt = kmajor(b, sc, z, k, n, block)
    assert (
        words.dtype == torch.int32 and words.shape == (nb * block // 8, n) and words.numel() * 4 == b.numel()
    )
    assert torch.equal(words.T.contiguous().view(torch.uint8).reshape(n, -1), b.reshape(n, -1))
    assert st.shape == (nb, n) and (zt is None) == (z is None)
    if zt is not None:
        assert zt.shape == (nb, n) and zt.dtype == (torch.uint8 if zp == "packed" else z.dtype)
    want = dequant_matmul_nbits(b, sc, z, k, n, 4, block, torch.float32)
    assert torch.equal(dequant_kmajor(words, st, zt, k, n, block, torch.float32), want)


def test_kmajor_rejects_blocks_that_are_not_whole_words() -> None:
    torch = pytest.importorskip("torch")
    from onnxgen.backends.native.ops.quant import kmajor

    with pytest.raises(NotImplementedError, match="block_size=4"):
        kmajor(torch.zeros(2, 4, 2, dtype=torch.uint8), torch.ones(8), None, 16, 2, 4)
