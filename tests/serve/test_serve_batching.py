"""The server on the batching engine (native backend, paged KV, CPU): 32 concurrent clients get exactly
what the same requests give run one at a time, with no 5xx; reuse is shared within a key and never
across keys; /metrics shows the engine's queue and the pool."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from onnxgen.serve.app import RunningServer, ServerConfig, create_app  # noqa: E402
from tests.conftest import native_available  # noqa: E402
from tests.harness import loaded  # noqa: E402

pytestmark = pytest.mark.skipif(not native_available(), reason="native backend not importable")

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
CLIENTS = 32


@pytest.fixture(scope="module")
def paged_engine(tiny_dir: Path):
    engine, m = loaded(tiny_dir, backend="native")
    assert m.paged
    return engine, m


@pytest.fixture(scope="module")
def paged_model(paged_engine):
    return paged_engine[1]


def chat(http, model_id: str, text: str, key: str, n: int = 6) -> httpx.Response:
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": n,
        "temperature": 0,
    }
    return http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def test_concurrent_clients_equal_serial_runs_and_no_5xx(paged_engine) -> None:
    engine, paged_model = paged_engine
    app = create_app(paged_model, ServerConfig(api_keys=(KEY_A, KEY_B), metrics_keys=(KEY_A,)))
    steps = {"n": 0, "batched": 0}
    original = engine.executor.run

    def counting(chunks):
        steps["n"] += 1
        steps["batched"] += len(chunks) > 1
        return original(chunks)

    engine.executor.run = counting
    try:
        with RunningServer(app) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
            model_id = http.get("/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}).json()["data"][0][
                "id"
            ]
            prompts = [f"client {c} says hello number {c * 7}" for c in range(CLIENTS)]

            def client(c: int) -> tuple[int, str]:
                r = chat(http, model_id, prompts[c], KEY_A if c % 2 else KEY_B)
                return r.status_code, r.json()["choices"][0]["message"][
                    "content"
                ] if r.status_code == 200 else ""

            with ThreadPoolExecutor(CLIENTS) as ex:
                out = list(ex.map(client, range(CLIENTS)))
            metrics = http.get("/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).text
    finally:
        engine.executor.run = original
    assert [s for s, _ in out] == [200] * CLIENTS
    for c, (_, text) in enumerate(out):
        ref = paged_model.generate(
            [{"role": "user", "content": prompts[c]}], max_new_tokens=6, temperature=0, reuse=False
        )
        assert text == ref.text, c
    assert steps["batched"] > 0, "concurrent requests never shared an engine step"
    for name in (
        "onnxgen_requests_running 0",
        "onnxgen_requests_waiting 0",
        "onnxgen_kv_pages_used",
        "onnxgen_kv_pages_shared",
        "onnxgen_prefix_hit_rate",
        "onnxgen_preemptions",
    ):
        assert name in metrics, name


def test_prefix_reuse_within_a_key_never_across_keys(paged_model) -> None:
    key_c, key_d = "key-c-only-this-test", "key-d-only-this-test"  # salts no other test has used
    app = create_app(paged_model, ServerConfig(api_keys=(key_c, key_d)))
    text = "a long shared system prompt " * 8
    with RunningServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        model_id = http.get("/v1/models", headers={"Authorization": f"Bearer {key_c}"}).json()["data"][0][
            "id"
        ]

        def cached(key: str, suffix: str) -> int:
            r = chat(http, model_id, text + suffix, key, n=2)
            assert r.status_code == 200
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached(key_c, "one") == 0
        assert cached(key_c, "two") > 0, "the key's own earlier prompt is reused"
        assert cached(key_d, "one") == 0, "another key's prompt is never visible"
