"""Attention over the runtime's KV: `attend` (append this step's keys/values to a layer's buffers, then
causal attention over them), the ops bound to a KV layer by the lowering (com.microsoft
GroupQueryAttention, ai.onnx Attention of opset 23, and the plain `Concat(past, new)` KV pattern), and
the causal / additive masks. The KV buffers (`onnxgen.kv.buffers.KVBuffers`) come through `ctx`."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from onnxgen.backends.native import paged
from onnxgen.backends.native.kernels.attention import QKNorm, cache_attention, rope_qkv_write
from onnxgen.backends.native.kernels.cpu import ops as cpu_kernels
from onnxgen.backends.native.kernels.reference import softmax_with_sink
from onnxgen.backends.native.ops.base import (
    AI,
    INTERNAL,
    MS,
    Builder,
    Fn,
    Node,
    RunCtx,
    forbid_static,
    same_device,
)
from onnxgen.backends.native.ops.norms import rms
from onnxgen.backends.native.ops.rotary import rope_rows, step_rows
from onnxgen.backends.native.rotary import rope
from onnxgen.errors import NotCapturable


def _sdpa_kernels() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


_FLASH = [True]  # cleared if this torch build cannot run flash attention on our shapes


def attend(
    ctx: RunCtx,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    *,
    scale: float,
    softcap: float = 0.0,
    window: int = -1,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Append `k`/`v` (`[1, Hkv, S, D]`; None when already written) to layer `layer`'s KV and attend
    `q` (`[1, N, S, D]`) over it.

    Causal, aligned bottom-right: query i (absolute position pos0 + i) sees keys j <= pos0 + i, and with
    `window` > 0 only the last `window` of them, j > pos0 + i - window (onnxruntime's local_window_size).
    `bias` is added to the scores; `mask` (bool, True = keep, or additive float) is combined with the
    causal mask. `sink` (`[N]` float32: GroupQueryAttention's head_sink, gpt-oss's attention sinks): one more
    logit per head in the softmax's denominator, with no value. Returns `[1, N, S, D]`."""
    kv = ctx.kv
    s = q.shape[2]
    if ctx.paged is not None:  # a ragged batch: each token attends over its own sequence's pages
        if bias is not None or mask is not None:
            raise NotImplementedError("an attention bias or mask in a batched step")
        if k is not None:  # None: the caller already wrote this step's k/v at the step's slots
            paged.write_kv(ctx.paged, layer, k[0].transpose(0, 1), v[0].transpose(0, 1))
        o = paged.attention(ctx.paged, layer, q[0].transpose(0, 1), scale, softcap, window, sink)
        return o.transpose(0, 1).unsqueeze(0)
    if ctx.static:
        if bias is not None or mask is not None:
            raise NotCapturable("an attention bias or mask in a static step")
        if k is not None:  # None: the caller already wrote this step's k/v at `ctx.positions`
            kv.write_at(layer, ctx.positions, k, v)
        return cache_attention(q, kv.keys[layer], kv.values[layer], ctx.past, scale, softcap, window, sink)
    pos0 = ctx.pos0
    if k is not None:  # None: the caller already wrote this step's k/v at [pos0, pos0 + s)
        kv.write(layer, pos0, k, v)
    total = pos0 + s
    if s <= cpu_kernels.QUERY_TOKENS and bias is None and mask is None and q.shape[0] == 1:
        positions = ctx.positions if ctx.positions is not None else torch.arange(pos0, total)
        o = cpu_kernels.buffer_attention(
            q[0].transpose(0, 1), kv.keys[layer], kv.values[layer], positions, scale, softcap, window, sink
        )
        if o is not None:  # float32 on the CPU: the C kernel ([S, N, D])
            return o.transpose(0, 1).unsqueeze(0)
    kk, vv = kv.view(layer, total)
    k0 = max(0, pos0 + 1 - window) if window > 0 else 0  # keys below the first query's window: never read
    if k0:
        kk, vv = kk[:, :, k0:], vv[:, :, k0:]
        bias = bias[..., k0:] if bias is not None and bias.shape[-1] == total else bias
        mask = mask[..., k0:] if mask is not None and mask.shape[-1] == total else mask
    n, hkv = q.shape[1], kk.shape[1]
    # CPU: the query heads of a KV head as one product's rows (below), never a copy of the keys per head
    grouped = q.device.type != "cuda" and softcap <= 0 and sink is None and n != hkv and q.shape[0] == 1
    if (
        _FLASH[0]
        and q.device.type == "cuda"
        and q.dtype in (torch.float16, torch.bfloat16)
        and softcap <= 0
        and bias is None
        and mask is None
        and window <= 0
        and sink is None
        and q.shape[-1] % 8 == 0
    ):
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
    if n != hkv and not grouped:
        kk = kk.repeat_interleave(n // hkv, dim=1)
        vv = vv.repeat_interleave(n // hkv, dim=1)
    if softcap > 0 or sink is not None:
        scores = torch.matmul(q.float(), kk.float().transpose(-1, -2)) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores + _causal_bias(pos0, s, total, window, k0, q.device, torch.float32)
        if bias is not None:
            scores = scores + bias.float()
        if mask is not None:
            scores = scores + _as_additive(mask, torch.float32)
        p = softmax_with_sink(scores, sink.view(-1, 1, 1) if sink is not None else None)
        return torch.matmul(p, vv.float()).to(q.dtype)
    if bias is None and mask is None and window <= 0 and (pos0 == 0 or s == 1):
        attn_mask, causal = None, s > 1
    else:
        attn_mask = _causal_bias(pos0, s, total, window, k0, q.device, q.dtype)
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
    qf, kf, vf = q.float(), kk.float(), vv.float()
    g, d, length = n // hkv, q.shape[-1], kk.shape[2]
    if grouped:  # [Hkv, G * S, D] rows (head, token) against each KV head's keys
        scores = (
            torch.matmul(qf.reshape(hkv, g * s, d), kf[0].transpose(-1, -2)).view(1, n, s, length) * scale
        )
    else:
        scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        attn_mask = _causal_bias(pos0, s, total, window, k0, q.device, torch.float32)
    if attn_mask is not None:
        scores = scores + attn_mask.float()
    p = torch.softmax(scores, dim=-1)
    if grouped:
        return torch.matmul(p.view(hkv, g * s, length), vf[0]).view(1, n, s, d).to(q.dtype)
    return torch.matmul(p, vf).to(q.dtype)


def _causal_bias(
    pos0: int, s: int, total: int, window: int, k0: int, device: Any, dtype: torch.dtype
) -> torch.Tensor:
    """Additive `[s, total - k0]` mask over keys `k0 .. total - 1`: 0 where query pos0 + i may see key j (see
    `attend`), -inf elsewhere."""
    qpos = torch.arange(pos0, pos0 + s, device=device).unsqueeze(1)
    kpos = torch.arange(k0, total, device=device).unsqueeze(0)
    keep = kpos <= qpos
    if window > 0:
        keep = keep & (kpos > qpos - window)
    return _as_additive(keep, dtype)


def _as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = keep) as 0 / -inf in `dtype`; an additive mask cast to `dtype`."""
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
    switch = node.attr("_rope_switch")  # LongRoPE: short and long tables in one (`ops.rotary.rope_rows`)
    # `_step_tables` (the lowering's `_mrope_into_gqa`): the rotary tables are the step's own (MRoPE's,
    # `ops.rotary.MRopeTables`), row i for token i
    step_tables = bool(node.attr("_step_tables", 0))
    layer = node.layer
    assert layer is not None and not (step_tables and switch)

    def rows(ctx: RunCtx) -> Any:
        return step_rows(ctx) if step_tables else rope_rows(ctx, switch)

    def f(
        ctx: RunCtx,
        query: Any,
        key: Any = None,
        value: Any = None,
        _pk: Any = None,
        _pv: Any = None,
        _seqlens: Any = None,
        _total: Any = None,
        cos_c: Any = None,
        sin_c: Any = None,
        _pos: Any = None,
        bias: Any = None,
        sink: Any = None,
        _ks: Any = None,
        _vs: Any = None,
        qnw: Any = None,
        knw: Any = None,
        *_: Any,
    ) -> tuple[Any, ...]:
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
        scale = scale_attr or 1.0 / math.sqrt(d)
        if bias is not None:
            (bias,) = same_device(ctx, bias)
        if sink is not None:  # head_sink: a constant [num_heads] (on the device with the weights)
            sink = sink.reshape(-1).float()
        if key is None and layer in ctx.prepared:  # the QKV product rotated q and k and wrote k and v
            q = query[..., : n * d].reshape(b, s, n, d).transpose(1, 2)
            o = attend(
                ctx, layer, q, None, None, scale=scale, softcap=softcap, window=window, bias=bias, sink=sink
            )
            return (o.transpose(1, 2).reshape(b, s, n * d), None, None)
        if key is None and do_rotary and (qnw is None or knw is not None):
            # one fused launch: q/k norms, rotary on q and k, k/v written into the cache at their positions
            assert ctx.static or ctx.paged is not None or ctx.pos0 + s <= ctx.kv.capacity
            slots = ctx.paged.slots if ctx.paged is not None else ctx.positions
            q = rope_qkv_write(
                query,
                cos_c,
                sin_c,
                rows(ctx),
                ctx.kv,
                layer,
                n,
                hkv,
                d,
                interleaved,
                slots=slots,
                token_major=ctx.paged is not None,
                qk_norm=None if qnw is None else QKNorm(qnw, knw, qn_eps, kn_eps),
            )
            o = attend(
                ctx, layer, q, None, None, scale=scale, softcap=softcap, window=window, bias=bias, sink=sink
            )
            return (o.transpose(1, 2).reshape(b, s, n * d), None, None)
        if qnw is not None:
            q = rms(q, qnw, qn_eps)
            k = rms(k, knw, kn_eps)
        if do_rotary:
            pos = rows(ctx)
            cos = cos_c.index_select(0, pos).unsqueeze(1)  # [S, 1, rd/2]
            sin = sin_c.index_select(0, pos).unsqueeze(1)
            q, k = rope(q, cos, sin, interleaved), rope(k, cos, sin, interleaved)
        o = attend(
            ctx,
            layer,
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            scale=scale,
            softcap=softcap,
            window=window,
            bias=bias,
            sink=sink,
        )
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
            (mask,) = same_device(ctx, mask)
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
        forbid_static(ctx, "plain KV concat has a dynamic shape")
        kv = ctx.kv
        s = new.shape[2]
        buf = kv.keys[layer] if role == "key" else kv.values[layer]
        buf[:, :, ctx.pos0 : ctx.pos0 + s].copy_(new)
        return (buf[:, :, : ctx.pos0 + s],)

    return f


def layer_windows(nodes: Any, num_layers: int) -> list[int]:
    """Each KV layer's attention window (GroupQueryAttention's `local_window_size`; 0: the layer attends to the
    whole context) from the lowered program's KV-bound `nodes`: what a layer's attention never reads again."""
    windows: dict[int, int] = {}
    for n in (p for m in nodes for p in (m.attrs["_parts"] if m.op == "CpuLayer" else [m])):  # fused: its ops
        if n.layer is None:
            continue
        w = int(n.attr("local_window_size", -1)) if (n.domain, n.op) == (MS, "GroupQueryAttention") else 0
        w = max(w, 0)
        prev = windows.get(n.layer)
        windows[n.layer] = w if prev is None else (0 if 0 in (prev, w) else max(prev, w))
    return [windows.get(layer, 0) for layer in range(num_layers)]


BUILDERS: dict[tuple[str, str], Builder] = {
    (MS, "GroupQueryAttention"): _gqa,
    (AI, "Attention"): _attention23,
    (INTERNAL, "KVConcat"): _kv_concat,
}
