"""Micro-benchmark (issues 12, 13): the paged attention kernel on the 8B shape (32 query heads, 8 KV heads,
head 128, pages of 16, bf16) over 8 layers of distinct KV (the L2 cannot hold them), GPU time per layer
from CUDA-graph replays:

- a prefill chunk (80 tokens after 8,000 cached: the growing conversation's turn) for tiles (rows per
  program, keys per block, warps, stages) and key splits ("rule": `paged.splits_for`), against PyTorch's
  flash attention on the same keys laid out contiguously (the yardstick). The default tile
  (`paged.tile_for`) is the first row's "default";
- a batch-1 decode step of the 0.5B, 1B and 8B shapes at 640 and 4,096 keys: attention + combine for a
  given number of key splits, and as a captured decode graph runs it (its grid sized at capture for a 16k
  context, the keys per split set each step: the runner's rule, and with a floor of 256 / 512 / 1,024 keys
  per split), to choose the decode split rule.

    PYTHONPATH=src python3 benchmarks/gpu_paged_attention.py
"""

# ruff: noqa: B023  (each lambda is timed within the iteration that made it)

import dataclasses
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _util import graph_replay_ms
from onnxgen.backends.batch import BatchStep, SeqChunk
from onnxgen.backends.native import paged
from onnxgen.kv.storage import PageStorage

P, N, HKV, D, LAYERS = 16, 32, 8, 128, 8
DT = torch.bfloat16
TILES = [
    (64, 64, 4, 3),
    (128, 128, 8, 3),
    (128, 128, 8, 2),
    (128, 64, 8, 3),
    (64, 128, 8, 3),
    (128, 128, 8, 4),
]


def setup(
    shapes: list[tuple[int, int]], seed: int = 0, hkv: int = HKV, d: int = D
) -> tuple[PageStorage, paged.PagedStep]:
    rnd = random.Random(seed)
    need = sum(-(-(a + m) // P) for a, m in shapes)
    st = PageStorage(LAYERS, need + 1, P, hkv, d, DT, torch.device("cuda"))
    st.data.normal_()
    free = list(range(1, need + 1))
    rnd.shuffle(free)
    seqs = [
        SeqChunk(tokens=[0] * m, start=a, pages=[free.pop() for _ in range(-(-(a + m) // P))])
        for a, m in shapes
    ]
    return st, paged.build_step(BatchStep(tuple(seqs)), st, P, torch.device("cuda"))


def per_layer(fn) -> tuple[float, torch.Tensor]:  # type: ignore[no-untyped-def]
    ms, out = graph_replay_ms(lambda: [fn(layer) for layer in range(LAYERS)][-1])
    return ms / LAYERS, out


def prefill() -> None:
    start, m = 8000, 80
    st, ps = setup([(start, m)])
    q = torch.randn(m, N, D, device="cuda", dtype=DT)
    scale = D**-0.5
    base_ms, want = per_layer(lambda layer: paged.attention_triton(ps, layer, q, scale))
    rows = []
    for tile in TILES:
        for ns in (None, 3, 4, 6, 8, 11, 16, 22):
            ms, got = per_layer(
                lambda layer: paged.attention_triton(ps, layer, q, scale, nsplit=ns, tile=tile)
            )
            err = float((got.float() - want.float()).norm() / want.float().norm())
            rows.append((ms, tile, ns or "rule", err))
    # the yardstick: flash attention over the same keys, contiguous ([1, heads, positions, D])
    ks = [
        st.keys(layer)[ps.page_table[0, : -(-(start + m) // P)].long()].flatten(0, 1)[: start + m]
        for layer in range(LAYERS)
    ]
    vs = [
        st.values(layer)[ps.page_table[0, : -(-(start + m) // P)].long()].flatten(0, 1)[: start + m]
        for layer in range(LAYERS)
    ]
    kc = [k.transpose(0, 1).unsqueeze(0).contiguous() for k in ks]
    vc = [v.transpose(0, 1).unsqueeze(0).contiguous() for v in vs]
    qf = q.transpose(0, 1).unsqueeze(0).contiguous()
    fa_ms, _ = per_layer(
        lambda layer: torch.ops.aten._scaled_dot_product_flash_attention(
            qf, kc[layer], vc[layer], 0.0, is_causal=True, scale=scale
        )[0]
    )
    flops = 4 * m * N * (start + m / 2) * D
    print(
        f"\nprefill {m} tokens after {start}: default {base_ms * 1e3:.1f} us/layer; flash (contiguous) "
        f"{fa_ms * 1e3:.1f} us/layer ({flops / fa_ms / 1e9:.0f} TFLOP/s)"
    )
    print("| us/layer | TFLOP/s | BLOCK_M | BLOCK_N | warps | stages | splits | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for ms, tile, ns, err in sorted(rows, key=lambda r: r[0])[:15]:
        print(
            f"| {ms * 1e3:.1f} | {flops / ms / 1e9:.0f} | {' | '.join(map(str, tile))} | {ns} | {err:.1e} |"
        )


def decode() -> None:
    print(
        "\n| decode, batch 1 | keys | "
        + " | ".join(f"{k} splits" for k in (1, 2, 4, 8, 16, 32))
        + " | captured (splits planned for 16k) | worst rel err |"
    )
    print("|---|---|" + "---|" * 8)
    for name, n, hkv, d in (("0.5b", 14, 2, 64), ("1b", 32, 8, 64), ("8b", 32, 8, 128)):
        for length in (640, 4096):
            _st, ps = setup([(length - 1, 1)], hkv=hkv, d=d)
            q = torch.randn(1, n, d, device="cuda", dtype=DT)
            cells, worst = [], 0.0
            want = paged.attention_ref(ps, LAYERS - 1, q, d**-0.5).float()

            def check(out: torch.Tensor) -> None:
                nonlocal worst
                worst = max(worst, float((out.float() - want).norm() / want.norm()))

            for ns in (1, 2, 4, 8, 16, 32):
                ms, out = per_layer(lambda layer: paged.attention_triton(ps, layer, q, d**-0.5, nsplit=ns))
                cells.append(f"{ms * 1e3:.1f}")
                check(out)
            # a captured step: splits planned for the whole context, each sequence splitting its own keys
            g = dataclasses.replace(ps, plan_len=16384, _work={})
            ms, out = per_layer(lambda layer: paged.attention_triton(g, layer, q, d**-0.5))
            cells.append(f"{ms * 1e3:.1f}")
            check(out)
            print(f"| {name} | {length} | " + " | ".join(cells) + f" | {worst:.1e} |")


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    decode()
    prefill()
