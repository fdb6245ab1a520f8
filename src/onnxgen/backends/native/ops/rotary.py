"""The RotaryEmbedding ops (com.microsoft and ai.onnx opset 23) and com.microsoft MRotaryEmbedding (Qwen-VL's
multimodal rotary: each rotated frequency reads one of three position rows): cos/sin lookup by position around
the one rotary implementation, `onnxgen.backends.native.rotary.rope`. (GroupQueryAttention's fused rotary is
in `attention`.) And `rope_rows`: which rows of the rotary tables a step's tokens read, LongRoPE's switch
included (every op that looks the tables up by position goes through it)."""

from __future__ import annotations

from typing import Any

import torch

from onnxgen.backends.native.ops.base import AI, INTERNAL, MS, Builder, Fn, Node, RunCtx, same_device
from onnxgen.backends.native.rotary import rope
from onnxgen.errors import UnsupportedModel


def rope_rows(
    ctx: RunCtx | None, switch: tuple[int, int] | None, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """The rows of the rotary tables the step's tokens read: their positions (`positions`, default
    `ctx.positions`), or with LongRoPE's `switch` = (threshold, offset) (the lowering's `_rope_switch`: the
    tables are the short ones, `offset` rows, followed by the long ones) position + offset for a token whose
    sequence is longer than the threshold (`RunCtx.totals`), as the builder's `If(attention_mask.shape[1] >
    threshold)` picks the long tables. Computed on the device without a host sync (a captured step reads the
    lengths from device memory); once per forward for `ctx.positions`."""
    pos = ctx.positions if positions is None and ctx is not None else positions
    assert pos is not None, "rotary rows need the step's positions"
    if switch is None:
        return pos
    assert ctx is not None, "LongRoPE's rows depend on the step"
    key = ("rope_rows", switch) if positions is None else None
    if key is not None and key in ctx.memo:
        return ctx.memo[key]
    limit, offset = switch
    tot = ctx.totals
    if tot is None:
        assert ctx.paged is None, "a paged step of a LongRoPE graph sets RunCtx.totals"
        if ctx.static:  # the KV length before the step and the index of its last real token, on the device
            tot = ctx.past + (ctx.last + 1 if ctx.last is not None else 1)
        else:
            tot = ctx.pos0 + ctx.n
    if isinstance(tot, int):
        rows = pos + offset if tot > limit else pos
    else:
        if tot.numel() == pos.numel() and tot.numel() > 1:
            tot = tot.reshape(pos.shape)
        tot = tot.to(pos.device)
        rows = torch.where(tot > limit, pos + offset, pos)
    if key is not None:
        ctx.memo[key] = rows
    return rows


def step_rows(ctx: RunCtx) -> torch.Tensor:
    """`arange(ctx.n)` on the device, once per forward: the rows of per-step rotary tables (`MRopeTables`),
    whose row i is the step's token i (static steps: the bucket's rows, padding included)."""
    rows = ctx.memo.get("step_rows")
    if rows is None:
        assert ctx.positions is not None, "step rows need the step's positions (for their device)"
        rows = ctx.memo["step_rows"] = torch.arange(ctx.n, device=ctx.positions.device)
    return rows


def mrope_tables(
    pos: torch.Tensor, cos_c: torch.Tensor, sin_c: torch.Tensor, section: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """MRoPE's cos / sin of each token, `[B * S, half]` (contiguous): frequency j of token i read at row
    `pos[r, i]` of the tables, where r is j's section (`section` [t, h, w] sizes, one after the other) —
    `MRotaryEmbedding`'s values, so a rotary over these tables at rows `arange(B * S)` equals it."""
    assert sum(section) == cos_c.shape[1], f"mrope_section {section} vs tables of {cos_c.shape[1]}"
    p = pos.reshape(len(section), -1).long()
    cos, sin, a = [], [], 0
    for r, w in enumerate(section):
        cos.append(cos_c[:, a : a + w].index_select(0, p[r]))
        sin.append(sin_c[:, a : a + w].index_select(0, p[r]))
        a += w
    return torch.cat(cos, dim=1), torch.cat(sin, dim=1)


def _mrope_tables(node: Node) -> Fn:
    """onnxgen MRopeTables(position_ids [3, B, S], cos_cache, sin_cache) -> the step's tables `[B * S, half]`
    (`mrope_tables`), computed once per forward for every layer (the lowering's `_mrope_into_gqa`)."""
    section = tuple(int(n) for n in node.attr("mrope_section"))

    def f(ctx: Any, pos: Any, cos_c: Any, sin_c: Any) -> tuple[Any, ...]:
        pos, cos_c, sin_c = same_device(ctx, pos, cos_c, sin_c)
        return mrope_tables(pos, cos_c, sin_c, section)

    return f


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, num_heads: int
) -> torch.Tensor:
    """`rope` on `x` laid out `[B, N, S, H]` or `[B, S, N * H]` (`num_heads` = N), back in that layout."""
    if x.dim() == 4:
        return rope(x.transpose(1, 2), cos, sin, interleaved).transpose(1, 2)
    xs = x.reshape(x.shape[0], x.shape[1], num_heads, -1)
    return rope(xs, cos, sin, interleaved).reshape(x.shape)


def _rotary_ms(node: Node) -> Fn:
    """com.microsoft RotaryEmbedding(input, position_ids, cos_cache, sin_cache)."""
    interleaved = bool(node.attr("interleaved", 0))
    num_heads = int(node.attr("num_heads", 0))
    switch = node.attr("_rope_switch")

    def f(ctx: Any, x: Any, pos: Any, cos_c: Any, sin_c: Any) -> tuple[Any, ...]:
        x, pos, cos_c, sin_c = same_device(ctx, x, pos, cos_c, sin_c)
        s = x.shape[2] if x.dim() == 4 else x.shape[1]
        if pos.numel() == 1:
            pos = pos.reshape(1, 1) + torch.arange(s, device=pos.device).reshape(1, s)
        pos = rope_rows(ctx, switch, pos.reshape(-1, s).long())
        cos = cos_c[pos].unsqueeze(2)  # [B, S, 1, rd/2]
        sin = sin_c[pos].unsqueeze(2)
        nh = num_heads or x.shape[2] // (2 * cos_c.shape[1])
        return (_rotate(x, cos, sin, interleaved, nh),)

    return f


def _rotary_23(node: Node) -> Fn:
    """ai.onnx RotaryEmbedding(X, cos_cache, sin_cache, position_ids?) (opset 23)."""
    interleaved = bool(node.attr("interleaved", 0))
    num_heads = int(node.attr("num_heads", 0))
    rot_dim = int(node.attr("rotary_embedding_dim", 0))
    switch = node.attr("_rope_switch")

    def f(ctx: Any, x: Any, cos_c: Any, sin_c: Any, pos: Any = None) -> tuple[Any, ...]:
        x, cos_c, sin_c, pos = same_device(ctx, x, cos_c, sin_c, pos)
        s = x.shape[2] if x.dim() == 4 else x.shape[1]
        if pos is not None:
            rows = rope_rows(ctx, switch, pos.long())
            cos, sin = cos_c[rows], sin_c[rows]  # [B, S, rd/2]
        else:
            cos, sin = cos_c, sin_c
        if rot_dim:
            cos, sin = cos[..., : rot_dim // 2], sin[..., : rot_dim // 2]
        cos, sin = cos.reshape(-1, s, 1, cos.shape[-1]), sin.reshape(-1, s, 1, sin.shape[-1])
        return (_rotate(x, cos, sin, interleaved, num_heads),)

    return f


def _mrotary(node: Node) -> Fn:
    """com.microsoft MRotaryEmbedding(input [B, S, N*H], position_ids [3, B, S], cos_cache, sin_cache):
    frequency j of the rotated half reads the position row of its section (`mrope_section` [t, h, w] sizes,
    laid out one section after the other: `mrope_layout` 0)."""
    interleaved = bool(node.attr("interleaved", 0))
    num_heads = int(node.attr("num_heads", 0))
    section = [int(n) for n in node.attr("mrope_section", [])]
    if int(node.attr("mrope_layout", 0)) != 0 or len(section) != 3:
        raise UnsupportedModel(
            f"MRotaryEmbedding {node.name!r}: only the sectioned layout of three sections is supported "
            f"(mrope_layout {node.attr('mrope_layout', 0)}, mrope_section {section})"
        )

    def f(ctx: Any, x: Any, pos: Any, cos_c: Any, sin_c: Any) -> tuple[Any, ...]:
        x, pos, cos_c, sin_c = same_device(ctx, x, pos, cos_c, sin_c)
        half = cos_c.shape[1]
        cos, sin = mrope_tables(pos, cos_c, sin_c, tuple(section))
        b, s = pos.shape[1], pos.shape[2]
        cos, sin = cos.view(b, s, 1, half), sin.view(b, s, 1, half)
        return (_rotate(x, cos, sin, interleaved, num_heads or x.shape[-1] // (2 * half)),)

    return f


BUILDERS: dict[tuple[str, str], Builder] = {
    (MS, "MRotaryEmbedding"): _mrotary,
    (INTERNAL, "MRopeTables"): _mrope_tables,
    (MS, "RotaryEmbedding"): _rotary_ms,
    (AI, "RotaryEmbedding"): _rotary_23,
}
