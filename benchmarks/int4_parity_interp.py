"""The packed int4 Triton GEMV (`triton_int4`) on a real int4 package, without a GPU: decode steps through
the Triton interpreter against the native backend's dense int4 (dequantized at load, plain torch).

    .venv/bin/python benchmarks/int4_parity_interp.py PKG                     # 1: dense, saves its logits
    TRITON_INTERPRET=1 ONNXGEN_FORCE_TRITON=1 PYTHONPATH=/tmp/tsite:src \\
        .venv/bin/python benchmarks/int4_parity_interp.py PKG                 # 2: packed, compares (slow: ~20 min)

A 150-token prompt (the edit workload's notes), greedy, 3 new tokens: the prefill dequantizes (more than
`ops.quant.GEMV_ROWS` rows), each decode step runs the packed GEMV. The logits go to /tmp/int4_parity_*.npy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import onnxgen
from speculative import DOC


def main() -> int:
    pkg = sys.argv[1]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    mode = "packed" if interpreted else "dense"
    m = onnxgen.load(pkg, backend="native", int4=mode)
    ids = m.encode_prompt([{"role": "user", "content": "Rewrite: " + DOC}])
    r = m.generate(ids, max_new_tokens=3, temperature=0, reuse=False, output_logits=True, speculative=False)
    np.save(f"/tmp/int4_parity_{mode}.npy", r.logits)
    np.save(f"/tmp/int4_parity_{mode}_tokens.npy", np.array(r.tokens))
    print(f"{mode}: {len(ids)} prompt tokens, tokens {r.tokens}")
    if interpreted:
        dense = np.load("/tmp/int4_parity_dense.npy")
        same = r.tokens == np.load("/tmp/int4_parity_dense_tokens.npy").tolist()
        d = np.linalg.norm(r.logits - dense, axis=-1) / np.linalg.norm(dense, axis=-1)
        print(
            f"packed (interpreted Triton GEMV) vs dense: tokens equal {same}, max rel. logit diff {d.max():.2e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
