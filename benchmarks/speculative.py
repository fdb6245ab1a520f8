"""Speculative decoding by prompt lookup against plain decoding, same engine, same run, CPU or CUDA.

    python benchmarks/speculative.py [--model default] [--engine backend=ort] [--runs 5] [--tokens 128]
    python benchmarks/speculative.py --model convert:/tmp/gg/m.gguf:bf16 --device cuda --mix
    python benchmarks/speculative.py --engine "" --engine spec_decode_steps=4 --engine speculate_alone=false

Workloads (chat prompts, greedy, fresh state each run: `reuse=False`):
  edit     "repeat this document with one change" (the answer mostly copies the prompt)
  free     a story from a one-line request (little to copy)
  numbers  a list the model invents
  explain  a one-paragraph explanation (the least repetition of the four)
  --mix    also the four submitted at once (one batch; tok/s: all their tokens over the batch's wall time)
For each engine: plain decoding (`speculative="off"`) against each --modes value (`default`: what a
request that names nothing gets; `prompt_lookup`: asked explicitly), interleaved, median of --runs;
tok/s = generated tokens / wall time of the request (prefill included on both sides). The outputs are
compared token for token with plain decoding's; accepted/drafted come from `Result.stats`. Draft policy
that a run varies is a load option (`spec_decode_steps`, `speculate_alone`: `onnxgen.config`).
--save-tokens writes each workload's prompt ids and plain greedy tokens (JSON).
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util as u

DOC = (
    "Meeting notes, 3 March. Attendees: Ana, Bruno, Chen, Dara. The team reviewed the launch plan for the new "
    "mobile app. Ana reported that the login screen is finished and tested on both platforms. Bruno said the "
    "payment flow still fails when the card is declined twice; he will fix it by Friday. Chen presented the "
    "new onboarding screens and asked for feedback before Wednesday. Dara confirmed the marketing budget of "
    "twelve thousand euros and proposed a launch date of 28 March. Next meeting: 10 March at 10:00."
)
WORKLOADS = {
    "edit": "Rewrite the following notes exactly as they are, but change the launch date to 4 April:\n\n"
    + DOC,
    "free": "Tell me a short original story about a robot who learns to paint.",
    "numbers": "Invent twenty random five-digit numbers, separated by commas, with no pattern.",
    "explain": "In one paragraph, explain why the sky is blue to a ten-year-old.",
}


def main() -> int:
    ap = u.parser(__doc__)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--modes", default="default", help="default, prompt_lookup (comma-separated)")
    ap.add_argument("--mix", action="store_true", help="also the four workloads submitted at once")
    ap.add_argument("--save-tokens", type=Path, default=None)
    args = ap.parse_args()
    u.check_args(ap, args)
    u.require_cuda(args.device, "speculative.py")
    u.set_threads(args.threads)
    pkg = u.models(args)[0]
    specs = u.engines(args.engine, default=("backend=ort",) if args.device == "cpu" else ("",))
    loaded = {k: u.load(pkg, args.device, o, args.threads) for k, o in specs.items()}
    batches = {name: [[{"role": "user", "content": text}]] for name, text in WORKLOADS.items()}
    if args.mix:
        batches["mix (4 at once)"] = [b[0] for b in batches.values()]
    modes = args.modes.split(",")

    def run(model: Any, batch: list[Any], mode: str | None) -> tuple[list[Any], float]:
        kw: dict[str, Any] = {"max_new_tokens": args.tokens, "temperature": 0, "reuse": False}
        if mode != "default":
            kw["speculative"] = mode
        model.settle()  # the previous contender's tail (steps launched past its EOS) is not this one's
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(batch)) as ex:
            rs = list(ex.map(lambda m: model.generate(m, **kw), batch))
        return rs, sum(r.stats.generated_tokens for r in rs) / (time.perf_counter() - t0)

    rows, data, saved = [], [], {}
    for name, batch in batches.items():
        contenders = {}
        for k, m in loaded.items():
            contenders[(k, "plain")] = lambda m=m, batch=batch: run(m, batch, "off")
            for mode in modes:
                contenders[(k, mode)] = lambda m=m, batch=batch, mode=mode: run(m, batch, mode)
        for fn in contenders.values():
            fn()  # warm-up
        runs = u.interleave(args.runs, contenders)
        for k, m in loaded.items():
            plain_rs = runs[(k, "plain")][-1][0]
            plain = u.median(t for _, t in runs[(k, "plain")])
            if len(batch) == 1 and k == next(iter(loaded)):
                saved[name] = {"prompt": m.encode(batch[0]), "greedy": list(plain_rs[0].tokens)}
            for mode in modes:
                rs = runs[(k, mode)][-1][0]
                spec = u.median(t for _, t in runs[(k, mode)])
                same = all(a.tokens == b.tokens for a, b in zip(plain_rs, rs, strict=True))
                acc = sum(r.stats.accepted_tokens for r in rs)
                drafted = sum(r.stats.draft_tokens for r in rs)
                label = " ".join(
                    x for x in (k if len(loaded) > 1 else "", mode if len(modes) > 1 else "") if x
                )
                data.append({"workload": name, "engine": k, "mode": mode, "plain": plain, "spec": spec})
                rows.append(
                    [
                        f"{name}, {label}" if label else name,
                        sum(r.stats.generated_tokens for r in rs),
                        u.fmt(plain),
                        u.fmt(spec),
                        f"{spec / plain:.2f}x",
                        f"{acc}/{drafted}",
                        "yes" if same else "NO",
                    ]
                )
    if args.save_tokens is not None:
        args.save_tokens.write_text(json.dumps({"model": str(pkg.path), "workloads": saved}))
    header = [
        "workload",
        "tokens",
        "plain tok/s",
        "speculative tok/s",
        "speedup",
        "accepted/drafted",
        "identical",
    ]
    caption = (
        f"model: {pkg.name} ({pkg.path}); engines {', '.join(loaded)}; {u.describe(args.device, args.threads)}; "
        f"median of {args.runs} interleaved runs; greedy, {args.tokens} new tokens at most"
    )
    u.report(caption, [("", u.table(rows, header))], args, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
