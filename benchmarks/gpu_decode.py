"""Batch-1 decode on one GPU against the card's bandwidth floor and transformers, with TTFT and the kernels
a decode step launches. Everything through the public API (`onnxgen.load`, `Model.generate`).

    python benchmarks/gpu_decode.py --model builder:0.5b,builder:1b,builder:8b16k [--engine decode_steps=8]
    python benchmarks/gpu_decode.py --model builder:8b16k,builder:8b16k:int4 --engine int4=dense \\
        --engine int4=packed                        (int4: dequantized at load vs packed; the bf16 package)

For each model and engine (engines interleaved, median of --runs; greedy, `speculative="off"`,
`reuse=False`):
- decode tok/s (`Stats.decode_tok_s`) of a --prompt-token random prompt and --new tokens, and the host's
  CPU time per token (process CPU time over the generation; it includes the host's wait for the GPU);
- TTFT at each --ttft length (the engine settled first: no earlier request's tail);
- GPU time and kernels per decode step: two generations of different lengths under torch.profiler, the
  difference of their kernels' summed time and count over the difference of their steps; and where the
  longest --ttft length is 1,024 or more, one prefill of it under torch.profiler, its kernels by name;
- the floor: the bytes a step reads (the decoder's initializers but gathered-only embeddings, as stored,
  plus the KV of prompt + new tokens, of a sliding window's only on windowed layers) over the copy bandwidth
  measured at the start;
- transformers eager (sdpa, cuDNN SDPA off, `logits_to_keep=1`, DynamicCache, bf16) on the same checkpoint
  when the model is `builder:*` or `convert:HF_DIR`: decode tok/s, its forward over the first --ttft
  prompt, and how many greedy tokens it shares with onnxgen's first engine (random weights: small margins).
`--device cpu` runs the same code on the CPU as a check (no floor, no kernels).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util as u

GREEDY = {"temperature": 0, "speculative": "off", "reuse": False, "stop": []}


def profiled_step(
    m: Any, prompt: list[int], device: str, short: int = 24, long: int = 88
) -> tuple[float, float]:
    """(GPU ms, kernels) per decode step: `long` and `short` tokens generated under torch.profiler, the
    difference of the kernels' summed device time and count over the difference of the steps."""
    from torch.profiler import ProfilerActivity, profile

    if device != "cuda":
        return float("nan"), float("nan")
    out = []
    for n in (short, long):
        m.settle()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            r = m.generate(prompt, max_new_tokens=n, **GREEDY)
            m.settle()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        out.append(
            (sum(e.time_range.elapsed_us() for e in kernels) / 1e3, len(kernels), r.stats.generated_tokens)
        )
    (ms1, k1, n1), (ms2, k2, n2) = out
    steps = max(n2 - n1, 1)
    return (ms2 - ms1) / steps, (k2 - k1) / steps


def profiled_prefill(m: Any, prompt: list[int], top: int = 12) -> None:
    """One prefill of `prompt` (one token out) under torch.profiler: its kernels summed by name, most first."""
    from torch.profiler import ProfilerActivity, profile

    m.settle()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = m.generate(prompt, max_new_tokens=1, **GREEDY)
        m.settle()
    kernels = u.kernels_by_name(prof)
    busy = sum(ms for _, ms, _ in kernels)
    print(
        f"prefill of {len(prompt)}: TTFT {r.stats.ttft_s * 1e3:.1f} ms (profiled), kernels busy {busy:.1f} ms"
    )
    for name, ms, n in kernels[:top]:
        print(f"  {ms:8.2f} ms {100 * ms / busy:5.1f} %  x{n:5d}  {name[:110]}")


def hf_run(pkg: u.Package, prompt: list[int], new: int, ttft_len: int, device: str) -> dict[str, Any]:
    """transformers eager on the package's checkpoint: decode tok/s (one token read per step), greedy tokens,
    and the forward over the first `ttft_len` prompt ids (median of 5)."""
    import torch
    from transformers import DynamicCache

    model = u.hf_model(pkg.hf, "bfloat16", device)
    with torch.no_grad():
        ids = torch.tensor([prompt], device=device)
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tokens = [int(out.logits[0, -1].argmax())]
        for i in range(new + 3):
            if i == 4:
                u.sync(device)
                t0 = time.perf_counter()
            x = torch.tensor([[tokens[-1]]], device=device)
            out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tokens.append(int(out.logits[0, -1].argmax()))
        u.sync(device)
        tps = (new - 1) / (time.perf_counter() - t0)
        del cache
        long = torch.tensor([u.random_ids(ttft_len, model.config.vocab_size, 7)], device=device)
        times = []
        for _ in range(6):
            u.sync(device)
            t0 = time.perf_counter()
            model(input_ids=long, logits_to_keep=1).logits[0, -1].argmax().item()
            times.append((time.perf_counter() - t0) * 1e3)
    del model
    u.release(device)
    return {"tok_s": tps, "tokens": tokens, "ttft_ms": u.median(times[1:])}


def run_model(args: Any, pkg: u.Package, specs: dict[str, dict[str, Any]], bw: float | None) -> list[dict]:
    loaded = {}
    for k, opts in specs.items():
        u.release(args.device)
        t0 = time.perf_counter()
        m = u.load(pkg, args.device, opts, args.threads)
        loaded[k] = (m, time.perf_counter() - t0)
    m0 = next(iter(loaded.values()))[0]
    vocab = m0.spec.vocab_size
    prompt = u.random_ids(args.prompt, vocab, 1)
    lengths = u.ints(args.ttft)
    ttft_prompts = {n: u.random_ids(n, vocab, 100 + n) for n in lengths}
    for m, _ in loaded.values():  # warm-up: compiles, captures, per-shape choices
        m.generate(prompt[:64], max_new_tokens=16, **GREEDY)
        m.generate(prompt, max_new_tokens=args.new, **GREEDY)
        for p in ttft_prompts.values():
            m.generate(p, max_new_tokens=1, **GREEDY)

    def decode(m: Any) -> dict[str, Any]:
        m.settle()
        c0 = time.process_time()
        r = m.generate(prompt, max_new_tokens=args.new, **GREEDY)
        cpu = (time.process_time() - c0) / max(r.stats.generated_tokens, 1) * 1e3
        return {"tok_s": r.stats.decode_tok_s, "cpu_ms": cpu, "tokens": r.tokens}

    def ttft(m: Any) -> dict[str, float]:
        out = {}
        for n, p in ttft_prompts.items():
            m.settle()
            out[n] = m.generate(p, max_new_tokens=1, **GREEDY).stats.ttft_s * 1e3
        return out

    contenders = {}
    for k, (m, _) in loaded.items():
        contenders[f"{k}|decode"] = lambda m=m: decode(m)
        contenders[f"{k}|ttft"] = lambda m=m: ttft(m)
    runs = u.interleave(args.runs, contenders)
    floor_ms = None
    if bw:
        floor_ms = (u.step_bytes(pkg.path) + u.kv_read_bytes(pkg.path, args.prompt + args.new)) / bw * 1e3
    rows = []
    for k, (m, load_s) in loaded.items():
        tps = u.median(x["tok_s"] for x in runs[f"{k}|decode"])
        gpu_ms, kernels = (
            (float("nan"), float("nan")) if args.no_profile else profiled_step(m, prompt, args.device)
        )
        if not args.no_profile and args.device == "cuda" and max(lengths) >= 1024:
            profiled_prefill(m, ttft_prompts[max(lengths)])
        rows.append(
            {
                "model": pkg.name,
                "engine": k,
                "load_s": load_s,
                "tok_s": tps,
                "ms_token": 1e3 / tps if tps else None,
                "cpu_ms_token": u.median(x["cpu_ms"] for x in runs[f"{k}|decode"]),
                "gpu_ms_step": gpu_ms,
                "kernels_step": kernels,
                "floor_ms": floor_ms,
                "ttft_ms": {n: u.median(x[n] for x in runs[f"{k}|ttft"]) for n in lengths},
                "tokens": runs[f"{k}|decode"][-1]["tokens"],
            }
        )
    for m, _ in loaded.values():
        m.close()
    del loaded, m0, contenders, runs
    u.release(args.device)
    if pkg.hf is not None and not args.no_hf:
        hf = hf_run(pkg, prompt, args.new, lengths[0], args.device)
        same = next(
            (i for i, (a, b) in enumerate(zip(rows[0]["tokens"], hf["tokens"], strict=False)) if a != b), None
        )
        for r in rows:
            r["hf_tok_s"], r["hf_ttft_ms"] = hf["tok_s"], hf["ttft_ms"]
        rows[0]["same_as_hf"] = min(len(rows[0]["tokens"]), len(hf["tokens"])) if same is None else same
    return rows


def main() -> int:
    ap = u.parser(__doc__, model="builder:0.5b,builder:1b,builder:8b16k", device="cuda")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--ttft", default="512,4096", help="prompt lengths whose TTFT is measured")
    ap.add_argument("--no-hf", action="store_true", help="no transformers peer")
    ap.add_argument("--no-profile", action="store_true", help="no torch.profiler pass (kernels per step)")
    args = ap.parse_args()
    u.check_args(ap, args)
    u.require_cuda(args.device, "gpu_decode.py")
    u.set_threads(args.threads)
    bw = u.copy_bandwidth() if args.device == "cuda" else None
    if bw:
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    specs = u.engines(args.engine)
    rows: list[dict[str, Any]] = []
    for spec in args.model.split(","):
        try:
            pkg = u.resolve(spec, work=args.work, tokenizer=args.tokenizer, device=args.device)
            rows += run_model(args, pkg, specs, bw)
            print(f"{spec}: done", flush=True)
        except Exception as exc:  # keep the other models' numbers
            print(f"!!! {spec}: {type(exc).__name__}: {exc}", flush=True)
    lengths = u.ints(args.ttft)
    table = []
    for r in rows:
        ms, floor = r["ms_token"], r["floor_ms"]
        table.append(
            [
                r["model"],
                r["engine"],
                u.fmt(r["tok_s"], 0),
                u.fmt(ms, 3),
                u.fmt(r["gpu_ms_step"], 3),
                u.fmt(r["cpu_ms_token"], 3),
                u.fmt(r["kernels_step"], 0),
                u.fmt(floor, 3),
                f"{floor / ms:.0%}" if floor and ms else "-",
                *(u.fmt(r["ttft_ms"][n], 2) for n in lengths),
                u.fmt(r.get("hf_tok_s"), 0),
                u.fmt(r.get("hf_ttft_ms"), 1),
            ]
        )
    header = [
        "model",
        "engine",
        "tok/s",
        "ms/token",
        "GPU ms/step",
        "CPU ms/token",
        "kernels/step",
        "floor ms",
        "% of floor",
        *(f"TTFT {n} ms" for n in lengths),
        "transformers tok/s",
        f"transformers {lengths[0]} forward ms",
    ]
    caption = (
        f"{u.describe(args.device, args.threads)}"
        + (f"; copy bandwidth {bw / 1e12:.2f} TB/s" if bw else "")
        + f"; batch 1, {args.prompt}-token prompt, {args.new} new tokens, greedy; median of {args.runs}"
    )
    same = [
        f"{r['model']}: greedy tokens equal transformers' for {r['same_as_hf']}"
        for r in rows
        if "same_as_hf" in r
    ]
    u.report(caption, [("", u.table(table, header) + ("\n\n" + "\n".join(same) if same else ""))], args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
