"""The RotaryEmbedding ops (com.microsoft and ai.onnx opset 23): cos/sin lookup by position around the
one rotary implementation, `onnxgen.backends.native.rotary.rope`. (GroupQueryAttention's fused rotary is
in `attention`.)"""

from __future__ import annotations

from typing import Any

import torch

from onnxgen.backends.native.ops.base import AI, MS, Builder, Fn, Node, same_device
from onnxgen.backends.native.rotary import rope


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

    def f(ctx: Any, x: Any, pos: Any, cos_c: Any, sin_c: Any) -> tuple[Any, ...]:
        x, pos, cos_c, sin_c = same_device(ctx, x, pos, cos_c, sin_c)
        s = x.shape[2] if x.dim() == 4 else x.shape[1]
        if pos.numel() == 1:
            pos = pos.reshape(1, 1) + torch.arange(s, device=pos.device).reshape(1, s)
        pos = pos.reshape(-1, s).long()
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

    def f(ctx: Any, x: Any, cos_c: Any, sin_c: Any, pos: Any = None) -> tuple[Any, ...]:
        x, cos_c, sin_c, pos = same_device(ctx, x, cos_c, sin_c, pos)
        s = x.shape[2] if x.dim() == 4 else x.shape[1]
        if pos is not None:
            cos, sin = cos_c[pos.long()], sin_c[pos.long()]  # [B, S, rd/2]
        else:
            cos, sin = cos_c, sin_c
        if rot_dim:
            cos, sin = cos[..., : rot_dim // 2], sin[..., : rot_dim // 2]
        cos, sin = cos.reshape(-1, s, 1, cos.shape[-1]), sin.reshape(-1, s, 1, sin.shape[-1])
        return (_rotate(x, cos, sin, interleaved, num_heads),)

    return f


BUILDERS: dict[tuple[str, str], Builder] = {
    (MS, "RotaryEmbedding"): _rotary_ms,
    (AI, "RotaryEmbedding"): _rotary_23,
}
