"""Elementwise ops and activations: arithmetic, comparison and logic (binary and variadic), unary math,
Where, Softmax/LogSoftmax, the Gelu family, and the lowering's fused Silu, SiluMul and GeluMul."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from onnxgen.backends.native.kernels.norms import gelu_mul, silu_mul
from onnxgen.backends.native.ops.base import AI, INTERNAL, MS, Builder, Fn, Node, same_device

_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "Add": torch.add,
    "Sub": torch.sub,
    "Mul": torch.mul,
    "Equal": torch.eq,
    "Less": torch.lt,
    "Greater": torch.gt,
    "LessOrEqual": torch.le,
    "GreaterOrEqual": torch.ge,
    "And": torch.logical_and,
    "Or": torch.logical_or,
    "Xor": torch.logical_xor,
    "BitwiseAnd": torch.bitwise_and,
    "BitwiseOr": torch.bitwise_or,
}
_ARITH = {"Add", "Sub", "Mul", "Div", "Pow", "Mod"}


def _binary(node: Node) -> Fn:
    op = node.op
    if op == "Div":

        def f(ctx: Any, a: Any, b: Any) -> tuple[Any, ...]:
            a, b = same_device(ctx, a, b)
            if not a.dtype.is_floating_point:
                return (torch.div(a, b, rounding_mode="trunc"),)
            return (torch.div(a, b).to(a.dtype),)

        return f
    if op == "Pow":

        def f(ctx: Any, a: Any, b: Any) -> tuple[Any, ...]:
            a, b = same_device(ctx, a, b)
            if isinstance(b, torch.Tensor) and b.numel() == 1 and b.device.type == "cpu":
                e = b.item()
                if e == 2:
                    return (a * a,)
                if e == 0.5:
                    return (torch.sqrt(a),)
                return (torch.pow(a, e).to(a.dtype),)
            return (torch.pow(a, b).to(a.dtype),)

        return f
    if op == "Mod":
        fmod = int(node.attr("fmod", 0))

        def f(ctx: Any, a: Any, b: Any) -> tuple[Any, ...]:
            a, b = same_device(ctx, a, b)
            return ((torch.fmod(a, b) if fmod else torch.remainder(a, b)),)

        return f
    fn = _BINARY[op]
    arith = op in _ARITH

    def f(ctx: Any, a: Any, b: Any) -> tuple[Any, ...]:
        a, b = same_device(ctx, a, b)
        r = fn(a, b)
        if arith and r.dtype != a.dtype:
            r = r.to(a.dtype)
        return (r,)

    return f


_VARIADIC: dict[str, Callable[[Any, Any], Any]] = {
    "Max": torch.maximum,
    "Min": torch.minimum,
    "Sum": torch.add,
    "Mean": torch.add,
}


def _variadic(node: Node) -> Fn:
    fn = _VARIADIC[node.op]
    op = node.op

    def f(ctx: Any, *xs: Any) -> tuple[Any, ...]:
        xs = tuple(same_device(ctx, *xs))
        r = xs[0]
        for x in xs[1:]:
            r = fn(r, x)
        if op == "Mean":
            r = r / len(xs)
        return (r,)

    return f


_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Sqrt": torch.sqrt,
    "Reciprocal": torch.reciprocal,
    "Neg": torch.neg,
    "Sigmoid": torch.sigmoid,
    "Tanh": torch.tanh,
    "Exp": torch.exp,
    "Log": torch.log,
    "Abs": torch.abs,
    "Sin": torch.sin,
    "Cos": torch.cos,
    "Erf": torch.erf,
    "Relu": torch.relu,
    "Not": torch.logical_not,
    "Floor": torch.floor,
    "Ceil": torch.ceil,
    "Softplus": F.softplus,
    "Sign": torch.sign,
    "IsNaN": torch.isnan,
    "Round": torch.round,
}


def _unary(node: Node) -> Fn:
    fn = _UNARY[node.op]
    return lambda ctx, x: (fn(x),)


def _identity(node: Node) -> Fn:
    return lambda ctx, x: (x,)


def _where(node: Node) -> Fn:
    def f(ctx: Any, c: Any, a: Any, b: Any) -> tuple[Any, ...]:
        c, a, b = same_device(ctx, c, a, b)
        return (torch.where(c, a, b),)

    return f


def _silu(node: Node) -> Fn:  # fused by the lowering: x * sigmoid(x)
    return lambda ctx, x: (F.silu(x),)


def _silu_mul(node: Node) -> Fn:  # fused by the lowering: (g * sigmoid(g)) * u
    if node.attr("gate_dead", 0):  # the lowering proved g has no other reader: write the result into it
        return lambda ctx, g, u: (silu_mul(g, u, out=g),)
    return lambda ctx, g, u: (silu_mul(g, u),)


def _gelu_mul(node: Node) -> Fn:  # fused by the lowering: gelu_tanh(g) * u
    return lambda ctx, g, u: (gelu_mul(g, u),)


def _gelu(node: Node) -> Fn:
    approx = node.attr("approximate", "none")
    approx = approx.decode() if isinstance(approx, bytes) else approx
    return lambda ctx, x: (F.gelu(x, approximate=approx),)


def _fast_gelu(node: Node) -> Fn:
    def f(ctx: Any, x: Any, bias: Any = None) -> tuple[Any, ...]:
        if bias is not None:
            x = x + bias
        return (F.gelu(x, approximate="tanh"),)

    return f


def _quick_gelu(node: Node) -> Fn:
    alpha = float(node.attr("alpha", 1.702))
    return lambda ctx, x: (x * torch.sigmoid(alpha * x),)


def _softmax(node: Node) -> Fn:
    axis = int(node.attr("axis", -1))
    log = node.op == "LogSoftmax"

    def f(ctx: Any, x: Any) -> tuple[Any, ...]:
        return ((torch.log_softmax(x, axis) if log else torch.softmax(x, axis)),)

    return f


BUILDERS: dict[tuple[str, str], Builder] = {
    **{(AI, op): _binary for op in (*_BINARY, "Div", "Pow", "Mod")},
    **{(AI, op): _variadic for op in _VARIADIC},
    **{(AI, op): _unary for op in _UNARY},
    (AI, "Identity"): _identity,
    (AI, "Dropout"): _identity,
    (AI, "Where"): _where,
    (AI, "Softmax"): _softmax,
    (AI, "LogSoftmax"): _softmax,
    (AI, "Gelu"): _gelu,
    (MS, "FastGelu"): _fast_gelu,
    (MS, "QuickGelu"): _quick_gelu,
    (MS, "Gelu"): _gelu,
    (INTERNAL, "Silu"): _silu,
    (INTERNAL, "SiluMul"): _silu_mul,
    (INTERNAL, "GeluMul"): _gelu_mul,
}
