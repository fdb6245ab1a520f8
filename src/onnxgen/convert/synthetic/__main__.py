"""`python -m onnxgen.convert.synthetic OUT [--preset tiny|1b|8b] [--layers N] [--dtype ...] [--progress]`."""

from __future__ import annotations

import argparse
import dataclasses
import time

from onnxgen.convert.synthetic.config import ATTENTION_STYLES, DTYPES, LLAMA_1B, LLAMA_8B, SyntheticConfig
from onnxgen.convert.synthetic.package import write_package


def main(argv: list[str] | None = None) -> None:
    """Write a synthetic package from a preset with a few fields overridden, and report its size and time."""
    presets = {"tiny": SyntheticConfig(), "1b": LLAMA_1B, "8b": LLAMA_8B}
    ap = argparse.ArgumentParser(prog="python -m onnxgen.convert.synthetic", description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--preset", choices=sorted(presets), default="tiny")
    ap.add_argument("--layers", type=int, help="override num_layers (e.g. a truncated 1B for timing)")
    ap.add_argument("--dtype", choices=DTYPES)
    ap.add_argument("--attention", choices=ATTENTION_STYLES)
    ap.add_argument("--quant", choices=["int4"])
    ap.add_argument("--context-length", type=int)
    ap.add_argument("--tokenizer-dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    over = {
        k: v
        for k, v in (
            ("num_layers", args.layers),
            ("dtype", args.dtype),
            ("attention", args.attention),
            ("quant", args.quant),
            ("context_length", args.context_length),
        )
        if v is not None
    }
    cfg = dataclasses.replace(presets[args.preset], **over)
    t0 = time.time()
    out = write_package(
        args.out, cfg, seed=args.seed, tokenizer_dir=args.tokenizer_dir, progress=args.progress
    )
    size = sum(f.stat().st_size for f in out.iterdir())
    print(
        f"wrote {out} ({cfg.num_parameters / 1e9:.3f}B params, {size / 2**30:.2f} GiB) in {time.time() - t0:.1f}s"
    )


if __name__ == "__main__":
    main()
