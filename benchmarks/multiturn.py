"""A 10-turn chat on one model: per-turn TTFT with session reuse, with a fresh prefill, and with
onnxruntime-genai's manual append (one Generator kept across turns), in the same run.

The conversation is fixed first (greedy replies, --reply-tokens each), so every contender sees the
same token sequences. Each contender replays the whole conversation --runs times (>= 5), interleaved;
the table shows per-turn medians. Equal intra-op threads everywhere.

    python benchmarks/multiturn.py [MODEL] --backends ort,native --threads 2 --runs 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import onnxgen
from _util import genai_model, machine, median, table
from onnxgen.convert.default import resolve_model_path
from onnxgen.engine.reuse import common_prefix

QUESTIONS = [
    "Hi! I'm planning a trip to Paris next spring. What should I see first?",
    "How many days would you recommend staying?",
    "What is a good neighbourhood to stay in?",
    "Which museums are worth it if I only have one afternoon?",
    "What local food should I try?",
    "Is the metro easy to use for tourists?",
    "Can you suggest a day trip outside the city?",
    "What should I pack for the weather in April?",
    "Any tips for saving money while there?",
    "Thanks! Can you summarise the plan in three bullet points?",
]
SYSTEM = (
    "You are a friendly, concise travel assistant. Answer in short paragraphs. " * 40
)  # long, as agents have


def build_conversation(model, reply_tokens: int) -> list[list[dict[str, str]]]:
    """Per turn, the messages sent (history + new question), with greedy replies filled in."""
    msgs = [{"role": "system", "content": SYSTEM}]
    turns = []
    for q in QUESTIONS:
        msgs = [*msgs, {"role": "user", "content": q}]
        turns.append(msgs)
        r = model.generate(msgs, max_new_tokens=reply_tokens, reuse=False)
        msgs = [*msgs, {"role": "assistant", "content": r.text}]
    return turns


def run_session(model, prompts, reply_tokens) -> list[float]:
    """Each turn's token ids (as onnxruntime-genai gets them: equal tokenisation work on both sides)."""
    s = model.session()
    out = []
    for ids in prompts:
        r = s.generate(ids, max_new_tokens=reply_tokens)
        out.append(r.stats.ttft_s)
    s.close()
    return out


def run_fresh(model, prompts) -> list[float]:
    return [model.generate(ids, max_new_tokens=1, reuse=False).stats.ttft_s for ids in prompts]


def run_genai(og_model, prompts: list[list[int]], reply_tokens: int) -> list[float]:
    """One Generator across turns; each turn appends what its sequence lacks (rewinding to the
    common prefix first when re-tokenisation differs, then appending)."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(og_model)
    params.set_search_options(do_sample=False, max_length=len(prompts[-1]) + reply_tokens + 8)
    gen = og.Generator(og_model, params)
    seq: list[int] = []
    out = []
    for ids in prompts:
        t0 = time.perf_counter()
        keep = min(common_prefix(seq, ids), len(ids) - 1)
        if keep < len(seq):
            gen.rewind_to(keep)
            seq = seq[:keep]
        gen.append_tokens(ids[keep:])
        seq = list(ids)
        gen.generate_next_token()
        tok = int(gen.get_next_tokens()[0])
        out.append(time.perf_counter() - t0)
        n = 1
        while n < reply_tokens and not gen.is_done():
            seq.append(tok)
            gen.generate_next_token()
            tok = int(gen.get_next_tokens()[0])
            n += 1
        seq.append(tok)  # the last sampled token (EOS included) is not yet in the generator's KV
        seq = seq[:-1]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--backends", default="ort,native")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--reply-tokens", type=int, default=32)
    args = ap.parse_args()
    path = str(resolve_model_path(args.model))
    import torch

    torch.set_num_threads(args.threads)
    models = {}
    for b in args.backends.split(","):
        opts = {"threads": args.threads} if b == "ort" else {}
        models[b] = onnxgen.load(path, backend=b, **opts)
    first = next(iter(models.values()))
    turns = build_conversation(first, args.reply_tokens)
    prompts = [first.encode_prompt(t) for t in turns]
    og_model = genai_model(path, args.threads)
    contenders = {
        f"{b} reuse": (lambda m=m: run_session(m, prompts, args.reply_tokens)) for b, m in models.items()
    }
    contenders |= {f"{b} fresh": (lambda m=m: run_fresh(m, prompts)) for b, m in models.items()}
    contenders["ort-genai append"] = lambda: run_genai(og_model, prompts, args.reply_tokens)
    for fn in contenders.values():
        fn()  # warm-up
    samples: dict[str, list[list[float]]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(args.runs):
        for name in names if r % 2 == 0 else reversed(names):
            samples[name].append(contenders[name]())
    med = {k: [median([run[t] for run in v]) for t in range(len(turns))] for k, v in samples.items()}
    header = ["turn", "prompt tokens", *[f"{k} ms" for k in names]]
    rows = [
        [str(t + 1), str(len(prompts[t])), *[f"{med[k][t] * 1000:.1f}" for k in names]]
        for t in range(len(turns))
    ]
    print(
        f"\nmodel: {path}\nmachine: {machine()}; threads {args.threads}; median of {args.runs} interleaved runs; "
        f"{args.reply_tokens} reply tokens per turn\n"
    )
    print(table(rows, header))
    print()
    for b in models:
        t2 = med[f"{b} reuse"][1]
        print(
            f"turn 2, {b}: reuse {t2 * 1000:.1f} ms; vs fresh {med[f'{b} fresh'][1] / t2:.1f}x faster; "
            f"vs ort-genai append {t2 / med['ort-genai append'][1]:.2f}x its TTFT"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
