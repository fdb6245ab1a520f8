"""Per-op numerical error of the native backend against a float64 evaluation of the same graph
(`onnxgen.backends.native.numerics`): a table per op type, then the worst nodes.

    PYTHONPATH=src python benchmarks/op_error.py PKG --tokens 256 1024 [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pkg")
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    from onnxgen.backends.native import numerics

    for n in a.tokens:
        rows = numerics.measure(a.pkg, n, a.device)
        print(f"\n## {Path(a.pkg).name}, {n} tokens, {a.device}: per op type (worst local/floor ratio)")
        print("| op | nodes | median ratio | worst ratio | worst node | its local error |")
        print("|---|---|---|---|---|---|")
        for op, g in sorted(numerics.by_op(rows).items(), key=lambda kv: -kv[1]["worst"]["ratio"]):
            w = g["worst"]
            print(
                f"| {op} | {g['nodes']} | {g['median']:.2f} | {w['ratio']:.2f} | {w['node']}:{w['out']} | {w['local']:.2e} |"
            )
        print(f"\nworst {a.top} nodes:")
        for r in sorted(rows, key=lambda r: -r["ratio"])[: a.top]:
            print(
                f"  {r['ratio']:8.2f}  local {r['local']:.2e}  floor {r['floor']:.2e}  {r['op']:<28} {r['node']}:{r['out']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
