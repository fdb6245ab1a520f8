"""Native backend numerics on builder-made bf16 packages against transformers, on one H200, in one run.

    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_parity.py --tokenizer DIR \
        [--shapes 2048x4,1b,8b] [--lengths 16,256,1024,2048,4096,8192] [--sections parity,ops,sessions,speed]

Packages: random Llama checkpoints saved by transformers (bf16 weights, `onnxgen.convert.reference`),
converted by onnxruntime-genai's model builder (`-p bf16 -e cuda`) under /tmp on this host.

Sections (each runs even when an earlier one failed; errors are logged):
- parity: last-position logits of a random prompt at each length, and 32 greedy steps teacher-forced
  (native's tokens fed to transformers), native bf16 (CUDA graphs on) vs transformers fp32; transformers
  bf16 on the same input is the yardstick. ‖Δ‖/‖ref‖, the ratio native/transformers-bf16, and argmax
  agreement with fp32 where its top-2 margin is clear (> 2 × transformers-bf16's max |Δ| at that step);
- ops: `benchmarks/op_error.py` on the first shape (per-op error against float64, CUDA);
- sessions: a retained session vs a fresh run at 2k and 8k contexts on the last shape (logits of the
  turn's first step and of 16 teacher-forced steps; greedy tokens);
- speed: decode tok/s (512-token prompt, 128 steps), TTFT at 4096 tokens and a 64-token turn on a
  retained 8000-token context, median of 5.
Full logs and a JSON of every number go to $OUT; a short table prints last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

OUT = Path(os.environ.get("OUT") or "/tmp/gpu_parity_out")
OUT.mkdir(parents=True, exist_ok=True)
TAG = os.environ.get(
    "ONNXGEN_BENCH_TAG", ""
)  # names this run's files (runs of two source trees side by side)
LOG = open(OUT / f"gpu_parity{TAG}.log", "a", buffering=1)
RESULTS: dict[str, Any] = {"parity": [], "sessions": [], "speed": []}
WORK = Path("/tmp/onnxgen_parity")
DEV = "cuda"  # --device cpu: a dry run of the script logic (tiny shapes)


def log(*a: Any) -> None:
    msg = " ".join(str(x) for x in a)
    print(msg, flush=True)
    LOG.write(msg + "\n")


def guarded(name: str, fn: Any, *a: Any) -> None:
    log(f"\n=== {name} ===")
    t0 = time.perf_counter()
    try:
        fn(*a)
    except Exception:
        log(f"!!! {name} failed:\n{traceback.format_exc()}")
        RESULTS.setdefault("errors", []).append(f"{name}: {traceback.format_exc().splitlines()[-1]}")
    log(f"--- {name}: {time.perf_counter() - t0:.1f}s")
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm())


def package(shape_name: str, tokenizer: Path) -> tuple[Path, Path]:
    """(hf folder, bf16 cuda package) of a shape, built once on this host."""
    hf, pkg = WORK / f"{shape_name}_hf", WORK / f"{shape_name}_pkg"
    if not (hf / "tokenizer.json").is_file():
        from onnxgen.convert.reference import SHAPES, random_llama_checkpoint

        t = time.perf_counter()
        random_llama_checkpoint(hf, SHAPES[shape_name], tokenizer, device=DEV)
        log(f"{shape_name}: random checkpoint in {time.perf_counter() - t:.1f}s")
    if not (pkg / "genai_config.json").is_file():
        from onnxgen.convert.checkpoint import convert_checkpoint

        t = time.perf_counter()
        convert_checkpoint(hf, pkg, precision="bf16", execution_provider="cuda", progress=False)
        log(f"{shape_name}: builder package in {time.perf_counter() - t:.1f}s")
    return hf, pkg


def _hf(hf: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf, dtype=dtype, attn_implementation="sdpa").to(DEV).eval()


def _hf_logits(model: Any, ids: list[int], keep: int) -> torch.Tensor:
    with torch.no_grad():
        x = torch.tensor([ids], device=DEV)
        return model(input_ids=x, logits_to_keep=keep).logits[0].double()


def parity(shapes: list[str], lengths: list[int], tokenizer: Path, steps: int = 32) -> None:
    import onnxgen

    for name in shapes:
        hf_dir, pkg = package(name, tokenizer)
        m32, m16 = _hf(hf_dir, torch.float32), _hf(hf_dir, torch.bfloat16)
        model = onnxgen.load(
            str(pkg), backend="native", device=DEV, kv_bytes=8 << 30
        )  # room for transformers
        ctx = model.spec.context_length
        g = torch.Generator().manual_seed(1)
        for n in lengths:
            n = min(n, ctx - steps - 1)
            ids = torch.randint(100, model.spec.vocab_size - 100, (n,), generator=g).tolist()
            r = model.generate(
                ids, max_new_tokens=steps, speculative="off", temperature=0, output_logits=True, reuse=False
            )
            got = torch.from_numpy(r.logits).double().to(DEV)  # [steps, vocab]
            k = got.shape[0]
            full = ids + r.tokens[: k - 1]
            ref = _hf_logits(m32, full, k)
            y16 = _hf_logits(m16, full, k)
            e_nat = [rel(got[i], ref[i]) for i in range(k)]
            e_16 = [rel(y16[i], ref[i]) for i in range(k)]
            top2 = ref.topk(2, dim=-1).values
            margin = top2[:, 0] - top2[:, 1]
            clear = margin > 2 * (y16 - ref).abs().amax(-1)
            agree = (got.argmax(-1) == ref.argmax(-1)) & clear
            row = {
                "shape": name,
                "tokens": n,
                "native_first": e_nat[0],
                "hf16_first": e_16[0],
                "native_mean": statistics.mean(e_nat),
                "hf16_mean": statistics.mean(e_16),
                "ratio_first": e_nat[0] / e_16[0],
                "ratio_mean": statistics.mean(e_nat) / statistics.mean(e_16),
                "clear": int(clear.sum()),
                "agree": int(agree.sum()),
                "steps": k,
            }
            RESULTS["parity"].append(row)
            log(json.dumps(row))
        del m32, m16, model
        gc.collect()


def ops(shape: str, tokenizer: Path, tokens: list[int]) -> None:
    import op_error

    _, pkg = package(shape, tokenizer)
    sys.argv = ["op_error", str(pkg), "--device", DEV, "--tokens", *map(str, tokens)]
    op_error.main()


def _hf_cached_turn(model: Any, turn1: list[int], reply: list[int], new: list[int]) -> torch.Tensor:
    """transformers with a kept cache, fed as onnxgen's session feeds it: turn 1 prefilled, the reply
    decoded one token at a time (its last token is never fed), then reply[-1] + the new tokens as one
    chunk. Returns the last position's logits."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(
            input_ids=torch.tensor([turn1], device=DEV),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        for t in reply[:-1]:
            model(
                input_ids=torch.tensor([[t]], device=DEV),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        out = model(
            input_ids=torch.tensor([reply[-1:] + new], device=DEV),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    return out.logits[0, -1].double()


def sessions(shape: str, tokenizer: Path, contexts: list[int]) -> None:
    """Turn 2 on a retained session vs the same request fresh (reuse=False), both against transformers fp32;
    transformers bf16 with a kept cache vs fresh is the yardstick for the gap two valid bf16 evaluation
    orders leave between them."""
    import onnxgen

    hf_dir, pkg = package(shape, tokenizer)
    model = onnxgen.load(str(pkg), backend="native", device=DEV, kv_bytes=8 << 30)  # room for transformers
    m32, m16 = _hf(hf_dir, torch.float32), _hf(hf_dir, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    for n in contexts:
        s = model.session()
        turn1 = torch.randint(100, 49000, (n - 80,), generator=g).tolist()
        r1 = s.generate(turn1, max_new_tokens=16, temperature=0)
        new = torch.randint(100, 49000, (64,), generator=g).tolist()
        turn2 = turn1 + r1.tokens + new
        a = s.generate(turn2, max_new_tokens=16, temperature=0, output_logits=True)
        b = model.generate(turn2, max_new_tokens=16, temperature=0, output_logits=True, reuse=False)
        k = min(len(a.tokens), len(b.tokens))
        same = next((i for i in range(k) if a.tokens[i] != b.tokens[i]), k)  # teacher-forced while equal
        steps = min(same + 1, k)
        la, lb = torch.from_numpy(a.logits[:steps]).double(), torch.from_numpy(b.logits[:steps]).double()
        ref = _hf_logits(m32, turn2 + a.tokens[: steps - 1], steps).cpu()
        gap = [rel(la[i], lb[i]) for i in range(steps)]
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * (la - lb).abs().amax(-1)
        hf_cached = _hf_cached_turn(m16, turn1, r1.tokens, new).cpu()
        hf_fresh = _hf_logits(m16, turn2, 1)[-1].cpu()
        row = {
            "shape": shape,
            "context": len(turn2),
            "reused": a.stats.reused_tokens,
            "gap_first": gap[0],
            "gap_max": max(gap),
            "retained_vs_fp32": rel(la[0], ref[0]),
            "fresh_vs_fp32": rel(lb[0], ref[0]),
            "hf16_gap": rel(hf_cached, hf_fresh),
            "hf16_cached_vs_fp32": rel(hf_cached, ref[0]),
            "hf16_fresh_vs_fp32": rel(hf_fresh, ref[0]),
            "tokens_equal": a.tokens == b.tokens,
            "steps_compared": steps,
            "argmax_agree_clear": int(((la.argmax(-1) == lb.argmax(-1)) & clear).sum()),
            "clear": int(clear.sum()),
        }
        RESULTS["sessions"].append(row)
        log(json.dumps(row))
        s.close()


def speed(shapes: list[str], tokenizer: Path) -> None:
    import onnxgen

    for name in shapes:
        _, pkg = package(name, tokenizer)
        model = onnxgen.load(str(pkg), backend="native", device=DEV)
        g = torch.Generator().manual_seed(3)
        p512 = torch.randint(100, 49000, (512,), generator=g).tolist()
        p4k = torch.randint(100, 49000, (4096,), generator=g).tolist()
        model.generate(
            p512, max_new_tokens=130, speculative="off", temperature=0, reuse=False
        )  # warm-up (captures)
        dec = statistics.median(
            model.generate(
                p512, max_new_tokens=128, speculative="off", temperature=0, reuse=False
            ).stats.decode_tok_s
            for _ in range(5)
        )
        model.generate(p4k, max_new_tokens=1, reuse=False)  # (its step first waits for the decodes' tail)
        ttft = statistics.median(
            model.generate(p4k, max_new_tokens=1, reuse=False).stats.ttft_s * 1e3 for _ in range(5)
        )
        s = model.session()
        ctx = torch.randint(100, 49000, (8000,), generator=g).tolist()
        s.generate(ctx, max_new_tokens=1)
        turns = []
        for _ in range(6):
            r0 = s.generate(ctx, max_new_tokens=1)  # rewinds to ctx - 1: the same 1-token turn each time
            extra = torch.randint(100, 49000, (64,), generator=g).tolist()
            r = s.generate(ctx + extra, max_new_tokens=1)
            assert r.stats.reused_tokens >= 7999 and r0.stats.reused_tokens >= 7999
            turns.append(r.stats.ttft_s * 1e3)
        row = {
            "shape": name,
            "decode_tok_s": dec,
            "ttft_4096_ms": ttft,
            "turn64_on_8000_ms": statistics.median(turns[1:]),
        }
        RESULTS["speed"].append(row)
        log(json.dumps(row))
        s.close()
        del model
        gc.collect()


def table() -> None:
    (OUT / f"gpu_parity{TAG}.json").write_text(json.dumps(RESULTS, indent=1))
    print(
        "\n| shape | tokens | native err (first / mean of 32) | transformers-bf16 err | ratio (first / mean) | argmax agree (clear) |"
    )
    print("|---|---|---|---|---|---|")
    for r in RESULTS["parity"]:
        print(
            f"| {r['shape']} | {r['tokens']} | {r['native_first']:.4f} / {r['native_mean']:.4f} | "
            f"{r['hf16_first']:.4f} / {r['hf16_mean']:.4f} | {r['ratio_first']:.2f} / {r['ratio_mean']:.2f} | "
            f"{r['agree']}/{r['clear']} |"
        )
    if RESULTS["sessions"]:
        print(
            "\n| shape | context | reused | retained vs fresh (first / max) | transformers-bf16 cached vs fresh "
            "| vs fp32: retained / fresh | transformers-bf16 vs fp32: cached / fresh | greedy equal | argmax (clear) |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
    for r in RESULTS["sessions"]:
        print(
            f"| {r['shape']} | {r['context']} | {r['reused']} | {r['gap_first']:.4f} / {r['gap_max']:.4f} | "
            f"{r['hf16_gap']:.4f} | {r['retained_vs_fp32']:.4f} / {r['fresh_vs_fp32']:.4f} | "
            f"{r['hf16_cached_vs_fp32']:.4f} / {r['hf16_fresh_vs_fp32']:.4f} | {r['tokens_equal']} | "
            f"{r['argmax_agree_clear']}/{r['clear']} |"
        )
    for r in RESULTS["speed"]:
        print(
            f"speed{TAG} {r['shape']}: decode {r['decode_tok_s']:.1f} tok/s, TTFT@4096 {r['ttft_4096_ms']:.1f} ms, "
            f"turn64@8000 {r['turn64_on_8000_ms']:.2f} ms"
        )
    for e in RESULTS.get("errors", []):
        print("ERROR", e)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--shapes", default="2048x4,1b,8b")
    ap.add_argument("--lengths", default="16,256,1024,2048,4096,8192")
    ap.add_argument("--sections", default="parity,ops,sessions,speed")
    ap.add_argument("--op-tokens", default="256,1024")
    ap.add_argument("--session-contexts", default="2048,8000")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    global DEV
    DEV = a.device
    torch.set_grad_enabled(False)
    if DEV == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    shapes, secs = a.shapes.split(","), a.sections.split(",")
    lengths = [int(x) for x in a.lengths.split(",")]
    log("torch", torch.__version__, torch.cuda.get_device_name() if DEV == "cuda" else "cpu")
    if "parity" in secs:
        guarded("parity", parity, shapes, lengths, a.tokenizer)
    if "ops" in secs:
        guarded("ops", ops, shapes[0], a.tokenizer, [int(x) for x in a.op_tokens.split(",")])
    if "sessions" in secs:
        guarded(
            "sessions", sessions, shapes[-1], a.tokenizer, [int(x) for x in a.session_contexts.split(",")]
        )
    if "speed" in secs:
        guarded("speed", speed, [s for s in shapes if s != "2048x4"], a.tokenizer)
    table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
