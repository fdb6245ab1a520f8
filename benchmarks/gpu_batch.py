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
- agents: N sessions under one salt share a system prompt of S tokens; each runs T turns (64-token user
  turn, up to 128 tokens of answer) on its own thread, all arriving at once: throughput, p50/p99 TTFT and
  inter-token latency, KV pages held at the end against the tokens of one system prompt + every session's
  turns, prefix hit rate; the same agents on the one-request-at-a-time engine (decoders, max_running=1,
  fewer turns: a rate) in the same run.
- growing: one session whose context grows from 7,900 to 9,000 tokens in 64-token turns (32 tokens of
  answer each): TTFT per turn (p50, p99) and decode tok/s per turn.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _util import copy_bandwidth  # noqa: E402

OUT = Path(os.environ.get("OUT") or "/tmp/gpu_batch_out")
OUT.mkdir(parents=True, exist_ok=True)
RESULTS: dict[str, Any] = {"batch1": [], "throughput": [], "errors": []}
DEV = "cuda"  # --device cpu: a dry run of the script's logic (tiny shapes)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def log(*a: Any) -> None:
    print(" ".join(str(x) for x in a), flush=True)


def p99(xs: list[float]) -> float:
    """The 99th percentile (nearest rank)."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(0.99 * len(ys)))]


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 49000, (length,), generator=g).tolist() for _ in range(n)]


def batch1(name: str, paged: Any, slots: Any) -> None:
    p512, p4k = prompts(1, 512, 1)[0], prompts(1, 4096, 2)[0]
    ctx = prompts(1, 8000, 3)[0]
    row: dict[str, Any] = {"shape": name}
    for m in (paged, slots):  # warm-up: captures, compiles
        m.generate(p512, max_new_tokens=130, speculative="off", temperature=0, reuse=False)
        m.generate(p4k, max_new_tokens=1, reuse=False)
    dec: dict[str, list[float]] = {"paged": [], "decoders": []}
    ttft: dict[str, list[float]] = {"paged": [], "decoders": []}
    turn: dict[str, list[float]] = {"paged": [], "decoders": []}
    sessions = {"paged": paged.session(), "decoders": slots.session()}
    for s in sessions.values():
        s.generate(ctx, max_new_tokens=1)
    for r in range(5):
        for tag, m in (
            (("paged", paged), ("decoders", slots)) if r % 2 == 0 else (("decoders", slots), ("paged", paged))
        ):
            dec[tag].append(
                m.generate(
                    p512, max_new_tokens=128, speculative="off", temperature=0, reuse=False
                ).stats.decode_tok_s
            )
            m.settle()  # the decode's tail (a run past its EOS) is not the next request's TTFT
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


def throughput(
    name: str, model: Any, batches: list[int], prompt: int, gen: int, weight_bytes: int, bw: float
) -> None:
    for b in batches:
        ps = prompts(b, prompt, 100 + b)
        handles = [
            model.submit(p, max_new_tokens=gen, speculative="off", temperature=0, reuse=False) for p in ps
        ]
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
        # engine steps may each run several decode steps (`decode_steps`): a decode step's time is the
        # decode time over the tokens each request generated in it
        row = {
            "shape": name,
            "batch": b,
            "prefill_s": t1 - t0,
            "engine_steps": steps,
            "decode_tokens": tokens,
            "agg_tok_s": tokens / (t2 - t1),
            "step_ms": (t2 - t1) / max(tokens / b, 1) * 1e3,
            "weights_floor_ms": floor_ms,
            "stats": model.kv_stats(),
        }
        RESULTS["throughput"].append(row)
        log(json.dumps({k: v for k, v in row.items() if k != "stats"}))


def agents(
    name: str, paged: Any, slots: Any | None, n: int, system: int, turns: int, base_turns: int
) -> None:
    import threading

    sys_prompt = prompts(1, system, 7)[0]
    paged.close()  # drop what earlier sections left in the prefix cache: count this section's pages alone

    def run(model: Any, n_turns: int, tag: str) -> dict[str, Any]:
        ttft: list[float] = []
        itl: list[float] = []
        gen = [0]
        lock = threading.Lock()
        barrier = threading.Barrier(n)

        def agent(i: int) -> int:
            s = model.session(salt=f"{tag}-team")
            ctx = list(sys_prompt)
            barrier.wait()
            for t in range(n_turns):
                ctx += prompts(1, 64, 1000 * i + t)[0]
                r = s.generate(ctx, max_new_tokens=128, speculative="off", temperature=0)
                with lock:
                    ttft.append(r.stats.ttft_s * 1e3)
                    if r.stats.generated_tokens > 1 and r.stats.decode_tok_s > 0:
                        itl.append(1e3 / r.stats.decode_tok_s)
                    gen[0] += r.stats.generated_tokens
                ctx += r.tokens
            return len(ctx)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as ex:
            lens = list(ex.map(agent, range(n)))
        wall = time.perf_counter() - t0
        row = {
            "shape": name,
            "engine": tag,
            "agents": n,
            "turns": n_turns,
            "tokens": gen[0],
            "wall_s": wall,
            "tok_s": gen[0] / wall,
            "ttft_p50_ms": statistics.median(ttft),
            "ttft_p99_ms": p99(ttft),
            "itl_p50_ms": statistics.median(itl),
            "itl_p99_ms": p99(itl),
            "contexts": lens,
        }
        return row

    row = run(paged, turns, "paged")
    st = paged.kv_stats()
    # what must be held: one system prompt and every session's own turns (its context minus the prompt)
    need = system + sum(x - system for x in row["contexts"])
    row.update(
        {
            "pages_used": st["pages_used"],
            "tokens_held": st["pages_used"] * st["page_size"],
            "tokens_needed": need,
            "held_over_needed": st["pages_used"] * st["page_size"] / need,
            "prefix_hit_rate": st["prefix_hit_tokens"] / max(st["prefix_lookup_tokens"], 1),
        }
    )
    RESULTS.setdefault("agents", []).append({k: v for k, v in row.items() if k != "contexts"})
    log(json.dumps(RESULTS["agents"][-1]))
    if slots is not None:
        base = run(slots, base_turns, "serial")
        RESULTS["agents"].append({k: v for k, v in base.items() if k != "contexts"})
        log(json.dumps(RESULTS["agents"][-1]))


def _last_prefill_graph_ms(model: Any, n: int) -> float | None:
    """The GPU time of one replay of the prefill graph a turn of `n` tokens used, with the inputs of the
    last turn (it rewrites the same keys and values): what of the TTFT is the GPU's."""
    runner = getattr(model.executor, "runner", None)
    graphs = getattr(runner, "_graphs", {})
    m = next((m for m in getattr(runner, "_graph_chunks", []) if m >= n), None)
    g = graphs.get((1, m))
    if DEV != "cuda" or g is None:
        return None
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        a.record()
        g.graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def growing(name: str, model: Any, start: int, end: int, step: int) -> None:
    s = model.session()
    ctx = prompts(1, start, 11)[0]
    s.generate(ctx, max_new_tokens=1)
    rows = []
    while len(ctx) + step + 32 <= end:
        ctx = ctx + prompts(1, step, len(ctx))[0]
        r = s.generate(ctx, max_new_tokens=32, speculative="off", temperature=0)
        rows.append(
            {
                "context": len(ctx),
                "reused": r.stats.reused_tokens,
                "ttft_ms": r.stats.ttft_s * 1e3,
                "decode_tok_s": r.stats.decode_tok_s,
            }
        )
        ctx = ctx + r.tokens
    t = [r["ttft_ms"] for r in rows[1:]]  # the first turn compiles nothing but may warm caches
    d = [r["decode_tok_s"] for r in rows[1:]]
    summary = {
        "shape": name,
        "turns": len(rows),
        "ttft_p50_ms": statistics.median(t),
        "ttft_p99_ms": p99(t),
        "decode_min": min(d),
        "decode_max": max(d),
        "decode_spread": (max(d) - min(d)) / statistics.median(d),
        "rows": rows,
        "prefill_graph_ms": _last_prefill_graph_ms(model, step + 1),
    }
    RESULTS.setdefault("growing", []).append(summary)
    log(json.dumps({k: v for k, v in summary.items() if k != "rows"}))
    if DEV == "cuda" and len(ctx) + step + 2 <= model.spec.context_length:
        _profile_turn(s, ctx + prompts(1, step, len(ctx))[0])
    s.close()


def _profile_turn(session: Any, ctx: list[int]) -> None:
    """One more turn (1 token) under torch.profiler: the host's ops by self time and the GPU's kernels, and
    a Chrome trace in $OUT (where a turn's TTFT goes between the host and the prefill graph)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = session.generate(ctx, max_new_tokens=1, temperature=0)
    prof.export_chrome_trace(str(OUT / "growing_turn_trace.json"))
    log(f"profiled turn: TTFT {r.stats.ttft_s * 1e3:.2f} ms (profiler on)")
    log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    log(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--sections", default="batch1,throughput")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--system", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--base-turns", type=int, default=1)
    ap.add_argument("--grow", default="7900,9000,64")
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
            if "agents" in sections:
                slots = None
                if "serial" in sections:
                    slots = onnxgen.load(str(pkg), backend="native", device=DEV, paged=False, max_running=1)
                agents(name, paged, slots, args.agents, args.system, args.turns, args.base_turns)
                if slots is not None:
                    slots.close()
                    del slots
            if "growing" in sections:
                a, b, c = (int(x) for x in args.grow.split(","))
                growing(name, paged, a, b, c)
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
            print(
                f"| {r['shape']} | {tag} | {r[f'{tag}_decode_tok_s']:.1f} | {r[f'{tag}_ttft_4096_ms']:.1f} | "
                f"{r[f'{tag}_turn64_on_8000_ms']:.2f} |"
            )
    print("\n| shape | concurrent | aggregate decode tok/s | ms per step | weights floor ms | prefill s |")
    print("|---|---|---|---|---|---|")
    for r in RESULTS["throughput"]:
        print(
            f"| {r['shape']} | {r['batch']} | {r['agg_tok_s']:.0f} | {r['step_ms']:.2f} | {r['weights_floor_ms']:.2f} | "
            f"{r['prefill_s']:.2f} |"
        )
    if RESULTS.get("agents"):
        print(
            "\n| shape | engine | agents x turns | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | tokens held / needed | prefix hits |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in RESULTS["agents"]:
            held = (
                f"{r['tokens_held']} / {r['tokens_needed']} ({r['held_over_needed']:.2f}x)"
                if "tokens_held" in r
                else "-"
            )
            hits = f"{r['prefix_hit_rate']:.1%}" if "prefix_hit_rate" in r else "-"
            print(
                f"| {r['shape']} | {r['engine']} | {r['agents']} x {r['turns']} | {r['tok_s']:.0f} | "
                f"{r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | "
                f"{held} | {hits} |"
            )
    for r in RESULTS.get("growing", []):
        print(
            f"\ngrowing {r['shape']}: {r['turns']} turns, TTFT p50 {r['ttft_p50_ms']:.2f} ms, p99 {r['ttft_p99_ms']:.2f} ms, "
            f"decode {r['decode_min']:.1f}-{r['decode_max']:.1f} tok/s (spread {r['decode_spread']:.1%}); "
            f"the turn's prefill graph alone {r['prefill_graph_ms'] or 0:.2f} ms of GPU time"
        )
    for e in RESULTS["errors"]:
        print("ERROR", e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
