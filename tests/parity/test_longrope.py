"""LongRoPE parity on CUDA: a Phi-4-mini-shaped package from an independent producer, past the switch.

The package: a random Phi-3 checkpoint of Phi-4-mini's shape (`onnxgen.convert.reference.SHAPES["phi4mini"]`:
3072 hidden, 32 layers, 24/8 heads of 128, 3/4 of each head rotated, LongRoPE switching at 4096 tokens)
saved by transformers and converted by onnxruntime-genai's builder with `-p bf16 -e cuda` (its short and long
rotary tables behind an `If`). The reference: transformers fp32 on the same weights (`from_pretrained`: the
rotary frequencies stay float32); transformers bf16 is the yardstick for what bf16 arithmetic alone costs. The
native backend's error may be at most 1.5x the yardstick's, below and past the switch, while decoding across
it (the crossing step recomputes the context with the long factors, as transformers' Phi-3 does), and a
session that grows past it equals a fresh run.

The shape is `phi4minix4` (Phi-4-mini's layers, 4 of them: the GPU tests' time) unless
$ONNXGEN_TEST_LONGROPE_SHAPE names another of `SHAPES` (`phi4mini`: all 32 layers; `benchmarks/gpu_session.sh
longrope`). $ONNXGEN_TEST_LONGROPE_WORK: build into (or reuse from) that folder as the benchmarks do
(`SHAPE_hf`, `SHAPE_bf16_cuda` under their --work), else into pytest's temporary folder.
$ONNXGEN_TEST_TOKENIZER: a folder with SmolLM2's tokenizer files (the GPU host cannot build the default model).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai")
torch = pytest.importorskip("torch")

SHAPE = os.environ.get("ONNXGEN_TEST_LONGROPE_SHAPE", "phi4minix4")


@pytest.fixture(scope="module")
def phi4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """(transformers folder, builder-made bf16 package, LongRoPE's switch), built on the GPU."""
    from onnxgen.convert.checkpoint import convert_checkpoint
    from onnxgen.convert.default import ensure_default_model
    from onnxgen.convert.reference import SHAPES, random_llama_checkpoint

    shape = SHAPES[SHAPE]
    assert shape.original_context, f"{SHAPE} has no LongRoPE switch"
    tok = (
        Path(os.environ["ONNXGEN_TEST_TOKENIZER"])
        if "ONNXGEN_TEST_TOKENIZER" in os.environ
        else ensure_default_model(precision="fp32")
    )
    work = os.environ.get("ONNXGEN_TEST_LONGROPE_WORK")
    root = Path(work) if work else tmp_path_factory.mktemp("longrope_bf16")
    hf, pkg = root / f"{SHAPE}_hf", root / f"{SHAPE}_bf16_cuda"
    if not (hf / "config.json").is_file():
        random_llama_checkpoint(hf, shape, tok, device="cuda")
    if not (pkg / "genai_config.json").is_file():
        convert_checkpoint(hf, pkg, precision="bf16", execution_provider="cuda", progress=False)
    return hf, pkg, shape.original_context


@pytest.fixture(scope="module")
def refs(phi4: tuple[Path, Path, int]) -> Any:
    """transformers on the checkpoint, fp32 (the reference) and bf16 (the yardstick), on the GPU, sdpa
    (cuDNN's off), loaded once for the module."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.enable_cudnn_sdp(False)
    models = {
        dt: AutoModelForCausalLM.from_pretrained(phi4[0], dtype=dt, attn_implementation="sdpa")
        .to("cuda")
        .eval()
        for dt in (torch.float32, torch.bfloat16)
    }
    yield models
    models.clear()


def _rel(a: Any, ref: Any) -> float:
    return float((a.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())


def _last(refs: dict[Any, Any], ids: list[int]) -> tuple[Any, Any]:
    """transformers' last-position logits of a fresh forward over `ids` (its regime: the length's), fp32
    and bf16."""
    with torch.no_grad():
        x = torch.tensor([ids], device="cuda")
        return tuple(refs[dt](x, logits_to_keep=1).logits[0, -1].float().cpu() for dt in refs)


def _clear(r32: Any, r16: Any) -> bool:
    top2 = r32.topk(2).values
    return float(top2[0] - top2[1]) > 2 * float((r16 - r32).abs().max())


@pytest.mark.gpu
def test_cuda_longrope_bf16_logits_within_1p5x_of_transformers_bf16_past_the_switch(
    phi4: tuple[Path, Path, int], refs: Any
) -> None:
    """Last-position logits of prompts below the switch, at it, one past it and far past it (a prompt longer
    than a prefill chunk: its first chunks computed with the long factors already): error <= 1.5x the
    yardstick's, argmax equal where the margin is clear."""
    import onnxgen

    _, pkg, switch = phi4
    model = onnxgen.load(str(pkg), backend="native", device="cuda", kv_bytes=2 << 30)
    assert model.spec.kv_dtype == "bfloat16"
    g = torch.Generator().manual_seed(0)
    rows = []
    try:
        for n in (switch // 4, switch, switch + 1, switch + switch // 2, 2 * switch):
            ids = torch.randint(100, model.spec.vocab_size - 100, (n,), generator=g).tolist()
            r32, r16 = _last(refs, ids)
            got = model.generate(ids, max_new_tokens=1, output_logits=True, reuse=False)
            nat = torch.from_numpy(np.asarray(got.logits[0]))
            rows.append((n, _rel(nat, r32), _rel(r16, r32)))
            if _clear(r32, r16):
                assert int(nat.argmax()) == int(r32.argmax()), f"argmax differs at {n} tokens"
    finally:
        model.close()
    for n, e_nat, e_16 in rows:
        assert e_nat <= 1.5 * e_16, f"{n} tokens: native bf16 error {e_nat:.4f} > 1.5 x {e_16:.4f}; {rows}"


@pytest.mark.gpu
def test_cuda_longrope_decoding_across_the_switch(phi4: tuple[Path, Path, int], refs: Any) -> None:
    """A prompt 6 tokens short of the switch and 14 greedy steps: CUDA's decode runs stop at the switch, the
    crossing step recomputes the context; the tokens equal one-step decoding's, and each step's logits are
    within 1.5x of transformers-bf16's error against fp32 (a fresh forward over the same tokens: the regime
    of their length) at the first step, at the crossing step and on average."""
    from tests.harness import loaded, set_policy

    _, pkg, switch = phi4
    engine, model = loaded(pkg, backend="native", device="cuda", kv_bytes=2 << 30)
    g = torch.Generator().manual_seed(2)
    n = switch - 6
    ids = torch.randint(100, model.spec.vocab_size - 100, (n,), generator=g).tolist()
    kw = {"max_new_tokens": 14, "temperature": 0, "reuse": False, "speculative": "off", "stop": []}
    try:
        runs = model.generate(ids, **kw)
        set_policy(engine, decode_steps=1, launch_first=False)
        single = model.generate(ids, output_logits=True, **kw)
    finally:
        model.close()
    assert runs.tokens == single.tokens and len(runs.tokens) == 14
    errs, clear = [], 0
    for j, tok in enumerate(single.tokens):
        r32, r16 = _last(refs, ids + single.tokens[:j])
        nat = torch.from_numpy(np.asarray(single.logits[j]))
        errs.append((n + j, _rel(nat, r32), _rel(r16, r32)))
        if _clear(r32, r16):
            clear += 1
            assert tok == int(r32.argmax()), (
                f"step {j} ({n + j} tokens): the token differs from transformers fp32"
            )
    crossing = next(e for e in errs if e[0] == switch + 1)  # the step that made the context 4097 tokens long
    for length, e_nat, e_16 in (errs[0], crossing):
        assert e_nat <= 1.5 * e_16, f"{length} tokens: {e_nat:.4f} > 1.5 x {e_16:.4f}; {errs}"
    mean_nat, mean_16 = statistics.mean(e[1] for e in errs), statistics.mean(e[2] for e in errs)
    assert mean_nat <= 1.5 * mean_16, errs
    assert clear > 0, "no step with a clear margin: the tokens were checked against nothing"


@pytest.mark.gpu
def test_cuda_longrope_session_growing_past_the_switch_equals_a_fresh_run(
    phi4: tuple[Path, Path, int], refs: Any
) -> None:
    """Turn 1 below the switch, turn 2 past it (its keys all computed anew with the long factors: the same as
    a fresh run), turn 3 further past it (reusing turn 2's pages): each turn's first logits as close to
    transformers fp32 as a fresh run's, within 1.5x of transformers-bf16's error."""
    import onnxgen

    _, pkg, switch = phi4
    model = onnxgen.load(str(pkg), backend="native", device="cuda", kv_bytes=2 << 30)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(100, model.spec.vocab_size - 100, (switch + switch // 8,), generator=g).tolist()
    kw = {"max_new_tokens": 8, "temperature": 0, "speculative": "off", "stop": [], "output_logits": True}
    try:
        s = model.session()
        a, b = switch - switch // 16, switch + switch // 32  # turn 1 ends below the switch, turn 2 past it
        r1 = s.generate(ids[:a], **kw)
        turn = ids[:a] + r1.tokens + ids[a:b]
        for k in (2, 3):
            r = s.generate(turn, **kw)
            fresh = model.generate(turn, reuse=False, **kw)
            r32, r16 = _last(refs, turn)
            e_16 = _rel(r16, r32)
            for name, got in (("session", r), ("fresh", fresh)):
                e = _rel(torch.from_numpy(np.asarray(got.logits[0])), r32)
                assert e <= 1.5 * e_16, f"turn {k} ({len(turn)} tokens), {name}: {e:.4f} > 1.5 x {e_16:.4f}"
            if k == 2:  # nothing reusable: computed as the fresh run is
                assert r.stats.reused_tokens == 0 and r.tokens == fresh.tokens
            else:
                assert r.stats.reused_tokens > switch
            turn = turn + r.tokens + ids[b:]
    finally:
        model.close()
