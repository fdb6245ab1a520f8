"""Mixture-of-experts layers: per-token routing and the experts' products over a ragged set of tokens.

`moe(x, logits, w1, b1, w2, b2, cfg)` is the whole layer, onnxruntime's `MoE` on prepared weights
(`ops.moe` prepares them at load): `w1` `[E, N1, H]` (gated activations: the gate rows, then the up rows,
`N1 = 2 * I`), `w2` `[E, H, I]`, biases `[E, N1]` / `[E, H]` or None; or 4-bit experts kept packed
(`Packed`, `int4="packed"`: integer or MXFP4 codes, dequantized tile by tile in the products, per expert in
torch). Each token routes on its own:
softmax over its router logits (float32), its top `k` experts, their weights renormalised to sum 1 when
`cfg.normalize` (or PhiMoE's sparse mixer); the token's output is the weighted sum of its experts'
`fc2(act(fc1(x)))`, formed in float32 and rounded once. A batch's tokens are independent rows: a ragged
batch, a prefill chunk and a verify step's rows route alike.

Two paths with the same values (up to the float32 accumulation order):
- torch (the CPU, and CUDA without Triton): the (token, slot) pairs sorted by expert, one product per
  expert that has tokens (the expert counts are read on the host, so a captured step cannot run it);
- Triton (`triton/moe.py`, CUDA or the interpreter): five launches and no host synchronisation, so a decode
  step is captured in a CUDA graph: `route` (softmax, top-k, normalisation per token), `align` (the pairs
  sorted by expert into row blocks of `BLOCK_M`, each block one expert's), the grouped fc1 product with
  bias and activation in its epilogue and the grouped fc2 product with bias (one launch each for every
  expert), and `combine` (each token's weighted sum). A block's rows are computed as one row alone would be
  (the products' K loop does not depend on the other rows), and a step of `rowwise` rows takes the decode
  step's configuration, so a verify step's rows have a decode step's bits.

    pairs p = t * k + j (token t, its j-th expert)      sorted rows (BLOCK_M = 4 here)
    ids  [T, k] -> flat [P]                             | e0: p3 p6 -  - | e1: p0 p1 p4 p7 | e1: p9 - - - |
                                                        block_expert = [0, 1, 1], block_rows = [2, 4, 1]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from onnxgen.backends.native.kernels.dispatch import KERNELS, triton_cdiv, use_triton
from onnxgen.package.int4 import unpack_nibbles

ACTIVATIONS = ("swiglu", "geglu", "silu", "gelu", "relu", "relu2", "identity")
SPARSE_MIXER_EPS = 0.01  # PhiMoE's jitter epsilon (its routing threshold), as onnxruntime's sparse mixer


@dataclass(frozen=True)
class MoEConfig:
    """A layer's routing and activation (onnxruntime's `MoE` / `QMoE` attributes, checked by `ops.moe`).

    activation: one of `ACTIVATIONS`. gated: fc1's rows are the gate's, then the up's (`[E, 2I, H]`): the
    activation is `act(gate) * up` (swiglu: `G * sigmoid(alpha * G) * (L + beta)` with `G = min(gate,
    limit)`, `L = clamp(up, -limit, limit)`; geglu: `gelu_tanh(gate) * up`); else `act(fc1)`. gelu is
    onnxruntime's tanh form."""

    k: int
    activation: str
    gated: bool
    alpha: float = 1.0
    beta: float = 0.0
    limit: float = math.inf
    normalize: bool = False
    sparse_mixer: bool = False


class Packed(NamedTuple):
    """4-bit experts kept packed on the device (`int4="packed"`): `codes` uint8 `[E, N, K / 2]` (element k of
    a row in byte k // 2, the even one in the low nibble), float32 `scales` `[E, N, K / block]`, and for
    integer codes float32 `zeros` `[E, N, K / block]` (None: 8): `(q - zero) * scale`; `fp4`: e2m1 codes
    (MXFP4: sign, then a 1.2 float: 0, 0.5, 1, 1.5, 2, 3, 4, 6) times the scale. `block` divides K and 128."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    fp4: bool
    block: int

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, kb = self.codes.shape
        return e, n, 2 * kb

    def is_contiguous(self) -> bool:
        return self.codes.is_contiguous() and self.scales.is_contiguous()

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `e`'s dense `[N, K]` in `dtype` (computed in float32, rounded once)."""
        return unpack4(
            self.codes[e],
            self.scales[e],
            None if self.zeros is None else self.zeros[e],
            self.fp4,
            self.block,
            dtype,
        )


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack4(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    fp4: bool,
    block: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`Packed` codes `[..., N, K / 2]` with their scales (and zero points) -> dense `[..., N, K]` in `dtype`."""
    q = unpack_nibbles(codes)
    if fp4:
        v = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)[q.long()]
    else:
        v = q.float() - (8.0 if zeros is None else zeros.repeat_interleave(block, dim=-1))
    return (v * scales.repeat_interleave(block, dim=-1)).to(dtype)


def _dims(w: torch.Tensor | Packed) -> tuple[int, int, int]:
    return tuple(w.shape)  # type: ignore[return-value]


def _expert(w: torch.Tensor | Packed, e: int, dtype: torch.dtype) -> torch.Tensor:
    return w.expert(e, dtype) if isinstance(w, Packed) else w[e]


# --- routing -------------------------------------------------------------------------------------------


def route(logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and weights: (ids int64 `[T, k]`, weights float32 `[T, k]`), best first.
    Softmax over all experts in float32, the top k, renormalised to sum 1 when `cfg.normalize` (onnxruntime's
    CPU order: softmax, then the partial sort); with `cfg.sparse_mixer`, PhiMoE's top-2 sparse mixer."""
    p = _wide(logits.reshape(-1, logits.shape[-1]))
    if cfg.sparse_mixer:
        return _sparse_mixer(p)
    w, ids = torch.topk(torch.softmax(p, dim=-1), cfg.k, dim=-1)
    if cfg.normalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w


def _sparse_mixer(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's top-2 sparse mixer (inference): the best expert, weighted by its softmax among the experts
    whose score is within `2 * eps` (relative) of it; then the best of the others, the same way."""
    ids, ws = [], []
    masked = scores
    for _ in range(2):
        top, idx = masked.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=top)
        drop = (top - scores) / factor > 2 * SPARSE_MIXER_EPS
        gates = torch.softmax(masked.masked_fill(drop, float("-inf")), dim=-1)
        ws.append(gates.gather(-1, idx))
        ids.append(idx)
        masked = masked.scatter(-1, idx, float("-inf"))
    return torch.cat(ids, -1), torch.cat(ws, -1)


# --- the torch path ------------------------------------------------------------------------------------


def _act(h: torch.Tensor, name: str) -> torch.Tensor:
    if name == "silu":
        return F.silu(h)
    if name == "gelu":
        return F.gelu(h, approximate="tanh")
    if name == "relu":
        return F.relu(h)
    if name == "relu2":
        return F.relu(h).square()
    return h  # identity


def _wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32, or as it is in float64 (the float64 reference runs of `numerics`)."""
    return t if t.dtype == torch.float64 else t.float()


def activate(h: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """The activation of fc1's output `h` `[rows, N1]`: float32 inside, rounded once to h's dtype."""
    f = _wide(h)
    if not cfg.gated:
        return _act(f, cfg.activation).to(h.dtype)
    n = f.shape[-1] // 2
    g, u = f[..., :n], f[..., n:]
    if cfg.activation == "swiglu":
        g = g.clamp(max=cfg.limit)
        u = u.clamp(-cfg.limit, cfg.limit)
        y = g * torch.sigmoid(cfg.alpha * g) * (u + cfg.beta)
    elif cfg.activation == "geglu":
        y = F.gelu(g, approximate="tanh") * u
    else:
        y = _act(g, cfg.activation) * u
    return y.to(h.dtype)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """`x @ w.T + b` rounded once to x's dtype; bf16/fp16 on the CPU as float32 (the same products, exact in
    float32: torch's CPU half-precision GEMM is a slow reference path without bf16 matrix units)."""
    if x.device.type == "cpu" and x.dtype != torch.float32:
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    return F.linear(x, w, b)


def experts_torch(
    x: torch.Tensor,
    ids: torch.Tensor,
    wts: torch.Tensor,
    w1: torch.Tensor | Packed,
    b1: torch.Tensor | None,
    w2: torch.Tensor | Packed,
    b2: torch.Tensor | None,
    cfg: MoEConfig,
) -> torch.Tensor:
    """The experts of routed tokens `x` `[T, H]`: one product per expert over its tokens (a `Packed` expert
    dequantized for it), each pair's output kept in its own row, then every token's weighted sum in float32
    (experts in the token's order), rounded once. Reads the expert counts on the host (not capturable)."""
    t, h = x.shape
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=_dims(w1)[0]).tolist()
    y = x.new_empty(t * k, h)
    start = 0
    for e, c in enumerate(counts):
        if not c:
            continue
        sel = order[start : start + c]
        start += c
        a = activate(_linear(x[sel // k], _expert(w1, e, x.dtype), None if b1 is None else b1[e]), cfg)
        y[sel] = _linear(a, _expert(w2, e, x.dtype), None if b2 is None else b2[e])
    yw = _wide(y.view(t, k, h))
    return (yw * wts.to(yw.dtype).unsqueeze(-1)).sum(1).to(x.dtype)


# --- the layer -----------------------------------------------------------------------------------------


def moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    w1: torch.Tensor | Packed,
    b1: torch.Tensor | None,
    w2: torch.Tensor | Packed,
    b2: torch.Tensor | None,
    cfg: MoEConfig,
    *,
    rowwise: bool = False,
) -> torch.Tensor:
    """The MoE layer over x's tokens (`[..., H]`, any leading shape; `logits` one row of E per token), dense or
    `Packed` experts: the Triton path where it runs (`triton_ok`), else `experts_torch`. Returns x's shape and
    dtype."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    if x2.shape[0] == 0:
        return torch.empty_like(x)
    lg = logits.reshape(x2.shape[0], -1)
    if triton_ok(x2, w1, cfg):  # pragma: cuda
        return experts_triton(x2, lg, w1, b1, w2, b2, cfg, rowwise=rowwise).reshape(x.shape)
    ids, wts = route(lg, cfg)
    return experts_torch(x2, ids, wts, w1, b1, w2, b2, cfg).reshape(x.shape)


def triton_ok(x: torch.Tensor, w1: torch.Tensor | Packed, cfg: MoEConfig) -> bool:
    """Whether the Triton path runs this layer: a Triton device (the sparse mixer's routing then runs in torch,
    still capturable), contiguous weights, at most `MAX_EXPERTS` experts and `MAX_K` per token."""
    return use_triton(x) and w1.is_contiguous() and _dims(w1)[0] <= MAX_EXPERTS and cfg.k <= MAX_K


# --- the Triton path -----------------------------------------------------------------------------------

MAX_EXPERTS = 1024
MAX_K = 16
DECODE_CONFIG = (16, 64, 128, 4, 3)
"""(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the grouped products when an expert has few rows (decode
steps, batched decode, verify steps: each a weight-streaming product, many programs in flight). On CUDA
BLOCK_N, warps and stages are chosen per product shape among `DECODE_TILES` (`decode_tiles`); BLOCK_M and
BLOCK_K stay (a row's sums keep their order, so a verify step's rows keep a decode step's bits)."""
DECODE_TILES = ((64, 4, 3), (32, 4, 3), (128, 4, 3), (32, 4, 5), (128, 8, 4))
"""(BLOCK_N, warps, stages) timed for each decode product shape on CUDA (`autotune.fastest`; few: each is
compiled the first time a shape is timed, and a model's MoE layers share their two shapes)."""
PREFILL_CONFIG = (64, 64, 64, 4, 3)
"""The same when an expert has many rows on average (prefill chunks): 64-row tiles on the tensor cores."""


def moe_config(pairs: int, experts: int, rowwise: bool) -> tuple[int, int, int, int, int]:
    """The grouped products' configuration for `pairs` (token, expert) pairs over `experts`: the decode
    configuration for a rowwise step (a verify step's rows then have a decode step's bits) or while the
    experts average fewer than 32 rows, else the prefill one."""
    if rowwise or pairs < 32 * experts:
        return DECODE_CONFIG
    return PREFILL_CONFIG


def decode_tiles(
    a: torch.Tensor, w: torch.Tensor | Packed, b: torch.Tensor | None, cfg: MoEConfig | None, k: int
) -> tuple[int, int, int, int, int]:  # pragma: cuda
    """`DECODE_CONFIG` with the BLOCK_N, warps and stages of `DECODE_TILES` that run this product shape fastest
    on CUDA (timed once per shape on a one-token step's `k` experts, weights from HBM; cached in
    `autotune.CHOICES`); `DECODE_CONFIG` itself elsewhere and while a graph is being captured."""
    from onnxgen.backends.native.kernels import autotune

    bm, _, bk, _, _ = DECODE_CONFIG
    kind = ("fp4" if w.fp4 else "int4", w.block) if isinstance(w, Packed) else w.dtype
    key = ("moe", _dims(w), cfg is not None and cfg.gated, kind, a.dtype, k)
    if key in autotune.CHOICES:
        bn, warps, stages = autotune.CHOICES[key]
        return bm, bn, bk, warps, stages
    if not a.is_cuda or torch.cuda.is_current_stream_capturing():
        return DECODE_CONFIG
    e, n, kk = _dims(w)
    ids = torch.randperm(e, device=a.device)[:k].to(torch.int32).reshape(1, k)
    plan = align(ids, e, bm)
    x = torch.randn((1 if cfg is not None else k, kk), device=a.device).to(a.dtype)
    n = n // 2 if cfg is not None and cfg.gated else n
    out = torch.empty((k, n), dtype=a.dtype, device=a.device)
    div = k if cfg is not None else 1
    cands = [
        (t, lambda i, t=t: grouped_linear(x, div, w, b, out, plan, cfg, (bm, t[0], bk, t[1], t[2])))
        for t in DECODE_TILES
    ]
    bn, warps, stages = autotune.fastest(key, cands, 1)
    return bm, bn, bk, warps, stages


_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}


def _kernels() -> dict[str, Any]:  # pragma: cuda (Triton only)
    if "moe_gemm" not in KERNELS:
        from onnxgen.backends.native.kernels.triton import moe as tm

        KERNELS.update(
            {
                "moe_route": tm.moe_route_kernel,
                "moe_align": tm.moe_align_kernel,
                "moe_gemm": tm.moe_gemm_kernel,
                "moe_combine": tm.moe_combine_kernel,
            }
        )
    return KERNELS


def route_triton(logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: cuda
    """`route`'s experts (int32) and weights in one launch (the sparse mixer: `route` itself, in torch)."""
    if cfg.sparse_mixer:
        ids, w = route(logits, cfg)
        return ids.to(torch.int32).contiguous(), w.contiguous()
    t, e = logits.shape
    ids = torch.empty((t, cfg.k), dtype=torch.int32, device=logits.device)
    w = torch.empty((t, cfg.k), dtype=torch.float32, device=logits.device)
    _kernels()["moe_route"][(t,)](
        logits,
        ids,
        w,
        e,
        logits.stride(0),
        K=cfg.k,
        BLOCK_E=max(16, 1 << (e - 1).bit_length()),
        BLOCK_K=max(2, 1 << (cfg.k - 1).bit_length()),
        NORMALIZE=cfg.normalize,
        num_warps=1,
    )
    return ids, w


def align(
    ids: torch.Tensor, experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # pragma: cuda
    """The pairs of `ids` (`[T, k]` int32) sorted by expert into blocks of `block_m` rows: (rows: pair
    index per sorted row, block_expert, block_rows: the block's expert and how many of its rows are real,
    0 for a block no expert needed). One launch; sizes depend on the pair count only (capturable)."""
    p = ids.numel()
    # NOTE: every expert with pairs pads at most one block: sum(ceil(c_e / BM)) <= ceil(P / BM) + min(E, P)
    blocks = triton_cdiv(p, block_m) + min(experts, p)
    dev = ids.device
    rows = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    block_rows = torch.empty(blocks, dtype=torch.int32, device=dev)
    _kernels()["moe_align"][(1,)](
        ids,
        rows,
        block_expert,
        block_rows,
        p,
        experts,
        blocks,
        BLOCK_M=block_m,
        BLOCK_E=max(16, 1 << (experts - 1).bit_length()),
        CHUNK=64 if experts > 128 else 128,
        num_warps=4,
    )
    return rows, block_expert, block_rows


def grouped_linear(
    a: torch.Tensor,
    div: int,
    w: torch.Tensor | Packed,
    b: torch.Tensor | None,
    out: torch.Tensor,
    plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cfg: MoEConfig | None,
    tiles: tuple[int, int, int, int, int],
) -> torch.Tensor:  # pragma: cuda
    """`out[p] = act(a[p // div] @ w[e(p)].T + b[e(p)])` for every pair p of `plan` (`align`'s), one launch
    for all experts; `cfg` None: no activation (fc2), else `cfg`'s (fc1: gated products read the gate and
    the up rows of `w` and write the `N1 / 2` activated columns). `Packed` experts are dequantized tile by
    tile in the K loop (BLOCK_K at least their block)."""
    bm, bn, bk, warps, stages = tiles
    rows, block_expert, block_rows = plan
    gated = cfg is not None and cfg.gated
    _, n, k = _dims(w)
    n = n // 2 if gated else n
    act = -1 if cfg is None else _ACT_CODE[cfg.activation]
    packed = isinstance(w, Packed)
    codes = w.codes if isinstance(w, Packed) else w
    scales = w.scales if isinstance(w, Packed) else codes
    zeros = w.zeros if isinstance(w, Packed) and w.zeros is not None else scales
    qblock = w.block if isinstance(w, Packed) else 16
    if packed:
        bk = max(bk, qblock)
    _kernels()["moe_gemm"][(triton_cdiv(n, bn), block_expert.numel())](
        a,
        codes,
        b if b is not None else codes,
        scales,
        zeros,
        out,
        rows,
        block_expert,
        block_rows,
        n,
        k,
        a.stride(0),
        out.stride(0),
        div,
        0.0 if cfg is None else cfg.alpha,
        0.0 if cfg is None else cfg.beta,
        3.0e38 if cfg is None or math.isinf(cfg.limit) else cfg.limit,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GATED=gated,
        ACT=act,
        HAS_BIAS=b is not None,
        PACKED=packed,
        FP4=isinstance(w, Packed) and w.fp4,
        HAS_ZP=isinstance(w, Packed) and w.zeros is not None,
        QBLOCK=qblock,
        IEEE=not a.is_cuda or a.dtype == torch.float32,  # float32 models: no TF32 on CUDA
        num_warps=warps,
        num_stages=stages,
    )
    return out


def experts_triton(
    x: torch.Tensor,
    logits: torch.Tensor,
    w1: torch.Tensor | Packed,
    b1: torch.Tensor | None,
    w2: torch.Tensor | Packed,
    b2: torch.Tensor | None,
    cfg: MoEConfig,
    *,
    rowwise: bool = False,
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:  # pragma: cuda
    """The layer in five launches (module doc); `tiles` overrides `moe_config`'s choice."""
    t, h = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    e, n1, _ = _dims(w1)
    ids, wts = route_triton(logits, cfg)
    p = ids.numel()
    tiles1 = tiles2 = tiles or moe_config(p, e, rowwise)
    if tiles is None and tiles1 == DECODE_CONFIG and x.is_cuda:
        tiles1 = decode_tiles(x, w1, b1, cfg, cfg.k)
        tiles2 = decode_tiles(x, w2, b2, None, cfg.k)
    plan = align(ids, e, tiles1[0])
    inter = n1 // 2 if cfg.gated else n1
    act = torch.empty((p, inter), dtype=x.dtype, device=x.device)
    grouped_linear(x, cfg.k, w1, b1, act, plan, cfg, tiles1)
    y = torch.empty((p, h), dtype=x.dtype, device=x.device)
    grouped_linear(act, 1, w2, b2, y, plan, None, tiles2)
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    block_h = min(1024, max(16, 1 << (h - 1).bit_length()))
    _kernels()["moe_combine"][(t, triton_cdiv(h, block_h))](
        y, wts, out, h, K=cfg.k, BLOCK_H=block_h, num_warps=4
    )
    return out
