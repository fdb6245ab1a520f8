"""Shared helpers for the benchmark scripts: medians, interleaving, onnxruntime-genai setup, tables."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def copy_bandwidth() -> float:
    """This GPU's device-to-device copy bandwidth in bytes/s (read + write), median of 10 copies of 2 GiB
    after 2 warm-up copies: the ceiling a decode step's bytes are measured against."""
    import torch

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


def graph_replay_ms(fn: Callable[[], Any], reps: int = 20) -> tuple[float, Any]:
    """GPU milliseconds of `fn`'s launches captured in one CUDA graph (median of `reps` replays, each timed
    with CUDA events after a warm-up run and replay), and what the captured `fn` returned."""
    import torch

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), out


def short(name: str) -> str:
    """A kernel's name without its template arguments (enough to tell the kinds apart)."""
    return name.split("(")[0].split("<")[0][:48]


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def interleave(runs: int, contenders: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
    """Run each contender once per round, alternating the order each round; `runs` rounds."""
    out: dict[str, list[Any]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(runs):
        for name in names if r % 2 == 0 else reversed(names):
            out[name].append(contenders[name]())
    return out


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: median([s[k] for s in samples]) for k in samples[0]}


def genai_model(path: str, threads: int | None) -> Any:
    """An onnxruntime-genai Model on `path` with `threads` intra-op threads (same as onnxgen's; None: its
    default)."""
    import onnxruntime_genai as og

    cfg = og.Config(path)
    if threads:
        cfg.overlay(
            json.dumps(
                {
                    "model": {
                        "decoder": {
                            "session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
                        }
                    }
                }
            )
        )
    return og.Model(cfg)


def genai_generate(model: Any, prompt_ids: list[int], new_tokens: int) -> dict[str, float]:
    """Greedy generation with onnxruntime-genai: TTFT (append + first token) and decode tok/s."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt_ids) + new_tokens + 1)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(prompt_ids)
    gen.generate_next_token()
    gen.get_next_tokens()
    t1 = time.perf_counter()
    n = 1
    while n < new_tokens and not gen.is_done():
        gen.generate_next_token()
        gen.get_next_tokens()
        n += 1
    t2 = time.perf_counter()
    return {"ttft_s": t1 - t0, "decode_tok_s": (n - 1) / (t2 - t1) if n > 1 else 0.0, "tokens": n}


def machine() -> str:
    import os

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])
