"""The coverage matrix: every text architecture the model builder knows, tiny and random, on both backends.

Each recipe of `onnxgen.convert.zoo` (a seeded random checkpoint saved by transformers 5) is converted by
onnxruntime-genai's builder the way `onnxgen convert` does it (config normalized, builder patched), once
per test session. Each cell compares a backend with transformers fp32 (`from_pretrained`, greedy): the
greedy tokens of prompts shorter and longer than every sliding window (and on both sides of LongRoPE's
switch, and across it during decoding), the first step's logits within a tolerance, and the session rule
(turn 2 on a retained session equals a fresh run, logits included, and reuses tokens). Logits are
compared at every generated step (a rotary or window mistake can leave the greedy tokens of a tiny random
model unchanged while moving its logits).

Cells the native backend cannot load yet are strict xfails with the exact error type: they fail the day
the feature lands, so whoever lands it removes the mark. Architectures the builder cannot convert assert
the builder's own failure and `onnxgen convert`'s clear error, so that list stays true.
"""

from __future__ import annotations

import shutil
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from onnxgen.convert.zoo import EOS, NOT_RUNNABLE, RECIPES, ROPE_SWITCH, VOCAB, WINDOW, ZooBuild, build_zoo
from onnxgen.errors import ConversionError, UnsupportedModel

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai")
torch = pytest.importorskip("torch")

N_NEW = 24
SHORT, LONG = 12, 100  # shorter than every window (32) and LongRoPE's switch (64); longer than both
CROSS = 50  # LongRoPE: 50 + 24 new tokens cross the switch while decoding
LOGIT_TOL = {"ort": 1e-4, "native": 1e-3}

BUILT = [n for n, r in RECIPES.items() if r.builds and n not in NOT_RUNNABLE]
NOT_BUILT = [n for n, r in RECIPES.items() if not r.builds]

# Native cells that cannot load today: (exact error type, reason). Remove an entry when its feature lands.
NATIVE_XFAIL: dict[str, tuple[type[Exception], str]] = {}


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ZooBuild]:
    """Every recipe built once (one subprocess, ~15 s on 2 cores)."""
    return build_zoo(list(RECIPES), tmp_path_factory.mktemp("zoo"))


# int4: MatMulNBits linears; gpt-oss's experts go from the checkpoint's MXFP4 tensors to QMoE (int4).
INT4 = BUILT


@pytest.fixture(scope="session")
def zoo_int4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ZooBuild]:
    return build_zoo(INT4, tmp_path_factory.mktemp("zoo_int4"), precision="int4")


def _prompt(name: str, n: int) -> list[int]:
    rng = np.random.default_rng(sum(map(ord, name)))
    return rng.integers(3, VOCAB - 1, n).tolist()


def _lengths(name: str) -> tuple[int, ...]:
    return (SHORT, CROSS, LONG) if RECIPES[name].rope_switch else (SHORT, LONG)


@cache
def _hf_model(hf: Path) -> Any:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()


@cache
def _reference(hf: Path, ids: tuple[int, ...], n: int = N_NEW) -> tuple[list[int], np.ndarray]:
    """transformers fp32 greedy: (tokens, every step's logits `[steps, vocab]`). Stops at EOS as onnxgen does."""
    model = _hf_model(hf)
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(ids) :].tolist(), torch.stack(out.logits)[:, 0].float().numpy()


def _load(build: ZooBuild, backend: str) -> Any:
    import onnxgen

    assert build.package is not None, build.error
    return onnxgen.load(str(build.package), backend=backend, device="cpu")


def _cells() -> list[Any]:
    cells = []
    for name in BUILT:
        for backend in ("ort", "native"):
            marks = []
            if backend == "native" and name in NATIVE_XFAIL:
                exc, reason = NATIVE_XFAIL[name]
                marks.append(pytest.mark.xfail(strict=True, raises=exc, reason=reason))
            cells.append(pytest.param(name, backend, marks=marks, id=f"{name}-{backend}"))
    return cells


@pytest.mark.parametrize(("name", "backend"), _cells())
def test_greedy_and_logits_match_transformers(zoo: dict[str, ZooBuild], name: str, backend: str) -> None:
    build = zoo[name]
    model = _load(build, backend)
    try:
        for n in _lengths(name):
            ids = _prompt(name, n)
            want, want_logits = _reference(build.hf, tuple(ids))
            r = model.generate(ids, max_new_tokens=N_NEW, temperature=0, output_logits=True, reuse=False)
            assert r.tokens == want, (
                f"{name}/{backend}, {n}-token prompt: greedy tokens differ from transformers"
            )
            diff = float(np.abs(np.asarray(r.logits, dtype=np.float32) - want_logits).max())
            assert diff <= LOGIT_TOL[backend], f"{name}/{backend}, {n} tokens: logits differ by {diff}"
    finally:
        model.close()


@pytest.mark.parametrize(("name", "backend"), _cells())
def test_session_turn_two_equals_fresh(zoo: dict[str, ZooBuild], name: str, backend: str) -> None:
    """Turn 2 on a retained session reuses turn 1's KV and equals a fresh run on the whole prompt (and
    transformers). Turn 1 ends past every window; for LongRoPE below the switch, turn 2 crosses it: every key
    is then computed anew with the long factors (the paged KV reuses nothing there: a short-factor key is not
    a long-factor key), so the reuse is asserted on a turn 3, past the switch too."""
    build = zoo[name]
    model = _load(build, backend)

    def turn(s: Any, ids: list[int]) -> Any:
        r = s.generate(ids, max_new_tokens=8, temperature=0, output_logits=True)
        fresh = model.session().generate(ids, max_new_tokens=8, temperature=0, output_logits=True)
        assert r.tokens == fresh.tokens
        assert float(np.abs(np.asarray(r.logits) - np.asarray(fresh.logits)).max()) <= LOGIT_TOL[backend] / 10
        want, want_logits = _reference(build.hf, tuple(ids), 8)
        assert r.tokens == want
        assert float(np.abs(np.asarray(r.logits, dtype=np.float32) - want_logits).max()) <= LOGIT_TOL[backend]
        return r

    try:
        ids = _prompt(name, 90)
        s = model.session()
        r1 = s.generate(ids[:40], max_new_tokens=8, temperature=0)
        turn2 = ids[:40] + r1.tokens + ids[40:70]
        r = turn(s, turn2)
        if RECIPES[name].rope_switch:
            assert len(ids[:40] + r1.tokens) <= ROPE_SWITCH < len(turn2)
            r = turn(s, turn2 + r.tokens + ids[70:80])
        assert r.stats.reused_tokens > 0, r.stats
    finally:
        model.close()


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_ort_equals_onnxruntime_genai(request: pytest.FixtureRequest, precision: str) -> None:
    """The ort backend runs each package as onnxruntime-genai does: the same greedy tokens and the same
    logits (fp32: bit for bit; int4 within 1e-6, MatMulNBits' accumulation order) on a prompt past every
    window and switch. Where the package differs from transformers, the builder made it so."""
    og = pytest.importorskip("onnxruntime_genai")
    import onnxgen

    builds = request.getfixturevalue("zoo" if precision == "fp32" else "zoo_int4")
    for name in BUILT if precision == "fp32" else INT4:
        pkg = builds[name].package
        assert pkg is not None, builds[name].error
        ids = _prompt(name, LONG)
        m = og.Model(str(pkg))
        params = og.GeneratorParams(m)
        params.set_search_options(do_sample=False, max_length=LONG + 8)
        gen = og.Generator(m, params)
        gen.append_tokens(ids)
        first = np.asarray(gen.get_output("logits"), dtype=np.float32)[0, -1]
        tokens = []
        while not gen.is_done() and len(tokens) < 8:
            gen.generate_next_token()
            tokens.append(int(gen.get_next_tokens()[0]))
        model = onnxgen.load(str(pkg), backend="ort")
        r = model.generate(ids, max_new_tokens=8, temperature=0, output_logits=True, reuse=False)
        model.close()
        assert r.tokens[: len(tokens)] == tokens[: len(r.tokens)], name
        diff = float(np.abs(np.asarray(r.logits[0]) - first).max())
        assert diff <= (0.0 if precision == "fp32" else 1e-6), (name, diff)


def test_matrix_recipes_cover_the_issue() -> None:
    """The recipes keep the windows and switches the prompts are chosen around."""
    for r in RECIPES.values():
        assert all(SHORT < w < LONG for w in r.windows), r.name
        assert r.rope_switch in (None, ROPE_SWITCH), r.name
    assert {n for n, r in RECIPES.items() if r.windows} >= {"mistral", "gemma2", "gemma3", "gptoss"}
    assert WINDOW < 40  # the session test's turn 1 ends past every window


@pytest.mark.parametrize("name", NOT_BUILT)
def test_builder_cannot_convert(zoo: dict[str, ZooBuild], name: str, tmp_path: Path) -> None:
    """The builder's own failure (so this list stays true: a builder that learns one fails here), and
    `onnxgen convert`'s error naming the architecture, before any builder runs."""
    from onnxgen.convert.checkpoint import convert_checkpoint

    build = zoo[name]
    assert build.package is None and build.error is not None
    assert RECIPES[name].builder_error in build.error
    with pytest.raises(ConversionError, match=RECIPES[name].model_class.replace("Phimoe", "Phi[Mm]o[Ee]")):
        convert_checkpoint(build.hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", sorted(NOT_RUNNABLE))
def test_builder_makes_what_onnxgen_cannot_run(zoo: dict[str, ZooBuild], name: str, tmp_path: Path) -> None:
    from onnxgen.convert.checkpoint import convert_checkpoint
    from onnxgen.package import load_spec

    build = zoo[name]
    assert build.error is None
    with pytest.raises(UnsupportedModel):
        load_spec(build.package)
    with pytest.raises(ConversionError, match=f"cannot run {RECIPES[name].model_class}"):
        convert_checkpoint(build.hf, tmp_path / "out", progress=False)


def test_onnxgen_convert_normalizes_and_patches(zoo: dict[str, ZooBuild], tmp_path: Path) -> None:
    """`onnxgen convert` (its subprocess path: config normalized, builder patched in its own process) on a
    recipe that needs both (Gemma 3's RoPE per layer type): the package equals the zoo's."""
    import json

    from onnxgen.cli import convert as cli_convert

    out = tmp_path / "gemma3"
    args = _convert_args(cli_convert, [str(zoo["gemma3"].hf), str(out), "-q"])
    assert args.func(args) == 0
    ref = zoo["gemma3"].package
    assert json.loads((out / "genai_config.json").read_text()) == json.loads(
        (ref / "genai_config.json").read_text()
    )
    assert (out / "model.onnx").read_bytes() == (ref / "model.onnx").read_bytes()
    shutil.rmtree(out)


def _convert_args(cli_convert: Any, argv: list[str]) -> Any:
    import argparse

    ap = argparse.ArgumentParser(prog="onnxgen")
    cli_convert.register(ap.add_subparsers())
    return ap.parse_args(["convert", *argv])


# --- the ort backend's handling of windows and LongRoPE, at the decoder seam ---------------------------


def test_ort_kv_holds_the_sliding_window_whatever_the_floor(zoo: dict[str, ZooBuild]) -> None:
    """GroupQueryAttention's windowed layers need every KV buffer to hold the window: a floor below it
    (here 8 < 32; the real Gemma 3's default 256 < 512) is raised to it instead of failing in onnxruntime."""
    import onnxgen

    model = onnxgen.load(str(zoo["gemma3"].package), backend="ort", kv_floor=8)
    ids = _prompt("gemma3", 5)
    r = model.generate(ids, max_new_tokens=N_NEW, temperature=0, reuse=False)
    assert r.tokens == _reference(zoo["gemma3"].hf, tuple(ids))[0]
    model.close()


def test_ort_longrope_rows_and_rewinds_across_the_switch(zoo: dict[str, ZooBuild]) -> None:
    """Verify rows on both sides of LongRoPE's switch equal one-token steps (each row in its own regime),
    and a rewind back below the switch recomputes the cache in the short regime (equal to a fresh run)."""
    from onnxgen.backends.ort.decoder import OrtDecoder
    from onnxgen.package import load_spec

    spec = load_spec(zoo["phi3_longrope"].package)
    ids = _prompt("phi3_longrope", 80)
    ref = OrtDecoder(spec, threads=1)
    assert ref.info["rope_switch"] == ROPE_SWITCH
    ref.forward(ids[:56], 0)
    steps = np.stack([ref.forward([t], 56 + i) for i, t in enumerate(ids[56:72])])
    assert ref.info["rope_recomputes"] == 1  # at the step that made the total 65

    dec = OrtDecoder(spec, threads=1)
    dec.forward(ids[:56], 0)
    rows = dec.forward(ids[56:72], 56, rows=16)  # one forward across the switch (a verify step)
    np.testing.assert_allclose(rows, steps, atol=1e-5, rtol=0)
    assert dec.info["rope_recomputes"] == 1 and dec.kv_len() == 72

    assert dec.rewind_to(50)
    again = dec.forward(ids[50:55], 50)  # total 55: the short regime again
    fresh = OrtDecoder(spec, threads=1).forward(ids[:55], 0)
    np.testing.assert_allclose(again, fresh, atol=1e-5, rtol=0)
    assert dec.info["rope_recomputes"] == 2

    # a long cache rewound below the switch, then rows across it: each row still in its own regime
    assert dec.rewind_to(0) and dec.forward(ids[:70], 0) is not None and dec.rewind_to(56)
    rows = dec.forward(ids[56:72], 56, rows=16)
    np.testing.assert_allclose(rows, steps, atol=1e-5, rtol=0)
