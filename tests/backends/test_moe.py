"""The native MoE / QMoE ops (`ops.moe`, `kernels.moe`'s torch path) against onnxruntime's CPU kernels on
one-node graphs (random routing, k = 1..4, ragged token counts, biases on and off, the activations the
builder emits), both as the com.microsoft op runs on the graph's inputs and as the lowering's `MoE` runs on
the weights `prepare_moe` made; the forms onnxruntime's CPU lacks (geglu, fc3, swiglu_fusion 2, the sparse
mixer, bf16, 8-bit experts: onnxruntime's CPU kernel quantizes the activations to int8 there) against a
float64 loop over the tokens; MXFP4 experts against the checkpoint's own decoding; and the clear errors."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from onnxgen.backends.native import ops as O  # noqa: E402
from onnxgen.backends.native.kernels import moe as K  # noqa: E402
from onnxgen.backends.native.ops import moe as M  # noqa: E402
from onnxgen.errors import UnsupportedOp  # noqa: E402

GPT_OSS = {"activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": 1.702, "activation_beta": 1.0}


class _Spec:
    def __init__(self, kv_dtype: str = "float32", config: dict[str, Any] | None = None) -> None:
        self.kv_dtype = kv_dtype
        self.config = config or {}


def _ort(
    op: str, attrs: dict[str, Any], inits: dict[str, np.ndarray], names: list[str], x: Any, r: Any
) -> Any:
    """onnxruntime's CPU result of a one-node `op` graph: inputs x, router, then `names` (initializers)."""
    tt = TensorProto.FLOAT16 if x.dtype == np.float16 else TensorProto.FLOAT
    node = helper.make_node(op, ["x", "router", *names], ["y"], domain="com.microsoft", **attrs)
    graph = helper.make_graph(
        [node],
        "moe",
        [
            helper.make_tensor_value_info("x", tt, list(x.shape)),
            helper.make_tensor_value_info("router", tt, list(r.shape)),
        ],
        [helper.make_tensor_value_info("y", tt, list(x.shape))],
        [numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x, "router": r})[0]


def _node(op: str, attrs: dict[str, Any], names: list[str]) -> O.Node:
    proto = helper.make_node(op, ["x", "router", *names], ["y"], domain="com.microsoft", **attrs)
    return O.Node(
        op,
        "com.microsoft",
        "moe",
        list(proto.input),
        ["y"],
        {a.name: helper.get_attribute_value(a) for a in proto.attribute},
    )


def _native(
    op: str,
    attrs: dict[str, Any],
    inits: dict[str, np.ndarray],
    names: list[str],
    x: Any,
    r: Any,
    dtype: Any = None,
) -> list[Any]:
    """The com.microsoft op on the graph's inputs, and the lowering's MoE on `prepare_moe`'s weights (dense;
    for QMoE also kept packed, where they can be)."""
    tx, tr = torch.from_numpy(x), torch.from_numpy(r)
    if dtype is not None:
        tx, tr = tx.to(dtype), tr.to(dtype)
    ins = [torch.from_numpy(inits[n]) if n else None for n in names]
    if dtype is not None:
        ins = [t.to(dtype) if t is not None and t.is_floating_point() else t for t in ins]
    node = _node(op, attrs, names)
    out = [O.builder(node)(node)(None, tx, tr, *ins)[0]]
    spec = _Spec({None: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype])
    for packed in (False, True) if op == "QMoE" else (False,):
        consts = {n: t for n, t in zip(names, ins, strict=True) if n}
        (low,) = M.prepare_moe([_node(op, attrs, names)], consts, torch.device("cpu"), spec, packed=packed)
        assert (low.domain, low.op) == ("onnxgen", "MoE")
        if packed and int(attrs.get("expert_weight_bits", 4)) == 4:
            assert low.attrs["packed"] in ("int4", "fp4")
        out.append(O.builder(low)(low)(None, tx, tr, *(consts[n] if n else None for n in low.inputs[2:]))[0])
    return out


def _weights(rng: Any, e: int, h: int, inter: int, gated: bool, bias: bool) -> dict[str, np.ndarray]:
    n1 = 2 * inter if gated else inter
    out = {
        "w1": (rng.standard_normal((e, n1, h)) / math.sqrt(h)).astype(np.float32),
        "w2": (rng.standard_normal((e, h, inter)) / math.sqrt(inter)).astype(np.float32),
    }
    if bias:
        out["b1"] = (0.5 * rng.standard_normal((e, n1))).astype(np.float32)
        out["b2"] = (0.5 * rng.standard_normal((e, h))).astype(np.float32)
    return out


def _ref(
    x: Any,
    r: Any,
    w1: Any,
    b1: Any,
    w2: Any,
    b2: Any,
    *,
    k: int,
    act: str,
    layout: str = "interleaved",
    w3: Any = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    limit: float = math.inf,
    normalize: bool = False,
    sparse: bool = False,
) -> np.ndarray:
    """A float64 loop over the tokens, straight from onnxruntime's op description."""
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        s = np.asarray(r[t], np.float64)
        if sparse:
            idx, wts = [], []
            masked = s.copy()
            for _ in range(2):
                j = int(np.argmax(masked))
                drop = (masked[j] - s) / np.maximum(np.abs(s), masked[j]) > 2 * K.SPARSE_MIXER_EPS
                g = np.where(drop, -np.inf, masked)
                g = np.exp(g - g.max())
                idx.append(j)
                wts.append(g[j] / g.sum())
                masked[j] = -np.inf
        else:
            p = np.exp(s - s.max())
            p /= p.sum()
            idx = list(np.argsort(-p, kind="stable")[:k])
            wts = p[idx] / (p[idx].sum() if normalize else 1.0)
        for e, we in zip(idx, wts, strict=True):
            h = np.asarray(w1[e], np.float64) @ x[t] + (0 if b1 is None else b1[e])
            if w3 is not None:
                g, u = h, np.asarray(w3[e], np.float64) @ x[t]
            elif act in ("swiglu", "geglu"):
                half = h.shape[0] // 2
                g, u = (h[0::2], h[1::2]) if layout == "interleaved" else (h[:half], h[half:])
            else:
                g, u = h, None
            if act == "swiglu":
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
                a = g / (1 + np.exp(-alpha * g)) * (u + beta)
            else:
                f = {
                    "silu": lambda v: v / (1 + np.exp(-v)),
                    "geglu": lambda v: 0.5 * v * (1 + np.tanh(0.7978845608028654 * (v + 0.044715 * v**3))),
                    "gelu": lambda v: 0.5 * v * (1 + np.tanh(0.7978845608028654 * (v + 0.044715 * v**3))),
                    "relu": lambda v: np.maximum(v, 0),
                    "relu2": lambda v: np.maximum(v, 0) ** 2,
                    "identity": lambda v: v,
                }[act]
                a = f(g) if u is None else f(g) * u
            out[t] += we * (np.asarray(w2[e], np.float64) @ a + (0 if b2 is None else b2[e]))
    return out


def _close(got: Any, want: Any, tol: float) -> None:
    got = got.double().numpy() if isinstance(got, torch.Tensor) else np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want).max()))
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= tol * scale, float(np.abs(got - want).max())


CASES = [
    # (k, tokens, activation attributes, bias, normalize)
    (1, 1, GPT_OSS | {"swiglu_limit": 7.0}, True, True),
    (2, 5, GPT_OSS | {"swiglu_limit": 7.0}, True, True),
    (4, 33, GPT_OSS | {"swiglu_limit": 7.0}, False, True),
    (3, 17, {"activation_type": "swiglu", "swiglu_fusion": 1}, True, False),  # alpha 1, beta 0, no limit
    (2, 9, {"activation_type": "silu"}, True, True),
    (3, 4, {"activation_type": "gelu"}, False, False),
    (2, 12, {"activation_type": "relu"}, True, False),
    (4, 6, {"activation_type": "identity"}, True, True),
]


@pytest.mark.parametrize(("k", "tokens", "act", "bias", "normalize"), CASES)
def test_moe_equals_onnxruntime(
    k: int, tokens: int, act: dict[str, Any], bias: bool, normalize: bool
) -> None:
    rng = np.random.default_rng(k * 100 + tokens)
    e, h, inter = 6, 32, 24
    gated = act["activation_type"] == "swiglu"
    w = _weights(rng, e, h, inter, gated, bias)
    names = ["w1", "b1" if bias else "", "w2", "b2" if bias else ""]
    x = rng.standard_normal((tokens, h)).astype(np.float32)
    r = (2 * rng.standard_normal((tokens, e))).astype(np.float32)
    attrs = {"k": k, "normalize_routing_weights": int(normalize), **act}
    want = _ort("MoE", attrs, w, names, x, r)
    for got in _native("MoE", attrs, w, names, x, r):
        _close(got, want, 2e-6)


def test_moe_fp16_equals_onnxruntime() -> None:
    rng = np.random.default_rng(3)
    e, h, inter, t = 4, 32, 16, 11
    w = {n: a.astype(np.float16) for n, a in _weights(rng, e, h, inter, True, True).items()}
    x = rng.standard_normal((t, h)).astype(np.float16)
    r = rng.standard_normal((t, e)).astype(np.float16)
    attrs = {"k": 2, "normalize_routing_weights": 1, **GPT_OSS, "swiglu_limit": 7.0}
    want = _ort("MoE", attrs, w, ["w1", "b1", "w2", "b2"], x, r)
    for got in _native("MoE", attrs, w, ["w1", "b1", "w2", "b2"], x, r, torch.float16):
        assert got.dtype == torch.float16
        _close(got.float(), want, 4e-3)


def test_tokens_route_independently() -> None:
    """A ragged batch's tokens (one [1, T] step of several sequences) give each token's own result: the op
    over all of them equals the op over each part, and the layer keeps the input's shape."""
    rng = np.random.default_rng(5)
    w = {n: torch.from_numpy(a) for n, a in _weights(rng, 8, 32, 16, True, True).items()}
    cfg = K.MoEConfig(k=3, activation="swiglu", gated=True, alpha=1.702, beta=1.0, limit=7.0, normalize=True)
    x = torch.randn(1, 20, 32, generator=torch.Generator().manual_seed(0))
    r = torch.randn(20, 8, generator=torch.Generator().manual_seed(1))
    whole = K.moe(x, r, w["w1"], w["b1"], w["w2"], w["b2"], cfg)
    assert whole.shape == x.shape
    parts = [
        K.moe(x[:, a:b], r[a:b], w["w1"], w["b1"], w["w2"], w["b2"], cfg)
        for a, b in ((0, 1), (1, 8), (8, 20))
    ]
    torch.testing.assert_close(whole, torch.cat(parts, dim=1), rtol=0, atol=1e-6)
    assert K.moe(x[:, :0], r[:0], w["w1"], w["b1"], w["w2"], w["b2"], cfg).shape == (1, 0, 32)


def _q4(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 (zero point 8) of `[E, N, K]`, per block of K (0: per row): raw bytes, scales."""
    e, n, k = w.shape
    nb = k // block if block else 1
    wb = w.reshape(e, n, nb, -1)
    sc = np.abs(wb).max(-1) / 7.0
    q = np.clip(np.round(wb / sc[..., None]) + 8, 0, 15).astype(np.uint8).reshape(e, n, k)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8), sc.astype(np.float32).reshape(
        e, n, nb
    ) if block else sc.astype(np.float32).reshape(e, n)


@pytest.mark.parametrize(
    ("block", "zero_points", "tokens", "k"),
    [(32, False, 7, 2), (64, False, 1, 1), (0, False, 13, 3), (32, True, 5, 4)],
)
def test_qmoe_int4_equals_onnxruntime(block: int, zero_points: bool, tokens: int, k: int) -> None:
    rng = np.random.default_rng(block + tokens)
    e, h, inter = 5, 64, 64
    w = _weights(rng, e, h, inter, True, True)
    q1, s1 = _q4(w["w1"], block)
    q2, s2 = _q4(w["w2"], block)
    inits = {"q1": q1, "s1": s1, "b1": w["b1"], "q2": q2, "s2": s2, "b2": w["b2"]}
    names = ["q1", "s1", "b1", "q2", "s2", "b2"]
    if zero_points:  # one zero point per block, two per byte
        nb1, nb2 = h // block, inter // block
        inits["z1"] = rng.integers(0, 256, (e, 2 * inter, (nb1 + 1) // 2)).astype(np.uint8)
        inits["z2"] = rng.integers(0, 256, (e, h, (nb2 + 1) // 2)).astype(np.uint8)
        names += ["", "", "", "z1", "z2"]
    attrs = {"k": k, "normalize_routing_weights": 1, **GPT_OSS, "swiglu_limit": 7.0, "expert_weight_bits": 4}
    if block:
        attrs["block_size"] = block
    x = rng.standard_normal((tokens, h)).astype(np.float32)
    r = rng.standard_normal((tokens, e)).astype(np.float32)
    want = _ort("QMoE", attrs, inits, names, x, r)
    for got in _native("QMoE", attrs, inits, names, x, r):
        _close(got, want, 2e-6)


def test_qmoe_int8_equals_float64() -> None:
    """8-bit experts dequantized exactly ((q - 128) * scale per block). onnxruntime's CPU kernel quantizes the
    activations to int8 for them (its `accuracy_level` note), so the reference is float64 on the dequantized
    weights."""
    rng = np.random.default_rng(8)
    e, h, inter, t = 4, 64, 32, 6
    q1 = rng.integers(0, 256, (e, 2 * inter, h)).astype(np.uint8)
    q2 = rng.integers(0, 256, (e, h, inter)).astype(np.uint8)
    s1 = (rng.random((e, 2 * inter, h // 32)) / 800).astype(np.float32)
    s2 = (rng.random((e, h, inter // 32)) / 800).astype(np.float32)
    attrs = {
        "k": 2,
        "normalize_routing_weights": 1,
        **GPT_OSS,
        "swiglu_limit": 7.0,
        "expert_weight_bits": 8,
        "block_size": 32,
    }
    x = rng.standard_normal((t, h)).astype(np.float32)
    r = rng.standard_normal((t, e)).astype(np.float32)
    d1 = (q1.astype(np.float64) - 128) * np.repeat(s1, 32, -1)
    d2 = (q2.astype(np.float64) - 128) * np.repeat(s2, 32, -1)
    want = _ref(x, r, d1, None, d2, None, k=2, act="swiglu", alpha=1.702, beta=1.0, limit=7.0, normalize=True)
    for got in _native(
        "QMoE", attrs, {"q1": q1, "s1": s1, "q2": q2, "s2": s2}, ["q1", "s1", "", "q2", "s2", ""], x, r
    ):
        _close(got, want, 1e-5)


FLOAT64_CASES = {
    "geglu-interleaved": ({"activation_type": "geglu", "swiglu_fusion": 1}, "interleaved", False),
    "geglu-halves": ({"activation_type": "geglu", "swiglu_fusion": 2}, "halves", False),
    "swiglu-halves": (
        {"activation_type": "swiglu", "swiglu_fusion": 2, "swiglu_limit": 5.0},
        "halves",
        False,
    ),
    "swiglu-fc3": ({"activation_type": "swiglu", "swiglu_fusion": 0}, "fc3", False),
    "silu-fc3": ({"activation_type": "silu"}, "fc3", False),
    "relu2": ({"activation_type": "relu2"}, "", False),
    "sparse-mixer": ({"activation_type": "silu", "use_sparse_mixer": 1}, "fc3", True),
}


@pytest.mark.parametrize("case", sorted(FLOAT64_CASES))
def test_forms_onnxruntime_cpu_lacks_equal_float64(case: str) -> None:
    act, layout, sparse = FLOAT64_CASES[case]
    rng = np.random.default_rng(len(case))
    e, h, inter, t, k = 6, 32, 16, 9, 2
    gated = act["activation_type"] in ("swiglu", "geglu") and layout != "fc3"
    w = _weights(rng, e, h, inter, gated, True)
    names = ["w1", "b1", "w2", "b2"]
    w3 = None
    if layout == "fc3":
        w3 = (rng.standard_normal((e, inter, h)) / math.sqrt(h)).astype(np.float32)
        w["w3"] = w3
        names += ["w3"]
    x = rng.standard_normal((t, h)).astype(np.float32)
    r = rng.standard_normal((t, e)).astype(np.float32)
    r[0, 1] = r[0, 0] + 1e-3  # a near tie: the sparse mixer keeps both in the softmax
    attrs = {"k": k, "normalize_routing_weights": 1, **act}
    want = _ref(
        x,
        r,
        w["w1"],
        w["b1"],
        w["w2"],
        w["b2"],
        k=k,
        act=act["activation_type"],
        layout=layout,
        w3=w3,
        limit=act.get("swiglu_limit", math.inf),
        normalize=True,
        sparse=sparse,
    )
    for got in _native("MoE", attrs, w, names, x, r):
        _close(got, want, 2e-6)


def test_bf16_layer_equals_float64_to_its_roundings() -> None:
    """bf16 in, bf16 out: float32 routing and accumulation, each product and the activation rounded once."""
    rng = np.random.default_rng(16)
    e, h, inter, t = 8, 64, 32, 21
    w = _weights(rng, e, h, inter, True, True)
    w = {n: torch.from_numpy(a).to(torch.bfloat16).float().numpy() for n, a in w.items()}  # bf16 values
    x = torch.from_numpy(rng.standard_normal((t, h)).astype(np.float32)).to(torch.bfloat16).float().numpy()
    r = torch.from_numpy(rng.standard_normal((t, e)).astype(np.float32)).to(torch.bfloat16).float().numpy()
    attrs = {"k": 4, "normalize_routing_weights": 1, **GPT_OSS, "swiglu_limit": 7.0}
    want = _ref(
        x,
        r,
        w["w1"],
        w["b1"],
        w["w2"],
        w["b2"],
        k=4,
        act="swiglu",
        alpha=1.702,
        beta=1.0,
        limit=7.0,
        normalize=True,
    )
    for got in _native("MoE", attrs, w, ["w1", "b1", "w2", "b2"], x, r, torch.bfloat16):
        assert got.dtype == torch.bfloat16
        _close(got.float(), want, 2e-2)


def test_mxfp4_experts_dequantize_to_the_checkpoints_values() -> None:
    """QMoE's fp4 experts ([E, K, N/2] codes, e8m0 scales, global scales) hold exactly the MXFP4 values of the
    checkpoint (gpt-oss's `_blocks` / `_scales`, decoded by `convert.zoo.mxfp4_decode`), and the op on them
    equals the dense op on those values."""
    from onnxgen.convert.zoo import mxfp4_decode, mxfp4_encode

    g = torch.Generator().manual_seed(4)
    e, n, kk = 3, 48, 64
    blocks, scales = mxfp4_encode(torch.randn(e, n, kk, generator=g))
    dense = mxfp4_decode(blocks, scales)
    # the builder's repacking (GptOssMXFP4Loader.pack_blocks_for_qmoe): [E, N, K/32, 16] -> [E, K, N/2]
    codes = torch.stack((blocks & 0x0F, blocks >> 4), -1).reshape(e, n, kk)  # [E, N, K]
    kn = codes.transpose(1, 2)  # [E, K, N]
    packed = (kn[..., 0::2] | (kn[..., 1::2] << 4)).contiguous()
    glob = torch.tensor([1.0, 2.0, 0.5])
    got = M.dequant_mxfp4(packed, scales, glob, torch.float32)
    torch.testing.assert_close(got, dense * glob[:, None, None], rtol=0, atol=0)

    try:
        from onnxruntime_genai.models.loaders.gptoss import GptOssMXFP4Loader
    except ImportError:
        return
    theirs = GptOssMXFP4Loader(".").pack_blocks_for_qmoe(blocks)
    assert torch.equal(theirs, packed)


def test_qmoe_fp4_op_equals_dense_op() -> None:
    from onnxgen.convert.zoo import mxfp4_encode

    g = torch.Generator().manual_seed(6)
    e, h, inter, t = 4, 64, 32, 5
    qs = {}
    dense = {}
    for name, (n, kk) in {"1": (2 * inter, h), "2": (h, inter)}.items():
        blocks, scales = mxfp4_encode(torch.randn(e, n, kk, generator=g) / 8)
        codes = torch.stack((blocks & 0x0F, blocks >> 4), -1).reshape(e, n, kk).transpose(1, 2)
        qs["q" + name] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous().numpy()
        qs["s" + name] = scales.numpy()
        qs["g" + name] = np.ones(e, np.float32)
        dense["w" + name] = M.dequant_mxfp4(
            torch.from_numpy(qs["q" + name]), scales, None, torch.float32
        ).numpy()
    qs["b1"] = np.zeros((e, 2 * inter), np.float32)
    qs["b2"] = np.zeros((e, h), np.float32)
    x = torch.randn(t, h, generator=g).numpy()
    r = torch.randn(t, e, generator=g).numpy()
    attrs = {
        "k": 2,
        "normalize_routing_weights": 1,
        **GPT_OSS,
        "swiglu_limit": 7.0,
        "expert_weight_bits": 4,
        "block_size": 32,
        "quant_type": "fp4",
    }
    names = ["q1", "s1", "b1", "q2", "s2", "b2", *[""] * 9, "g1", "g2"]
    want = _ref(
        x,
        r,
        dense["w1"],
        None,
        dense["w2"],
        None,
        k=2,
        act="swiglu",
        alpha=1.702,
        beta=1.0,
        limit=7.0,
        normalize=True,
    )
    for got in _native("QMoE", attrs, qs, names, x, r):
        _close(got, want, 2e-6)


def _lowered_error(
    op: str, attrs: dict[str, Any], shapes: dict[str, tuple[int, ...]], names: list[str], spec: Any = None
) -> str:
    node = _node(op, attrs, names)
    consts = {
        n: torch.zeros(s, dtype=torch.uint8 if n.startswith("q") else torch.float32)
        for n, s in shapes.items()
    }
    with pytest.raises(UnsupportedOp) as info:
        O.builder(node)(node)
        M.prepare_moe([node], consts, torch.device("cpu"), spec or _Spec())
    return str(info.value)


@pytest.mark.parametrize(
    ("attrs", "why"),
    [
        ({"activation_type": "softplus"}, "activation_type=softplus"),
        (
            {"activation_type": "swiglu", "swiglu_fusion": 1, "swiglu_limit_after_activation": 1},
            "swiglu_limit_after_activation",
        ),
        ({"activation_type": "silu", "use_sparse_mixer": 1, "k": 1}, "use_sparse_mixer with k=1"),
        ({"activation_type": "swiglu", "swiglu_fusion": 0}, "swiglu with swiglu_fusion=0 and no fc3"),
    ],
)
def test_unsupported_moe_forms_name_themselves(attrs: dict[str, Any], why: str) -> None:
    shapes = {"w1": (2, 32, 16), "w2": (2, 16, 16)}
    msg = _lowered_error("MoE", {"k": 2, **attrs}, shapes, ["w1", "", "w2"])
    assert why in msg and "backend='ort'" in msg


@pytest.mark.parametrize(
    ("attrs", "extra", "why"),
    [
        ({"weights_prepacked": 1}, {}, "CUDA-prepacked"),
        ({"expert_weight_bits": 2}, {}, "expert_weight_bits=2"),
        ({"quant_type": "nvfp4"}, {}, "quant_type=nvfp4"),
        ({"fc2_expert_weight_bits": 8}, {}, "mixed-width"),
        ({}, {"rw": (3, 2)}, "router_weights"),
        ({}, {"q1": (2, 16, 16)}, "not the raw layout"),  # [E, K, N / 2]: a CUDA-prepacked shape
    ],
)
def test_unsupported_qmoe_forms_name_themselves(
    attrs: dict[str, Any], extra: dict[str, Any], why: str
) -> None:
    shapes = {"q1": (2, 32, 8), "s1": (2, 32), "q2": (2, 16, 8), "s2": (2, 16), **extra}
    names = ["q1", "s1", "", "q2", "s2", ""] + (["", "", "", "", "", "", "rw"] if "rw" in extra else [])
    base = {"k": 2, "activation_type": "swiglu", "swiglu_fusion": 1, "expert_weight_bits": 4}
    assert why in _lowered_error("QMoE", {**base, **attrs}, shapes, names)


def test_a_cuda_package_s_int_qmoe_is_taken_as_prepacked() -> None:
    """The builder writes integer QMoE experts CUTLASS-prepacked for `-e cuda` without saying so (the op's
    default `weights_prepacked=-1`): such a package is refused with the build option that avoids it."""

    cuda = _Spec(config={"model": {"decoder": {"session_options": {"provider_options": [{"cuda": {}}]}}}})
    shapes = {"q1": (2, 16, 16), "s1": (2, 32), "q2": (2, 16, 8), "s2": (2, 16)}
    base = {"k": 2, "activation_type": "swiglu", "swiglu_fusion": 1, "expert_weight_bits": 4}
    msg = _lowered_error("QMoE", base, shapes, ["q1", "s1", "", "q2", "s2", ""], cuda)
    assert "qmoe_weights_prepacked=0" in msg


def test_the_grouped_products_take_the_decode_tiles_while_experts_have_few_rows() -> None:
    """Decode steps, batched decode and verify steps (`rowwise`: a decode step's bits) take the decode
    configuration; a prefill chunk whose experts average 32 rows or more, the prefill one."""
    assert K.moe_config(4, 32, False) == K.DECODE_CONFIG  # one token, top 4 of 32
    assert K.moe_config(64 * 4, 32, False) == K.DECODE_CONFIG  # 64 running requests
    assert K.moe_config(2048 * 4, 32, False) == K.PREFILL_CONFIG
    assert K.moe_config(2048 * 4, 32, True) == K.DECODE_CONFIG
    p = K.Packed(torch.zeros(2, 8, 16, dtype=torch.uint8), torch.ones(2, 8, 1), None, False, 32)
    assert p.shape == (2, 8, 32) and p.is_contiguous()
    assert torch.equal(p.expert(1, torch.float32), torch.full((8, 32), -8.0))
