"""Attention over the paged KV pool for ragged batches: the torch path against dense attention computed
independently (contiguous keys, PyTorch's scaled_dot_product_attention in float64), and the Triton
kernel against the torch path on the GPU."""

from __future__ import annotations

import math
import os
import random

import pytest

torch = pytest.importorskip("torch")

from onnxgen.backends.batch import BatchStep, SeqChunk  # noqa: E402
from onnxgen.backends.native import paged  # noqa: E402
from onnxgen.kv.storage import PageStorage  # noqa: E402

from .dense_attention import dense_attention as _dense  # noqa: E402

P, HKV, N, D = 16, 2, 8, 32


def _batch(
    device: str,
    dtype: torch.dtype,
    shapes: list[tuple[int, int]],
    seed: int = 0,
    heads: int = N,
    kv_heads: int = HKV,
    consecutive: bool = False,
):
    """Random pool contents, a shuffled page assignment (`consecutive`: each sequence's pages a run of
    consecutive ones, which the torch path reads in place) and a step of (start, new tokens) chunks."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    num_pages = 160
    st = PageStorage(2, num_pages, P, kv_heads, D, dtype, device)
    st.data.copy_(torch.randn(st.data.shape, generator=g).to(dtype))
    free = list(range(num_pages))
    rnd.shuffle(free)
    seqs = []
    for start, m in shapes:
        end = start + m
        pages = [free.pop() for _ in range(-(-end // P))]
        seqs.append(SeqChunk(tokens=[0] * m, start=start, pages=pages))
    step = BatchStep(tuple(seqs))
    q = torch.randn(step.num_tokens, heads, D, generator=g).to(device=device, dtype=dtype)
    return st, step, q


SHAPES = [(0, 5), (37, 1), (100, 1), (16, 20), (3, 1), (300, 1), (0, 1)]


@pytest.mark.parametrize("window", [-1, 8])
@pytest.mark.parametrize("consecutive", [False, True])
def test_torch_path_equals_dense_attention(window: int, consecutive: bool) -> None:
    st, step, q = _batch("cpu", torch.float32, SHAPES, consecutive=consecutive)
    ps = paged.build_step(step, st, P, torch.device("cpu"))
    got = paged.attention_ref(ps, 1, q, 0.2, window=window)
    want = _dense(st, step, q, 1, 0.2, window)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize(("window", "softcap", "sinks"), [(-1, 4.0, False), (8, 0.0, True), (-1, 2.0, True)])
def test_torch_path_with_softcap_and_sinks_equals_dense_attention(
    window: int, softcap: float, sinks: bool, consecutive: bool
) -> None:
    """Soft-capped scores and attention sinks (per query head), over pages shuffled or consecutive."""
    st, step, q = _batch("cpu", torch.float32, SHAPES, consecutive=consecutive)
    sink = torch.randn(N, generator=torch.Generator().manual_seed(1)) if sinks else None
    ps = paged.build_step(step, st, P, torch.device("cpu"))
    got = paged.attention_ref(ps, 1, q, 0.2, softcap, window, sink)
    want = _dense(st, step, q, 1, 0.2, window, softcap, sink)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6


@pytest.mark.parametrize("window", [-1, 8])
def test_a_decode_step_in_one_batched_product_equals_dense_attention(window: int) -> None:
    """One query per sequence takes the batched path (every sequence's pages at once, padded to the longest);
    slots no sequence wrote hold NaN, as an uninitialised pool may, and must not leak into any row."""
    st, step, q = _batch("cpu", torch.float32, [(37, 1), (100, 1), (3, 1), (300, 1), (0, 1), (15, 1)])
    written = torch.zeros(st.data.shape[2:4], dtype=torch.bool)  # [pages, P]
    for s in step.seqs:
        for p in range(s.end):
            written[s.pages[p // P], p % P] = True
    st.data.masked_fill_(~written[None, None, :, :, None, None], float("nan"))
    ps = paged.build_step(step, st, P, torch.device("cpu"))
    got = paged.attention_ref(ps, 1, q, 0.2, window=window)
    want = _dense(st, step, q, 1, 0.2, window)
    assert not got.isnan().any()
    assert float((got.double() - want).norm() / want.norm()) < 1e-6


def test_write_kv_lands_at_each_tokens_slot() -> None:
    st, step, _ = _batch("cpu", torch.float32, [(14, 4), (0, 2)])
    ps = paged.build_step(step, st, P, torch.device("cpu"))
    k = torch.randn(6, HKV, D)
    v = torch.randn(6, HKV, D)
    paged.write_kv(ps, 0, k, v)
    a, b = step.seqs
    assert torch.equal(st.keys(0)[a.pages[0], 15], k[1]) and torch.equal(st.keys(0)[a.pages[1], 0], k[2])
    assert torch.equal(st.values(0)[b.pages[0], 1], v[5])
    assert ps.positions.tolist() == [14, 15, 16, 17, 0, 1] and ps.last.tolist() == [3, 5]


def _triton_equals_torch(device: str, dt: torch.dtype, nsplit: int | None) -> None:
    """Decodes, chunks over cached pages and a 64-token prefill in one ragged step (the decode-size tile, 64
    rows), prefill chunks only (the large tile), short chunks only (16- and 32-row tiles, as speculative
    verify steps have), and decodes only (one token a sequence: the kernels read no work items, `ONE`):
    unmasked key blocks, masked tails, windows, soft-capping, split and unsplit."""
    for shapes in (
        [*SHAPES, (700, 1), (64, 64), (1000, 1), (40, 60)],
        [(64, 64), (500, 17), (40, 60), (0, 130)],
        [(37, 5), (100, 8), (300, 3)],
        [(600, 3), (33, 2)],
        [(600, 1), (33, 1), (5, 1)],
    ):
        st, step, q = _batch(device, dt, shapes, seed=3)
        ps = paged.build_step(step, st, P, torch.device(device))
        for window, softcap in ((-1, 0.0), (8, 0.0), (-1, 4.0)):
            got = paged.attention_triton(ps, 1, q, 0.2, softcap, window, nsplit=nsplit).double()
            want = paged.attention_ref(ps, 1, q, 0.2, softcap, window).double()
            tol = 1e-5 if dt == torch.float32 else 2e-2
            assert float((got - want).norm() / want.norm()) < tol, (shapes[0], window, softcap)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("nsplit", [None, 1, 3])
def test_cuda_triton_kernel_equals_the_torch_path(dtype: str, nsplit: int | None) -> None:
    _triton_equals_torch("cuda", getattr(torch, dtype), nsplit)


@pytest.mark.parametrize("nsplit", [None, 1, 3])
def test_interpreted_triton_kernel_equals_the_torch_path(nsplit: int | None) -> None:
    """The same on the CPU under `TRITON_INTERPRET=1` (float32: the interpreter multiplies bf16 operands of
    `tl.dot` as integers); skipped where Triton is not installed or not interpreted."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU runs Triton only under TRITON_INTERPRET=1")
    pytest.importorskip("triton")
    _triton_equals_torch("cpu", torch.float32, nsplit)


def _per_token_rows_are_decode_bits(device: str, dt: torch.dtype) -> None:
    """A verify step's tokens attended per token (`PagedStep.per_token`) give, bit for bit, what one-token
    steps at the same positions give (splits planned for the same context, each item splitting its own
    keys): across several key splits, a window and soft-capping, with other sequences in the step, and with
    more query heads per KV head than a tile has rows (72: a token's rows in two work items)."""
    context = 4096
    for start, m, heads, kv_heads in ((5, 4, N, HKV), (250, 7, N, HKV), (1100, 16, N, HKV), (300, 3, 72, 1)):
        st, step, q = _batch(
            device, dt, [(start, m), (77, 1), (31, 3)], seed=start, heads=heads, kv_heads=kv_heads
        )
        ver = paged.build_step(step, st, P, torch.device(device))
        ver.plan_len, ver.per_token = context, True
        s = step.seqs[0]
        for window, softcap in ((-1, 0.0), (8, 0.0), (-1, 4.0)):
            got = paged.attention_triton(ver, 1, q, 0.2, softcap, window)
            for i in range(m):
                one = BatchStep((SeqChunk([0], start + i, s.pages),))
                dec = paged.build_step(one, st, P, torch.device(device))
                dec.plan_len = context
                want = paged.attention_triton(dec, 1, q[i : i + 1], 0.2, softcap, window)
                assert torch.equal(got[i], want[0]), (start, m, i, window, softcap)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_per_token_rows_are_the_bits_of_decode_steps(dtype: str) -> None:
    _per_token_rows_are_decode_bits("cuda", getattr(torch, dtype))


def test_interpreted_per_token_rows_are_the_bits_of_decode_steps() -> None:
    """The same under `TRITON_INTERPRET=1` (skipped where Triton is not installed or not interpreted)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU runs Triton only under TRITON_INTERPRET=1")
    pytest.importorskip("triton")
    _per_token_rows_are_decode_bits("cpu", torch.float32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rotary_write_gives_q_in_the_token_major_layout_paged_attention_reads(device: str) -> None:
    """`rope_qkv_write(..., token_major=True)` returns the same rotated q as the head-major layout, as a view
    whose per-token rows are contiguous (what `attention` reads without a copy), and writes the same k/v."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU host)")
    from onnxgen.backends.native.kernels import attention

    st, step, _ = _batch(device, torch.float32, [(37, 1), (16, 20), (0, 3)])
    twin = PageStorage(2, st.data.shape[2], P, HKV, D, torch.float32, device)
    twin.data.copy_(st.data)
    ps = paged.build_step(step, st, P, torch.device(device))
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(1, step.num_tokens, (N + 2 * HKV) * D, generator=g).to(device)
    ang = torch.arange(100.0)[:, None] * (0.5 ** torch.arange(D // 2))[None, :]
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    args = (cos, sin, ps.positions)
    head = attention.rope_qkv_write(qkv, *args, paged.PoolRows(twin), 1, N, HKV, D, False, slots=ps.slots)
    tok = attention.rope_qkv_write(
        qkv, *args, paged.PoolRows(st), 1, N, HKV, D, False, slots=ps.slots, token_major=True
    )
    assert head.is_contiguous() and tok[0].transpose(0, 1).is_contiguous()
    assert torch.equal(head, tok) and torch.equal(st.data, twin.data)
    page, row = divmod(int(ps.slots[0]), P)  # v is written unrotated at each token's slot
    assert torch.equal(st.values(1)[page, row], qkv[0, 0, (N + HKV) * D :].view(HKV, D))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_write_on_the_cpu_equals_q_and_k_rotated_apart(interleaved: bool) -> None:
    """The torch path rotates q's and k's heads in one call: the bits of `rotary.rope` applied to q and to k
    on their own, k and v at each token's slot, q token-major."""
    from onnxgen.backends.native.kernels import attention
    from onnxgen.backends.native.rotary import rope

    st, step, _ = _batch("cpu", torch.float32, [(37, 1), (16, 20), (0, 3)])
    ps = paged.build_step(step, st, P, torch.device("cpu"))
    t = step.num_tokens
    qkv = torch.randn(1, t, (N + 2 * HKV) * D, generator=torch.Generator().manual_seed(2))
    ang = torch.arange(100.0)[:, None] * (0.5 ** torch.arange(D // 2))[None, :]
    cos, sin = ang.cos(), ang.sin()
    got = attention.rope_qkv_write(
        qkv,
        cos,
        sin,
        ps.positions,
        paged.PoolRows(st),
        1,
        N,
        HKV,
        D,
        interleaved,
        slots=ps.slots,
        token_major=True,
    )
    c, s_ = cos[ps.positions].unsqueeze(1), sin[ps.positions].unsqueeze(1)
    q = rope(qkv[0, :, : N * D].reshape(t, N, D), c, s_, interleaved)
    k = rope(qkv[0, :, N * D : (N + HKV) * D].reshape(t, HKV, D), c, s_, interleaved)
    v = qkv[0, :, (N + HKV) * D :].reshape(t, HKV, D)
    assert torch.equal(got[0].transpose(0, 1), q)
    for i, slot in enumerate(ps.slots.tolist()):
        page, row = divmod(slot, P)
        assert torch.equal(st.keys(1)[page, row], k[i]) and torch.equal(st.values(1)[page, row], v[i])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_copy_page_prefix_copies_the_prefix_in_every_layer_and_nothing_else(device: str) -> None:
    """`kernels.advance.copy_page_prefix` (copy on write of a shared partial page; one launch on a Triton device)
    against slice assignment on a copy of the pool."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU host)")
    from onnxgen.backends.native.kernels import advance

    st, _, _ = _batch(device, torch.float32, [(0, 1)])
    want = st.data.clone()
    want[:, :, 9, :11] = want[:, :, 4, :11]
    advance.copy_page_prefix(st.data, 4, 9, 11)
    assert torch.equal(st.data, want)


def test_per_token_work_items_cut_each_token_as_a_decode_step() -> None:
    """Work items of a verify step (`per_token`) are each token's rows on their own, cut into tiles exactly
    as a one-token step's rows are; ordinary items take up to a tile of rows across tokens."""
    st, step, _ = _batch("cpu", torch.float32, [(10, 3), (40, 1)])
    ps = paged.build_step(step, st, P, torch.device("cpu"))
    assert ps.work(4, 16).tolist() == [[0, 0, 12], [1, 0, 4]]
    ps = paged.build_step(step, st, P, torch.device("cpu"))
    ps.per_token = True
    assert ps.work(4, 16).tolist() == [[0, 0, 4], [0, 4, 8], [0, 8, 12], [1, 0, 4]]
    assert ps.work(72, 64).tolist() == [
        [0, 0, 64],
        [0, 64, 72],
        [0, 72, 136],
        [0, 136, 144],
        [0, 144, 208],
        [0, 208, 216],
        [1, 0, 64],
        [1, 64, 72],
    ]
    one = paged.build_step(BatchStep((SeqChunk([0], 11, step.seqs[0].pages),)), st, P, torch.device("cpu"))
    assert one.work(72, 64).tolist() == [[0, 0, 64], [0, 64, 72]]  # token 1's cut, as a decode step's


@pytest.mark.parametrize(
    ("items", "group", "d", "plan"),
    [
        (2, 7, 64, 32768),
        (8, 4, 64, 131072),
        (8, 4, 128, 16384),
        (512, 4, 64, 8192),
        (2, 4, 32, 4096),
        (16, 8, 64, 1024),
    ],
)
def test_short_keys_is_the_longest_kv_length_whose_key_splits_stay_short(
    items: int, group: int, d: int, plan: int
) -> None:
    """`short_keys` (which decode graph the runner replays) agrees with the launch's own choice (`is_short`
    over the planned splits): up to it every split a sequence cuts holds at most `short_blocks()` key blocks,
    one key more and the longest sequence's splits hold more."""
    cpu = torch.device("cpu")
    bm, bn, _, stages = paged.tile_for(group, group, group, d)
    nsplit = paged.plan_splits(items, plan, bm, bn, cpu)
    keys = paged.short_keys(items, group, d, plan, cpu)
    assert stages == 2 and 0 < keys <= plan
    assert paged.is_short(keys, nsplit, bn)

    def blocks(n: int) -> int:  # key blocks a split of a sequence of n keys holds, as the kernel cuts it
        return math.ceil(math.ceil(n / nsplit) / bn)

    assert blocks(keys) <= paged.short_blocks()
    if keys < plan:
        assert not paged.is_short(keys + 1, nsplit, bn)
        assert blocks(keys + 1) > paged.short_blocks()


def test_decode_steps_with_short_splits_launch_the_attention_unpipelined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`attention_triton`'s pipeline depth (`paged.short_blocks`): one stage for decode-size items in half
    precision while every split of the longest sequence the launch may see (`seq_lens`: a captured graph's
    bound) holds at most `short_blocks()` key blocks; the tile's own otherwise (longer sequences, prefill chunks,
    float32). Only the launch's arguments are recorded (no kernel runs: needs Triton importable, not a GPU)."""
    pytest.importorskip("triton")
    from onnxgen.backends.native.kernels.triton import paged as tp

    seen: list[int] = []

    class Recorded:
        def __getitem__(self, grid: object) -> object:
            return lambda *a, **k: seen.append(k.get("num_stages", 0))

    monkeypatch.setattr(tp, "paged_attn_kernel", Recorded())
    monkeypatch.setattr(tp, "paged_combine_kernel", Recorded())  # (after the attention: seen[0] stays its)

    def stages(dtype: torch.dtype, shapes: list[tuple[int, int]], bound: int | None = None) -> int:
        st, step, q = _batch("cpu", dtype, shapes)
        ps = paged.build_step(step, st, P, torch.device("cpu"))
        ps.plan_len = 2048  # planned for the whole context, as decode and verify steps are
        if bound is not None:
            ps.seq_lens = [bound] * len(ps.seq_lens)  # a captured graph's host shapes
        seen.clear()
        paged.attention_triton(ps, 1, q, 0.2)
        return seen[0]

    cpu = torch.device("cpu")
    _, bn, _, two = paged.tile_for(N // HKV, N // HKV, N // HKV, D)
    nsplit = paged.plan_splits(HKV, 2048, 16, bn, cpu)
    keys = paged.short_keys(HKV, N // HKV, D, 2048, cpu)
    assert two == 2 and keys == paged.short_blocks() * bn * nsplit < 2048
    assert stages(torch.bfloat16, [(600, 1)]) == 1  # a decode of 601 keys (up to `keys`: 1,024)
    assert stages(torch.bfloat16, [(600, 1)], bound=keys) == 1  # a graph for up to `keys`
    assert stages(torch.bfloat16, [(600, 1)], bound=keys + 1) == 2  # a graph for longer sequences
    assert stages(torch.bfloat16, [(keys, 1)]) == 2  # a decode past the bound
    assert stages(torch.float32, [(600, 1)]) == 2  # float32 keeps its tile
    assert stages(torch.bfloat16, [(0, 40)]) == paged.tile_for(4 * 40, 4 * 40, 4, D)[3]  # a prefill chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rotary_write_with_qk_norms_normalises_each_head_then_rotates(
    device: str, dtype: torch.dtype
) -> None:
    """`rope_qkv_write(..., qk_norm=...)` (Gemma 3's q/k norms folded into the rotary launch): each q and k head
    RMS-normalised with its own weight and rounded, then rotated over its first 3/4 (partial rotary); v
    written as it is. Against the same computed independently in float64 (q within an ulp of the dtype)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU host)")
    from onnxgen.backends.native.kernels import attention

    st, step, _ = _batch(device, dtype, [(37, 1), (16, 20), (0, 3)])
    ps = paged.build_step(step, st, P, torch.device(device))
    g = torch.Generator().manual_seed(2)
    t = step.num_tokens
    qkv = (3 * torch.randn(1, t, (N + 2 * HKV) * D, generator=g)).to(device=device, dtype=dtype)
    qw, kw = (
        (1 + torch.randn(D, generator=g)).to(device, dtype),
        (1 + torch.randn(D, generator=g)).to(device, dtype),
    )
    half = 3 * D // 8  # rotary over 3/4 of each head
    ang = torch.arange(100.0)[:, None] * (0.5 ** torch.arange(half))[None, :]
    cos, sin = ang.cos().to(device), ang.sin().to(device)
    norm = attention.QKNorm(qw, kw, 1e-6, 1e-5)
    q = attention.rope_qkv_write(
        qkv, cos, sin, ps.positions, paged.PoolRows(st), 1, N, HKV, D, False, slots=ps.slots, qk_norm=norm
    )

    def want(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:  # [t, heads, D] float64
        x = x.double()
        y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()).to(dtype).double()
        c = cos.double()[ps.positions.cpu()].to(y.device)[:, None, :]
        s_ = sin.double()[ps.positions.cpu()].to(y.device)[:, None, :]
        a, b = y[..., :half], y[..., half : 2 * half]
        return torch.cat([a * c - b * s_, b * c + a * s_, y[..., 2 * half :]], -1)

    rows = qkv[0]
    wq = want(rows[:, : N * D].view(t, N, D), qw, 1e-6)
    wk = want(rows[:, N * D : (N + HKV) * D].view(t, HKV, D), kw, 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got_q = q[0].transpose(0, 1).double()  # [t, N, D]
    assert (got_q - wq).abs().max() <= tol * wq.abs().max()
    slots = ps.slots.cpu().tolist()
    got_k = torch.stack([st.keys(1)[s // P, s % P] for s in slots]).double()
    got_v = torch.stack([st.values(1)[s // P, s % P] for s in slots])
    assert (got_k - wk).abs().max() <= tol * wk.abs().max()
    assert torch.equal(got_v, rows[:, (N + HKV) * D :].view(t, HKV, D))


def test_interleaved_rotation_on_the_cpu_has_the_real_forms_bits() -> None:
    """float32 interleaved pairs on the CPU rotate as complex numbers: each output the same two roundings as
    `x1 * c - x2 * s` / `x2 * c + x1 * s` (what the other dtypes and devices compute)."""
    from onnxgen.backends.native.rotary import rope

    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 5, N + HKV, D, generator=g)
    ang = torch.randn(5, 1, D // 2, generator=g)
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    want = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).reshape(x.shape)
    got = rope(x, c, s, True)
    assert got.shape == x.shape and got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize(("pos0", "s"), [(0, 7), (40, 1), (40, 6)])
def test_contiguous_cache_attention_on_the_cpu_groups_query_heads_without_copying_keys(
    pos0: int, s: int
) -> None:
    """`attend` over a batch-1 KV buffer (the per-request decoder's) with grouped query heads: the float64
    attention of each query head over its KV head's keys, causal after `pos0` cached positions."""
    from onnxgen.backends.native.ops import RunCtx
    from onnxgen.backends.native.ops.attention import attend
    from onnxgen.kv.buffers import KVBuffers

    g = torch.Generator().manual_seed(pos0 + s)
    kv = KVBuffers(1, HKV, D, torch.float32, torch.device("cpu"))
    kv.reserve(pos0 + s)
    keys = torch.randn(1, HKV, pos0 + s, D, generator=g)
    values = torch.randn(1, HKV, pos0 + s, D, generator=g)
    kv.write(0, 0, keys[:, :, :pos0], values[:, :, :pos0])
    q = torch.randn(1, N, s, D, generator=g)
    ctx = RunCtx(kv, pos0, s, torch.arange(pos0, pos0 + s), static=False)
    got = attend(ctx, 0, q, keys[:, :, pos0:], values[:, :, pos0:], scale=0.2)
    k64 = keys.double().repeat_interleave(N // HKV, dim=1)
    v64 = values.double().repeat_interleave(N // HKV, dim=1)
    scores = q.double() @ k64.transpose(-1, -2) * 0.2
    keep = torch.arange(pos0 + s)[None, :] <= torch.arange(pos0, pos0 + s)[:, None]
    want = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v64
    assert got.shape == (1, N, s, D)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6
