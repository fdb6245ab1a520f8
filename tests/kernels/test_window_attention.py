"""Sliding-window attention at the window's edges, in every attention path: the paged pool's torch reference
and Triton kernel, and the contiguous buffer's `cache_attention` (Triton and its reference), against dense
float64 attention with an explicit mask; with soft-capping and attention sinks (GroupQueryAttention's
head_sink) too, and the semantics of both checked against onnxruntime's GroupQueryAttention itself.

The window follows transformers' (and onnxruntime's `local_window_size`): a query at position p sees keys
p - window + 1 .. p, `window` keys. Keys below every query's window are poisoned with NaN (and, in the
pool, their pages replaced by a page of NaN, as freed pages may be reused by anyone): a path that reads any
of them returns NaN, so these tests also prove that the cost is the window's, not the context's.
Shapes are small: the interpreted kernels run on the CPU (`TRITON_INTERPRET=1`, `ONNXGEN_FORCE_TRITON=1`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from onnxgen.backends.batch import BatchStep, SeqChunk  # noqa: E402
from onnxgen.backends.native import paged  # noqa: E402
from onnxgen.kv.storage import PageStorage  # noqa: E402

from .dense_attention import dense_attention as _dense  # noqa: E402
from .dense_attention import softmax_with_sink as _softmax  # noqa: E402

P, HKV, N, D = 16, 2, 4, 16
POISON = 0  # the pool's page of NaN (never any sequence's)

# (start, new tokens) per sequence, with windows that put their edges inside, on and across page and key-block
# boundaries: decodes just below, at and above the window, a chunk crossing the window's edge, a chunk longer
# than the window, ragged rows at different positions.
CASES = {
    "decodes": ([(6, 1), (7, 1), (8, 1), (9, 1), (31, 1), (32, 1), (33, 1), (140, 1)], (8, 32)),
    "chunks": ([(0, 12), (20, 9), (28, 40), (90, 5)], (8, 20)),
    "ragged": ([(3, 1), (47, 6), (64, 1), (150, 30), (100, 1)], (17, 100)),
}


def _interpreted() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU runs Triton only under TRITON_INTERPRET=1")
    pytest.importorskip("triton")


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU host)")


def _pool(device: str, dtype: torch.dtype, shapes: list[tuple[int, int]], window: int, seed: int = 0):
    """A pool with every sequence's positions written, a step of (start, new tokens) chunks, and the same step
    whose pages wholly below each sequence's first window point at the NaN page (the holes a freed sequence
    has). Returns (storage, step, step with holes, q)."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = sum(-(-(s + m) // P) for s, m in shapes)
    st = PageStorage(2, pages_needed + 1, P, HKV, D, dtype, device)
    st.data.copy_(torch.randn(st.data.shape, generator=g).to(dtype))
    st.data[:, :, POISON] = float("nan")
    nxt = 1
    seqs, holed = [], []
    for start, m in shapes:
        n = -(-(start + m) // P)
        pages = list(range(nxt, nxt + n))[::-1]  # not in position order
        nxt += n
        seqs.append(SeqChunk([0] * m, start, pages))
        dead = paged.first_page(start, window, P)
        holed.append(SeqChunk([0] * m, start, [POISON] * dead + pages[dead:]))
        for p in range(dead * P, start - window + 1 if window > 0 else 0):  # below the window, in a live page
            st.data[:, :, pages[p // P], p % P] = float("nan")
    q = torch.randn(sum(m for _, m in shapes), N, D, generator=g).to(device=device, dtype=dtype)
    return st, BatchStep(tuple(seqs)), BatchStep(tuple(holed)), q


def _sink(device: str, seed: int = 7) -> torch.Tensor:
    """A head_sink logit per query head (gpt-oss's attention sinks), float32."""
    return (torch.randn(N, generator=torch.Generator().manual_seed(seed)) * 2).to(device)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.double().cpu()
    assert not got.isnan().any(), "a key outside every window was read"
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_torch_path_reads_only_the_window(case: str) -> None:
    shapes, windows = CASES[case]
    for window in windows:
        for softcap, sink in ((0.0, None), (5.0, None), (0.0, _sink("cpu"))):
            st, step, holed, q = _pool("cpu", torch.float32, shapes, window)
            want = _dense(st, step, q, 1, 0.3, window, softcap, sink)
            ps = paged.build_step(holed, st, P, torch.device("cpu"))
            got = paged.attention_ref(ps, 1, q, 0.3, softcap, window, sink)
            assert _rel(got, want) < 1e-6, (window, softcap, sink is not None)


def _paged_triton(device: str, dtype: torch.dtype, cases: list[str], nsplits: tuple[int | None, ...]) -> None:
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for case in cases:
        shapes, windows = CASES[case]
        for window in windows:  # odd windows soft-capped, even ones with sinks
            st, step, holed, q = _pool(device, dtype, shapes, window, seed=window)
            cap, sink = (5.0, None) if window % 2 else (0.0, _sink(device, window))
            want = _dense(st, step, q, 1, 0.3, window, cap, sink)
            for nsplit in nsplits:
                ps = paged.build_step(holed, st, P, torch.device(device))
                got = paged.attention_triton(ps, 1, q, 0.3, cap, window, nsplit=nsplit, sink=sink)
                assert _rel(got, want) < tol, (case, window, nsplit)


def test_interpreted_paged_kernel_reads_only_the_window() -> None:
    _interpreted()
    _paged_triton("cpu", torch.float32, ["decodes", "chunks"], (None, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_paged_kernel_reads_only_the_window(dtype: str) -> None:
    _cuda()
    _paged_triton("cuda", getattr(torch, dtype), sorted(CASES), (None, 1, 2, 5))


def test_key_splits_of_a_windowed_layer_are_planned_over_the_window() -> None:
    """A decode at 100k keys with a window of 512 plans its splits as a 512-key context does (and the launch
    does not read the context's length): cost and parallelism follow the window."""
    cpu = torch.device("cpu")
    bm, bn, _, _ = paged.tile_for(4, 4, 4, 64)
    assert paged.plan_splits(8, min(100_000, 512), bm, bn, cpu) == paged.plan_splits(8, 512, bm, bn, cpu) == 2
    assert paged.first_page(1000, 512, 16) == (1000 - 511) // 16 and paged.first_page(1000, -1, 16) == 0
    assert paged.first_page(100, 512, 16) == 0


# --- the contiguous buffer (`NativeDecoder`'s KV, static steps) ---------------------------------------------


def _buffer(device: str, dtype: torch.dtype, past: int, m: int, window: int, cap: int = 256, seed: int = 0):
    """A `[1, Hkv, cap, D]` buffer valid at [0, past + m), NaN below the first query's window and past the
    chunk; q `[1, N, m, D]`. Returns (clean k, clean v, poisoned k, poisoned v, q)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, HKV, cap, D, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(1, HKV, cap, D, generator=g).to(device=device, dtype=dtype)
    kp, vp = k.clone(), v.clone()
    lo = max(0, past - window + 1) if window > 0 else 0
    for t in (kp, vp):
        t[:, :, :lo] = float("nan")
        t[:, :, past + m :] = float("nan")
    q = torch.randn(1, N, m, D, generator=g).to(device=device, dtype=dtype)
    return k, v, kp, vp, q


# (past, new tokens, window): a decode below, at, just past and far past the window; chunks crossing its edge
BUFFER_CASES = [
    (5, 1, 8),
    (7, 1, 8),
    (8, 1, 8),
    (200, 1, 8),
    (200, 1, 100),
    (30, 10, 8),
    (60, 40, 20),
    (0, 24, 8),
]


def _cache_attention(device: str, dtype: torch.dtype) -> None:
    from onnxgen.backends.native.kernels.attention import cache_attention
    from onnxgen.backends.native.kernels.reference import cache_attention_ref

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for past, m, window in BUFFER_CASES:
        k, v, kp, vp, q = _buffer(device, dtype, past, m, window, seed=past)
        p = torch.tensor([past], device=device)
        softcap = 5.0 if m > 1 else 0.0
        sink = _sink(device, past) if past % 2 == 0 else None
        want = cache_attention_ref(q, k, v, p, 0.3, softcap, window, sink).double().cpu()
        got = cache_attention(q, kp, vp, p, 0.3, softcap, window, sink)
        assert _rel(got, want) < tol, (past, m, window)


def test_cache_attention_reference_masks_the_window() -> None:
    """The reference (the CPU path of static steps) against the paged path's dense float64 for one sequence."""
    from onnxgen.backends.native.kernels.reference import cache_attention_ref

    for past, m, window in BUFFER_CASES:
        k, v, _, _, q = _buffer("cpu", torch.float32, past, m, window, seed=past)
        sink = _sink("cpu", past) if past % 2 == 0 else None
        got = cache_attention_ref(q, k, v, torch.tensor([past]), 0.3, 0.0, window, sink)
        kk = k[0, :, : past + m].repeat_interleave(N // HKV, 0).double()
        vv = v[0, :, : past + m].repeat_interleave(N // HKV, 0).double()
        qpos = torch.arange(past, past + m).unsqueeze(1)
        kpos = torch.arange(past + m).unsqueeze(0)
        keep = (kpos <= qpos) & (kpos > qpos - window)
        sc = (q[0].double() @ kk.transpose(-1, -2) * 0.3).masked_fill(~keep, float("-inf"))
        assert _rel(got[0], _softmax(sc, sink) @ vv) < 1e-6


def test_interpreted_cache_attention_reads_only_the_window() -> None:
    _interpreted()
    from onnxgen.backends.native.kernels.dispatch import use_triton

    if not use_triton(torch.zeros(1)):
        pytest.skip("needs ONNXGEN_FORCE_TRITON=1")
    _cache_attention("cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_cache_attention_reads_only_the_window(dtype: str) -> None:
    _cuda()
    _cache_attention("cuda", getattr(torch, dtype))


# --- the semantics, against onnxruntime's GroupQueryAttention ------------------------------------------------


def _ort_gqa(q, k, v, past: int, window: int, softcap: float, sink: torch.Tensor | None) -> torch.Tensor:
    """One GroupQueryAttention node (scale 0.3) run by onnxruntime: `q` `[m, N, D]` at positions past ..
    past + m - 1; `k`/`v` `[Hkv, past + m, D]` (the first `past` as the past KV). Returns `[m, N, D]`."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    m, total = q.shape[0], past + q.shape[0]
    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    inputs = [
        helper.make_tensor_value_info("q", f32, [1, m, N * D]),
        helper.make_tensor_value_info("k", f32, [1, m, HKV * D]),
        helper.make_tensor_value_info("v", f32, [1, m, HKV * D]),
        helper.make_tensor_value_info("pk", f32, [1, HKV, past, D]),
        helper.make_tensor_value_info("pv", f32, [1, HKV, past, D]),
        helper.make_tensor_value_info("seqlens", i32, [1]),
        helper.make_tensor_value_info("total", i32, [1]),
    ]
    inits = []
    names = ["q", "k", "v", "pk", "pv", "seqlens", "total", "", "", "", "", ""]
    if sink is not None:
        inits.append(helper.make_tensor("sink", f32, [N], sink.tolist()))
        names[11] = "sink"
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        ["out", "present_k", "present_v"],
        domain="com.microsoft",
        **_GQA_ATTRS,
        local_window_size=window,
        softcap=softcap,
    )
    out = helper.make_tensor_value_info("out", f32, [1, m, N * D])
    graph = helper.make_graph([node], "gqa", inputs, [out], initializer=inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
        ir_version=10,  # what every onnxruntime this runs against reads, whatever IR the onnx package writes
    )
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {
        "q": q.reshape(1, m, N * D).numpy(),
        "k": k[:, past:].transpose(0, 1).reshape(1, m, HKV * D).numpy(),
        "v": v[:, past:].transpose(0, 1).reshape(1, m, HKV * D).numpy(),
        "pk": k[None, :, :past].contiguous().numpy(),
        "pv": v[None, :, :past].contiguous().numpy(),
        "seqlens": np.array([total - 1], dtype=np.int32),
        "total": np.array([total], dtype=np.int32),
    }
    return torch.from_numpy(sess.run(["out"], feeds)[0]).view(m, N, D)


_GQA_ATTRS = {"num_heads": N, "kv_num_heads": HKV, "scale": 0.3}


def _native_gqa(q, k, v, past: int, window: int, softcap: float, sink, how: str) -> torch.Tensor:
    """The native backend's GroupQueryAttention op (its lowering's builder, bound to KV layer 0) over the same
    inputs, the past already in the runtime's KV: `how` = "eager" (a contiguous cache), "static" (the
    captured path: `cache_attention`) or "paged" (a ragged step over the pool)."""
    from onnxgen.backends.native import ops
    from onnxgen.backends.native.ops.base import Node, RunCtx
    from onnxgen.kv.buffers import KVBuffers

    m, total = q.shape[0], past + q.shape[0]
    attrs = {**_GQA_ATTRS, "local_window_size": window, "softcap": softcap}
    node = Node("GroupQueryAttention", "com.microsoft", "gqa", [], ["out", "", ""], attrs, layer=0)
    fn = ops.builder(node)(node)
    pos = torch.arange(past, total)
    new_k, new_v = k[None, :, past:], v[None, :, past:]  # [1, Hkv, m, D]
    if how == "paged":
        st = PageStorage(1, -(-total // P) + 1, P, HKV, D, torch.float32, "cpu")
        step = BatchStep((SeqChunk([0] * m, past, list(range(1, -(-total // P) + 1))[::-1]),))
        if past:
            old = paged.build_step(
                BatchStep((SeqChunk([0] * past, 0, step.seqs[0].pages),)), st, P, pos.device
            )
            st.write(0, old.slots, k[:, :past].transpose(0, 1), v[:, :past].transpose(0, 1))
        ps = paged.build_step(step, st, P, pos.device)
        ctx = RunCtx(None, -1, m, ps.positions, paged=ps)
    else:
        kv = KVBuffers(1, HKV, D, torch.float32, "cpu", floor=16)
        kv.reserve(total)
        kv.write(0, 0, k[None, :, :past], v[None, :, :past])
        ctx = (
            RunCtx(kv, past, m, pos) if how == "eager" else RunCtx(kv, -1, m, pos, past=torch.tensor([past]))
        )
    flat = (q.reshape(1, m, N * D), new_k[0].transpose(0, 1).reshape(1, m, HKV * D))
    value = new_v[0].transpose(0, 1).reshape(1, m, HKV * D)
    out = fn(ctx, *flat, value, None, None, None, None, None, None, None, None, sink)[0]
    return out.view(m, N, D)


@pytest.mark.parametrize(
    ("past", "m", "window", "softcap", "sinks"),
    [
        (0, 40, 8, 0.0, False),
        (39, 1, 8, 0.0, True),
        (30, 6, 8, 5.0, False),
        (20, 1, -1, 0.0, True),
        (9, 12, 8, 0.0, True),
        (70, 3, 20, 5.0, True),
    ],
)
def test_the_lowered_op_means_what_onnxruntime_means(
    past: int, m: int, window: int, softcap: float, sinks: bool
) -> None:
    """onnxruntime's GroupQueryAttention against the dense float64 attention every path here is held to (the
    window: a query at p sees p - window + 1 .. p; soft-capping; head sinks), and the native backend's
    lowered op in each of its three contexts against onnxruntime."""
    g = torch.Generator().manual_seed(past + m)
    total = past + m
    k, v = torch.randn(HKV, total, D, generator=g), torch.randn(HKV, total, D, generator=g)
    q = torch.randn(m, N, D, generator=g)
    sink = _sink("cpu", past) if sinks else None
    got = _ort_gqa(q, k, v, past, window, softcap, sink)
    kk, vv = k.double().repeat_interleave(N // HKV, 0), v.double().repeat_interleave(N // HKV, 0)
    sc = q.transpose(0, 1).double() @ kk.transpose(-1, -2) * 0.3  # [N, m, total]
    if softcap > 0:
        sc = softcap * torch.tanh(sc / softcap)
    qpos = torch.arange(past, total).unsqueeze(1)
    kpos = torch.arange(total).unsqueeze(0)
    keep = (kpos <= qpos) & ((kpos > qpos - window) if window > 0 else True)
    want = (_softmax(sc.masked_fill(~keep, float("-inf")), sink) @ vv).transpose(0, 1)
    assert _rel(got, want) < 1e-5
    for how in ("eager", "static", "paged"):
        assert float((_native_gqa(q, k, v, past, window, softcap, sink, how) - got).abs().max()) < 1e-5, how
