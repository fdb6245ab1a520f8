"""The three API families through their official SDKs (`openai` for chat completions and responses, `anthropic`
for messages) on a tiny synthetic package: chat, streams, structured output, a tool loop with a forced tool
choice (call → tool result → answer), tool calls streamed in fragments, multi-turn reuse reported in usage
(stateless, by session, by `previous_response_id`, which prefills only the new tokens), the families' errors,
and API keys: no cached token crosses keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
pydantic = pytest.importorskip("pydantic")

from onnxgen.serve.app import RunningServer, ServerConfig, create_app  # noqa: E402
from tests.harness import loaded  # noqa: E402

KEY_A, KEY_B = "clients-key-a-0123", "clients-key-b-4567"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
SYSTEM = "You are a weather assistant. " * 12  # a shared prefix worth reusing


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path):
    return loaded(tiny_dir, backend="ort", threads=1)


@pytest.fixture(scope="module")
def srv(tiny):
    with RunningServer(create_app(tiny[1], ServerConfig(api_keys=(KEY_A, KEY_B)))) as s:
        yield s


@pytest.fixture(scope="module")
def oa(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY_A, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY_A, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def mid(oa) -> str:
    return oa.models.list().data[0].id


# --- OpenAI chat completions ------------------------------------------------------------------------


def test_openai_structured_output_parses(oa, mid):
    r = oa.chat.completions.parse(
        model=mid, messages=[{"role": "user", "content": "a person"}], response_format=Person, max_tokens=60
    )
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and isinstance(ch.message.parsed, Person)


def test_openai_tool_loop_and_streamed_tool_calls(oa, mid):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Oslo?"}]
    kw = {"model": mid, "tools": tools, "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0}
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r1 = oa.chat.completions.create(messages=msgs, tool_choice=forced, **kw)
    call = r1.choices[0].message.tool_calls[0]
    assert r1.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    deltas = [
        tc
        for c in oa.chat.completions.create(messages=msgs, tool_choice=forced, stream=True, **kw)
        if c.choices
        for tc in c.choices[0].delta.tool_calls or []
    ]
    assert len(deltas) > 2 and deltas[0].id and deltas[0].function.name == "get_weather"  # names first
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments  # then fragments
    msgs += [
        r1.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    r2 = oa.chat.completions.create(messages=msgs, tool_choice="none", **kw)
    assert r2.choices[0].finish_reason in ("stop", "length") and r2.choices[0].message.tool_calls is None
    # the stateless follow-up reused the first turn's context (no session named)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 1


# --- Anthropic messages ---------------------------------------------------------------------------------


def test_anthropic_messages_plain_stream_and_count(an, mid):
    kw = {"model": mid, "max_tokens": 12, "system": SYSTEM}
    msgs = [{"role": "user", "content": "hello"}]
    r = an.messages.create(messages=msgs, **kw)
    assert r.type == "message" and r.role == "assistant" and r.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in r.content if b.type == "text")
    with an.messages.stream(messages=msgs, **kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text and final.stop_reason == r.stop_reason
    assert final.usage.cache_read_input_tokens > 0  # the second identical request reused the first
    u = final.usage
    assert (
        u.input_tokens + u.cache_read_input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens
    )
    count = an.messages.count_tokens(model=mid, system=SYSTEM, messages=msgs)
    assert count.input_tokens == u.input_tokens + u.cache_read_input_tokens


def test_anthropic_stop_sequences_and_errors(an, mid):
    r = an.messages.create(model=mid, max_tokens=40, messages=[{"role": "user", "content": "go"}])
    text = r.content[0].text
    assert len(text) > 4
    stop = text[2:4]
    s = an.messages.create(
        model=mid,
        max_tokens=40,
        messages=[{"role": "user", "content": "go"}],
        stop_sequences=["zzzzzz", stop],
    )
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == stop
    assert s.content[0].text == text[: text.find(stop)]
    with pytest.raises(anthropic.BadRequestError) as err:
        an.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=an.base_url, api_key="wrong", max_retries=0).messages.create(
            model=mid, max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )


def test_anthropic_tool_loop_streams_input_json(an, mid):
    tools = [{"name": "get_weather", "description": "the weather", "input_schema": CITY}]
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    kw = {"model": mid, "max_tokens": 200, "tools": tools, "system": SYSTEM}
    with an.messages.stream(messages=msgs, tool_choice=choice, **kw) as s:
        parts = [e.partial_json for e in s if e.type == "input_json"]
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and len(parts) > 2
    use = final.content[-1]
    assert use.type == "tool_use" and use.name == "get_weather" and json.loads("".join(parts)) == use.input
    msgs += [
        {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    r = an.messages.create(messages=msgs, tool_choice={"type": "none"}, **kw)
    assert r.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in r.content)
    assert r.usage.cache_read_input_tokens > 0  # the conversation's prefix came from the cache
    with pytest.raises(anthropic.BadRequestError):  # a tool_result answering no tool_use
        bad = [
            msgs[0],
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "?"}]},
        ]
        an.messages.create(messages=bad, **kw)


def test_anthropic_session_reuse_and_keys_never_share(srv, an, mid):
    sid = httpx.post(srv.url + "/v1/sessions", headers={"x-api-key": KEY_A}).json()["id"]
    h = {"X-Session-Id": sid}
    msgs = [{"role": "user", "content": "a private turn about tulips"}]
    r1 = an.messages.create(model=mid, max_tokens=6, messages=msgs, extra_headers=h)
    msgs += [
        {"role": "assistant", "content": r1.content[0].text if r1.content else "ok"},
        {"role": "user", "content": "more"},
    ]
    r2 = an.messages.create(model=mid, max_tokens=6, messages=msgs, extra_headers=h)
    assert r2.usage.cache_read_input_tokens >= r1.usage.input_tokens + r1.usage.cache_read_input_tokens - 1
    other = anthropic.Anthropic(base_url=an.base_url, api_key=KEY_B, max_retries=0)
    b = other.messages.create(model=mid, max_tokens=2, messages=msgs)
    assert b.usage.cache_read_input_tokens == 0  # key B reuses nothing of key A's
    with pytest.raises(anthropic.NotFoundError):  # nor can it name A's session
        other.messages.create(model=mid, max_tokens=2, messages=msgs, extra_headers=h)


# --- OpenAI responses -------------------------------------------------------------------------------------


def test_responses_follow_up_prefills_only_its_new_tokens(oa, mid, tiny):
    model = tiny[1]
    r1 = oa.responses.create(
        model=mid, input="Name a color.", instructions=SYSTEM, max_output_tokens=8, temperature=0
    )
    assert r1.status in ("completed", "incomplete") and r1.output[0].type == "message"
    r2 = oa.responses.create(
        model=mid, input="And another?", instructions=SYSTEM, previous_response_id=r1.id, max_output_tokens=8
    )
    kept = (
        r1.usage.input_tokens + r1.usage.output_tokens - 1
    )  # the first response's KV: all but its last sample
    assert r2.usage.input_tokens_details.cached_tokens == kept
    # what it prefilled is exactly what follows the first response's context: the rest of the assistant turn
    # (the last sampled token, never fed) and the new user turn
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a color."}]
    render = model.chat_template.render
    text = render(
        [
            *first,
            {"role": "assistant", "content": r1.output_text},
            {"role": "user", "content": "And another?"},
        ],
        add_generation_prompt=True,
    )
    head = render(first, add_generation_prompt=True) + r1.output_text
    assert text.startswith(head)
    tail = model.tokenizer.encode(text[len(head) :], add_special_tokens=False)
    unfed = 0 if r1.status == "completed" else 1  # a length finish's last token is part of its text
    assert r2.usage.input_tokens - r2.usage.input_tokens_details.cached_tokens == len(tail) + unfed
    assert oa.responses.retrieve(r1.id).id == r1.id
    oa.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(model=mid, input="x", previous_response_id=r1.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):  # another key never sees it
        other = openai.OpenAI(base_url=oa.base_url, api_key=KEY_B, max_retries=0)
        other.responses.retrieve(r2.id)


def test_responses_function_tools_stream_and_continue(oa, mid):
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}]
    kw = {
        "model": mid,
        "tools": tools,
        "parallel_tool_calls": False,
        "max_output_tokens": 200,
        "temperature": 0,
    }
    events = list(
        oa.responses.create(
            input="Weather in Oslo?",
            tool_choice={"type": "function", "name": "get_weather"},
            stream=True,
            **kw,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = events[-1].response
    call = done.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and len(deltas) > 2
    assert "".join(deltas) == call.arguments and set(json.loads(call.arguments)) == {"city"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    r = oa.responses.create(
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        previous_response_id=done.id,
        tool_choice="none",
        **kw,
    )
    assert r.output and all(o.type == "message" for o in r.output)
    assert (
        r.usage.input_tokens_details.cached_tokens == done.usage.input_tokens + done.usage.output_tokens - 1
    )


def test_responses_structured_output(oa, mid):
    r = oa.responses.parse(model=mid, input="a person", text_format=Person, max_output_tokens=60)
    assert r.status == "completed" and isinstance(r.output_parsed, Person)
