"""Synthetic package writer: graphs run in onnxruntime and match an independent float64 Llama."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from onnxgen.convert.synthetic import (
    LLAMA_1B,
    LLAMA_8B,
    SyntheticConfig,
    random_weights,
    reference_weights,
    to_hf_llama_config,
    write_package,
)
from onnxgen.package import spec as spec_mod

ort = pytest.importorskip("onnxruntime")

PROMPT = [5, 17, 99, 3, 250, 8, 41]
DECODE = [77, 1, 300, 12, 200]


# --- independent float64 reference ---------------------------------------------------------------


def ref_logits(w: dict[str, np.ndarray], cfg: SyntheticConfig, ids: list[int]) -> np.ndarray:
    """Llama forward pass (no cache, causal) in float64: logits [len(ids), vocab]."""
    w = {k: np.asarray(v, dtype=np.float64) for k, v in w.items()}
    h, kvh = cfg.num_heads, cfg.num_kv_heads
    d = cfg.hidden_size // h if cfg.head_size is None else cfg.head_size
    n = len(ids)

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * g

    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    ang = np.outer(np.arange(n), inv)
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(x: np.ndarray) -> np.ndarray:  # [heads, n, d], half rotation
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = rms(x, w[p + "input_layernorm.weight"])
        q = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(n, h, d).transpose(1, 0, 2)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kvh, d).transpose(1, 0, 2)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kvh, d).transpose(1, 0, 2)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, h // kvh, 0), np.repeat(v, h // kvh, 0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(d) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        x = x + o.transpose(1, 0, 2).reshape(n, h * d) @ w[p + "self_attn.o_proj.weight"].T
        a = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = a @ w[p + "mlp.gate_proj.weight"].T
        x = (
            x
            + ((gate / (1 + np.exp(-gate))) * (a @ w[p + "mlp.up_proj.weight"].T))
            @ w[p + "mlp.down_proj.weight"].T
        )
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return rms(x, w["model.norm.weight"]) @ head.T


def run_ort(
    pkg: Path, cfg: SyntheticConfig, prompt: list[int], decode: list[int], extra: dict | None = None
) -> np.ndarray:
    """Prefill `prompt` then feed `decode` one token at a time (present -> past); logits [n, vocab]."""
    sess = ort.InferenceSession(str(pkg / "model.onnx"), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    d = cfg.head_size or cfg.hidden_size // cfg.num_heads
    kv_np = {"float32": np.float32, "float16": np.float16}[cfg.dtype]
    past = {
        f"past_key_values.{i}.{k}": np.zeros((1, cfg.num_kv_heads, 0, d), kv_np)
        for i in range(cfg.num_layers)
        for k in ("key", "value")
    }
    out_names = [o.name for o in sess.get_outputs()]
    logits, pos = [], 0
    for chunk in [prompt] + [[t] for t in decode]:
        feeds = {
            "input_ids": np.array([chunk], np.int64),
            "attention_mask": np.ones((1, pos + len(chunk)), np.int64),
            **past,
        }
        if "position_ids" in names:
            feeds["position_ids"] = np.arange(pos, pos + len(chunk), dtype=np.int64)[None]
        feeds.update(extra or {})
        res = dict(zip(out_names, sess.run(None, feeds), strict=True))
        logits.append(res["logits"][0].astype(np.float64))
        past = {k: res[k.replace("past_key_values", "present")] for k in past}
        pos += len(chunk)
    return np.concatenate(logits)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("synthetic")


def _write(tmp: Path, cfg: SyntheticConfig, tag: str, weights: dict | None = None) -> Path:
    return write_package(tmp / tag, cfg, weights)


# --- logits parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["gqa", "plain", "onnx23"])
@pytest.mark.parametrize("tie", [False, True])
def test_fp32_styles_match_reference(tmp: Path, attention: str, tie: bool) -> None:
    cfg = SyntheticConfig(attention=attention, tie_embeddings=tie)
    pkg = _write(tmp, cfg, f"{attention}-{tie}")
    got = run_ort(pkg, cfg, PROMPT, DECODE)
    want = ref_logits(random_weights(cfg), cfg, PROMPT + DECODE)
    assert got.shape == (len(PROMPT) + len(DECODE), cfg.vocab_size)
    assert want.std() > 0.5  # logits are not degenerate
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    spec = spec_mod.load_spec(pkg)
    assert spec.num_layers == cfg.num_layers and spec.kv_dtype == "float32"
    assert (spec.position_ids_name is not None) == (attention != "gqa")
    assert spec.search.past_present_share_buffer == (attention == "gqa")


@pytest.mark.parametrize(
    "kw",
    [
        {"quant": "int4"},
        {"quant": "int4", "quant_zero_points": True, "accuracy_level": 4},
        {"quant": "int4", "quant_embeddings": True},
        {"quant": "int4", "quant_embeddings": True, "quant_zero_points": True, "tie_embeddings": True},
        {"quant": "int4", "attention": "plain", "tie_embeddings": True},
    ],
    ids=["sym", "zp-acc4", "qemb", "qemb-zp-tied", "plain-tied"],
)
def test_int4_matches_dequantized_reference(tmp: Path, kw: dict) -> None:
    cfg = SyntheticConfig(**kw)
    pkg = _write(tmp, cfg, "int4-" + "-".join(f"{k}{v}" for k, v in kw.items()))
    got = run_ort(pkg, cfg, PROMPT, DECODE)
    ref_w = reference_weights(cfg)
    want = ref_logits(ref_w, cfg, PROMPT + DECODE)
    # accuracy_level 4 quantizes activations to int8 inside MatMulNBits: looser.
    atol = 0.05 * np.abs(want).max() if cfg.accuracy_level == 4 else 5e-4
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    # ... and the quantization is real: the fp32 model gives measurably different logits.
    fp = ref_logits(random_weights(cfg), cfg, PROMPT + DECODE)
    assert np.abs(fp - want).max() > 10 * 5e-4
    ops = _ops(pkg)
    per_layer = 5 if cfg.attention == "gqa" else 7
    assert ops.count("MatMulNBits") == cfg.num_layers * per_layer + 1
    assert cfg.attention != "gqa" or "MatMul" not in ops
    assert ("GatherBlockQuantized" in ops) == cfg.quant_embeddings


def _ops(pkg: Path) -> list[str]:
    import onnx

    return [n.op_type for n in onnx.load(str(pkg / "model.onnx"), load_external_data=False).graph.node]


def test_int4_packing_is_onnxruntime_layout(tmp: Path) -> None:
    """Unpack MatMulNBits initializers independently (low nibble first, zero point 8 default)."""
    import onnx
    from onnx import numpy_helper

    cfg = SyntheticConfig(quant="int4", quant_zero_points=True, num_layers=1)
    pkg = _write(tmp, cfg, "int4-pack")
    model = onnx.load(str(pkg / "model.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    base = "model.layers.0.mlp.down_proj.MatMul.weight"
    b, scales, zp = inits[base + "_Q4"], inits[base + "_scales"], inits[base + "_zero_points"]
    n, k = cfg.hidden_size, cfg.intermediate_size
    assert b.shape == (n, k // 32, 16) and b.dtype == np.uint8 and scales.shape == (n * k // 32,)
    q = np.stack([b & 15, b >> 4], -1).reshape(n, k // 32, 32).astype(np.float64)
    z = np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, : k // 32].astype(np.float64)
    deq = ((q - z[..., None]) * scales.reshape(n, k // 32, 1)).reshape(n, k)
    np.testing.assert_allclose(deq, reference_weights(cfg)["model.layers.0.mlp.down_proj.weight"], atol=1e-6)
    w = random_weights(cfg)["model.layers.0.mlp.down_proj.weight"]
    err = np.abs(deq - w).max()
    assert 0 < err <= np.abs(w).max() / 15 + 1e-6  # within half a quantization step of a 16-level grid


def test_given_weights_round_trip(tmp: Path) -> None:
    torch = pytest.importorskip("torch")
    # head_size != hidden/heads (ORT's CPU GroupQueryAttention needs head_size % 16 == 0).
    cfg = SyntheticConfig(num_layers=1, num_heads=4, num_kv_heads=1, head_size=32, hidden_size=64)
    given = {k: torch.from_numpy(v).to(torch.float64) for k, v in random_weights(cfg, seed=7).items()}
    pkg = write_package(tmp / "given", cfg, given)
    got = run_ort(pkg, cfg, PROMPT, DECODE[:2])
    want = ref_logits(random_weights(cfg, seed=7), cfg, PROMPT + DECODE[:2])
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    other = ref_logits(random_weights(cfg, seed=0), cfg, PROMPT + DECODE[:2])
    assert np.abs(other - want).max() > 0.1


def test_lazy_random_weights_equal_random_weights(tmp: Path) -> None:
    cfg = SyntheticConfig(num_layers=1)
    a = write_package(tmp / "lazy", cfg)
    b = write_package(tmp / "eager", cfg, random_weights(cfg))
    assert (a / "model.onnx.data").read_bytes() == (b / "model.onnx.data").read_bytes()


def test_given_weights_validation(tmp: Path) -> None:
    from onnxgen.errors import ConversionError

    cfg = SyntheticConfig(num_layers=1)
    w = random_weights(cfg)
    del w["model.norm.weight"]
    with pytest.raises(ConversionError, match=r"model\.norm\.weight"):
        write_package(tmp / "bad1", cfg, w)
    w = random_weights(cfg)
    w["lm_head.weight"] = w["lm_head.weight"][:, :10]
    with pytest.raises(ConversionError, match="shape"):
        write_package(tmp / "bad2", cfg, w)
    with pytest.raises(ConversionError, match="multiple"):
        SyntheticConfig(num_heads=4, num_kv_heads=3)


@pytest.mark.parametrize("attention", ["gqa", "plain", "onnx23"])
def test_fp16_runs_on_cpu(tmp: Path, attention: str) -> None:
    cfg = SyntheticConfig(attention=attention, dtype="float16")
    pkg = _write(tmp, cfg, f"fp16-{attention}")
    spec = spec_mod.load_spec(pkg)
    assert spec.kv_dtype == "float16"
    got = run_ort(pkg, cfg, PROMPT, DECODE)
    want = ref_logits(reference_weights(cfg), cfg, PROMPT + DECODE)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


@pytest.mark.parametrize("attention", ["gqa", "plain", "onnx23"])
def test_bf16_graph_is_typed_like_the_builder(tmp: Path, attention: str) -> None:
    import onnx

    cfg = SyntheticConfig(attention=attention, dtype="bfloat16", quant="int4" if attention == "gqa" else None)
    pkg = _write(tmp, cfg, f"bf16-{attention}")
    spec = spec_mod.load_spec(pkg)
    assert spec.kv_dtype == "bfloat16"
    logits = next(o for o in spec.outputs if o.name == "logits")
    assert logits.dtype == "float32"  # the builder casts bf16 logits to float32
    check_graph(pkg)
    if attention != "gqa":
        model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
        onnx.shape_inference.infer_shapes(model, strict_mode=True)


def check_graph(pkg: Path, full: bool = False) -> None:
    """onnx.checker on the package's graph. The builder puts ORT's SimplifiedLayerNormalization in the
    default domain, which onnx does not know (the real builder package fails the checker the same
    way), so those nodes are checked as a custom-domain op."""
    import onnx

    model = onnx.load(str(pkg / "model.onnx"), load_external_data=False)
    for n in model.graph.node:
        if n.op_type == "SimplifiedLayerNormalization" and n.domain == "":
            n.domain = "com.microsoft"
    path = pkg / "model.check.onnx"  # next to model.onnx.data, so external data resolves
    onnx.save_model(model, str(path))
    try:
        onnx.checker.check_model(str(path), full_check=full)
    finally:
        path.unlink()


def test_graphs_pass_onnx_checker(tmp: Path) -> None:

    for tag, cfg in [
        ("chk-plain", SyntheticConfig(attention="plain", num_layers=1)),
        ("chk-23", SyntheticConfig(attention="onnx23", num_layers=1)),
        ("chk-gqa", SyntheticConfig(num_layers=1, quant="int4", quant_embeddings=True)),
    ]:
        pkg = _write(tmp, cfg, tag)
        check_graph(pkg, full=cfg.attention != "gqa")


# --- package contents --------------------------------------------------------------------------------


def test_genai_config_and_spec(tmp: Path) -> None:
    cfg = SyntheticConfig(chunk_size=16, context_length=512, local_window_size=8, softcap=30.0)
    pkg = _write(tmp, cfg, "cfg")
    spec = spec_mod.load_spec(pkg)
    raw = json.loads((pkg / "genai_config.json").read_text())
    assert raw["model"]["decoder"]["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert spec.chunk_size == 16 and spec.context_length == 512 and spec.search.max_length == 512
    assert spec.head_size == 16 and spec.num_kv_heads == 2 and spec.vocab_size == 384
    assert spec.extra_inputs == ()
    tok = json.loads((pkg / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    assert set(spec.eos_token_ids) == {vocab["<|im_end|>"], vocab["<|endoftext|>"]}
    assert spec.bos_token_id == vocab["<|im_start|>"]
    assert spec.chat_template and "<|im_start|>" in spec.chat_template
    import onnx

    gqa = [
        n
        for n in onnx.load(str(pkg / "model.onnx"), load_external_data=False).graph.node
        if n.op_type == "GroupQueryAttention"
    ]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gqa[0].attribute}
    assert (
        attrs["local_window_size"] == 8
        and attrs["softcap"] == pytest.approx(30.0)
        and attrs["do_rotary"] == 1
    )


def test_same_op_set_as_the_builder_package() -> None:
    """The gqa style uses exactly the op types of the real builder package (when it is present)."""
    from onnxgen.package.home import default_model_dir

    real = default_model_dir("fp32")
    if not (real / "model.onnx").is_file():
        pytest.skip("default model not built")
    import tempfile

    import onnx

    with tempfile.TemporaryDirectory() as d:
        pkg = write_package(Path(d) / "p", SyntheticConfig(tie_embeddings=True))
        ours = {
            (n.domain, n.op_type)
            for n in onnx.load(str(pkg / "model.onnx"), load_external_data=False).graph.node
        }
    theirs = {
        (n.domain, n.op_type)
        for n in onnx.load(str(real / "model.onnx"), load_external_data=False).graph.node
    }
    assert ours == theirs


def test_tokenizer_round_trips_utf8(tmp: Path) -> None:
    from tokenizers import Tokenizer

    pkg = _write(tmp, SyntheticConfig(num_layers=1), "tok")
    tok = Tokenizer.from_file(str(pkg / "tokenizer.json"))
    assert tok.get_vocab_size() <= 384
    for text in [
        "Hello, world!",
        "日本語の文章です。中文句子 🚀😀👍🏽 ünïcödé",
        "<|im_start|>user\nhi<|im_end|>\n",
        "  spaces\ttabs\n",
    ]:
        ids = tok.encode(text).ids
        assert all(0 <= i < 384 for i in ids)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_end|>").ids == [tok.token_to_id("<|im_end|>")]
    # Deterministic: a second write gives the same tokenizer.
    pkg2 = _write(tmp, SyntheticConfig(num_layers=1), "tok2")
    assert (pkg / "tokenizer.json").read_text() == (pkg2 / "tokenizer.json").read_text()


def test_tokenizer_dir_is_copied(tmp: Path) -> None:
    src = _write(tmp, SyntheticConfig(num_layers=1, vocab_size=300), "toksrc")
    cfg = SyntheticConfig(num_layers=1, vocab_size=320)
    pkg = write_package(tmp / "tokcopy", cfg, tokenizer_dir=src)
    assert (pkg / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    from onnxgen.errors import ConversionError

    with pytest.raises(ConversionError, match="vocab_size"):
        write_package(
            tmp / "toksmall",
            SyntheticConfig(num_layers=1, vocab_size=280),
            tokenizer_dir=_write(tmp, SyntheticConfig(num_layers=1), "tokbig"),
        )


def test_extra_inputs_are_required(tmp: Path) -> None:
    cfg = SyntheticConfig(num_layers=1, extra_inputs=("pixel_values",))
    pkg = _write(tmp, cfg, "extra")
    spec = spec_mod.load_spec(pkg)
    assert [i.name for i in spec.extra_inputs] == ["pixel_values"]
    with pytest.raises(Exception, match="pixel_values"):
        run_ort(pkg, cfg, PROMPT, [])
    pix = {"pixel_values": np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    got = run_ort(pkg, cfg, PROMPT, DECODE[:1], extra=pix)
    np.testing.assert_allclose(
        got, ref_logits(random_weights(cfg), cfg, PROMPT + DECODE[:1]), atol=2e-4, rtol=0
    )


# --- shapes ------------------------------------------------------------------------------------------


def test_llama_presets_have_the_real_parameter_counts() -> None:
    assert LLAMA_1B.num_parameters == 1_235_814_400  # meta-llama/Llama-3.2-1B
    assert LLAMA_8B.num_parameters == 8_030_261_248  # meta-llama/Meta-Llama-3-8B
    assert LLAMA_1B.dtype == LLAMA_8B.dtype == "bfloat16"
    assert LLAMA_1B.context_length >= 8192 and LLAMA_8B.context_length >= 8192


def test_matches_transformers_llama(tmp: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for tie in (False, True):
        cfg = SyntheticConfig(tie_embeddings=tie, num_kv_heads=1, rope_theta=500000.0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf_llama_config(cfg))).eval()
        w = random_weights(cfg, seed=3)
        missing, unexpected = model.load_state_dict(
            {k: torch.from_numpy(v) for k, v in w.items()}, strict=False
        )
        assert not unexpected and set(missing) <= {"lm_head.weight"}
        pkg = write_package(tmp / f"hf-{tie}", cfg, {k: v.detach() for k, v in model.state_dict().items()})
        with torch.no_grad():
            want = model(torch.tensor([PROMPT + DECODE])).logits[0].double().numpy()
        got = run_ort(pkg, cfg, PROMPT, DECODE)
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)


@pytest.mark.skipif(not os.environ.get("ONNXGEN_MANUAL"), reason="manual timing check: set ONNXGEN_MANUAL=1")
def test_manual_llama_1b_write_speed(tmp_path: Path) -> None:
    """Write a 2-layer truncation of LLAMA_1B and extrapolate the full write time."""
    cfg = dataclasses.replace(LLAMA_1B, num_layers=2)
    t0 = time.time()
    pkg = write_package(tmp_path / "1b2", cfg, progress=True)
    dt = time.time() - t0
    size = (pkg / "model.onnx.data").stat().st_size
    per_layer = (size - 2 * LLAMA_1B.vocab_size * LLAMA_1B.hidden_size) / 2
    full = size + 14 * per_layer
    print(f"\n2-layer 1B: {size / 2**30:.2f} GiB in {dt:.1f}s -> full 1B ~{dt * full / size:.0f}s")
    assert dt * full / size < 600


@pytest.mark.parametrize("kw", [{}, {"attention": "plain", "quant": "int4"}], ids=["gqa", "plain-int4"])
def test_onnxruntime_genai_runs_the_package(tmp: Path, kw: dict) -> None:
    """The reference runtime loads the package (config, graph, tokenizer) and decodes greedily as we do."""
    og = pytest.importorskip("onnxruntime_genai")
    cfg = SyntheticConfig(**kw)
    pkg = _write(tmp, cfg, "og-" + "-".join(map(str, kw.values())))
    model = og.Model(str(pkg))
    tok = og.Tokenizer(model)
    text = "Hello 日本 🚀"
    assert tok.decode(tok.encode(text)) == text
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(PROMPT) + 5, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(PROMPT)
    got = []
    while not gen.is_done():
        gen.generate_next_token()
        got.append(int(gen.get_next_tokens()[0]))
    w, seq = reference_weights(cfg), list(PROMPT)
    for _ in range(5):
        seq.append(int(ref_logits(w, cfg, seq)[-1].argmax()))
    assert got == seq[len(PROMPT) :]


def test_tokenizer_dir_from_the_default_model(tmp: Path) -> None:
    from onnxgen.package.home import default_model_dir

    real = default_model_dir("fp32")
    if not (real / "tokenizer.json").is_file():
        pytest.skip("default model not built")
    pkg = write_package(tmp / "smoltok", SyntheticConfig(num_layers=1, vocab_size=49152), tokenizer_dir=real)
    spec = spec_mod.load_spec(pkg)
    assert spec.bos_token_id == 1 and set(spec.eos_token_ids) == {2, 0} and spec.pad_token_id == 2
    assert spec.chat_template == (real / "chat_template.jinja").read_text()
