"""Each kernel of a batch-1 decode step, in order, against the bandwidth floor (issue 13): where the small
shapes' step still loses its time once the host is out of the way.

    PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 ONNXGEN_PDL=0 python3 benchmarks/gpu_kernel_table.py \
        --tokenizer DIR [--shapes 0.5b,1b]

For each shape (builder-made bf16 package of a random checkpoint, `gpu_parity.package`): a 512-token prompt
is prefilled and 16 tokens decoded through the public API (captures and per-shape choices as usual), then
the batch-1 one-step decode graph the decoding replayed is replayed 50 times under torch.profiler. The
device's kernels are taken in order (the graph runs the same sequence every replay) and each position's
median duration and the median gap before it are kept. The sequence is cut into periods at each paged
attention launch (attention, its combine, o-proj, [norm], gate/up, down, [norm], the next layer's QKV),
and each period position's median over the layers is printed with, for GEMVs, the weight bytes it reads
(the shape's o, gate/up, down and QKV products, in that order), GB/s and the time the copy bandwidth
(measured first) would take; then the kernels before the first period and after the last. Run it with
`ONNXGEN_PDL=0` for durations that are the kernels' own: with programmatic dependent launch a kernel starts
before its predecessor ends and its time includes that wait (the graph's replay time is printed either
way; compare the two runs' replay times for what the overlap buys). A JSON goes to $OUT.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _util import copy_bandwidth, short  # noqa: E402

OUT = Path(os.environ.get("OUT") or "/tmp/gpu_kernel_table_out")
OUT.mkdir(parents=True, exist_ok=True)
REPS = 50


def sequence(graph: Any) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The kernels of one replay of `graph` in order: names, median duration and median gap before each (µs)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    evs = sorted(
        (e for e in trace["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"),
        key=lambda e: float(e["ts"]),
    )
    n = len(evs) // REPS
    assert n * REPS == len(evs), f"{len(evs)} kernels in {REPS} replays"
    names = [short(e["name"]) for e in evs[:n]]
    ts = np.array([float(e["ts"]) for e in evs]).reshape(REPS, n)
    dur = np.array([float(e["dur"]) for e in evs]).reshape(REPS, n)
    gap = np.zeros_like(ts)
    gap[:, 1:] = ts[:, 1:] - (ts[:, :-1] + dur[:, :-1])
    return names, np.median(dur, 0), np.median(gap, 0)


def weights(name: str) -> dict[str, float]:
    """MB each product of the shape reads (bf16)."""
    from onnxgen.convert.reference import SHAPES

    sh = SHAPES[name]
    h, hd = sh.hidden_size, sh.hidden_size // sh.num_heads
    q, kv = sh.num_heads * hd, sh.num_kv_heads * hd
    mb = {
        "o": q * h,
        "gate/up": 2 * h * sh.intermediate_size,
        "down": sh.intermediate_size * h,
        "qkv": h * (q + 2 * kv),
        "lm_head": sh.vocab_size * h,
    }
    return {k: v * 2 / 1e6 for k, v in mb.items()}


def table(name: str, names: list[str], dur: np.ndarray, gap: np.ndarray, bw: float) -> dict[str, Any]:
    mb = weights(name)
    starts = [i for i, k in enumerate(names) if k.startswith("paged_attn")]
    periods = [list(range(a, b)) for a, b in itertools.pairwise(starts)]
    shapes = {tuple(names[i] for i in p) for p in periods}
    lines = [
        f"\n{name}: {len(names)} kernels a step, {len(starts)} attention launches; "
        f"{sum(dur):.1f} µs of kernels, {sum(gap[1:]):.1f} µs of gaps between them"
    ]
    if len(shapes) != 1:
        lines.append(f"  periods differ ({len(shapes)} kinds): medians over the most common one")
    common = max(shapes, key=lambda s: sum(tuple(names[i] for i in p) == s for p in periods))
    same = [p for p in periods if tuple(names[i] for i in p) == common]
    per = np.median(np.array([[dur[i] for i in p] for p in same]), 0)
    pgap = np.median(np.array([[gap[i] for i in p] for p in same]), 0)
    lines.append(f"one layer (median over {len(same)} periods), µs; gap = idle before the kernel")
    lines.append("| kernel | µs | gap µs | weights MB | GB/s | floor µs |")
    lines.append("|---|---|---|---|---|---|")
    order = iter(["o", "gate/up", "down", "qkv"])
    rows = []
    for k, d, g in zip(common, per, pgap, strict=True):
        w = mb.get(next(order, ""), 0.0) if k.startswith("gemv") else 0.0
        rows.append({"kernel": k, "us": float(d), "gap_us": float(g), "mb": w})
        extra = f"{w:.2f} | {w / d * 1e3:.0f} | {w * 1e12 / bw:.2f}" if w else " | | "
        lines.append(f"| {k} | {d:.2f} | {g:.2f} | {extra} |")
    lines.append(
        f"| (layer) | {per.sum():.2f} | {pgap.sum():.2f} | {sum(r['mb'] for r in rows):.2f} | | "
        f"{sum(r['mb'] for r in rows) * 1e12 / bw:.2f} |"
    )
    head = list(range(starts[0])) if starts else []
    tail = list(range(starts[-1], len(names))) if starts else list(range(len(names)))
    lines.append("before the first attention and from the last one on, µs")
    lines.append("| kernel | µs | gap µs | GB/s (lm_head) |")
    lines.append("|---|---|---|---|")
    last_gemv = max((i for i in tail if names[i].startswith("gemv")), default=-1)
    for i in head + tail:
        bwcol = (
            f"{mb['lm_head'] / dur[i] * 1e3:.0f} (floor {mb['lm_head'] * 1e12 / bw:.1f} µs)"
            if i == last_gemv
            else ""
        )
        lines.append(f"| {names[i]} | {dur[i]:.2f} | {gap[i]:.2f} | {bwcol} |")
    print("\n".join(lines), flush=True)
    return {
        "layer": rows,
        "edges": [{"kernel": names[i], "us": float(dur[i]), "gap_us": float(gap[i])} for i in head + tail],
        "kernels": len(names),
        "kernel_us": float(sum(dur)),
        "gap_us": float(sum(gap[1:])),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--shapes", default="0.5b,1b")
    args = ap.parse_args()
    import gpu_decode
    import onnxgen
    from gpu_parity import package
    from onnxgen.backends.native import kernels

    bw = copy_bandwidth()
    print(
        f"copy bandwidth {bw / 1e12:.2f} TB/s; programmatic dependent launch {'on' if kernels.PDL else 'off'}"
    )
    prompt = np.random.default_rng(1).integers(100, 32000, 512).tolist()
    out: dict[str, Any] = {"pdl": kernels.PDL, "bw": bw}
    for name in args.shapes.split(","):
        _, pkg = package(name, args.tokenizer)
        m = onnxgen.load(str(pkg), backend="native", device="cuda")
        toks = m.generate(prompt, max_new_tokens=16, speculative="off", reuse=False, temperature=0).tokens
        runner = m.executor.runner
        kv = len(prompt) + len(toks)
        replay = statistics.median(gpu_decode.replay_ms(runner, kv) for _ in range(3))
        g = gpu_decode.decode_graph(runner, kv)
        one = statistics.median(gpu_decode.replay_ms(runner, kv, multi=False) for _ in range(3))
        names, dur, gap = sequence(g.graph)
        out[name] = table(name, names, dur, gap, bw) | {"replay_ms": replay, "one_step_ms": one}
        print(
            f"{name}: decode graph {one:.4f} ms a one-step replay, {replay:.4f} ms a step in the run's "
            f"graph; floor {gpu_decode.floor_ms(name, kv, bw):.4f} ms",
            flush=True,
        )
        m.close()
    (OUT / "gpu_kernel_table.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
