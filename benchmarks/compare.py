"""Commit-vs-commit CPU micro-benchmarks: `python benchmarks/compare.py BASE HEAD`.

Each commit's `src/` is exported (`git archive`) into a temporary tree; every scenario then runs in fresh
subprocesses whose PYTHONPATH points at one tree, alternately BASE, HEAD, BASE, HEAD, ... (the order
flips each round), `--rounds` times each (>= 5). A run times its scenario `reps` times after a warm-up and
reports the median; the table shows, per scenario, the median of the runs of each commit, the change, and
the noise: the larger of the two commits' run-to-run spreads (interquartile range / median of its runs; on
a shared machine a single disturbed run would make the full range meaningless). A change is flagged
(faster / slower) only when it exceeds that noise; otherwise it reads "~". `--json` keeps every run.

Scenarios (the scripts below run against either tree, through names both expose):
  sample_greedy    Sampler.sample on 49152 float32 logits, greedy (per token)
  sample_top_p     the same at temperature 0.8, top-p 0.9 (per token)
  grammar_mask     one llguidance JSON-schema mask step on SmolLM2's tokenizer + applying it (per token)
  tokenize         Tokenizer.encode of a ~2k-token text (per text)
  detokenize       IncrementalDetokenizer over the same ~2k tokens, pushed one at a time (per text)
  kv_rewind        the reuse policy on a SmolLM2 ort decoder holding 1024 positions, new prompt diverging
                   at 512: LCP + plan + rewind_to (per request)
  ort_decode_step  one greedy decode step of SmolLM2 on the ort backend, 1 thread, through Model.generate
                   (1 / Stats.decode_tok_s over 23 steps after a 64-token prompt, EOS masked; per token)

SmolLM2 is the default model, built by `onnxgen.convert.default.ensure_default_model()` on first use.
Usage: python benchmarks/compare.py 91f8a19 HEAD [--rounds 7] [--only sample_greedy,tokenize]
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 49152
SCENARIOS = (
    "sample_greedy",
    "sample_top_p",
    "grammar_mask",
    "tokenize",
    "detokenize",
    "kv_rewind",
    "ort_decode_step",
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}


# --- worker side: one scenario against the onnxgen on PYTHONPATH --------------------------------------


def _text() -> str:
    """A deterministic English-like text of about 2k SmolLM2 tokens (varied words, numbers, punctuation)."""
    import random

    rng = random.Random(1234)
    words = (
        "the a of to and in is it that for on with as was at by this be from or have an they which one you "
        "were her all she there would their we him been has when who will more no if out so said what up its "
        "about into than them can only other new some could time these two may then do first any my now "
        "such like our over man me even most made after also did many before must through back years where "
        "much your way well down should because each just those people how too little state good very make "
        "world still own see men work long get here between both life being under never day same another "
        "know while last might us great old year off come since against go came right used take three "
        "cache tensor decoder session rewind prefix token logits sampler grammar schema kernel"
    ).split()
    out: list[str] = []
    for i in range(1500):
        w = rng.choice(words)
        if rng.random() < 0.05:
            w = str(rng.randint(0, 99999))
        out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
        if rng.random() < 0.08:
            out[-1] += rng.choice([".", ",", ";", "!", "?"])
    return " ".join(out)


def _time(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def worker(scenario: str, model_dir: str) -> dict[str, float]:
    import numpy as np

    import onnxgen

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(VOCAB) * 4).astype(np.float32)
    extra: dict[str, float] = {}
    if scenario in ("sample_greedy", "sample_top_p"):
        from onnxgen.sampling import Sampler, SamplingParams

        params = (
            SamplingParams()
            if scenario == "sample_greedy"
            else SamplingParams(temperature=0.8, top_p=0.9, seed=0)
        )
        sampler = Sampler(params)
        seconds = _time(
            lambda: sampler.sample(logits), 400 if scenario == "sample_greedy" else 100, warmup=10
        )
    elif scenario == "grammar_mask":
        from onnxgen.package.spec import load_spec
        from onnxgen.sampling.grammar import GrammarCompiler, GrammarProcessor

        tok_json = (Path(model_dir) / "tokenizer.json").read_text()
        eos = list(load_spec(model_dir).eos_token_ids)
        compiler = GrammarCompiler(tok_json, VOCAB, eos)
        grammar = compiler.compile("json_schema", SCHEMA)

        # a path through the grammar: argmax of seeded random logits under the mask, 64 steps
        proc = GrammarProcessor(compiler, grammar)
        path: list[int] = []
        for _ in range(64):
            x = proc(logits.copy(), path)
            path.append(int(np.argmax(x)))
        buf = np.empty_like(logits)

        def steps() -> None:
            p = GrammarProcessor(compiler, grammar)
            for i in range(len(path)):
                np.copyto(buf, logits)
                p(buf, path[:i])

        seconds = _time(steps, 5, warmup=1) / len(path)
    elif scenario in ("tokenize", "detokenize"):
        from onnxgen.package.spec import load_spec
        from onnxgen.text import IncrementalDetokenizer, Tokenizer

        tok = Tokenizer.from_spec(load_spec(model_dir))
        text = _text()
        ids = tok.encode(text, add_special_tokens=False)
        extra["tokens"] = len(ids)
        if scenario == "tokenize":
            seconds = _time(lambda: tok.encode(text, add_special_tokens=False), 20)
        else:

            def detok() -> None:
                d = IncrementalDetokenizer(tok)
                for t in ids:
                    d.push(t)
                d.flush()

            seconds = _time(detok, 5, warmup=1)
    elif scenario == "kv_rewind":
        from onnxgen.engine import reuse
        from onnxgen.engine.identity import make_identity

        m = onnxgen.load(model_dir, backend="ort", threads=1)
        d = m.pool.acquire()
        ids = [int(t) for t in rng.integers(100, 40000, size=1024)]
        for s in range(0, 1024, 256):
            d.forward(ids[s : s + 256], s, None)
        held = make_identity(ids, None, m.package_key)
        new = make_identity(ids[:512] + [7] + ids[513:], None, m.package_key)
        assert d.kv_len() == 1024

        def rewind() -> None:
            assert reuse.prepare(d, held, new) == 512
            d._len = 1024  # NOTE: shared-buffer KV: positions past the length stay valid, so this restores it

        seconds = _time(rewind, 300, warmup=5)
    elif scenario == "ort_decode_step":
        m = onnxgen.load(model_dir, backend="ort", threads=1)
        eos = list(m.eos_token_ids)

        def no_eos(x, _generated):
            x[eos] = -np.inf
            return x

        prompt = [int(t) for t in rng.integers(100, 40000, size=64)]

        def per_token(n: int = 24) -> float:
            r = m.generate(prompt, max_new_tokens=n, reuse=False, processors=[no_eos])
            assert r.stats.generated_tokens == n
            return 1.0 / r.stats.decode_tok_s

        per_token(4)
        seconds = statistics.median(per_token() for _ in range(3))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}; one of {', '.join(SCENARIOS)}")
    return {"seconds": seconds, "onnxgen": str(Path(onnxgen.__file__).parent), **extra}


# --- orchestrator -------------------------------------------------------------------------------------


def export(commit: str, into: Path) -> tuple[Path, str]:
    """`src/` of `commit` under `into` (git archive; the repository's worktrees are left alone)."""
    sha = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{commit}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    into.mkdir(parents=True)
    archive = into / "src.tar"
    subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(archive), sha, "src"], check=True
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    archive.unlink()
    return into / "src", sha


def run_once(scenario: str, src: Path, model_dir: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", scenario, "--model", model_dir],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{scenario} on {src} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["onnxgen"]).resolve() == (src / "onnxgen").resolve(), (
        f"imported {out['onnxgen']}, not {src}"
    )
    return out


def _iqr(xs: list[float]) -> float:
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q3 - q1


def fmt_time(s: float) -> str:
    for unit, k in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= k:
            return f"{s / k:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", nargs="?")
    ap.add_argument("head", nargs="?")
    ap.add_argument("--rounds", type=int, default=7, help="runs of each scenario per commit (>= 5)")
    ap.add_argument("--only", default="", help="comma-separated scenarios (default: all)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help="SmolLM2 package (default: the default model, built if missing)")
    ap.add_argument("--json", type=Path, help="write every run's seconds here")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.model)))
        return
    if not (args.base and args.head):
        ap.error("BASE and HEAD are required")
    if args.rounds < 5:
        ap.error("--rounds must be >= 5")
    scenarios = [s for s in args.only.split(",") if s] or list(SCENARIOS)
    if args.model is None:
        from onnxgen.convert.default import ensure_default_model

        args.model = str(ensure_default_model())
    with tempfile.TemporaryDirectory(prefix="onnxgen-compare-") as tmp:
        base_src, base_sha = export(args.base, Path(tmp) / "base")
        head_src, head_sha = export(args.head, Path(tmp) / "head")
        trees = {"base": base_src, "head": head_src}
        runs: dict[str, dict[str, list[float]]] = {s: {"base": [], "head": []} for s in scenarios}
        notes: dict[str, str] = {}
        t0 = time.perf_counter()
        for r in range(args.rounds):
            order = ("base", "head") if r % 2 == 0 else ("head", "base")
            for s in scenarios:
                for which in order:
                    out = run_once(s, trees[which], args.model)
                    runs[s][which].append(out["seconds"])
                    if "tokens" in out:
                        notes[s] = f"{int(out['tokens'])} tokens"
            print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"base": base_sha, "head": head_sha, "runs": runs}, indent=1))
    rows = []
    for s in scenarios:
        b, h = runs[s]["base"], runs[s]["head"]
        mb, mh = statistics.median(b), statistics.median(h)
        change = (mh - mb) / mb * 100
        noise = max(_iqr(x) / statistics.median(x) for x in (b, h)) * 100
        verdict = "~" if abs(change) <= noise else ("slower" if change > 0 else "faster")
        rows.append([s, fmt_time(mb), fmt_time(mh), f"{change:+.1f} %", f"±{noise:.1f} %", verdict])
    from _util import machine, table  # benchmarks/_util.py, beside this script

    print(
        f"base {args.base} = {base_sha[:10]}, head {args.head} = {head_sha[:10]}; {args.rounds} runs each, "
        f"interleaved; {machine()}"
    )
    print(table(rows, ["scenario", "base median", "head median", "change", "noise", "flag"]))
    for s, note in notes.items():
        print(f"- {s}: {note}")


if __name__ == "__main__":
    main()
