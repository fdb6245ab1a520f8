"""Whether the per-shape GEMV choices, each timed as one product alone, are the fastest inside the decode step
(issue 13): coordinate descent over every batch-1 choice the decode graph reads, timed by the step itself.

    PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_tune_in_graph.py --tokenizer DIR \
        [--shapes 0.5b,1b] [--rounds 2]

For each shape (builder-made bf16 package of a random checkpoint, `gpu_parity.package`): a 512-token prompt
is prefilled and 16 tokens decoded through the public API (captures and per-shape choices as usual). Then
the batch-1 decode graphs (the one for any length and the short-context one) are captured again while
recording which `kernels.CHOICES` entries the capture reads: the one-row products' choices (`gemv`,
`rms_gemv`: norm folded in or not, `rope_gemv`: rotary fused or not). For each such entry in turn, every
candidate (its configuration list, and None — the separate kernels — where it has that) is put in
`CHOICES`, the graphs are captured again, the last decode step's state is copied in, and
`gpu_decode.replay_ms` times the step the engine replayed (the several-step graph, per step); the fastest
stays where it beats the load's choice by `MIN_GAIN`. `--rounds` passes over the entries. Last, the load's
own choices and the tuned ones are captured and timed alternately three times each, and a greedy decode
with the tuned choices is compared with the first (a choice may move a row's bits — a norm folded in or
not rounds differently — so with random weights the greedy tokens can part where two logits are close).
A table prints last; a JSON goes to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

OUT = Path(os.environ.get("OUT") or "/tmp/gpu_tune_in_graph_out")
OUT.mkdir(parents=True, exist_ok=True)
TUNED = ("gemv", "rms_gemv", "rope_gemv")  # the one-row products' choices
MIN_GAIN = 0.003  # a candidate replaces the load's choice only when the step is this much faster


class _Reads(dict):
    """`kernels.CHOICES` that records the keys looked up (a capture's reads)."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.read: list[Any] = []

    def __contains__(self, key: object) -> bool:
        self.read.append(key)
        return super().__contains__(key)

    def __getitem__(self, key: Any) -> Any:
        self.read.append(key)
        return super().__getitem__(key)


def candidates(key: tuple[Any, ...]) -> list[Any]:
    """What a choice under `key` may be: its configurations, and None where the separate kernels are one."""
    from onnxgen.backends.native import kernels

    if key[0] == "gemv":
        return list(kernels.GEMV_CONFIGS)
    if key[0] == "rope_gemv":
        return [None, *kernels.ROPE_GEMV_CONFIGS]
    return [None, *kernels.GEMV_CONFIGS]


class Step:
    """The engine's batch-1 decode graphs, captured again on demand, each starting from one saved state."""

    def __init__(self, runner: Any, kv_len: int) -> None:
        import gpu_decode

        self.runner, self.kv_len = runner, kv_len
        g = gpu_decode.decode_graph(runner, kv_len)  # the graph the last step replayed: its state is real
        self.short = g is runner._short.get(1)
        self.keys = g.keys
        self.state = (g.wide.clone(), g.narrow.clone())

    def capture(self) -> list[Any]:
        """Capture the batch-1 decode graph the timed step uses, with the state copied in; the choice keys
        read by the capture."""
        from onnxgen.backends.native import kernels

        reads = _Reads(kernels.CHOICES)
        kernels.CHOICES = reads
        try:
            with self.runner.device_lock:
                g = self.runner._capture(1, 1, keys=self.keys if self.short else 0)
        finally:
            kernels.CHOICES = dict(reads)
        assert g is not None, "capture failed"
        g.wide.copy_(self.state[0])
        g.narrow.copy_(self.state[1])
        torch.cuda.synchronize()
        return [k for k in dict.fromkeys(reads.read) if isinstance(k, tuple) and k[0] in TUNED]

    def time(self) -> float:
        """GPU ms per step of the graph captured with the current choices (`gpu_decode.replay_ms`)."""
        import gpu_decode

        self.capture()
        return gpu_decode.replay_ms(self.runner, self.kv_len)


def name(key: tuple[Any, ...]) -> str:
    silu = key[0] in ("gemv", "rms_gemv") and key[3] is True
    return f"{key[0]} {tuple(key[1])}{' silu' if silu else ''}"


def tune(step: Step, rounds: int, log: Any) -> tuple[dict[Any, Any], list[tuple[str, Any, Any, float]]]:
    """Coordinate descent: for each choice the capture reads, the candidate with the fastest step."""
    from onnxgen.backends.native import kernels

    changes = []
    for r in range(rounds):
        for key in step.capture():
            if key not in kernels.CHOICES:
                continue
            start = kernels.CHOICES[key]
            times = {}
            for cand in candidates(key):
                kernels.CHOICES[key] = cand
                try:
                    times[cand] = step.time()
                except Exception as exc:  # a configuration that does not compile or capture
                    log(f"  {name(key)} {cand}: {type(exc).__name__}")
            best = min(times, key=lambda c: times[c])
            if start in times and times[best] > times[start] * (
                1 - MIN_GAIN
            ):  # within noise: keep the load's
                best = start
            kernels.CHOICES[key] = best
            log(
                f"round {r + 1} {name(key)}: load's {start} {times.get(start, float('nan')):.4f} ms -> "
                f"{best} {times[best]:.4f} ms ({len(times)} tried)"
            )
            if best != start:
                changes.append((name(key), start, best, times.get(start, float("nan")) - times[best]))
    return dict(kernels.CHOICES), changes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--shapes", default="0.5b,1b")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import onnxgen
    from gpu_parity import package
    from onnxgen.backends.native import kernels

    def log(*a: Any) -> None:
        print(*a, flush=True)

    prompt = np.random.default_rng(1).integers(100, 32000, 512).tolist()
    rows, report = [], {}
    for shape in args.shapes.split(","):
        _, pkg = package(shape, args.tokenizer)
        kernels.CHOICES.clear()
        m = onnxgen.load(str(pkg), backend="native", device="cuda")
        ref = m.generate(prompt, max_new_tokens=16, speculative="off", reuse=False, temperature=0).tokens
        step = Step(m.executor.runner, len(prompt) + len(ref))
        loaded = dict(kernels.CHOICES)
        tuned, changes = tune(step, args.rounds, log)
        alt: dict[str, list[float]] = {"load": [], "tuned": []}
        for _ in range(3):
            for label, choices in (("load", loaded), ("tuned", tuned)):
                kernels.CHOICES = dict(choices)
                alt[label].append(step.time())
        kernels.CHOICES = dict(tuned)
        step.capture()
        got = m.generate(prompt, max_new_tokens=16, speculative="off", reuse=False, temperature=0).tokens
        same = sum(a == b for a, b in zip(got, ref, strict=False))
        m.close()
        a, b = statistics.median(alt["load"]), statistics.median(alt["tuned"])
        log(
            f"{shape}: load's choices {alt['load']} ms, tuned {alt['tuned']} ms; greedy tokens equal {same}/16"
        )
        rows.append((shape, a, b, len(changes), same))
        report[shape] = {
            "load_ms": alt["load"],
            "tuned_ms": alt["tuned"],
            "tokens_equal": same,
            "changes": [[n, repr(s), repr(t), d] for n, s, t, d in changes],
        }
        for n, s, t, d in changes:
            log(f"  {shape} {n}: {s} -> {t} (step {d * 1e3:+.1f} us in its round)")
    (OUT / "tune_in_graph.json").write_text(json.dumps(report, indent=1))
    print(
        "\n| shape | load's choices ms | tuned in the step ms | gain | choices changed | greedy tokens equal |"
    )
    print("|---|---|---|---|---|---|")
    for shape, a, b, n, same in rows:
        print(f"| {shape} | {a:.4f} | {b:.4f} | {(a - b) / a * 100:+.1f} % | {n} | {same}/16 |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
