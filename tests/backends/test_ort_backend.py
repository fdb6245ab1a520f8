"""The ort backend's KV handling: shared-buffer vs concat modes, rewind, capacity growth, forks (the
contract every decoder obeys is checked in test_decoder_contract.py)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgen.backends.ort.decoder import OrtDecoder
from onnxgen.package import load_spec


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run_steps(dec: OrtDecoder, prompt: list[int], steps: list[int]) -> list[np.ndarray]:
    out = [dec.forward(prompt, dec.kv_len())]
    for t in steps:
        out.append(dec.forward([t], dec.kv_len()))
    return out


@pytest.fixture(scope="module")
def tiny_spec(tiny_dir):
    return load_spec(tiny_dir)


def test_shared_and_concat_modes_agree(tiny_spec):
    shared = OrtDecoder(tiny_spec, threads=1, kv_floor=16)
    concat = OrtDecoder(tiny_spec, threads=1, kv_mode="concat")
    assert shared.info["kv_mode"] == "shared" and concat.info["kv_mode"] == "concat"
    prompt = list(range(3, 40))
    steps = list(range(50, 90))  # the shared buffers grow during decode (the valid prefix copied over)
    a = [shared.forward(prompt, 0)]
    caps = {shared.info["kv_capacity"]}
    for t in steps:
        a.append(shared.forward([t], shared.kv_len()))
        caps.add(shared.info["kv_capacity"])
    b = run_steps(concat, prompt, steps)
    assert shared.kv_len() == concat.kv_len() == len(prompt) + len(steps)
    assert len(caps) >= 2, caps
    for x, y in zip(a, b, strict=True):
        assert rel(x, y) < 1e-5


@pytest.mark.parametrize("mode", ["shared", "concat"])
def test_rewind_then_refeed_matches(tiny_spec, mode):
    dec = OrtDecoder(tiny_spec, threads=1, kv_mode=mode, kv_floor=16)
    prompt = list(range(3, 30))
    ref = run_steps(dec, prompt, [40, 41, 42, 43])
    assert dec.rewind_to(len(prompt) + 1)
    assert dec.kv_len() == len(prompt) + 1
    again = [dec.forward([41], dec.kv_len()), dec.forward([42], dec.kv_len())]
    assert rel(again[0], ref[2]) < 1e-6 and rel(again[1], ref[3]) < 1e-6
    # a different continuation after the rewind point
    assert dec.rewind_to(10)
    other = dec.forward(prompt[10:], 10)
    assert rel(other, ref[0]) < 1e-6


def test_forward_asserts_position(tiny_spec):
    dec = OrtDecoder(tiny_spec, threads=1)
    dec.forward([5, 6, 7], 0)
    with pytest.raises(AssertionError):
        dec.forward([8], 2)


def test_close_frees_and_fork_shares_weights(tiny_spec):
    dec = OrtDecoder(tiny_spec, threads=1, kv_floor=16)
    dec.forward(list(range(3, 20)), 0)
    assert dec.kv_bytes() > 0
    child = dec.fork()
    assert child.kv_len() == 0 and child.info["weights"] == dec.info["weights"]
    x = child.forward(list(range(3, 20)), 0)
    dec.close()
    assert dec.kv_len() == 0 and dec.kv_bytes() == 0
    y = dec.forward(list(range(3, 20)), 0)
    assert rel(x, y) < 1e-6


def test_plain_graph_uses_concat_and_matches_gqa(tiny_plain_dir, tiny_dir):
    """Same random weights (seed 0) written as a plain ai.onnx graph and as a GQA graph."""
    plain = OrtDecoder(load_spec(tiny_plain_dir), threads=1)
    gqa = OrtDecoder(load_spec(tiny_dir), threads=1)
    assert plain.info["kv_mode"] == "concat"
    a = run_steps(plain, list(range(3, 25)), [30, 31, 32])
    b = run_steps(gqa, list(range(3, 25)), [30, 31, 32])
    for x, y in zip(a, b, strict=True):
        assert rel(x, y) < 1e-4


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_plain_dir"])
def test_last_position_graph_gives_the_same_logits(request, fixture):
    spec = load_spec(request.getfixturevalue(fixture))
    sliced = OrtDecoder(spec, threads=1)
    full = OrtDecoder(spec, threads=1, last_logits=False)
    assert sliced.info["last_logits"] and not full.info["last_logits"]
    prompt = list(range(3, 50))
    a = run_steps(sliced, prompt, [60, 61])
    b = run_steps(full, prompt, [60, 61])
    for x, y in zip(a, b, strict=True):
        assert x.shape == (spec.vocab_size,) and rel(x, y) < 1e-6
    assert sliced.fork().info["last_logits"]
