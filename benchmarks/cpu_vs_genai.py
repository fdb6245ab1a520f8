"""onnxgen against onnxruntime-genai on the CPU, on the same package with the same intra-op threads:
load time, time to first token and decode speed of single requests, and turn 2 of a chat (the first
turn's KV kept on both sides) on a quiet machine and with cores busy.

    python benchmarks/cpu_vs_genai.py [--model default] [--engine backend=ort] [--engine backend=native]
        [--sections load,single,turn2] [--threads 2] [--runs 7] [--new-tokens 64] [--busy 1]

Sections (each contender interleaved with the others, the order reversed every other round, median of --runs):
  load    seconds from `onnxgen.load` / `og.Model` to a ready model, each in a fresh process
  single  a short and a long chat prompt, greedy, fresh state each run (`reuse=False`): TTFT (prompt in,
          first token out) and decode tok/s over --new-tokens
  turn2   a long system prompt, a question and the greedy --reply-tokens reply, then a second question:
          turn 2's TTFT with the session kept (onnxgen: `Session.generate` from messages, tokenization
          included) against one onnxruntime-genai Generator kept from turn 1 with the new ids appended;
          quiet, then with --busy processes spinning (`while True: pass`)
Contenders: each --engine (default `backend=ort`) and onnxruntime-genai. Ratios are onnxgen's time over the
peer's (below 1: onnxgen faster) or its tok/s over the peer's (above 1: faster).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util as u

SHORT = "What is the capital of France?"
LONG = (
    "Here is a description of a small town. " * 3
    + "The town has a river, a bakery, a school, a library and a market that opens every Saturday. " * 12
    + "Summarise the description above in three sentences."
)
SYSTEM = "You are a friendly, concise travel assistant. Answer in short paragraphs. " * 40
TURN1 = "Hi! I'm planning a trip to Paris next spring. What should I see first?"
TURN2 = "How many days would you recommend staying?"
PEER = "onnxruntime-genai"


def _spin() -> None:  # an unrelated process that keeps a core busy
    while True:
        pass


def genai_single(model: Any, ids: list[int], new: int) -> dict[str, float]:
    """Greedy generation with onnxruntime-genai: TTFT (append + first token) and decode tok/s."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + new + 1)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(ids)
    gen.generate_next_token()
    gen.get_next_tokens()
    t1 = time.perf_counter()
    n = 1
    while n < new and not gen.is_done():
        gen.generate_next_token()
        gen.get_next_tokens()
        n += 1
    t2 = time.perf_counter()
    return {"ttft_ms": (t1 - t0) * 1e3, "tok_s": (n - 1) / (t2 - t1) if n > 1 else 0.0, "tokens": n}


def genai_turn2(model: Any, ids1: list[int], ids2: list[int], reply: int) -> float:
    """Turn 1 on a kept Generator (untimed), then turn 2's new ids appended: ms to its first token."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids2) + 8)
    gen = og.Generator(model, params)
    gen.append_tokens(ids1)
    seq = list(ids1)
    for _ in range(reply):
        gen.generate_next_token()
        seq.append(int(gen.get_next_tokens()[0]))
        if gen.is_done():
            break
    seq = seq[:-1]  # the last sampled token is not in its KV yet
    t0 = time.perf_counter()
    keep = min(u.common_prefix(seq, ids2), len(ids2) - 1)
    if keep < len(seq):
        gen.rewind_to(keep)
    gen.append_tokens(ids2[keep:])
    gen.generate_next_token()
    gen.get_next_tokens()
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    ap = u.parser(__doc__, runs=7)
    ap.add_argument("--sections", default="load,single,turn2")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument(
        "--busy", type=int, default=1, help="busy processes in turn2's loaded phase (0: quiet only)"
    )
    ap.add_argument("--no-genai", action="store_true", help="onnxgen's engines only")
    ap.add_argument("--load-worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_worker:  # a child of the load section: print the seconds one load takes
        path, spec, threads = args.load_worker
        t0 = time.perf_counter()
        if spec == PEER:
            u.genai_model(Path(path), int(threads))
        else:
            opts = u.options(spec)
            opts.pop("label", None)
            u.load(Path(path), "cpu", opts, int(threads))
        print(time.perf_counter() - t0)
        return 0
    u.check_args(ap, args)
    if args.device != "cpu":
        ap.error("this tool compares CPU runtimes: --device cpu")
    u.set_threads(args.threads)
    pkg = u.models(args)[0]
    specs = u.engines(args.engine, default=("backend=ort",))
    specs_text = list(zip(specs, args.engine or ["backend=ort"], strict=True))
    sections = args.sections.split(",")
    ours = {label: u.load(pkg, "cpu", opts, args.threads) for label, opts in specs.items()}
    first = next(iter(ours.values()))
    theirs = None if args.no_genai else u.genai_model(pkg.path, args.threads)
    rows: list[list[str]] = []
    data: dict[str, Any] = {"model": str(pkg.path), "machine": u.describe("cpu", args.threads)}

    def add(section: str, case: str, samples: dict[str, list[dict[str, float]]], key: str, unit: str) -> None:
        med = {k: {m: u.median(s[m] for s in v) for m in v[0]} for k, v in samples.items()}
        data.setdefault(section, {})[case] = med
        peer = med.get(PEER, {})
        for name, m in med.items():
            vs = "-" if name == PEER or not peer else u.ratio(m[key], peer[key])
            tps = m.get("tok_s")
            if tps is not None and name != PEER and peer.get("tok_s"):
                vs += f" (decode {u.ratio(tps, peer['tok_s'])})"
            rows.append([section, case, name, f"{m[key]:,.1f} {unit}", u.fmt(tps), vs])

    if "load" in sections:  # each load in a fresh process: an engine in this one shares loaded weights
        contenders = {
            label: (lambda s=s: {"s": _load_time(pkg.path, s, args.threads)}) for label, s in specs_text
        }
        if theirs is not None:
            contenders[PEER] = lambda: {"s": _load_time(pkg.path, None, args.threads)}
        add("load", "ready model", u.interleave(args.runs, contenders), "s", "s")
    if "single" in sections:
        for case, text in (("short chat", SHORT), ("long chat", LONG)):
            ids = first.encode_prompt([{"role": "user", "content": text}])

            def run(m: Any, ids: list[int] = ids) -> dict[str, float]:
                r = m.generate(ids, max_new_tokens=args.new_tokens, reuse=False, stop=[], temperature=0)
                return {
                    "ttft_ms": r.stats.ttft_s * 1e3,
                    "tok_s": r.stats.decode_tok_s,
                    "tokens": len(r.tokens),
                }

            contenders = {label: (lambda m=m: run(m)) for label, m in ours.items()}
            if theirs is not None:
                contenders[PEER] = lambda ids=ids: genai_single(theirs, ids, args.new_tokens)
            for fn in contenders.values():
                fn()  # warm-up
            add(
                "single",
                f"{case} ({len(ids)} tokens)",
                u.interleave(args.runs, contenders),
                "ttft_ms",
                "ms TTFT",
            )
    if "turn2" in sections:
        turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURN1}]
        reply = first.generate(turn1, max_new_tokens=args.reply_tokens, temperature=0, reuse=False).text
        turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": TURN2}]
        ids1, ids2 = first.encode_prompt(turn1), first.encode_prompt(turn2)

        def ours_turn2(m: Any) -> dict[str, float]:
            s = m.session()
            s.generate(turn1, max_new_tokens=args.reply_tokens, temperature=0)
            r = s.generate(turn2, max_new_tokens=1, temperature=0)
            s.close()
            return {"ms": r.stats.ttft_s * 1e3, "reused": r.stats.reused_tokens}

        contenders = {label: (lambda m=m: ours_turn2(m)) for label, m in ours.items()}
        if theirs is not None:
            contenders[PEER] = lambda: {"ms": genai_turn2(theirs, ids1, ids2, args.reply_tokens)}
        for fn in contenders.values():
            fn()  # warm-up
        for busy in (0, args.busy) if args.busy else (0,):
            procs = [mp.Process(target=_spin, daemon=True) for _ in range(busy)]
            for p in procs:
                p.start()
            time.sleep(0.5 if busy else 0)
            try:
                samples = u.interleave(args.runs, contenders)
            finally:
                for p in procs:
                    p.terminate()
                    p.join()
            phase = "quiet" if not busy else f"{busy} core(s) busy"
            add("turn2", f"{len(ids2)} tokens, {phase}", samples, "ms", "ms TTFT")
    u.report(
        f"model: {pkg.name} ({pkg.path}); {u.describe('cpu', args.threads)}; median of {args.runs} interleaved "
        f"runs; greedy",
        [
            (
                "",
                u.table(
                    rows, ["section", "case", "contender", "time", "decode tok/s", "vs onnxruntime-genai"]
                ),
            )
        ],
        args,
        data,
    )
    return 0


def _load_time(path: Path, spec: str | None, threads: int) -> float:
    """Seconds one load takes in a fresh process (`spec`: an engine's options; None: onnxruntime-genai)."""
    cmd = [sys.executable, __file__, "--load-worker", str(path), PEER if spec is None else spec, str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"loading in a child process failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
