"""Probe (issue 13): the paged attention of one batch-1 decode token, the 0.5B and 1B shapes, as a captured
decode graph launches it (splits planned for the whole context), with other tiles (warps, key block,
pipeline stages) and split counts than `paged.tile_for` / `splits_for` choose: GPU µs a layer (attention
and its combine; 8 layers of distinct KV replayed in a CUDA graph, best of two interleaved rounds) and the
output's relative difference from the default's. The attention costs 3.4 µs a layer of the 0.5B decode step
and 5.3 µs of the 1B's on an H100 (docs/benchmarks/decode-gpu.md, tenth session) for 528 keys that take
0.1-0.4 µs to read: which of its knobs move that.

    PYTHONPATH=src python3 benchmarks/gpu_decode_attention.py [--plan 16384] [--lengths 528,4096]
        [--shapes 0.5b,1b] [--tiles "16,64,4,1;16,32,4,1"] [--splits 16,8]
"""

# ruff: noqa: B023  (each lambda is timed within the iteration that made it)

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_paged_attention import DT, per_layer, setup
from onnxgen.backends.native import paged

SHAPES = {"0.5b": (14, 2, 64), "1b": (32, 8, 64), "8b": (32, 8, 128)}  # query heads, KV heads, head size
# (block_m, block_n, warps, stages); None: tile_for's
TILES = (
    None,
    (16, 64, 1, 2),
    (16, 64, 2, 2),
    (16, 64, 8, 2),
    (16, 32, 1, 2),
    (16, 32, 2, 2),
    (16, 32, 4, 2),
    (16, 128, 4, 2),
    (16, 128, 8, 2),
    (16, 64, 4, 1),
    (16, 64, 4, 3),
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", type=int, default=16384, help="the context a decode graph plans its splits for")
    ap.add_argument("--lengths", default="528,4096")
    ap.add_argument("--shapes", default="0.5b,1b")
    ap.add_argument("--tiles", default=None, help="tiles to try beside the default, `bm,bn,warps,stages;...`")
    ap.add_argument("--splits", default="16,8", help="split counts to try with the default tile")
    args = ap.parse_args()
    tiles = TILES
    if args.tiles is not None:
        tiles = (None, *(tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";")))
    splits = (None, *(int(v) for v in args.splits.split(",") if v))
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    rows = []
    for name in args.shapes.split(","):
        n, hkv, d = SHAPES[name]
        for length in (int(x) for x in args.lengths.split(",")):
            _st, ps = setup([(length - 1, 1)], hkv=hkv, d=d)
            g = dataclasses.replace(ps, plan_len=args.plan, _work={})
            q = torch.randn(1, n, d, device="cuda", dtype=DT)
            default = paged.tile_for(n // hkv, n // hkv, n // hkv, d, False)
            best: dict[tuple, float] = {}
            outs: dict[tuple, torch.Tensor] = {}
            for _round in range(2):
                for tile in tiles:
                    for ns in splits:
                        if ns is not None and tile is not None:
                            continue  # splits varied with the default tile only
                        key = (tile, ns)
                        try:
                            ms, out = per_layer(
                                lambda layer: paged.attention_triton(
                                    g, layer, q, d**-0.5, nsplit=ns, tile=tile
                                )
                            )
                        except Exception as exc:  # a tile the compiler refuses: reported, not fatal
                            print(f"{name} {length} {key}: {type(exc).__name__}: {str(exc)[:100]}")
                            continue
                        best[key] = min(best.get(key, float("inf")), ms * 1e3)
                        outs[key] = out
            base = outs[(None, None)].float()
            for key, us in best.items():
                diff = float((outs[key].float() - base).norm() / base.norm())
                tile, ns = key
                rows.append((name, length, str(tile or f"default {default}"), ns or "rule", us, diff))
    print("\n| shape | keys | tile (block_m, block_n, warps, stages) | splits | µs a layer | rel. diff |")
    print("|---|---|---|---|---|---|")
    for name, length, tile, ns, us, diff in rows:
        print(f"| {name} | {length} | {tile} | {ns} | {us:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
