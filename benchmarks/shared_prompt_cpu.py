"""Requests arriving together under one system prompt, on the CPU: the default model (SmolLM2-135M-Instruct),
native paged engine, `clients` threads submitting at once (distinct questions after one long system
prompt), greedy. Contenders, interleaved (order alternating each round), median of `rounds`, each round
under a fresh salt so that only sharing within the round counts:

- sharing: a request that arrives while another of the same identity is prefilling the same system prompt
  waits for it, then shares its computed pages while it still runs (`PagedKV.defer`, `KVManager.open(...,
  inflight)`);
- no sharing: the same engine with both turned off (what onnxgen did before): every request that arrives
  before the first one finishes computes the system prompt itself.

Reported: aggregate tok/s (generated tokens / wall time of the round), TTFT median and max, prompt tokens
prefilled in the round.

    .venv/bin/python benchmarks/shared_prompt_cpu.py [--clients 8] [--system 600] [--tokens 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from batch_cpu import QUESTIONS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--system", type=int, default=600, help="system prompt length in tokens (about)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    import onnxgen
    from _util import interleave, machine, table

    torch.set_num_threads(args.threads)
    models = {
        "sharing": onnxgen.load(backend="native", max_running=args.clients),
        "no sharing": onnxgen.load(backend="native", max_running=args.clients),
    }
    off = models["no sharing"].executor
    off.defer = lambda req: False
    inner_open = off.kv.open
    off.kv.open = lambda digest, tokens, inflight=(): inner_open(digest, tokens)
    words = " ".join(
        f"Rule {i}: answer briefly and politely, in plain English." for i in range(args.system // 12)
    )
    system = {"role": "system", "content": words}
    msgs = [[system, {"role": "user", "content": q}] for q in QUESTIONS[: args.clients]]
    salts = itertools.count()

    def round_of(model):
        def go():
            salt = f"round-{next(salts)}"
            with ThreadPoolExecutor(args.clients) as ex:
                t0 = time.perf_counter()
                rs = list(
                    ex.map(
                        lambda m: model.generate(m, max_new_tokens=args.tokens, temperature=0, salt=salt),
                        msgs,
                    )
                )
                wall = time.perf_counter() - t0
            ttft = [r.stats.ttft_s * 1e3 for r in rs]
            return (
                sum(r.stats.generated_tokens for r in rs) / wall,
                statistics.median(ttft),
                max(ttft),
                sum(r.stats.prefilled_tokens for r in rs),
                [r.tokens for r in rs],
            )

        return go

    contenders = {name: round_of(m) for name, m in models.items()}
    for go in contenders.values():  # warm-up
        go()
    runs = interleave(args.rounds, contenders)
    same = all(a[4] == b[4] for a, b in zip(runs["sharing"], runs["no sharing"], strict=True))
    base = statistics.median(x[0] for x in runs["no sharing"])
    rows = []
    for k, v in runs.items():
        tps = statistics.median(x[0] for x in v)
        rows.append(
            [
                k,
                f"{tps:.1f}",
                f"{tps / base:.2f}x",
                f"{statistics.median(x[1] for x in v):.0f}",
                f"{statistics.median(x[2] for x in v):.0f}",
                f"{statistics.median(x[3] for x in v):.0f}",
            ]
        )
    n_prompt = len(models["sharing"].encode_prompt(msgs[0]))
    print(
        f"{machine()}; {args.clients} clients, prompts of ~{n_prompt} tokens (one system prompt) x "
        f"{args.tokens} tokens; median of {args.rounds}; outputs identical: {'yes' if same else 'NO'}"
    )
    print(
        table(
            rows,
            [
                "contender",
                "aggregate tok/s",
                "vs no sharing",
                "TTFT p50 ms",
                "TTFT max ms",
                "tokens prefilled",
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
