"""Continuous batching on one GPU: aggregate decode throughput at 1..128 concurrent requests, and batch-1
speed of the paged engine against the one-decoder-per-request engine, on builder-made bf16 packages.

    PYTHONPATH=src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_batch.py --tokenizer DIR \
        [--shapes 1b,8b] [--batches 1,8,32,64,128] [--prompt 512] [--gen 128]

Packages: random Llama checkpoints converted by onnxruntime-genai's builder (`benchmarks/gpu_parity.py`'s
`package`). Both engines load the same package (they share the lowered program, so one copy of the
weights). Sections per shape:
- batch 1 (paged vs decoders, interleaved, median of 5): decode tok/s of a 512-token prompt + 128 tokens,
  TTFT of a 4096-token prompt, and a 64-token turn on a retained 8000-token context;
- throughput: B requests with distinct 512-token prompts submitted at once; after every request has its
  first token, the remaining steps are timed (CUDA synchronised): aggregate decode tok/s = tokens / time,
  and per step ms. The weights' bytes over the measured copy bandwidth give the floor of one step.
A JSON of every number goes to $OUT; a table prints last.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

OUT = Path(os.environ.get("OUT") or "/tmp/gpu_batch_out")
OUT.mkdir(parents=True, exist_ok=True)
RESULTS: dict[str, Any] = {"batch1": [], "throughput": [], "errors": []}
DEV = "cuda"  # --device cpu: a dry run of the script's logic (tiny shapes)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def log(*a: Any) -> None:
    print(" ".join(str(x) for x in a), flush=True)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of 10 copies of 2 GiB."""
    x = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    y = torch.empty_like(x)
    ts = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * (2 << 30) / statistics.median(ts[2:])


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 49000, (length,), generator=g).tolist() for _ in range(n)]


def batch1(name: str, paged: Any, slots: Any) -> None:
    p512, p4k = prompts(1, 512, 1)[0], prompts(1, 4096, 2)[0]
    ctx = prompts(1, 8000, 3)[0]
    row: dict[str, Any] = {"shape": name}
    for m in (paged, slots):  # warm-up: captures, compiles
        m.generate(p512, max_new_tokens=130, temperature=0, reuse=False)
        m.generate(p4k, max_new_tokens=1, reuse=False)
    dec: dict[str, list[float]] = {"paged": [], "decoders": []}
    ttft: dict[str, list[float]] = {"paged": [], "decoders": []}
    turn: dict[str, list[float]] = {"paged": [], "decoders": []}
    sessions = {"paged": paged.session(), "decoders": slots.session()}
    for s in sessions.values():
        s.generate(ctx, max_new_tokens=1)
    for r in range(5):
        for tag, m in (("paged", paged), ("decoders", slots)) if r % 2 == 0 else (("decoders", slots), ("paged", paged)):
            dec[tag].append(m.generate(p512, max_new_tokens=128, temperature=0, reuse=False).stats.decode_tok_s)
            ttft[tag].append(m.generate(p4k, max_new_tokens=1, reuse=False).stats.ttft_s * 1e3)
            s = sessions[tag]
            s.generate(ctx, max_new_tokens=1)  # back to the 8000-token context
            extra = prompts(1, 64, 10 + r)[0]
            res = s.generate(ctx + extra, max_new_tokens=1)
            assert res.stats.reused_tokens >= 7999, res.stats
            turn[tag].append(res.stats.ttft_s * 1e3)
    for tag in dec:
        row[f"{tag}_decode_tok_s"] = statistics.median(dec[tag])
        row[f"{tag}_ttft_4096_ms"] = statistics.median(ttft[tag])
        row[f"{tag}_turn64_on_8000_ms"] = statistics.median(turn[tag])
    for s in sessions.values():
        s.close()
    RESULTS["batch1"].append(row)
    log(json.dumps(row))


def throughput(name: str, model: Any, batches: list[int], prompt: int, gen: int, weight_bytes: int, bw: float) -> None:
    for b in batches:
        ps = prompts(b, prompt, 100 + b)
        handles = [model.submit(p, max_new_tokens=gen, temperature=0, reuse=False) for p in ps]
        t0 = time.perf_counter()
        while not all(h.request.output for h in handles):
            model.step()
        sync()
        t1 = time.perf_counter()
        first = sum(len(h.request.output) for h in handles)
        steps = 0
        while not all(h.done() for h in handles):
            model.step()
            steps += 1
        sync()
        t2 = time.perf_counter()
        for h in handles:
            h.result()
        tokens = sum(len(h.request.output) for h in handles) - first
        floor_ms = weight_bytes / bw * 1e3
        row = {"shape": name, "batch": b, "prefill_s": t1 - t0, "decode_steps": steps, "decode_tokens": tokens,
               "agg_tok_s": tokens / (t2 - t1), "step_ms": (t2 - t1) / max(steps, 1) * 1e3,
               "weights_floor_ms": floor_ms, "stats": model.kv_stats()}  # fmt: skip
        RESULTS["throughput"].append(row)
        log(json.dumps({k: v for k, v in row.items() if k != "stats"}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--sections", default="batch1,throughput")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    import gpu_parity
    import onnxgen
    from gpu_parity import package

    gpu_parity.DEV = DEV

    batches = [int(x) for x in args.batches.split(",")]
    sections = set(args.sections.split(","))
    bw = copy_bandwidth() if DEV == "cuda" else 1e12
    RESULTS["copy_bandwidth_GBs"] = bw / 1e9
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    for name in args.shapes.split(","):
        try:
            _, pkg = package(name, args.tokenizer)
            t = time.perf_counter()
            paged = onnxgen.load(str(pkg), backend="native", device=DEV, max_running=max(batches))
            log(f"{name}: paged engine loaded in {time.perf_counter() - t:.1f}s: {paged.kv_stats()}")
            weights = paged.executor.runner.program.weight_bytes
            if "batch1" in sections:
                slots = onnxgen.load(str(pkg), backend="native", device=DEV, paged=False)
                batch1(name, paged, slots)
                slots.close()
                del slots
            if "throughput" in sections:
                throughput(name, paged, batches, args.prompt, args.gen, weights, bw)
            paged.close()
            del paged
        except Exception as exc:  # keep going with the next shape
            import traceback

            traceback.print_exc()
            RESULTS["errors"].append(f"{name}: {exc!r}")
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
    (OUT / "gpu_batch.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    print("\n| shape | engine | decode tok/s (512 + 128) | TTFT 4096 ms | turn 64 on 8000 ms |")
    print("|---|---|---|---|---|")
    for r in RESULTS["batch1"]:
        for tag in ("paged", "decoders"):
            print(f"| {r['shape']} | {tag} | {r[f'{tag}_decode_tok_s']:.1f} | {r[f'{tag}_ttft_4096_ms']:.1f} | "
                  f"{r[f'{tag}_turn64_on_8000_ms']:.2f} |")  # fmt: skip
    print("\n| shape | concurrent | aggregate decode tok/s | ms per step | weights floor ms | prefill s |")
    print("|---|---|---|---|---|---|")
    for r in RESULTS["throughput"]:
        print(f"| {r['shape']} | {r['batch']} | {r['agg_tok_s']:.0f} | {r['step_ms']:.2f} | {r['weights_floor_ms']:.2f} | "
              f"{r['prefill_s']:.2f} |")  # fmt: skip
    for e in RESULTS["errors"]:
        print("ERROR", e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
