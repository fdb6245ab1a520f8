"""Per-token cost of each sampling step and processor, and llguidance's mask time, on SmolLM2's
vocabulary (49152), numpy logits (the CPU backend's type) and torch CPU tensors.

    .venv/bin/python benchmarks/sampling_cost.py [--model DIR] [--iters 300]

Each row is `Sampler.sample` with one feature on (penalties see 256 prior tokens), median
microseconds per call. The grammar rows replay a real JSON document token by token through a
json_schema / json_object matcher and time the mask computation + application per token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import onnxgen
from onnxgen.sampling import Sampler, SamplingParams
from onnxgen.sampling.grammar import GrammarCompiler
from onnxgen.sampling.processors import LogitBias, LogprobsRecorder

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace, mathematician", "age": 36, "tags": ["engines", "poetry", "numbers", "notes"]}


def time_sampler(make, x, history, iters: int) -> float:
    ts = []
    for _ in range(iters):
        s = make()
        for t in history:
            s.accept(t)
        t0 = time.perf_counter()
        s.sample(x)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--iters", type=int, default=300)
    a = ap.parse_args()
    model = onnxgen.load(a.model, backend="ort", threads=2)
    V = model.spec.vocab_size
    rng = np.random.default_rng(0)
    x_np = (rng.standard_normal(V) * 3).astype(np.float32)
    history = rng.integers(0, V, 256).tolist()
    prompt = rng.integers(0, V, 256).tolist()
    cases = {
        "greedy (baseline)": (SamplingParams(), []),
        "temperature 0.8": (SamplingParams(temperature=0.8), []),
        "top_k 50": (SamplingParams(temperature=0.8, top_k=50), []),
        "top_p 0.9": (SamplingParams(temperature=0.8, top_p=0.9), []),
        "min_p 0.05": (SamplingParams(temperature=0.8, min_p=0.05), []),
        "repetition_penalty 1.1": (SamplingParams(repetition_penalty=1.1), []),
        "presence+frequency 0.5": (SamplingParams(presence_penalty=0.5, frequency_penalty=0.5), []),
        "logit_bias (16 ids)": (SamplingParams(), [lambda: LogitBias({i: 1.0 for i in range(16)}, V)]),
        "logprobs top 5": (SamplingParams(), [lambda: LogprobsRecorder(5)]),
    }
    rows = []
    torch = None
    try:
        import torch
    except ImportError:
        pass
    for name, (params, procs) in cases.items():

        def make(params=params, procs=procs):
            return Sampler(params, prompt, [p() for p in procs])

        us_np = time_sampler(make, x_np, history, a.iters)
        us_t = time_sampler(make, torch.from_numpy(x_np.copy()), history, a.iters) if torch else float("nan")
        rows.append((name, us_np, us_t))
    compiler = GrammarCompiler.for_model(model)
    doc_ids = model.tokenizer.encode(json.dumps(DOC), add_special_tokens=False)
    for kind, source in (("json_schema", SCHEMA), ("json_object", None)):
        for label, x in (("numpy", x_np), ("torch", torch.from_numpy(x_np.copy()) if torch else None)):
            if x is None:
                continue
            mask_ts, full_ts = [], []
            for _ in range(max(1, a.iters // 50)):
                proc = compiler.processor(kind, source)
                for k in range(len(doc_ids) + 1):
                    t0 = time.perf_counter()
                    proc.allowed(doc_ids[:k])
                    mask_ts.append(time.perf_counter() - t0)
                proc = compiler.processor(kind, source)
                for k in range(len(doc_ids) + 1):
                    xx = x.copy() if label == "numpy" else x.clone()
                    t0 = time.perf_counter()
                    proc(xx, doc_ids[:k])
                    full_ts.append(time.perf_counter() - t0)
            rows.append(
                (f"grammar {kind} mask only ({label})", statistics.median(mask_ts) * 1e6, float("nan"))
            )
            rows.append(
                (f"grammar {kind} mask+apply ({label})", statistics.median(full_ts) * 1e6, float("nan"))
            )
    print(f"vocab {V} · {a.iters} iterations · median µs per token")
    print("| step | numpy µs | torch (CPU) µs |\n|---|---|---|")
    for name, n, t in rows:
        print(f"| {name} | {n:.0f} | {'' if t != t else f'{t:.0f}'} |")


if __name__ == "__main__":
    main()
