"""int4 (MatMulNBits) vs bf16 packages of the same shape on the native backend (CUDA).

`int4="dense"` dequantizes int4 weights once at load into the model dtype; `int4="packed"` (the default on
CUDA) keeps them packed and runs decode rows through the Triton GEMV (`backends/native/triton_int4.py`). This
measures both against bf16 in one run: load time, the weights' bytes on the device (the lowered program's
tensors), TTFT at 512 tokens and batch-1 decode tok/s (median of 3, public API, greedy); `same tokens`
compares the first 32 greedy tokens with the dequantized int4 run's.

    # builder-made packages (onnxruntime-genai's `-p bf16` and `-p int4` from one random checkpoint)
    PYTHONPATH=/tmp/site:src python3 benchmarks/gpu_int4.py --tokenizer DIR --shape 8b16k
    # synthetic packages written by onnxgen (the 1B shape; --tiny checks the script on a CPU)
    PYTHONPATH=src python3 benchmarks/gpu_int4.py [--layers N] [--device cuda] [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def synthetic_packages(args: Any) -> list[tuple[str, Path, dict[str, Any], int]]:
    from onnxgen.convert.synthetic import LLAMA_1B, SyntheticConfig, write_package

    base = (
        SyntheticConfig(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
        if args.tiny
        else LLAMA_1B
    )
    if args.layers is not None:
        base = dataclasses.replace(base, num_layers=args.layers)
    out = []
    for name, cfg in (("bf16", base), ("int4", dataclasses.replace(base, quant="int4"))):
        pkg = Path(args.root) / (f"1b_{name}" if args.layers is None else f"1b_{name}_{args.layers}")
        if not (pkg / "genai_config.json").exists():
            write_package(pkg, cfg)
        out.append((name, pkg, {"int4": "dense"} if name == "int4" else {}, base.vocab_size))
    return [*out, ("int4 packed", out[1][1], {"int4": "packed"}, base.vocab_size)]


def builder_packages(args: Any) -> list[tuple[str, Path, dict[str, Any], int]]:
    from gpu_parity import package
    from onnxgen.convert.checkpoint import convert_checkpoint
    from onnxgen.convert.reference import SHAPES

    hf, bf16 = package(args.shape, args.tokenizer)
    int4 = bf16.parent / f"{args.shape}_int4_pkg"
    if not (int4 / "genai_config.json").is_file():
        t = time.perf_counter()
        convert_checkpoint(hf, int4, precision="int4", execution_provider="cuda", progress=False)
        print(f"{args.shape}: builder int4 package in {time.perf_counter() - t:.1f}s", flush=True)
    v = SHAPES[args.shape].vocab_size
    return [
        ("bf16", bf16, {}, v),
        ("int4", int4, {"int4": "dense"}, v),
        ("int4 packed", int4, {"int4": "packed"}, v),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/onnxgen_bench")
    ap.add_argument(
        "--tokenizer", type=Path, default=None, help="builder packages (SmolLM2's tokenizer files)"
    )
    ap.add_argument("--shape", default="8b16k", help="with --tokenizer: a shape of onnxgen.convert.reference")
    ap.add_argument("--layers", type=int, default=None, help="truncate the synthetic shape (smoke tests)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny fp32 synthetic shape (checks the script on a CPU)"
    )
    args = ap.parse_args()
    import torch

    import onnxgen

    cuda = args.device == "cuda"
    packages = builder_packages(args) if args.tokenizer is not None else synthetic_packages(args)
    rows = []
    step_logits: list[Any] = []  # per package: the raw logits of its first 32 greedy steps
    for label, pkg, opts, vocab in packages:
        disk = sum(f.stat().st_size for f in pkg.iterdir())
        if cuda:  # the previous engine's weights and KV pool gone before the next loads (80 GB cards)
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        t = time.perf_counter()
        m = onnxgen.load(str(pkg), backend="native", device=args.device, **opts)
        load_s = time.perf_counter() - t
        runner = getattr(m.executor, "runner", None)
        weights = runner.program.weight_bytes if runner is not None else 0
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(100, min(vocab, 32000) - 1, (512,), generator=g).tolist()
        m.generate(prompt[:32], max_new_tokens=8, speculative="off", reuse=False)  # warm-up
        runs = []
        for _ in range(3):
            m.settle()  # a run's TTFT does not include the previous run's tail
            runs.append(
                m.generate(prompt, max_new_tokens=129, speculative="off", reuse=False, stop=[], temperature=0)
            )
        ttft = statistics.median(r.stats.ttft_s for r in runs) * 1000
        tps = statistics.median(r.stats.decode_tok_s for r in runs)
        # the raw logits of each greedy step (a slower path: only for the margins where tokens differ)
        logits = m.generate(
            prompt,
            max_new_tokens=32,
            speculative="off",
            reuse=False,
            stop=[],
            temperature=0,
            output_logits=True,
        ).logits
        rows.append((label, disk / 1e9, load_s, weights / 1e9, ttft, tps, runs[0].tokens[:32]))
        step_logits.append(logits)
        print(f"{label}: {tps:.1f} tok/s, weights {weights / 1e9:.2f} GB", flush=True)
        m.close()
        del m, runner
    ref = rows[1][6]
    print(
        "\n| package | on disk GB | load s | weights on device GB | TTFT 512 ms | decode tok/s | same tokens |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, d, ld, wg, ttft, tps, toks in rows:
        same = (
            "-"
            if label == "bf16"
            else ("yes" if toks == ref else f"{sum(a == b for a, b in zip(toks, ref, strict=False))}/32")
        )
        print(f"| {label} | {d:.2f} | {ld:.1f} | {wg:.2f} | {ttft:.1f} | {tps:.1f} | {same} |")
    print(
        "\nwhere greedy tokens part from the dequantized int4 run's: the reference's top-2 logit margin there"
    )
    print(
        "(a margin within both runs' rounding differences is not a clear one; the median margin is for scale)"
    )
    ref_logits = step_logits[1]
    top = np.sort(ref_logits, axis=-1)[:, -2:]
    gap = top[:, 1] - top[:, 0]  # the reference's top-2 margin at each step
    for (label, *_, toks), lg in zip(rows, step_logits, strict=True):
        if label == "bf16" or toks == ref:
            continue
        i = next(j for j, (a, b) in enumerate(zip(toks, ref, strict=False)) if a != b)
        print(
            f"{label}: first differs at step {i}; reference margin there {gap[i]:.4f}, median {np.median(gap):.4f};"
            f" this run's logits there differ from the reference's by {np.abs(lg[i] - ref_logits[i]).max():.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
