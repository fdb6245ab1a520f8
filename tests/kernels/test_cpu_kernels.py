"""onnxgen's C kernels for CPU decode work (`kernels/cpu`) against independent torch computations: products
with their norm and epilogues, the rotary write, attention over paged and contiguous KV (float64 dense
attention), each row's independence from the others, and when the library is (not) used."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")

from onnxgen.backends.batch import BatchStep, SeqChunk  # noqa: E402
from onnxgen.backends.native import paged  # noqa: E402
from onnxgen.backends.native.kernels import cpu_gemm  # noqa: E402
from onnxgen.backends.native.kernels.cpu import build  # noqa: E402
from onnxgen.backends.native.kernels.cpu import ops as ck  # noqa: E402
from onnxgen.kv.storage import PageStorage  # noqa: E402

from .dense_attention import dense_attention  # noqa: E402

# Where a C compiler exists the library must build (a failure is a bug, not a skip).
pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in build.COMPILERS), reason="no C compiler: the CPU kernels are off"
)


@pytest.fixture(autouse=True)
def _library() -> None:
    assert build.library() is not None, build.unavailable()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _weight(k: int, n: int, parts: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[K, N]` weight and the layout the lowering gives it (`parts` > 1: the split, else itself)."""
    w = torch.randn(k, n, generator=torch.Generator().manual_seed(seed)) / k**0.5
    if parts == 1:
        return w, w
    s = cpu_gemm.split(w, parts)
    assert s is not None
    return w, s


@pytest.mark.parametrize(("k", "n", "parts"), [(64, 96, 1), (37, 40, 2), (130, 4104, 3), (576, 960, 2)])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_products_equal_torch_on_every_layout(k: int, n: int, parts: int, rows: int) -> None:
    """Odd K (a tail after the four-at-a-time sum), N with a tail of under 8 columns, blocks wider than a
    work item's columns, the split layout of 2 and 3 blocks."""
    w, laid = _weight(k, n, parts)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    got = ck.linear(x, laid)
    assert got is not None and got[1] is None
    assert got[0].shape == (rows, n) and _rel(got[0], x.double() @ w.double()) < 1e-6


@pytest.mark.parametrize(("k", "n"), [(576, 3072), (576, 960), (150, 200)])
def test_a_rows_values_do_not_depend_on_the_other_rows(k: int, n: int) -> None:
    """What a verify step relies on: each of its rows has the bits of the same row computed alone, in calls of
    every row count. Wide blocks (streamed), narrow ones (tiled from three rows on), and a narrow one with a
    column tail and a K that leaves rows after the tiles."""
    _, laid = _weight(k, n, 2)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(2))
    nw = torch.rand(k, generator=torch.Generator().manual_seed(3)) + 0.5
    alone = [ck.linear(x[i : i + 1], laid, norm=(None, nw, 1e-5), silu_halves=True) for i in range(16)]
    for rows in (2, 3, 4, 5, 9, 16):
        together = ck.linear(x[:rows], laid, norm=(None, nw, 1e-5), silu_halves=True)
        assert together is not None
        for i in range(rows):
            one = alone[i]
            assert one is not None and torch.equal(one[0][0], together[0][i]), (rows, i)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("silu", [False, True])
def test_norm_before_and_silu_after_equal_the_ops_they_replace(skip: bool, silu: bool) -> None:
    from onnxgen.backends.native.kernels.reference import rms_norm_ref

    g = torch.Generator().manual_seed(4)
    w, laid = _weight(96, 256, 2)
    x, s = torch.randn(3, 96, generator=g), torch.randn(3, 96, generator=g)
    nw = torch.rand(96, generator=g) + 0.5
    got, total = ck.linear(x, laid, norm=(s if skip else None, nw, 1e-6), silu_halves=silu)
    h, want_total = rms_norm_ref(x, s if skip else None, nw, 1e-6)
    y = h.double() @ w.double()
    want = torch.nn.functional.silu(y[:, :128]) * y[:, 128:] if silu else y
    assert _rel(got, want) < 1e-6
    if skip:
        assert torch.equal(total, want_total)  # the residual sum is exact (one float32 add)
    else:
        assert total is None


def test_bias_and_residual_are_added_to_the_product() -> None:
    g = torch.Generator().manual_seed(5)
    w, laid = _weight(64, 48, 2)
    x, bias, res = (
        torch.randn(2, 64, generator=g),
        torch.randn(48, generator=g),
        torch.randn(2, 48, generator=g),
    )
    got = ck.linear(x, laid, bias=bias, residual=res)[0]
    assert _rel(got, x.double() @ w.double() + bias.double() + res.double()) < 1e-6


def test_products_the_kernels_do_not_take_return_none() -> None:
    """More rows than `ROWS`, other dtypes, a non-contiguous input, silu with a residual: the caller's torch
    path runs instead."""
    _, laid = _weight(64, 64, 2)
    assert ck.linear(torch.randn(ck.ROWS + 1, 64), laid) is None
    assert ck.linear(torch.randn(2, 64, dtype=torch.float64), laid) is None
    assert ck.linear(torch.randn(64, 2).t(), laid) is None
    assert ck.linear(torch.randn(1, 64), laid, residual=torch.randn(1, 64), silu_halves=True) is None
    assert ck.linear(torch.randn(1, 64).bfloat16(), laid.bfloat16()) is None


P, HKV, D = 16, 2, 64


def _pool(shapes: list[tuple[int, int]], seed: int, heads: int, kv_heads: int = HKV, d: int = D):
    g = torch.Generator().manual_seed(seed)
    st = PageStorage(2, 192, P, kv_heads, d, torch.float32, "cpu")
    st.data.copy_(torch.randn(st.data.shape, generator=g))
    free = list(torch.randperm(192, generator=g).tolist())
    seqs = []
    for start, m in shapes:
        pages = [free.pop() for _ in range(-(-(start + m) // P))]
        seqs.append(SeqChunk(tokens=[0] * m, start=start, pages=pages))
    step = BatchStep(tuple(seqs))
    q = torch.randn(step.num_tokens, heads, d, generator=g)
    return st, step, q


@pytest.mark.parametrize(
    ("window", "softcap", "sinks", "heads", "kv_heads", "d"),
    [
        (-1, 0.0, False, 8, 2, 64),
        (8, 0.0, False, 8, 2, 64),
        (-1, 3.0, True, 4, 4, 128),
        (40, 2.0, True, 6, 1, 32),
    ],
)
def test_paged_attention_equals_dense_attention(
    window: int, softcap: float, sinks: bool, heads: int, kv_heads: int, d: int
) -> None:
    """Decodes and verify-size chunks (up to 16 tokens of a sequence) over shuffled pages, long enough for
    several key splits (over 256 keys), grouped and not."""
    shapes = [(37, 1), (300, 1), (0, 1), (600, 5), (15, 16), (1000, 1)]
    st, step, q = _pool(shapes, 6, heads, kv_heads, d)
    sink = torch.randn(heads, generator=torch.Generator().manual_seed(7)) if sinks else None
    ps = paged.build_step(step, st, P, torch.device("cpu"))
    got = paged.attention(ps, 1, q, 0.125, softcap, window, sink)
    assert ps._token_seq is not None  # the C kernel ran
    want = dense_attention(st, step, q, 1, 0.125, window, softcap, sink)
    assert _rel(got, want) < 1e-6


def test_each_verify_token_has_the_bits_of_a_decode_step_at_its_position() -> None:
    """A verify step's token t of a sequence equals a one-token step of that sequence at its position (the
    key splits depend on a query's own length only), so speculation keeps plain decoding's tokens."""
    st, step, q = _pool([(500, 6), (20, 3)], 8, 8)
    ps = paged.build_step(step, st, P, torch.device("cpu"))
    together = paged.attention(ps, 0, q, 0.125)
    t = 0
    for s in step.seqs:
        for i in range(len(s.tokens)):
            one = BatchStep((SeqChunk(tokens=[0], start=s.start + i, pages=s.pages),))
            alone = paged.attention(paged.build_step(one, st, P, torch.device("cpu")), 0, q[t : t + 1], 0.125)
            assert torch.equal(alone[0], together[t])
            t += 1


def test_contiguous_buffer_attention_equals_dense_attention() -> None:
    """The per-request decoder's buffers (`[1, Hkv, capacity, D]`): the last 3 of 700 positions."""
    g = torch.Generator().manual_seed(9)
    keys, values = torch.randn(1, HKV, 1024, D, generator=g), torch.randn(1, HKV, 1024, D, generator=g)
    q = torch.randn(3, 8, D, generator=g)
    got = ck.buffer_attention(q, keys, values, torch.arange(697, 700), 0.125, 0.0, -1, None)
    assert got is not None
    k = keys[0, :, :700].double().repeat_interleave(4, 0)
    v = values[0, :, :700].double().repeat_interleave(4, 0)
    sc = q.double().transpose(0, 1) @ k.transpose(1, 2) * 0.125  # [heads, 3, 700]
    keep = torch.arange(700)[None, :] <= torch.arange(697, 700)[:, None]
    want = (torch.softmax(sc.masked_fill(~keep, float("-inf")), -1) @ v).transpose(0, 1)
    assert _rel(got, want) < 1e-6


def test_attention_the_kernel_does_not_take_returns_none() -> None:
    """A float64 query, and a head size that is not a multiple of 8: the torch path runs instead."""
    st, step, q = _pool([(10, 1)], 10, 8)
    ps = paged.build_step(step, st, P, torch.device("cpu"))
    assert ck.paged_attention(q.double(), ps, 0, 0.1, 0, -1, None) is None
    st2, step2, odd = _pool([(10, 1)], 10, 8, d=60)
    ps2 = paged.build_step(step2, st2, P, torch.device("cpu"))
    assert ck.paged_attention(odd, ps2, 0, 0.1, 0, -1, None) is None


def test_the_rotary_write_keeps_the_torch_paths_bits_for_partial_rotation() -> None:
    """A rotary over the first half of each head (`half` < D / 2, Phi's partial rotary): the rest copied."""
    from onnxgen.backends.native.rotary import rope

    st, step, _ = _pool([(37, 1), (0, 4)], 11, 8)
    ps = paged.build_step(step, st, P, torch.device("cpu"))
    t = step.num_tokens
    qkv = torch.randn(1, t, (8 + 2 * HKV) * D, generator=torch.Generator().manual_seed(12))
    ang = torch.arange(100.0)[:, None] * (0.5 ** torch.arange(D // 4))[None, :]
    cos, sin = ang.cos(), ang.sin()
    rows = paged.PoolRows(st)
    q = ck.rope_qkv_write(
        qkv, cos, sin, ps.positions, rows.keys[1], rows.values[1], 8, HKV, D, False, ps.slots, False
    )
    assert q is not None and q.is_contiguous()
    c, s_ = cos[ps.positions].unsqueeze(1), sin[ps.positions].unsqueeze(1)
    want_q = rope(qkv[0, :, : 8 * D].reshape(t, 8, D), c, s_, False)
    want_k = rope(qkv[0, :, 8 * D : (8 + HKV) * D].reshape(t, HKV, D), c, s_, False)
    assert torch.equal(q[0].transpose(0, 1), want_q)
    for i, slot in enumerate(ps.slots.tolist()):
        page, row = divmod(slot, P)
        assert torch.equal(st.keys(1)[page, row], want_k[i])


def test_the_switch_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONNXGEN_CPU_KERNELS", "0")
    build.library.cache_clear()
    try:
        assert build.library() is None and "ONNXGEN_CPU_KERNELS=0" in (build.unavailable() or "")
        assert ck.linear(torch.randn(1, 8), torch.randn(8, 8)) is None
    finally:
        monkeypatch.delenv("ONNXGEN_CPU_KERNELS")
        build.library.cache_clear()


def test_without_a_compiler_the_kernels_are_off_and_say_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("ONNXGEN_HOME", str(tmp_path))
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    build.library.cache_clear()
    try:
        assert build.library() is None
        assert "no C compiler" in (build.unavailable() or "") and "gcc" in (build.unavailable() or "")
    finally:
        monkeypatch.undo()
        build.library.cache_clear()


def test_a_failed_compile_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A compiler that rejects the source: no library, the reason names the compiler, no file in the cache
    (a half-written library is never loaded by a later process)."""
    broken = tmp_path / "kernels.c"
    broken.write_text("this is not C\n")
    monkeypatch.setenv("ONNXGEN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(build, "SOURCE", broken)
    build.library.cache_clear()
    try:
        assert build.library() is None and "failed" in (build.unavailable() or "")
        assert not list((tmp_path / "home" / "kernels").glob("*.so")) and not list(
            (tmp_path / "home" / "kernels").glob("*.tmp")
        )
    finally:
        monkeypatch.undo()
        build.library.cache_clear()


def test_the_library_shares_torchs_openmp_runtime() -> None:
    """One OpenMP runtime mapped after loading: the kernels' threads are torch's pool, not a second one."""
    assert len(build._openmp_runtimes()) <= 1


def test_each_layer_runs_as_one_call_with_the_separate_kernels_bits(
    tiny_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny builder-style package lowered with its layers fused (`CpuLayer`, one C call per layer for up to
    16 tokens) and without: a 7-token prefill and a decode step give the same bits (the same C functions in
    the same order), a 20-token prefill (the five ops, torch's products) too; and the torch path (kernels off)
    agrees to float32 rounding with the same next token."""
    from onnxgen.backends.native import lowering
    from onnxgen.kv.buffers import KVBuffers
    from onnxgen.package.spec import load_spec

    from .test_cpu_gemm import _last_logits

    spec = load_spec(tiny_dir)
    cpu = torch.device("cpu")
    fused = lowering.lower(spec.decoder_path, spec, cpu)
    assert sum(st.node.op == "CpuLayer" for st in fused.steps) == spec.num_layers
    monkeypatch.setattr(lowering, "_fuse_cpu_layers", lambda nodes, consts: nodes)
    apart = lowering.lower(spec.decoder_path, spec, cpu)
    assert not any(st.node.op == "CpuLayer" for st in apart.steps)
    monkeypatch.setattr(ck, "library", lambda: None)  # every op's torch path
    monkeypatch.setattr(lowering.cpu_kernels, "library", lambda: None)
    torch_only = lowering.lower(spec.decoder_path, spec, cpu)
    monkeypatch.undo()

    def kv() -> KVBuffers:
        return KVBuffers(spec.num_layers, spec.num_kv_heads, spec.head_size, torch.float32, cpu)

    for prompt in ([5, 17, 3, 42, 9, 11, 60], list(range(3, 23))):
        kvs = [kv(), kv()]
        a, b = _last_logits(fused, spec, prompt, 0, kvs[0]), _last_logits(apart, spec, prompt, 0, kvs[1])
        assert torch.equal(a, b)
        nxt = [int(a.argmax())]
        a2 = _last_logits(fused, spec, nxt, len(prompt), kvs[0])
        assert torch.equal(a2, _last_logits(apart, spec, nxt, len(prompt), kvs[1]))
        for layer in range(spec.num_layers):  # the KV each wrote
            for buf in ("keys", "values"):
                mine, theirs = getattr(kvs[0], buf)[layer], getattr(kvs[1], buf)[layer]
                assert torch.equal(mine[:, :, : len(prompt) + 1], theirs[:, :, : len(prompt) + 1])
    with monkeypatch.context() as m:
        m.setattr(ck, "library", lambda: None)
        ref, off = kv(), kv()
        c = _last_logits(torch_only, spec, prompt, 0, ref)
        c2 = _last_logits(torch_only, spec, nxt, len(prompt), ref)
        # the fused program with the kernels switched off since: each layer runs its five ops
        assert torch.equal(_last_logits(fused, spec, prompt, 0, off), c)
        assert torch.equal(_last_logits(fused, spec, nxt, len(prompt), off), c2)
    assert _rel(a, c) < 1e-5 and _rel(a2, c2) < 1e-5 and int(a2.argmax()) == int(c2.argmax())
