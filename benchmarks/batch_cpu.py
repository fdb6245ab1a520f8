"""Continuous batching on the CPU: the default model (SmolLM2-135M-Instruct) with 8 concurrent clients
against the same 8 requests one after another, in one run.

    .venv/bin/python benchmarks/batch_cpu.py [--clients 8] [--tokens 64] [--rounds 5]

Contenders, interleaved (order alternating each round), median of `rounds`:
- native, concurrent: 8 threads call `Model.generate` at once on the paged engine (batched steps);
- native, serial: the same 8 requests one after another on the same engine;
- ort, serial: the ort backend (one decoder per request), one after another (the CPU default).
Every request is a distinct chat prompt, greedy, `reuse=False` (no prefix reuse between rounds), torch and
onnxruntime with the same thread count. Aggregate tok/s = generated tokens / wall time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

QUESTIONS = [
    "Name three rivers in France.",
    "Write a haiku about autumn.",
    "What is the capital of Japan?",
    "List three French cheeses.",
    "Give two tips for learning to cook.",
    "Explain what a CPU does.",
    "Name two primary colours.",
    "What is 17 times 23?",
    "Describe a cat in one sentence.",
    "Suggest a name for a bakery.",
    "What does DNA stand for?",
    "Name a famous bridge.",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    import onnxgen
    from _util import interleave, machine, table

    torch.set_num_threads(args.threads)
    native = onnxgen.load(backend="native", max_running=args.clients)
    ort = onnxgen.load(backend="ort", threads=args.threads)
    msgs = [[{"role": "user", "content": q}] for q in QUESTIONS[: args.clients]]

    def serial(model):
        def go():
            t0 = time.perf_counter()
            n = sum(
                model.generate(
                    m, max_new_tokens=args.tokens, temperature=0, reuse=False
                ).stats.generated_tokens
                for m in msgs
            )
            return n / (time.perf_counter() - t0)

        return go

    def concurrent():
        with ThreadPoolExecutor(args.clients) as ex:
            t0 = time.perf_counter()
            rs = list(
                ex.map(
                    lambda m: native.generate(m, max_new_tokens=args.tokens, temperature=0, reuse=False), msgs
                )
            )
            return sum(r.stats.generated_tokens for r in rs) / (time.perf_counter() - t0)

    contenders = {
        "native, concurrent": concurrent,
        "native, serial": serial(native),
        "ort, serial": serial(ort),
    }
    for go in contenders.values():  # warm-up
        go()
    runs = interleave(args.rounds, contenders)
    base = statistics.median(runs["native, serial"])
    rows = [
        [
            k,
            f"{statistics.median(v):.1f}",
            f"{min(v):.1f}-{max(v):.1f}",
            f"{statistics.median(v) / base:.2f}x",
        ]
        for k, v in runs.items()
    ]
    print(f"{machine()}; {args.clients} clients x {args.tokens} tokens; median of {args.rounds}")
    print(table(rows, ["contender", "aggregate tok/s", "range", "vs native serial"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
