"""onnxgen on the CPU against onnxruntime-genai (the same package) and llama.cpp (the GGUF the package was
converted from), with the same threads: load time, time to first token and decode speed of single requests,
turn 2 of a chat (the first turn's KV kept on both sides) on a quiet machine and with cores busy, and a
conversation whose first answer is long.

    python benchmarks/cpu_vs_genai.py [--model default] [--engine backend=ort] [--engine backend=native]
        [--sections load,single,turn2] [--threads 2] [--runs 7] [--new-tokens 64] [--busy 1]
    python benchmarks/cpu_vs_genai.py --sections chat --llama-server BIN [--gguf FILE] [--llama-args "--poll 0"] \
        --engine model=default,label=ort-int4 --engine model=default-fp32,label=ort-fp32

Sections (each contender interleaved with the others, the order reversed every other round, median of --runs):
  load    seconds from `onnxgen.load` / `og.Model` to a ready model, each in a fresh process
  single  a short and a long chat prompt, greedy, fresh state each run (`reuse=False`): TTFT (prompt in,
          first token out) and decode tok/s over --new-tokens
  turn2   a long system prompt, a question and the greedy --reply-tokens reply, then a second question:
          turn 2's TTFT with the session kept (onnxgen: `Session.generate` from messages, tokenization
          included) against one onnxruntime-genai Generator kept from turn 1 with the new ids appended;
          quiet, then with --busy processes spinning (`while True: pass`)
  chat    a travel agent's chat (a ~490-token system prompt and a question), --chat-new greedy tokens with
          EOS suppressed on every side (TTFT fresh, decode tok/s), then the conversation extended by that
          reply and a follow-up question (~640 tokens) on the kept state: turn 2's TTFT. Every contender
          answers from the same ids (onnxgen's tokenizer; the follow-up appended to each one's own reply).
          onnxgen: a session under a new salt each round (turn 1 shares nothing), its `Stats`; llama.cpp:
          `llama-server` (one slot, --threads for prompt and decode) given token ids, its own timings
          (`prompt_ms`: the prompt evaluated up to the first token's logits, `predicted_per_second`), turn 1
          with `cache_prompt` off, turn 2 on (its prefix reuse); each --llama-args (repeatable; "": its
          defaults) one more server with those options (e.g. `--poll 0`: threads that sleep instead of
          spinning while they wait), the ratios against the first. The caption gives the machine's load
          average before and after (other jobs make spinning runtimes fall behind)
Contenders: each --engine (default `backend=ort`; `model=NAME` among its options picks that engine's package,
any --model name, else --model's), onnxruntime-genai in load/single/turn2 (on --model's package), llama.cpp in
chat (with --llama-server). Ratios: onnxgen's time over the peer's (below 1: onnxgen faster) or its tok/s over
the peer's (above 1: faster); in chat each against llama.cpp as speedups (above 1: onnxgen faster).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Sequence
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
LLAMA = "llama.cpp"
CHAT_SYSTEM = (
    "You are Marguerite, a travel assistant for a small agency in Lyon. You answer in clear, friendly English, "
    "in short paragraphs, and you never invent opening hours or prices: when you are unsure, you say so and "
    "suggest where the traveller can check. The agency's clients are mostly families and retired couples who "
    "prefer trains to planes, walk a lot but not up steep hills, and like to eat where the locals eat. "
    "Here is what we know about the current client. Anna and Tomas Berglund, both 67, live in Uppsala, Sweden. "
    "They travel in the second half of May for twelve nights, with a budget of about 4,000 euros for the two of "
    "them, hotels and trains included but flights excluded. They fly into Paris Charles de Gaulle on a Tuesday "
    "morning and fly home from Nice on a Sunday afternoon. Anna paints watercolours and wants to see the light "
    "of Provence that Van Gogh and Cezanne painted; Tomas is a retired railway engineer who would love one "
    "scenic train ride and a visit to a museum about trains or bridges. Neither of them eats pork. Tomas has a "
    "bad knee, so each day should have no more than about eight kilometres of walking, with a rest after lunch. "
    "They have been to Paris twice and do not want to spend more than two nights there. They speak English and "
    "some German, no French. They would like at least one day at a local market, one vineyard visit with a "
    "tasting (Anna does not drink, so a place that also serves grape juice is best), and one day with no plans "
    "at all. They dislike large tour groups and crowded places at midday, and they prefer small family-run "
    "hotels with a lift. Previous clients with similar wishes enjoyed Arles, Avignon, Aix-en-Provence, the "
    "Luberon villages, Cassis and the old town of Nice; some found Marseille too busy. The Cote d'Azur trains "
    "are frequent and cheap, but the Luberon villages are hard to reach without a car or a driver."
)
CHAT_QUESTION = (
    "Please draft a day-by-day plan for Anna and Tomas: where they sleep each night, how they travel between "
    "towns, and one idea for each afternoon. Keep the mornings free for Anna's painting."
)
CHAT_FOLLOW_UP = "Thank you! If they only had nine nights, which two stops would you drop, and why?"


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


class LlamaServer:
    """llama.cpp's `llama-server` on a GGUF: one slot, `threads` threads for prompt and decode (0: its
    default), on 127.0.0.1:`port`, `extra` options, given token ids; answers with its own timings."""

    def __init__(
        self, binary: Path, gguf: Path, threads: int, port: int, ctx: int = 4096, extra: Sequence[str] = ()
    ) -> None:
        cmd = [str(binary), "-m", str(gguf), "-c", str(ctx), "--parallel", "1", "--host", "127.0.0.1"]
        cmd += ["--port", str(port)] + (["-t", str(threads), "-tb", str(threads)] if threads else [])
        cmd += list(extra)
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
        self.version = " ".join((out.stdout + out.stderr).split())
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                self.log.seek(0)
                tail = self.log.read().decode(errors="replace")[-2000:]
                raise SystemExit(f"llama-server did not become ready ({' '.join(cmd)}):\n{tail}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:  # refused while starting, 503 while loading
            return False

    def complete(self, ids: list[int], new: int, *, cache: bool) -> dict[str, Any]:
        """Greedy `/completion` of `ids` (EOS ignored) for `new` tokens; `cache`: reuse the slot's prefix."""
        body = {"prompt": ids, "n_predict": new, "temperature": 0, "ignore_eos": True, "cache_prompt": cache}
        body["return_tokens"] = True
        headers = {"Content-Type": "application/json"}
        req = urllib.request.Request(self.url + "/completion", json.dumps(body).encode(), headers)
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.load(r)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def follow_up_ids(model: Any, turn1: list[dict[str, str]], question: str) -> list[int]:
    """The ids that extend a conversation past the assistant's reply: the template's end of that turn, the
    follow-up `question` and the generation prompt (appended to each contender's own reply ids)."""
    mark = "@@REPLY@@"
    text = model.chat_template.render(
        [*turn1, {"role": "assistant", "content": mark}, {"role": "user", "content": question}]
    )
    return list(model.tokenizer.encode(text.split(mark, 1)[1], add_special_tokens=False))


def ours_chat(model: Any, ids1: list[int], follow: list[int], new: int) -> dict[str, float]:
    """Turn 1 (EOS suppressed) in a session under a new salt, then turn 2 = turn 1 + the reply + `follow`."""
    from onnxgen.sampling.processors import LogitBias

    ban = LogitBias({t: -100 for t in model.eos_token_ids}, model.spec.vocab_size)
    s = model.session(salt=uuid.uuid4().hex)
    try:
        r1 = s.generate(ids1, max_new_tokens=new, temperature=0, stop=[], processors=[ban])
        r2 = s.generate([*ids1, *r1.tokens, *follow], max_new_tokens=1, temperature=0)
    finally:
        s.close()
    assert r1.stats.reused_tokens == 0, "turn 1 found cached KV under a new salt"
    return {
        "ttft_ms": r1.stats.ttft_s * 1e3,
        "tok_s": r1.stats.decode_tok_s,
        "tokens": len(r1.tokens),
        "turn2_ms": r2.stats.ttft_s * 1e3,
        "turn2_prompt": r2.stats.prompt_tokens,
        "turn2_reused": r2.stats.reused_tokens,
        "drafted": r1.stats.draft_tokens,
        "accepted": r1.stats.accepted_tokens,
    }


def llama_chat(server: LlamaServer, ids1: list[int], follow: list[int], new: int) -> dict[str, float]:
    """`ours_chat` against llama-server: turn 1 without its prefix cache, turn 2 with it."""
    r1 = server.complete(ids1, new, cache=False)
    t1 = r1["timings"]
    r2 = server.complete([*ids1, *r1["tokens"], *follow], 1, cache=True)
    t2 = r2["timings"]
    return {
        "ttft_ms": t1["prompt_ms"],
        "tok_s": t1["predicted_per_second"],
        "tokens": t1["predicted_n"],
        "turn2_ms": t2["prompt_ms"],
        "turn2_prompt": t2["prompt_n"] + t2["cache_n"],
        "turn2_reused": t2["cache_n"],
    }


def main() -> int:
    ap = u.parser(__doc__, runs=7)
    ap.add_argument("--sections", default="load,single,turn2")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument(
        "--busy", type=int, default=1, help="busy processes in turn2's loaded phase (0: quiet only)"
    )
    ap.add_argument("--no-genai", action="store_true", help="no onnxruntime-genai in load/single/turn2")
    ap.add_argument("--chat-new", type=int, default=128, help="chat: tokens of the first answer")
    ap.add_argument("--llama-server", type=Path, default=None, help="chat: llama.cpp's llama-server binary")
    ap.add_argument(
        "--gguf", type=Path, default=None, help="chat: llama.cpp's model (default: SmolLM2's GGUF)"
    )
    ap.add_argument(
        "--llama-port", type=int, default=8191, help="chat: the first server's port (then +1, ...)"
    )
    ap.add_argument(
        "--llama-args",
        action="append",
        default=None,
        help='chat: one llama-server per use with these extra options ("": its defaults; default: one such)',
    )
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
            opts.pop("model", None)
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
    pkgs = {  # each engine's package: its own `model=` option, else --model's
        label: u.resolve(str(opts.pop("model")), work=args.work) if "model" in opts else pkg
        for label, opts in specs.items()
    }
    ours = {label: u.load(pkgs[label], "cpu", opts, args.threads) for label, opts in specs.items()}
    first = next(iter(ours.values()))
    genai = not args.no_genai and bool({"load", "single", "turn2"} & set(sections))
    theirs = u.genai_model(pkg.path, args.threads) if genai else None
    rows: list[list[str]] = []
    tables: list[tuple[str, str]] = []
    data: dict[str, Any] = {
        "model": str(pkg.path),
        "packages": {label: str(p.path) for label, p in pkgs.items()},
        "machine": u.describe("cpu", args.threads),
    }

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
            label: (lambda p=pkgs[label].path, s=s: {"s": _load_time(p, s, args.threads)})
            for label, s in specs_text
        }
        if theirs is not None:
            contenders[PEER] = lambda: {"s": _load_time(pkg.path, None, args.threads)}
        add("load", "ready model", u.interleave(args.runs, contenders), "s", "s")
    if "single" in sections:
        for case, text in (("short chat", SHORT), ("long chat", LONG)):
            ids = first.encode([{"role": "user", "content": text}])

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
        ids1, ids2 = first.encode(turn1), first.encode(turn2)

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
    if "chat" in sections:
        tables.append(("chat", _chat(args, ours, pkgs, data)))
    if rows:
        header = ["section", "case", "contender", "time", "decode tok/s", "vs onnxruntime-genai"]
        tables.insert(0, ("", u.table(rows, header)))
    u.report(
        f"model: {pkg.name} ({pkg.path}); {u.describe('cpu', args.threads)}; median of {args.runs} interleaved "
        f"runs; greedy",
        tables,
        args,
        data,
    )
    return 0


def _chat(args: Any, ours: dict[str, Any], pkgs: dict[str, u.Package], data: dict[str, Any]) -> str:
    """The chat section: every engine and llama.cpp interleaved; returns its table."""
    first = next(iter(ours.values()))
    turn1 = [{"role": "system", "content": CHAT_SYSTEM}, {"role": "user", "content": CHAT_QUESTION}]
    ids1 = first.encode(turn1)
    follow = follow_up_ids(first, turn1, CHAT_FOLLOW_UP)
    contenders = {label: (lambda m=m: ours_chat(m, ids1, follow, args.chat_new)) for label, m in ours.items()}
    servers: list[LlamaServer] = []
    llamas: list[str] = []
    try:
        if args.llama_server is not None:
            from onnxgen.package.home import sources_dir

            gguf = args.gguf or sources_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
            for i, extra in enumerate(args.llama_args or [""]):
                server = LlamaServer(
                    args.llama_server, gguf, args.threads, args.llama_port + i, extra=shlex.split(extra)
                )
                servers.append(server)
                llamas.append(f"{LLAMA} {extra}".strip())
                data["llama.cpp"] = {"gguf": str(gguf), "version": server.version}
                contenders[llamas[-1]] = lambda s=server: llama_chat(s, ids1, follow, args.chat_new)
        for fn in contenders.values():
            fn()  # warm-up
        load = os.getloadavg()[0]
        samples = u.interleave(args.runs, contenders)
        load_after = os.getloadavg()[0]
    finally:
        for server in servers:
            server.close()
    med = {k: {m: u.median(s[m] for s in v) for m in v[0]} for k, v in samples.items()}
    data["chat"] = {"prompt_tokens": len(ids1), "samples": samples, "median": med, "load": [load, load_after]}
    peer = med.get(llamas[0]) if llamas else None
    rows = []
    for name, m in med.items():
        where = pkgs[name].name if name in pkgs else "GGUF"
        drafts = f"{m['accepted']:.0f}/{m['drafted']:.0f}" if m.get("drafted") else "-"
        turn2 = f"{m['turn2_ms']:,.1f} ms ({m['turn2_reused']:.0f}/{m['turn2_prompt']:.0f})"
        vs = ["-"] * 3
        if peer is not None and name not in llamas:
            vs = [
                u.ratio(m["tok_s"], peer["tok_s"]),
                u.ratio(peer["ttft_ms"], m["ttft_ms"]),
                u.ratio(peer["turn2_ms"], m["turn2_ms"]),
            ]
        rows.append([name, where, u.fmt(m["tok_s"]), drafts, f"{m['ttft_ms']:,.1f} ms", turn2, *vs])
    header = [
        "contender",
        "model",
        "decode tok/s",
        "drafts kept",
        "TTFT fresh",
        "TTFT turn 2 (reused/prompt)",
    ]
    header += [f"decode vs {llamas[0] if llamas else LLAMA}", "TTFT fresh speedup", "turn 2 speedup"]
    caption = (
        f"chat: {len(ids1)}-token prompt, {args.chat_new} tokens (EOS suppressed), then turn 2; load average "
        f"{load:.1f} before, {load_after:.1f} after"
    )
    return caption + "\n\n" + u.table(rows, header)


def _load_time(path: Path, spec: str | None, threads: int) -> float:
    """Seconds one load takes in a fresh process (`spec`: an engine's options; None: onnxruntime-genai)."""
    cmd = [sys.executable, __file__, "--load-worker", str(path), PEER if spec is None else spec, str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"loading in a child process failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
