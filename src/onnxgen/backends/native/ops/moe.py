"""Mixture of experts: com.microsoft `MoE` and `QMoE` as onnxruntime computes them, over `kernels.moe`.

Routing is per token (a step's tokens are independent rows, so ragged batches route each token on its own):
softmax of the router logits, the top `k` experts, renormalised with `normalize_routing_weights` (or
PhiMoE's `use_sparse_mixer`); each expert is `fc2(act(fc1(x)))` with optional biases; the activations are
onnxruntime's: `swiglu` with `activation_alpha` / `activation_beta` / `swiglu_limit` (gpt-oss: 1.702, 1, 7),
`geglu`, `silu`, `gelu` (tanh), `relu`, `relu2`, `identity`, gated by fc3 where the graph has one.

Weights are prepared once at load (`prepare_moe`, run by the lowering): a node whose expert weights are
constants becomes the lowering's `MoE` (`onnxgen` domain) over dense `[E, N, K]` weights in the model's
dtype, gated activations with the gate rows first and the up rows after them (`swiglu_fusion` 1's
interleaved rows and a separate fc3 are rearranged; the product's values are the same); `QMoE`'s
experts dequantized: integer weights (4 or 8 bits, block-wise or per output channel, optional zero points,
onnxruntime's raw `[E, N, K * bits / 8]` layout) and MXFP4 (`quant_type="fp4"`: e2m1 codes `[E, K, N / 2]`,
e8m0 block scales `[E, N, K / 32]`, per-expert global scales), so gpt-oss's MXFP4 experts (`-p int4 -e cuda
--extra_options moe_quant_type=mxfp4`) load with the checkpoint's own values. With `int4="packed"` QMoE's
4-bit and MXFP4 experts stay 4-bit on the device instead (`kernels.moe.Packed`, a quarter of the bytes a
decode step reads). The com.microsoft ops themselves also run on the graph's inputs (preparing their
weights at every call) for graphs whose weights are not constants.

Not supported (`UnsupportedOp` at load): CUDA-prepacked integer QMoE weights (the builder's default for
`-p int4 -e cuda`; build with `--extra_options qmoe_weights_prepacked=0` or `-e cpu`), 2/3-bit and
mixed-width experts, NVFP4 / FP8 experts, `router_weights`, `swiglu_limit_after_activation`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from onnxgen.backends.native.kernels.moe import ACTIVATIONS, E2M1, MoEConfig, Packed, moe, triton_ok
from onnxgen.backends.native.ops.base import INTERNAL, MS, Builder, Fn, Node, forbid_static, is_rowwise
from onnxgen.errors import UnsupportedOp
from onnxgen.package.int4 import pack_nibbles, unpack_nibbles

SUPPORTED = (
    f"MoE / QMoE with activation_type {' / '.join(ACTIVATIONS)}",
    "QMoE quant_type int (4 or 8 bits, the raw [E, N, K * bits / 8] layout, weights_prepacked=0)",
    "QMoE quant_type fp4 (MXFP4)",
)
"""What the family runs, named in its `UnsupportedOp` errors (a form of MoE / QMoE it does not run)."""


def _unsupported(node: Node, feature: str) -> UnsupportedOp:
    return UnsupportedOp(f"{node.op}({feature})", node.domain, node.name, list(SUPPORTED))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def moe_config(node: Node, gated_by_fc3: bool) -> MoEConfig:
    """The routing and activation of a com.microsoft `MoE` / `QMoE` node (or the lowering's `MoE`, whose
    attributes are the same plus `gated`). Raises `UnsupportedOp` for what the native backend does not run."""
    act = _text(node.attr("activation_type", "relu")).lower()
    if act not in ACTIVATIONS:
        raise _unsupported(node, f"activation_type={act}")
    if int(node.attr("swiglu_limit_after_activation", 0)):
        raise _unsupported(node, "swiglu_limit_after_activation")
    k = int(node.attr("k", 1))
    sparse = bool(int(node.attr("use_sparse_mixer", 0)))
    if sparse and k != 2:
        raise _unsupported(node, f"use_sparse_mixer with k={k}")
    if act in ("swiglu", "geglu") or gated_by_fc3:
        gated = True
    else:
        gated = bool(int(node.attr("gated", 0)))
    limit = node.attr("swiglu_limit", None)
    return MoEConfig(
        k=k,
        activation=act,
        gated=gated,
        alpha=float(node.attr("activation_alpha", 1.0)),
        beta=float(node.attr("activation_beta", 0.0)),
        limit=math.inf if limit is None else float(limit),
        normalize=bool(int(node.attr("normalize_routing_weights", 0))),
        sparse_mixer=sparse,
    )


# --- weights -------------------------------------------------------------------------------------------


def gate_up_rows(w1: torch.Tensor, fusion: int, w3: torch.Tensor | None = None) -> torch.Tensor:
    """fc1's weights (`[E, N1, H]`) or biases (`[E, N1]`) with the gate rows first, the up rows after them:
    `swiglu_fusion` 1 (rows interleaved g0, u0, g1, u1, ...) reordered; 2 (`[g | u]`) as it is; a separate fc3
    (`w3`: the up rows) appended."""
    if w3 is not None:
        return torch.cat([w1, w3.to(w1.device)], dim=1)
    if fusion == 1:
        return torch.cat([w1[:, 0::2], w1[:, 1::2]], dim=1)
    return w1


def dequant_int(
    qw: torch.Tensor,
    scales: torch.Tensor,
    zp: torch.Tensor | None,
    bits: int,
    block: int,
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """QMoE's integer experts (raw uint8 `[E, N, ceil(K * bits / 8)]`, low nibble first) -> dense `[E, N, K]`
    in `dtype`: `(q - zero point) * scale` in float32 (zero point 2^(bits-1) without one), per block of
    `block` along K (`block` 0: one scale per output row). Zero points: uint8, packed like the weights
    (`[E, N, ceil(n_blocks * bits / 8)]`, or `[E, ceil(N * bits / 8)]` per row). One expert at a time."""
    e, n = qw.shape[0], qw.shape[1]
    nb = -(-k // block) if block else 1
    out = torch.empty((e, n, k), dtype=dtype, device=qw.device)
    for i in range(e):
        q = (unpack_nibbles(qw[i].to(torch.uint8)) if bits == 4 else qw[i])[..., :k].float()  # [N, K]
        sc = scales[i].reshape(n, nb).float()
        if zp is None:
            z = torch.full((n, nb), float(1 << (bits - 1)), device=qw.device)
        else:
            zi = zp[i].to(torch.uint8).reshape(n if block else 1, -1)  # per row: one packed row of N
            zi = unpack_nibbles(zi) if bits == 4 else zi
            z = (zi[:, :nb] if block else zi[0, :n, None]).float()
        if block:
            pad = nb * block - k
            qb = torch.nn.functional.pad(q, (0, pad)) if pad else q
            w = ((qb.reshape(n, nb, block) - z[..., None]) * sc[..., None]).reshape(n, nb * block)[:, :k]
        else:
            w = (q - z) * sc
        out[i] = w.to(dtype)
    return out


def dequant_mxfp4(
    qw: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """QMoE's MXFP4 experts (`quant_type="fp4"`): e2m1 codes uint8 `[E, K, N / 2]` (two output rows per
    byte, the even one in the low nibble), e8m0 block scales `[E, N, K / 32]` (2^(s - 127)) and optional
    per-expert float32 global scales -> dense `[E, N, K]` in `dtype`. One expert at a time."""
    e, k = qw.shape[0], qw.shape[1]
    n = scales.shape[1]
    lut = torch.tensor(E2M1, dtype=torch.float32, device=qw.device)
    out = torch.empty((e, n, k), dtype=dtype, device=qw.device)
    for i in range(e):
        codes = unpack_nibbles(qw[i].to(torch.uint8))[:, :n]  # [K, N]
        v = lut[codes.long()].T  # [N, K]
        sc = torch.pow(2.0, scales[i].to(torch.uint8).float() - 127.0).repeat_interleave(32, dim=-1)[:, :k]
        w = v * sc
        if global_scale is not None:
            w = w * global_scale.reshape(-1)[i].float()
        out[i] = w.to(dtype)
    return out


def _qmoe_dense(node: Node, ins: list[Any], dtype: torch.dtype) -> tuple[Any, ...]:
    """QMoE's inputs 2..16 -> dense (w1, b1, w2, b2, w3, b3) in `dtype` (w3 / b3: fc3's, or None)."""
    ins = ins + [None] * (17 - len(ins))
    qt = _text(node.attr("quant_type", "int")).lower()
    bits = int(node.attr("expert_weight_bits", 4))
    for a in ("fc1_expert_weight_bits", "fc2_expert_weight_bits", "fc3_expert_weight_bits"):
        if node.attr(a) is not None and int(node.attr(a)) != bits:
            raise _unsupported(node, "mixed-width experts")
    if ins[14] is not None:
        raise _unsupported(node, "router_weights")
    hidden = None
    if qt == "fp4":
        ws = [
            None if w is None else dequant_mxfp4(w, s, g, dtype)
            for w, s, g in ((ins[2], ins[3], ins[15]), (ins[5], ins[6], ins[16]), (ins[8], ins[9], None))
        ]
    elif qt == "int":
        if bits not in (4, 8):
            raise _unsupported(node, f"expert_weight_bits={bits}")
        if int(node.attr("weights_prepacked", 0)) != 0:
            raise _unsupported(node, "CUDA-prepacked weights")
        block = int(node.attr("block_size", 0) or 0)
        hidden = ins[5].shape[1]  # fc2: [E, H, I * bits / 8]
        inter = ins[5].shape[2] * 8 // bits
        ws = []
        for w, s, z, kk in ((ins[2], ins[3], ins[11], hidden), (ins[5], ins[6], ins[12], inter)):
            if w.dim() != 3 or w.shape[2] != -(-kk * bits // 8) or s is None:
                raise _unsupported(node, f"weights of shape {tuple(w.shape)} (not the raw layout)")
            ws.append(dequant_int(w, s, z, bits, block, kk, dtype))
        ws.append(
            None if ins[8] is None else dequant_int(ins[8], ins[9], ins[13], bits, block, hidden, dtype)
        )
    else:
        raise _unsupported(node, f"quant_type={qt}")
    b = [None if x is None else x.to(dtype) for x in (ins[4], ins[7], ins[10])]
    return ws[0], b[0], ws[1], b[1], ws[2], b[2]


def prepared(
    node: Node,
    w1: Any,
    b1: Any,
    w2: Any,
    b2: Any,
    w3: Any,
    b3: Any,
    shape: tuple[int, int, int] | None = None,
) -> tuple[MoEConfig, torch.Tensor, Any, torch.Tensor, Any]:
    """A node's config and its weights as the lowering's `MoE` takes them (gate rows first; fc3 folded into
    fc1), checked against each other. Dense `[E, N, K]` weights, or `Packed` codes `[E, N, K / 2]` with
    `shape` fc1's logical `[E, N1, K]` (fc2's K then twice its last dimension)."""
    cfg = moe_config(node, gated_by_fc3=w3 is not None)
    fusion = int(node.attr("swiglu_fusion", 0))
    if cfg.activation in ("swiglu", "geglu") and w3 is None and fusion not in (1, 2):
        raise _unsupported(node, f"{cfg.activation} with swiglu_fusion={fusion} and no fc3")
    if w3 is not None and b1 is not None and b3 is None:
        b3 = torch.zeros(w3.shape[:2], dtype=b1.dtype, device=b1.device)
    if b3 is not None and b1 is None:
        b1 = torch.zeros(w1.shape[:2], dtype=b3.dtype, device=b3.device)
    if cfg.gated:
        w1 = gate_up_rows(w1, fusion, w3)
        b1 = None if b1 is None else gate_up_rows(b1, fusion, b3)
    e, n1, hid = w1.shape if shape is None else (w1.shape[0], w1.shape[1], shape[2])
    inter = n1 // 2 if cfg.gated else n1
    w2_shape = tuple(w2.shape) if shape is None else (w2.shape[0], w2.shape[1], 2 * w2.shape[2])
    if w2_shape != (e, hid, inter) or (cfg.gated and n1 % 2):
        raise _unsupported(node, f"expert weights {tuple(w1.shape)} and {tuple(w2.shape)}")
    return cfg, w1.contiguous(), b1, w2.contiguous(), b2


# --- the ops -------------------------------------------------------------------------------------------


def _run(ctx: Any, cfg: MoEConfig, x: Any, router: Any, w1: Any, b1: Any, w2: Any, b2: Any) -> Any:
    if ctx is not None and ctx.static and x.is_cuda and not triton_ok(x, w1, cfg):  # pragma: cuda
        forbid_static(ctx, "MoE without Triton reads its expert counts on the host")
    return moe(x, router, w1, b1, w2, b2, cfg, rowwise=is_rowwise(ctx))


def _experts(node: Node) -> Fn:
    """The lowering's `MoE`: inputs x, router logits, w1 `[E, N1, H]` (gated: gate rows, then up rows), b1
    ("" if none), w2 `[E, H, I]`, b2 ("" if none); the com.microsoft attributes plus `gated`. With `packed`
    ("int4" or "fp4", and `block`): w1 and w2 are `kernels.moe.Packed` codes `[E, N, K / 2]`, followed by
    inputs s1, z1, s2, z2 (scales, zero points or "")."""
    cfg = moe_config(node, gated_by_fc3=False)
    packed = _text(node.attr("packed", ""))
    block = int(node.attr("block", 0))

    def f(
        ctx: Any,
        x: Any,
        router: Any,
        w1: Any,
        b1: Any = None,
        w2: Any = None,
        b2: Any = None,
        s1: Any = None,
        z1: Any = None,
        s2: Any = None,
        z2: Any = None,
    ) -> tuple[Any, ...]:
        if packed:
            w1 = Packed(w1, s1, z1, packed == "fp4", block)
            w2 = Packed(w2, s2, z2, packed == "fp4", block)
        return (_run(ctx, cfg, x, router, w1, b1, w2, b2),)

    return f


def _moe(node: Node) -> Fn:
    """com.microsoft `MoE` on the graph's own inputs (weights prepared at each call)."""
    moe_config(node, gated_by_fc3=len(node.inputs) > 6 and bool(node.inputs[6]))  # checked at load

    def f(
        ctx: Any,
        x: Any,
        router: Any,
        w1: Any,
        b1: Any = None,
        w2: Any = None,
        b2: Any = None,
        w3: Any = None,
        b3: Any = None,
    ) -> tuple[Any, ...]:
        dev = x.device
        ws = [None if t is None else t.to(dev) for t in (w1, b1, w2, b2, w3, b3)]
        cfg, *dense = prepared(node, *ws)
        return (_run(ctx, cfg, x, router, *dense),)

    return f


def _qmoe(node: Node) -> Fn:
    """com.microsoft `QMoE` on the graph's own inputs (experts dequantized at each call)."""
    moe_config(node, gated_by_fc3=len(node.inputs) > 8 and bool(node.inputs[8]))

    def f(ctx: Any, x: Any, router: Any, *rest: Any) -> tuple[Any, ...]:
        ins = [None, None, *(None if t is None else t.to(x.device) for t in rest)]
        cfg, *dense = prepared(node, *_qmoe_dense(node, ins, x.dtype))
        return (_run(ctx, cfg, x, router, *dense),)

    return f


def _pack_block(k: int, block: int) -> int:
    """The `Packed` block of a projection quantized per `block` along K (0: per output row): the block itself
    when it divides K and 128, per row the largest of 128, 64, 32, 16 dividing K; 0 when none fits."""
    if block:
        return block if k % block == 0 and 128 % block == 0 else 0
    return next((b for b in (128, 64, 32, 16) if k % b == 0), 0)


def pack_int4(
    qw: torch.Tensor, scales: torch.Tensor, zp: torch.Tensor | None, block: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """QMoE's raw 4-bit experts (`[E, N, K / 2]`, block-wise or per-row scales, optional packed zero points)
    -> `Packed`'s (codes: the same bytes, float32 scales and zero points per block, block). Per-row scales
    are repeated over `_pack_block`'s blocks."""
    e, n = qw.shape[0], qw.shape[1]
    pb = _pack_block(k, block)
    nb = k // pb
    if block:
        sc = scales.reshape(e, n, nb).float()
    else:
        sc = scales.reshape(e, n, 1).float().expand(e, n, nb)
    z = None
    if zp is not None:
        zu = unpack_nibbles(zp.to(torch.uint8).reshape(e, n if block else 1, -1))
        z = (zu[..., :nb] if block else zu.reshape(e, -1)[:, :n, None].expand(e, n, nb)).float()
    return qw.to(torch.uint8).contiguous(), sc.contiguous(), None if z is None else z.contiguous(), pb


def pack_mxfp4(
    qw: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """QMoE's MXFP4 experts (codes `[E, K, N / 2]`, e8m0 scales `[E, N, K / 32]`, global scales) -> `Packed`'s
    codes `[E, N, K / 2]` (K-packed: the same e2m1 codes, two along K per byte) and float32 scales
    `2^(s - 127) * global`, one expert at a time."""
    e, k = qw.shape[0], qw.shape[1]
    n = scales.shape[1]
    codes = torch.empty((e, n, k // 2), dtype=torch.uint8, device=qw.device)
    for i in range(e):
        codes[i] = pack_nibbles(unpack_nibbles(qw[i].to(torch.uint8))[:, :n].T.contiguous())
    sc = torch.pow(2.0, scales.to(torch.uint8).float() - 127.0)
    if global_scale is not None:
        sc = sc * global_scale.reshape(-1, 1, 1).float()
    return codes, sc.contiguous()


def _qmoe_packed(node: Node, t: list[Any]) -> tuple[str, int, tuple[Any, ...]] | None:
    """QMoE's inputs 2..16 kept packed: (kind "int4" / "fp4", block, (codes1, b1, codes2, b2, codes3, b3,
    scales1, zeros1, scales2, zeros2, scales3, zeros3)), or None when they cannot be (8-bit, a block that
    does not divide K or 128: then dequantized)."""
    qt = _text(node.attr("quant_type", "int")).lower()
    if qt == "fp4":
        projections = [(t[2], t[3], t[15]), (t[5], t[6], t[16]), (t[8], t[9], None)]
        if any(w is not None and w.shape[1] % 32 for w, _, _ in projections):
            return None
        out = [None if w is None else pack_mxfp4(w, s, g) for w, s, g in projections]
        c = [None if o is None else o[0] for o in out]
        sc = [None if o is None else o[1] for o in out]
        return "fp4", 32, (c[0], t[4], c[1], t[7], c[2], t[10], sc[0], None, sc[1], None, sc[2], None)
    if qt != "int" or int(node.attr("expert_weight_bits", 4)) != 4:
        return None
    block = int(node.attr("block_size", 0) or 0)
    hidden, inter = t[5].shape[1], 2 * t[5].shape[2]
    if not _pack_block(hidden, block) or _pack_block(hidden, block) != _pack_block(inter, block):
        return None
    p1 = pack_int4(t[2], t[3], t[11], block, hidden)
    p2 = pack_int4(t[5], t[6], t[12], block, inter)
    p3 = None if t[8] is None else pack_int4(t[8], t[9], t[13], block, hidden)
    c3, s3, z3 = (None, None, None) if p3 is None else p3[:3]
    return "int4", p1[3], (p1[0], t[4], p2[0], t[7], c3, t[10], p1[1], p1[2], p2[1], p2[2], s3, z3)


# --- the lowering's rewrite ----------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def prepare_moe(
    nodes: list[Node],
    consts: dict[str, torch.Tensor],
    device: torch.device,
    spec: Any,
    *,
    packed: bool = False,
    on_device: set[str] | None = None,
) -> list[Node]:
    """Every com.microsoft `MoE` / `QMoE` whose expert tensors are constants -> the lowering's `MoE` over
    weights prepared once, made on the device (CUDA: the stored tensors are copied there first, so no host
    copy of the experts is made) and stored in `consts` (their names added to `on_device`); the originals
    are left to the placement, which drops what no node reads. Dense by default (`prepared`; QMoE dequantized
    to the model's dtype, `spec.kv_dtype`); `packed` (`int4="packed"`): QMoE's 4-bit and MXFP4 experts stay
    4-bit (`kernels.moe.Packed`: the products dequantize them tile by tile; 8-bit experts are dequantized).
    Raises `UnsupportedOp` for what `prepared` / `_qmoe_dense` cannot run, and for integer QMoE weights in the
    CUDA-prepacked layout (a package made for the CUDA provider that does not say `weights_prepacked=0`)."""
    dev = device if device.type == "cuda" else torch.device("cpu")
    dtype = _DTYPES.get(getattr(spec, "kv_dtype", "float32"), torch.float32)
    cuda_package = _made_for_cuda(spec)
    for n in nodes:
        if n.domain != MS or n.op not in ("MoE", "QMoE"):
            continue
        q = n.op == "QMoE"
        weights = range(2, 17) if q else range(2, 8)
        ins = n.inputs + [""] * (17 - len(n.inputs))
        if not all(ins[i] in consts for i in weights if ins[i]):
            continue  # computed weights: the op prepares them at each call
        if q and _text(n.attr("quant_type", "int")).lower() == "int":
            pre = n.attr("weights_prepacked")
            if (pre is None and cuda_package) or (pre is not None and int(pre) != 0):
                raise _unsupported(n, "CUDA-prepacked weights: build with qmoe_weights_prepacked=0 or -e cpu")
        t = [consts[x].to(dev) if x and i >= 2 else None for i, x in enumerate(ins[:17])]
        kept = _qmoe_packed(n, t) if q and packed else None
        extra: dict[str, Any] = {}
        if kept is not None:
            kind, block, (c1, b1, c2, b2, c3, b3, s1, z1, s2, z2, s3, z3) = kept
            b1, b2, b3 = (None if b is None else b.to(dtype) for b in (b1, b2, b3))
            cfg, w1, b1, w2, b2 = prepared(
                n, c1, b1, c2, b2, c3, b3, shape=(c1.shape[0], c1.shape[1], 2 * c1.shape[2])
            )
            fusion = int(n.attr("swiglu_fusion", 0))
            s1 = gate_up_rows(s1, fusion, s3) if cfg.gated else s1
            z1 = None if z1 is None else (gate_up_rows(z1, fusion, z3) if cfg.gated else z1)
            tensors = {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "s1": s1, "z1": z1, "s2": s2, "z2": z2}
            extra = {"packed": kind, "block": block}
        else:
            dense = _qmoe_dense(n, t, dtype) if q else (t[2], t[3], t[4], t[5], t[6], t[7])
            cfg, w1, b1, w2, b2 = prepared(n, *dense)
            tensors = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
        names = []
        for role, v in tensors.items():
            if v is None:
                names.append("")
                continue
            name = f"{n.name}::{role}"
            consts[name] = v.contiguous()
            names.append(name)
            if on_device is not None:
                on_device.add(name)
        while names and not names[-1]:
            names.pop()
        n.attrs = {**n.attrs, "gated": int(cfg.gated), **extra}
        n.op, n.domain, n.inputs = "MoE", INTERNAL, [ins[0], ins[1], *names]
    return nodes


def _made_for_cuda(spec: Any) -> bool:
    """Whether the package's genai_config names the CUDA provider (the builder's `-e cuda`)."""
    cfg = getattr(spec, "config", None) or {}
    opts = cfg.get("model", {}).get("decoder", {}).get("session_options", {}).get("provider_options", [])
    return any(isinstance(o, dict) and "cuda" in o for o in opts)


BUILDERS: dict[tuple[str, str], Builder] = {
    (MS, "MoE"): _moe,
    (MS, "QMoE"): _qmoe,
    (INTERNAL, "MoE"): _experts,
}
