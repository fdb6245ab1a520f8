"""Speculative decoding by prompt lookup against plain decoding, same model, same run.

    .venv/bin/python benchmarks/speculative.py [MODEL] --backend ort|native|native-paged --runs 5 [--threads 2]
        [--device cuda]   (CUDA: native only; plain decoding there runs `decode_steps` steps per host round trip)
        [--spec-runs 4,2] (CUDA: one speculative contender per value of `Engine.spec_decode_steps`;
                           `default`: the engine's choice, `speculative=None`)
        [--mix]           (also the four workloads submitted at once: speculation in a batch; on CUDA
                           only with a `b` run, e.g. --spec-runs default,2fb)
        [--save-tokens FILE] (each workload's prompt and plain greedy tokens, JSON: what
                              `spec_schedule.py --replay FILE` replays the draft policy on, off the GPU)

Workloads (greedy, fresh state each run: `reuse=False`):
- edit: "repeat this document with one change" (the output mostly copies the prompt);
- free: a story from a one-line request (little to copy);
- numbers: a list the model invents;
- explain: a one-paragraph explanation (the least repetition of the four).
Contenders interleaved (order alternating), median of --runs; generated tokens / wall time of the whole
request (prefill included, same for both). The outputs are compared token for token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import onnxgen
from _util import interleave, machine, table
from onnxgen.convert.default import resolve_model_path
from onnxgen.engine import drafts
from onnxgen.engine.engine import SPEC_DECODE_STEPS

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


def run_policy(spec: str) -> tuple[int, dict[str, bool], str, bool]:
    """A `--spec-runs` entry (digits, then letters: `o` no chance-match confirmation, `f` drafts after a
    confirmed stop only along the confirmed match, `b` drafts in batches too) -> (decode steps per run while
    copying, the `drafts` settings it means, a label, whether it drafts in batches: `Engine.speculate_alone`
    off)."""
    run = spec.rstrip("ofb")
    flags = spec[len(run) :]
    settings = {"CUDA_CONFIRM": "o" not in flags, "CUDA_FOLLOW": "f" in flags}
    notes = [
        n
        for f, n in (
            ("o", "unconfirmed stops"),
            ("f", "drafts follow the confirmed match"),
            ("b", "drafts in batches"),
        )
        if f in flags
    ]
    return int(run), settings, ", ".join([f"runs of {run}", *notes]), "b" in flags


DEFAULTS = {"CUDA_CONFIRM": drafts.CUDA_CONFIRM, "CUDA_FOLLOW": drafts.CUDA_FOLLOW}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--backend", default="ort")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--spec-runs",
        default=None,
        help="decode steps per run while speculating, comma-separated "
        "(a trailing o: without `drafts.CUDA_CONFIRM`, the chance-match confirmation; f: with "
        "`drafts.CUDA_FOLLOW`; b: drafts in batches too, `Engine.speculate_alone` off; "
        "`default`: speculative=None, the engine's choice): one contender "
        'each (default: one with speculative="prompt_lookup" and the engine\'s settings)',
    )
    ap.add_argument(
        "--mix",
        action="store_true",
        help="also the four workloads submitted at once (one batch; "
        "tok/s: all their tokens over the batch's wall time)",
    )
    ap.add_argument(
        "--save-tokens",
        type=Path,
        default=None,
        help="write each workload's prompt and plain greedy tokens to this JSON file",
    )
    args = ap.parse_args()
    path = str(resolve_model_path(args.model))
    backend = args.backend.removesuffix("-paged")  # "native-paged": the paged pool (native's default)
    opts = {"threads": args.threads} if backend == "ort" else {"paged": args.backend.endswith("-paged")}
    if backend == "native":
        import torch

        torch.set_num_threads(args.threads)
    model = onnxgen.load(path, backend=backend, device=args.device, **opts)
    rows = []
    saved: dict[str, dict[str, list[int]]] = {}
    alone_default = model.speculate_alone  # CUDA: a request drafts only while running alone
    batches = {name: [[{"role": "user", "content": text}]] for name, text in WORKLOADS.items()}
    if args.mix:  # the four workloads submitted together: one batch of requests on the same engine
        batches["mix (4 at once)"] = [b[0] for b in batches.values()]
    for name, batch in batches.items():

        def go(spec, batch=batch, run=None, settings=DEFAULTS, alone=alone_default):
            model.spec_decode_steps = SPEC_DECODE_STEPS if run is None else run
            model.speculate_alone = alone
            model.settle()  # the previous contender's tail (steps launched past its EOS) is not this one's
            for key, value in settings.items():
                setattr(drafts, key, value)
            t0 = time.perf_counter()
            pending = [
                model.submit(m, max_new_tokens=args.tokens, temperature=0, reuse=False, speculative=spec)
                for m in batch
            ]
            rs = [p.result() for p in pending]
            return rs, sum(r.stats.generated_tokens for r in rs) / (time.perf_counter() - t0)

        runs = [v.strip() for v in args.spec_runs.split(",")] if args.spec_runs else [None]
        contenders = {"plain": lambda: go(False)}
        for run in runs:
            if run is None:
                contenders["spec"] = lambda: go("prompt_lookup")
                continue
            if run == "default":  # what a request that does not say gets (on CUDA: drafts while alone)
                contenders["spec (the engine's choice: speculative=None)"] = lambda: go(None)
                continue
            steps, settings, label, in_batches = run_policy(run)
            contenders[f"spec ({label})"] = (
                lambda steps=steps, settings=settings, a=alone_default and not in_batches: go(
                    "prompt_lookup", run=steps, settings=settings, alone=a
                )
            )
        for fn in contenders.values():  # warm-up
            fn()
        samples = interleave(args.runs, contenders)
        rate = {k: [tps for _, tps in v] for k, v in samples.items()}
        results = {k: v[-1][0] for k, v in samples.items()}
        if len(batch) == 1:
            saved[name] = {
                "prompt": list(model.encode_prompt(batch[0])),
                "greedy": list(results["plain"][0].tokens),
            }
        plain = statistics.median(rate["plain"])
        for label in contenders:
            if label == "plain":
                continue
            same = all(a.tokens == b.tokens for a, b in zip(results["plain"], results[label], strict=True))
            stats = [r.stats for r in results[label]]
            spec = statistics.median(rate[label])
            rows.append(
                [
                    name if len(runs) == 1 else f"{name}, {label}",
                    str(sum(s.generated_tokens for s in stats)),
                    f"{plain:.1f}",
                    f"{spec:.1f}",
                    f"{spec / plain:.2f}x",
                    f"{sum(s.accepted_tokens for s in stats)}/{sum(s.draft_tokens for s in stats)}",
                    "yes" if same else "NO",
                ]
            )
    print(
        f"\nmodel: {path}; backend {args.backend} on {args.device}; {machine()}; threads {args.threads}; "
        f"median of {args.runs} interleaved runs; greedy, {args.tokens} new tokens max\n"
    )
    print(
        table(
            rows,
            [
                "workload",
                "tokens",
                "plain tok/s",
                "speculative tok/s",
                "speedup",
                "accepted/drafted",
                "identical",
            ],
        )
    )
    if args.save_tokens is not None:
        args.save_tokens.write_text(json.dumps({"model": path, "device": args.device, "workloads": saved}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
