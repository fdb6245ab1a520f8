"""Server overhead per generated token vs the Python API, on the same model and requests.

    .venv/bin/python benchmarks/serve_overhead.py [--model DIR] [--tokens 64] [--runs 5] [--threads 2]

Each round runs the same completion request (raw prompt, greedy, max_tokens N) through
`Session.generate`, through `POST /v1/completions` (JSON) and through the same route streamed (SSE),
in alternating order; each path uses its own session on the same loaded model, so reuse is
identical. Reports median seconds per generated token and the ratio server / API.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

import onnxgen
from onnxgen.serve.app import RunningServer, ServerConfig, create_app

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    model = onnxgen.load(a.model, backend="ort", threads=a.threads)
    app = create_app(model, ServerConfig())
    session = model.session()
    out: dict[str, list[float]] = {"api": [], "http": [], "http_stream": []}
    with RunningServer(app) as srv, httpx.Client(base_url=srv.url, timeout=300) as http:
        mid = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": mid, "prompt": PROMPT, "max_tokens": a.tokens, "temperature": 0}

        def api() -> float:
            t = time.perf_counter()
            r = session.generate(PROMPT, max_new_tokens=a.tokens, temperature=0)
            return (time.perf_counter() - t) / len(r.tokens)

        def plain() -> float:
            t = time.perf_counter()
            r = http.post("/v1/completions", json=body).json()
            return (time.perf_counter() - t) / r["usage"]["completion_tokens"]

        def stream() -> float:
            t = time.perf_counter()
            usage = None
            with http.stream(
                "POST",
                "/v1/completions",
                json={**body, "stream": True, "stream_options": {"include_usage": True}},
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"usage":{' in line:
                        usage = json.loads(line[6:])["usage"]
            return (time.perf_counter() - t) / usage["completion_tokens"]

        for f in (api, plain, stream):  # warm-up
            f()
        fns = {"api": api, "http": plain, "http_stream": stream}
        for r in range(a.runs):
            for name in list(fns) if r % 2 == 0 else reversed(list(fns)):
                out[name].append(fns[name]())
    med = {k: statistics.median(v) for k, v in out.items()}
    print(
        f"model {model.spec.path.name} · ort/cpu threads={a.threads} · {a.tokens} tokens · {a.runs} runs (median)"
    )
    print("| path | ms / token | ratio vs API |\n|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v * 1000:.2f} | {v / med['api']:.3f} |")


if __name__ == "__main__":
    main()
