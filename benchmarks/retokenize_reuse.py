"""Reuse across a chat turn whose reply re-tokenizes differently (issue 10, item 8).

Six two-turn chats on the default model (SmolLM2-135M-Instruct, greedy, 128 new tokens): turn 2 resends
the history with turn 1's reply as text. Reports, per chat, the tokens the session retained after turn 1,
how many turn 2 reused, and whether the reply's text re-tokenizes into the sampled ids.

    .venv/bin/python benchmarks/retokenize_reuse.py [--backend ort|native]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

QUESTIONS = [
    "Name three rivers in France.",
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "List three French cheeses.",
    "Give me two tips for learning to cook.",
    "Explain what a CPU does in one sentence.",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="ort")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    import onnxgen

    model = onnxgen.load(backend=a.backend, threads=2)
    rows, total_held, total_reused = [], 0, 0
    for q in QUESTIONS:
        s = model.session()
        history = [{"role": "user", "content": q}]
        r1 = s.generate(history, max_new_tokens=a.max_new_tokens, temperature=0)
        held = s.retained_tokens
        plain = model.encode_prompt(history + [{"role": "assistant", "content": r1.text}])
        sampled = [t for t in r1.tokens if t not in model.eos_token_ids]
        same = plain[len(r1.prompt_ids) : len(r1.prompt_ids) + len(sampled)] == sampled
        history += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "Tell me more."}]
        r2 = s.generate(history, max_new_tokens=4, temperature=0)
        rows.append((q, held, r2.stats.reused_tokens, same))
        total_held += held
        total_reused += r2.stats.reused_tokens
    print(
        f"\n{a.backend}: | chat | retained after turn 1 | reused on turn 2 | reply re-tokenizes to its ids |"
    )
    print("|---|---|---|---|")
    for q, held, reused, same in rows:
        print(f"| {q} | {held} | {reused} ({100 * reused / held:.0f} %) | {'yes' if same else 'no'} |")
    print(f"| all | {total_held} | {total_reused} ({100 * total_reused / total_held:.1f} %) | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
