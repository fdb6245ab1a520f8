"""OpenAI request schemas (pydantic lives only in `serve/`). Responses are plain dicts built in
`openai.py` in the same shapes as the OpenAI API.

Unknown fields are ignored, as OpenAI-compatible servers commonly do; types are checked here, strictly
as the OpenAI API checks them (no string or boolean coerced into a number, no number into a string;
integers are accepted where a float is expected), and ranges by the engine (`SamplingParams`), so there
is one source of truth for valid values. Bodies reach these models only after `bodies.parse_json_body`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ImageURL(_Model):
    url: str
    detail: str | None = None


class ContentPart(_Model):
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None


class FunctionCall(_Model):
    name: str
    arguments: str


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Model):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class JsonSchemaSpec(_Model):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Model):
    """`text`, `json_object`, `json_schema` (OpenAI) and the extensions `regex` (field `regex`)
    and `lark` / `grammar` (field `grammar`, a Lark grammar in llguidance's dialect)."""

    type: Literal["text", "json_object", "json_schema", "regex", "lark", "grammar"]
    json_schema: JsonSchemaSpec | None = None
    regex: str | None = None
    grammar: str | None = None


class StreamOptions(_Model):
    include_usage: bool = False


class _Sampling(_Model):
    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    speculative: Literal["prompt_lookup", "off"] | None = (
        None  # onnxgen's: drafts by prompt lookup (None: the engine's choice)
    )
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    cache_salt: str | None = None  # vLLM's: requests share cached prefixes only under the same salt


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(union_mode="left_to_right")
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


# --- Anthropic Messages ------------------------------------------------------------------------------


class AnthropicBlock(_Model):
    """A content block: text, tool_use (id, name, input), tool_result (tool_use_id, content), thinking."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[AnthropicBlock] | None = None
    is_error: bool | None = None


class AnthropicMessage(_Model):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]


class AnthropicTool(_Model):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class CountTokensRequest(_Model):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    cache_salt: str | None = None  # onnxgen's (as vLLM's): share cached prefixes only under the same salt


# --- OpenAI Responses --------------------------------------------------------------------------------


class ResponseItem(_Model):
    """An input item: a message (role, content: text or input_text / output_text parts), a function_call
    (call_id, name, arguments) or a function_call_output (call_id, output); reasoning items are ignored."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str | None = None
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None
    id: str | None = None


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Model):
    format: TextFormat | None = None


class ResponsesRequest(_Model):
    model: str
    input: str | list[ResponseItem]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    cache_salt: str | None = None  # onnxgen's (as vLLM's): share cached prefixes only under the same salt
