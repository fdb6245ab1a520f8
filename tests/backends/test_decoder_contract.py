"""The Decoder contract (`onnxgen.backends.base`), one set of checks run against every backend and KV layout:
ort with shared buffers (GroupQueryAttention) and with concat KV (plain attention), native eager and native
through the static (CUDA-graph) code path on the CPU."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

import onnxgen
from onnxgen.backends import backend_options, create_decoder
from onnxgen.backends.base import INFO_KEYS, Decoder
from onnxgen.errors import ContextOverflow, InvalidRequest, MissingRequiredInput
from onnxgen.package import load_spec
from tests.conftest import native_available

needs_native = pytest.mark.skipif(not native_available(), reason="native backend not importable")

# name -> (backend, package fixture, options, whether reset() keeps allocated buffers)
KINDS: dict[str, tuple[str, str, dict[str, Any], bool]] = {
    "ort-shared": ("ort", "tiny_dir", {"threads": 1, "kv_floor": 16}, True),
    "ort-concat": ("ort", "tiny_plain_dir", {"threads": 1}, False),  # KV sized by its length: nothing to keep
    "native": ("native", "tiny_dir", {"kv_floor": 16}, True),
    "native-static": ("native", "tiny_dir", {"kv_floor": 16, "static_steps": True}, True),
}
PARAMS = [pytest.param(k, marks=needs_native) if KINDS[k][0] == "native" else k for k in KINDS]
PROMPT = list(range(3, 30))


@pytest.fixture(params=PARAMS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def make(request: pytest.FixtureRequest, kind: str) -> Decoder:
    backend, fixture, opts, _ = KINDS[kind]
    return create_decoder(load_spec(request.getfixturevalue(fixture)), backend, "cpu", **opts)


@pytest.fixture
def dec(request: pytest.FixtureRequest, kind: str) -> Decoder:
    return make(request, kind)


def host(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def rel(a: Any, b: Any) -> float:
    a, b = host(a).astype(np.float64), host(b).astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def feed(d: Decoder, tokens: list[int]) -> Any:
    return d.forward(tokens, d.kv_len())


# --- declarations ------------------------------------------------------------------------------------


def test_declares_the_protocol_and_the_info_keys(dec: Decoder, kind: str) -> None:
    assert isinstance(dec, Decoder)
    assert dec.backend == KINDS[kind][0] and dec.device == "cpu" and dec.can_rewind is True
    info = dec.info
    assert set(INFO_KEYS) <= set(info)
    assert (info["backend"], info["device"], info["kv_dtype"]) == (dec.backend, "cpu", "float32")
    assert info["kv_capacity"] >= dec.kv_len() == 0
    info["kv_capacity"] = -1  # a snapshot: changing it changes nothing
    assert dec.info["kv_capacity"] >= 0


@pytest.mark.parametrize("backend", ["ort", pytest.param("native", marks=needs_native)])
def test_declared_options_are_the_decoder_keywords(backend: str) -> None:
    if backend == "ort":
        from onnxgen.backends.ort.decoder import OrtDecoder as cls
    else:
        from onnxgen.backends.native.decoder import NativeDecoder as cls
    from onnxgen.backends import native, ort

    params = inspect.signature(cls.__init__).parameters.values()
    keywords = {p.name for p in params if p.kind is p.KEYWORD_ONLY and not p.name.startswith("_")}
    assert keywords == set(ort.OPTIONS if backend == "ort" else native.OPTIONS)
    assert keywords <= set(backend_options()[backend])
    assert not any(p.kind is p.VAR_KEYWORD for p in params), "a decoder swallows no unknown option"


def test_load_checks_names_and_options_once_at_the_edge(tiny_dir) -> None:
    with pytest.raises(InvalidRequest, match="tpu") as e:
        onnxgen.load(str(tiny_dir), device="tpu")
    assert e.value.field == "device"
    with pytest.raises(InvalidRequest, match="onnx") as e:
        onnxgen.load(str(tiny_dir), backend="onnx")
    assert e.value.field == "backend"
    with pytest.raises(InvalidRequest, match="kv_flor") as e:
        onnxgen.load(str(tiny_dir), backend="ort", kv_flor=16)
    assert e.value.field == "kv_flor" and "kv_floor" in str(e.value)
    # a backend ignores the options only the other backend declares (one set of options for backend="auto")
    m = onnxgen.load(str(tiny_dir), backend="ort", threads=1, graph_max_tokens=0, static_steps=True)
    assert m.generate([5, 6, 7], max_new_tokens=2).stats.generated_tokens >= 1


# --- forward ----------------------------------------------------------------------------------------


def test_forward_returns_the_last_positions_logits_as_a_fresh_1d_float32_array(request, kind, dec) -> None:
    vocab = load_spec(request.getfixturevalue(KINDS[kind][1])).vocab_size
    first = feed(dec, PROMPT)
    assert tuple(first.shape) == (vocab,) and str(first.dtype).endswith("float32")
    kept = host(first).copy()
    second = feed(dec, [40])
    assert np.array_equal(host(first), kept), "the next forward overwrote the returned logits"
    assert dec.kv_len() == len(PROMPT) + 1 and dec.info["kv_capacity"] >= dec.kv_len()
    whole = make(request, kind).forward([*PROMPT, 40], 0)  # the same positions fed in one forward
    assert rel(second, whole) <= 1e-5


def test_forward_returns_the_last_rows_logits_for_draft_verification(request, kind, dec) -> None:
    """`rows=r` gives the last r positions' logits `[r, vocab]`, each equal to feeding up to it alone."""
    vocab = load_spec(request.getfixturevalue(KINDS[kind][1])).vocab_size
    feed(dec, PROMPT)
    tail = [40, 41, 42]
    rows = dec.forward(tail, len(PROMPT), rows=3)
    assert tuple(rows.shape) == (3, vocab) and str(rows.dtype).endswith("float32")
    assert dec.kv_len() == len(PROMPT) + 3
    one = make(request, kind)
    feed(one, PROMPT)
    for i, t in enumerate(tail):
        assert rel(rows[i], one.forward([t], len(PROMPT) + i)) <= 1e-5, i
    with pytest.raises(AssertionError):
        dec.forward([7], dec.kv_len(), rows=2)  # more rows than tokens


def test_forward_asserts_its_preconditions_and_overflow_is_typed(dec) -> None:
    feed(dec, PROMPT)
    with pytest.raises(AssertionError):
        dec.forward([8], len(PROMPT) - 1)  # start_pos != kv_len()
    with pytest.raises(AssertionError):
        dec.forward([], len(PROMPT))
    ctx = 1024  # tiny packages' context length
    with pytest.raises(ContextOverflow):
        dec.forward([5] * (ctx - len(PROMPT) + 1), len(PROMPT))
    assert dec.kv_len() == len(PROMPT)  # raised before anything ran


# --- the KV seam ------------------------------------------------------------------------------------


def test_rewind_then_refeed_gives_the_same_logits(dec) -> None:
    feed(dec, PROMPT)
    steps = [feed(dec, [t]) for t in (40, 41, 42, 43)]
    steps = [host(s).copy() for s in steps]
    assert dec.rewind_to(dec.kv_len()) and dec.kv_len() == len(PROMPT) + 4  # rewinding to kv_len is a no-op
    assert dec.rewind_to(len(PROMPT) + 1) and dec.kv_len() == len(PROMPT) + 1
    assert rel(feed(dec, [41]), steps[1]) <= 1e-6 and rel(feed(dec, [42]), steps[2]) <= 1e-6


def test_rewind_out_of_range_is_the_callers_error_and_changes_nothing(dec) -> None:
    feed(dec, PROMPT)
    for n in (-1, len(PROMPT) + 1):
        with pytest.raises(AssertionError, match="outside"):
            dec.rewind_to(n)
        assert dec.kv_len() == len(PROMPT)


def test_reset_empties_and_keeps_the_buffers(request, kind, dec) -> None:
    feed(dec, PROMPT)
    feed(dec, [40])
    before, cap = dec.kv_bytes(), dec.info["kv_capacity"]
    assert before > 0
    dec.reset()
    assert dec.kv_len() == 0
    if KINDS[kind][3]:
        assert dec.kv_bytes() == before and dec.info["kv_capacity"] == cap
    else:
        assert dec.kv_bytes() == 0 and dec.info["kv_capacity"] == 0
    fresh = make(request, kind)
    assert rel(feed(dec, PROMPT[:10]), fresh.forward(PROMPT[:10], 0)) <= 1e-6


def test_close_frees_the_memory_is_idempotent_and_leaves_the_decoder_usable(request, kind, dec) -> None:
    feed(dec, PROMPT)
    assert dec.kv_bytes() > 0
    dec.close()
    assert dec.kv_len() == 0 and dec.kv_bytes() == 0 and dec.info["kv_capacity"] == 0
    dec.close()
    again = feed(dec, PROMPT)
    assert rel(again, make(request, kind).forward(PROMPT, 0)) <= 1e-6
    assert dec.kv_bytes() > 0


def test_fork_shares_the_weights_and_options_but_not_the_cache(dec) -> None:
    parent = feed(dec, PROMPT)
    dec.close()  # a closed decoder still forks (the engine's pool may close the prototype)
    child = dec.fork()
    assert isinstance(child, Decoder) and child is not dec
    assert (child.backend, child.device, child.can_rewind) == (dec.backend, dec.device, dec.can_rewind)
    assert child.kv_len() == 0 and child.kv_bytes() == 0
    same = {
        k
        for k in dec.info
        if k
        not in ("kv_capacity", "load_s", "warm_up_s", "warmed_steps", "static_forwards", "eager_forwards")
    }
    assert {k: child.info[k] for k in same} == {k: dec.info[k] for k in same}  # weights id included
    assert rel(child.forward(PROMPT, 0), parent) <= 1e-6
    assert dec.kv_len() == 0  # the child's forward left the parent's cache alone
    feed(dec, PROMPT[:5])
    assert child.kv_len() == len(PROMPT)


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory: pytest.TempPathFactory):
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    cfg = SyntheticConfig(num_layers=2, context_length=512, extra_inputs=("pixel_values",))
    return write_package(tmp_path_factory.mktemp("contract_vision") / "pkg", cfg)


@pytest.mark.parametrize("backend", ["ort", pytest.param("native", marks=needs_native)])
def test_a_missing_required_input_is_typed(vision_dir, backend: str) -> None:
    d = create_decoder(load_spec(vision_dir), backend, "cpu")
    with pytest.raises(MissingRequiredInput, match="pixel_values"):
        d.forward(PROMPT, 0)
    d.reset()
    out = d.forward(PROMPT, 0, {"pixel_values": np.full((1, 3, 8, 8), 0.5, dtype=np.float32)})
    assert tuple(out.shape) == (load_spec(vision_dir).vocab_size,)
