"""Reading packages into ModelSpec: the real builder package, and each bad-package error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from onnxgen.errors import (
    InvalidConfig,
    MissingModelFile,
    MissingTokenizer,
    PackageNotFound,
    UnsupportedModel,
)
from onnxgen.package import load_spec


def test_builder_package_spec(smollm2_dir):
    spec = load_spec(smollm2_dir)
    assert (spec.model_type, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_size) == (
        "llama",
        30,
        9,
        3,
        64,
    )
    assert spec.vocab_size == 49152 and spec.context_length == 8192 and spec.kv_dtype == "float32"
    assert (
        spec.past_key_names[0] == "past_key_values.0.key"
        and spec.present_value_names[-1] == "present.29.value"
    )
    assert spec.attention_mask_name == "attention_mask" and spec.position_ids_name is None
    assert spec.eos_token_ids == (2,) and spec.chat_template and "im_start" in spec.chat_template
    assert spec.search.past_present_share_buffer and not spec.search.do_sample
    assert spec.extra_inputs == () and spec.chunk_size is None
    assert spec.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    with pytest.raises(AttributeError):
        spec.num_layers = 3  # frozen


@pytest.fixture
def pkg(tiny_dir, tmp_path) -> Path:
    dst = tmp_path / "pkg"
    shutil.copytree(tiny_dir, dst)
    return dst


def edit_config(pkg: Path, fn) -> None:
    cfg = json.loads((pkg / "genai_config.json").read_text())
    fn(cfg)
    (pkg / "genai_config.json").write_text(json.dumps(cfg))


def test_missing_folder(tmp_path):
    with pytest.raises(PackageNotFound, match="no such model folder") as e:
        load_spec(tmp_path / "nope")
    assert e.value.path == tmp_path / "nope"


def test_missing_config(pkg):
    (pkg / "genai_config.json").unlink()
    with pytest.raises(InvalidConfig, match=r"genai_config.json: missing.*onnxgen convert"):
        load_spec(pkg)


def test_invalid_json(pkg):
    (pkg / "genai_config.json").write_text("{ not json")
    with pytest.raises(InvalidConfig, match="not valid JSON"):
        load_spec(pkg)


@pytest.mark.parametrize(
    "key",
    [
        "model.type",
        "model.decoder.filename",
        "model.decoder.num_hidden_layers",
        "model.decoder.head_size",
        "model.vocab_size",
        "model.context_length",
    ],
)
def test_missing_key_names_the_key(pkg, key):
    def drop(cfg):
        *parents, last = key.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        del node[last]

    edit_config(pkg, drop)
    with pytest.raises(InvalidConfig) as e:
        load_spec(pkg)
    assert e.value.key == key and key in str(e.value)


def test_mistyped_key(pkg):
    edit_config(pkg, lambda c: c["model"]["decoder"].__setitem__("num_hidden_layers", "two"))
    with pytest.raises(InvalidConfig, match="num_hidden_layers' must be int"):
        load_spec(pkg)


def test_layer_count_mismatch_names_the_missing_input(pkg):
    edit_config(pkg, lambda c: c["model"]["decoder"].__setitem__("num_hidden_layers", 3))
    with pytest.raises(InvalidConfig, match=r"past_key_values\.2\.key"):
        load_spec(pkg)


def test_missing_onnx_file(pkg):
    (pkg / "model.onnx").unlink()
    with pytest.raises(MissingModelFile, match=r"model.onnx.*missing"):
        load_spec(pkg)


def test_missing_external_data(pkg):
    (pkg / "model.onnx.data").unlink()
    with pytest.raises(MissingModelFile, match="external weight file"):
        load_spec(pkg)


def test_corrupt_onnx_file(pkg):
    (pkg / "model.onnx").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(MissingModelFile, match="cannot read the ONNX graph"):
        load_spec(pkg)


def test_missing_tokenizer(pkg):
    (pkg / "tokenizer.json").unlink()
    with pytest.raises(MissingTokenizer, match=r"tokenizer\.json: missing"):
        load_spec(pkg)


def test_unsupported_model_type(pkg):
    edit_config(pkg, lambda c: c["model"].__setitem__("type", "whisper"))
    with pytest.raises(UnsupportedModel, match="'whisper' is not supported"):
        load_spec(pkg)


def test_chunk_size_precedence(pkg):
    edit_config(pkg, lambda c: c["search"].__setitem__("chunk_size", 64))
    assert load_spec(pkg).chunk_size == 64
    edit_config(
        pkg, lambda c: c["model"].__setitem__("runtime_configurable", {"chunked_prefill": {"chunk_size": 32}})
    )
    spec = load_spec(pkg)
    assert spec.chunk_size == 32
    assert spec.with_chunk_size(128).chunk_size == 128 and spec.with_chunk_size(None).chunk_size == 32
    with pytest.raises(InvalidConfig):
        spec.with_chunk_size(0)


def test_eos_union_and_template_fallback(pkg):
    edit_config(pkg, lambda c: c["model"].__setitem__("eos_token_id", [2, 5]))
    (pkg / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    template = (pkg / "chat_template.jinja").read_text()
    (pkg / "chat_template.jinja").unlink()
    tc = json.loads((pkg / "tokenizer_config.json").read_text())
    tc["chat_template"] = template
    (pkg / "tokenizer_config.json").write_text(json.dumps(tc))
    spec = load_spec(pkg)
    assert spec.eos_token_ids == (2, 5, 7)
    assert spec.chat_template == template
