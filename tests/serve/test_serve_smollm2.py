"""The server on the real default model (SmolLM2-135M-Instruct): structured output acceptance
(20 json_schema requests, every reply valid, none cut by max_tokens) and cancellation of a stream
whose client disconnects mid-generation (the session stays consistent)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from onnxgen.serve.app import RunningServer, ServerConfig, create_app  # noqa: E402
from tests._schema import validate  # noqa: E402


@pytest.fixture(scope="module")
def server(smollm2_ort):
    with RunningServer(create_app(smollm2_ort, ServerConfig())) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def obj(**props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


S = {"type": "string", "minLength": 1, "maxLength": 24}
I = {"type": "integer", "minimum": 0, "maximum": 3000}  # noqa: E741
SCHEMAS = [
    ("person", obj(name=S, age=I), "Invent a person. Reply with their name and age."),
    (
        "city",
        obj(city=S, country=S, population=I),
        "Describe a European city: name, country, population in thousands.",
    ),
    (
        "book",
        obj(title=S, author=S, year=I, fiction={"type": "boolean"}),
        "Name a famous book with its author and year.",
    ),
    (
        "color",
        obj(color={"type": "string", "enum": ["red", "green", "blue"]}, reason=S),
        "Pick your favourite color.",
    ),
    (
        "tags",
        obj(topic=S, tags={"type": "array", "items": S, "minItems": 1, "maxItems": 3}),
        "Give a topic and up to three tags about cooking.",
    ),
]
PROMPTS = ["", " Be brief.", " Answer in JSON.", " Keep every value short."]


def test_twenty_json_schema_requests_all_validate(client):
    model_id = client.models.list().data[0].id
    failures = []
    for i in range(20):
        name, schema, prompt = SCHEMAS[i % len(SCHEMAS)]
        r = client.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": prompt + PROMPTS[i // len(SCHEMAS)]}],
            max_tokens=512,
            temperature=0.7 if i % 2 else 0,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": name, "schema": schema, "strict": True},
            },
        )
        choice = r.choices[0]
        try:
            assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
            validate(json.loads(choice.message.content), schema)
        except (AssertionError, ValueError) as exc:
            failures.append((i, name, str(exc), choice.message.content))
    assert not failures, failures


def test_json_object_and_regex_extensions(client):
    model_id = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model_id,
        messages=[
            {"role": "user", "content": 'Reply with a JSON object with the key "answer": what is 2+2?'}
        ],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "What year is it?"}],
        max_tokens=20,
        extra_body={"response_format": {"type": "regex", "regex": "[12][0-9]{3}"}},
    )
    text = r.choices[0].message.content
    assert len(text) == 4 and text.isdigit() and r.choices[0].finish_reason == "stop"


def test_disconnect_mid_stream_cancels_and_session_stays_consistent(server, client, smollm2_ort):
    state = server.app.state.server
    model_id = client.models.list().data[0].id
    sid = httpx.post(server.url + "/v1/sessions").json()["id"]
    conv = [{"role": "user", "content": "Write a very long story about a dragon."}]
    before = state.metrics.cancelled
    body = {"model": model_id, "messages": conv, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": sid}
    ) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                seen += 1
                if seen >= 3:
                    break  # leave the context: the connection is closed mid-generation
    deadline = time.monotonic() + 20
    while (state.metrics.cancelled == before or state.depth) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.metrics.cancelled == before + 1
    # The cancelled request left nothing behind: the next turn reuses nothing and equals a fresh run.
    follow = [{"role": "user", "content": "Say hi."}]
    r = client.chat.completions.create(
        model=model_id, messages=follow, max_tokens=8, temperature=0, extra_headers={"X-Session-Id": sid}
    )
    ref = smollm2_ort.session().generate(follow, max_new_tokens=8, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.choices[0].message.content == ref.text


def test_reuse_survives_retokenization_through_the_server(client, server):
    """ "Name three rivers in France." has a reply whose text re-tokenizes differently; turn 2 through the
    server still reuses every token the session retained (turn 1's prompt and all but the last reply token)."""
    model_id = client.models.list().data[0].id
    sid = httpx.post(server.url + "/v1/sessions").json()["id"]
    h = {"X-Session-Id": sid}
    history = [{"role": "user", "content": "Name three rivers in France."}]
    r1 = client.chat.completions.create(
        model=model_id, messages=history, max_tokens=128, temperature=0, extra_headers=h
    )
    history += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Tell me more."},
    ]
    r2 = client.chat.completions.create(
        model=model_id, messages=history, max_tokens=4, temperature=0, extra_headers=h
    )
    held = r1.usage.prompt_tokens + r1.usage.completion_tokens - 1
    assert r2.usage.prompt_tokens_details.cached_tokens == held
