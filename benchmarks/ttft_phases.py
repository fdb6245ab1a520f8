"""Where a growing conversation's time to first token goes on the host: one session grows in `--step`-token
turns (random ids) from `--start` tokens, and each turn's TTFT is split into the engine's phases by
wrapping them with timers (submit's prompt check, the scheduler, the executor's run and its graph filling,
the first token's choice, the KV's finish), plus the time Python's garbage collector ran during the turn.

    PYTHONPATH=src python3 benchmarks/ttft_phases.py --package DIR [--device cuda] [--start 7900]
        [--end 9000] [--step 64] [--new 1,32] [--warm 0,64]

`--package`: a package folder, or a shape of `gpu_parity.py` (e.g. 8b16k, built there with `--tokenizer`).
For each (answer length in `--new`, concurrent warm-up requests in `--warm`), in a fresh session: `warm`
requests of 512 tokens + 128 generated run at once first (the state a server is in after load; 0: none),
then the turns. Per phase: the median µs per turn; the phases overlap where one calls another (run
contains the graph filling, which contains the graph's replay call and event waits). A table prints last.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

SPENT: dict[str, float] = defaultdict(float)


def timed(cls: type, name: str, label: str) -> None:
    """Wrap `cls.name` so that each call adds its wall time to SPENT[label] (the engine's threads run one
    step at a time, so per-turn sums are exact for a single session)."""
    fn = getattr(cls, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            SPENT[label] += time.perf_counter() - t

    static = isinstance(inspect.getattr_static(cls, name), staticmethod)
    setattr(cls, name, staticmethod(wrapper) if static else wrapper)


def instrument() -> None:
    from onnxgen.engine.engine import Engine
    from onnxgen.engine.paged import PagedKV
    from onnxgen.engine.request import Request
    from onnxgen.engine.scheduler import Scheduler
    from onnxgen.kv.manager import KVManager

    timed(Engine, "encode_prompt", "encode_prompt")
    timed(Engine, "submit", "submit")
    timed(Scheduler, "schedule", "schedule")
    timed(KVManager, "open", "kv_open")
    timed(PagedKV, "run", "run")
    timed(Engine, "_sample", "sample")
    timed(Request, "accept", "accept")
    timed(PagedKV, "finish", "finish")
    try:
        import torch

        from onnxgen.backends.native.runner import NativeRunner

        timed(NativeRunner, "_run_graph", "run_graph")
        timed(torch.cuda.CUDAGraph, "replay", "replay")
        timed(torch.cuda.Event, "synchronize", "event_sync")
    except ImportError:
        pass
    state = {"t": 0.0}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            state["t"] = time.perf_counter()
        else:
            SPENT["gc"] += time.perf_counter() - state["t"]

    gc.callbacks.append(on_gc)


def prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, min(vocab, 49000), (length,), generator=g).tolist() for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", required=True)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--start", type=int, default=7900)
    ap.add_argument("--end", type=int, default=9000)
    ap.add_argument("--step", type=int, default=64)
    ap.add_argument("--new", default="1,32")
    ap.add_argument("--warm", default="0,64")
    ap.add_argument(
        "--cprofile", type=int, default=0, help="print the N functions of most own time (cProfile)"
    )
    args = ap.parse_args()
    import onnxgen

    pkg = Path(args.package)
    if not pkg.is_dir():
        import gpu_parity

        gpu_parity.DEV = args.device
        _, pkg = gpu_parity.package(args.package, args.tokenizer)
    warms = [int(x) for x in args.warm.split(",")]
    model = onnxgen.load(str(pkg), backend="native", device=args.device, max_running=max(1, *warms))
    vocab = model.spec.vocab_size
    instrument()
    prof = None
    if args.cprofile:  # the phases' times include its overhead: a separate run
        import cProfile

        prof = cProfile.Profile()
    rows = []
    for new in (int(x) for x in args.new.split(",")):
        for warm in warms:
            if warm:
                with ThreadPoolExecutor(warm) as ex:
                    list(
                        ex.map(
                            lambda p: model.generate(p, max_new_tokens=128, temperature=0, reuse=False),
                            prompts(warm, 512, 7, vocab),
                        )
                    )
            s = model.session()
            ctx = prompts(1, args.start, 11 + new + warm, vocab)[0]
            s.generate(ctx, max_new_tokens=1)
            per: dict[str, list[float]] = defaultdict(list)
            turn = 0
            while len(ctx) + args.step + new <= args.end:
                ctx = ctx + prompts(1, args.step, len(ctx) + warm, vocab)[0]
                SPENT.clear()
                if prof is not None and turn:
                    prof.enable()
                r = s.generate(ctx, max_new_tokens=new, temperature=0)
                if prof is not None:
                    prof.disable()
                ctx = ctx + r.tokens
                turn += 1
                if turn == 1:  # the first turn may still warm caches
                    continue
                per["ttft"].append(r.stats.ttft_s)
                for k in (
                    "encode_prompt",
                    "submit",
                    "schedule",
                    "kv_open",
                    "run",
                    "run_graph",
                    "sample",
                    "accept",
                    "finish",
                    "replay",
                    "event_sync",
                    "gc",
                ):
                    per[k].append(SPENT.get(k, 0.0))
            s.close()
            row = {"new": new, "warm": warm, "turns": len(per["ttft"])}
            row.update({k: statistics.median(v) * 1e6 for k, v in per.items()})
            row["ttft_p99"] = (
                sorted(per["ttft"])[min(len(per["ttft"]) - 1, int(0.99 * len(per["ttft"])))] * 1e6
            )
            row["gc_max"] = max(per["gc"]) * 1e6
            rows.append(row)
            print(row, flush=True)
    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
    cols = [
        "new",
        "warm",
        "turns",
        "ttft",
        "ttft_p99",
        "encode_prompt",
        "submit",
        "schedule",
        "kv_open",
        "run",
        "run_graph",
        "replay",
        "event_sync",
        "sample",
        "accept",
        "finish",
        "gc",
        "gc_max",
    ]
    print(
        f"\nTTFT phases (µs, median per turn; {model.spec.path.name}, {args.device}, {args.start}..{args.end} "
        f"in {args.step}-token turns)"
    )
    print(" | ".join(cols))
    for r in rows:
        print(
            " | ".join(
                f"{r.get(c, 0):.0f}" if isinstance(r.get(c, 0), float) else str(r.get(c)) for c in cols
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
