"""Conversations that keep their KV between requests, on the CPU or CUDA: multi-turn reuse, a turn on a
long retained context, a conversation that grows, replies that re-tokenize differently, chunked prefill.

    python benchmarks/sessions.py [--model default] [--device cpu] [--engine ...] --sections chat
    python benchmarks/sessions.py --model builder:8b16k --device cuda --sections retained,growing,chunks
    python benchmarks/sessions.py --model qwen_vl:small --sections images

Sections (contenders interleaved, the order reversed every other round, median of --runs):
  chat        a --turns-turn chat under a long system prompt, greedy --reply-tokens replies fixed first: each
              turn's TTFT with a `Session` (reuse), with a fresh prefill (`reuse=False`), and (CPU, --genai)
              one onnxruntime-genai Generator kept across turns with each turn's new ids appended
  retained    a --turn-token turn on a retained --context-token context (random ids): TTFT with the session,
              against the same prompt prefilled fresh; decode tok/s at that context
  resume      a --turn-token turn on a --context-token conversation: TTFT kept in its session, restored from
              the host tier (`Session.offload` before each run: its KV in host memory only; a third model of
              the engine, with `host_kv_bytes` set to twice the context), restored from its
              session file (the restore included; a second model of the same engine, its caches emptied after
              each run, the file dropped from the page cache, and again with the file wholly in the page
              cache), and prefilled fresh; the file's size
  idle        --idle sessions of --context tokens (a --shared-token prefix common to all, the rest their own)
              on a paged pool sized for --pool-sessions contexts and a host tier for --host-sessions: the
              time to open them (--idle-threads at once), RSS as they are made and as each resumes with a
              --turn-token turn, the host tier's largest size against its bound, how much each reused
  growing     one session from --grow START,END,STEP: STEP-token turns, --new tokens answered each: TTFT
              p50 / p99 and decode tok/s over the turns (--profile: one more turn under torch.profiler)
  retokenize  six two-turn chats whose replies are resent as text: the tokens turn 1 retained, how many turn 2
              reused, whether the reply's text re-tokenizes into the sampled ids (a chat model: default)
  chunks      a --context-token prefill with each --chunks value as the load option chunk_size: TTFT against
              no chunking, and (CUDA) the peak memory allocated beyond what the loaded engine holds
  images      (a vision package, e.g. --model qwen_vl:small) turn 2 of a chat whose turn 1 held an --image
              x --image picture: in the session with the same image, in the session with another one, fresh
              with the image's features cached, fresh with a new image (cold): TTFT, tokens reused and
              prefilled, vision graph runs (`kv_stats`), decode tok/s over --new tokens
Engines: each --engine (default: the device's default engine).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _util as u

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
SYSTEM = "You are a friendly, concise travel assistant. Answer in short paragraphs. " * 40
RETOKENIZE = [
    "Name three rivers in France.",
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "List three French cheeses.",
    "Give me two tips for learning to cook.",
    "Explain what a CPU does in one sentence.",
]
GREEDY = {"temperature": 0, "speculative": "off"}


def chat(args: Any, models: dict[str, Any], pkg: u.Package) -> tuple[str, str, Any]:
    first = next(iter(models.values()))
    msgs: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    prompts = []
    for q in QUESTIONS[: args.turns]:
        msgs = [*msgs, {"role": "user", "content": q}]
        prompts.append(first.encode(msgs))
        r = first.generate(msgs, max_new_tokens=args.reply_tokens, reuse=False, **GREEDY)
        msgs = [*msgs, {"role": "assistant", "content": r.text}]

    def reuse(m: Any) -> list[float]:
        s = m.session()
        out = [s.generate(ids, max_new_tokens=args.reply_tokens, **GREEDY).stats.ttft_s for ids in prompts]
        s.close()
        return out

    def fresh(m: Any) -> list[float]:
        return [m.generate(ids, max_new_tokens=1, reuse=False, **GREEDY).stats.ttft_s for ids in prompts]

    contenders = {f"{k} reuse": (lambda m=m: reuse(m)) for k, m in models.items()}
    contenders |= {f"{k} fresh": (lambda m=m: fresh(m)) for k, m in models.items()}
    if args.genai:
        peer = u.genai_model(pkg.path, args.threads)
        contenders["onnxruntime-genai append"] = lambda: genai_chat(peer, prompts, args.reply_tokens)
    for fn in contenders.values():
        fn()  # warm-up
    runs = u.interleave(args.runs, contenders)
    med = {k: [u.median(r[t] for r in v) * 1e3 for t in range(len(prompts))] for k, v in runs.items()}
    rows = [[t + 1, len(prompts[t]), *(f"{med[k][t]:,.1f}" for k in med)] for t in range(len(prompts))]
    notes = []
    for k in models:
        if len(prompts) > 1:
            t2 = med[f"{k} reuse"][1]
            peer_t2 = med.get("onnxruntime-genai append", [None, None])[1]
            vs = f", {t2 / peer_t2:.2f}x onnxruntime-genai's append" if peer_t2 else ""
            notes.append(f"turn 2, {k}: {med[f'{k} fresh'][1] / t2:.1f}x faster than fresh{vs}")
    text = u.table(rows, ["turn", "prompt tokens", *(f"{k} ms" for k in med)]) + "\n\n" + "\n".join(notes)
    return f"chat: TTFT per turn ({args.reply_tokens}-token replies)", text, med


def genai_chat(model: Any, prompts: list[list[int]], reply: int) -> list[float]:
    """One Generator across turns; each turn appends what its sequence lacks (rewinding to the common prefix
    first when re-tokenisation differs). Seconds to each turn's first token."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompts[-1]) + reply + 8)
    gen = og.Generator(model, params)
    seq: list[int] = []
    out = []
    for ids in prompts:
        t0 = time.perf_counter()
        keep = min(u.common_prefix(seq, ids), len(ids) - 1)
        if keep < len(seq):
            gen.rewind_to(keep)
        gen.append_tokens(ids[keep:])
        seq = list(ids)
        gen.generate_next_token()
        tok = int(gen.get_next_tokens()[0])
        out.append(time.perf_counter() - t0)
        n = 1
        while n < reply and not gen.is_done():
            seq.append(tok)
            gen.generate_next_token()
            tok = int(gen.get_next_tokens()[0])
            n += 1
    return out


def retained(args: Any, models: dict[str, Any]) -> tuple[str, str, Any]:
    vocab = next(iter(models.values())).spec.vocab_size
    ctx = u.random_ids(args.context, vocab, 1)
    turns = [u.random_ids(args.turn, vocab, 10 + i) for i in range(args.runs + 2)]
    sessions = {k: m.session() for k, m in models.items()}
    for k, m in models.items():  # warm-up: the context, and a turn of this size (captures, compiles)
        sessions[k].generate(ctx, max_new_tokens=1, **GREEDY)
        m.generate(ctx[:64], max_new_tokens=1, reuse=False, **GREEDY)
    rounds = iter(range(1 << 30))

    def turn(k: str) -> dict[str, float]:
        tk = turns[next(rounds) % len(turns)]
        sessions[k].generate(ctx, max_new_tokens=1, **GREEDY)  # back to the context: the same turn each time
        r = sessions[k].generate(ctx + tk, max_new_tokens=1, **GREEDY)
        return {"ttft_ms": r.stats.ttft_s * 1e3, "reused": r.stats.reused_tokens}

    def fresh(k: str) -> dict[str, float]:
        models[k].settle()
        r = models[k].generate(ctx + turns[0], max_new_tokens=1, reuse=False, **GREEDY)
        return {"ttft_ms": r.stats.ttft_s * 1e3}

    def decode(k: str) -> dict[str, float]:
        r = sessions[k].generate(ctx + turns[0], max_new_tokens=64, stop=[], **GREEDY)
        return {"tok_s": r.stats.decode_tok_s}

    contenders = {}
    for k in models:
        contenders |= {f"{k}|turn": lambda k=k: turn(k), f"{k}|fresh": lambda k=k: fresh(k)}
        contenders[f"{k}|decode"] = lambda k=k: decode(k)
    for fn in contenders.values():
        fn()
    runs = u.interleave(args.runs, contenders)
    rows, data = [], {}
    for k in models:
        t = u.median(x["ttft_ms"] for x in runs[f"{k}|turn"])
        f = u.median(x["ttft_ms"] for x in runs[f"{k}|fresh"])
        d = u.median(x["tok_s"] for x in runs[f"{k}|decode"])
        reused = runs[f"{k}|turn"][-1]["reused"]
        data[k] = {"turn_ms": t, "fresh_ms": f, "decode_tok_s": d, "reused": reused}
        rows.append([k, f"{t:,.2f}", reused, f"{f:,.1f}", f"{f / t:.1f}x", u.fmt(d)])
        sessions[k].close()
    header = [
        "engine",
        "turn TTFT ms",
        "reused",
        "fresh prefill TTFT ms",
        "turn speedup",
        "decode tok/s there",
    ]
    return (
        f"retained: a {args.turn}-token turn on a {args.context}-token context",
        u.table(rows, header),
        data,
    )


def resume(
    args: Any, models: dict[str, Any], pkg: u.Package, specs: dict[str, dict[str, Any]]
) -> tuple[str, str, Any]:
    """A --turn-token turn on a --context-token conversation: retained in the session, after a trip through the
    host tier, restored from its session file (`Model.restore_session` on a second model of the same engine
    whose caches are emptied after each run) twice, the file dropped from the OS page cache first (read from
    the disk) and wholly in it (read from memory, as a file saved recently is), and prefilled fresh."""
    import os
    import tempfile

    vocab = next(iter(models.values())).spec.vocab_size
    ctx = u.random_ids(args.context, vocab, 1)
    turns = [u.random_ids(args.turn, vocab, 10 + i) for i in range(args.runs + 2)]
    count = {}  # NOTE: a new turn each run: a paged pool keeps the last run's turn indexed

    def turn_of(name: str) -> list[int]:
        count[name] = count.get(name, -1) + 1
        return turns[count[name] % len(turns)]

    folder = Path(tempfile.mkdtemp(prefix="onnxgen-resume-"))
    sessions, files, sizes, held = {}, {}, {}, {}
    per_token = kv_bytes_per_token(next(iter(models.values())))
    room = {"kv_bytes": 3 * per_token * (args.context + 2 * args.turn)}  # the second and third models' pools
    restorers = {k: u.load(pkg, args.device, {**room, **specs[k]}, args.threads) for k in models}
    hosts = {}
    for k in models:  # the host tier: room for the context
        extra = {"host_kv_bytes": 2 * per_token * (args.context + args.turn)}
        hosts[k] = u.load(pkg, args.device, {**room, **extra, **specs[k]}, args.threads)
    for k, m in models.items():
        sessions[k] = m.session()
        sessions[k].generate(ctx, max_new_tokens=1, **GREEDY)
        files[k] = folder / f"{len(files)}.onnxgen"
        sizes[k] = sessions[k].save(files[k])
        restorers[k].generate(ctx[:64], max_new_tokens=1, reuse=False, **GREEDY)  # warm-up
        held[k] = hosts[k].session()
        held[k].generate(ctx, max_new_tokens=1, **GREEDY)

    def host(k: str) -> dict[str, float]:
        s = held[k]
        hosts[k].settle()
        assert s.offload() > 0, "the context went to no tier"
        t0 = time.perf_counter()
        r = s.generate(ctx + turn_of(f"{k}|host"), max_new_tokens=1, **GREEDY)
        wall = (
            time.perf_counter() - t0
        )  # NOTE: the restore included wherever it runs (the caller's thread or the step)
        s.generate(ctx, max_new_tokens=1, **GREEDY)  # back to the context (restored from the tier too)
        return {"ttft_ms": wall * 1e3, "reused": r.stats.reused_tokens}

    def retained(k: str) -> dict[str, float]:
        sessions[k].generate(ctx, max_new_tokens=1, **GREEDY)  # back to the context: the same turn each time
        r = sessions[k].generate(ctx + turn_of(f"{k}|retained"), max_new_tokens=1, **GREEDY)
        return {"ttft_ms": r.stats.ttft_s * 1e3, "reused": r.stats.reused_tokens}

    def restored(k: str, cached: bool = False) -> dict[str, float]:
        m = restorers[k]
        fd = os.open(files[k], os.O_RDONLY)
        try:  # NOTE: the file's pages leave the page cache (the restore reads the disk), or all come in
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED if cached else os.POSIX_FADV_DONTNEED)
            if cached:
                while os.read(fd, 64 << 20):
                    pass
        finally:
            os.close(fd)
        m.settle()
        t0 = time.perf_counter()
        s = m.restore_session(files[k])
        t1 = time.perf_counter()
        r = s.generate(ctx + turn_of(f"{k}|restored"), max_new_tokens=1, **GREEDY)
        s.close()
        m.close()  # the restored pages leave the pool: the next run restores them again
        return {
            "ttft_ms": (t1 - t0 + r.stats.ttft_s) * 1e3,
            "restore_ms": (t1 - t0) * 1e3,
            "reused": r.stats.reused_tokens,
        }

    def fresh(k: str) -> dict[str, float]:
        models[k].settle()
        r = models[k].generate(ctx + turn_of(f"{k}|fresh"), max_new_tokens=1, reuse=False, **GREEDY)
        return {"ttft_ms": r.stats.ttft_s * 1e3}

    def page_cache(k: str) -> dict[str, float]:
        return restored(k, cached=True)

    names = ("retained", "host", "restored", "page_cache", "fresh")
    contenders = {}
    for k in models:
        for name, fn in zip(names, (retained, host, restored, page_cache, fresh), strict=True):
            contenders[f"{k}|{name}"] = lambda k=k, fn=fn: fn(k)
    for fn in contenders.values():
        fn()
    runs = u.interleave(args.runs, contenders)
    rows, data = [], {}
    for k in models:
        med = {n: u.median(x["ttft_ms"] for x in runs[f"{k}|{n}"]) for n in names}
        restore_ms = u.median(x["restore_ms"] for x in runs[f"{k}|restored"])
        cached_ms = u.median(x["restore_ms"] for x in runs[f"{k}|page_cache"])
        reused = {n: runs[f"{k}|{n}"][-1]["reused"] for n in ("retained", "host", "restored")}
        assert reused["retained"] == reused["restored"] == len(ctx), ("both turns reuse the context", reused)
        # a paged pool's host tier holds full pages: a context's last partial page is recomputed with the turn
        assert len(ctx) - reused["host"] < 64, ("the host tier gave the context back", reused)
        data[k] = {
            **med,
            "restore_ms": restore_ms,
            "page_cache_restore_ms": cached_ms,
            "reused": reused,
            "file_bytes": sizes[k],
        }
        fresh_ms = med["fresh"]
        rows.append(
            [
                k,
                f"{med['retained']:,.1f}",
                f"{med['host']:,.1f} ({med['host'] / fresh_ms:.3f})",
                f"{med['restored']:,.1f} ({med['restored'] / fresh_ms:.3f}; {restore_ms:,.0f} restore)",
                f"{med['page_cache']:,.1f} ({med['page_cache'] / fresh_ms:.3f}; {cached_ms:,.0f} restore)",
                f"{fresh_ms:,.1f}",
                f"{sizes[k] / 2**20:,.0f} MiB",
                f"{reused['host']} / {reused['restored']}",
            ]
        )
        for m in (sessions[k], held[k], restorers[k], hosts[k]):
            m.close()
    for f in files.values():
        f.unlink(missing_ok=True)
    folder.rmdir()
    header = [
        "engine",
        "retained TTFT ms",
        "from the host tier TTFT ms (/ fresh)",
        "from its file on disk TTFT ms (/ fresh)",
        "from its file in the page cache TTFT ms (/ fresh)",
        "fresh prefill TTFT ms",
        "file",
        "reused: host / file",
    ]
    title = (
        f"resume: a {args.turn}-token turn on a {args.context}-token conversation: kept, restored from host memory,"
        " restored from its file, recomputed"
    )
    return title, u.table(rows, header), data


def kv_bytes_per_token(model: Any) -> int:
    """KV bytes one token takes in every layer (keys and values, the package's KV dtype)."""
    import numpy as np

    spec = model.spec
    size = 2 if spec.kv_dtype in ("bfloat16", "float16") else np.dtype(spec.kv_dtype).itemsize
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_size * size


def rss_bytes() -> tuple[int, int]:
    """This process's resident memory now and at its peak (Linux: /proc/self/status)."""
    fields = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


def idle(args: Any, pkg: u.Package, specs: dict[str, dict[str, Any]]) -> tuple[str, str, Any]:
    """--idle sessions of --context tokens sharing a --shared-token prefix on a paged pool for --pool-sessions
    contexts and a host tier for --host-sessions; each opened with one prefill of its own tokens, then each
    resumed with a --turn-token turn. RSS sampled as they go; the host tier's size after every request."""
    rows, data = [], {}
    for k, opts in specs.items():
        row, data[k] = idle_run(args, pkg, opts)
        rows.append([k, *row])
    header = [
        "engine",
        "sessions x tokens",
        "pool / host tier",
        "open all / resume all",
        "RSS: shared prefix / largest opening / after resuming / peak",
        "host tier at most",
        "resumed whole / at least the prefix / all",
        "reused min / median",
    ]
    title = (
        f"idle: {args.idle} sessions of {args.context} tokens, a pool for {args.pool_sessions} contexts, "
        f"a host tier for {args.host_sessions}, each resumed with a {args.turn}-token turn"
    )
    return title, u.table(rows, header), data


def idle_run(args: Any, pkg: u.Package, opts: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """One engine's idle run: its table row and its numbers."""
    from concurrent.futures import ThreadPoolExecutor

    probe = u.load(pkg, args.device, {**opts, "kv_bytes": 1 << 24}, args.threads)
    per_token, vocab = kv_bytes_per_token(probe), probe.spec.vocab_size
    probe.close()
    del probe
    u.release(args.device)
    pool = args.pool_sessions * args.context * per_token
    bound = args.host_sessions * args.context * per_token
    m = u.load(pkg, args.device, {**opts, "kv_bytes": pool, "host_kv_bytes": bound}, args.threads)
    assert m.paged, "the idle section runs on a paged pool (the native backend)"
    shared = u.random_ids(args.shared, vocab, 5)
    own = [u.random_ids(args.context - args.shared, vocab, 100 + i) for i in range(args.idle)]
    turns = [u.random_ids(args.turn, vocab, 5000 + i) for i in range(args.idle)]
    m.generate(shared + own[0][:8], max_new_tokens=1, **GREEDY)  # the shared prefix, computed once
    rss0 = rss_bytes()[0]
    sessions = [m.session() for _ in range(args.idle)]
    largest, samples = [0], []

    def request(i: int, ids: list[int]) -> int:
        r = sessions[i].generate(ids, max_new_tokens=1, **GREEDY)
        largest[0] = max(largest[0], m.kv_snapshot().get("host_pages_bytes", 0))
        if i % max(args.idle // 20, 1) == 0:
            samples.append(rss_bytes()[0])
        return r.stats.reused_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.idle_threads) as ex:
        list(ex.map(lambda i: request(i, shared + own[i]), range(args.idle)))
    opened_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.idle_threads) as ex:
        reused = list(ex.map(lambda i: request(i, shared + own[i] + turns[i]), range(args.idle)))
    resumed_s = time.perf_counter() - t0
    rss_now, peak = rss_bytes()
    st = m.kv_stats()
    host = max(largest[0], st.get("host_pages_bytes", 0))
    assert host <= bound, (host, bound)
    P = st["page_size"]
    whole = sum(r >= args.context // P * P for r in reused)
    prefix = sum(r >= args.shared // P * P for r in reused)
    for s in sessions:
        s.close()
    m.close()
    gib = 1 << 30
    row = [
        f"{args.idle:,} x {args.context:,} ({args.shared:,} shared)",
        f"{pool / gib:.2f} / {bound / gib:.2f} GiB",
        f"{opened_s:,.0f} s / {resumed_s:,.0f} s",
        f"{rss0 / gib:.2f} / {max(samples, default=0) / gib:.2f} / {rss_now / gib:.2f} / {peak / gib:.2f} GiB",
        f"{host / gib:.2f} GiB ({host / bound:.0%})",
        f"{whole:,} / {prefix:,} / {args.idle:,}",
        f"{min(reused):,} / {u.median(reused):,.0f}",
    ]
    numbers = {
        "per_token": per_token,
        "pool_bytes": pool,
        "host_bound": bound,
        "host_largest": host,
        "opened_s": opened_s,
        "resumed_s": resumed_s,
        "rss_after_shared": rss0,
        "rss_samples": samples,
        "rss_resumed": rss_now,
        "rss_peak": peak,
        "reused": reused,
        "kv_stats": st,
    }
    return row, numbers


def growing(args: Any, models: dict[str, Any]) -> tuple[str, str, Any]:
    start, end, step = u.ints(args.grow)
    rows, data = [], {}
    for k, m in models.items():
        vocab = m.spec.vocab_size
        s = m.session()
        ctx = u.random_ids(start, vocab, 11)
        s.generate(ctx, max_new_tokens=1, **GREEDY)
        ttft, tps = [], []
        while len(ctx) + step + args.new <= end:
            ctx = ctx + u.random_ids(step, vocab, len(ctx))
            r = s.generate(ctx, max_new_tokens=args.new, stop=[], **GREEDY)
            ttft.append(r.stats.ttft_s * 1e3)
            tps.append(r.stats.decode_tok_s)
            ctx = ctx + r.tokens
        if args.profile and len(ctx) + step + 2 <= m.spec.context_length:
            profile_turn(s, ctx + u.random_ids(step, vocab, len(ctx)), args.device)
        s.close()
        t, d = ttft[1:] or ttft, tps[1:] or tps  # the first turn may warm caches
        data[k] = {"ttft_ms": ttft, "decode_tok_s": tps}
        spread = (max(d) - min(d)) / statistics.median(d) if d and statistics.median(d) else 0.0
        rows.append(
            [
                k,
                len(ttft),
                f"{u.median(t):,.2f}",
                f"{u.p99(t):,.2f}",
                f"{min(d):,.1f}-{max(d):,.1f}",
                f"{spread:.1%}",
            ]
        )
    header = ["engine", "turns", "TTFT p50 ms", "TTFT p99 ms", "decode tok/s", "decode spread"]
    title = f"growing: {start} -> {end} tokens in {step}-token turns, {args.new} tokens answered"
    return title, u.table(rows, header), data


def profile_turn(session: Any, ctx: list[int], device: str) -> None:
    """One more turn under torch.profiler: the host's ops by self time (and the device's kernels on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        r = session.generate(ctx, max_new_tokens=1, **GREEDY)
    print(f"\nprofiled turn: TTFT {r.stats.ttft_s * 1e3:.2f} ms (profiler on)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    if device == "cuda":
        print(
            prof.key_averages().table(
                sort_by="self_device_time_total", row_limit=12, max_name_column_width=60
            )
        )


IMAGE_CASES = {
    "same": "session, same image",
    "other": "session, another image",
    "cached": "fresh, features cached",
    "cold": "fresh, new image",
}


def images(args: Any, models: dict[str, Any]) -> tuple[str, str, Any]:
    """Turn 2 of a chat whose turn 1 asked about an image (a fixed reply between them), four ways per engine
    (`IMAGE_CASES`). A session case runs turn 1 first (one token, untimed), so turn 2 finds its KV; every
    "new" or "another" image is one no request has shown before, so the vision graph runs for it."""
    import io

    import numpy as np
    from PIL import Image

    def png(seed: int) -> bytes:
        pixels = np.random.default_rng(seed).integers(0, 256, (args.image, args.image, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        return buf.getvalue()

    question = [{"type": "image"}, {"type": "text", "text": "What is in this picture? Describe it."}]
    turn1 = [{"role": "user", "content": question}]
    reply = "It shows a field of coloured noise, with no objects or text that I can make out."
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "Anything else?"}]
    image = png(0)
    fresh = iter(range(1, 1 << 30))  # seeds of images no request has shown
    opts = {"max_new_tokens": args.new, "stop": [], **GREEDY}

    def vision_runs(m: Any) -> int:
        return int(m.kv_stats().get("vision_runs", 0))

    def case(m: Any, name: str) -> dict[str, float]:
        other = png(next(fresh)) if name in ("other", "cold") else image
        s = m.session() if name in ("same", "other") else None
        if s is not None:
            s.generate(turn1, images=[image], max_new_tokens=1, **GREEDY)
        runs = vision_runs(m)
        if s is not None:
            r = s.generate(turn2, images=[other], **opts)
            s.close()
        else:
            r = m.generate(turn2, images=[other], reuse=False, **opts)
        st = r.stats
        return {
            "ttft_ms": st.ttft_s * 1e3,
            "prompt": st.prompt_tokens,
            "reused": st.reused_tokens,
            "prefilled": st.prefilled_tokens,
            "vision_runs": vision_runs(m) - runs,
            "tok_s": st.decode_tok_s,
        }

    contenders = {f"{k}|{c}": (lambda m=m, c=c: case(m, c)) for k, m in models.items() for c in IMAGE_CASES}
    for fn in contenders.values():
        fn()  # warm-up
    runs = u.interleave(args.runs, contenders)
    rows, data = [], {}
    for k in models:
        cold = u.median(x["ttft_ms"] for x in runs[f"{k}|cold"])
        for c, label in IMAGE_CASES.items():
            xs = runs[f"{k}|{c}"]
            med = {f: u.median(x[f] for x in xs) for f in ("ttft_ms", "tok_s")}
            last = xs[-1]
            data[f"{k}|{c}"] = {**last, **med}
            rows.append(
                [k, label, last["prompt"], last["reused"], last["prefilled"], last["vision_runs"],
                 f"{med['ttft_ms']:,.1f}", f"{cold / med['ttft_ms']:.1f}x", u.fmt(med["tok_s"])]
            )  # fmt: skip
    header = ["engine", "turn 2", "prompt", "reused", "prefilled", "vision runs", "TTFT ms", "vs cold", "tok/s"]  # fmt: skip
    title = f"images: turn 2 of a chat about a {args.image}x{args.image} image, {args.new} tokens answered"
    return title, u.table(rows, header), data


def retokenize(args: Any, models: dict[str, Any]) -> tuple[str, str, Any]:
    rows, data = [], {}
    for k, m in models.items():
        held_all = reused_all = 0
        for q in RETOKENIZE:
            s = m.session()
            history = [{"role": "user", "content": q}]
            r1 = s.generate(history, max_new_tokens=args.reply_tokens, **GREEDY)
            held = s.retained_tokens
            plain = m.encode([*history, {"role": "assistant", "content": r1.text}])
            sampled = [t for t in r1.tokens if t not in m.eos_token_ids]
            same = plain[len(r1.prompt_ids) : len(r1.prompt_ids) + len(sampled)] == sampled
            history += [
                {"role": "assistant", "content": r1.text},
                {"role": "user", "content": "Tell me more."},
            ]
            r2 = s.generate(history, max_new_tokens=4, **GREEDY)
            s.close()
            reused = r2.stats.reused_tokens
            held_all, reused_all = held_all + held, reused_all + reused
            rows.append([k, q, held, f"{reused} ({reused / held:.0%})", "yes" if same else "no"])
        data[k] = {"retained": held_all, "reused": reused_all}
        rows.append([k, "all", held_all, f"{reused_all} ({reused_all / held_all:.1%})", ""])
    header = ["engine", "chat", "retained after turn 1", "reused on turn 2", "reply re-tokenizes to its ids"]
    return (
        f"retokenize: turn 2 resends turn 1's reply as text ({args.reply_tokens} tokens)",
        u.table(rows, header),
        data,
    )


def chunks(args: Any, pkg: u.Package, specs: dict[str, dict[str, Any]]) -> tuple[str, str, Any]:
    import torch

    cuda = args.device == "cuda"
    rows, data = [], {}
    for k, opts in specs.items():
        results = {}
        for chunk in [*u.ints(args.chunks), None]:
            u.release(args.device)
            m = u.load(pkg, args.device, {**opts, "chunk_size": chunk}, args.threads)
            ctx = u.random_ids(args.context, m.spec.vocab_size, 3)
            m.generate(ctx[:64], max_new_tokens=1, reuse=False, **GREEDY)
            times, peaks = [], []
            for i in range(args.runs + 2):  # the first two runs of a prefill shape may compile or capture
                u.sync(args.device)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated() if cuda else 0
                r = m.generate(ctx, max_new_tokens=1, reuse=False, **GREEDY)
                u.sync(args.device)
                if i >= 2:
                    times.append(r.stats.ttft_s * 1e3)
                    peaks.append((torch.cuda.max_memory_allocated() - before) if cuda else None)
            results[chunk] = (u.median(times), max(peaks) if cuda else None)
            m.close()
            del m
        none_ms = results[None][0]
        for chunk, (ms, peak) in results.items():
            rows.append(
                [
                    k,
                    chunk or "none",
                    f"{ms:,.1f}",
                    f"{ms / none_ms:.2f}x",
                    u.fmt(peak / 1e9, 3) if peak else "-",
                ]
            )
        data[k] = {str(c): v for c, v in results.items()}
    header = ["engine", "chunk", "TTFT ms", "vs none", "peak beyond the loaded engine GB"]
    return f"chunks: a {args.context}-token prefill", u.table(rows, header), data


def main() -> int:
    ap = u.parser(__doc__)
    ap.add_argument("--sections", default="chat")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--genai", action="store_true", help="chat: onnxruntime-genai's append too (CPU)")
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--turn", type=int, default=64)
    ap.add_argument("--grow", default="7900,9000,64", help="START,END,STEP")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--chunks", default="256,512,1024")
    ap.add_argument("--image", type=int, default=448, help="images: the picture's side in pixels")
    ap.add_argument("--idle", type=int, default=1000, help="idle: how many sessions")
    ap.add_argument("--shared", type=int, default=1920, help="idle: the prefix every session starts with")
    ap.add_argument("--pool-sessions", type=int, default=50, help="idle: the pool holds this many contexts")
    ap.add_argument("--host-sessions", type=int, default=50, help="idle: the host tier holds this many")
    ap.add_argument("--idle-threads", type=int, default=8, help="idle: sessions opened / resumed at once")
    args = ap.parse_args()
    u.check_args(ap, args)
    u.require_cuda(args.device, "sessions.py")
    u.set_threads(args.threads)
    pkg = u.models(args)[0]
    specs = u.engines(args.engine)
    sections = args.sections.split(",")
    loaded = (
        {k: u.load(pkg, args.device, o, args.threads) for k, o in specs.items()}
        if not set(sections) <= {"chunks", "idle"}
        else {}
    )
    tables, data = [], {}
    for name in sections:
        if name == "chat":
            out = chat(args, loaded, pkg)
        elif name == "retained":
            out = retained(args, loaded)
        elif name == "growing":
            out = growing(args, loaded)
        elif name == "resume":
            out = resume(args, loaded, pkg, specs)
        elif name == "retokenize":
            out = retokenize(args, loaded)
        elif name == "images":
            out = images(args, loaded)
        elif name in ("chunks", "idle"):
            for m in loaded.values():
                m.close()
            loaded = {}
            out = chunks(args, pkg, specs) if name == "chunks" else idle(args, pkg, specs)
        else:
            ap.error(f"unknown section {name!r}")
        tables.append(out[:2])
        data[name] = out[2]
    caption = f"model: {pkg.name} ({pkg.path}); {u.describe(args.device, args.threads)}; median of {args.runs}; greedy"
    u.report(caption, tables, args, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
