"""Torch implementations of the ONNX ops the native backend lowers, one builder per op.

A builder takes a `Node` (op type, domain, attributes, input/output names) and returns a closure
`fn(ctx, *inputs) -> tuple(outputs)`. Values are torch tensors; "host" values (shape arithmetic,
small integer constants) are CPU tensors and stay on the CPU as long as every input of an op is on
the CPU, so `Shape -> Gather -> Concat -> Reshape` chains never touch the device. When an op mixes
host and device inputs, the host ones are moved to the device (never during a static-shape decode
step, where that raises `NotCapturable` so the decoder falls back to eager execution). A static step
(decode, or a prefill chunk padded to a bucket) reads its start position, positions and last real
token from device memory, so one captured CUDA graph serves every position.

Attention ops (`GroupQueryAttention`, ai.onnx `Attention`) and the plain `Concat(past, new)` KV
pattern are bound to the runtime's KV buffers (`onnxgen.kv.buffers.KVBuffers`) through `ctx`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from onnxgen.backends.native import kernels
from onnxgen.backends.native.rotary import rope
from onnxgen.backends.native.weights import ONNX_TO_TORCH
from onnxgen.errors import NotCapturable

Fn = Callable[..., tuple[Any, ...]]



@dataclass
class Node:
    op: str
    domain: str
    name: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    layer: int | None = None  # KV layer bound to this node (attention / KV concat)
    kv_role: str | None = None  # "key" / "value" for a bound Concat

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)


class RunCtx:
    """Per-forward state the ops read: KV buffers, positions, and whether the step is static."""

    def __init__(self, kv: Any, pos0: int, n: int, positions: torch.Tensor | None, *,
                 past: torch.Tensor | None = None, last: torch.Tensor | None = None) -> None:  # fmt: skip
        self.kv = kv
        self.pos0 = pos0  # KV length before this forward (host int; -1 when static)
        self.n = n  # tokens in this forward (static: the bucket size, padding included)
        self.positions = positions  # [n] int64 on the device: pos0 + arange(n)
        self.past = past  # static only: [1] int64 on the device, the KV length before this forward
        self.last = last  # static only: [1] int64 on the device, index of the last real token
        self.static = past is not None


# --- helpers ------------------------------------------------------------------------------------


def _same(ctx: RunCtx | None, *xs: Any) -> list[Any]:
    """Move CPU (host) tensors to the device of the first non-CPU input."""
    dev = None
    for x in xs:
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            dev = x.device
            break
    if dev is None:
        return list(xs)
    out = []
    for x in xs:
        if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0:
            if ctx is not None and ctx.static:
                raise NotCapturable("host tensor used by a device op in a static step")
            x = x.to(dev)
        out.append(x)
    return out


def _ints(x: Any, ctx: RunCtx | None = None) -> list[int]:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" and ctx is not None and ctx.static:
            raise NotCapturable("device tensor read on the host in a static step")
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


def _scalar(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.reshape(-1)[0].item()
    return x


def torch_dtype(onnx_type: int) -> torch.dtype:
    if onnx_type not in ONNX_TO_TORCH:
        raise ValueError(f"unsupported ONNX element type {onnx_type}")
    return ONNX_TO_TORCH[onnx_type]


def _axis(a: int, rank: int) -> int:
    return a + rank if a < 0 else a


# --- elementwise ----------------------------------------------------------------------------------


def _int_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.div(a, b, rounding_mode="trunc")


_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul,
    "Equal": torch.eq, "Less": torch.lt, "Greater": torch.gt, "LessOrEqual": torch.le,
    "GreaterOrEqual": torch.ge, "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor,
    "BitwiseAnd": torch.bitwise_and, "BitwiseOr": torch.bitwise_or,
}  # fmt: skip
_ARITH = {"Add", "Sub", "Mul", "Div", "Pow", "Mod"}


def _binary(node: Node) -> Fn:
    op = node.op
    if op == "Div":

        def f(ctx: Any, a: Any, b: Any) -> tuple[Any, ...]:
            a, b = _same(ctx, a, b)
            if not a.dtype.is_floating_point:
                return (_int_div(a, b),)
            return (torch.div(a, b).to(a.dtype),)

        return f
    if op == "Pow":

        def f(ctx: Any, a: Any, b: Any) -> tuple[Any, ...]:
            a, b = _same(ctx, a, b)
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
            a, b = _same(ctx, a, b)
            return ((torch.fmod(a, b) if fmod else torch.remainder(a, b)),)

        return f
    fn = _BINARY[op]
    arith = op in _ARITH

    def f(ctx: Any, a: Any, b: Any) -> tuple[Any, ...]:
        a, b = _same(ctx, a, b)
        r = fn(a, b)
        if arith and r.dtype != a.dtype:
            r = r.to(a.dtype)
        return (r,)

    return f


def _variadic(node: Node) -> Fn:
    fn = {"Max": torch.maximum, "Min": torch.minimum, "Sum": torch.add, "Mean": torch.add}[node.op]
    op = node.op

    def f(ctx: Any, *xs: Any) -> tuple[Any, ...]:
        xs = tuple(_same(ctx, *xs))
        r = xs[0]
        for x in xs[1:]:
            r = fn(r, x)
        if op == "Mean":
            r = r / len(xs)
        return (r,)

    return f


def _erf(x: torch.Tensor) -> torch.Tensor:
    return torch.erf(x)


_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Sqrt": torch.sqrt, "Reciprocal": torch.reciprocal, "Neg": torch.neg, "Sigmoid": torch.sigmoid,
    "Tanh": torch.tanh, "Exp": torch.exp, "Log": torch.log, "Abs": torch.abs, "Sin": torch.sin,
    "Cos": torch.cos, "Erf": _erf, "Relu": torch.relu, "Not": torch.logical_not, "Floor": torch.floor,
    "Ceil": torch.ceil, "Softplus": F.softplus, "Sign": torch.sign, "IsNaN": torch.isnan, "Round": torch.round,
}  # fmt: skip


def _unary(node: Node) -> Fn:
    fn = _UNARY[node.op]
    return lambda ctx, x: (fn(x),)


def _identity(node: Node) -> Fn:
    return lambda ctx, x: (x,)


def _where(node: Node) -> Fn:
    def f(ctx: Any, c: Any, a: Any, b: Any) -> tuple[Any, ...]:
        c, a, b = _same(ctx, c, a, b)
        return (torch.where(c, a, b),)

    return f


def _silu(node: Node) -> Fn:  # fused by the lowering: x * sigmoid(x)
    return lambda ctx, x: (F.silu(x),)


def _silu_mul(node: Node) -> Fn:  # fused by the lowering: (g * sigmoid(g)) * u
    if node.attr("gate_dead", 0):  # the lowering proved g has no other reader: write the result into it
        return lambda ctx, g, u: (kernels.silu_mul(g, u, out=g),)
    return lambda ctx, g, u: (kernels.silu_mul(g, u),)


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


# --- shape & data movement -------------------------------------------------------------------------


def _shape(node: Node) -> Fn:
    start = node.attr("start", 0)
    end = node.attr("end", None)

    def f(ctx: Any, x: Any) -> tuple[Any, ...]:
        dims = list(x.shape)[start:end]
        return (torch.tensor(dims, dtype=torch.int64),)

    return f


def _size(node: Node) -> Fn:
    return lambda ctx, x: (torch.tensor(x.numel(), dtype=torch.int64),)


def _cast(node: Node) -> Fn:
    to = torch_dtype(int(node.attr("to")))
    return lambda ctx, x: ((x if x.dtype == to else x.to(to)),)


def _cast_like(node: Node) -> Fn:
    return lambda ctx, x, like: ((x if x.dtype == like.dtype else x.to(like.dtype)),)


def _reshape(node: Node) -> Fn:
    allowzero = int(node.attr("allowzero", 0))

    def f(ctx: Any, x: Any, shape: Any) -> tuple[Any, ...]:
        dims = _ints(shape, ctx)
        if not allowzero:
            dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
        return (x.reshape(dims),)

    return f


def _flatten(node: Node) -> Fn:
    axis = int(node.attr("axis", 1))

    def f(ctx: Any, x: Any) -> tuple[Any, ...]:
        a = _axis(axis, x.dim())
        lead = math.prod(x.shape[:a])
        return (x.reshape(lead, -1),)

    return f


def _transpose(node: Node) -> Fn:
    perm = node.attr("perm")

    def f(ctx: Any, x: Any) -> tuple[Any, ...]:
        p = perm if perm is not None else list(range(x.dim()))[::-1]
        return (x.permute(*p),)

    return f


def _concat(node: Node) -> Fn:
    axis = int(node.attr("axis"))

    def f(ctx: Any, *xs: Any) -> tuple[Any, ...]:
        xs = [x for x in _same(ctx, *xs) if x is not None]
        xs = [x for x in xs if x.numel() > 0] or xs[:1]
        return (torch.cat(xs, dim=axis) if len(xs) > 1 else xs[0],)

    return f


def _split(node: Node) -> Fn:
    axis = int(node.attr("axis", 0))
    attr_split = node.attr("split")
    num_outputs = node.attr("num_outputs")
    nout = len(node.outputs)

    def f(ctx: Any, x: Any, split: Any = None) -> tuple[Any, ...]:
        a = _axis(axis, x.dim())
        sizes = (
            _ints(split, ctx) if split is not None else (list(attr_split) if attr_split is not None else None)
        )
        if sizes is None:
            n = int(num_outputs or nout)
            chunk = -(-x.shape[a] // n)
            sizes = [min(chunk, x.shape[a] - i * chunk) for i in range(n)]
        return tuple(torch.split(x, sizes, dim=a))

    return f


def _axes_arg(node: Node, axes_in: Any, ctx: Any) -> list[int] | None:
    if axes_in is not None:
        return _ints(axes_in, ctx)
    a = node.attr("axes")
    return list(a) if a is not None else None


def _unsqueeze(node: Node) -> Fn:
    def f(ctx: Any, x: Any, axes: Any = None) -> tuple[Any, ...]:
        ax = _axes_arg(node, axes, ctx) or []
        rank = x.dim() + len(ax)
        shape = list(x.shape)
        for a in sorted(_axis(a, rank) for a in ax):
            shape.insert(a, 1)
        return (x.reshape(shape),)

    return f


def _squeeze(node: Node) -> Fn:
    def f(ctx: Any, x: Any, axes: Any = None) -> tuple[Any, ...]:
        ax = _axes_arg(node, axes, ctx)
        if ax is None:
            return (x.reshape([d for d in x.shape if d != 1]),)
        ax = {_axis(a, x.dim()) for a in ax}
        return (x.reshape([d for i, d in enumerate(x.shape) if i not in ax]),)

    return f


def _slice(node: Node) -> Fn:
    def f(ctx: Any, x: Any, starts: Any, ends: Any, axes: Any = None, steps: Any = None) -> tuple[Any, ...]:
        st, en = _ints(starts, ctx), _ints(ends, ctx)
        ax = _ints(axes, ctx) if axes is not None else list(range(len(st)))
        sp = _ints(steps, ctx) if steps is not None else [1] * len(st)
        out = x
        for s, e, a, p in zip(st, en, ax, sp, strict=True):
            a = _axis(a, x.dim())
            dim = x.shape[a]
            if p > 0:
                s = max(0, min(dim, s + dim if s < 0 else s))
                e = max(0, min(dim, e + dim if e < 0 else e))
                idx = [slice(None)] * x.dim()
                idx[a] = slice(s, max(s, e), p)
                out = out[tuple(idx)]
            else:
                s = max(-1, min(dim - 1, s + dim if s < 0 else s))
                e = max(-1, min(dim - 1, e + dim if e < 0 else e))
                ids = torch.arange(s, e, p, device=out.device)
                out = out.index_select(a, ids)
        return (out,)

    return f


def _gather(node: Node) -> Fn:
    axis = int(node.attr("axis", 0))

    def f(ctx: Any, data: Any, idx: Any) -> tuple[Any, ...]:
        a = _axis(axis, data.dim())
        if idx.device.type == "cpu" and data.device.type == "cpu":
            idx = torch.where(idx < 0, idx + data.shape[a], idx)
        elif idx.device.type == "cpu":
            if ctx is not None and ctx.static:
                raise NotCapturable("host indices into a device tensor")
            idx = torch.where(idx < 0, idx + data.shape[a], idx).to(data.device)
        if a == 0 and data.dim() == 2 and idx.dtype in (torch.int64, torch.int32):
            return (F.embedding(idx, data),)
        flat = data.index_select(a, idx.reshape(-1).long())
        shape = list(data.shape[:a]) + list(idx.shape) + list(data.shape[a + 1 :])
        return (flat.reshape(shape),)

    return f


def _gather_elements(node: Node) -> Fn:
    axis = int(node.attr("axis", 0))

    def f(ctx: Any, data: Any, idx: Any) -> tuple[Any, ...]:
        data, idx = _same(ctx, data, idx)
        a = _axis(axis, data.dim())
        idx = torch.where(idx < 0, idx + data.shape[a], idx)
        return (torch.gather(data, a, idx.long()),)

    return f


def _expand(node: Node) -> Fn:
    def f(ctx: Any, x: Any, shape: Any) -> tuple[Any, ...]:
        dims = _ints(shape, ctx)
        out = torch.broadcast_shapes(tuple(x.shape), tuple(dims))
        return (x.expand(out),)

    return f


def _tile(node: Node) -> Fn:
    return lambda ctx, x, reps: (x.repeat(*_ints(reps, ctx)),)


def _constant_of_shape(node: Node) -> Fn:
    val = node.attr("value")

    def f(ctx: Any, shape: Any) -> tuple[Any, ...]:
        dims = _ints(shape, ctx)
        if val is None:
            return (torch.zeros(dims, dtype=torch.float32),)
        return (torch.full(dims, val.reshape(-1)[0].item(), dtype=val.dtype),)

    return f


def _range(node: Node) -> Fn:
    def f(ctx: Any, start: Any, limit: Any, delta: Any) -> tuple[Any, ...]:
        dt = start.dtype if isinstance(start, torch.Tensor) else torch.int64
        s, lim, d = _scalar(start), _scalar(limit), _scalar(delta)
        n = max(math.ceil((lim - s) / d), 0)
        return (torch.arange(n, dtype=torch.float64).mul(d).add(s).to(dt) if dt.is_floating_point
                else torch.arange(s, s + n * d, d, dtype=dt)[:n],)  # fmt: skip

    return f


def _trilu(node: Node) -> Fn:
    upper = int(node.attr("upper", 1))

    def f(ctx: Any, x: Any, k: Any = None) -> tuple[Any, ...]:
        kk = int(_scalar(k)) if k is not None else 0
        return ((torch.triu(x, kk) if upper else torch.tril(x, kk)),)

    return f


def _cumsum(node: Node) -> Fn:
    exclusive = int(node.attr("exclusive", 0))
    reverse = int(node.attr("reverse", 0))

    def f(ctx: Any, x: Any, axis: Any) -> tuple[Any, ...]:
        a = _axis(int(_scalar(axis)), x.dim())
        y = x.flip(a) if reverse else x
        c = torch.cumsum(y, a).to(x.dtype)
        if exclusive:
            c = c - y
        return ((c.flip(a) if reverse else c),)

    return f


def _reduce(node: Node) -> Fn:
    op = node.op
    keep = bool(node.attr("keepdims", 1))
    noop = int(node.attr("noop_with_empty_axes", 0))

    def f(ctx: Any, x: Any, axes: Any = None) -> tuple[Any, ...]:
        ax = _axes_arg(node, axes, ctx)
        if not ax:
            if noop:
                return (x,)
            ax = list(range(x.dim()))
        ax = [_axis(a, x.dim()) for a in ax]
        if op == "ReduceSum":
            r = torch.sum(x, dim=ax, keepdim=keep, dtype=x.dtype)
        elif op == "ReduceMean":
            r = torch.mean(x, dim=ax, keepdim=keep)
        elif op == "ReduceMax":
            r = torch.amax(x, dim=ax, keepdim=keep)
        elif op == "ReduceMin":
            r = torch.amin(x, dim=ax, keepdim=keep)
        elif op == "ReduceProd":
            r = x
            for a in sorted(ax, reverse=True):
                r = torch.prod(r, dim=a, keepdim=keep)
        else:  # ReduceSumSquare
            r = torch.sum(x * x, dim=ax, keepdim=keep)
        return (r,)

    return f


def _constant(node: Node) -> Fn:
    raise AssertionError("Constant nodes are folded at load")


# --- linear algebra ------------------------------------------------------------------------------------


def _matmul(node: Node) -> Fn:
    def f(ctx: Any, a: Any, b: Any) -> tuple[Any, ...]:
        a, b = _same(ctx, a, b)
        return (torch.matmul(a, b),)

    return f


def _linear(node: Node) -> Fn:
    """MatMul / MatMulNBits / Gemm with a constant weight, rewritten by the lowering.

    The weight input is either `[K, N]` (CPU: `x @ w`) or `[N, K]` (`transposed`, CUDA: `F.linear`)."""
    transposed = bool(node.attr("_transposed", 0))

    def f(ctx: Any, x: Any, w: Any, bias: Any = None) -> tuple[Any, ...]:
        if transposed and _upcast_cpu_matmul(x):
            y = F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)
            return (y,)
        y = F.linear(x, w, bias) if transposed else torch.matmul(x, w)
        if bias is not None and not transposed:
            y = y + bias
        return (y,)

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
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and not _CPU_LOWP_MATMUL
            and x.numel() // max(1, x.shape[-1]) >= 16)  # fmt: skip


def _gemm(node: Node) -> Fn:
    alpha = float(node.attr("alpha", 1.0))
    beta = float(node.attr("beta", 1.0))
    ta, tb = int(node.attr("transA", 0)), int(node.attr("transB", 0))

    def f(ctx: Any, a: Any, b: Any, c: Any = None) -> tuple[Any, ...]:
        a, b, c = _same(ctx, a, b, c)
        y = torch.matmul(a.t() if ta else a, b.t() if tb else b)
        if alpha != 1.0:
            y = y * alpha
        if c is not None:
            y = y + (c * beta if beta != 1.0 else c)
        return (y,)

    return f


# --- normalization --------------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor | None, eps: float, dims: int = 1) -> torch.Tensor:
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

    def f(ctx: Any, x: Any, w: Any) -> tuple[Any, ...]:
        dims = x.dim() - _axis(axis, x.dim())
        if dims == 1:
            return (kernels.rms_norm(x, None, w, eps)[0], *pad)
        return (_rms(x, w, eps, dims), *pad)

    return f


def _simplified_ln(node: Node) -> Fn:
    return _rms_norm_fn(node, 1)


def _skip_simplified_ln(node: Node) -> Fn:
    eps = float(node.attr("epsilon", 1e-5))
    want_sum = len(node.outputs) > 3 and bool(node.outputs[3])

    def f(ctx: Any, x: Any, skip: Any, w: Any, bias: Any = None) -> tuple[Any, ...]:
        if bias is not None:
            x = x + bias
        if x.shape != skip.shape:  # a broadcast skip (rare): materialise it, same kernel
            x, skip = torch.broadcast_tensors(x, skip)
            x, skip = x.contiguous(), skip.contiguous()
        y, s = kernels.rms_norm(x, skip, w, eps)
        return (y, None, None, s if want_sum else None)

    return f


def _layer_norm(node: Node) -> Fn:
    eps = float(node.attr("epsilon", 1e-5))
    axis = int(node.attr("axis", -1))

    def f(ctx: Any, x: Any, w: Any, b: Any = None) -> tuple[Any, ...]:
        a = _axis(axis, x.dim())
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


def _rms_norm23(node: Node) -> Fn:
    return _rms_norm_fn(node, 0)


# --- rotary ---------------------------------------------------------------------------------------


def _rotary_ms(node: Node) -> Fn:
    """com.microsoft RotaryEmbedding(input, position_ids, cos_cache, sin_cache)."""
    interleaved = bool(node.attr("interleaved", 0))
    num_heads = int(node.attr("num_heads", 0))

    def f(ctx: Any, x: Any, pos: Any, cos_c: Any, sin_c: Any) -> tuple[Any, ...]:
        x, pos, cos_c, sin_c = _same(ctx, x, pos, cos_c, sin_c)
        four = x.dim() == 4
        b = x.shape[0]
        s = x.shape[2] if four else x.shape[1]
        if pos.numel() == 1:
            pos = pos.reshape(1, 1) + torch.arange(s, device=pos.device).reshape(1, s)
        pos = pos.reshape(-1, s).long()
        cos = cos_c[pos].unsqueeze(2)  # [B, S, 1, rd/2]
        sin = sin_c[pos].unsqueeze(2)
        if four:
            xs = x.transpose(1, 2)  # [B, S, N, H]
            return (rope(xs, cos, sin, interleaved).transpose(1, 2),)
        nh = num_heads or x.shape[2] // (2 * cos_c.shape[1])
        xs = x.reshape(b, s, nh, -1)
        return (rope(xs, cos, sin, interleaved).reshape(x.shape),)

    return f


def _rotary_23(node: Node) -> Fn:
    """ai.onnx RotaryEmbedding(X, cos_cache, sin_cache, position_ids?) (opset 23)."""
    interleaved = bool(node.attr("interleaved", 0))
    num_heads = int(node.attr("num_heads", 0))
    rot_dim = int(node.attr("rotary_embedding_dim", 0))

    def f(ctx: Any, x: Any, cos_c: Any, sin_c: Any, pos: Any = None) -> tuple[Any, ...]:
        x, cos_c, sin_c, pos = _same(ctx, x, cos_c, sin_c, pos)
        four = x.dim() == 4
        b = x.shape[0]
        s = x.shape[2] if four else x.shape[1]
        if pos is not None:
            cos, sin = cos_c[pos.long()], sin_c[pos.long()]  # [B, S, rd/2]
        else:
            cos, sin = cos_c, sin_c
        if rot_dim:
            cos, sin = cos[..., : rot_dim // 2], sin[..., : rot_dim // 2]
        cos, sin = cos.reshape(-1, s, 1, cos.shape[-1]), sin.reshape(-1, s, 1, sin.shape[-1])
        if four:
            return (rope(x.transpose(1, 2), cos, sin, interleaved).transpose(1, 2),)
        xs = x.reshape(b, s, num_heads, -1)
        return (rope(xs, cos, sin, interleaved).reshape(x.shape),)

    return f


# --- attention over the runtime's KV ----------------------------------------------------------------


def _sdpa_kernels() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


_FLASH = [True]  # cleared if this torch build cannot run flash attention on our shapes


def attend(ctx: RunCtx, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, *, scale: float,
           softcap: float = 0.0, window: int = -1, bias: torch.Tensor | None = None,
           mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Append `k`/`v` (`[1, Hkv, S, D]`; None when already written) to layer `layer`'s KV and attend
    `q` (`[1, N, S, D]`) over it.

    Causal, aligned bottom-right: query i (absolute position pos0 + i) sees keys j <= pos0 + i, and with
    `window` > 0 only the last `window` of them, j > pos0 + i - window (onnxruntime's local_window_size). `bias` is added to the scores; `mask` (bool, True =
    keep, or additive float) is combined with the causal mask. Returns `[1, N, S, D]`."""
    kv = ctx.kv
    s = q.shape[2]
    if ctx.static:
        if bias is not None or mask is not None:
            raise NotCapturable("an attention bias or mask in a static step")
        if k is not None:  # None: the caller already wrote this step's k/v at `ctx.positions`
            kv.write_at(layer, ctx.positions, k, v)
        return kernels.cache_attention(q, kv.keys[layer], kv.values[layer], ctx.past, scale, softcap, window)
    pos0 = ctx.pos0
    if k is not None:  # None: the caller already wrote this step's k/v at [pos0, pos0 + s)
        kv.write(layer, pos0, k, v)
    total = pos0 + s
    kk, vv = kv.view(layer, total)
    n, hkv = q.shape[1], kk.shape[1]
    if (_FLASH[0] and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and softcap <= 0
            and bias is None and mask is None and window <= 0 and q.shape[-1] % 8 == 0):  # fmt: skip
        # Flash attention reads the grouped KV as it is (no repeat_interleave copy of the whole cache) and
        # its causal mask is aligned bottom-right, which is what a chunk after cached tokens needs.
        try:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, kk, vv, 0.0, is_causal=True, return_debug_mask=False, scale=scale
            )[0]
        except RuntimeError as exc:  # an unsupported shape/build: fall back for the rest of the process
            _FLASH[0] = False
            import logging

            logging.getLogger(__name__).warning("flash attention unavailable (%s); using SDPA", exc)
    if n != hkv:
        kk = kk.repeat_interleave(n // hkv, dim=1)
        vv = vv.repeat_interleave(n // hkv, dim=1)
    if softcap > 0:
        scores = torch.matmul(q.float(), kk.float().transpose(-1, -2)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores + _causal_bias(pos0, s, total, window, q.device, torch.float32)
        if bias is not None:
            scores = scores + bias.float()
        if mask is not None:
            scores = scores + _as_additive(mask, torch.float32)
        p = torch.softmax(scores, dim=-1)
        return torch.matmul(p, vv.float()).to(q.dtype)
    if bias is None and mask is None and window <= 0 and (pos0 == 0 or s == 1):
        attn_mask, causal = None, s > 1
    else:
        attn_mask = _causal_bias(pos0, s, total, window, q.device, q.dtype)
        if bias is not None:
            attn_mask = attn_mask + bias.to(q.dtype)
        if mask is not None:
            attn_mask = attn_mask + _as_additive(mask, q.dtype)
        causal = False
    if q.device.type == "cuda":
        with _sdpa_kernels():
            return F.scaled_dot_product_attention(
                q, kk, vv, attn_mask=attn_mask, is_causal=causal, scale=scale
            )
    # CPU: explicit math (torch's CPU flash kernel costs milliseconds per call at decode sizes), in
    # float32 whatever the storage dtype: scores, softmax and the weighted sum over the keys accumulate
    # as onnxruntime's kernels do, and the output is rounded once.
    scores = torch.matmul(q.float(), kk.float().transpose(-1, -2)) * scale
    if causal:
        attn_mask = _causal_bias(pos0, s, total, window, q.device, torch.float32)
    if attn_mask is not None:
        scores = scores + attn_mask.float()
    return torch.matmul(torch.softmax(scores, dim=-1), vv.float()).to(q.dtype)


def _causal_bias(pos0: int, s: int, total: int, window: int, device: Any, dtype: torch.dtype) -> torch.Tensor:
    qpos = torch.arange(pos0, pos0 + s, device=device).unsqueeze(1)
    kpos = torch.arange(total, device=device).unsqueeze(0)
    keep = kpos <= qpos
    if window > 0:
        keep = keep & (kpos > qpos - window)
    out = torch.zeros((s, total), dtype=dtype, device=device)
    return out.masked_fill_(~keep, float("-inf"))


def _as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.to(dtype)


def _gqa(node: Node) -> Fn:
    """com.microsoft GroupQueryAttention bound to KV layer `node.layer` (seqlens/total come from the runtime)."""
    n = int(node.attr("num_heads"))
    hkv = int(node.attr("kv_num_heads"))
    scale_attr = float(node.attr("scale", 0.0) or 0.0)
    softcap = float(node.attr("softcap", 0.0) or 0.0)
    window = int(node.attr("local_window_size", -1))
    do_rotary = int(node.attr("do_rotary", 0))
    interleaved = bool(node.attr("rotary_interleaved", 0))
    qn_eps = float(node.attr("q_norm_epsilon", node.attr("qk_norm_epsilon", 1e-6)))
    kn_eps = float(node.attr("k_norm_epsilon", node.attr("qk_norm_epsilon", 1e-6)))
    layer = node.layer
    assert layer is not None

    def f(ctx: RunCtx, query: Any, key: Any = None, value: Any = None, _pk: Any = None, _pv: Any = None,
          _seqlens: Any = None, _total: Any = None, cos_c: Any = None, sin_c: Any = None, _pos: Any = None,
          bias: Any = None, _sink: Any = None, _ks: Any = None, _vs: Any = None, qnw: Any = None,
          knw: Any = None, *_: Any) -> tuple[Any, ...]:  # fmt: skip
        b, s, _h = query.shape
        if key is None:
            d = query.shape[2] // (n + 2 * hkv)
            q = query[..., : n * d].reshape(b, s, n, d)
            k = query[..., n * d : (n + hkv) * d].reshape(b, s, hkv, d)
            v = query[..., (n + hkv) * d :].reshape(b, s, hkv, d)
        else:
            d = query.shape[2] // n
            q = query.reshape(b, s, n, d)
            k = key.reshape(b, s, hkv, d)
            v = value.reshape(b, s, hkv, d)
        if qnw is not None:
            q = _rms(q, qnw, qn_eps)
            k = _rms(k, knw, kn_eps)
        scale = scale_attr or 1.0 / math.sqrt(d)
        if bias is not None:
            bias, = _same(ctx, bias)  # fmt: skip
        if key is None and do_rotary and qnw is None:
            # one fused launch: rotary on q and k, k/v written into the cache at their positions
            assert ctx.static or ctx.pos0 + s <= ctx.kv.capacity
            q = kernels.rope_qkv_write(query, cos_c, sin_c, ctx.positions, ctx.kv, layer, n, hkv, d, interleaved)
            o = attend(ctx, layer, q, None, None, scale=scale, softcap=softcap, window=window, bias=bias)
            return (o.transpose(1, 2).reshape(b, s, n * d), None, None)
        if do_rotary:
            pos = ctx.positions
            cos = cos_c.index_select(0, pos).unsqueeze(1)  # [S, 1, rd/2]
            sin = sin_c.index_select(0, pos).unsqueeze(1)
            q, k = rope(q, cos, sin, interleaved), rope(k, cos, sin, interleaved)
        o = attend(ctx, layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
                   softcap=softcap, window=window, bias=bias)  # fmt: skip
        return (o.transpose(1, 2).reshape(b, s, n * d), None, None)

    return f


def _attention23(node: Node) -> Fn:
    """ai.onnx Attention (opset 23) with past_key/past_value bound to KV layer `node.layer`."""
    qh = int(node.attr("q_num_heads", 0))
    kh = int(node.attr("kv_num_heads", 0))
    scale_attr = node.attr("scale")
    softcap = float(node.attr("softcap", 0.0) or 0.0)
    causal = int(node.attr("is_causal", 0))
    layer = node.layer
    assert layer is not None

    def f(ctx: RunCtx, q: Any, k: Any, v: Any, mask: Any = None, *_: Any) -> tuple[Any, ...]:
        three = q.dim() == 3
        if three:
            b, s, _ = q.shape
            q4 = q.reshape(b, s, qh, -1).transpose(1, 2)
            k4 = k.reshape(b, k.shape[1], kh, -1).transpose(1, 2)
            v4 = v.reshape(b, v.shape[1], kh, -1).transpose(1, 2)
        else:
            q4, k4, v4 = q, k, v
        d = q4.shape[-1]
        scale = float(scale_attr) if scale_attr else 1.0 / math.sqrt(d)
        if mask is not None:
            mask, = _same(ctx, mask)  # fmt: skip
            if mask.device != q4.device:
                mask = mask.to(q4.device)
        if not causal and mask is None and q4.shape[2] > 1:
            raise NotImplementedError("non-causal Attention without a mask over a KV cache")
        o = attend(ctx, layer, q4, k4, v4, scale=scale, softcap=softcap, mask=mask)
        if three:
            o = o.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)
        return (o, None, None, None)

    return f


def _kv_concat(node: Node) -> Fn:
    """`Concat(past, new, axis=2) -> present.L.*` bound to KV layer `node.layer`: writes `new` in place,
    returns a view of the valid prefix."""
    layer = node.layer
    role = node.kv_role
    assert layer is not None and role in ("key", "value")

    def f(ctx: RunCtx, _past: Any, new: Any) -> tuple[Any, ...]:
        if ctx.static:
            raise NotCapturable("plain KV concat has a dynamic shape")
        kv = ctx.kv
        s = new.shape[2]
        buf = kv.keys[layer] if role == "key" else kv.values[layer]
        buf[:, :, ctx.pos0 : ctx.pos0 + s].copy_(new)
        return (buf[:, :, : ctx.pos0 + s],)

    return f


# --- quantized ------------------------------------------------------------------------------------------


def dequant_matmul_nbits(b: torch.Tensor, scales: torch.Tensor, zp: torch.Tensor | None, k: int, n: int,
                         bits: int, block: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """MatMulNBits' B (uint8 `[N, n_blocks, blob]`) -> dense `[N, K]` in `dtype` (computed in float32)."""
    if bits != 4:
        raise NotImplementedError(f"MatMulNBits bits={bits}")
    nb = (k + block - 1) // block
    b = b.reshape(n, nb, block // 2).to(torch.uint8)
    lo, hi = (b & 0x0F), (b >> 4)
    q = torch.stack((lo, hi), dim=-1).reshape(n, nb, block).float()
    sc = scales.reshape(n, nb, 1).float()
    if zp is None:
        z = torch.full((n, nb, 1), 8.0, device=b.device)
    elif zp.dtype == torch.uint8:
        per_row = (nb + 1) // 2
        zb = zp.reshape(n, per_row)
        zz = torch.stack(((zb & 0x0F), (zb >> 4)), dim=-1).reshape(n, per_row * 2)[:, :nb]
        z = zz.float().reshape(n, nb, 1)
    else:
        z = zp.reshape(n, nb, 1).float()
    w = ((q - z) * sc).reshape(n, nb * block)[:, :k]
    return w.to(dtype).contiguous()


def dequant_gather_block(data: torch.Tensor, scales: torch.Tensor, zp: torch.Tensor | None, *, bits: int,
                         block: int, quant_axis: int, signed: bool, shape: tuple[int, ...]) -> torch.Tensor:  # fmt: skip
    """GatherBlockQuantized's table -> dense float (scales' dtype). `data` is packed uint8 for 4 bits."""
    if bits != 4:
        raise NotImplementedError(f"GatherBlockQuantized bits={bits}")
    raw = data.reshape(-1).to(torch.uint8)
    vals = torch.stack(((raw & 0x0F), (raw >> 4)), dim=-1).reshape(-1)[: math.prod(shape)].to(torch.int16)
    if signed:
        vals = torch.where(vals >= 8, vals - 16, vals)
    q = vals.reshape(shape).float()
    qa = _axis(quant_axis, len(shape))
    sc = scales.float().repeat_interleave(block, dim=qa).narrow(qa, 0, shape[qa])
    if zp is None:
        z = torch.zeros((), device=data.device) if signed else torch.full((), 8.0, device=data.device)
    else:
        zshape = list(scales.shape)
        if zp.dim() >= 2:  # uint8 zero points: packed per row along the last axis
            zr = zp.to(torch.uint8)
            zv = torch.stack(((zr & 0x0F), (zr >> 4)), dim=-1).reshape(*zr.shape[:-1], -1)[..., : zshape[-1]]
            zv = zv.reshape(-1).to(torch.int16)
        else:  # INT4/UINT4 tensor: packed flat
            zraw = zp.reshape(-1).to(torch.uint8)
            zv = (
                torch.stack(((zraw & 0x0F), (zraw >> 4)), dim=-1)
                .reshape(-1)[: math.prod(zshape)]
                .to(torch.int16)
            )
        if signed:
            zv = torch.where(zv >= 8, zv - 16, zv)
        z = zv.reshape(zshape).float().repeat_interleave(block, dim=qa).narrow(qa, 0, shape[qa])
    return ((q - z) * sc).to(scales.dtype)


def _slice_last(node: Node) -> Fn:
    """Inserted by the lowering before the lm_head: keep only the last real position (`[B, 1, H]`;
    in a padded static step its index comes from device memory)."""

    def f(ctx: RunCtx, x: Any) -> tuple[Any, ...]:
        if ctx is not None and ctx.last is not None:
            return (x.index_select(1, ctx.last),)
        return (x[:, -1:],)

    return f


# --- registry ---------------------------------------------------------------------------------------

AI = ""
MS = "com.microsoft"
BUILDERS: dict[tuple[str, str], Callable[[Node], Fn]] = {}
for _op in (*_BINARY, "Div", "Pow", "Mod"):
    BUILDERS[(AI, _op)] = _binary
for _op in ("Max", "Min", "Sum", "Mean"):
    BUILDERS[(AI, _op)] = _variadic
for _op in _UNARY:
    BUILDERS[(AI, _op)] = _unary
for _op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare"):
    BUILDERS[(AI, _op)] = _reduce
BUILDERS.update({
    (AI, "Identity"): _identity, (AI, "Dropout"): _identity, (AI, "Where"): _where,
    (AI, "Softmax"): _softmax, (AI, "LogSoftmax"): _softmax, (AI, "Gelu"): _gelu,
    (AI, "Shape"): _shape, (AI, "Size"): _size, (AI, "Cast"): _cast, (AI, "CastLike"): _cast_like,
    (AI, "Reshape"): _reshape, (AI, "Flatten"): _flatten, (AI, "Transpose"): _transpose, (AI, "Concat"): _concat,
    (AI, "Split"): _split, (AI, "Unsqueeze"): _unsqueeze, (AI, "Squeeze"): _squeeze, (AI, "Slice"): _slice,
    (AI, "Gather"): _gather, (AI, "GatherElements"): _gather_elements, (AI, "Expand"): _expand,
    (AI, "Tile"): _tile, (AI, "ConstantOfShape"): _constant_of_shape, (AI, "Range"): _range,
    (AI, "Trilu"): _trilu, (AI, "CumSum"): _cumsum, (AI, "Constant"): _constant, (AI, "MatMul"): _matmul,
    (AI, "Gemm"): _gemm, (AI, "LayerNormalization"): _layer_norm, (AI, "RMSNormalization"): _rms_norm23,
    (AI, "RotaryEmbedding"): _rotary_23, (AI, "Attention"): _attention23,
    (AI, "SimplifiedLayerNormalization"): _simplified_ln,
    (MS, "SimplifiedLayerNormalization"): _simplified_ln,
    (MS, "SkipSimplifiedLayerNormalization"): _skip_simplified_ln, (MS, "SkipLayerNormalization"): _skip_ln,
    (MS, "RotaryEmbedding"): _rotary_ms, (MS, "GroupQueryAttention"): _gqa, (MS, "FastGelu"): _fast_gelu,
    (MS, "QuickGelu"): _quick_gelu, (MS, "Gelu"): _gelu,
    (MS, "MatMulNBits"): _linear, (MS, "GatherBlockQuantized"): _gather,
    # internal ops produced by the lowering
    ("onnxgen", "Linear"): _linear, ("onnxgen", "Silu"): _silu, ("onnxgen", "SiluMul"): _silu_mul,
    ("onnxgen", "SliceLast"): _slice_last, ("onnxgen", "KVConcat"): _kv_concat,
})  # fmt: skip


def supported_ops() -> list[str]:
    """Public op names (domain-qualified for contrib ops) the native backend lowers."""
    out = []
    for dom, op in BUILDERS:
        if dom == "onnxgen":
            continue
        out.append(op if dom == AI else f"{dom}::{op}")
    return sorted(set(out))
