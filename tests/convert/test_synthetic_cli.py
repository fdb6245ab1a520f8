"""`python -m onnxgen.convert.synthetic`: the command-line overrides reach the package it writes."""

from __future__ import annotations

import json

import onnx

import onnxgen
from onnxgen.convert.synthetic.__main__ import main


def test_cli_writes_a_loadable_package_with_the_overrides(tmp_path, capsys):
    out = tmp_path / "pkg"
    main(
        [
            str(out),
            "--preset",
            "tiny",
            "--layers",
            "1",
            "--attention",
            "plain",
            "--context-length",
            "96",
            "--seed",
            "3",
        ]
    )
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {out} (") and "B params" in printed
    cfg = json.loads((out / "genai_config.json").read_text())
    assert cfg["model"]["context_length"] == 96
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False)
    past = [i.name for i in graph.graph.input if i.name.startswith("past_key_values.")]
    assert sorted(past) == ["past_key_values.0.key", "past_key_values.0.value"]  # one layer
    assert not any(n.op_type == "GroupQueryAttention" for n in graph.graph.node)  # plain attention
    m = onnxgen.load(str(out), backend="ort", threads=1)
    r = m.generate([5, 6, 7], max_new_tokens=3, reuse=False)
    assert 1 <= len(r.tokens) <= 3
    main(
        [
            str(tmp_path / "again"),
            "--layers",
            "1",
            "--context-length",
            "96",
            "--attention",
            "plain",
            "--seed",
            "3",
        ]
    )
    capsys.readouterr()
    assert (tmp_path / "again" / "model.onnx.data").read_bytes() == (
        out / "model.onnx.data"
    ).read_bytes()  # seeded
