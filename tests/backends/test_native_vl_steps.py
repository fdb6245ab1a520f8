"""A vision package's decoder steps on the native backend (the tiny Qwen2.5-VL, `convert/qwen_vl.py`): the
lowering's fold of MRotaryEmbedding into GroupQueryAttention (`_mrope_into_gqa`: packed QKV over per-step MRoPE
tables) against the unfused program (one op per ONNX node: MRotaryEmbedding on q and k), and static steps fed
embeddings (the code path CUDA graphs capture, `FedInputs`) against eager forwards, over a prompt with two
images (positions on their grids) and greedy decode steps. transformers' parity on the folded path is
tests/parity/test_qwen_vl.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import native_available
from tests.parity.test_qwen_vl import IMAGES, messages

pytestmark = pytest.mark.skipif(not native_available(), reason="native backend not importable")
torch = pytest.importorskip("torch")
STEPS = 8


@pytest.fixture(scope="module")
def prepared(qwen_vl_dir):
    import onnxgen

    m = onnxgen.load(str(qwen_vl_dir), backend="ort", threads=2)
    p = m.prepare(messages(2), images=IMAGES, max_new_tokens=1, reuse=False)
    m.close()
    return p


def _decoder(qwen_vl_dir, device: str = "cpu", fuse: bool = True, **options):
    from onnxgen.backends.multimodal import MultimodalDecoder, Parts
    from onnxgen.backends.native.decoder import NativeDecoder
    from onnxgen.backends.native.lowering import lower
    from onnxgen.package.spec import load_spec

    spec = load_spec(qwen_vl_dir)
    program = None if fuse else lower(spec.decoder_path, spec, torch.device(device), fuse=False)
    inner = NativeDecoder(spec, device, kv_floor=16, _program=program, **options)
    return MultimodalDecoder(inner, Parts(spec, "native", device))


def _greedy(dec, prepared) -> tuple[list[int], np.ndarray]:
    """Logits of the prompt's last token and of `STEPS` greedy steps after it, and the tokens chosen."""
    from onnxgen.package.attachments import IMAGES as KEY

    inputs = {KEY: prepared.images}
    out = [dec.forward(prepared.ids, 0, inputs)]
    tokens: list[int] = []
    for _ in range(STEPS):
        tokens.append(int(out[-1].argmax()))
        out.append(dec.forward([tokens[-1]], dec.kv_len(), inputs))
    return tokens, torch.stack(out).cpu().numpy()


def _ops(dec) -> list[str]:
    return [s.node.op for s in dec.inner.program.steps]


def test_mrope_folded_into_attention_equals_the_unfused_program(qwen_vl_dir, prepared):
    fused, plain = _decoder(qwen_vl_dir), _decoder(qwen_vl_dir, fuse=False)
    ops = _ops(fused)
    layers = fused.spec.num_layers
    assert "MRotaryEmbedding" not in ops and ops.count("MRopeTables") == 1
    assert _ops(plain).count("MRotaryEmbedding") == 2 * layers
    gqa = [s.node for s in fused.inner.program.steps if s.node.op == "GroupQueryAttention"]
    assert len(gqa) == layers and all(g.attrs.get("_step_tables") and not g.inputs[1] for g in gqa)
    t_fused, l_fused = _greedy(fused, prepared)
    t_plain, l_plain = _greedy(plain, prepared)
    assert t_fused == t_plain
    assert np.abs(l_fused - l_plain).max() <= 1e-5 * np.abs(l_plain).max()


def test_static_steps_fed_embeddings_equal_eager_forwards(qwen_vl_dir, prepared):
    static, eager = _decoder(qwen_vl_dir, static_steps=True), _decoder(qwen_vl_dir)
    assert static.info["static"] and not eager.info["static"]
    t_static, l_static = _greedy(static, prepared)
    t_eager, l_eager = _greedy(eager, prepared)
    assert t_static == t_eager
    assert np.abs(l_static - l_eager).max() <= 1e-5 * np.abs(l_eager).max()
    prompt = len(prepared.ids)
    assert static.info["eager_forwards"] == 0
    assert static.info["static_forwards"] == {max(16, 1 << (prompt - 1).bit_length()): 1, 1: STEPS}
    # a verify-style forward asking for several rows still runs eagerly and agrees
    static.rewind_to(prompt)
    eager.rewind_to(prompt)
    ids = [t for t in t_eager[:3]]
    a, b = static.forward(ids, prompt, {}, rows=3), eager.forward(ids, prompt, {}, rows=3)
    assert static.info["eager_forwards"] == 1
    assert torch.allclose(a, b, rtol=0, atol=1e-5 * float(b.abs().max()))


@pytest.mark.gpu
def test_cuda_graph_decode_steps_of_a_vision_package_equal_eager(qwen_vl_dir, prepared):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    graphs, eager = _decoder(qwen_vl_dir, "cuda"), _decoder(qwen_vl_dir, "cuda", cuda_graphs=False)
    assert graphs.info["cuda_graphs"]
    t_graphs, l_graphs = _greedy(graphs, prepared)
    t_eager, l_eager = _greedy(eager, prepared)
    assert t_graphs == t_eager
    assert np.abs(l_graphs - l_eager).max() <= 1e-4 * np.abs(l_eager).max()
    assert graphs.info["static_forwards"].get(1) == STEPS and any(m == 1 for m, _ in graphs.info["graphs"])


def _parts(pkg):
    from onnxgen.backends.multimodal import Parts
    from onnxgen.package.spec import load_spec

    return Parts(load_spec(pkg), "native", "cpu")


def test_text_tokens_are_read_from_the_embedding_table_as_the_graph_gives_them(qwen_vl_dir):
    parts = _parts(qwen_vl_dir)
    assert parts._table is not None
    ids = np.array([0, 7, 200, 383, 9], dtype=np.int64)
    fast = parts.embed(ids, parts.rows([]))
    table, parts._table = parts._table, None
    assert torch.equal(fast, parts.embed(ids, parts.rows([])))  # the graph's own output
    parts._table = table
    assert fast.shape == (1, 5, parts.spec.hidden_size)


def test_an_embedding_graph_that_is_not_a_plain_lookup_keeps_running(qwen_vl_dir, tmp_path):
    """A graph scaling the looked-up rows fails the load-time probe: every forward runs the graph."""
    import shutil

    import onnx
    from onnx import helper, numpy_helper

    pkg = tmp_path / "pkg"
    shutil.copytree(qwen_vl_dir, pkg)
    model = onnx.load(str(pkg / "embedding.onnx"))
    g = model.graph
    gather = next(n for n in g.node if n.op_type == "Gather" and n.input[1] == "input_ids")
    raw, out = gather.output[0] + "_raw", gather.output[0]
    gather.output[0] = raw
    g.initializer.append(numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two"))
    g.node.insert(list(g.node).index(gather) + 1, helper.make_node("Mul", [raw, "two"], [out]))
    onnx.save(model, str(pkg / "embedding.onnx"))
    parts = _parts(pkg)
    assert parts._table is None
    table = _parts(qwen_vl_dir).embed(np.array([7, 9]), parts.rows([]))
    assert torch.equal(parts.embed(np.array([7, 9]), parts.rows([])), 2 * table)
