"""Probe (issue 13): why the attention's last-split merge (`kernels.MERGE_IN_ATTENTION`) is slower than the
combine launch it replaces. A batch-1 decode step of the 0.5B and 1B shapes, splits planned for a 16k context
as a captured decode graph plans them, GPU µs per layer (8 layers of distinct KV, CUDA-graph replays) with the
merge off and on (8 and 16 splits' partials loaded at once), and the registers / spills of each compiled
attention kernel.

    PYTHONPATH=src python3 benchmarks/gpu_merge_probe.py
"""

# ruff: noqa: B023  (each lambda is timed within the iteration that made it)

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_paged_attention import DT, per_layer, setup
from onnxgen.backends.native import kernels, paged
from onnxgen.backends.native import triton_paged as tp


def compiled(fn) -> list[str]:  # type: ignore[no-untyped-def]
    """Registers and spills of every compiled variant of a Triton kernel (best effort)."""
    out = []
    try:
        for cache in fn.device_caches.values():
            for ck in cache[0].values():
                c = ck.metadata.constants if hasattr(ck.metadata, "constants") else {}
                out.append(f"regs {ck.n_regs} spills {ck.n_spills} MERGE={c.get('MERGE', '?')} "
                           f"warps {ck.metadata.num_warps} shared {ck.metadata.shared}")  # fmt: skip
    except Exception as exc:  # a probe: report what could not be read
        out.append(f"(no metadata: {exc!r})")
    return out


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print("| shape | keys | merge off µs/layer | merge on, 8 splits a load µs/layer | 16 a load | rel diff off/on |"
          " 8 vs 16 |")
    print("|---|---|---|---|---|---|---|")
    for name, n, hkv, d in (("0.5b", 14, 2, 64), ("1b", 32, 8, 64)):
        for length in (528, 4096):
            _st, ps = setup([(length - 1, 1)], hkv=hkv, d=d)
            g = dataclasses.replace(ps, plan_len=16384, _work={})
            q = torch.randn(1, n, d, device="cuda", dtype=DT)
            res: dict[int, list] = {}
            for unroll in (0, 8, 16, 0, 8, 16):  # 0: the merge off (the combine launch)
                kernels.MERGE_IN_ATTENTION = unroll > 0
                kernels.MERGE_UNROLL = unroll or 8
                ms, out = per_layer(lambda layer: paged.attention_triton(g, layer, q, d**-0.5))
                res.setdefault(unroll, []).append((ms, out))
            best = {u: min(r[0] for r in rs) * 1e3 for u, rs in res.items()}
            a, b, c = (res[u][0][1].float() for u in (0, 8, 16))
            diff = float((a - b).norm() / a.norm())
            same = "same bits" if torch.equal(b, c) else f"{float((b - c).norm() / b.norm()):.1e}"
            print(f"| {name} | {length} | {best[0]:.2f} | {best[8]:.2f} | {best[16]:.2f} | {diff:.1e} | {same} |")
    kernels.MERGE_IN_ATTENTION = False
    kernels.MERGE_UNROLL = 8
    print("paged_attn_kernel:", *compiled(tp.paged_attn_kernel), sep="\n  ")
    print("paged_combine_kernel:", *compiled(tp.paged_combine_kernel), sep="\n  ")


if __name__ == "__main__":
    main()
