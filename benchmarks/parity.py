"""Numerics: onnxgen's logits against transformers on builder-made packages, a retained session against a
fresh run, each lowered op against float64, and engines against each other (backends, int4 modes).

    python benchmarks/parity.py --model builder:2048x4,builder:1b --device cuda --sections logits
    python benchmarks/parity.py --model builder:8b --device cuda --sections logits,sessions
    python benchmarks/parity.py --model builder:1b --sections ops --device cuda --op-tokens 256,1024
    python benchmarks/parity.py --model convert:HF_DIR:int4@cpu --sections engines --steps 24 \\
        --engine backend=ort --engine backend=native,int4=packed --engine backend=native,int4=dense

Sections:
  logits    per model (needs its checkpoint: builder:* or convert:HF_DIR) and --lengths: a random prompt and
            --steps greedy steps of the first --engine, teacher-forced into transformers (onnxgen's tokens
            fed back). Error = ||logits - fp32 reference|| / ||reference|| at the prompt's last position
            ("first") and averaged over the steps ("mean"); transformers in bf16 on the same input is the
            yardstick for what bf16 arithmetic alone costs; argmax agreement counted where the reference's
            top-2 margin is clear (> 2x transformers-bf16's max |error| at that step)
  sessions  the last model: turn 2 on a retained session against the same request fresh (`reuse=False`), both
            against fp32; transformers-bf16 with a kept cache against its fresh run is the yardstick
  ops       the first model: each lowered op fed exact inputs rounded to its dtype, against float64
            (`onnxgen.backends.native.numerics`): the worst local / floor ratio per op type
  engines   every --engine against the first on one long chat prompt: greedy tokens equal, max relative
            logit difference per step
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util as u


def rel(a: Any, ref: Any) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm())


def hf_logits(model: Any, ids: list[int], keep: int, device: str) -> Any:
    import torch

    with torch.no_grad():
        x = torch.tensor([ids], device=device)
        return model(input_ids=x, logits_to_keep=keep).logits[0].double()


def logits(args: Any, pkgs: list[u.Package], opts: dict[str, Any]) -> tuple[str, str, Any]:
    import torch

    rows, data = [], []
    for pkg in pkgs:
        if pkg.hf is None:
            print(f"{pkg.name}: no checkpoint known (builder:* or convert:HF_DIR): skipped", flush=True)
            continue
        m32, m16 = u.hf_model(pkg.hf, "float32", args.device), u.hf_model(pkg.hf, "bfloat16", args.device)
        model = u.load(pkg, args.device, opts, args.threads)
        g = torch.Generator().manual_seed(1)
        for n in u.ints(args.lengths):
            n = min(n, model.spec.context_length - args.steps - 1)
            ids = torch.randint(100, model.spec.vocab_size - 100, (n,), generator=g).tolist()
            r = model.generate(
                ids,
                max_new_tokens=args.steps,
                temperature=0,
                speculative="off",
                output_logits=True,
                reuse=False,
            )
            got = torch.from_numpy(r.logits).double().to(args.device)
            k = got.shape[0]
            full = ids + r.tokens[: k - 1]
            ref, y16 = hf_logits(m32, full, k, args.device), hf_logits(m16, full, k, args.device)
            e_nat = [rel(got[i], ref[i]) for i in range(k)]
            e_16 = [rel(y16[i], ref[i]) for i in range(k)]
            top2 = ref.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * (y16 - ref).abs().amax(-1)
            agree = int(((got.argmax(-1) == ref.argmax(-1)) & clear).sum())
            row = {
                "model": pkg.name,
                "tokens": n,
                "native": e_nat,
                "bf16": e_16,
                "agree": agree,
                "clear": int(clear.sum()),
            }
            data.append(row)
            mean_n, mean_16 = statistics.mean(e_nat), statistics.mean(e_16)
            rows.append(
                [
                    pkg.name,
                    n,
                    f"{e_nat[0]:.4f} / {mean_n:.4f}",
                    f"{e_16[0]:.4f} / {mean_16:.4f}",
                    f"{e_nat[0] / e_16[0]:.2f} / {mean_n / mean_16:.2f}",
                    f"{row['agree']}/{row['clear']}",
                ]
            )
        model.close()
        del m32, m16, model
        u.release(args.device)
    header = [
        "model",
        "tokens",
        f"onnxgen error (first / mean of {args.steps})",
        "transformers-bf16 error",
        "ratio (first / mean)",
        "argmax agree (clear)",
    ]
    return "logits: against transformers fp32", u.table(rows, header), data


def hf_cached_turn(model: Any, turn1: list[int], reply: list[int], new: list[int], device: str) -> Any:
    """transformers with a kept cache, fed as a session feeds it: turn 1 prefilled, the reply decoded one token
    at a time (its last token never fed), then reply[-1] + the new tokens as one chunk: the last logits."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        kw = {"past_key_values": cache, "use_cache": True, "logits_to_keep": 1}
        model(input_ids=torch.tensor([turn1], device=device), **kw)
        for t in reply[:-1]:
            model(input_ids=torch.tensor([[t]], device=device), **kw)
        out = model(input_ids=torch.tensor([reply[-1:] + new], device=device), **kw)
    return out.logits[0, -1].double()


def sessions(args: Any, pkg: u.Package, opts: dict[str, Any]) -> tuple[str, str, Any]:
    import torch

    if pkg.hf is None:
        raise SystemExit(f"sessions: {pkg.name} has no known checkpoint (builder:* or convert:HF_DIR)")
    model = u.load(pkg, args.device, opts, args.threads)
    m32, m16 = u.hf_model(pkg.hf, "float32", args.device), u.hf_model(pkg.hf, "bfloat16", args.device)
    g = torch.Generator().manual_seed(2)
    rows, data = [], []
    kw = {"max_new_tokens": 16, "temperature": 0, "speculative": "off", "output_logits": True}
    for n in u.ints(args.session_contexts):
        s = model.session()
        turn1 = torch.randint(100, model.spec.vocab_size - 100, (n - 80,), generator=g).tolist()
        r1 = s.generate(turn1, max_new_tokens=16, temperature=0, speculative="off")
        new = torch.randint(100, model.spec.vocab_size - 100, (64,), generator=g).tolist()
        turn2 = turn1 + r1.tokens + new
        a = s.generate(turn2, **kw)
        b = model.generate(turn2, reuse=False, **kw)
        s.close()
        la, lb = torch.from_numpy(a.logits[:1]).double(), torch.from_numpy(b.logits[:1]).double()
        ref = hf_logits(m32, turn2, 1, args.device).cpu()
        cached = hf_cached_turn(m16, turn1, r1.tokens, new, args.device).cpu()
        fresh = hf_logits(m16, turn2, 1, args.device)[-1].cpu()
        row = {
            "context": len(turn2),
            "reused": a.stats.reused_tokens,
            "gap": rel(la[0], lb[0]),
            "hf16_gap": rel(cached, fresh),
            "retained_vs_fp32": rel(la[0], ref[0]),
            "fresh_vs_fp32": rel(lb[0], ref[0]),
            "hf16_cached_vs_fp32": rel(cached, ref[0]),
            "hf16_fresh_vs_fp32": rel(fresh, ref[0]),
            "tokens_equal": a.tokens == b.tokens,
        }
        data.append(row)
        rows.append(
            [
                row["context"],
                row["reused"],
                f"{row['gap']:.4f}",
                f"{row['hf16_gap']:.4f}",
                f"{row['retained_vs_fp32']:.4f} / {row['fresh_vs_fp32']:.4f}",
                f"{row['hf16_cached_vs_fp32']:.4f} / {row['hf16_fresh_vs_fp32']:.4f}",
                "yes" if row["tokens_equal"] else "no",
            ]
        )
    model.close()
    header = [
        "context",
        "reused",
        "retained vs fresh",
        "transformers-bf16 cached vs fresh",
        "vs fp32: retained / fresh",
        "transformers-bf16 vs fp32: cached / fresh",
        "16 greedy tokens equal",
    ]
    return f"sessions: {pkg.name}, turn 2 retained against fresh", u.table(rows, header), data


def ops(args: Any, pkg: u.Package) -> tuple[str, str, Any]:
    import torch

    try:
        from onnxgen.backends.native import numerics
    except ImportError as exc:
        raise SystemExit(f"ops: the per-op harness is not importable in this tree ({exc})") from None
    torch.set_grad_enabled(False)
    rows, data = [], {}
    for n in u.ints(args.op_tokens):
        measured = numerics.measure(str(pkg.path), n, args.device)
        data[n] = measured
        for op, grp in sorted(numerics.by_op(measured).items(), key=lambda kv: -kv[1]["worst"]["ratio"]):
            w = grp["worst"]
            rows.append(
                [n, op, grp["nodes"], f"{grp['median']:.2f}", f"{w['ratio']:.2f}", f"{w['node']}:{w['out']}"]
            )
    header = ["tokens", "op", "nodes", "median local / floor", "worst", "worst node"]
    return f"ops: {pkg.name}, each op against float64", u.table(rows, header), data


def engines(args: Any, pkg: u.Package, specs: dict[str, dict[str, Any]]) -> tuple[str, str, Any]:
    import numpy as np

    from speculative import DOC

    msgs = [{"role": "user", "content": ("Summarise these notes. " + DOC + " ") * args.repeat}]
    kw = {
        "max_new_tokens": args.steps,
        "temperature": 0,
        "reuse": False,
        "output_logits": True,
        "speculative": "off",
    }
    results = {}
    for k, o in specs.items():
        m = u.load(pkg, args.device, o, args.threads)
        ids = (
            m.encode(msgs)
            if m.chat_template is not None
            else u.random_ids(40 * args.repeat, m.spec.vocab_size, 5)
        )
        results[k] = m.generate(ids, **kw)
        m.close()
        del m
        u.release(args.device)
    ref_k = next(iter(results))
    ref = results[ref_k]
    rows, data = [], {}
    for k, r in results.items():
        steps = min(len(r.tokens), len(ref.tokens))
        same = next((i for i in range(steps) if r.tokens[i] != ref.tokens[i]), steps)
        a, b = r.logits[: same + 1], ref.logits[: same + 1]  # teacher-forced while the tokens agree
        d = float((np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)).max())
        data[k] = {"same_tokens": same, "steps": steps, "max_rel": d}
        rows.append([k, f"{same}/{steps}", f"{d:.2e}"])
    header = ["engine", "greedy tokens equal", f"max relative logit difference vs {ref_k}"]
    return f"engines: {pkg.name}, {len(ref.prompt_ids)}-token prompt", u.table(rows, header), data


def main() -> int:
    ap = u.parser(__doc__, model="builder:2048x4", runs=1)
    ap.add_argument("--sections", default="logits")
    ap.add_argument("--lengths", default="16,256,1024,2048,4096,8192")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--session-contexts", default="2048,8000")
    ap.add_argument("--op-tokens", default="256,1024")
    ap.add_argument("--repeat", type=int, default=14, help="engines: the notes repeated (prompt length)")
    args = ap.parse_args()
    args.dry_run = True  # nothing here is timed: --runs does not apply
    u.check_args(ap, args)
    u.require_cuda(args.device, "parity.py")
    u.set_threads(args.threads)
    pkgs = u.models(args)
    specs = u.engines(args.engine, default=("backend=native",))
    first = dict(next(iter(specs.values())))
    if args.device == "cuda":
        first.setdefault("kv_bytes", 8 << 30)  # room for transformers beside it
    tables, data = [], {}
    for name in args.sections.split(","):
        if name == "logits":
            out = logits(args, pkgs, first)
        elif name == "sessions":
            out = sessions(args, pkgs[-1], first)
        elif name == "ops":
            out = ops(args, pkgs[0])
        elif name == "engines":
            out = engines(args, pkgs[0], specs)
        else:
            ap.error(f"unknown section {name!r}")
        tables.append(out[:2])
        data[name] = out[2]
    u.report(f"{u.describe(args.device, args.threads)}; greedy", tables, args, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
