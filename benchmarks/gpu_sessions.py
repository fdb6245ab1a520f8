"""GPU sessions benchmark (H200, native backend, bf16 Llama-3-8B shape, random weights written on the host).

Measures, through the public API (onnxgen.load / Session.generate):
  1. TTFT of a 64-token turn on an 8192-token retained context (session reuse), vs a fresh 8k prefill;
  2. peak GPU memory beyond weights + KV during an 8192-token prefill at chunk sizes 256/512/1024/none,
     and the TTFT cost of each chunk size against none.
Prints a table last and writes JSON to --out.

    PYTHONPATH=src python3 benchmarks/gpu_sessions.py --pkg /tmp/og8b --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pkg", default="/tmp/og8b")
    ap.add_argument("--out", default=".")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--turn", type=int, default=64)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--layers", type=int, default=None, help="truncate the 8B shape (smoke tests)")
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny shape on the CPU: checks the script, measures nothing"
    )
    args = ap.parse_args()

    import torch

    import onnxgen
    from onnxgen.convert.synthetic import LLAMA_8B, SyntheticConfig, write_package

    device = "cpu" if args.tiny else "cuda"
    cfg = dataclasses.replace(SyntheticConfig() if args.tiny else LLAMA_8B, context_length=2 * args.context)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    pkg = Path(args.pkg)
    t = time.perf_counter()
    if not (pkg / "genai_config.json").exists():
        write_package(pkg, cfg)
    write_s = time.perf_counter() - t
    results: dict[str, object] = {"write_s": write_s, "shape": dataclasses.asdict(cfg)}
    cuda = device == "cuda"
    dev = torch.device(device)
    mem = torch.cuda.memory_allocated if cuda else (lambda *a: 0)
    sync = torch.cuda.synchronize if cuda else (lambda *a: None)
    sync()
    base0 = mem()
    t = time.perf_counter()
    eng = onnxgen.load(str(pkg), backend="native", device=device)
    load_s = time.perf_counter() - t
    weights = mem() - base0
    results |= {"load_s": load_s, "weight_bytes": weights}
    g = torch.Generator().manual_seed(0)
    vocab = eng.spec.vocab_size
    ctx = torch.randint(100, vocab - 1, (args.context,), generator=g).tolist()
    turns = [torch.randint(100, vocab - 1, (args.turn,), generator=g).tolist() for _ in range(args.runs + 1)]
    eng.generate(ctx[:128], max_new_tokens=4, reuse=False)  # warm-up (kernels, graphs)

    # 1. fresh 8k prefill vs a 64-token turn on the retained 8k context. Two engines on the same weights
    #    (decoders share the lowered program), run interleaved: prefill chunks as CUDA graphs (the
    #    default) and every prefill eager (graph_max_tokens=0, the previous behaviour).
    fresh = [eng.generate(ctx, max_new_tokens=1, reuse=False).stats.ttft_s for _ in range(3)]
    eager = onnxgen.load(str(pkg), backend="native", device=device, graph_max_tokens=0)  # no prefill graphs
    variants = {"graphs": eng, "eager": eager}
    sessions = {k: e.session() for k, e in variants.items()}
    firsts = {k: s.generate(ctx, max_new_tokens=1) for k, s in sessions.items()}
    ttfts: dict[str, list[float]] = {k: [] for k in variants}
    walls: dict[str, list[float]] = {k: [] for k in variants}
    reused: list[int] = []
    for tk in turns:
        for k, s in sessions.items():
            sync()
            t = time.perf_counter()
            r = s.generate(ctx + tk, max_new_tokens=1)
            walls[k].append(time.perf_counter() - t)
            ttfts[k].append(r.stats.ttft_s)
            if k == "graphs":
                reused.append(r.stats.reused_tokens)
    # the first two turns of a shape run eagerly and then capture; report the rest
    ttft_ms = {k: statistics.median(v[2:]) * 1000 for k, v in ttfts.items()}
    wall_ms = {k: statistics.median(v[2:]) * 1000 for k, v in walls.items()}
    # the same turn as a bare decoder forward (no engine around it), for where the time goes
    bare: dict[str, float] = {}
    for k, s in sessions.items():
        dec = s._retained.decoder  # benchmark introspection
        xs = []
        for tk in turns[:5]:
            dec.rewind_to(args.context)
            sync()
            t = time.perf_counter()
            int(dec.forward(tk, args.context).argmax())
            xs.append(time.perf_counter() - t)
        bare[k] = statistics.median(xs) * 1000
    decode = sessions["graphs"].generate(
        ctx + turns[0], max_new_tokens=64, speculative="off", temperature=0.0
    )
    results |= {
        "fresh_prefill_ttft_ms": statistics.median(fresh) * 1000,
        "turn_ttft_ms": ttft_ms["graphs"],
        "turn_ttft_eager_ms": ttft_ms["eager"],
        "turn_wall_ms": wall_ms,
        "turn_bare_forward_ms": bare,
        "turn_ttft_all_ms": {k: [x * 1000 for x in v] for k, v in ttfts.items()},
        "turn_reused_tokens": reused,
        "first_prefill_ttft_ms": {k: r.stats.ttft_s * 1000 for k, r in firsts.items()},
        "decode_tok_s_at_8k": decode.stats.decode_tok_s,
        "graph_info": sessions["graphs"]._retained.decoder.info,
    }
    for s in sessions.values():
        s.close()
    eager.close()
    eng.close()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    # 2. chunked prefill: activation peak beyond weights + KV
    kv_bytes = eng.spec.kv_bytes_per_token * args.context
    kv_cap_bytes = eng.spec.kv_bytes_per_token * (1 << (args.context - 1).bit_length())
    chunk_rows = []
    for chunk, gmax in ((256, 1024), (512, 0), (512, 1024), (1024, 0), (1024, 1024), (None, 1024)):
        gc.collect()
        base_v = (
            mem()
        )  # before this engine's weights (shared with any live engine of the package), KV and graphs
        e = onnxgen.load(str(pkg), backend="native", device=device, chunk_size=chunk, graph_max_tokens=gmax)
        weights_v = mem() - base_v
        e.generate(ctx[:64], max_new_tokens=1, reuse=False)
        times, peaks = [], []
        for i in range(7):  # the first two runs of a prefill shape run eagerly / capture: not timed
            gc.collect()
            sync()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            r = e.generate(ctx, max_new_tokens=1, reuse=False)
            sync()
            if i >= 2:
                # beyond the weights and the KV buffers (capacity 8192): CUDA-graph pools count as activations
                peaks.append(
                    torch.cuda.max_memory_allocated(dev) - base_v - weights_v - kv_cap_bytes if cuda else 0
                )
                times.append(r.stats.ttft_s)
        chunk_rows.append(
            {
                "chunk": chunk or "none",
                "graph_max_tokens": gmax,
                "ttft_ms": statistics.median(times) * 1000,
                "activation_peak_gb": max(peaks) / 1e9,
            }
        )
        e.close()
        del e
    none_ttft = chunk_rows[-1]["ttft_ms"]
    for row in chunk_rows:
        row["ttft_vs_none"] = row["ttft_ms"] / none_ttft
    results["chunks"] = chunk_rows
    results["kv_bytes_8k"] = kv_bytes

    Path(args.out, "gpu_sessions.json").write_text(json.dumps(results, indent=2))
    print(
        f"\n8B-shape bf16 package written in {write_s:.1f} s; load {load_s:.1f} s; weights {weights / 1e9:.2f} GB; "
        f"KV of {args.context} tokens {kv_bytes / 1e9:.2f} GB"
    )
    print(f"fresh {args.context}-token prefill TTFT: {results['fresh_prefill_ttft_ms']:.1f} ms")
    print(
        f"{args.turn}-token turn on a retained {args.context}-token context (median of {len(turns) - 2}; "
        f"reused {reused[-1]} tokens):"
    )
    for k in ("graphs", "eager"):
        print(
            f"  prefill {k:6s}: TTFT {ttft_ms[k]:.1f} ms, generate() wall {wall_ms[k]:.1f} ms, "
            f"bare forward+argmax {bare[k]:.1f} ms"
        )
    print(f"decode at {args.context} context: {results['decode_tok_s_at_8k']:.1f} tok/s\n")
    print(
        "| chunk | graph_max_tokens | TTFT ms (8k prefill) | vs none | activation peak beyond weights+KV (GB) |"
    )
    print("|---|---|---|---|---|")
    for row in chunk_rows:
        print(
            f"| {row['chunk']} | {row['graph_max_tokens']} | {row['ttft_ms']:.1f} | {row['ttft_vs_none']:.2f}x "
            f"| {row['activation_peak_gb']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
