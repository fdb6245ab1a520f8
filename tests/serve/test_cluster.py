"""onnxgen behind Ray Serve: the bridge and session adoption in process, then a local Ray with two CPU replicas
of a tiny package driven through the `openai` client (sessions and prefixes stay on one replica and reuse
its KV, two sessions spread over both, outputs equal one server's; a 16 x 6 trace keeps its reuse under affinity,
not round-robin; a replica killed mid-trace loses nothing)."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from onnxgen.serve.app import RunningServer, ServerConfig, create_app  # noqa: E402
from onnxgen.serve.cluster.bridge import REPLICA_HEADER, HttpCall, read_call, run  # noqa: E402
from onnxgen.serve.cluster.keys import route_key, session_digest  # noqa: E402

SID = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def tiny_model(tiny_dir: Path):
    import onnxgen

    m = onnxgen.load(str(tiny_dir), backend="ort", threads=1)
    yield m
    m.close()


def _call(path: str, body: dict | None = None, method: str = "POST", **headers: str) -> HttpCall:
    raw = json.dumps(body).encode() if body is not None else b""
    hs = {"content-type": "application/json", **{k.lower().replace("_", "-"): v for k, v in headers.items()}}
    return HttpCall(
        method,
        path,
        b"",
        tuple((k.encode(), v.encode()) for k, v in hs.items()),
        raw,
        ("127.0.0.1", 1),
        route_key(method, path, hs, raw),
    )


def _answer(app, call: HttpCall) -> tuple[int, dict[bytes, bytes], bytes]:
    async def go():
        msgs = [m async for m in run(app, call, "r7")]
        start = msgs[0]
        assert start["type"] == "http.response.start"
        return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in msgs[1:])

    return asyncio.run(go())


def test_a_call_runs_through_the_servers_own_routes(tiny_model):
    app = create_app(tiny_model, ServerConfig())
    chat = {
        "model": app.state.server.model_id,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
    }
    status, headers, body = _answer(app, _call("/v1/chat/completions", chat))
    assert status == 200 and headers[REPLICA_HEADER] == b"r7"
    assert json.loads(body)["usage"]["completion_tokens"] == 3
    status, _, body = _answer(app, _call("/v1/chat/completions", {**chat, "stream": True}))
    events = [ln for ln in body.decode().split("\n\n") if ln.startswith("data: ")]
    assert status == 200 and events[-1] == "data: [DONE]" and len(events) >= 4
    status, _, body = _answer(app, _call("/v1/nowhere", {}))
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    app.state.server.close()


def test_the_ingress_reads_a_whole_request():
    chunks = [b'{"messages": [{"role": "user", ', b'"content": "x"}]}']

    async def go():
        it = iter(chunks)

        async def receive():
            part = next(it)
            return {"type": "http.request", "body": part, "more_body": part is not chunks[-1]}

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "query_string": b"a=1",
            "headers": [(b"X-Session-Id", SID.encode())],
            "client": ("10.0.0.1", 5),
        }
        return await read_call(scope, receive, isolate_keyless=False)

    call = asyncio.run(go())
    assert call.body == b"".join(chunks) and call.query == b"a=1" and call.client == ("10.0.0.1", 5)
    assert call.headers == ((b"x-session-id", SID.encode()),)
    assert call.route.session == session_digest(SID) and call.session_id is None


def test_the_ingress_names_the_session_a_post_makes(tiny_model):
    async def make():
        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/a/v1/sessions", "root_path": "/a", "headers": []}
        return await read_call(scope, receive, isolate_keyless=False)

    calls = [asyncio.run(make()) for _ in range(2)]
    assert calls[0].session_id != calls[1].session_id
    assert calls[0].route.session == session_digest(calls[0].session_id)
    app = create_app(tiny_model, ServerConfig())
    status, _, body = _answer(app, calls[0])
    assert status == 200 and json.loads(body)["id"] == calls[0].session_id == app.state.server.store.ids()[0]
    # a client cannot choose its id: only the ASGI scope (set in process) carries one
    status, _, body = _answer(app, _call("/v1/sessions", {"id": SID}, **{"onnxgen.session_id": SID}))
    assert status == 200 and json.loads(body)["id"] != SID
    app.state.server.close()


def test_a_replica_adopts_a_session_begun_elsewhere(tiny_model):
    keys = ("key-a-0123456789", "key-b-9876543210")
    plain = create_app(tiny_model, ServerConfig(api_keys=keys))
    adopting = create_app(tiny_model, ServerConfig(api_keys=keys, adopt_sessions=True))
    chat = {
        "model": plain.state.server.model_id,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    a = {"authorization": f"Bearer {keys[0]}", "x_session_id": SID}
    assert _answer(plain, _call("/v1/chat/completions", chat, **a))[0] == 404
    assert _answer(adopting, _call("/v1/chat/completions", chat, **a))[0] == 200
    assert adopting.state.server.store.ids() == [SID]
    # the id stays its adopter's: another key cannot use it, and ids this store never makes are not adopted
    b = {"authorization": f"Bearer {keys[1]}", "x_session_id": SID}
    assert _answer(adopting, _call("/v1/chat/completions", chat, **b))[0] == 404
    odd = {**a, "x_session_id": "not-a-session"}
    assert _answer(adopting, _call("/v1/chat/completions", chat, **odd))[0] == 404
    for app in (plain, adopting):
        app.state.server.close()


# --- a local Ray with two replicas ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path):
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from onnxgen.serve.cluster.deployment import ClusterConfig, application, deploy

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # paged: the prefixes of stateless conversations at once are shared, none taken from another
        load = {"backend": "native", "paged": True, "threads": 1, "max_sessions": 32}
        # imbalance 8: a trace's 16 conversations, 8 a replica, keep their replica (the default, 4, yields to
        # momentary differences in load at times: 94-99 % of one server's cached share in runs here)
        config = ClusterConfig(replicas=2, load=load, stats_period_s=0.5, imbalance=8)
        rr = ClusterConfig(**{**config.__dict__, "mode": "round_robin"})
        lines: list[str] = []
        deploy(  # both at once; the baseline (round-robin) at /rr
            [
                ("onnxgen", "/", application(str(tiny_dir), config)),
                ("rr", "/rr", application(str(tiny_dir), rr)),
            ],
            timeout_s=300,
            every_s=0.5,
            progress=lines.append,
        )
        apps = serve.status().applications
        assert apps["onnxgen"].status == "RUNNING" and apps["rr"].status == "RUNNING"
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _conversation(client, model: str, turns: list[str], sid: str | None):
    """Run `turns` as one conversation; (reply, replica, prompt tokens, cached tokens) per turn."""
    messages, out = [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            max_tokens=4,
            temperature=0,
            extra_headers={"X-Session-Id": sid} if sid else None,
        )
        r = raw.parse()
        reply = r.choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        out.append(
            (
                reply,
                raw.headers.get(REPLICA_HEADER.decode()),
                r.usage.prompt_tokens,
                r.usage.prompt_tokens_details.cached_tokens,
            )
        )
    return out


TURNS = [
    ["Tell me about rivers " * 20, "And lakes?", "And seas?"],
    ["Name some cities " * 20, "In Peru?", "Why?"],
]


@pytest.mark.slow
def test_sessions_keep_their_replica_and_its_kv(cluster, tiny_model):
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    sids = [httpx.post(cluster + "/v1/sessions", timeout=60).json()["id"] for _ in TURNS]
    runs = [_conversation(client, model, turns, sid) for turns, sid in zip(TURNS, sids, strict=True)]
    homes = []
    for run_ in runs:
        replicas = {replica for _, replica, _, _ in run_}
        assert len(replicas) == 1 and None not in replicas, run_
        homes.append(replicas.pop())
        for (_, _, prompt, _), (_, _, _, cached) in itertools.pairwise(run_):
            assert cached >= prompt  # the whole previous turn (and its reply) was reused
    assert homes[0] != homes[1]  # two sessions, two replicas
    # every reply equals one server's (greedy), stateless there
    with RunningServer(create_app(tiny_model, ServerConfig())) as one:
        single = openai.OpenAI(base_url=one.url + "/v1", api_key="none", max_retries=0, timeout=120)
        for turns, run_ in zip(TURNS, runs, strict=True):
            assert [t[0] for t in _conversation(single, model, turns, None)] == [t[0] for t in run_]


@pytest.mark.slow
def test_a_stateless_conversation_follows_its_prefix_and_streams(cluster):
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    run_ = _conversation(client, model, ["A long shared preamble " * 30, "Go on.", "More."], None)
    assert len({replica for _, replica, _, _ in run_}) == 1
    assert all(cached > 0 for *_, cached in run_[1:])
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "A long shared preamble " * 30}],
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == run_[0][0]


def test_the_serve_config_builder_takes_strings_as_serve_run_passes_them(tiny_dir: Path):
    pytest.importorskip("ray.serve")
    from onnxgen.serve.cluster.deployment import ClusterConfig, build

    app = build({"model": str(tiny_dir), "replicas": "3", "imbalance": "2", "isolate_keyless": "true"})
    assert type(app).__name__ == "Application"
    with pytest.raises(ValueError, match="replicas"):
        ClusterConfig(replicas=0)


SYSTEM = "You are a terse assistant for a trace."
QUESTIONS = ["Rivers?", "Lakes and seas?", "Why so?", "And cities?", "Name one.", "Thanks, more?"]
TOPIC = " Tell me more about the rivers, lakes and seas of the region, and of its towns."


def _trace(base: str, model: str, kill=None, convs: int = 16, turns: int = 6):
    """`convs` stateless conversations at once under one system prompt, `turns` turns each, each turn sent
    with the whole conversation (greedy, EOS allowed): per conversation, (reply, prompt tokens, cached
    tokens) per turn, and how many answers were 503 `replica_unavailable` (retried after `Retry-After`).
    `kill()` is called once, when half the turns have been answered. Any other failure raises."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    lock, answered, retried = threading.Lock(), [0], [0]

    def conversation(c: int):
        messages, out = [{"role": "system", "content": SYSTEM}], []
        for t in range(turns):
            question = f"{c}.{t}: {QUESTIONS[(c + t) % len(QUESTIONS)]}" + TOPIC  # most of each turn its own
            messages.append({"role": "user", "content": question})
            body = {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0}
            while True:
                r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
                if r.status_code != 503:
                    break
                assert r.json()["error"]["code"] == "replica_unavailable" and "retry-after" in r.headers
                with lock:
                    retried[0] += 1
                time.sleep(float(r.headers["retry-after"]))
            assert r.status_code == 200, r.text
            doc = r.json()
            reply = doc["choices"][0]["message"]["content"]
            out.append(
                (reply, doc["usage"]["prompt_tokens"], doc["usage"]["prompt_tokens_details"]["cached_tokens"])
            )
            messages.append({"role": "assistant", "content": reply})
            with lock:
                answered[0] += 1
                now = kill is not None and answered[0] == convs * turns // 2
            if now:
                kill()
        return out

    with ThreadPoolExecutor(convs) as ex:
        return list(ex.map(conversation, range(convs))), retried[0]


def _share(trace) -> float:
    """The share of later turns' prompt tokens that were cached."""
    later = [t for conv in trace for t in conv[1:]]
    return sum(t[2] for t in later) / sum(t[1] for t in later)


@pytest.fixture(scope="module")
def single_trace(tiny_dir: Path):
    """The trace against one server of the same package, loaded as the replicas are: the reference."""
    import onnxgen

    with onnxgen.load(str(tiny_dir), backend="native", paged=True, threads=1, max_sessions=32) as m:
        with RunningServer(create_app(m, ServerConfig())) as one:
            model = httpx.get(one.url + "/v1/models", timeout=60).json()["data"][0]["id"]
            return model, _trace(one.url, model)[0]


@pytest.mark.slow
def test_a_multi_turn_trace_keeps_its_reuse_under_affinity_not_round_robin(cluster, single_trace):
    """16 conversations x 6 turns at once: the affinity router keeps >= 95 % of the cached-token share one
    server gets, round-robin clearly less; every reply equals one server's."""
    model, single = single_trace
    affinity, _ = _trace(cluster, model)
    robin, _ = _trace(cluster + "/rr", model)
    replies = [[t[0] for t in conv] for conv in single]
    for trace in (affinity, robin):
        assert [[t[0] for t in conv] for conv in trace] == replies
    one, aff, rr = _share(single), _share(affinity), _share(robin)
    assert one > 0.5, one
    assert aff >= 0.95 * one, (aff, one)
    assert rr < 0.9 * one and rr < aff, (rr, aff, one)


@pytest.mark.slow
def test_a_replica_killed_mid_trace_loses_and_corrupts_nothing(cluster, single_trace):
    """A replica of the round-robin application is killed when half the trace's turns are answered: every
    turn still completes (retried by the ingress, or answered 503 and retried by the client) with the reply
    one server gives: nothing is lost silently or attached to the wrong context."""
    import ray

    model, single = single_trace

    def kill() -> None:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        victims = [n for n in names if "rr#onnxgen-replica#" in n]
        assert victims, names
        ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=True)

    trace, _ = _trace(cluster + "/rr", model, kill=kill)
    assert [[t[0] for t in conv] for conv in trace] == [[t[0] for t in conv] for conv in single]


@pytest.mark.slow
def test_a_session_whose_replica_dies_is_answered_elsewhere(cluster):
    """No request is lost silently: the turn after its replica was killed is retried on the other replica,
    which adopts the session and recomputes it (the same greedy replies as before), and keeps it."""
    import ray

    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    sid = httpx.post(cluster + "/v1/sessions", timeout=60).json()["id"]
    before = _conversation(client, model, TURNS[0][:2], sid)
    home = before[0][1]
    names = [
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("#" + home)
    ]
    assert len(names) == 1
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    after = _conversation(client, model, TURNS[0][:2], sid)
    assert {replica for _, replica, _, _ in after} - {home} == {replica for _, replica, _, _ in after}
    assert [t[0] for t in after] == [t[0] for t in before]
    assert after[1][3] >= after[0][2]  # adopted there: its next turn reuses the turn recomputed there


def test_replicas_that_cannot_be_placed_stop_with_what_they_wait_for(cluster: str, tiny_dir: Path) -> None:
    """Replicas asking for more CPUs than the local Ray has never start: `deploy` raises a typed error naming
    the application and its replicas' state within its timeout (not a hang), says so while it waits, deletes
    what it started, and the applications already serving keep serving."""
    from ray import serve

    from onnxgen.errors import ClusterStartError
    from onnxgen.serve.cluster.deployment import ClusterConfig, application, deploy

    big = ClusterConfig(replicas=1, num_cpus=64, load={"backend": "native", "threads": 1})
    lines: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(ClusterStartError) as err:
        deploy(
            [("huge", "/huge", application(str(tiny_dir), big))],
            timeout_s=3,
            every_s=1,
            progress=lines.append,
        )
    assert time.monotonic() - t0 < 60
    text = str(err.value)
    assert "huge" in text and "not running after 3 s" in text and "onnxgen-replica" in text
    assert lines and all(line.startswith("waiting for huge") for line in lines)
    deadline = time.monotonic() + 60
    while "huge" in serve.status().applications and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "huge" not in serve.status().applications
    models = httpx.get(f"{cluster}/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"]
