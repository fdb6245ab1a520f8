"""The native backend (ONNX graph lowered to torch, KV owned by the runtime) against independent references.

References: a plain `onnxruntime.InferenceSession` on the same package fed past/present KV by hand
(teacher-forced: both sides get the reference's greedy tokens), and for int4 a float64 torch Llama
forward on the dequantized weights. Errors are norm-relative per step: ||out - ref|| / ||ref||.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

import onnxgen  # noqa: E402
from onnxgen.backends.native.decoder import NativeDecoder  # noqa: E402
from onnxgen.convert.synthetic import SyntheticConfig, reference_weights, write_package  # noqa: E402
from onnxgen.errors import InvalidRequest, UnsupportedOp  # noqa: E402
from onnxgen.package.spec import load_spec  # noqa: E402

TINY = SyntheticConfig(num_layers=2, context_length=2048)


class OrtRef:
    """onnxruntime on the package, past/present KV carried by hand (growing concat-style past)."""

    def __init__(self, spec: Any) -> None:
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        self.spec = spec
        self.sess = ort.InferenceSession(str(spec.decoder_path), so, providers=["CPUExecutionProvider"])
        self.out_names = [o.name for o in self.sess.get_outputs()]
        self.reset()

    def reset(self) -> None:
        s = self.spec
        dt = {"float32": np.float32, "float16": np.float16}[s.kv_dtype]
        empty = np.zeros((1, s.num_kv_heads, 0, s.head_size), dt)
        self.past = {n: empty for n in (*s.past_key_names, *s.past_value_names)}
        self.n = 0

    def forward(self, toks: list[int]) -> np.ndarray:
        s = self.spec
        total = self.n + len(toks)
        feeds = {s.input_ids_name: np.array([toks], np.int64), **self.past}
        if s.attention_mask_name:
            feeds[s.attention_mask_name] = np.ones((1, total), np.int64)
        if s.position_ids_name:
            feeds[s.position_ids_name] = np.arange(self.n, total, dtype=np.int64)[None]
        res = dict(zip(self.out_names, self.sess.run(None, feeds), strict=True))
        for pk, pv, ck, cv in zip(
            s.past_key_names, s.past_value_names, s.present_key_names, s.present_value_names, strict=True
        ):
            self.past[pk], self.past[pv] = res[ck], res[cv]
        self.n = total
        return res[s.logits_name][0, -1].astype(np.float64)


def rel(out: Any, ref: np.ndarray) -> float:
    o = out.detach().cpu().double().numpy() if hasattr(out, "detach") else np.asarray(out, np.float64)
    return float(np.linalg.norm(o - ref) / np.linalg.norm(ref))


def teacher_forced(dec: NativeDecoder, ref: OrtRef, prompt: list[int], steps: int) -> list[float]:
    """Prefill `prompt`, then `steps` single-token steps fed with the reference's greedy tokens."""
    r = ref.forward(prompt)
    out = dec.forward(prompt, 0)
    assert out.dtype == torch.float32 and out.dim() == 1 and out.shape[0] == dec.spec.vocab_size
    errs = [rel(out, r)]
    for _ in range(steps):
        t = int(np.argmax(r))
        r = ref.forward([t])
        errs.append(rel(dec.forward([t], dec.kv_len()), r))
    return errs


def _pkg(tmp_path_factory: pytest.TempPathFactory, name: str, cfg: SyntheticConfig, seed: int = 1) -> Path:
    return write_package(tmp_path_factory.mktemp(name) / "pkg", cfg, seed=seed)


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def kv_bytes_per_position(spec: Any, itemsize: int) -> int:
    """Bytes one cached position takes: K and V of every layer, `itemsize` bytes per element."""
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_size * itemsize


# --- parity -------------------------------------------------------------------------------------------


def test_smollm2_parity_vs_onnxruntime(smollm2_dir: Path) -> None:
    spec = load_spec(smollm2_dir)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(spec.tokenizer_path))
    prompt = tok.encode("The history of the printing press begins in the fifteenth century, when").ids
    errs = teacher_forced(NativeDecoder(spec), OrtRef(spec), prompt, 60)
    assert len(errs) == 61
    assert max(errs) <= 1e-5, errs


STYLES = {
    "gqa": TINY,
    "plain": dataclasses.replace(TINY, attention="plain"),
    "onnx23": dataclasses.replace(TINY, attention="onnx23"),
    "tied": dataclasses.replace(TINY, tie_embeddings=True),
    "window_softcap": dataclasses.replace(TINY, local_window_size=8, softcap=30.0),
    "odd_heads": dataclasses.replace(TINY, hidden_size=96, num_heads=6, num_kv_heads=2, head_size=48),
}


@pytest.mark.parametrize("style", sorted(STYLES))
def test_tiny_fixture_parity(style: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    spec = load_spec(_pkg(tmp_path_factory, style, STYLES[style]))
    errs = teacher_forced(NativeDecoder(spec, kv_floor=16), OrtRef(spec), _prompt(20, 384), 60)
    assert max(errs) <= 1e-5, errs


@pytest.mark.parametrize("style", ["gqa", "window_softcap"])
def test_static_decode_path_matches_onnxruntime(style: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The code path CUDA graphs capture (device-side length, writes by index, masked attention over the
    whole bucket, fused rope+KV write) run eagerly on the CPU."""
    spec = load_spec(_pkg(tmp_path_factory, "static_" + style, STYLES[style]))
    dec = NativeDecoder(spec, kv_floor=16, static_steps=True)
    assert dec.info["static"]
    errs = teacher_forced(dec, OrtRef(spec), _prompt(12, 384), 40)  # crosses the 32 -> 64 buckets
    assert max(errs) <= 1e-5, errs
    assert dec.info["eager_forwards"] == 0 and dec.info["static_forwards"] == {16: 1, 1: 40}


def test_load_time_warm_up_leaves_an_empty_consistent_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The warm-up CUDA decoders run at load (static steps of 1 and 64 tokens on a small cache, the second
    size for every prefill step) leaves the cache empty; what follows equals onnxruntime. Run here through
    the same static path on the CPU. It runs once per lowered program: a second decoder skips it."""
    spec = load_spec(_pkg(tmp_path_factory, "warm_up", STYLES["gqa"]))
    dec = NativeDecoder(spec, kv_floor=64, static_steps=True)
    assert dec.info["warm_up_s"] > 0.0 and dec.info["warmed_steps"] == (1, 64)
    assert dec.kv_len() == 0 and dec.info["kv_capacity"] > 64  # it ran on two capacities; the buffers stay
    assert dec.info["static_forwards"] == {} and dec.info["eager_forwards"] == 0  # not counted as forwards
    again = dec.fork()
    assert again.info["warm_up_s"] == 0.0 and again.info["warmed_steps"] == ()
    errs = teacher_forced(dec, OrtRef(spec), _prompt(40, 384, seed=8), 10)
    assert max(errs) <= 1e-5, errs


@pytest.mark.parametrize("style", ["gqa", "window_softcap"])
def test_static_prefill_chunks_match_onnxruntime(
    style: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Prefill chunks through the captured code path: padded to a power-of-two step, start position and
    last real token read from device memory. Chunks of 2..40 tokens after cached ones, a chunk that
    would not fit the capacity once padded (runs eagerly), and decode after them: logits equal
    onnxruntime's, and the padding's keys never leak into later steps."""
    spec = load_spec(_pkg(tmp_path_factory, "static_prefill_" + style, STYLES[style]))
    dec = NativeDecoder(spec, kv_floor=16, static_steps=True, graph_max_tokens=64)
    ref = OrtRef(spec)
    toks = _prompt(200, 384, seed=5)
    pos = 0
    for c in (20, 5, 17, 3, 40, 33, 1, 9):
        out = dec.forward(toks[pos : pos + c], pos)
        assert rel(out, ref.forward(toks[pos : pos + c])) <= 1e-5, (c, pos)
        pos += c
    # (chunk@start -> step; capacity): 20@0 -> 32 (32); 5@20 -> 16 would end at 36 > 32: eager;
    # 17@25 -> 32 (64); 3@42 -> 16; 40@45 -> 64 (128); 33@85 -> 64 ends at 149 > 128: eager; 1 -> 1;
    # 9@119 -> 16 ends at 135 > 128: eager
    assert dec.info["static_forwards"] == {32: 2, 16: 1, 64: 1, 1: 1} and dec.info["eager_forwards"] == 3
    for _ in range(30):
        t = int(out.argmax())
        out = dec.forward([t], pos)
        assert rel(out, ref.forward([t])) <= 1e-5
        pos += 1


def test_fp16_package_close_to_onnxruntime(tmp_path_factory: pytest.TempPathFactory) -> None:
    spec = load_spec(_pkg(tmp_path_factory, "fp16", dataclasses.replace(TINY, dtype="float16")))
    dec = NativeDecoder(spec)
    errs = teacher_forced(dec, OrtRef(spec), _prompt(20, 384), 20)
    assert max(errs) <= 1e-2, errs
    assert dec.info["kv_dtype"] == "float16"
    assert dec.kv_bytes() == dec.info["kv_capacity"] * kv_bytes_per_position(spec, 2)  # stored in fp16


# --- int4 ---------------------------------------------------------------------------------------------


def _llama_f64(cfg: SyntheticConfig, w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Float64 Llama forward (all positions) on HF-named weights: the int4 reference."""
    t = {k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in w.items()}
    x = t["model.embed_tokens.weight"][torch.tensor(ids)]
    n, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    s = len(ids)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)

    def norm(v: Any, g: Any) -> Any:
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * g

    def rot(v: Any) -> Any:  # [H, S, D]
        half = d // 2
        return v * cos + torch.cat((-v[..., half:], v[..., :half]), -1) * sin

    mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = norm(x, t[p + "input_layernorm.weight"])
        q = (h @ t[p + "self_attn.q_proj.weight"].T).reshape(s, n, d).transpose(0, 1)
        k = (h @ t[p + "self_attn.k_proj.weight"].T).reshape(s, hkv, d).transpose(0, 1)
        v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(s, hkv, d).transpose(0, 1)
        q, k = rot(q), rot(k)
        k, v = k.repeat_interleave(n // hkv, 0), v.repeat_interleave(n // hkv, 0)
        a = torch.softmax(q @ k.transpose(-1, -2) / d**0.5 + mask, -1) @ v
        x = x + a.transpose(0, 1).reshape(s, n * d) @ t[p + "self_attn.o_proj.weight"].T
        h = norm(x, t[p + "post_attention_layernorm.weight"])
        g = h @ t[p + "mlp.gate_proj.weight"].T
        x = (
            x
            + (torch.nn.functional.silu(g) * (h @ t[p + "mlp.up_proj.weight"].T))
            @ t[p + "mlp.down_proj.weight"].T
        )
    x = norm(x, t["model.norm.weight"])
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return (x @ head.T).numpy()


def test_int4_mode_defaults_to_dense_and_checks_its_value() -> None:
    """`int4=None` (what `onnxgen.load` passes when unset): dequantized at load (packed steps of
    more than `GEMV_ROWS` rows dequantize per product); an explicit mode is kept; anything else is a typed
    error naming the field."""
    from onnxgen.backends.native.device import int4_mode

    assert int4_mode(None) == "dense" and int4_mode("dense") == "dense" and int4_mode("packed") == "packed"
    with pytest.raises(onnxgen.errors.InvalidRequest, match="int4"):
        int4_mode("nf4")


@pytest.mark.parametrize("int4", ["dense", "packed"])
@pytest.mark.parametrize("zero_points", [False, True])
def test_int4_matmulnbits_vs_float64_and_onnxruntime(
    zero_points: bool, int4: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Both int4 modes: weights dequantized at load, or kept packed (`Int4Linear`, the gate and up products
    as one `Int4LinearSiluMul`: on the CPU each call dequantizes; under Triton decode rows run the packed
    GEMV, `tests/test_int4_kernel.py`)."""
    cfg = dataclasses.replace(
        TINY, quant="int4", accuracy_level=1, quant_zero_points=zero_points, quant_embeddings=zero_points
    )
    pkg = _pkg(tmp_path_factory, f"int4_{zero_points}", cfg, seed=3)
    spec = load_spec(pkg)
    dec, ref = NativeDecoder(spec, int4=int4), OrtRef(spec)
    ops = {st.node.op for st in dec.program.steps}
    assert ("Int4Linear" in ops) == (int4 == "packed") and ("MatMulNBits" not in ops)
    # packed: each layer's gate and up products merged into one (SiLU in the product), as dense's
    # LinearSiluMul, and the norms folded into the packed products that alone read them
    folded = [st.node for st in dec.program.steps if st.node.op == "RmsInt4Linear"]
    assert bool(folded) == (int4 == "packed") and "SiluMul" not in ops
    if int4 == "packed":
        assert sum(bool(nd.attr("silu", 0)) for nd in folded) == cfg.num_layers
        # every skip-norm's residual sum formed by the packed product that feeds it
        assert "SkipSimplifiedLayerNormalization" not in ops
        assert (
            sum(
                len(st.node.inputs) > 5 and bool(st.node.inputs[5])
                for st in dec.program.steps
                if st.node.op == "Int4Linear"
            )
            == 2 * cfg.num_layers
        )
    assert dec.info["int4"] == ("packed" if int4 == "packed" else "dequantized at load")
    if int4 == "packed":  # the weights stay packed: half a byte per weight, less than the dense bytes
        default = NativeDecoder(spec)  # the default: dequantized at load
        assert default.info["int4"] == "dequantized at load"
        assert dec.program.weight_bytes < 0.6 * default.program.weight_bytes
    prompt = _prompt(16, 384, seed=5)
    # greedy with the native decoder, then check every step against float64 and onnxruntime
    seq = list(prompt)
    out = dec.forward(prompt, 0)
    outs = [out]
    ort_out = [ref.forward(prompt)]
    for _ in range(40):
        t = int(out.argmax())
        assert t == int(np.argmax(ort_out[-1])), "greedy token differs from onnxruntime"
        seq.append(t)
        out = dec.forward([t], dec.kv_len())
        outs.append(out)
        ort_out.append(ref.forward([t]))
    full = _llama_f64(cfg, reference_weights(cfg, seed=3), seq)
    for j, o in enumerate(outs):
        assert rel(o, full[len(prompt) - 1 + j]) <= 1e-3
        assert rel(o, ort_out[j]) <= 1e-3


# --- KV: rewind, buckets, chunks ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_spec(_pkg(tmp_path_factory, "tiny_kv", TINY, seed=2))


def test_rewind_then_refeed_gives_identical_logits(tiny_spec: Any) -> None:
    dec = NativeDecoder(tiny_spec, kv_floor=16)
    prompt = _prompt(10, 384)
    dec.forward(prompt, 0)
    toks = [11, 22, 33, 44, 55]
    first = [dec.forward([t], dec.kv_len()).clone() for t in toks]
    assert dec.kv_len() == 15
    assert dec.rewind_to(12) and dec.kv_len() == 12
    again = [dec.forward([t], dec.kv_len()) for t in toks[2:]]
    for a, b in zip(first[2:], again, strict=True):
        assert torch.equal(a, b)
    dec.reset()
    assert dec.kv_len() == 0
    assert rel(dec.forward(prompt, 0), NativeDecoder(tiny_spec).forward(prompt, 0).double().numpy()) <= 1e-6


def test_bucket_growth_256_512_1024_in_one_sequence(tiny_spec: Any) -> None:
    dec = NativeDecoder(tiny_spec)  # default floor 256
    ref = OrtRef(tiny_spec)
    seen = []
    toks = _prompt(1030, 384, seed=9)
    pos = 0
    for chunk in (200, 100, 250, 300, 170):
        out = dec.forward(toks[pos : pos + chunk], pos)
        r = ref.forward(toks[pos : pos + chunk])
        pos += chunk
        seen.append(dec.info["kv_capacity"])
        assert rel(out, r) <= 1e-5
    while pos < 1030:
        out = dec.forward([toks[pos]], pos)
        r = ref.forward([toks[pos]])
        pos += 1
        seen.append(dec.info["kv_capacity"])
    assert rel(out, r) <= 1e-5
    assert sorted(set(seen)) == [256, 512, 1024, 2048]
    assert dec.kv_bytes() == dec.info["kv_capacity"] * kv_bytes_per_position(
        tiny_spec, 4
    )  # fp32, whole capacity


def test_chunked_prefill_after_cached_tokens_equals_unchunked(tiny_spec: Any) -> None:
    toks = _prompt(45, 384, seed=4)
    whole = NativeDecoder(tiny_spec, kv_floor=16)
    ref = whole.forward(toks, 0).double().numpy()
    chunked = NativeDecoder(tiny_spec, kv_floor=16)
    pos = 0
    for c in (10, 7, 1, 27):
        out = chunked.forward(toks[pos : pos + c], pos)
        pos += c
    assert rel(out, ref) <= 1e-5
    nxt = int(np.argmax(ref))
    assert rel(chunked.forward([nxt], 45), whole.forward([nxt], 45).double().numpy()) <= 1e-5


def test_kv_stays_in_model_dtype_and_is_not_mirrored(tmp_path_factory: pytest.TempPathFactory) -> None:
    spec = load_spec(_pkg(tmp_path_factory, "bf16", dataclasses.replace(TINY, dtype="bfloat16")))
    dec = NativeDecoder(spec, kv_floor=16)
    out = dec.forward(_prompt(5, 384), 0)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert dec.info["kv_dtype"] == "bfloat16" and dec.info["kv_capacity"] >= 5
    assert dec.kv_bytes() == dec.info["kv_capacity"] * kv_bytes_per_position(spec, 2)  # 2 bytes: no f32 copy


def test_unsupported_op_fails_at_load(tmp_path_factory: pytest.TempPathFactory) -> None:
    import onnx

    pkg = _pkg(tmp_path_factory, "unsupported", TINY)
    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    victim = next(n for n in model.graph.node if n.op_type == "SimplifiedLayerNormalization")
    victim.op_type, victim.domain, victim.name = "FancyNorm", "com.example", "the_victim"
    onnx.save(model, str(pkg / "model.onnx"))
    with pytest.raises(UnsupportedOp) as info:
        NativeDecoder(load_spec(pkg))
    msg = str(info.value)
    assert (
        "com.example::FancyNorm" in msg
        and "the_victim" in msg
        and "com.microsoft::GroupQueryAttention" in msg
    )
    assert info.value.op == "FancyNorm" and info.value.node == "the_victim"


def test_prefill_never_builds_seq_by_vocab_logits(tiny_spec: Any) -> None:
    dec = NativeDecoder(tiny_spec)
    shapes = []
    patched = []
    for st in dec.program.steps:
        if dec.program.logits_slot in st.outs:
            fn = st.fn

            def spy(*a: Any, _fn: Any = fn) -> Any:
                res = _fn(*a)
                shapes.append(tuple(res[0].shape))
                return res

            st.fn = spy
            patched.append((st, fn))
    try:
        dec.forward(_prompt(30, 384), 0)
    finally:  # NOTE: the program is shared by every decoder of the package
        for st, fn in patched:
            st.fn = fn
    assert shapes == [(1, 1, 384)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_program_equals_one_op_per_node(dtype: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The cross-node fusions (gate/up merged with SiLU: LinearSiluMul; RMSNorm folded into the projection
    that reads it: RmsLinear; the logits' cast done by the lm_head) compute what the unfused program
    computes, prefill and decode rows alike."""
    from onnxgen.backends.native.lowering import lower
    from onnxgen.backends.native.ops import RunCtx
    from onnxgen.kv.buffers import KVBuffers

    pkg = write_package(tmp_path_factory.mktemp("fuse") / dtype, SyntheticConfig(num_layers=2, dtype=dtype))
    spec = load_spec(pkg)
    dev = torch.device("cpu")
    progs = {f: lower(spec.decoder_path, spec, dev, fuse=f) for f in (True, False)}
    # the nodes each program runs, a CPU layer fused for the C kernels (`CpuLayer`) seen as its five
    nodes = {
        f: [n for st in p.steps for n in (st.node.attrs["_parts"] if st.node.op == "CpuLayer" else [st.node])]
        for f, p in progs.items()
    }
    ops = {f: {n.op for n in ns} for f, ns in nodes.items()}
    assert "RmsLinear" in ops[True] and "SiluMul" not in ops[True]  # gate/up + SiLU, with the norm before it
    assert any(n.attrs.get("silu") for n in nodes[True] if n.op == "RmsLinear")
    assert not {"LinearSiluMul", "RmsLinear", "CpuLayer"} & ops[False] and "SiluMul" in ops[False]
    # every skip-norm's sum formed by the o / down projection feeding it (its residual input), so no
    # skip-norm is left: the norms folded into the next projection, and the final norm, are plain
    with_res = [n for n in nodes[True] if n.op == "Linear" and any(n.inputs[5:])]
    assert len(with_res) == 2 * spec.num_layers and "SkipSimplifiedLayerNormalization" not in ops[True]
    assert "SkipSimplifiedLayerNormalization" in ops[False]
    # the final norm too: the cut before the lm_head moved before it, so it folds into the lm_head
    assert not any(op.endswith("LayerNormalization") for op in ops[True])
    assert [n.op for n in nodes[True]][-2:] == ["SliceLast", "RmsLinear"]
    # the logits' cast to float32 done by the lm_head product (half-precision packages end with one)
    casts = {f: sum(n.op == "Cast" for n in ns) for f, ns in nodes.items()}
    out_float = [n for n in nodes[True] if n.attrs.get("_out_float")]
    if dtype == "bfloat16":
        assert casts[True] == casts[False] - 1 and len(out_float) == 1
    ids = torch.tensor(_prompt(12, spec.vocab_size))
    out = {}
    for f, prog in progs.items():
        kv = KVBuffers(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_size,
            torch.float32 if dtype == "float32" else torch.bfloat16,
            dev,
        )
        kv.reserve(16)
        rows = []
        for start, chunk in ((0, ids[:11]), (11, ids[11:])):  # a prefill chunk, then a one-row decode step
            env = prog.new_env()
            env[prog.input_slots[spec.input_ids_name]] = chunk.view(1, -1)
            n = chunk.numel()
            logits = prog.execute(env, RunCtx(kv, start, n, torch.arange(start, start + n)))
            assert logits.dtype == torch.float32  # the package's logits type, fused or not
            rows.append(logits)
        out[f] = rows
    tol = 1e-5 if dtype == "float32" else 2e-2
    for a, b in zip(out[True], out[False], strict=True):
        assert float((a - b).norm() / b.norm()) <= tol


def test_silu_mul_halves_writes_over_the_gate_half() -> None:
    from onnxgen.backends.native.kernels.norms import silu_mul_halves

    for dtype in (torch.float32, torch.bfloat16):
        y = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        g, u = y[..., :8].float().clone(), y[..., 8:].float().clone()
        got = silu_mul_halves(y)
        assert got.shape == (3, 5, 8) and got.data_ptr() == y.data_ptr()  # a view over y's first half
        want = (torch.nn.functional.silu(g) * u).to(dtype)
        assert torch.allclose(got.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gelu_mul_halves_is_the_tanh_gelu_of_the_gate_half_times_the_up_half(device: str) -> None:
    """`gelu_mul_halves` (Gemma's merged gate/up: one launch on a Triton device) against the float64 formula
    `0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) u`, written over the gate half."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU host)")
    from onnxgen.backends.native.kernels.norms import gelu_mul_halves

    for dtype in (torch.float32, torch.bfloat16):
        y = (3 * torch.randn(3, 5, 4096, generator=torch.Generator().manual_seed(2))).to(device, dtype)
        g, u = y[..., :2048].double().clone(), y[..., 2048:].double().clone()
        got = gelu_mul_halves(y)
        assert got.shape == (3, 5, 2048) and got.data_ptr() == y.data_ptr()
        want = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))) * u
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        assert float((got.double() - want).abs().max()) <= tol * float(want.abs().max())


# --- GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_matches_cpu(graphs: bool, tiny_spec: Any) -> None:
    cpu = NativeDecoder(tiny_spec)
    gpu = NativeDecoder(tiny_spec, "cuda", cuda_graphs=graphs, kv_floor=16)
    assert gpu.info["cuda_graphs"] == graphs
    toks = _prompt(20, 384)
    a, b = cpu.forward(toks, 0), gpu.forward(toks, 0)
    assert b.device.type == "cuda"
    assert rel(b, a.double().numpy()) <= 1e-4
    for t in range(40):
        a, b = cpu.forward([t + 3], cpu.kv_len()), gpu.forward([t + 3], gpu.kv_len())
        assert rel(b, a.double().numpy()) <= 1e-4


@pytest.mark.gpu
def test_cuda_bf16_prefill_and_chunks_after_cache_match_cpu(tmp_path: Any) -> None:
    """bf16 on CUDA (flash attention, bottom-right causal over cached tokens) against the CPU path."""
    from onnxgen.convert.synthetic import SyntheticConfig, write_package
    from onnxgen.package.spec import load_spec

    cfg = SyntheticConfig(
        num_layers=2,
        hidden_size=256,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=512,
        vocab_size=384,
        dtype="bfloat16",
    )
    spec = load_spec(write_package(tmp_path / "bf16", cfg))
    toks = _prompt(100, 384)
    ref = NativeDecoder(spec).forward(toks, 0)
    whole = NativeDecoder(spec, "cuda", kv_floor=16).forward(toks, 0)
    gpu = NativeDecoder(spec, "cuda", kv_floor=16)
    gpu.forward(toks[:40], 0)
    gpu.forward(toks[40:57], 40)
    chunked = gpu.forward(toks[57:], 57)
    assert rel(whole, ref.double().numpy()) <= 2e-2
    assert rel(chunked, ref.double().numpy()) <= 2e-2
    assert int(chunked.argmax()) == int(ref.argmax())


@pytest.mark.gpu
def test_cuda_graph_prefill_chunks_match_cpu(tiny_spec: Any) -> None:
    """Prefill chunks replayed from CUDA graphs (each shape runs eagerly once, is captured on its second
    use and replayed after) give the CPU path's logits, and decode after them too."""
    cpu = NativeDecoder(tiny_spec, kv_floor=128)
    gpu = NativeDecoder(tiny_spec, "cuda", kv_floor=128, graph_max_tokens=64)
    toks = _prompt(120, 384, seed=6)
    base = 40
    cpu.forward(toks[:base], 0)
    gpu.forward(toks[:base], 0)
    for _ in range(3):
        for c in (7, 20, 33):  # steps of 16, 32 and 64 tokens
            assert cpu.rewind_to(base) and gpu.rewind_to(base)
            a, b = cpu.forward(toks[base : base + c], base), gpu.forward(toks[base : base + c], base)
            assert rel(b, a.double().numpy()) <= 1e-4
            for t in toks[100:103]:
                a, b = cpu.forward([t], cpu.kv_len()), gpu.forward([t], gpu.kv_len())
                assert rel(b, a.double().numpy()) <= 1e-4
    assert {m for m, _cap in gpu.info["graphs"]} == {1, 16, 32, 64}


def test_int4_option_reaches_both_executors_and_is_checked(tmp_path_factory: pytest.TempPathFactory) -> None:
    cfg = dataclasses.replace(TINY, quant="int4")
    pkg = _pkg(tmp_path_factory, "int4_option", cfg, seed=4)
    packed = onnxgen.load(str(pkg), backend="native", int4="packed")  # the paged runner
    plain = onnxgen.load(str(pkg), backend="native", paged=False, int4="packed")  # per-request decoders
    dense = onnxgen.load(str(pkg), backend="native", paged=False)
    want = dense.generate([5, 6, 7, 8], max_new_tokens=8, temperature=0, output_logits=True)
    for m in (packed, plain):
        got = m.generate([5, 6, 7, 8], max_new_tokens=8, temperature=0, output_logits=True)
        assert got.tokens == want.tokens and rel(got.logits, want.logits) <= 1e-5
    with pytest.raises(InvalidRequest) as e:
        onnxgen.load(str(pkg), backend="native", int4="nf4")
    assert e.value.field == "int4" and "packed" in str(e.value)


def test_slice_before_the_lm_head_passes_every_row_through_without_a_copy() -> None:
    """SliceLast (the lowering's cut before the lm_head): the rows `RunCtx.last` lists, or x itself when it
    lists every position (a decode or verify step: no launch), or the last position without a list."""
    from onnxgen.backends.native import ops as O
    from onnxgen.backends.native.ops import RunCtx

    node = O.Node("SliceLast", "onnxgen", "cut", ["x"], ["y"])
    f = O.builder(node)(node)
    x = torch.randn(1, 3, 4)
    assert f(RunCtx(None, -1, 3, None, last=torch.arange(3)), x)[0] is x
    assert torch.equal(f(RunCtx(None, -1, 3, None, last=torch.tensor([0, 2])), x)[0], x[:, [0, 2]])
    assert torch.equal(f(RunCtx(None, 0, 3, None), x)[0], x[:, 2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_gathers_the_rows_of_its_ids(dtype: torch.dtype) -> None:
    """`kernels.norms.embedding` (the Gather of token ids from the embedding table: Triton on CUDA or under the
    interpreter, torch elsewhere) returns the table's rows by indexing, in the ids' shape, for int64 and int32
    ids, a width that is not a whole number of column blocks, and no ids; on a Triton device an id outside
    the table reads zeros."""
    from onnxgen.backends.native.kernels.dispatch import use_triton
    from onnxgen.backends.native.kernels.norms import embedding

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.randn(50, 1100, generator=torch.Generator().manual_seed(0)).to(dtype).to(dev)
    ids = torch.tensor([[3, 0, 49, 3, 17]], device=dev)
    for idx in (ids, ids.to(torch.int32), ids[:, :0]):
        got = embedding(idx, w)
        assert got.shape == (*idx.shape, 1100) and got.dtype == dtype
        assert torch.equal(got, w[idx.long()])
    if use_triton(w):
        bad = embedding(torch.tensor([1, 50, -1, 2], device=dev), w)
        assert torch.equal(bad[[0, 3]], w[[1, 2]]) and not bad[1:3].any()
