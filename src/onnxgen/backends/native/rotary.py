"""Rotary position embedding on torch tensors: the one implementation the ops (RotaryEmbedding, fused
GroupQueryAttention) and the kernels' torch reference share. Computed in float32, rounded once."""

from __future__ import annotations

import torch


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the first `2 * cos.shape[-1]` features of `x` (`[..., S, heads, D]`, cos `[..., S, 1, rd/2]`)."""
    half = cos.shape[-1]
    rd = 2 * half
    if interleaved and rd == x.shape[-1] and x.dtype == torch.float32 and x.device.type == "cpu":
        # the pairs as complex numbers, one product: (x1 + i x2)(c + i s) = (x1 c - x2 s) + i (x2 c + x1 s), the
        # same roundings as the real form below (each product rounded, then their sum), in a few torch calls
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], half, 2))
        return torch.view_as_real(z * torch.complex(cos.float(), sin.float())).flatten(-2)
    xf = x.float()
    xr, rest = xf[..., :rd], xf[..., rd:]
    c, s = cos.float(), sin.float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        out = torch.stack((o1, o2), dim=-1).reshape(xr.shape)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    if rest.shape[-1]:
        out = torch.cat((out, rest), dim=-1)
    return out.to(x.dtype)
