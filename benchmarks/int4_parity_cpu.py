"""A builder-made int4 package with real weights, on the CPU: the native backend with `int4="packed"` (the
K-major words, dequantized per call on the CPU) against `int4="dense"` (dequantized at load) and against
onnxruntime (the ort backend), on a prompt of about 1,700 tokens, greedy, 24 new tokens.

    (any int4 package; e.g. one of the default model's checkpoint, made by onnxruntime-genai's builder:)
    .venv/bin/python -m onnxgen.convert.checkpoint gguf-to-hf ~/.cache/onnxgen/sources/*.gguf /tmp/gg/hf
    .venv/bin/onnxgen convert /tmp/gg/hf /tmp/spkg_int4 --precision int4 -e cpu -q
    .venv/bin/python benchmarks/int4_parity_cpu.py /tmp/spkg_int4
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import onnxgen
from speculative import DOC


def main() -> int:
    pkg = sys.argv[1]
    ort = onnxgen.load(pkg, backend="ort")
    msgs = [{"role": "user", "content": ("Summarise these notes. " + DOC + " ") * 14}]
    ids = ort.encode_prompt(msgs)
    kw = dict(max_new_tokens=24, temperature=0, reuse=False, output_logits=True, speculative=False)
    ref = ort.generate(ids, **kw)
    res = {
        mode: onnxgen.load(pkg, backend="native", int4=mode).generate(ids, **kw)
        for mode in ("packed", "dense")
    }

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float((np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).max())

    print(f"{pkg}: {len(ids)} prompt tokens, {len(ref.tokens)} generated\n")
    print("| native int4 mode | tokens = onnxruntime's | max rel. logit diff vs onnxruntime | vs dense |")
    print("|---|---|---|---|")
    for mode, r in res.items():
        print(
            f"| {mode} | {r.tokens == ref.tokens} | {rel(r.logits, ref.logits):.2e} | "
            f"{rel(r.logits, res['dense'].logits):.2e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
