"""Per-op numerical error of the native backend against a float64 evaluation of the same graph.

The package's graph is lowered twice: once as the native backend runs it (the package's dtype, on
`--device`) and once on the CPU with every floating weight upcast to float64 (the reference). Both
run one prompt in lockstep. Each op of the tested program is fed the *reference* inputs (cast to the
dtype and device the tested op sees), so its error is its own, not inherited from earlier ops:

    local = ||op_test(x) - ref_out|| / ||ref_out||                x = cast(ref_inputs)
    floor = ||cast(op_exact(x)) - ref_out|| / ||ref_out||        exact arithmetic on x, one rounding

An op that accumulates in fp32 and rounds once lands at its floor (ratio ~1); an op that rounds
intermediates to bf16 or reduces in bf16 shows a ratio above 1 that grows with the reduction length. The
table lists, per op type, the worst ratio and where it occurred, then the worst single nodes.

Used by `benchmarks/parity.py --sections ops` (a table per op type) and by the parity tests (every op at its
floor).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch


def _f64_program(spec: Any) -> Any:
    from onnxgen.backends.native.lowering import lower

    prog = lower(spec.decoder_path, spec, torch.device("cpu"), fuse=False)
    prog.consts = {s: (t.double() if t.dtype.is_floating_point else t) for s, t in prog.consts.items()}
    return prog


def _up(x: Any) -> Any:
    """A value as the float64 CPU reference sees it (floating tensors upcast, every tensor on the CPU)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64 if x.dtype.is_floating_point else x.dtype)
    return x


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    d = float(torch.linalg.vector_norm(a.double().cpu() - ref))
    n = float(torch.linalg.vector_norm(ref))
    return d / n if n > 0 else d


def measure(pkg: str, tokens: int, device: str, seed: int = 0) -> list[dict[str, Any]]:
    """Run a random prompt of `tokens` ids in lockstep; one row per floating op output."""
    from onnxgen.backends.native.decoder import NativeDecoder
    from onnxgen.backends.native.ops import RunCtx
    from onnxgen.kv.buffers import KVBuffers
    from onnxgen.package.spec import load_spec

    spec = load_spec(pkg)
    from onnxgen.backends.native.lowering import lower

    test = NativeDecoder(spec, device, cuda_graphs=False)
    ref_prog = _f64_program(spec)
    tp = lower(spec.decoder_path, spec, test._dev, fuse=False)  # one op per node: each op's own error
    assert [s.node.name for s in tp.steps] == [s.node.name for s in ref_prog.steps], "programs differ"
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, spec.vocab_size - 100, (tokens,), generator=g)
    dev = test._dev
    ref_kv = KVBuffers(spec.num_layers, spec.num_kv_heads, spec.head_size, torch.float64, torch.device("cpu"))
    ref_kv.reserve(tokens)
    test.kv.reserve(tokens)
    ctx_r = RunCtx(ref_kv, 0, tokens, torch.arange(tokens))
    ctx_t = RunCtx(test.kv, 0, tokens, torch.arange(tokens, device=dev))
    env_r: list[Any] = [None] * ref_prog.nslots
    meta: dict[int, tuple[torch.dtype, torch.device]] = {}  # slot -> (dtype, device) the tested program uses
    for s, t in ref_prog.consts.items():
        env_r[s] = t
    for s, t in tp.consts.items():
        meta[s] = (t.dtype, t.device)
    inputs = {spec.input_ids_name: ids.view(1, -1)}
    if spec.attention_mask_name:
        inputs[spec.attention_mask_name] = torch.ones((1, tokens), dtype=torch.int64)
    if spec.position_ids_name:
        inputs[spec.position_ids_name] = torch.arange(tokens).view(1, -1)
    for name, v in inputs.items():
        if name in ref_prog.input_slots:
            env_r[ref_prog.input_slots[name]] = v
            dv = torch.device("cpu") if name == spec.attention_mask_name else dev
            meta[tp.input_slots[name]] = (v.dtype, dv)
    rows: list[dict[str, Any]] = []
    for st_t, st_r in zip(tp.steps, ref_prog.steps, strict=True):
        args_r = [env_r[i] if i >= 0 else None for i in st_r.ins]
        args_t = []
        for i, a in zip(st_t.ins, args_r, strict=True):
            if i >= 0 and i in tp.consts:
                args_t.append(tp.consts[i])
            elif isinstance(a, torch.Tensor):
                dt, dv = meta.get(i, (a.dtype, dev))
                args_t.append(a.to(dv, dt))
            else:
                args_t.append(a)
        # the ideal op: exact arithmetic on the inputs the tested op sees (copied first: ops may write
        # into a dead input; run before the exact run so that its KV writes are the ones that stay)
        out_i = st_r.fn(ctx_r, *[_up(a).clone() if isinstance(a, torch.Tensor) else a for a in args_t])
        out_i = [_up(v) for v in out_i]
        out_t = st_t.fn(ctx_t, *args_t)
        out_r = st_r.fn(ctx_r, *args_r)
        for k, (o, vt, vr, vi) in enumerate(zip(st_t.outs, out_t, out_r, out_i, strict=False)):
            if o < 0 or vr is None:
                continue
            env_r[o] = _up(vr)
            meta[o] = (vt.dtype, vt.device)
            if vt.dtype.is_floating_point and vt.numel() > 1:
                ref = env_r[o]
                local = _rel(vt, ref)
                floor = _rel(vi.to(vt.dtype), ref)
                rows.append(
                    {
                        "node": st_t.node.name,
                        "op": st_t.node.op,
                        "out": k,
                        "local": local,
                        "floor": floor,
                        "ratio": local / floor if floor > 0 else (0.0 if local == 0 else float("inf")),
                    }
                )
        for f in st_r.frees:
            env_r[f] = None
    return rows


def by_op(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per op type: node count, median and worst ratio, and the worst row."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r["op"]].append(r)
    out = {}
    for op, rs in groups.items():
        ratios = sorted(r["ratio"] for r in rs)
        out[op] = {
            "nodes": len(rs),
            "median": ratios[len(rs) // 2],
            "worst": max(rs, key=lambda r: r["ratio"]),
        }
    return out
