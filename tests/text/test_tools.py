"""Tool calling (issue 10, item 6): the call formats, conversation preparation, constrained generation
through the engine and the server with the official `openai` client (streamed and not), an agent loop that
reuses the cache across the tool turn, 50 `required` calls on SmolLM2 that all parse and validate, and the
CLI's `generate --tools`."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llguidance")

import onnxgen
from onnxgen.text import tools as T
from tests._schema import validate

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = [
    WEATHER,
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "minLength": 1, "maxLength": 40},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 10},
                },
                "required": ["query", "limit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "description": "Set an alarm",
            "parameters": {
                "type": "object",
                "properties": {
                    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                    "minute": {"type": "integer", "minimum": 0, "maximum": 59},
                    "label": {"type": "string", "maxLength": 20},
                },
                "required": ["hour", "minute", "label"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "send_email",
            "description": "Send an email",
            "parameters": {
                "type": "object",
                "properties": {
                    "to": {"type": "string", "maxLength": 40},
                    "subject": {"type": "string", "maxLength": 40},
                    "urgent": {"type": "boolean"},
                },
                "required": ["to", "subject", "urgent"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "create_event",
            "description": "Create a calendar event",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string", "maxLength": 30},
                    "attendees": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 3,
                        "items": {"type": "string", "maxLength": 20},
                    },
                },
                "required": ["title", "attendees"],
                "additionalProperties": False,
            },
        },
    },
]
QUESTIONS = [
    "What's the weather in Paris?",
    "Add 17 and 25.",
    "Find recent news about Mars.",
    "Wake me up at 7:30 for the gym.",
    "Email Bob that the meeting moved.",
    "Plan lunch with Ann and Joe.",
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in SCHEMAS}

# A tool-aware template in Hugging Face's semantics (Hermes/Qwen style): tools in the system turn, calls
# inside <tool_call> tags, tool results as <tool_response> in a user turn.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls | default([]) %}{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
{%- if not loop.first or message.content %}{{ '\\n' }}{% endif %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _check_call(call: Any, allowed: set[str]) -> None:
    name = call.function.name if hasattr(call, "function") else call.name
    args = call.function.arguments if hasattr(call, "function") else call.arguments
    assert name in allowed, name
    validate(json.loads(args), PARAMS[name])


# --- formats ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(T.FORMATS))
def test_formats_render_and_parse_round_trip(name):
    fmt = T.get_format(name)
    calls = [
        {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}},
        {"name": "add", "arguments": {"a": 1, "b": -2}},
    ]
    content, parsed = fmt.parse(fmt.render(calls))
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(c["name"], c["arguments"]) for c in calls]
    assert all(c.id.startswith("call_") for c in parsed) and len({c.id for c in parsed}) == 2
    assert fmt.parse("just text, no call") == ("just text, no call", [])
    assert fmt.parse(fmt.render(calls)[:-3])[1] != [parsed[0], parsed[1]]  # a truncated call is not a call


@pytest.mark.parametrize("name", sorted(T.FORMATS))
def test_format_grammars_accept_rendered_calls_and_reject_bad_arguments(name, tool_model):
    """Each format's grammar admits exactly its own rendering of valid calls; `auto` also admits text that
    cannot begin a call and rejects it where it would."""
    import llguidance

    from onnxgen.sampling.grammar import GrammarCompiler

    fmt, funcs = T.get_format(name), T.function_specs(SCHEMAS[:2])
    comp = GrammarCompiler.for_model(tool_model)
    tok = tool_model.tokenizer

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(comp.ll_tokenizer, comp.compile("lark", grammar), log_level=0)
        return (
            all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()
        )

    good = fmt.render(
        [
            {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}},
            {"name": "add", "arguments": {"a": 1, "b": 2}},
        ]
    )
    bad = fmt.render([{"name": "add", "arguments": {"a": "one", "b": 2}}])
    for required in (True, False):
        g = fmt.lark(funcs, required=required, parallel=True)
        assert accepts(g, good) and not accepts(g, bad)
        assert not accepts(fmt.lark(funcs, required=required, parallel=False), good)  # two calls
    auto = fmt.lark(funcs, required=False, parallel=True)
    assert accepts(auto, "Sure, here you go.") and not accepts(
        fmt.lark(funcs, required=True, parallel=True), "Sure."
    )
    assert not accepts(auto, fmt.marker + " not a call")


def test_hermes_keeps_text_around_calls_and_skips_broken_ones():
    fmt = T.FORMATS["hermes"]
    text = 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{oops}\n</tool_call>'
    content, calls = fmt.parse(text)
    assert [c.name for c in calls] == ["a"]
    assert content == "Let me check.\n\n<tool_call>\n{oops}\n</tool_call>"


def test_detect_format_from_the_template():
    assert T.detect_format(HERMES_TEMPLATE).name == "hermes"
    assert T.detect_format("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert T.detect_format("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert T.detect_format(None).name == "hermes"


def test_prepare_messages_for_a_template_without_tool_support():
    fmt = T.FORMATS["hermes"]
    msgs = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    out = T.prepare_messages(msgs, fmt, "{{ messages }}", T.function_specs(SCHEMAS[:2]))
    assert (
        out[0]["role"] == "system"
        and "get_weather" in out[0]["content"]
        and "<tool_call>" in out[0]["content"]
    )
    assert out[2] == {
        "role": "assistant",
        "content": fmt.render([{"name": "add", "arguments": {"a": 1, "b": 2}}]),
    }
    assert msgs[1]["content"] is None  # the caller's messages are untouched
    kept = T.prepare_messages(msgs, fmt, HERMES_TEMPLATE, T.function_specs(SCHEMAS[:2]))
    assert kept[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}  # templates tojson a dict
    with pytest.raises(onnxgen.errors.InvalidRequest):
        T.function_specs([{"type": "function", "function": {"name": "bad name!"}}])


# --- the engine and the server on a tiny package with a tool-aware template ---------------------------------


@pytest.fixture(scope="module")
def tool_pkg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random package (its byte-level vocabulary spends a token per byte or two, so the tool
    definitions need a 4k context) with the tool-aware template."""
    from onnxgen.convert.synthetic import SyntheticConfig, write_package

    dest = write_package(
        tmp_path_factory.mktemp("tools") / "pkg", SyntheticConfig(num_layers=2, context_length=4096)
    )
    (dest / "chat_template.jinja").write_text(HERMES_TEMPLATE, encoding="utf-8")
    return dest


@pytest.fixture(scope="module")
def tool_model(tool_pkg: Path):
    return onnxgen.load(str(tool_pkg), backend="ort", threads=1)


def test_engine_named_and_required_calls_validate(tool_model):
    msgs = [{"role": "user", "content": "weather?"}]
    named = {"type": "function", "function": {"name": "add"}}
    r = tool_model.generate(
        msgs, tools=SCHEMAS, tool_choice=named, max_new_tokens=120, temperature=0.8, seed=3, reuse=False
    )
    assert r.finish_reason == "tool_calls" and r.tool_calls and {c.name for c in r.tool_calls} == {"add"}
    for c in r.tool_calls:
        _check_call(c, {"add"})
    for seed in range(4):
        r = tool_model.generate(
            msgs,
            tools=SCHEMAS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_new_tokens=200,
            temperature=1.0,
            seed=seed,
            reuse=False,
        )
        assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1 and r.content is None
        _check_call(r.tool_calls[0], set(PARAMS))


def test_engine_tool_choice_errors_name_the_field(tool_model):
    msgs = [{"role": "user", "content": "x"}]
    for kw in (
        {"tool_choice": "required"},
        {"tools": SCHEMAS, "tool_choice": "sometimes"},
        {"tools": SCHEMAS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    ):
        with pytest.raises(onnxgen.errors.InvalidRequest) as e:
            tool_model.generate(msgs, max_new_tokens=2, **kw)
        assert e.value.field == "tool_choice"


@pytest.fixture(scope="module")
def tool_server(tool_model):
    pytest.importorskip("fastapi")
    from onnxgen.serve.app import RunningServer, ServerConfig, create_app

    with RunningServer(create_app(tool_model, ServerConfig())) as srv:
        yield srv


@pytest.fixture(scope="module")
def tool_client(tool_server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_server_tool_calls_plain_and_streamed(tool_client):
    mid = tool_client.models.list().data[0].id
    kw = {
        "model": mid,
        "messages": [{"role": "user", "content": "weather in Oslo?"}],
        "tools": SCHEMAS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "max_tokens": 120,
        "temperature": 0,
    }
    plain = tool_client.chat.completions.create(**kw)
    ch = plain.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and len(ch.message.tool_calls) == 1
    _check_call(ch.message.tool_calls[0], {"get_weather"})
    chunks = list(tool_client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    # the id and name first, then the arguments in fragments as they are generated
    assert len(streamed) > 2 and {tc.index for tc in streamed} == {0} and streamed[0].id.startswith("call_")
    assert streamed[0].function.name == "get_weather" and all(tc.id is None for tc in streamed[1:])
    arguments = "".join(tc.function.arguments or "" for tc in streamed)
    assert json.loads(arguments) == json.loads(ch.message.tool_calls[0].function.arguments)
    assert not any(d.content for d in deltas)  # nothing of the call leaked as text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_server_auto_gives_text_or_a_valid_call(tool_client):
    mid = tool_client.models.list().data[0].id
    kinds = set()
    for seed in range(6):
        r = tool_client.chat.completions.create(
            model=mid,
            messages=[{"role": "user", "content": f"hello {seed}"}],
            tools=SCHEMAS,
            tool_choice="auto",
            max_tokens=60,
            temperature=1.0,
            seed=seed,
        )
        m = r.choices[0].message
        if m.tool_calls:
            kinds.add("call")
            for c in m.tool_calls:
                _check_call(c, set(PARAMS))
        else:
            kinds.add("text")
            assert not (m.content or "").lstrip().startswith("<tool_call>")
    assert kinds  # (which kinds a random model picks is its business; each must be well-formed)


def test_agent_loop_reuses_the_cache_across_the_tool_turn(tool_client, tool_server):
    import httpx

    mid = tool_client.models.list().data[0].id
    sid = httpx.post(tool_server.url + "/v1/sessions").json()["id"]
    h = {"X-Session-Id": sid}
    history: list[dict[str, Any]] = [{"role": "user", "content": "What's the weather in Rome?"}]
    r1 = tool_client.chat.completions.create(
        model=mid,
        messages=history,
        tools=SCHEMAS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
        extra_headers=h,
    )
    call = r1.choices[0].message.tool_calls[0]
    history += [
        r1.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})},
    ]
    r2 = tool_client.chat.completions.create(
        model=mid,
        messages=history,
        tools=SCHEMAS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
        extra_headers=h,
    )
    held = r1.usage.prompt_tokens + r1.usage.completion_tokens - 1
    assert r2.usage.prompt_tokens_details.cached_tokens == held  # the call was re-rendered as generated
    assert r2.choices[0].finish_reason in ("stop", "length") and r2.choices[0].message.tool_calls is None


# --- SmolLM2: a 135M model emits valid calls because the grammar allows nothing else -----------------------


def test_smollm2_fifty_required_calls_parse_and_validate(smollm2_ort):
    rng = random.Random(0)
    ok = 0
    for i in range(50):
        tools = rng.sample(SCHEMAS, rng.randint(1, 3))
        q = rng.choice(QUESTIONS)
        r = smollm2_ort.generate(
            [{"role": "user", "content": q}],
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            max_new_tokens=160,
            temperature=0.7,
            seed=i,
            reuse=False,
        )
        assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1, (q, r.text)
        _check_call(r.tool_calls[0], {t["function"]["name"] for t in tools})
        ok += 1
    assert ok == 50


def test_smollm2_parallel_calls_each_validate(smollm2_ort):
    r = smollm2_ort.generate(
        [{"role": "user", "content": "Weather in Paris and in Rome?"}],
        tools=[WEATHER],
        tool_choice="required",
        max_new_tokens=120,
        temperature=0,
        reuse=False,
    )
    assert r.tool_calls and r.finish_reason == "tool_calls"
    for c in r.tool_calls:
        _check_call(c, {"get_weather"})


def test_cli_generate_tools_prints_the_calls(tool_pkg, tmp_path, capsys):
    from onnxgen.cli.main import main

    spec = tmp_path / "tools.json"
    spec.write_text(json.dumps([WEATHER]), encoding="utf-8")
    rc = main(
        [
            "generate",
            str(tool_pkg),
            "--prompt",
            "weather in Lima?",
            "--tools",
            str(spec),
            "--tool-choice",
            "required",
            "--tool-parser",
            "hermes",
            "--max-new-tokens",
            "120",
            "--threads",
            "1",
            "--no-stream",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "tool_calls" and out["tool_calls"]
    for c in out["tool_calls"]:
        assert c["type"] == "function" and c["function"]["name"] == "get_weather"
        validate(json.loads(c["function"]["arguments"]), PARAMS["get_weather"])
