"""Shape arithmetic and data movement: Shape, Size, Cast, Reshape, Flatten, Transpose, Concat, Split,
(Un)Squeeze, Slice, Gather(Elements), Expand, Tile, ConstantOfShape, Range, Trilu, CumSum, the Reduce*
family, and the lowering's SliceLast. Shape, axis and index inputs are host tensors read as Python
ints (see `base`); reading one that lives on the device raises `NotCapturable` in a static step."""

from __future__ import annotations

import math
from typing import Any

import torch

from onnxgen.backends.native.kernels.norms import embedding
from onnxgen.backends.native.ops.base import (
    AI,
    INTERNAL,
    MS,
    Builder,
    Fn,
    Node,
    RunCtx,
    forbid_static,
    nonneg_axis,
    same_device,
)
from onnxgen.backends.native.weights import ONNX_TO_TORCH


def _ints(x: Any, ctx: RunCtx | None = None) -> list[int]:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            forbid_static(ctx, "device tensor read on the host in a static step")
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


def _scalar(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.reshape(-1)[0].item()
    return x


def _axes_arg(node: Node, axes_in: Any, ctx: Any) -> list[int] | None:
    if axes_in is not None:
        return _ints(axes_in, ctx)
    a = node.attr("axes")
    return list(a) if a is not None else None


def torch_dtype(onnx_type: int) -> torch.dtype:
    if onnx_type not in ONNX_TO_TORCH:
        raise ValueError(f"unsupported ONNX element type {onnx_type}")
    return ONNX_TO_TORCH[onnx_type]


def _to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


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
    return lambda ctx, x: (_to(x, to),)


def _cast_like(node: Node) -> Fn:
    return lambda ctx, x, like: (_to(x, like.dtype),)


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
        a = nonneg_axis(axis, x.dim())
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
        xs = [x for x in same_device(ctx, *xs) if x is not None]
        xs = [x for x in xs if x.numel() > 0] or xs[:1]
        return (torch.cat(xs, dim=axis) if len(xs) > 1 else xs[0],)

    return f


def _split(node: Node) -> Fn:
    axis = int(node.attr("axis", 0))
    attr_split = node.attr("split")
    num_outputs = node.attr("num_outputs")
    nout = len(node.outputs)

    def f(ctx: Any, x: Any, split: Any = None) -> tuple[Any, ...]:
        a = nonneg_axis(axis, x.dim())
        sizes = (
            _ints(split, ctx) if split is not None else (list(attr_split) if attr_split is not None else None)
        )
        if sizes is None:
            n = int(num_outputs or nout)
            chunk = -(-x.shape[a] // n)
            sizes = [min(chunk, x.shape[a] - i * chunk) for i in range(n)]
        return tuple(torch.split(x, sizes, dim=a))

    return f


def _unsqueeze(node: Node) -> Fn:
    def f(ctx: Any, x: Any, axes: Any = None) -> tuple[Any, ...]:
        ax = _axes_arg(node, axes, ctx) or []
        rank = x.dim() + len(ax)
        shape = list(x.shape)
        for a in sorted(nonneg_axis(a, rank) for a in ax):
            shape.insert(a, 1)
        return (x.reshape(shape),)

    return f


def _squeeze(node: Node) -> Fn:
    def f(ctx: Any, x: Any, axes: Any = None) -> tuple[Any, ...]:
        ax = _axes_arg(node, axes, ctx)
        if ax is None:
            return (x.reshape([d for d in x.shape if d != 1]),)
        ax = {nonneg_axis(a, x.dim()) for a in ax}
        return (x.reshape([d for i, d in enumerate(x.shape) if i not in ax]),)

    return f


def _clamp(i: int, dim: int, lo: int, hi: int) -> int:
    """A Slice start/end: negative counts from the end, then clamped to [lo, hi]."""
    return max(lo, min(hi, i + dim if i < 0 else i))


def _slice(node: Node) -> Fn:
    def f(ctx: Any, x: Any, starts: Any, ends: Any, axes: Any = None, steps: Any = None) -> tuple[Any, ...]:
        st, en = _ints(starts, ctx), _ints(ends, ctx)
        ax = _ints(axes, ctx) if axes is not None else list(range(len(st)))
        sp = _ints(steps, ctx) if steps is not None else [1] * len(st)
        out = x
        for s, e, a, p in zip(st, en, ax, sp, strict=True):
            a = nonneg_axis(a, x.dim())
            dim = x.shape[a]
            if p > 0:
                s, e = _clamp(s, dim, 0, dim), _clamp(e, dim, 0, dim)
                idx = [slice(None)] * x.dim()
                idx[a] = slice(s, max(s, e), p)
                out = out[tuple(idx)]
            else:
                s, e = _clamp(s, dim, -1, dim - 1), _clamp(e, dim, -1, dim - 1)
                ids = torch.arange(s, e, p, device=out.device)
                out = out.index_select(a, ids)
        return (out,)

    return f


def _slice_last(node: Node) -> Fn:
    """Inserted by the lowering before the lm_head: keep only the last real position (`[B, 1, H]`;
    in a padded static step its index comes from device memory), or the positions `ctx.last` lists — all
    of them, as they are (no launch), when it lists as many rows as there are positions (`RunCtx.last`)."""

    def f(ctx: RunCtx, x: Any) -> tuple[Any, ...]:
        if ctx is not None and ctx.last is not None:
            if ctx.last.numel() == x.shape[1]:  # every position is a logits row: a decode or verify step
                return (x,)
            return (x.index_select(1, ctx.last),)
        return (x[:, -1:],)

    return f


def _wrap(idx: torch.Tensor, size: int) -> torch.Tensor:
    """Negative indices count from the end of an axis of `size`."""
    return torch.where(idx < 0, idx + size, idx)


def _gather(node: Node) -> Fn:
    axis = int(node.attr("axis", 0))

    def f(ctx: Any, data: Any, idx: Any) -> tuple[Any, ...]:
        a = nonneg_axis(axis, data.dim())
        if idx.device.type == "cpu" and data.device.type == "cpu":
            idx = _wrap(idx, data.shape[a])
        elif idx.device.type == "cpu":
            forbid_static(ctx, "host indices into a device tensor")
            idx = _wrap(idx, data.shape[a]).to(data.device)
        if a == 0 and data.dim() == 2 and idx.dtype in (torch.int64, torch.int32):
            return (embedding(idx, data),)
        flat = data.index_select(a, idx.reshape(-1).long())
        shape = list(data.shape[:a]) + list(idx.shape) + list(data.shape[a + 1 :])
        return (flat.reshape(shape),)

    return f


def _gather_elements(node: Node) -> Fn:
    axis = int(node.attr("axis", 0))

    def f(ctx: Any, data: Any, idx: Any) -> tuple[Any, ...]:
        data, idx = same_device(ctx, data, idx)
        a = nonneg_axis(axis, data.dim())
        idx = _wrap(idx, data.shape[a])
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


def _constant(node: Node) -> Fn:
    raise AssertionError("Constant nodes are folded at load")


def _range(node: Node) -> Fn:
    def f(ctx: Any, start: Any, limit: Any, delta: Any) -> tuple[Any, ...]:
        dt = start.dtype if isinstance(start, torch.Tensor) else torch.int64
        s, lim, d = _scalar(start), _scalar(limit), _scalar(delta)
        n = max(math.ceil((lim - s) / d), 0)
        return (
            torch.arange(n, dtype=torch.float64).mul(d).add(s).to(dt)
            if dt.is_floating_point
            else torch.arange(s, s + n * d, d, dtype=dt)[:n],
        )

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
        a = nonneg_axis(int(_scalar(axis)), x.dim())
        y = x.flip(a) if reverse else x
        c = torch.cumsum(y, a).to(x.dtype)
        if exclusive:
            c = c - y
        return ((c.flip(a) if reverse else c),)

    return f


_REDUCE = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare")


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
        ax = [nonneg_axis(a, x.dim()) for a in ax]
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


BUILDERS: dict[tuple[str, str], Builder] = {
    **{(AI, op): _reduce for op in _REDUCE},
    (AI, "Shape"): _shape,
    (AI, "Size"): _size,
    (AI, "Cast"): _cast,
    (AI, "CastLike"): _cast_like,
    (AI, "Reshape"): _reshape,
    (AI, "Flatten"): _flatten,
    (AI, "Transpose"): _transpose,
    (AI, "Concat"): _concat,
    (AI, "Split"): _split,
    (AI, "Unsqueeze"): _unsqueeze,
    (AI, "Squeeze"): _squeeze,
    (AI, "Slice"): _slice,
    (AI, "Gather"): _gather,
    (AI, "GatherElements"): _gather_elements,
    (AI, "Expand"): _expand,
    (AI, "Tile"): _tile,
    (AI, "ConstantOfShape"): _constant_of_shape,
    (AI, "Range"): _range,
    (AI, "Trilu"): _trilu,
    (AI, "CumSum"): _cumsum,
    (AI, "Constant"): _constant,
    (MS, "GatherBlockQuantized"): _gather,  # the lowering dequantizes the table at load (see `quant`)
    (INTERNAL, "SliceLast"): _slice_last,
}
