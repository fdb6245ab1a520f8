"""Agent frameworks against the server, as their users run them (one server for the module, the default model,
no session header: stateless clients): openai-agents over chat completions and over the Responses
API, pydantic-ai and langchain-openai. Each runs a tool loop with a forced first tool choice (call → tool
result → answer, so the small model is not the variable), and later model calls report cached prompt tokens:
the server reuses a stateless agent loop's prefix."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
agents = pytest.importorskip("agents")
pydantic_ai = pytest.importorskip("pydantic_ai")
langchain_openai = pytest.importorskip("langchain_openai")

from onnxgen.serve.app import RunningServer, ServerConfig, create_app  # noqa: E402

pytestmark = pytest.mark.slow

INSTRUCTIONS = "You are a weather assistant. Call get_weather, then answer in one sentence. " * 4


@pytest.fixture(scope="module")
def srv(smollm2_ort):
    with RunningServer(create_app(smollm2_ort, ServerConfig(max_tokens_cap=200))) as s:
        s.model_id = smollm2_ort.spec.path.name
        yield s


def test_openai_agents_tool_loop_on_chat_completions_and_responses(srv):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)

    async def run(kind: type) -> tuple[Any, list[str]]:
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        calls: list[str] = []

        @function_tool(is_enabled=lambda ctx, agent: not calls)  # offered once: then the agent answers
        def get_weather(city: str) -> str:
            """The weather in a city."""
            calls.append(city)
            return f"sunny in {city}"

        agent = Agent(
            name="weather",
            instructions=INSTRUCTIONS,
            model=kind(model=srv.model_id, openai_client=client),
            tools=[get_weather],
            model_settings=ModelSettings(
                tool_choice="get_weather", parallel_tool_calls=False, max_tokens=150, temperature=0.0
            ),
        )
        result = await Runner.run(agent, "What is the weather in Oslo?", max_turns=4)
        await client.close()
        return result, calls

    for kind in (OpenAIChatCompletionsModel, OpenAIResponsesModel):
        result, calls = asyncio.run(run(kind))
        kinds = [item.type for item in result.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
        assert len(calls) == 1 and isinstance(result.final_output, str)
        responses = result.raw_responses
        assert len(responses) == 2
        assert responses[1].usage.input_tokens_details.cached_tokens > 0  # the loop's prefix was reused


def test_openai_agents_streams_tool_arguments(srv):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    calls: list[str] = []

    @function_tool(is_enabled=lambda ctx, agent: not calls)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    agent = Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        model=OpenAIChatCompletionsModel(model=srv.model_id, openai_client=client),
        tools=[get_weather],
        model_settings=ModelSettings(tool_choice="get_weather", parallel_tool_calls=False, max_tokens=150),
    )

    async def run() -> list[str]:
        out = agent_run = Runner.run_streamed(agent, "Weather in Oslo?", max_turns=4)
        deltas = []
        async for ev in out.stream_events():
            if ev.type == "raw_response_event" and ev.data.type == "response.function_call_arguments.delta":
                deltas.append(ev.data.delta)
        assert agent_run.final_output is not None
        return deltas

    deltas = asyncio.run(run())
    assert len(deltas) > 2 and json.loads("".join(deltas)) == {"city": calls[0]}


def test_pydantic_ai_structured_output_and_tool_loop(srv):
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent
    from pydantic_ai.capabilities.abstract import AbstractCapability
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Forecast(BaseModel):
        city: str = Field(max_length=20)
        celsius: int = Field(ge=-50, le=50)

    class ToolFirst(AbstractCapability):
        """Step 1 must call get_weather; later steps must give the structured answer."""

        def get_model_settings(self):
            return lambda ctx: {"tool_choice": ["get_weather"] if ctx.run_step <= 1 else ["final_result"]}

    model = OpenAIChatModel(srv.model_id, provider=OpenAIProvider(base_url=srv.url + "/v1", api_key="unused"))
    calls: list[str] = []
    agent = Agent(model, output_type=Forecast, instructions=INSTRUCTIONS, capabilities=[ToolFirst()])

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny, 21 C"

    settings = {"max_tokens": 150, "temperature": 0.0, "parallel_tool_calls": False}
    result = agent.run_sync("Weather in Oslo?", model_settings=settings)
    assert len(calls) == 1 and isinstance(result.output, Forecast)
    usages = [m.usage for m in result.all_messages() if getattr(m, "kind", "") == "response"]
    assert len(usages) == 2 and usages[1].cache_read_tokens > 0  # the loop's prefix was reused


def test_langchain_openai_tools_stream_and_structured_output(srv):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from pydantic import BaseModel, Field

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = langchain_openai.ChatOpenAI(
        model=srv.model_id,
        base_url=srv.url + "/v1",
        api_key="unused",
        max_tokens=120,
        temperature=0,
        max_retries=0,
    )
    forced = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False, strict=True)
    history = [SystemMessage(INSTRUCTIONS), HumanMessage("Weather in Oslo?")]
    ai = forced.invoke(history)
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "get_weather"
    chunks = list(forced.stream(history))
    pieces = [c for ch in chunks for c in ch.tool_call_chunks]
    assert len(pieces) > 2 and pieces[0]["name"] == "get_weather"  # the name first, then argument fragments
    history += [
        ai,
        ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"]),
    ]
    answer = llm.invoke(history)
    assert isinstance(answer.content, str) and not answer.tool_calls
    assert answer.usage_metadata["input_token_details"]["cache_read"] > 0

    class Forecast(BaseModel):
        city: str = Field(max_length=20)
        celsius: int = Field(ge=-50, le=50)

    out = llm.with_structured_output(Forecast, method="json_schema").invoke("Forecast for Oslo")
    assert isinstance(out, Forecast)
