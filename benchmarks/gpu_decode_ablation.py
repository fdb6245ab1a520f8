"""What each kind of kernel costs a batch-1 decode step (issue 13): the captured decode graph's GPU time with
one kind of launch removed, so the gain a fusion could bring is bounded before it is built.

    PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 python3 benchmarks/gpu_decode_ablation.py --tokenizer DIR \
        [--shapes 0.5b,1b] [--ablations none,rms,combine,rms+combine,attention]

For each shape (builder-made bf16 package, `gpu_parity.package`) and each ablation, a fresh engine is
loaded with the named Triton launches replaced by no-ops (`rms`: the RMSNorm kernel, and the folded
norm+GEMV is then never chosen since the separate pair times faster; `combine`: the merge of the key
splits' partial attention results; `attention`: the paged attention and its combine; `rope`: the rotary
kernel; `late`, `early`, `nores` and `x1d` are variants, not removals: folded norms scale the product at
the end or normalise x first, `kernels.NORM_LATE`; the skip-norms kept, with no residual added by the
products before them, `lowering._residual_into_product`; the GEMV loads x as a vector converted through
shared memory, `kernels.X_IN_TILE` off; `fold`: every RMSNorm folded into the product after it, without
asking the per-shape timing (which may pick the norm kernel and the plain product); `pipelined`: decode
attention two pipeline stages deep however short its key splits (`paged.SHORT_BLOCKS` 0; the same bits);
`steps1`: decode graphs one step deep only (`runner.RUN_GRAPH_STEPS` 1: the time is then the one-step graph's,
otherwise the several-step graph's per step, which greedy runs replay); `torchgather`: the token embedding
gathered by torch instead of `kernels.embedding` (which takes part in programmatic dependent launch);
`torchargmax`: the decode graph's greedy choice by `torch.argmax` instead of partial maxima and a pick
inside the advance kernel, `kernels.GREEDY_IN_ADVANCE` off), a 512-token prompt is prefilled and 16 tokens
decoded (captures and per-shape choices happen as usual), then the batch-1 decode graph the decoding replayed
is replayed 200 times (CUDA events) and its kernels counted (torch.profiler). The outputs are garbage in every ablation but the variants:
only the times mean something. An ablation may be named more than once (`none,late,none,late`: interleaved);
`saved` is against the latest `none`.
A table prints last.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` launches nothing."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *a, **k: None


def _patch(ablation: str) -> list[tuple[Any, str, Any]]:
    """Replace the launches `ablation` names; returns what to restore."""
    from onnxgen.backends.native import kernels
    from onnxgen.backends.native import triton_paged as tp

    kernels._build()
    saved: list[tuple[Any, str, Any]] = []

    def swap(obj: Any, key: str) -> None:
        if isinstance(obj, dict):
            saved.append((obj, key, obj[key]))
            obj[key] = _NoLaunch()
        else:
            saved.append((obj, key, getattr(obj, key)))
            setattr(obj, key, _NoLaunch())

    parts = set(ablation.split("+")) - {"none"}
    if "rms" in parts:
        swap(kernels._TRITON, "rms")
    if "rope" in parts:
        swap(kernels._TRITON, "rope_qkv")
    if "late" in parts or "early" in parts:  # folded norms scaled after the product, or x normalised first
        saved.append((kernels, "NORM_LATE", kernels.NORM_LATE))
        kernels.NORM_LATE = "late" in parts
    if "nores" in parts:  # skip-norms left as they are (the o / down products do not add the residual)
        from onnxgen.backends.native import lowering

        saved.append((lowering, "_residual_into_product", lowering._residual_into_product))
        lowering._residual_into_product = lambda nodes, logits: None
    if "torchargmax" in parts:  # the greedy choice by torch.argmax, not partial maxima + the advance kernel
        saved.append((kernels, "GREEDY_IN_ADVANCE", kernels.GREEDY_IN_ADVANCE))
        kernels.GREEDY_IN_ADVANCE = False
    if "fold" in parts:  # every RMSNorm folded into the product after it (its per-shape timing not asked)
        saved.append((kernels, "FOLD_ALWAYS", kernels.FOLD_ALWAYS))
        kernels.FOLD_ALWAYS = True
    if "pipelined" in parts:  # decode attention always two pipeline stages deep (as before SHORT_BLOCKS)
        from onnxgen.backends.native import paged

        saved.append((paged, "SHORT_BLOCKS", paged.SHORT_BLOCKS))
        paged.SHORT_BLOCKS = 0
    if "steps1" in parts:  # decode graphs one step deep only (no several-step graphs: runner.RUN_GRAPH_STEPS)
        from onnxgen.backends.native import runner

        saved.append((runner, "RUN_GRAPH_STEPS", runner.RUN_GRAPH_STEPS))
        runner.RUN_GRAPH_STEPS = 1
    if "torchgather" in parts:  # the embedding gathered by torch (no programmatic dependent launch)
        import torch.nn.functional as F

        saved.append((kernels, "embedding", kernels.embedding))
        kernels.embedding = F.embedding
    if "x1d" in parts:
        saved.append((kernels, "X_IN_TILE", kernels.X_IN_TILE))
        kernels.X_IN_TILE = False
    if "combine" in parts or "attention" in parts:
        swap(tp, "paged_combine_kernel")
    if "attention" in parts:
        swap(tp, "paged_attn_kernel")
    return saved


def _restore(saved: list[tuple[Any, str, Any]]) -> None:
    for obj, key, value in reversed(saved):
        if isinstance(obj, dict):
            obj[key] = value
        else:
            setattr(obj, key, value)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--shapes", default="0.5b,1b")
    ap.add_argument("--ablations", default="none,rms,combine,rms+combine,attention")
    args = ap.parse_args()
    import gpu_decode
    import onnxgen
    from gpu_parity import package

    prompt = np.random.default_rng(1).integers(100, 32000, 512).tolist()
    rows = []
    for name in args.shapes.split(","):
        _, pkg = package(name, args.tokenizer)
        base = None
        first: list[int] | None = None  # the tokens of the first `none`
        for ablation in args.ablations.split(","):
            from onnxgen.backends.native import kernels

            kernels.CHOICES.clear()  # every engine times its own per-shape choices (a no-op launch is fast)
            saved = _patch(ablation)
            try:
                m = onnxgen.load(str(pkg), backend="native", device="cuda")
                toks = m.generate(
                    prompt, max_new_tokens=16, speculative="off", reuse=False, temperature=0
                ).tokens
                runner = m.executor.runner
                folds = {
                    f"{c[0]} {tuple(c[1])}": v is not None
                    for c, v in kernels.CHOICES.items()
                    if c[0] in ("rms_gemv", "rope_gemv")
                }
                print(f"{name} {ablation}: norm folded (per product shape): {folds}", flush=True)
                ms = gpu_decode.replay_ms(runner, len(prompt) + len(toks))
                k = gpu_decode.kernels(runner, len(prompt) + len(toks))
                m.close()
                del m, runner
            finally:
                _restore(saved)
                gc.collect()
                torch.cuda.empty_cache()
            base = ms if ablation == "none" else base
            first = toks if first is None and ablation == "none" else first
            rows.append((name, ablation, ms, k["kernels_per_step"], base))
            same = sum(a == b for a, b in zip(toks, first or [], strict=False)) if first else "-"
            print(
                f"{name} {ablation}: replay {ms:.4f} ms, {k['kernels_per_step']:.0f} kernels/step, "
                f"greedy tokens equal to the first none's: {same}/{len(toks)}",
                flush=True,
            )
    print(
        "\n| shape | removed | decode graph ms | kernels/step | saved ms | saved per launch us | tok/s bound |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, ablation, ms, kn, base in rows:
        full = next(r for r in rows if r[0] == name and r[1] == "none")
        saved = (base - ms) if base is not None else float("nan")
        per = saved / max(full[3] - kn, 1) * 1e3 if kn < full[3] else float("nan")
        print(f"| {name} | {ablation} | {ms:.4f} | {kn:.0f} | {saved:.4f} | {per:.2f} | {1e3 / ms:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
