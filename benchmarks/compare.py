"""Base against head in one run: the same scenarios on two source trees, interleaved, medians, ratios.

    python benchmarks/compare.py BASE HEAD [--device cpu] [--model default] [--scenarios decode,batch]
        [--rounds 5] [--concurrency 64] [--option backend=native] [--base-env K=V] [--head-option k=v]
    python benchmarks/compare.py main . --device cuda --model builder:1b          (this checkout's work tree)
    python benchmarks/compare.py HEAD HEAD --head-env ONNXGEN_FOLD_NORMS=1        (one tree, two settings)

BASE and HEAD are each a commit of this repository (its `src/` exported with `git archive`), or a folder
holding a source tree (`src/onnxgen` or `onnxgen`; `.` is this checkout, uncommitted changes included: what
the offline GPU host has, beside a base carried in `.carry/base`). Each side runs in its own long-lived
process (PYTHONPATH = its tree, its --*-env variables set, the same thread count), which loads the model once
with the same load options (--option, then the side's --*-option) and runs one scenario per request; the
orchestrator alternates BASE, HEAD, HEAD, BASE, ... (the order flips each round), --rounds >= 5 times.
A run repeats its scenario --reps times after a warm-up and reports the median.

Scenarios (greedy, `speculative="off"`, random-id prompts, `reuse=False` unless said):
  decode   batch-1 decode tok/s (`Stats.decode_tok_s`): a --prompt-token prompt, --new tokens
  batch    --concurrency requests at once from as many threads (distinct --prompt-token prompts, --batch-new
           tokens each): all generated tokens over the wall time, prefill included
  ttft     a --long-token prompt, one token: TTFT ms
  turn     a 64-token turn on a retained --long-token session: TTFT ms
  overhead the decode scenario's time outside the decoder's forward, per step: ms (the engine's own work:
           scheduling, sampling, streaming; engines with a decoder per request: ort, native unbatched)
The engine is loaded with `max_running` = --concurrency (and on CUDA `kv_bytes` = 8 GiB, so that both sides'
processes fit on one card) unless --option says otherwise. The table gives each side's median of its runs,
head / base, and the noise: the larger of the two sides' run-to-run spreads (interquartile range / median);
a change is flagged only beyond it. "paired" is the median of each round's head / base (the two sides' runs of
a round are adjacent in time, so a drift of the machine's speed cancels), with its interquartile range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util as u

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = {"decode": "tok/s", "batch": "tok/s", "ttft": "ms", "turn": "ms", "overhead": "ms"}
TAG = "@@compare "

# --- worker side: the scenarios against the onnxgen on PYTHONPATH ------------------------------------


def worker() -> None:
    """Read one JSON request a line from stdin, answer one line on stdout prefixed with TAG."""
    import onnxgen

    init = json.loads(sys.stdin.readline())
    if init["threads"]:
        import torch

        torch.set_num_threads(init["threads"])
    opts = dict(init["options"])
    if init["threads"]:
        opts.setdefault("threads", init["threads"])
    model = onnxgen.load(init["model"], device=init["device"], **opts)
    vocab = model.spec.vocab_size
    p = init["params"]
    greedy = {"temperature": 0, "speculative": "off"}
    state: dict[str, Any] = {"round": 0}

    def decode() -> float:
        model.settle()
        r = model.generate(
            u.random_ids(p["prompt"], vocab, 1), max_new_tokens=p["new"], reuse=False, **greedy
        )
        return r.stats.decode_tok_s

    def batch() -> float:
        state["round"] += 1
        prompts = [
            u.random_ids(p["prompt"], vocab, 1000 * state["round"] + i) for i in range(p["concurrency"])
        ]
        barrier = threading.Barrier(len(prompts))
        made = [0] * len(prompts)

        def go(i: int) -> None:
            barrier.wait()
            made[i] = model.generate(
                prompts[i], max_new_tokens=p["batch_new"], reuse=False, **greedy
            ).stats.generated_tokens

        model.settle()
        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(made) / (time.perf_counter() - t0)

    long = u.random_ids(p["long"], vocab, 2)

    def ttft() -> float:
        model.settle()
        return model.generate(long, max_new_tokens=1, reuse=False, **greedy).stats.ttft_s * 1e3

    session = model.session()

    def turn() -> float:
        state["round"] += 1
        session.generate(long, max_new_tokens=1, **greedy)  # back to the context: the same turn each time
        extra = u.random_ids(64, vocab, 50 + state["round"])
        return session.generate(long + extra, max_new_tokens=1, **greedy).stats.ttft_s * 1e3

    forward = {"s": 0.0, "n": 0}

    def timed(cls: Any) -> None:  # the decoder class's forward, timed
        inner = cls.forward

        def wrapped(self: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(self, *a, **k)
            finally:
                forward["s"] += time.perf_counter() - t0
                forward["n"] += 1

        cls.forward = wrapped

    def overhead() -> float:
        if "timed" not in state:
            from onnxgen.backends.ort.decoder import OrtDecoder

            timed(OrtDecoder)
            if model.backend == "native":
                from onnxgen.backends.native.decoder import NativeDecoder

                timed(NativeDecoder)
            state["timed"] = True
        model.settle()
        forward.update(s=0.0, n=0)
        r = model.generate(
            u.random_ids(p["prompt"], vocab, 1), max_new_tokens=p["new"], reuse=False, **greedy
        )
        if forward["n"] == 0:
            raise SystemExit(
                "overhead: this engine runs no per-request decoder (paged KV); load it with paged=false"
            )
        return (r.stats.total_s - forward["s"]) / forward["n"] * 1e3

    fns = {"decode": decode, "batch": batch, "ttft": ttft, "turn": turn, "overhead": overhead}
    warm: set[str] = set()
    print(TAG + json.dumps({"ready": True, "onnxgen": str(Path(onnxgen.__file__).parent)}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        fn = fns[req["scenario"]]
        if req["scenario"] not in warm:
            fn()
            warm.add(req["scenario"])
        values = [fn() for _ in range(p["reps"])]
        print(TAG + json.dumps({"value": statistics.median(values)}), flush=True)


# --- orchestrator ------------------------------------------------------------------------------------


def tree(ref: str, into: Path) -> tuple[Path, str]:
    """(the folder to put on PYTHONPATH, a name for it): a source folder as is, or a commit's `src/` exported."""
    path = Path(ref).expanduser()
    if path.is_dir():
        for cand in (path / "src", path):
            if (cand / "onnxgen" / "__init__.py").is_file():
                return cand.resolve(), f"{ref} (folder)"
        raise SystemExit(f"{ref}: a folder without src/onnxgen or onnxgen")
    try:
        sha = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--verify", f"{ref}^{{commit}}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        raise SystemExit(f"{ref}: neither a source folder nor a commit of {REPO}") from None
    into.mkdir(parents=True)
    archive = into / "src.tar"
    subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(archive), sha, "src"], check=True
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    archive.unlink()
    return into / "src", f"{ref} = {sha[:10]}"


class Side:
    """One source tree's worker process."""

    def __init__(self, src: Path, env: dict[str, str], init: dict[str, Any], log: Path) -> None:
        self.log = log
        full = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0", **env}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            env=full,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
        )
        self.send(init)
        ready = self.read()
        if Path(ready["onnxgen"]).resolve() != (src / "onnxgen").resolve():
            raise SystemExit(f"the worker imported {ready['onnxgen']}, not {src / 'onnxgen'}")

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG) :])
        tail = self.log.read_text()[-3000:]
        raise SystemExit(f"a worker stopped (its log: {self.log}):\n{tail}")

    def run(self, scenario: str) -> float:
        self.send({"scenario": scenario})
        return self.read()["value"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def env_pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep:
            raise SystemExit(f"expected NAME=VALUE, got {item!r}")
        out[key] = val
    return out


def main() -> int:
    if "--worker" in sys.argv:
        worker()
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("head")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default="default", help="a model as the other tools name it (_util.py)")
    ap.add_argument("--scenarios", default="decode,batch", help=", ".join(SCENARIOS))
    ap.add_argument(
        "--rounds", type=int, default=5, help=f"runs of each scenario per side (>= {u.ROUNDS_MIN})"
    )
    ap.add_argument("--reps", type=int, default=3, help="repetitions inside a run (median)")
    ap.add_argument(
        "--prompt", type=int, default=None, help="prompt tokens (default: 64 on the CPU, 512 on CUDA)"
    )
    ap.add_argument("--new", type=int, default=None, help="new tokens (default: 32 on the CPU, 128 on CUDA)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument(
        "--batch-new", type=int, default=None, help="new tokens of each batch request (default: --new)"
    )
    ap.add_argument(
        "--long", type=int, default=None, help="ttft / turn context (default: 512 CPU, 8000 CUDA)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--option", default="", help="load options for both sides, k=v comma-separated")
    ap.add_argument("--base-option", default="")
    ap.add_argument("--head-option", default="")
    ap.add_argument("--base-env", action="append", default=[], help="NAME=VALUE for the base process")
    ap.add_argument("--head-env", action="append", default=[], help="NAME=VALUE for the head process")
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=u.WORK)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--dry-run", action="store_true", help=f"allow --rounds below {u.ROUNDS_MIN} (checks only)"
    )
    args = ap.parse_args()
    if args.rounds < u.ROUNDS_MIN and not args.dry_run:
        ap.error(f"--rounds must be >= {u.ROUNDS_MIN}")
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; one of {', '.join(SCENARIOS)}")
    u.require_cuda(args.device, "compare.py")
    cuda = args.device == "cuda"
    params = {
        "prompt": args.prompt or (512 if cuda else 64),
        "new": args.new or (128 if cuda else 32),
        "concurrency": args.concurrency,
        "batch_new": args.batch_new or args.new or (128 if cuda else 32),
        "long": args.long or (8000 if cuda else 512),
        "reps": args.reps,
    }
    pkg = u.resolve(args.model, work=args.work, tokenizer=args.tokenizer, device=args.device)
    shared = {
        "max_running": args.concurrency,
        **({"kv_bytes": 8 << 30} if cuda else {}),
        **u.options(args.option),
    }
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    with tempfile.TemporaryDirectory(prefix="onnxgen-compare-") as tmp:
        sides: dict[str, Side] = {}
        names: dict[str, str] = {}
        try:
            for which, ref, over, extra in (
                ("base", args.base, args.base_option, args.base_env),
                ("head", args.head, args.head_option, args.head_env),
            ):
                src, names[which] = tree(ref, Path(tmp) / which)
                init = {
                    "model": str(pkg.path),
                    "device": args.device,
                    "options": {**shared, **u.options(over)},
                    "threads": args.threads,
                    "params": params,
                }
                sides[which] = Side(src, {**env, **env_pairs(extra)}, init, Path(tmp) / f"{which}.log")
            runs: dict[str, dict[str, list[float]]] = {s: {"base": [], "head": []} for s in scenarios}
            t0 = time.perf_counter()
            for r in range(args.rounds):
                order = ("base", "head") if r % 2 == 0 else ("head", "base")
                for s in scenarios:
                    for which in order:
                        runs[s][which].append(sides[which].run(s))
                print(
                    f"round {r + 1}/{args.rounds} ({time.perf_counter() - t0:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            for side in sides.values():
                side.close()
    rows = []
    for s in scenarios:
        b, h = runs[s]["base"], runs[s]["head"]
        mb, mh = statistics.median(b), statistics.median(h)
        change = (mh - mb) / mb
        noise = max(u.spread(b), u.spread(h))
        better = change > 0 if SCENARIOS[s] == "tok/s" else change < 0
        flag = "~" if abs(change) <= noise else ("better" if better else "worse")
        pairs = sorted(x / y for x, y in zip(h, b, strict=True))
        q1, q3 = pairs[len(pairs) // 4], pairs[(3 * len(pairs)) // 4]
        rows.append(
            [
                s,
                f"{mb:,.2f} {SCENARIOS[s]}",
                f"{mh:,.2f} {SCENARIOS[s]}",
                f"{mh / mb:.3f}",
                f"{statistics.median(pairs):.3f} ({q1:.3f}–{q3:.3f})",
                f"±{noise:.1%}",
                flag,
            ]
        )
    if args.json:
        args.json.write_text(
            json.dumps({"base": names["base"], "head": names["head"], "params": params, "runs": runs})
        )
    caption = (
        f"base {names['base']}, head {names['head']}; model {pkg.name}; {u.describe(args.device, args.threads)}; "
        f"{args.rounds} runs a side, interleaved, each the median of {args.reps}; prompt {params['prompt']}, "
        f"new {params['new']} (batch {params['batch_new']}), concurrency {params['concurrency']}, long {params['long']}; options {shared}"
    )
    print(f"\n{caption}\n")
    print(u.table(rows, ["scenario", "base", "head", "head / base", "paired (IQR)", "noise", "flag"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
