"""The Triton MoE path (`kernels.moe`: route, align, grouped products, combine) against the torch path: on the
GPU, and on the CPU under `TRITON_INTERPRET=1` where Triton is installed (skipped elsewhere)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the CPU runs Triton only under TRITON_INTERPRET=1", allow_module_level=True)

from onnxgen.backends.native.kernels import moe as K  # noqa: E402

GPT_OSS = {"activation": "swiglu", "gated": True, "alpha": 1.702, "beta": 1.0, "limit": 7.0}


def _layer(e: int, h: int, inter: int, gated: bool, bias: bool, dtype: torch.dtype, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    n1 = 2 * inter if gated else inter
    w1 = torch.randn(e, n1, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    b1 = 0.5 * torch.randn(e, n1, generator=g) if bias else None
    b2 = 0.5 * torch.randn(e, h, generator=g) if bias else None
    return [None if t is None else t.to(dtype).to(DEVICE) for t in (w1, b1, w2, b2)]


def _inputs(t: int, h: int, e: int, dtype: torch.dtype, seed: int = 1) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, generator=g).to(dtype).to(DEVICE), (2 * torch.randn(t, e, generator=g)).to(
        dtype
    ).to(DEVICE)


@pytest.mark.parametrize(
    ("t", "e", "k", "normalize"), [(1, 4, 1, True), (9, 32, 4, True), (5, 6, 3, False), (3, 128, 2, True)]
)
def test_route_equals_torch(t: int, e: int, k: int, normalize: bool) -> None:
    cfg = K.MoEConfig(k=k, activation="silu", gated=False, normalize=normalize)
    _, logits = _inputs(t, 8, e, torch.float32, seed=t + e)
    ids, w = K.route_triton(logits, cfg)
    want_ids, want_w = K.route(logits, cfg)
    assert ids.dtype == torch.int32 and torch.equal(ids.long().cpu(), want_ids.cpu())
    torch.testing.assert_close(w.cpu(), want_w.cpu(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("t", "k", "e", "bm"), [(1, 4, 32, 16), (37, 2, 5, 16), (300, 4, 8, 64), (20, 3, 200, 16)]
)
def test_align_sorts_pairs_into_expert_blocks(t: int, k: int, e: int, bm: int) -> None:
    """Every block holds one expert's pairs, in pair order, `block_rows` of them; each pair exactly once;
    blocks past the last expert's hold nothing."""
    g = torch.Generator().manual_seed(t)
    ids = torch.randint(0, e, (t, k), generator=g, dtype=torch.int32).to(DEVICE)
    rows, block_expert, block_rows = (x.cpu() for x in K.align(ids, e, bm))
    flat = ids.reshape(-1).cpu().long()
    seen: list[int] = []
    last = -1
    for b in range(block_expert.numel()):
        n = int(block_rows[b])
        if n == 0:
            continue
        ex = int(block_expert[b])
        assert ex >= last and 0 < n <= bm
        pairs = rows[b * bm : b * bm + n].long().tolist()
        assert all(int(flat[p]) == ex for p in pairs)
        seen += pairs
        last = ex
    assert sorted(seen) == list(range(flat.numel()))
    assert seen == sorted(seen, key=lambda p: (int(flat[p]), p))  # stable: pair order inside an expert
    assert int(block_rows.sum()) == flat.numel()


CASES = [
    # (tokens, experts, k, config, bias)
    (1, 8, 4, GPT_OSS, True),
    (7, 6, 2, GPT_OSS, False),
    (40, 4, 1, {"activation": "geglu", "gated": True}, True),
    (5, 6, 3, {"activation": "silu", "gated": False}, True),
    (6, 5, 2, {"activation": "silu", "gated": True}, False),
    (3, 4, 2, {"activation": "relu2", "gated": False}, True),
    (100, 4, 2, GPT_OSS, True),  # 200 pairs over 4 experts: the prefill configuration (64-row blocks)
]


@pytest.mark.parametrize(("t", "e", "k", "act", "bias"), CASES)
def test_triton_layer_equals_torch_path_float32(t: int, e: int, k: int, act: dict, bias: bool) -> None:
    cfg = K.MoEConfig(k=k, normalize=True, **act)
    h, inter = 64, 48
    w1, b1, w2, b2 = _layer(e, h, inter, cfg.gated, bias, torch.float32, seed=t)
    x, logits = _inputs(t, h, e, torch.float32, seed=t + 1)
    got = K.experts_triton(x, logits, w1, b1, w2, b2, cfg)
    ids, w = K.route(logits, cfg)
    want = K.experts_torch(x, ids, w, w1, b1, w2, b2, cfg)
    assert got.shape == (t, h) and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-4, atol=1e-4)


def test_triton_layer_bf16_equals_float64() -> None:
    """bf16: within a few roundings of float64 on the same (bf16) values. NOTE: the interpreter rounds float32
    to bf16 toward zero (the GPU to nearest even), hence the looser bound there."""
    cfg = K.MoEConfig(k=4, normalize=True, **GPT_OSS)
    e, h, inter, t = 8, 128, 64, 12
    w1, b1, w2, b2 = _layer(e, h, inter, True, True, torch.bfloat16, seed=3)
    x, logits = _inputs(t, h, e, torch.bfloat16, seed=4)
    got = K.experts_triton(x, logits, w1, b1, w2, b2, cfg)
    assert got.dtype == torch.bfloat16
    ids, w = K.route(logits, cfg)
    d = [None if v is None else v.double().cpu() for v in (x, w1, b1, w2, b2)]
    want = K.experts_torch(d[0], ids.cpu(), w.double().cpu(), *d[1:], cfg)
    err = (got.double().cpu() - want).abs().max().item()
    assert err <= (2e-2 if DEVICE == "cuda" else 6e-2) * max(1.0, want.abs().max().item()), err


def test_rowwise_rows_equal_one_token_steps_bit_for_bit() -> None:
    """A verify step's rows (`rowwise`: the decode configuration) are each a one-token step's bits."""
    cfg = K.MoEConfig(k=2, normalize=True, **GPT_OSS)
    e, h, inter, t = 4, 64, 32, 6
    w1, b1, w2, b2 = _layer(e, h, inter, True, True, torch.bfloat16, seed=5)
    x, logits = _inputs(t, h, e, torch.bfloat16, seed=6)
    rows = K.experts_triton(x, logits, w1, b1, w2, b2, cfg, rowwise=True)
    for i in range(t):
        one = K.experts_triton(x[i : i + 1], logits[i : i + 1], w1, b1, w2, b2, cfg)
        assert torch.equal(rows[i : i + 1], one), i


@pytest.mark.gpu
@pytest.mark.parametrize("t", [8, 1024])
def test_cuda_layer_is_captured_and_replayed(t: int) -> None:
    """The Triton path reads nothing on the host: a CUDA graph of it replays new inputs to the eager values
    (decode-size and a prefill chunk's worth of tokens, as the runner's graphs hold)."""
    cfg = K.MoEConfig(k=4, normalize=True, **GPT_OSS)
    e, h, inter = 32, 256, 128
    w1, b1, w2, b2 = _layer(e, h, inter, True, True, torch.bfloat16, seed=7)
    x, logits = _inputs(t, h, e, torch.bfloat16, seed=8)
    sx, sl = x.clone(), logits.clone()
    K.moe(sx, sl, w1, b1, w2, b2, cfg)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.moe(sx, sl, w1, b1, w2, b2, cfg)
    x2, l2 = _inputs(t, h, e, torch.bfloat16, seed=9)
    sx.copy_(x2)
    sl.copy_(l2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, K.moe(x2, l2, w1, b1, w2, b2, cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 64, 512, 1024])
def test_cuda_gpt_oss_shapes_equal_float64(t: int) -> None:
    """gpt-oss-20B's layer shape (hidden 2880, 32 experts of 2880, top 4) in bf16: decode, batched decode and
    a prefill chunk within bf16's roundings of float64."""
    cfg = K.MoEConfig(k=4, normalize=True, **GPT_OSS)
    e, h, inter = 32, 2880, 2880
    w1, b1, w2, b2 = _layer(e, h, inter, True, True, torch.bfloat16, seed=t)
    x, logits = _inputs(t, h, e, torch.bfloat16, seed=t + 1)
    got = K.moe(x, logits, w1, b1, w2, b2, cfg)
    ids, w = K.route(logits, cfg)
    d = [None if v is None else v.double() for v in (x, w1, b1, w2, b2)]
    want = K.experts_torch(d[0], ids, w.double(), *d[1:], cfg)
    err = float((got.double() - want).norm() / want.norm())
    assert err < 1e-2, err


def _packed(e: int, n: int, k: int, fp4: bool, zeros: bool, block: int, seed: int) -> K.Packed:
    from onnxgen.package.int4 import pack_nibbles

    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (e, n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(e, n, k // block, generator=g) + 0.5) / (4 * k**0.5)
    z = torch.randint(0, 16, (e, n, k // block), generator=g).float() if zeros else None
    return K.Packed(
        pack_nibbles(q).to(DEVICE), scales.to(DEVICE), None if z is None else z.to(DEVICE), fp4, block
    )


@pytest.mark.parametrize(
    ("fp4", "zeros", "block", "t"),
    [(True, False, 32, 3), (False, False, 64, 9), (False, True, 32, 1), (False, False, 128, 70)],
)
def test_packed_experts_equal_their_dequantized_values(fp4: bool, zeros: bool, block: int, t: int) -> None:
    """4-bit experts kept packed (`int4="packed"`): the grouped products dequantize each tile as
    `Packed.expert` does, so the layer equals the dense layer on the dequantized weights (float32: to the
    accumulation order)."""
    cfg = K.MoEConfig(k=2, normalize=True, **GPT_OSS)
    e, h, inter = 4, 256, 128
    p1 = _packed(e, 2 * inter, h, fp4, zeros, block, 1)
    p2 = _packed(e, h, inter, fp4, zeros, block, 2)
    _, b1, _, b2 = _layer(e, h, inter, True, True, torch.float32, seed=t)
    x, logits = _inputs(t, h, e, torch.float32, seed=t)
    d1 = torch.stack([p1.expert(i, torch.float32) for i in range(e)])
    d2 = torch.stack([p2.expert(i, torch.float32) for i in range(e)])
    got = K.experts_triton(x, logits, p1, b1, p2, b2, cfg)
    dense = K.experts_triton(x, logits, d1, b1, d2, b2, cfg)
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
    ids, w = K.route(logits, cfg)
    torch.testing.assert_close(
        got.cpu(), K.experts_torch(x, ids, w, p1, b1, p2, b2, cfg).cpu(), rtol=1e-4, atol=1e-4
    )


_SM90 = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from onnxgen.backends.native.kernels.triton import moe as tm
ptr = {"LOGITS": "*bf16", "IDS": "*i32", "WTS": "*fp32", "ROWS": "*i32", "BLOCK_EXPERT": "*i32", "BLOCK_ROWS": "*i32",
       "A": "*bf16", "W": "*bf16", "BIAS": "*bf16", "S": "*fp32", "Z": "*fp32", "OUT": "*bf16", "Y": "*bf16"}
floats = {"alpha", "beta", "limit"}
def compile(fn, consts, **over):
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else over.get(n, ptr.get(n, "fp32" if n in floats else "i32")) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts and n not in floats}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
compile(tm.moe_route_kernel, {"K": 4, "BLOCK_E": 32, "BLOCK_K": 4, "NORMALIZE": True})
compile(tm.moe_align_kernel, {"BLOCK_M": 16, "BLOCK_E": 32, "CHUNK": 128})
compile(tm.moe_combine_kernel, {"K": 4, "BLOCK_H": 1024})
base = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GATED=True, ACT=0, HAS_BIAS=True, PACKED=False, FP4=False, HAS_ZP=False, QBLOCK=16, IEEE=False)
compile(tm.moe_gemm_kernel, base)
compile(tm.moe_gemm_kernel, {**base, "BLOCK_M": 64, "BLOCK_K": 64, "GATED": False, "ACT": -1})
compile(tm.moe_gemm_kernel, {**base, "PACKED": True, "FP4": True, "QBLOCK": 32}, W="*u8")
compile(tm.moe_gemm_kernel, {**base, "BLOCK_M": 64, "PACKED": True, "HAS_ZP": True, "QBLOCK": 32, "ACT": 2}, W="*u8")
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    """Every MoE kernel form lowers to an sm_90 cubin (Triton's ahead-of-time path: no GPU needed, so the CPU
    checks what the interpreter cannot: layouts, pipelining, the packed tiles' reshapes)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _SM90], env=env, capture_output=True, text=True, timeout=600)
    if res.returncode and "GPUTarget" in res.stderr and "ImportError" in res.stderr:
        pytest.skip("this Triton has no ahead-of-time CUDA target")
    assert res.returncode == 0 and "compiled" in res.stdout, res.stderr[-3000:]
