"""Batch-1 decode against the bandwidth floor on one GPU (issue 13): where a token's time goes.

    PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_decode.py --tokenizer DIR \
        [--shapes 0.5b,1b,8b16k] [--no-hf] [--decode-steps 1,8]

For each shape (Qwen2.5-0.5B's, Llama-3.2-1B's and Llama-3-8B's, `onnxgen.convert.reference.SHAPES`): a
random Llama checkpoint saved by transformers and converted by onnxruntime-genai's builder (`-p bf16 -e
cuda`, `benchmarks/gpu_parity.py`'s `package`; without `--tokenizer`, a synthetic package of the same
shape written by onnxgen), through the public API (`onnxgen.load(pkg, backend="native", device="cuda")`,
the paged engine, greedy, a 512-token prompt, 128 tokens):
- decode tok/s (median of 5, `Stats.decode_tok_s`) and the host CPU time per token (process CPU time
  over the generation / tokens; it includes the host's spin while it waits for the GPU), for each
  `decode_steps` value (`Model.decode_steps`: decode steps per host round trip);
- the GPU time of one decode step alone: the captured batch-1 graph replayed 200 times back to back
  (CUDA events), so `ms per token - replay ms` is the time the GPU waits on the host per token;
- kernels per step and the top kernels (torch.profiler over 20 replays);
- transformers eager on the same checkpoint (sdpa, logits_to_keep=1, bf16) in the same run;
- the floor: the bytes a step reads (weights, lm_head, KV) over the copy bandwidth measured at the start.
A JSON of every number goes to $OUT; the table prints last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _util import copy_bandwidth  # noqa: E402

OUT = Path(os.environ.get("OUT") or "/tmp/gpu_decode_out")
OUT.mkdir(parents=True, exist_ok=True)


def log(*a: Any) -> None:
    print(" ".join(str(x) for x in a), flush=True)


def synthetic(name: str) -> Path:
    """A synthetic bf16 package of the shape (no tokenizer needed), written once."""
    from onnxgen.convert.reference import SHAPES
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    sh = SHAPES[name]
    out = Path("/tmp/onnxgen_bench") / f"synthetic_{name}"
    if not (out / "genai_config.json").is_file():
        cfg = SyntheticConfig(
            num_layers=sh.num_layers,
            hidden_size=sh.hidden_size,
            num_heads=sh.num_heads,
            num_kv_heads=sh.num_kv_heads,
            intermediate_size=sh.intermediate_size,
            vocab_size=sh.vocab_size,
            context_length=sh.context_length,
            dtype="bfloat16",
            rope_theta=sh.rope_theta,
            tie_embeddings=sh.tie_word_embeddings,
        )
        write_package(out, cfg, seed=0)
    return out


def floor_ms(name: str, ctx: int, bw: float) -> float:
    """Bytes one bf16 decode step must read (every layer's weights, the lm_head, the KV of `ctx`
    positions; one embedding row is negligible) over the copy bandwidth."""
    from onnxgen.convert.reference import SHAPES

    sh = SHAPES[name]
    h, kv_dim = sh.hidden_size, sh.hidden_size // sh.num_heads * sh.num_kv_heads
    layer = h * (h + 2 * kv_dim) + h * h + 3 * h * sh.intermediate_size + 2 * h
    params = sh.num_layers * layer + sh.vocab_size * h + h
    kv = 2 * sh.num_layers * kv_dim * ctx * 2
    return (params * 2 + kv) / bw * 1e3


def decode_graph(runner: Any, kv_len: int) -> Any:
    """The batch-1 decode graph the engine replayed for the last decode step to reach `kv_len` keys (the
    short-context graph while within its keys): its device inputs hold that step's state, so its replays
    time a real step. (The other decode graph still holds its capture's state, a one-key attention.)"""
    from onnxgen.backends.batch import BatchStep, SeqChunk

    return runner._decode_graph(BatchStep((SeqChunk([0], kv_len - 1, [0]),)), 1)


def replay_ms(runner: Any, kv_len: int, reps: int = 200, multi: bool = True) -> float:
    """GPU ms per decode step of back-to-back replays of `decode_graph`'s graph — with `multi`, its several-step
    version (`_Graph.multi`, what greedy runs replay) where it has one, per step."""
    from onnxgen.backends.native import runner as rn

    g = decode_graph(runner, kv_len)
    graph, steps = (g.multi, rn.RUN_GRAPH_STEPS) if multi and g.multi is not None else (g.graph, 1)
    for _ in range(20 // steps):
        graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps // steps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / (reps // steps * steps)


def kernels(runner: Any, kv_len: int, reps: int = 20) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    g = decode_graph(runner, kv_len)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.graph.replay()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t and ev.device_type == torch.autograd.DeviceType.CUDA:
            rows.append((ev.key[:90], t / reps / 1e3, ev.count / reps))
    rows.sort(key=lambda r: -r[1])
    return {
        "kernels_per_step": sum(r[2] for r in rows),
        "kernel_ms": sum(r[1] for r in rows),
        "top": rows[:15],
    }


def hf_tps(hf: Path | None, name: str, prompt: list[int], n: int = 64) -> tuple[float, list[int]]:
    """transformers eager decode tok/s (batch 1, greedy, one token read per step) and its greedy tokens: the
    checkpoint `hf`, or random weights of the shape."""
    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.backends.cuda.enable_cudnn_sdp(False)
    if hf is not None:
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16, attn_implementation="sdpa")
        model = model.to("cuda").eval()
    else:
        from onnxgen.convert.reference import SHAPES

        sh = SHAPES[name]
        conf = LlamaConfig(
            hidden_size=sh.hidden_size,
            intermediate_size=sh.intermediate_size,
            num_hidden_layers=sh.num_layers,
            num_attention_heads=sh.num_heads,
            num_key_value_heads=sh.num_kv_heads,
            vocab_size=sh.vocab_size,
            tie_word_embeddings=sh.tie_word_embeddings,
            attn_implementation="sdpa",
        )
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                model = LlamaForCausalLM(conf).eval()
        finally:
            torch.set_default_dtype(torch.float32)
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens = [int(tok)]
        for i in range(n + 4):
            if i == 4:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tokens.append(int(out.logits[0, -1].argmax()))
            tok = torch.tensor([[tokens[-1]]], device="cuda")
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del model, cache
    return n / dt, tokens


def run_shape(
    name: str, tokenizer: Path | None, bw: float, steps: list[int], with_hf: bool
) -> dict[str, Any]:
    import onnxgen

    if tokenizer is not None:
        from gpu_parity import package

        hf, pkg = package(name, tokenizer)
    else:
        hf, pkg = None, synthetic(name)
    r: dict[str, Any] = {"shape": name, "floor_ms": floor_ms(name, 512 + 128, bw), "builder": hf is not None}
    prompt = np.random.default_rng(1).integers(100, 32000, 512).tolist()
    t0 = time.perf_counter()
    m = onnxgen.load(str(pkg), backend="native", device="cuda")
    r["load_s"] = time.perf_counter() - t0
    r["weights_GB"] = m.executor.runner.program.weight_bytes / 1e9
    runner = m.executor.runner
    m.generate(prompt[:64], max_new_tokens=16, speculative="off", reuse=False, temperature=0)  # warm-up
    for k in steps:
        m.decode_steps = k
        tps, cpu = [], []
        for _ in range(5):
            c0 = time.process_time()
            res = m.generate(
                prompt, max_new_tokens=128, speculative="off", reuse=False, stop=[], temperature=0
            )
            r["tokens"] = list(res.tokens)
            cpu.append((time.process_time() - c0) / res.stats.generated_tokens * 1e3)
            tps.append(res.stats.decode_tok_s)
        r[f"tps_{k}"] = statistics.median(tps)
        r[f"cpu_ms_{k}"] = statistics.median(cpu)
        log(name, f"decode_steps={k}: {r[f'tps_{k}']:.1f} tok/s, CPU {r[f'cpu_ms_{k}']:.3f} ms/token")
    r["replay_ms"] = replay_ms(runner, 512 + 128)
    r.update(kernels(runner, 512 + 128))
    log(
        name,
        f"load {r['load_s']:.1f}s; replay {r['replay_ms']:.3f} ms; {r['kernels_per_step']:.0f} kernels/step, "
        f"{r['kernel_ms']:.3f} ms",
    )
    for k_, ms, cnt in r["top"]:
        log(f"   {ms:7.3f} ms {cnt:5.1f}x {k_}")
    m.close()
    del m, runner
    gc.collect()
    torch.cuda.empty_cache()
    if with_hf:
        r["hf_tps"], hf_tokens = hf_tps(hf, name, prompt)
        log(name, f"transformers eager {r['hf_tps']:.1f} tok/s")
        if hf is not None:  # the same checkpoint: a wrong kernel differs from the first token
            n = min(len(r["tokens"]), len(hf_tokens))
            r["same_as_hf"] = next((i for i in range(n) if r["tokens"][i] != hf_tokens[i]), n)
            log(
                name,
                f"greedy tokens equal to transformers' for the first {r['same_as_hf']} of {n} (random "
                "weights: small margins)",
            )
        gc.collect()
        torch.cuda.empty_cache()
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.5b,1b,8b16k")
    ap.add_argument(
        "--tokenizer", type=Path, default=None, help="builder packages (SmolLM2's tokenizer files)"
    )
    ap.add_argument("--decode-steps", default="1")
    ap.add_argument("--no-hf", action="store_true")
    a = ap.parse_args()
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s; torch {torch.__version__}; {torch.cuda.get_device_name()}")
    rows = []
    steps = [int(x) for x in a.decode_steps.split(",")]
    for name in a.shapes.split(","):
        try:
            rows.append(run_shape(name, a.tokenizer, bw, steps, not a.no_hf))
        except Exception as exc:  # keep the other shapes' numbers
            log(f"!!! {name}: {type(exc).__name__}: {exc}")
    (OUT / "gpu_decode.json").write_text(json.dumps({"bw": bw, "rows": rows}, indent=2, default=str))
    log(
        "\n| shape | decode_steps | tok/s | ms/token | replay ms (GPU) | GPU idle ms/token | CPU ms/token | "
        "kernels/step | floor ms | % of floor | transformers tok/s |"
    )
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for k in steps:
            ms = 1e3 / r[f"tps_{k}"]
            log(
                f"| {r['shape']} | {k} | {r[f'tps_{k}']:.0f} | {ms:.3f} | {r['replay_ms']:.3f} | "
                f"{ms - r['replay_ms']:.3f} | {r[f'cpu_ms_{k}']:.3f} | {r['kernels_per_step']:.0f} | "
                f"{r['floor_ms']:.3f} | {r['floor_ms'] / ms:.0%} | {r.get('hf_tps', float('nan')):.0f} |"
            )


if __name__ == "__main__":
    main()
