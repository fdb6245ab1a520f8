"""Normalisations: the RMSNorm family (com.microsoft (Skip)SimplifiedLayerNormalization, ai.onnx
RMSNormalization) on the fused `kernels.norms.rms_norm`, and LayerNormalization / SkipLayerNormalization.
Each computes in float32 and rounds its outputs once."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from onnxgen.backends.native.kernels.norms import rms_norm
from onnxgen.backends.native.ops.base import AI, MS, Builder, Fn, Node, nonneg_axis

# the lowering's `_out_dtype` (a Cast folded into the norm: ONNX element types) -> torch dtypes
_OUT_DTYPES = {10: torch.float16, 16: torch.bfloat16}


def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float, dims: int = 1) -> torch.Tensor:
    """RMS normalisation over the last `dims` axes, computed in float32 and rounded once (as
    onnxruntime's kernels do: the weight multiplies the float32 value, not a rounded one)."""
    xf = x.float()
    red = tuple(range(-dims, 0))
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=red, keepdim=True) + eps)
    if w is not None:
        y = y * w.float()
    return y.to(x.dtype)


def _rms_norm_fn(node: Node, extra_outputs: int) -> Fn:
    """RMS normalisation over the axes from `axis` on; `extra_outputs` trailing None outputs (the
    com.microsoft op declares an inverse-std-dev output nothing reads)."""
    eps = float(node.attr("epsilon", 1e-5))
    axis = int(node.attr("axis", -1))
    pad = (None,) * extra_outputs
    out = _OUT_DTYPES.get(node.attr("_out_dtype"))

    def f(ctx: Any, x: Any, w: Any) -> tuple[Any, ...]:
        dims = x.dim() - nonneg_axis(axis, x.dim())
        if dims == 1:
            return (rms_norm(x, None, w, eps, out)[0], *pad)
        y = rms(x, w, eps, dims)
        return (y if out is None else y.to(out), *pad)

    return f


def _simplified_ln(node: Node) -> Fn:
    return _rms_norm_fn(node, 1)


def _rms_norm23(node: Node) -> Fn:
    return _rms_norm_fn(node, 0)


def _skip_simplified_ln(node: Node) -> Fn:
    eps = float(node.attr("epsilon", 1e-5))
    want_sum = len(node.outputs) > 3 and bool(node.outputs[3])
    out = _OUT_DTYPES.get(node.attr("_out_dtype"))

    def f(ctx: Any, x: Any, skip: Any, w: Any, bias: Any = None) -> tuple[Any, ...]:
        if bias is not None:
            x = x + bias
        if x.shape != skip.shape:  # a broadcast skip (rare): materialise it, same kernel
            x, skip = torch.broadcast_tensors(x, skip)
            x, skip = x.contiguous(), skip.contiguous()
        y, s = rms_norm(x, skip, w, eps, out)
        return (y, None, None, s if want_sum else None)

    return f


def _layer_norm(node: Node) -> Fn:
    eps = float(node.attr("epsilon", 1e-5))
    axis = int(node.attr("axis", -1))

    def f(ctx: Any, x: Any, w: Any, b: Any = None) -> tuple[Any, ...]:
        a = nonneg_axis(axis, x.dim())
        shape = tuple(x.shape[a:])
        xf = x.float()
        y = F.layer_norm(
            xf, shape, w.float().expand(shape), None if b is None else b.float().expand(shape), eps
        )
        return (y.to(x.dtype), None, None)

    return f


def _skip_ln(node: Node) -> Fn:
    eps = float(node.attr("epsilon", 1e-12))

    def f(ctx: Any, x: Any, skip: Any, w: Any, beta: Any = None, bias: Any = None) -> tuple[Any, ...]:
        s = x + skip
        if bias is not None:
            s = s + bias
        y = F.layer_norm(s.float(), (s.shape[-1],), w.float(), None if beta is None else beta.float(), eps)
        return (y.to(x.dtype), None, None, s)

    return f


BUILDERS: dict[tuple[str, str], Builder] = {
    (AI, "RMSNormalization"): _rms_norm23,
    (AI, "LayerNormalization"): _layer_norm,
    (AI, "SimplifiedLayerNormalization"): _simplified_ln,
    (MS, "SimplifiedLayerNormalization"): _simplified_ln,
    (MS, "SkipSimplifiedLayerNormalization"): _skip_simplified_ln,
    (MS, "SkipLayerNormalization"): _skip_ln,
}
