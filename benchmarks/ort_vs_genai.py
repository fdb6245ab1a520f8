"""onnxgen (ort backend) vs onnxruntime-genai on the same package: TTFT and decode tok/s.

Interleaved runs, median of --runs (>= 5), equal intra-op thread counts, greedy, fresh state each run
(onnxgen with reuse=False). Prints a markdown table and the ratios.

    python benchmarks/ort_vs_genai.py [MODEL] --threads 2 --runs 7
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import onnxgen
from _util import genai_generate, genai_model, interleave, machine, medians, table
from onnxgen.convert.default import resolve_model_path

LONG = (
    "Here is a description of a small town. " * 3
    + "The town has a river, a bakery, a school, a library and a market that opens every Saturday. " * 12
    + "Summarise the description above in three sentences."
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    path = str(resolve_model_path(args.model))
    ours = onnxgen.load(path, backend="ort", threads=args.threads)
    theirs = genai_model(path, args.threads)
    prompts = {
        "short chat": [{"role": "user", "content": "What is the capital of France?"}],
        "long chat": [{"role": "user", "content": LONG}],
    }
    rows = []
    for label, msgs in prompts.items():
        ids = ours.encode_prompt(msgs)

        def run_ours(ids=ids):
            r = ours.generate(ids, max_new_tokens=args.new_tokens, reuse=False, stop=[])
            return {"ttft_s": r.stats.ttft_s, "decode_tok_s": r.stats.decode_tok_s, "tokens": len(r.tokens)}

        def run_theirs(ids=ids):
            return genai_generate(theirs, ids, args.new_tokens)

        run_ours(), run_theirs()  # warm-up
        res = interleave(args.runs, {"onnxgen": run_ours, "onnxruntime-genai": run_theirs})
        a, b = medians(res["onnxgen"]), medians(res["onnxruntime-genai"])
        rows.append(
            [
                label,
                str(len(ids)),
                f"{a['tokens']:.0f}/{b['tokens']:.0f}",
                f"{a['ttft_s'] * 1000:.1f}",
                f"{b['ttft_s'] * 1000:.1f}",
                f"{b['ttft_s'] / a['ttft_s']:.2f}x",
                f"{a['decode_tok_s']:.1f}",
                f"{b['decode_tok_s']:.1f}",
                f"{a['decode_tok_s'] / b['decode_tok_s']:.2f}x",
            ]
        )
    print(
        f"\nmodel: {path}\nmachine: {machine()}; threads {args.threads}; median of {args.runs} interleaved runs\n"
    )
    print(
        table(
            rows,
            [
                "prompt",
                "prompt tokens",
                "tokens (ours/theirs)",
                "TTFT ms onnxgen",
                "TTFT ms ort-genai",
                "TTFT speedup",
                "decode tok/s onnxgen",
                "decode tok/s ort-genai",
                "decode ratio",
            ],
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
