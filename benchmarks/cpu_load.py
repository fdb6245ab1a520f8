"""Turn 2 of a chat on the CPU, quiet and with one core busy: onnxgen (ort backend, session reuse, messages
in) against onnxruntime-genai's manual append (one Generator kept across turns) on the same package.

    .venv/bin/python benchmarks/cpu_load.py [MODEL] --runs 7 [--threads N] [--load 1]

Turn 1 is a long system prompt and a question, replied to greedily (--reply-tokens); turn 2 appends the reply
and a short question, so most of its prompt is cached on both sides. Timed: turn 2's time to first token
(onnxgen: `Session.generate` from messages, tokenization included; the peer: append + first token of the ids
onnxgen encoded). A third contender is onnxgen with `spinning=True` (onnxruntime's default, onnxgen's before). Each run replays turn 1 untimed first. Both at their default thread counts unless
--threads is given. Phases: quiet, then --load busy processes (`while True: pass`, one per core named),
contenders interleaved within each phase, median of --runs. Ratios are onnxgen / peer.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import onnxgen
from _util import genai_model, interleave, machine, table
from onnxgen.convert.default import resolve_model_path
from onnxgen.engine.reuse import common_prefix

SYSTEM = "You are a friendly, concise travel assistant. Answer in short paragraphs. " * 40
TURN1 = "Hi! I'm planning a trip to Paris next spring. What should I see first?"
TURN2 = "How many days would you recommend staying?"


def _spin() -> None:  # the unrelated process that keeps a core busy
    while True:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--load", type=int, default=1, help="busy processes in the loaded phase")
    ap.add_argument("--reply-tokens", type=int, default=32)
    args = ap.parse_args()
    import onnxruntime_genai as og

    path = str(resolve_model_path(args.model))
    threads = {"threads": args.threads} if args.threads else {}
    ours = onnxgen.load(path, backend="ort", **threads)
    spinning = onnxgen.load(path, backend="ort", spinning=True, **threads)  # onnxruntime's default
    theirs = genai_model(path, args.threads)
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURN1}]
    reply = ours.generate(turn1, max_new_tokens=args.reply_tokens, temperature=0, reuse=False).text
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": TURN2}]

    def onnxgen_turn2(model=ours) -> tuple[float, int, int]:
        s = model.session()
        s.generate(turn1, max_new_tokens=args.reply_tokens, temperature=0)
        t0 = time.perf_counter()
        r = s.generate(turn2, max_new_tokens=1, temperature=0)
        dt = time.perf_counter() - t0
        s.close()
        return dt, r.stats.prompt_tokens, r.stats.reused_tokens

    ids1 = ours.encode_prompt(turn1)
    ids2 = ours.encode_prompt(turn2)

    def genai_turn2() -> tuple[float, int, int]:
        params = og.GeneratorParams(theirs)
        params.set_search_options(do_sample=False, max_length=len(ids2) + 8)
        gen = og.Generator(theirs, params)
        gen.append_tokens(ids1)
        seq = list(ids1)
        for _ in range(args.reply_tokens):
            gen.generate_next_token()
            seq.append(int(gen.get_next_tokens()[0]))
            if gen.is_done():
                break
        seq = seq[:-1]  # the last sampled token is not in the KV yet
        t0 = time.perf_counter()
        keep = min(common_prefix(seq, ids2), len(ids2) - 1)
        if keep < len(seq):
            gen.rewind_to(keep)
        gen.append_tokens(ids2[keep:])
        gen.generate_next_token()
        gen.get_next_tokens()
        return time.perf_counter() - t0, len(ids2), keep

    contenders = {
        "onnxgen (ort, reuse)": onnxgen_turn2,
        "ort-genai append": genai_turn2,
        "onnxgen, spinning threads": lambda: onnxgen_turn2(spinning),
    }
    for fn in contenders.values():
        fn()  # warm-up
    rows = []
    shape = None
    for phase, busy in (("quiet", 0), (f"{args.load} core(s) busy", args.load)):
        procs = [mp.Process(target=_spin, daemon=True) for _ in range(busy)]
        for p in procs:
            p.start()
        time.sleep(0.5 if busy else 0)
        try:
            samples = interleave(args.runs, contenders)
            times = {k: [dt for dt, _, _ in v] for k, v in samples.items()}
            _, n, cached = samples["onnxgen (ort, reuse)"][-1]
            shape = (n, cached)
        finally:
            for p in procs:
                p.terminate()
                p.join()
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        ours_ms, peer_ms, spin_ms = (
            med["onnxgen (ort, reuse)"],
            med["ort-genai append"],
            med["onnxgen, spinning threads"],
        )
        rows.append(
            [
                phase,
                f"{ours_ms:.1f}",
                f"{min(times['onnxgen (ort, reuse)']) * 1000:.1f}",
                f"{peer_ms:.1f}",
                f"{min(times['ort-genai append']) * 1000:.1f}",
                f"{ours_ms / peer_ms:.2f}x",
                f"{spin_ms:.1f}",
                f"{spin_ms / peer_ms:.2f}x",
            ]
        )
    print(
        f"\nmodel: {path}\nmachine: {machine()}; threads {args.threads or 'default'}; median of {args.runs} "
        f"interleaved runs; turn 2 = {shape[0]} prompt tokens, {shape[1]} cached\n"
    )
    print(
        table(
            rows,
            [
                "phase",
                "onnxgen ms",
                "min",
                "ort-genai ms",
                "min",
                "onnxgen / peer",
                "spinning ms",
                "spinning / peer",
            ],
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
