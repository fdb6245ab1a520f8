"""The OpenAI-compatible server on a tiny synthetic package: the official `openai` client, raw HTTP
for every error status, sessions and key scoping, queue bound, cancellation, and a loopback load
test whose outputs must equal the same requests run serially through the Python API."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from onnxgen.serve.app import RunningServer, ServerConfig, create_app  # noqa: E402
from tests.harness import loaded  # noqa: E402

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir: Path):
    return loaded(tiny_dir, backend="ort", threads=1)


@pytest.fixture(scope="module")
def tiny_model(tiny_engine):
    return tiny_engine[1]


@pytest.fixture(scope="module")
def server(tiny_model):
    config = ServerConfig(
        api_keys=(KEY_A, KEY_B), max_queue=2, max_body_bytes=MAX_BODY, metrics_keys=(KEY_A,)
    )
    app = create_app(tiny_model, config)
    with RunningServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def post(server, path: str, body, key: str | None = KEY_A, **headers) -> httpx.Response:
    h = {"Authorization": f"Bearer {key}"} if key else {}
    h.update(headers)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        server.url + path, content=content, headers={"Content-Type": "application/json", **h}, timeout=60
    )


def msgs(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# --- the openai client ----------------------------------------------------------------------


def test_chat_matches_python_api(client, model_id, tiny_model):
    r = client.chat.completions.create(
        model=model_id, messages=msgs("hello there"), max_tokens=12, temperature=0
    )
    ref = tiny_model.session().generate(msgs("hello there"), max_new_tokens=12, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == ref.stats.prompt_tokens
    assert r.usage.completion_tokens == len(ref.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_equals_plain(client, model_id, server):
    sid = httpx.post(server.url + "/v1/sessions", headers={"Authorization": f"Bearer {KEY_A}"}).json()["id"]
    kw = {"model": model_id, "messages": msgs("stream me"), "max_tokens": 16, "temperature": 0}
    plain = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}, extra_headers={"X-Session-Id": sid}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_sse_wire_format(server, model_id):
    body = {"model": model_id, "messages": msgs("wire"), "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        assert json.loads(ln[6:])["object"] == "chat.completion.chunk"


def test_completions_plain_and_stream(client, model_id, tiny_model):
    r = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=10, temperature=0)
    ref = tiny_model.session().generate("Once upon a time", max_new_tokens=10, temperature=0)
    assert r.choices[0].text == ref.text and r.object == "text_completion"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model_id, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True
        )
    )
    assert streamed == ref.text


def test_session_follow_up_reports_cached_tokens(client, model_id, server, tiny_model):
    sid = client.post("/sessions", cast_to=object, body={})["id"]
    assert len(sid) == 32 and int(sid, 16) >= 0
    h = {"X-Session-Id": sid}
    conv = msgs("first turn")
    r1 = client.chat.completions.create(model=model_id, messages=conv, max_tokens=6, extra_headers=h)
    # a new session may find a shared prefix (the template's system prompt) in earlier requests' contexts
    assert r1.usage.prompt_tokens_details.cached_tokens < r1.usage.prompt_tokens - 1
    conv += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "more"},
    ]
    r2 = client.chat.completions.create(model=model_id, messages=conv, max_tokens=6, extra_headers=h)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < r2.usage.prompt_tokens
    assert cached >= r1.usage.prompt_tokens - 1  # the whole first prompt is reused
    # the same conversation in a fresh session reuses nothing
    sid2 = client.post("/sessions", cast_to=object, body={})["id"]
    r3 = client.chat.completions.create(
        model=model_id, messages=conv, max_tokens=6, extra_headers={"X-Session-Id": sid2}
    )
    assert r3.usage.prompt_tokens_details.cached_tokens < r1.usage.prompt_tokens - 1  # not the conversation
    # each reply equals the same requests through the Python API (turn 2 in the first session runs on the
    # ids it generated, which the fresh session's re-tokenized text may split differently: docs/reuse.md)
    api = tiny_model.session()
    assert api.generate(conv[:1], max_new_tokens=6).text == r1.choices[0].message.content
    assert api.generate(conv, max_new_tokens=6).text == r2.choices[0].message.content
    assert tiny_model.session().generate(conv, max_new_tokens=6).text == r3.choices[0].message.content


def test_stateless_reuse_never_crosses_keys(server, model_id):
    body = {"model": model_id, "messages": msgs("a private conversation about keys"), "max_tokens": 3}
    post(server, "/v1/chat/completions", body, key=KEY_A).raise_for_status()
    again_a = post(server, "/v1/chat/completions", body, key=KEY_A).json()
    first_b = post(server, "/v1/chat/completions", body, key=KEY_B).json()
    assert again_a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert first_b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_session_scoped_to_key_and_delete(server, model_id):
    auth_a = {"Authorization": f"Bearer {KEY_A}"}
    sid = httpx.post(server.url + "/v1/sessions", headers=auth_a).json()["id"]
    body = {"model": model_id, "messages": msgs("mine"), "max_tokens": 2}
    assert post(server, "/v1/chat/completions", body, key=KEY_A, **{"X-Session-Id": sid}).status_code == 200
    other = post(server, "/v1/chat/completions", body, key=KEY_B, **{"X-Session-Id": sid})
    assert other.status_code == 404 and other.json()["error"]["param"] == "X-Session-Id"
    assert (
        httpx.delete(
            f"{server.url}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {KEY_B}"}
        ).status_code
        == 404
    )
    d = httpx.delete(f"{server.url}/v1/sessions/{sid}", headers=auth_a)
    assert d.status_code == 200 and d.json()["deleted"] is True
    gone = post(server, "/v1/chat/completions", body, key=KEY_A, **{"X-Session-Id": sid})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"
    assert httpx.delete(f"{server.url}/v1/sessions/{sid}", headers=auth_a).status_code == 404


def test_logprobs_match_model_distribution(client, model_id, tiny_model):
    import numpy as np

    r = client.chat.completions.create(
        model=model_id,
        messages=msgs("logprobs please"),
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    ref = tiny_model.session().generate(
        msgs("logprobs please"), max_new_tokens=5, temperature=0, output_logits=True
    )
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.tokens)  # no EOS in a length finish
    for step, entry in zip(ref.logits, content, strict=True):
        x = step.astype(np.float64)
        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        assert entry.logprob == pytest.approx(lp.max(), abs=1e-4)  # greedy: the chosen token is the argmax
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(sorted(lp)[::-1][:3], abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token


def test_streamed_logprobs_arrive_with_their_text(client, model_id):
    """Each streamed chunk that carries text carries the logprobs of the tokens behind it (they used to
    arrive one chunk late), and the stream's entries equal the non-streamed response's."""
    kw = {
        "model": model_id,
        "messages": msgs("stream logprobs"),
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed, text = [], ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        streamed.extend(c.logprobs.content if c.logprobs is not None and c.logprobs.content else [])
        text += c.delta.content or ""
        covered = bytes(b for e in streamed for b in e.bytes or []).decode("utf-8", errors="replace")
        assert len(covered) >= len(text), f"{text!r} streamed ahead of its logprobs {streamed}"
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [
        (e.token, round(e.logprob, 5)) for e in whole
    ]


# --- error statuses (raw HTTP) ------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "no-such-model", "messages": msgs("x")}, "model"),
        ({"messages": msgs("x")}, "model"),
        ({"model": "$M"}, "messages"),
        ({"model": "$M", "messages": []}, "messages"),
        ({"model": "$M", "messages": msgs("x"), "temperature": -1}, "temperature"),
        ({"model": "$M", "messages": msgs("x"), "temperature": "hot"}, "temperature"),
        ({"model": "$M", "messages": msgs("x"), "top_p": 1.5}, "top_p"),
        ({"model": "$M", "messages": msgs("x"), "top_k": -3}, "top_k"),
        ({"model": "$M", "messages": msgs("x"), "min_p": 2}, "min_p"),
        ({"model": "$M", "messages": msgs("x"), "presence_penalty": 3}, "presence_penalty"),
        ({"model": "$M", "messages": msgs("x"), "frequency_penalty": -9}, "frequency_penalty"),
        ({"model": "$M", "messages": msgs("x"), "repetition_penalty": 0}, "repetition_penalty"),
        ({"model": "$M", "messages": msgs("x"), "max_tokens": 0}, "max_tokens"),
        ({"model": "$M", "messages": msgs("x"), "max_completion_tokens": 10**6}, "max_completion_tokens"),
        ({"model": "$M", "messages": msgs("x"), "n": 2}, "n"),
        ({"model": "$M", "messages": msgs("x"), "seed": 1.5}, "seed"),
        ({"model": "$M", "messages": msgs("x"), "top_logprobs": 3}, "top_logprobs"),
        ({"model": "$M", "messages": msgs("x"), "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"model": "$M", "messages": msgs("x"), "logit_bias": {"999999": 5}}, "logit_bias"),
        ({"model": "$M", "messages": msgs("x"), "response_format": {"type": "xml"}}, "response_format.type"),
        (
            {
                "model": "$M",
                "messages": msgs("x"),
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "t", "schema": {"type": "objectx"}},
                },
            },
            "response_format",
        ),
        (
            {"model": "$M", "messages": msgs("x"), "response_format": {"type": "regex", "regex": "("}},
            "response_format",
        ),
        (
            {"model": "$M", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
        ),
        ({"model": "$M", "messages": msgs("x " * 2000)}, "messages"),
    ],
)
def test_bad_chat_requests_are_400_naming_the_field(server, model_id, body, param):
    body = json.loads(json.dumps(body).replace('"$M"', json.dumps(model_id)))
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "$M", "prompt": ""}, "prompt"),
        ({"model": "$M", "prompt": [10**7]}, "prompt"),
        ({"model": "$M", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "$M", "prompt": "x", "logprobs": 9}, "logprobs"),
        ({"model": "$M", "prompt": "x", "echo": True}, "echo"),
    ],
)
def test_bad_completion_requests_are_400(server, model_id, body, param):
    body = json.loads(json.dumps(body).replace('"$M"', json.dumps(model_id)))
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_invalid_json_and_non_object_are_400(server):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        r = post(server, "/v1/chat/completions", raw)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", raw


def test_oversized_body_is_413(server, model_id):
    body = {"model": model_id, "messages": msgs("x" * (MAX_BODY + 10))}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit still holds while streaming the body
        yield b'{"model": "x", "messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"y" * 1024
        yield b'"}]}'

    r = httpx.post(
        server.url + "/v1/chat/completions", content=chunks(), headers={"Authorization": f"Bearer {KEY_A}"}
    )
    assert r.status_code == 413


def test_auth_is_401(server, model_id):
    body = {"model": model_id, "messages": msgs("x"), "max_tokens": 1}
    for key in (None, "wrong-key", KEY_A + "x"):
        r = post(server, "/v1/chat/completions", body, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(server.url + path).status_code == 401
    assert httpx.post(server.url + "/v1/sessions").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(
        server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Basic {KEY_A}"}
    )
    assert r.status_code == 401


def test_unknown_route_is_openai_shaped_404(server):
    r = httpx.get(server.url + "/v1/nope", headers={"Authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 404 and "error" in r.json()


def test_full_queue_is_429_and_queued_disconnect_cancels(server, model_id, tiny_engine):
    engine = tiny_engine[0]
    state = server.app.state.server
    release = threading.Event()
    body = {"model": model_id, "messages": msgs("x"), "max_tokens": 1}
    capacity = state.capacity
    assert capacity == tiny_engine[1].max_running + 2  # what the engine runs at once + max_queue
    with _engine_held(engine, release):
        with ThreadPoolExecutor(capacity) as pool:
            jobs = [pool.submit(post, server, "/v1/chat/completions", body) for _ in range(capacity)]
            deadline = time.monotonic() + 30
            while state.depth < capacity and time.monotonic() < deadline:
                time.sleep(0.01)
            assert state.depth == capacity
            try:
                r = post(server, "/v1/chat/completions", body)
                assert r.status_code == 429 and r.headers["Retry-After"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_error"
                stream = post(server, "/v1/chat/completions", {**body, "stream": True})
                assert stream.status_code == 429
                metrics = httpx.get(
                    server.url + "/metrics", headers={"Authorization": f"Bearer {KEY_A}"}
                ).text
                assert f"onnxgen_queue_depth {capacity}" in metrics
            finally:
                release.set()
            assert [j.result(60).status_code for j in jobs] == [200] * capacity
    # a queued request whose client goes away is cancelled, not run
    release.clear()
    before = state.metrics.cancelled
    with _engine_held(engine, release):
        with pytest.raises(httpx.ReadTimeout):
            post_timeout = httpx.Timeout(10, read=0.5)
            httpx.post(
                server.url + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {KEY_A}"},
                timeout=post_timeout,
            )
        deadline = time.monotonic() + 10
        while state.metrics.cancelled == before and time.monotonic() < deadline:
            time.sleep(0.05)
        release.set()
    assert state.metrics.cancelled == before + 1
    assert _drain(state)


class _engine_held:
    """While inside, the engine's loop blocks before each step until `release` is set (a busy engine)."""

    def __init__(self, engine, release: threading.Event) -> None:
        self.engine, self.release = engine, release

    def __enter__(self) -> None:
        step, release = self.engine.step, self.release

        def held() -> bool:
            release.wait(30)
            return step()

        self.engine.step = held

    def __exit__(self, *exc) -> None:
        self.release.set()
        del self.engine.step


def _drain(state) -> bool:
    deadline = time.monotonic() + 10
    while state.depth and time.monotonic() < deadline:
        time.sleep(0.05)
    return state.depth == 0


def test_metrics_exposition(server, model_id):
    body = {"model": model_id, "messages": msgs("count me"), "max_tokens": 3}
    post(server, "/v1/chat/completions", body).raise_for_status()
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['onnxgen_requests_total{route="/v1/chat/completions",status="200"}'] >= 1
    assert samples["onnxgen_completion_tokens_total"] >= 3
    assert samples['onnxgen_ttft_seconds_bucket{le="+Inf"}'] == samples["onnxgen_ttft_seconds_count"] >= 1
    for name in ("onnxgen_prompt_tokens_total", "onnxgen_reused_tokens_total", "onnxgen_queue_depth"):
        assert name in samples
    for line in text.splitlines():  # every sample has HELP and TYPE
        if line.startswith("# TYPE"):
            assert line.split()[3] in ("counter", "gauge", "histogram")


# --- load ----------------------------------------------------------------------------------

CLIENTS, TURNS, MAX_TOKENS = 32, 20, 4


def test_loopback_load_equals_serial(tiny_model):
    """32 concurrent clients × 20 requests, each a growing conversation in its own session, against
    a server with the default queue bound (64 ≥ 32 clients, so nothing is refused): every request
    succeeds and each client's replies equal the same conversation run serially via the Python API."""
    app = create_app(tiny_model, ServerConfig(api_keys=(KEY_A,), metrics_keys=(KEY_A,)))
    auth = {"Authorization": f"Bearer {KEY_A}"}
    statuses: list[int] = []
    with RunningServer(app) as srv:
        model_id = httpx.get(srv.url + "/v1/models", headers=auth).json()["data"][0]["id"]

        def run_client(c: int) -> list[str]:
            with httpx.Client(base_url=srv.url, headers=auth, timeout=120) as http:
                sid = http.post("/v1/sessions").json()["id"]
                conv: list[dict[str, str]] = []
                out = []
                for t in range(TURNS):
                    conv.append({"role": "user", "content": f"c{c} t{t}"})
                    body = {"model": model_id, "messages": conv, "max_tokens": MAX_TOKENS, "temperature": 0}
                    r = http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid})
                    statuses.append(r.status_code)
                    if r.status_code != 200:
                        return out
                    text = r.json()["choices"][0]["message"]["content"]
                    out.append(text)
                    conv.append({"role": "assistant", "content": text})
                http.delete(f"/v1/sessions/{sid}")
                return out

        t0 = time.perf_counter()
        with ThreadPoolExecutor(CLIENTS) as ex:
            results = list(ex.map(run_client, range(CLIENTS)))
        elapsed = time.perf_counter() - t0
        metrics = httpx.get(srv.url + "/metrics", headers=auth).text
    assert statuses.count(200) == CLIENTS * TURNS, sorted(set(statuses))
    assert "onnxgen_queue_depth 0" in metrics
    assert elapsed < 120
    for c in range(CLIENTS):
        session = tiny_model.session()
        conv = []
        for t in range(TURNS):
            conv.append({"role": "user", "content": f"c{c} t{t}"})
            text = session.generate(conv, max_new_tokens=MAX_TOKENS, temperature=0).text
            assert results[c][t] == text, (c, t)
            conv.append({"role": "assistant", "content": text})
