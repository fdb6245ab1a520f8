"""Matrix products: MatMul, Gemm, the lowering's Linear (a MatMul, MatMulNBits or Gemm with a constant
weight), LinearSiluMul (a gate and an up Linear of the same input merged, followed by `silu(g) * u`) and
RmsLinear (an RMSNorm whose only reader is one of those: normalised inside the one-row GEMV), with the
float32 path for low-precision matmuls on CPUs without bf16/fp16 matrix units."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from onnxgen.backends.native.kernels import cpu_gemm
from onnxgen.backends.native.kernels.cpu import ops as cpu_kernels
from onnxgen.backends.native.kernels.linear import Rope, linear, linear_rope, rms_linear
from onnxgen.backends.native.kernels.norms import gelu_mul_halves, rms_norm, silu_mul_halves
from onnxgen.backends.native.ops.base import AI, INTERNAL, MS, Builder, Fn, Node, is_rowwise, same_device
from onnxgen.backends.native.ops.rotary import rope_rows, step_rows


def _matmul(node: Node) -> Fn:
    def f(ctx: Any, a: Any, b: Any) -> tuple[Any, ...]:
        a, b = same_device(ctx, a, b)
        return (torch.matmul(a, b),)

    return f


def _linear(node: Node) -> Fn:
    """MatMul / MatMulNBits / Gemm with a constant weight, rewritten by the lowering.

    The weight input is either `[K, N]` (CPU: `x @ w`) or `[N, K]` (`transposed`, CUDA: `F.linear`). With
    `_rope` (the lowering's `_rope_into_qkv`: a layer's packed QKV, rotation pairs in adjacent rows; inputs
    3 and 4 the rotary tables, with `_step_tables` the step's own: MRoPE's) a one-row product may rotate q and k and write k and v itself (`_qkv_rope`).
    Input 5, a residual (the lowering's `_residual_into_product`; never with a bias or `_rope`): `residual
    + x @ W`, the sum formed before the product is rounded (`kernels.linear.linear`). `_out_float` (the
    lowering's `_cast_into_product`): the product's values, rounded to x's dtype, returned as float32."""
    transposed = bool(node.attr("_transposed", 0))
    qkv = node.attr("_rope", None)
    switch = node.attr("_rope_switch")  # LongRoPE's tables (`ops.rotary.rope_rows`)
    step = bool(node.attr("_step_tables", 0))  # the step's own tables (MRoPE's): row i for token i
    out = torch.float32 if node.attr("_out_float", 0) else None
    packed = node.attr("_packed")

    def f(
        ctx: Any, x: Any, w: Any, bias: Any = None, cos: Any = None, sin: Any = None, residual: Any = None
    ) -> tuple[Any, ...]:
        if qkv is not None and transposed and bias is None:
            done = _qkv_rope(ctx, qkv, x, w, cos, sin, None, switch, step)
            if done is not None:
                return (done[0],)
        return (_product(x, w, bias, transposed, is_rowwise(ctx), residual, out, packed),)

    return f


def _qkv_rope(
    ctx: Any,
    qkv: tuple[int, int, int, int],
    x: Any,
    w: Any,
    cos: Any,
    sin: Any,
    norm: tuple[Any, Any, float] | None,
    switch: tuple[int, int] | None = None,
    step_tables: bool = False,
) -> tuple[Any, Any] | None:
    """A one-token step's QKV product with rotary and the KV write (`kernels.linear.linear_rope`; a rowwise
    step's tokens each as one), recorded in `ctx.prepared` so the layer's attention takes q as it is and writes
    nothing; None when not fused."""
    layer, n, hkv, d = qkv
    if ctx is None or ctx.kv is None or (ctx.n != 1 and not ctx.rowwise) or ctx.positions is None:
        return None
    slot = ctx.paged.slots if ctx.paged is not None else ctx.positions
    rows = step_rows(ctx) if step_tables else rope_rows(ctx, switch)
    rope = Rope(cos, sin, rows, slot, ctx.kv, layer, n, hkv, d)
    out = linear_rope(x, w, rope, norm, rowwise=ctx.rowwise)
    if out is not None:
        ctx.prepared.add(layer)
    return out


def _product(
    x: Any,
    w: Any,
    bias: Any,
    transposed: bool,
    rowwise: bool = False,
    residual: Any = None,
    out_dtype: torch.dtype | None = None,
    packed: Any = None,
) -> Any:
    """`x @ W (+ bias) (+ residual)`: W `[N, K]` (`transposed`) or `[K, N]`; a residual (never with a bias)
    is added to the product before it is rounded where the kernels can (`kernels.linear.linear`);
    `out_dtype`: the result (rounded to x's dtype first) in that dtype. `packed`: a `[K, N]` float32 CPU
    weight's oneDNN copy (the lowering's `_packed`), which products of several rows read
    (`kernels.cpu_gemm`)."""
    assert bias is None or residual is None
    if transposed and _upcast_cpu_matmul(x):
        y = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        y = (y if residual is None else y + residual.float()).to(x.dtype)
    elif transposed and bias is None:
        return linear(x, w, rowwise=rowwise, residual=residual, out_dtype=out_dtype)
    elif not transposed and (done := cpu_kernels.linear(x, w, bias=bias, residual=residual)) is not None:
        y = done[0]  # decode-size float32 rows: the C kernel (bias and residual added before it returns)
    else:
        y = F.linear(x, w, bias) if transposed else cpu_gemm.product(x, w, packed)
        if bias is not None and not transposed:
            y = y + bias
        if residual is not None:  # float32 here ([K, N] weights are the CPU's float32 layout)
            y = y.add_(residual) if y.dtype == residual.dtype else (y.float() + residual.float()).to(y.dtype)
    return y if out_dtype is None else y.to(out_dtype)


def _linear_silu_mul(node: Node) -> Fn:
    """`silu(x @ Wg) * (x @ Wu)` over the merged weight `[Wg | Wu]` (`[2N, K]` transposed, else `[K, 2N]`):
    one product (one-row products: one fused GEMV on a Triton device), the same values as the two Linears
    and SiluMul it replaces."""
    transposed = bool(node.attr("_transposed", 0))
    packed = node.attr("_packed")

    def f(ctx: Any, x: Any, w: Any) -> tuple[Any, ...]:
        if transposed and not _upcast_cpu_matmul(x):
            return (linear(x, w, silu_halves=True, rowwise=is_rowwise(ctx)),)
        if not transposed and (done := cpu_kernels.linear(x, w, silu_halves=True)) is not None:
            return (done[0],)
        return (silu_mul_halves(_product(x, w, None, transposed, is_rowwise(ctx), packed=packed)),)

    return f


def _linear_gelu_mul(node: Node) -> Fn:
    """`gelu_tanh(x @ Wg) * (x @ Wu)` over the merged weight (as `LinearSiluMul`'s): one product, then one
    activation launch over its halves (`gelu_mul_halves`)."""
    transposed = bool(node.attr("_transposed", 0))
    packed = node.attr("_packed")
    return lambda ctx, x, w: (
        gelu_mul_halves(_product(x, w, None, transposed, is_rowwise(ctx), packed=packed)),
    )


def _rms_linear(node: Node) -> Fn:
    """`(Skip)SimplifiedLayerNormalization` followed by the Linear / LinearSiluMul that alone reads its
    output: outputs (the product, the residual sum `x + skip` or None). The same values as the two ops.
    `_rope`: as `_linear`'s."""
    transposed = bool(node.attr("_transposed", 0))
    silu = bool(node.attr("silu", 0))
    eps = float(node.attr("epsilon", 1e-5))
    qkv = node.attr("_rope", None)
    switch = node.attr("_rope_switch")
    step = bool(node.attr("_step_tables", 0))
    out = torch.float32 if node.attr("_out_float", 0) else None  # (never with silu)
    packed = node.attr("_packed")

    def f(ctx: Any, x: Any, skip: Any, nw: Any, w: Any, cos: Any = None, sin: Any = None) -> tuple[Any, ...]:
        if qkv is not None and transposed:
            done = _qkv_rope(ctx, qkv, x, w, cos, sin, (skip, nw, eps), switch, step)
            if done is not None:
                return done
        if transposed and not _upcast_cpu_matmul(x):
            return rms_linear(x, skip, nw, eps, w, silu, is_rowwise(ctx), out_dtype=out)
        if (
            not transposed
            and (done := cpu_kernels.linear(x, w, norm=(skip, nw, eps), silu_halves=silu)) is not None
        ):
            return done if out is None else (done[0].to(out), done[1])
        h, s = rms_norm(x, skip, nw, eps)
        y = _product(h, w, None, transposed, is_rowwise(ctx), out_dtype=out, packed=packed)
        return (silu_mul_halves(y) if silu else y), s

    return f


def _cpu_has_lowp_matmul() -> bool:
    cpu = getattr(torch, "cpu", None)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, p, lambda: False)()) for p in probes)


_CPU_LOWP_MATMUL = _cpu_has_lowp_matmul()


def _upcast_cpu_matmul(x: torch.Tensor) -> bool:
    """Whether a bf16/fp16 matmul with `x` as the left operand runs as float32 on this CPU.

    NOTE: on CPUs without bf16/fp16 matrix instructions (no AVX512-BF16, no AMX) torch's low-precision
    GEMM is ~5-8x slower than float32 at prefill sizes (1.6 s vs 0.2 s for 1024 x 2048 x 8192 on two
    AVX2 cores), while converting the operands costs one pass over them. The result is the same
    function either way: products of bf16 values are exact in float32 and both accumulate in float32,
    rounding once to the output dtype. Decode rows (< 16) stay in low precision, where the weight
    conversion would dominate."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float16)
        and not _CPU_LOWP_MATMUL
        and x.numel() // max(1, x.shape[-1]) >= 16
    )


def _gemm(node: Node) -> Fn:
    alpha = float(node.attr("alpha", 1.0))
    beta = float(node.attr("beta", 1.0))
    ta, tb = int(node.attr("transA", 0)), int(node.attr("transB", 0))

    def f(ctx: Any, a: Any, b: Any, c: Any = None) -> tuple[Any, ...]:
        a, b, c = same_device(ctx, a, b, c)
        y = torch.matmul(a.t() if ta else a, b.t() if tb else b)
        if alpha != 1.0:
            y = y * alpha
        if c is not None:
            y = y + (c * beta if beta != 1.0 else c)
        return (y,)

    return f


BUILDERS: dict[tuple[str, str], Builder] = {
    (AI, "MatMul"): _matmul,
    (AI, "Gemm"): _gemm,
    (MS, "MatMulNBits"): _linear,  # the lowering dequantizes the weight at load (see `quant`)
    (INTERNAL, "Linear"): _linear,
    (INTERNAL, "LinearSiluMul"): _linear_silu_mul,
    (INTERNAL, "LinearGeluMul"): _linear_gelu_mul,
    (INTERNAL, "RmsLinear"): _rms_linear,
}
