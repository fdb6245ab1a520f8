"""Where the device waits during batch-1 decoding (issue 13): GPU idle time between kernels, and runs' length.

    PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_gaps.py --tokenizer DIR \
        [--shapes 0.5b,1b] [--decode-steps 8,8s,8n,16]

For each shape (builder-made bf16 package of a random checkpoint, `gpu_parity.package`), through the public
API (paged engine, greedy, a 512-token prompt, 128 new tokens, `speculative="off"`):
- decode tok/s (`Stats.decode_tok_s`) for each `decode_steps` value (steps per host round trip), interleaved,
  median of 5, with the time to the first token of that prompt and of a 16-token one; suffixes
  (`configure`): `s`, each run's first replay one step deep, `n`, decoding launched only once the host has
  read the prompt's token (both as before 2026-12-06), `f`, the run launched before that read full length
  (as before the fourteenth session; by default one step), `w`, each run read whole (not in parts of 4 steps);
- replies that end by EOS: the wall time of `generate` with EOS set to a token of the greedy reply at one of
  up to 12 positions between 48 and 111 (its first occurrence), mean over the positions, interleaved;
- one generation under torch.profiler at each `decode_steps` value: from the first token on (a CPU-side
  marker set by `on_token`), the device's busy time (the union of its kernels and copies) and idle time per
  token, and the idle gaps between consecutive device events summed by their neighbours (which kernel or
  copy ends before the gap and which starts after it), the largest first. The profiler adds host time per
  launch, so its idle figures bound what the host costs from above; the tok/s rows are without it.
The tables print last; a JSON of every number goes to $OUT.
"""

from __future__ import annotations

import argparse
import collections
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

from _util import short  # noqa: E402

OUT = Path(os.environ.get("OUT") or "/tmp/gpu_gaps_out")
OUT.mkdir(parents=True, exist_ok=True)
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
GREEDY = {
    "speculative": "off",
    "reuse": False,
    "stop": [],
    "temperature": 0,
}  # every timed generation's settings


def log(*a: Any) -> None:
    print(" ".join(str(x) for x in a), flush=True)


def gaps(trace: dict[str, Any], t0: float, tokens: int) -> dict[str, Any]:
    """Device busy/idle time after host time `t0` (µs, the trace's clock) and the idle gaps by neighbours."""
    evs = sorted(
        (
            e
            for e in trace["traceEvents"]
            if e.get("cat") in DEVICE_CATS and e.get("ph") == "X" and float(e["ts"]) >= t0
        ),
        key=lambda e: float(e["ts"]),
    )
    if len(evs) < 2:
        return {"events": len(evs)}
    busy, end, prev = 0.0, float(evs[0]["ts"]), evs[0]
    start = end
    by = collections.Counter()
    count = collections.Counter()
    for e in evs:
        ts, dur = float(e["ts"]), float(e.get("dur", 0))
        if ts > end:
            key = f"{short(prev['name'])} -> {short(e['name'])}"
            by[key] += ts - end
            count[key] += 1
        lo = max(ts, end)
        if ts + dur > lo:
            busy += ts + dur - lo
        if ts + dur >= end:
            end, prev = ts + dur, e
    window = end - start
    top = [(k, by[k], count[k]) for k, _ in by.most_common(8)]
    return {
        "events": len(evs),
        "window_us": window,
        "busy_us": busy,
        "idle_us": window - busy,
        "idle_us_per_token": (window - busy) / tokens,
        "busy_us_per_token": busy / tokens,
        "top": top,
    }


def configure(m: Any, k: str) -> None:
    """`decode_steps` of `k` (e.g. "8"), else the defaults; suffixes: "s", each run's first replay one step
    deep (`runner.RUN_FIRST_MULTI` off); "n", no first run launched behind the prompt's step (`Model.launch_first`
    off: decoding starts once the host has read the first token); "f", that first run full length
    (`Model.first_run_steps` 0; by default one step: the least to launch before the first token is read); "w",
    each run read whole (`runner.PART_STEPS` 0; by default in parts of 4 steps)."""
    from onnxgen.backends.native import runner

    m.decode_steps = int(k.rstrip("snfw"))
    runner.RUN_FIRST_MULTI = "s" not in k
    m.launch_first = "n" not in k
    m.first_run_steps = 0 if "f" in k else 1
    runner.PART_STEPS = 0 if "w" in k else 4


def profiled(m: Any, prompt: list[int], k: str) -> dict[str, Any]:
    """One generation at `configure(m, k)` under torch.profiler, read from its first token on."""
    from torch.profiler import ProfilerActivity, profile, record_function

    configure(m, k)
    marks: list[Any] = []

    def first(_piece: str) -> None:
        if not marks:
            with record_function("onnxgen_first_token") as r:
                marks.append(r)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("onnxgen_generate"):
            pass
        res = m.generate(prompt, max_new_tokens=128, on_token=first, **GREEDY)
        m.settle()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    t0 = min(float(e["ts"]) for e in trace["traceEvents"] if e.get("name") == "onnxgen_first_token")
    out = gaps(trace, t0, res.stats.generated_tokens - 1)
    out["before_first"] = host_calls(trace, t0)
    return out


def host_calls(trace: dict[str, Any], t0: float) -> list[tuple[str, float, int]]:
    """The host's CUDA runtime calls of the generation before its first token (time `t0`), summed by name
    (µs in all under the profiler, count), the largest first: what the host does before the first token."""
    start = min(float(e["ts"]) for e in trace["traceEvents"] if e.get("name") == "onnxgen_generate")
    by: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for e in trace["traceEvents"]:
        if e.get("cat") == "cuda_runtime" and e.get("ph") == "X" and start <= float(e["ts"]) < t0:
            by[e["name"]] += float(e.get("dur", 0))
            count[e["name"]] += 1
    return [(k, by[k], count[k]) for k, _ in by.most_common(8)]


def eos_latency(m: Any, prompt: list[int], steps: list[str]) -> tuple[dict[str, float], list[int]]:
    """Replies that end by EOS: the greedy reply's tokens at up to 12 positions in 48..111 (first occurrences,
    spread) made EOS in turn; per `decode_steps` value the mean wall time of `generate` over them (ms; each
    position's contenders interleaved, the previous reply's trailing run settled outside the timing), and
    the positions. Every contender must stop at the same token."""
    import time

    configure(m, steps[0])
    m.settle()
    kw = {"max_new_tokens": 128, **GREEDY}
    ref = m.generate(prompt, **kw).tokens
    firsts = [i for i in range(48, min(112, len(ref))) if ref[i] not in ref[:i]]
    at = firsts[:: max(1, len(firsts) // 12)][:12]
    saved = m.eos_token_ids
    times: dict[str, list[float]] = {k: [] for k in steps}
    try:
        for i in at:
            m.eos_token_ids = (ref[i],)
            for k in steps:
                configure(m, k)
                m.settle()
                t = time.perf_counter()
                res = m.generate(prompt, **kw)
                times[k].append(time.perf_counter() - t)
                assert res.tokens == ref[: i + 1], f"{k}: stopped elsewhere"
    finally:
        m.eos_token_ids = saved
        m.settle()
    return {k: 1e3 * statistics.fmean(v) for k, v in times.items() if v}, at


def run_shape(name: str, tokenizer: Path, steps: list[str]) -> dict[str, Any]:
    import onnxgen
    from gpu_parity import package

    _, pkg = package(name, tokenizer)
    prompt = np.random.default_rng(1).integers(100, 32000, 512).tolist()
    m = onnxgen.load(str(pkg), backend="native", device="cuda")
    m.generate(prompt[:64], max_new_tokens=16, speculative="off", reuse=False, temperature=0)  # warm-up
    tps: dict[str, list[float]] = {k: [] for k in steps}
    ttft: dict[str, list[float]] = {k: [] for k in steps}  # ms: the 512-token prompt's, then a 16-token one's
    ttft16: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(5):
        for k in steps:
            configure(m, k)
            m.settle()
            res = m.generate(prompt, max_new_tokens=128, **GREEDY)
            tps[k].append(res.stats.decode_tok_s)
            ttft[k].append(res.stats.ttft_s * 1e3)
            m.settle()
            res = m.generate(prompt[:16], max_new_tokens=16, **GREEDY)
            ttft16[k].append(res.stats.ttft_s * 1e3)
    r: dict[str, Any] = {
        "shape": name,
        "tps": {k: statistics.median(v) for k, v in tps.items()},
        "runs": tps,
        "ttft_ms": {k: statistics.median(v) for k, v in ttft.items()},
        "ttft16_ms": {k: statistics.median(v) for k, v in ttft16.items()},
        "gaps": {},
    }
    r["eos_ms"], r["eos_at"] = eos_latency(m, prompt, steps)
    for k in steps:
        log(name, f"decode_steps={k}: {r['tps'][k]:.1f} tok/s ({', '.join(f'{x:.0f}' for x in tps[k])})")
        m.settle()
        r["gaps"][k] = profiled(m, prompt, k)
    m.close()
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="0.5b,1b")
    ap.add_argument("--tokenizer", type=Path, required=True, help="SmolLM2's tokenizer files")
    ap.add_argument("--decode-steps", default="8,8n,8s,16")
    a = ap.parse_args()
    steps = a.decode_steps.split(",")
    log(f"torch {torch.__version__}; {torch.cuda.get_device_name()}")
    rows = [run_shape(name, a.tokenizer, steps) for name in a.shapes.split(",")]
    (OUT / "gpu_gaps.json").write_text(json.dumps(rows, indent=2, default=str))
    for r in rows:
        for k in steps:
            log(f"\n{r['shape']}, decode_steps={k}: idle gaps by neighbours (µs in all, count)")
            for key, us, n in r["gaps"][k].get("top", []):
                log(f"  {us:9.1f} {n:5d}  {key}")
            log(
                f"{r['shape']}, decode_steps={k}: the host's CUDA calls before the first token (µs in all, count)"
            )
            for key, us, n in r["gaps"][k].get("before_first", []):
                log(f"  {us:9.1f} {n:5d}  {key}")
    log(
        "\n| shape | decode_steps | tok/s (median of 5) | profiled: busy µs/token | idle µs/token | "
        "tok/s of each run | TTFT ms, 512 / 16-token prompt | reply ending by EOS, mean ms |"
    )
    log("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for k in steps:
            g = r["gaps"][k]
            log(
                f"| {r['shape']} | {k} | {r['tps'][k]:.0f} | {g.get('busy_us_per_token', 0):.1f} | "
                f"{g.get('idle_us_per_token', 0):.1f} | {' / '.join(f'{x:.0f}' for x in r['runs'][k])} | "
                f"{r['ttft_ms'][k]:.2f} / {r['ttft16_ms'][k]:.2f} | {r['eos_ms'].get(k, 0):.2f} |"
            )
    for r in rows:
        log(f"{r['shape']}: EOS at positions {r['eos_at']}")


if __name__ == "__main__":
    main()
