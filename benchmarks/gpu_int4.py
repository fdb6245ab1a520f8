"""int4 (MatMulNBits, block 32) vs bf16 packages of the same Llama-3.2-1B shape on the native backend.

By default the native backend dequantizes int4 weights once at load into the model dtype; `int4="packed"`
keeps them packed and runs decode rows through the Triton GEMV (`backends/native/triton_int4.py`). This
measures both against bf16: write time, load time, device memory for weights, TTFT at 512 tokens and
batch-1 decode tok/s, in one run; `same tokens` compares the first 32 greedy tokens with the dequantized
int4 run's.

    PYTHONPATH=src python3 benchmarks/gpu_int4.py [--layers N] [--device cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default="/tmp/onnxgen_bench")
    ap.add_argument("--layers", type=int, default=None, help="truncate the shape (smoke tests)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny fp32 shape (checks the script on a CPU)")
    args = ap.parse_args()
    import torch

    import onnxgen
    from onnxgen.convert.synthetic import LLAMA_1B, SyntheticConfig, write_package

    base = SyntheticConfig(hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512) if args.tiny else LLAMA_1B
    if args.layers is not None:
        base = dataclasses.replace(base, num_layers=args.layers)
    cuda = args.device == "cuda"
    rows = []
    q4 = dataclasses.replace(base, quant="int4")
    for label, cfg, opts in (("bf16", base, {}), ("int4", q4, {}), ("int4 packed", q4, {"int4": "packed"})):
        name = label.split()[0]
        pkg = Path(args.root) / (f"1b_{name}" if args.layers is None else f"1b_{name}_{args.layers}")
        t = time.perf_counter()
        if not (pkg / "genai_config.json").exists():
            write_package(pkg, cfg)
        write_s = time.perf_counter() - t
        disk = sum(f.stat().st_size for f in pkg.iterdir())
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated() if cuda else 0
        t = time.perf_counter()
        m = onnxgen.load(str(pkg), backend="native", device=args.device, **opts)
        load_s = time.perf_counter() - t
        weights = (torch.cuda.memory_allocated() - before) if cuda else 0
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(100, cfg.vocab_size - 1, (512,), generator=g).tolist()
        m.generate(prompt[:32], max_new_tokens=8, reuse=False)  # warm-up
        runs = [m.generate(prompt, max_new_tokens=129, reuse=False, stop=[], temperature=0) for _ in range(3)]
        ttft = statistics.median(r.stats.ttft_s for r in runs) * 1000
        tps = statistics.median(r.stats.decode_tok_s for r in runs)
        rows.append((label, write_s, disk / 1e9, load_s, weights / 1e9, ttft, tps, runs[0].tokens[:32]))
        m.close()
        del m
    ref = rows[1][7]
    print("\n| package | write s | on disk GB | load s | weights on device GB | TTFT 512 ms | decode tok/s | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for label, w, d, ld, wg, ttft, tps, toks in rows:
        same = "-" if label == "bf16" else ("yes" if toks == ref else "no")
        print(f"| {label} | {w:.1f} | {d:.2f} | {ld:.1f} | {wg:.2f} | {ttft:.1f} | {tps:.1f} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
