"""Requests at once on one engine, on the CPU or CUDA, through the Python API or the OpenAI-compatible
server: throughput against concurrency, a shared system prompt, agents that keep sessions; and one multi-turn
trace replayed against any OpenAI-compatible server (onnxgen serve, llama.cpp's llama-server, ...).

    python benchmarks/batch.py --model builder:8b16k --device cuda --concurrency 1,8,32,64,128
    python benchmarks/batch.py --chat --concurrency 8 --new 64 --engine backend=native,max_running=8 \\
        --engine backend=ort --modes concurrent,serial                       (the CPU: batched vs one at a time)
    python benchmarks/batch.py --concurrency 1 --new 64 --api python,http,http-stream      (server overhead)
    python benchmarks/batch.py --model builder:8b16k --device cuda --sections agents --engine "" \\
        --engine paged=false,max_running=1,label=serial
    python benchmarks/batch.py --sections trace --url http://127.0.0.1:8000 --label onnxgen --sessions on,off
    python benchmarks/batch.py --sections trace --cluster 2 --routers affinity,round_robin --threads 1

Sections (contenders interleaved, the order reversed every other round, median of --runs):
  sweep   for each --concurrency B: B requests with distinct --prompt-token prompts (random ids; --chat:
          distinct chat questions) and --new tokens each, submitted together from B threads (`--modes
          serial`: one after another). Per contender (engine x mode x --api path): aggregate tok/s
          (all generated tokens over the wall time, prefill included), decode tok/s (the requests' own
          decode rates summed; serial: one request's), all decoding (the tokens a second from the last
          request's first token to the first request's last, when no step holds a prefill; python API
          only) and its ms per step (B over it: the number a floor is compared with), ms per decode step
          (one request's), ms per token of one request (its wall time over its tokens, prefill
          included), TTFT p50 / p99 (http: not seen; http-stream: the first streamed token), the most
          Python threads alive at once outside the B request threads (the main thread, the engine's loop,
          the server's event loop on the http paths: the server runs no thread per request). A warm-up
          round per size comes first (--no-warmup: none; with --runs 1, a fresh engine's first batch)
  shared  --clients requests at once, each a --system-token system prompt and its own question: one system
          prompt for all against a distinct one each (a fresh salt every round: only sharing within the
          round counts): aggregate tok/s, TTFT p50 / max, prompt tokens prefilled in the round
  agents  --agents sessions under one salt sharing a --system-token system prompt, --turns turns each
          (64-token user turns, up to --new tokens answered), all arriving at once; --runs runs per engine on
          the same engine, a new salt each (the first run meets the engine's first uses, later ones do not):
          tok/s, TTFT p50 / p99 (and their ratio), the first turn's TTFT (p50 / max: it computes the system
          prompt) and the later turns' (p50 / p99), the first run's TTFT p50 / p99, inter-token latency
          p50 / p99, KV pages held against one system prompt plus every session's own turns, prefix hits over
          looked-up prompt tokens (`Model.kv_stats`; paged engines); medians over the runs
  trace   against the server(s) at --url (started on their own), or with --cluster N against one server and,
          per --routers mode, N Ray Serve replicas of it (onnxgen.serve.cluster; all started here, from --model),
          the servers interleaved, each run the same trace for each: --agents conversations
          at once, --turns turns each, a --system-token system prompt (about; unique to the run, shared by
          its conversations), --new tokens a turn (EOS suppressed), streamed chat completions, each turn sent
          with the whole conversation as a stateless client does (--sessions on: onnxgen's X-Session-Id, a
          session per conversation), --think seconds between a reply and the next turn (as vLLM's multi-turn
          serving benchmark): TTFT of turn 1 and of later turns (p50 / p99), inter-token latency p50 / p99
          (the gaps between streamed content events), output tok/s, wall time, prompt tokens the server
          reported cached on later turns (their share), whether every reply equals the first server's
Greedy; `speculative` as --speculative ("off": plain decoding; "default": the engine's choice).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util as u

QUESTIONS = [
    "Name three rivers in France.",
    "Write a haiku about autumn.",
    "What is the capital of Japan?",
    "List three French cheeses.",
    "Give two tips for learning to cook.",
    "Explain what a CPU does.",
    "Name two primary colours.",
    "What is 17 times 23?",
    "Describe a cat in one sentence.",
    "Suggest a name for a bakery.",
    "What does DNA stand for?",
    "Name a famous bridge.",
]


class Client:
    """One way of sending a request to an engine: the Python API, or the server (JSON or streamed)."""

    def __init__(self, model: Any, api: str, workers: int) -> None:
        self.model, self.api = model, api
        self.server = self.http = None
        if api != "python":
            import httpx

            from onnxgen.serve.app import RunningServer, ServerConfig, create_app

            self.server = RunningServer(create_app(model, ServerConfig()))
            limits = httpx.Limits(max_connections=workers + 8, max_keepalive_connections=workers + 8)
            self.http = httpx.Client(base_url=self.server.url, timeout=3600, limits=limits)
            self.model_id = self.http.get("/v1/models").json()["data"][0]["id"]

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
            self.server.stop()

    def __call__(self, prompt: Any, new: int, gen: dict[str, Any]) -> dict[str, Any]:
        """One request: generated tokens, TTFT (None where the path does not show it), decode tok/s, wall."""
        t0 = time.perf_counter()
        if self.api == "python":
            stamps: list[float] = []  # when each piece of text came out (the decode-phase window's tokens)
            r = self.model.generate(
                prompt, max_new_tokens=new, on_token=lambda _t: stamps.append(time.perf_counter()), **gen
            )
            s = r.stats
            return {
                "n": s.generated_tokens,
                "ttft": s.ttft_s,
                "tok_s": s.decode_tok_s,
                "wall": s.total_s,
                "stamps": stamps,
            }
        chat = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
        route = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"model": self.model_id, "max_tokens": new, **gen, ("messages" if chat else "prompt"): prompt}
        body.pop("reuse", None)
        if self.api == "http":
            out = self.http.post(route, json=body)
            out.raise_for_status()
            n = out.json()["usage"]["completion_tokens"]
            return {"n": n, "ttft": None, "tok_s": None, "wall": time.perf_counter() - t0}
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        first = usage = None
        with self.http.stream("POST", route, json=body) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if first is None:
                    first = time.perf_counter()
                if '"usage":{' in line:
                    usage = json.loads(line[6:])["usage"]
        wall = time.perf_counter() - t0
        n = usage["completion_tokens"] if usage else 0
        tok_s = (n - 1) / (t0 + wall - first) if first and n > 1 and t0 + wall > first else None
        return {"n": n, "ttft": (first - t0) if first else None, "tok_s": tok_s, "wall": wall}


class ThreadPeak:
    """The most Python threads alive at once while it runs, the benchmark's request threads
    (`ThreadPoolExecutor-*`) and itself not counted: the main thread plus whatever serves the requests
    (the engine's loop; the server's event loop on the HTTP paths)."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, name="bench-thread-peak", daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            alive = [
                t for t in threading.enumerate() if not t.name.startswith(("ThreadPoolExecutor", "bench-"))
            ]
            self.peak = max(self.peak, len(alive))

    def __enter__(self) -> ThreadPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def at_once(fn: Callable[[Any], dict[str, Any]], prompts: list[Any], serial: bool) -> dict[str, Any]:
    """Run `fn` on every prompt, from one thread each released together (or one after another)."""
    t0 = time.perf_counter()
    with ThreadPeak() as threads:
        if serial:
            outs = [fn(p) for p in prompts]
        else:
            barrier = threading.Barrier(len(prompts))

            def go(p: Any) -> dict[str, Any]:
                barrier.wait()
                return fn(p)

            with ThreadPoolExecutor(len(prompts)) as ex:
                outs = list(ex.map(go, prompts))
    wall = time.perf_counter() - t0
    gen = sum(o["n"] for o in outs)
    ttft = [o["ttft"] * 1e3 for o in outs if o["ttft"] is not None]
    rates = [o["tok_s"] for o in outs if o["tok_s"]]
    return {
        "agg_tok_s": gen / wall,
        "phase_tok_s": decode_phase(outs) if not serial else None,
        "decode_tok_s": sum(rates) if rates and not serial else (u.median(rates) if rates else None),
        "ms_token": u.median(o["wall"] * 1e3 / o["n"] for o in outs if o["n"]) if gen else None,
        "ms_step": u.median(1e3 / r for r in rates) if rates else None,
        "ttft_p50": u.median(ttft) if ttft else None,
        "ttft_p99": u.p99(ttft) if ttft else None,
        "tokens": gen,
        "threads": threads.peak,
        "outs": outs,
    }


def decode_phase(outs: list[dict[str, Any]]) -> float | None:
    """Tokens a second while every request decodes: from the last request's first token to the first
    request's last, the tokens all of them gave in that window (no prefill in those steps). None without
    token times (the HTTP paths) or without such a window."""
    stamps = [o.get("stamps") for o in outs]
    if not all(stamps):
        return None
    lo, hi = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    if hi <= lo:
        return None
    return sum(sum(1 for t in s if lo < t <= hi) for s in stamps) / (hi - lo)


def make_prompts(args: Any, n: int, vocab: int, seed: int) -> list[Any]:
    if args.chat:
        return [
            [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (request {seed}-{i})"}]
            for i in range(n)
        ]
    return [u.random_ids(args.prompt, vocab, seed * 1000 + i) for i in range(n)]


def gen_kwargs(args: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"temperature": 0, "reuse": False}
    if args.speculative != "default":
        out["speculative"] = args.speculative
    return out


def sweep(args: Any, loaded: dict[str, Any]) -> tuple[str, str, Any]:
    apis, modes = args.api.split(","), args.modes.split(",")
    conc = u.ints(args.concurrency)
    clients = {(k, a): Client(m, a, max(conc)) for k, m in loaded.items() for a in apis}
    vocab = next(iter(loaded.values())).spec.vocab_size
    gen = gen_kwargs(args)
    rows, data = [], []
    seeds = itertools.count(1)
    try:
        for b in conc:
            contenders = {}
            for (k, a), client in clients.items():
                for mode in modes:

                    def go(client: Any = client, mode: str = mode, b: int = b) -> dict[str, Any]:
                        client.model.settle()
                        prompts = make_prompts(args, b, vocab, next(seeds))
                        return at_once(lambda p: client(p, args.new, gen), prompts, mode == "serial")

                    label = " ".join(
                        x for x in (k, a if len(apis) > 1 else "", mode if len(modes) > 1 else "") if x
                    )
                    contenders[label] = go
            if not args.no_warmup:
                for fn in contenders.values():
                    fn()  # warm-up: this batch size's captures
            runs = u.interleave(args.runs, contenders)
            base = None
            for label, v in runs.items():
                med = {
                    m: _med(x[m] for x in v)
                    for m in (
                        "agg_tok_s",
                        "decode_tok_s",
                        "phase_tok_s",
                        "ms_step",
                        "ms_token",
                        "ttft_p50",
                        "ttft_p99",
                    )
                }
                med["threads"] = max(x["threads"] for x in v)
                base = base or med["agg_tok_s"]
                data.append({"concurrency": b, "contender": label, **med})
                rows.append(
                    [
                        b,
                        label,
                        u.fmt(med["agg_tok_s"]),
                        u.fmt(med["decode_tok_s"]),
                        u.fmt(med["phase_tok_s"]),
                        u.fmt(b / med["phase_tok_s"] * 1e3 if med["phase_tok_s"] else None, 2),
                        u.fmt(med["ms_step"], 2),
                        u.fmt(med["ms_token"], 2),
                        u.fmt(med["ttft_p50"]),
                        u.fmt(med["ttft_p99"]),
                        str(med["threads"]),
                        u.ratio(med["agg_tok_s"], base),
                    ]
                )
        if args.profile:
            profile_batch(next(iter(contenders.values())), conc[-1], args.new)
    finally:
        for c in clients.values():
            c.close()
    header = [
        "concurrent",
        "contender",
        "aggregate tok/s",
        "decode tok/s",
        "all decoding: tok/s",
        "ms/step",
        "decode ms/step",
        "ms/token",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "threads",
        "vs first",
    ]
    p = "chat questions" if args.chat else f"{args.prompt}-token prompts"
    return f"sweep: {p}, {args.new} new tokens each", u.table(rows, header), data


def profile_batch(go: Callable[[], dict[str, Any]], batch: int, new: int, top: int = 14) -> None:
    """One more batch (`go`, the first contender at the largest concurrency) under torch.profiler (CUDA): the
    device's busy time per decode step against the wall's, and the kernels taking most of it, summed by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = go()
    kernels = u.kernels_by_name(prof)
    busy = sum(ms for _, ms, _ in kernels)
    steps = max(new, 1)
    print(
        f"\nprofiled batch of {batch}: wall {out['tokens'] / out['agg_tok_s'] * 1e3:,.0f} ms, kernels busy "
        f"{busy:,.0f} ms ({busy / steps:.2f} ms a step over {steps} steps, prefill included); "
        f"{sum(n for *_, n in kernels):,} kernels; median decode step {out['ms_step']:.2f} ms"
    )
    for name, ms, n in kernels[:top]:
        print(f"  {ms / steps:8.3f} ms/step {100 * ms / busy:5.1f} %  x{n / steps:6.1f}  {name[:110]}")


def _med(xs: Any) -> float | None:
    vals = [x for x in xs if x is not None]
    return u.median(vals) if vals else None


def shared(args: Any, loaded: dict[str, Any]) -> tuple[str, str, Any]:
    words = " ".join(
        f"Rule {i}: answer briefly and politely, in plain English." for i in range(args.system // 12)
    )
    salts = itertools.count()
    gen = {**gen_kwargs(args), "reuse": True}

    def rnd(model: Any, one: bool) -> dict[str, Any]:
        salt = f"round-{next(salts)}"
        msgs = []
        for i in range(args.clients):
            q = QUESTIONS[i % len(QUESTIONS)] + (f" (client {i})" if i >= len(QUESTIONS) else "")
            system = words if one else f"Client {i}. {words}"
            msgs.append([{"role": "system", "content": system}, {"role": "user", "content": q}])
        model.settle()

        def one_request(m: Any) -> dict[str, Any]:
            r = model.generate(m, max_new_tokens=args.new, salt=salt, **gen)
            s = r.stats
            return {
                "n": s.generated_tokens,
                "ttft": s.ttft_s,
                "tok_s": s.decode_tok_s,
                "wall": s.total_s,
                "pre": s.prefilled_tokens,
            }

        out = at_once(one_request, msgs, serial=False)
        out["prefilled"] = sum(o["pre"] for o in out["outs"])
        out["ttft_max"] = max(o["ttft"] for o in out["outs"]) * 1e3
        return out

    contenders = {}
    for k, m in loaded.items():
        contenders[f"{k}, one system prompt"] = lambda m=m: rnd(m, True)
        contenders[f"{k}, distinct system prompts"] = lambda m=m: rnd(m, False)
    for fn in contenders.values():
        fn()
    runs = u.interleave(args.runs, contenders)
    rows, data = [], {}
    for label, v in runs.items():
        med = {x: u.median(r[x] for r in v) for x in ("agg_tok_s", "ttft_p50", "ttft_max", "prefilled")}
        data[label] = med
        rows.append(
            [
                label,
                u.fmt(med["agg_tok_s"]),
                u.fmt(med["ttft_p50"], 0),
                u.fmt(med["ttft_max"], 0),
                f"{med['prefilled']:,.0f}",
            ]
        )
    n_prompt = len(next(iter(loaded.values())).encode([{"role": "system", "content": words}]))
    header = ["contender", "aggregate tok/s", "TTFT p50 ms", "TTFT max ms", "prompt tokens prefilled"]
    return (
        f"shared: {args.clients} requests at once, a {n_prompt}-token system prompt",
        u.table(rows, header),
        data,
    )


def team(args: Any, label: str, model: Any, run: int = 0) -> dict[str, Any]:
    """--agents sessions under one salt (new each run: nothing of an earlier run is shared), each --turns turns
    after the shared system prompt, all at once."""
    model.close()  # what earlier sections left in the prefix cache: count this section's pages alone
    vocab = model.spec.vocab_size
    system = u.random_ids(args.system, vocab, 7)
    ttft: list[tuple[int, float]] = []  # (turn, ms)
    itl: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(args.agents)
    gen = {key: v for key, v in gen_kwargs(args).items() if key != "reuse"}  # sessions reuse
    before = model.kv_stats()

    def agent(i: int) -> tuple[int, int]:
        s = model.session(salt=f"{label}-team-{run}")
        ctx = list(system)
        made = 0
        barrier.wait()
        for t in range(args.turns):
            ctx += u.random_ids(64, vocab, 1000 * i + t)
            r = s.generate(ctx, max_new_tokens=args.new, **gen)
            with lock:
                ttft.append((t, r.stats.ttft_s * 1e3))
                if r.stats.generated_tokens > 1 and r.stats.decode_tok_s > 0:
                    itl.append(1e3 / r.stats.decode_tok_s)
            made += r.stats.generated_tokens
            ctx += r.tokens
        return len(ctx), made

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.agents) as ex:
        out = list(ex.map(agent, range(args.agents)))
    wall = time.perf_counter() - t0
    st = model.kv_stats()
    looked = st.get("prefix_lookup_tokens", 0) - before.get("prefix_lookup_tokens", 0)
    first = [ms for t, ms in ttft if t == 0]
    later = [ms for t, ms in ttft if t > 0]
    return {
        "tok_s": sum(g for _, g in out) / wall,
        "ttft": [ms for _, ms in ttft],
        "ttft_p50": u.median(ms for _, ms in ttft),
        "ttft_p99": u.p99(ms for _, ms in ttft),
        "first_p50": u.median(first),
        "first_max": max(first),
        "later_p50": u.median(later) if later else 0.0,
        "later_p99": u.p99(later) if later else 0.0,
        "itl": itl,
        "held": st.get("pages_used", 0) * st.get("page_size", 0),
        "needed": args.system + sum(n - args.system for n, _ in out),
        "hits": (st.get("prefix_hit_tokens", 0) - before.get("prefix_hit_tokens", 0)) / max(looked, 1),
        "kv_stats": st,
    }


MEDIANS = ("tok_s", "ttft_p50", "ttft_p99", "first_p50", "first_max", "later_p50", "later_p99", "hits")


def agents(args: Any, loaded: dict[str, Any]) -> tuple[str, str, Any]:
    runs = iter(range(1 << 30))
    got = u.interleave(
        args.runs, {k: (lambda k=k, m=m: team(args, k, m, next(runs))) for k, m in loaded.items()}
    )
    rows, data = [], {}
    for k, ds in got.items():
        data[k] = ds
        d = ds[-1]  # pages held: the last run's (each run the same trace)
        med = {key: u.median(x[key] for x in ds) for key in MEDIANS}
        itl = [v for x in ds for v in x["itl"]]
        held, need = d["held"], d["needed"]
        rows.append(
            [
                k,
                f"{args.agents} x {args.turns}",
                u.fmt(med["tok_s"], 0),
                f"{med['ttft_p50']:,.1f} / {med['ttft_p99']:,.1f} ({med['ttft_p99'] / med['ttft_p50']:.1f}x)",
                f"{med['first_p50']:,.1f} / {med['first_max']:,.1f}",
                f"{med['later_p50']:,.1f} / {med['later_p99']:,.1f}" if args.turns > 1 else "-",
                f"{ds[0]['ttft_p50']:,.1f} / {ds[0]['ttft_p99']:,.1f}",
                f"{u.median(itl):,.2f} / {u.p99(itl):,.2f}" if itl else "-",
                f"{held:,} / {need:,} ({held / need:.2f}x)" if held else "-",
                f"{med['hits']:.1%}" if d["kv_stats"].get("paged") else "-",
            ]
        )
    header = [
        "engine",
        "agents x turns",
        "tok/s",
        "TTFT p50 / p99 ms",
        "turn 1 TTFT p50 / max",
        "later turns p50 / p99",
        "first run TTFT p50 / p99",
        "ITL p50 / p99 ms",
        "tokens held / needed",
        "prefix hits",
    ]
    title = f"agents: a {args.system}-token system prompt shared under one salt (median of {args.runs} runs)"
    return title, u.table(rows, header), data


RULES = [
    "Answer in plain English.",
    "Keep answers short and concrete.",
    "Never invent facts; say when you are unsure.",
    "Prefer lists when they help.",
    "Use metric units and quote prices in euros.",
    "Ask a follow-up question when the request is vague.",
    "Do not use emoji.",
    "Be polite but brief.",
]


def system_prompt(tokens: int, nonce: int) -> str:
    """About `tokens` tokens of a travel agent's instructions, unique to `nonce` (no reuse across runs)."""
    text = (
        f"Session {nonce}. You are Atlas, the assistant of a small travel agency in Lyon. You help customers "
    )
    text += "plan trips, compare destinations, estimate budgets and prepare packing lists."
    i = 0
    while len(text) < tokens * 4.2:
        text += f" Rule {i + 1}: {RULES[i % len(RULES)]}"
        i += 1
    return text


def _turn(http: Any, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """One streamed chat completion: TTFT (the first content), the gaps between content events (ITL), its
    text, usage (prompt, completion and cached tokens)."""
    t0 = time.perf_counter()
    ttft, text, usage, arrivals = None, [], {}, []
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    arrivals.append(time.perf_counter())
                    ttft = ttft if ttft is not None else arrivals[-1] - t0
                    text.append(piece)
            if ev.get("usage"):
                usage = ev["usage"]
            if ev.get("timings"):  # llama-server's: the prompt tokens its cache supplied
                usage = {**usage, "cache_n": ev["timings"].get("cache_n")}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = usage.get("cache_n") or 0
    return {
        "ttft": ttft,
        "itl": [b - a for a, b in itertools.pairwise(arrivals)],
        "text": "".join(text),
        "prompt": usage.get("prompt_tokens", 0),
        "completion": usage.get("completion_tokens", len(arrivals)),
        "cached": cached,
    }


def _trace_run(args: Any, http: Any, model: str, mode: str, nonce: int) -> dict[str, Any]:
    """One whole trace against one server (see the module docstring): its numbers."""
    bias = {str(t): -100 for t in u.ints(args.eos)}
    system = system_prompt(args.system, nonce=nonce)

    def conversation(c: int) -> list[dict[str, Any]]:
        headers = {}
        if mode == "on":
            sid = http.post("/v1/sessions").json()["id"]
            headers["X-Session-Id"] = sid
        msgs = [{"role": "system", "content": system}]
        turns = []
        for t in range(args.turns):
            msgs.append({"role": "user", "content": QUESTIONS[(c * args.turns + t) % len(QUESTIONS)]})
            body = {
                "model": model,
                "messages": msgs,
                "max_tokens": args.new,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                "logit_bias": bias,
                "ignore_eos": True,  # llama-server's; onnxgen ignores it (the logit bias does it there)
            }
            turns.append(_turn(http, body, headers))
            msgs.append({"role": "assistant", "content": turns[-1]["text"]})
            if args.think and t + 1 < args.turns:
                time.sleep(args.think)  # the user reads and types
        return turns

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.agents) as ex:
        convs = list(ex.map(conversation, range(args.agents)))
    wall = time.perf_counter() - t0
    first = [c[0]["ttft"] for c in convs]
    later = [t["ttft"] for c in convs for t in c[1:]]
    itl = [g for c in convs for t in c for g in t["itl"]]
    return {
        "wall_s": wall,
        "out_tok_s": sum(t["completion"] for c in convs for t in c) / wall,
        "itl_p50": u.median(itl) if itl else 0.0,
        "itl_p99": u.p99(itl) if itl else 0.0,
        "turn1_ttft_p50": u.median(first),
        "later_ttft_p50": u.median(later),
        "later_ttft_p99": u.p99(later),
        "later_cached": sum(t["cached"] for c in convs for t in c[1:]),
        "later_prompt": sum(t["prompt"] for c in convs for t in c[1:]),
        "turn1_prompt": convs[0][0]["prompt"],
        "texts": [[t["text"] for t in c] for c in convs],
    }


@contextlib.contextmanager
def _servers(args: Any) -> Iterator[list[tuple[str, str]]]:
    """The servers the trace runs against: (label, base URL). --url: "URL" (named --label) or "LABEL=URL,...";
    --cluster N: started here from --model on --device with the first --engine's load options, each engine one
    thread (--threads, default 1): one server in this process, and for each --routers mode N Ray Serve replicas
    behind an ingress (onnxgen.serve.cluster), each mode an application of one local Ray under its own route
    prefix; on CUDA the replicas share the cards Ray sees (N replicas on one card: half of it each for N = 2).
    Size the pools (`--engine kv_bytes=...`) so that every engine fits on the card at once."""
    if args.url:
        yield [tuple(x.split("=", 1)) if "=" in x else (args.label, x) for x in args.url.split(",")]
        return
    import socket

    import ray
    from ray import serve

    from onnxgen.serve.app import RunningServer, ServerConfig, create_app
    from onnxgen.serve.cluster.deployment import ClusterConfig, application, deploy, replica_gpus, start_ray

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - t0:.0f} s] {line}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    pkg = u.models(args)[0]
    opts = {"threads": args.threads or 1, **next(iter(u.engines(args.engine).values()))}
    capacity = {"max_queue": 4 * args.agents}
    one = RunningServer(create_app(u.load(pkg, args.device, opts), ServerConfig(**capacity)))
    say("1 server loaded")
    gpus = replica_gpus(args.device, args.cluster)  # N replicas on one card take 1/N of it each
    # Ray's actors log to files, not here: a start that hangs (Serve's controller or proxy failing to start, say)
    # prints the errors those files hold and ends the process rather than waiting for an outer time limit
    watchdog = threading.Timer(args.ready_timeout + 60, _give_up, ("Ray Serve did not start",))
    watchdog.daemon = True
    watchdog.start()
    start_ray(cuda=args.device == "cuda")
    say(f"Ray started ({ray.cluster_resources()})")
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        say("Serve started")
        out = [("1 server", one.url)]
        apps = []
        for mode in args.routers.split(","):
            config = ClusterConfig(
                replicas=args.cluster,
                mode=mode,
                num_gpus=gpus,
                load={**opts, "device": args.device},
                server=capacity,
            )
            apps.append((mode, f"/{mode}", application(str(pkg.path), config)))
            out.append((f"{args.cluster} replicas, {mode}", f"http://127.0.0.1:{port}/{mode}"))
        try:  # every mode's replicas load side by side
            deploy(apps, timeout_s=args.ready_timeout, progress=say)
        except Exception:
            print(_ray_errors(), file=sys.stderr, flush=True)
            raise
        watchdog.cancel()
        say(f"{args.cluster} replicas for each of {args.routers} serving")
        yield out
    finally:
        serve.shutdown()
        ray.shutdown()
        one.stop()


def _ray_errors(limit: int = 40) -> str:
    """What went wrong by the logs of this machine's newest Ray session (its actors' and daemons' output, which a
    driver started with `log_to_driver=False` does not show): the last lines of each `.err` file (its
    actor's stderr, INFO lines left out) and the error lines of the others, oldest file first."""
    import glob
    import os

    paths = [p for p in glob.glob("/tmp/ray/session_latest/logs/**/*", recursive=True) if os.path.isfile(p)]
    lines = []
    for path in sorted(paths, key=os.path.getmtime):
        try:
            with open(path, errors="replace") as f:
                text = [line.rstrip() for line in f if line.strip()]
        except OSError:
            continue
        if path.endswith(".err"):  # an actor's stderr: its log lines below WARNING left out
            text = [
                x
                for x in text
                if not x.startswith(("INFO ", "DEBUG ", ":actor_name:", ":task_name:", ":job_id:"))
            ]
        else:
            text = [x for x in text if any(w in x for w in ("Traceback", "Error:", " ERROR ", "No module"))]
        lines += [f"{os.path.basename(path)}: {line[:300]}" for line in text[-5:]]
    return "Ray's logs, last error lines:\n" + ("\n".join(lines[-limit:]) or "(none)")


def _give_up(what: str) -> None:
    """A watchdog's end: what did not happen and Ray's last error lines, then the process exits (status 3)."""
    import os

    print(f"{what} in time\n{_ray_errors()}", file=sys.stderr, flush=True)
    os._exit(3)


def trace(args: Any, loaded: dict[str, Any]) -> tuple[str, str, Any]:
    """The multi-turn trace against each server of `_servers`, per --sessions mode; the servers interleaved
    (the order reversed every other run), the same trace for each within a run, a fresh one each run."""
    import httpx

    data, rows = {}, []
    # NOTE: a connection per request, for every server alike (llama-server drops reused ones at times)
    limits = httpx.Limits(max_connections=args.agents + 4, max_keepalive_connections=0)
    with _servers(args) as servers:
        https = {label: httpx.Client(base_url=url, timeout=3600, limits=limits) for label, url in servers}
        models = {label: http.get("/v1/models").json()["data"][0]["id"] for label, http in https.items()}
        for mode in args.sessions.split(","):
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in servers}
            for run in range(args.runs):
                nonce = hash((mode, run, time.time())) % 100000
                for label, _ in servers if run % 2 == 0 else servers[::-1]:
                    runs[label].append(_trace_run(args, https[label], models[label], mode, nonce))
                print(f"trace run {run + 1}/{args.runs} (session ids {mode})", file=sys.stderr, flush=True)
            base = runs[servers[0][0]]
            for label, _ in servers:
                same = all(r["texts"] == b["texts"] for r, b in zip(runs[label], base, strict=True))
                med = {k: u.median(r[k] for r in runs[label]) for k in runs[label][0] if k != "texts"}
                share = med["later_cached"] / max(med["later_prompt"], 1)
                data[f"{label}|{mode}"] = {"runs": [{**r, "texts": None} for r in runs[label]], "median": med}
                rows.append(
                    [
                        f"{label} (session ids {mode})",
                        f"{med['turn1_ttft_p50'] * 1000:.0f}",
                        f"{med['later_ttft_p50'] * 1000:.0f}",
                        f"{med['later_ttft_p99'] * 1000:.0f}",
                        f"{med['itl_p50'] * 1000:.1f} / {med['itl_p99'] * 1000:.1f}",
                        f"{med['out_tok_s']:.1f}",
                        f"{med['wall_s']:.1f}",
                        f"{med['later_cached']:.0f} / {med['later_prompt']:.0f} ({share:.1%})",
                        "yes" if same else "no",
                    ]
                )
        for http in https.values():
            http.close()
    header = [
        "server",
        "turn 1 TTFT p50 ms",
        "later TTFT p50 ms",
        "later p99 ms",
        "ITL p50 / p99 ms",
        "output tok/s",
        "wall s",
        "later cached / prompt",
        f"replies = {servers[0][0]}'s",
    ]
    title = (
        f"trace: {args.agents} conversations x {args.turns} turns at once, ~{args.system}-token system prompt, "
        f"{args.new} new tokens a turn, {args.think:g} s think time, streamed (median of {args.runs})"
    )
    return title, u.table(rows, header), data


def main() -> int:
    ap = u.parser(__doc__)
    ap.add_argument("--sections", default="sweep")
    ap.add_argument("--concurrency", default="1,8,32,64,128")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--chat", action="store_true", help="chat questions instead of random-id prompts")
    ap.add_argument("--modes", default="concurrent", help="concurrent, serial or both")
    ap.add_argument("--api", default="python", help="python, http, http-stream (comma-separated)")
    ap.add_argument("--no-warmup", action="store_true", help="sweep: time an engine's first batches too")
    ap.add_argument(
        "--profile", action="store_true", help="sweep, CUDA: the largest batch once more under torch.profiler"
    )
    ap.add_argument("--speculative", default="off", choices=("off", "prompt_lookup", "default"))
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--system", type=int, default=600, help="system prompt tokens (shared: about)")
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument(
        "--think", type=float, default=0.0, help="trace: seconds between a reply and the next turn"
    )
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument(
        "--url", default=None, help="trace: the server (URL, or LABEL=URL,...) to replay it against"
    )
    ap.add_argument(
        "--cluster", type=int, default=0, help="trace: N replicas per --routers mode, started here"
    )
    ap.add_argument("--routers", default="affinity,round_robin", help="trace with --cluster: router modes")
    ap.add_argument(
        "--ready-timeout",
        type=float,
        default=600,
        help="trace with --cluster: seconds for the replicas to serve",
    )
    ap.add_argument("--label", default="server", help="trace: the server's name in the table")
    ap.add_argument("--sessions", default="off", help="trace: on (onnxgen's X-Session-Id), off, or both")
    ap.add_argument("--eos", default="2", help="trace: EOS ids to suppress, comma-separated")
    args = ap.parse_args()
    if args.sections == "trace":
        if args.url is None and not args.cluster:
            ap.error("--sections trace needs --url or --cluster")
        args.dry_run = True  # each run is a whole trace: --runs 1 is a measurement
        if args.cluster:
            u.require_cuda(args.device, "batch.py")
        title, text, d = trace(args, {})
        where = (
            args.url
            or f"started here from {args.model} on {args.device}, {args.threads or 1} thread(s) an engine"
        )
        device = args.device if args.cluster else "cpu"
        u.report(f"servers: {where}; {u.describe(device, None)}; greedy", [(title, text)], args, {"trace": d})
        return 0
    u.check_args(ap, args)
    u.require_cuda(args.device, "batch.py")
    if args.profile and args.device != "cuda":
        ap.error("--profile profiles CUDA kernels: run it with --device cuda")
    u.set_threads(args.threads)
    pkg = u.models(args)[0]
    specs = u.engines(args.engine)
    need = max([*u.ints(args.concurrency), args.clients, args.agents])
    loaded, load_s = {}, {}
    for k, opts in specs.items():  # room for every request of the run at once, unless the engine says
        t0 = time.perf_counter()
        loaded[k] = u.load(pkg, args.device, {"max_running": need, **opts}, args.threads)
        load_s[k] = time.perf_counter() - t0  # the load-time warm-up included (`ModelConfig.warmup`)
    tables, data = [], {}
    for name in args.sections.split(","):
        fn = {"sweep": sweep, "shared": shared, "agents": agents}.get(name)
        if fn is None:
            ap.error(f"unknown section {name!r}")
        title, text, d = fn(args, loaded)
        tables.append((title, text))
        data[name] = d
    loads = ", ".join(f"{k} {t:.1f} s" for k, t in load_s.items())
    caption = (
        f"model: {pkg.name} ({pkg.path}); {u.describe(args.device, args.threads)}; median of {args.runs}; "
        f"greedy; loaded in: {loads}"
    )
    u.report(caption, tables, args, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
