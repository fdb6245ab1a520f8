"""A request's prompt as the chat template's messages (or a completion's one prompt), checked the same for
every API family: `chat_messages` (OpenAI chat), `items_to_messages` (the Responses API's input items),
`check_messages` (the tool turns of any family's messages: Anthropic's and the Responses API's conversions
end here too), `completion_prompt`; `image_part` (an image's URL as a content part the engine decodes: data:
URLs as they are, remote ones fetched only when the operator allows it, `fetch_image`). Errors are
`APIError` 400s naming the field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from onnxgen.errors import APIError

Fetch = Callable[[str], bytes]


def chat_messages(req: Any, fetch: Fetch | None = None) -> list[dict[str, Any]]:
    """The chat template's messages (`developer` is `system`; text content parts joined by newlines; with
    `image_url` parts, the content stays a list of text and image parts: `image_part`), checked by
    `check_messages`. `fetch`: how a remote image URL is fetched (None: refused)."""
    messages = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": _flatten_content(m.content, i, fetch)}
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.content is None:
                msg["content"] = None
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
        messages.append(msg)
    return check_messages(messages, "messages")


def check_messages(messages: list[dict[str, Any]], field: str) -> list[dict[str, Any]]:
    """Check a conversation's tool turns (every family's messages come here): `tool_calls` only on assistant
    messages, each call's `arguments` JSON text checked like a body (`bodies.check_json_text`: depth, strict
    JSON, no lone surrogates), and every `tool` message answering a call made earlier by its `tool_call_id`.
    Returns `messages`; raises APIError 400 naming the message."""
    from onnxgen.serve.bodies import check_json_text

    called: set[str] = set()
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            if m["role"] != "assistant":
                raise APIError(
                    400,
                    f"{field}[{i}]: only assistant messages carry tool_calls (this one is {m['role']!r})",
                    param=f"{field}.{i}.tool_calls",
                    code="invalid_value",
                )
            for j, c in enumerate(calls):
                fn = c.get("function") or {}
                args = fn.get("arguments")
                if isinstance(args, str) and args.strip():
                    check_json_text(args, f"{field}.{i}.tool_calls.{j}.function.arguments")
                if c.get("id"):
                    called.add(c["id"])
        if m["role"] == "tool":
            tid = m.get("tool_call_id")
            if not tid:
                raise APIError(
                    400,
                    f"{field}[{i}]: a tool message needs the tool_call_id of the call it answers",
                    param=f"{field}.{i}.tool_call_id",
                    code="invalid_value",
                )
            if tid not in called:
                raise APIError(
                    400,
                    f"{field}[{i}]: tool_call_id {tid!r} answers no tool call made earlier in the conversation",
                    param=f"{field}.{i}.tool_call_id",
                    code="invalid_value",
                )
    return messages


def completion_prompt(req: Any) -> Any:
    """The completion's one prompt: text or token ids (a list of one prompt is that prompt)."""
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(
                400, "only one prompt per request is supported", param="prompt", code="invalid_value"
            )
        prompt = prompt[0]
    return prompt


def image_part(url: str, where: str, fetch: Fetch | None) -> dict[str, Any]:
    """The content part of an image at `url`: a `data:` URL as it is (the engine decodes it), a remote URL's
    bytes through `fetch` (None: refused, 400). Raises APIError naming `where`."""
    if url.startswith("data:"):
        return {"type": "image_url", "image_url": {"url": url}}
    if not url.startswith(("http://", "https://")):
        raise APIError(
            400, f"{where}: an image URL must be a data: or http(s) URL", param=where, code="invalid_value"
        )
    if fetch is None:
        raise APIError(
            400,
            f"{where}: remote image URLs are refused by this server; send the image as a base64 data: URL "
            "(the operator may allow remote images: onnxgen serve --allow-remote-images)",
            param=where,
            code="unsupported",
        )
    return {"type": "image", "image": fetch(url)}


def fetch_image(url: str, *, max_bytes: int, timeout_s: float = 10.0) -> bytes:
    """The bytes at a remote image URL (at most `max_bytes`, within `timeout_s`). Raises APIError 400."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            data = resp.read(max_bytes + 1)
    except Exception as exc:  # URLError, timeouts, HTTP errors
        raise APIError(
            400, f"the image at {url!r} could not be fetched ({exc})", code="invalid_value"
        ) from None
    if len(data) > max_bytes:
        raise APIError(400, f"the image at {url!r} is over {max_bytes} bytes", code="invalid_value")
    return data


def _flatten_content(content: Any, i: int, fetch: Fetch | None = None) -> str | list[dict[str, Any]]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        if part.type == "image_url" and part.image_url is not None:
            url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
            parts.append(image_part(url, f"messages.{i}.content.{k}.image_url", fetch))
            continue
        if part.type != "text" or part.text is None:
            raise APIError(
                400,
                f"content parts of type {part.type!r} are not supported (text and image_url only)",
                param=f"messages.{i}.content",
                code="unsupported",
            )
        texts.append(part.text)
        parts.append({"type": "text", "text": part.text})
    return parts if len(parts) > len(texts) else "\n".join(texts)


def _parts_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for k, p in enumerate(content):
        if p.get("type") not in ("input_text", "output_text", "text") or not isinstance(p.get("text"), str):
            raise APIError(
                400,
                f"{where}.{k}: content parts of type {p.get('type')!r} are not supported (text only)",
                param=f"{where}.{k}.type",
                code="unsupported",
            )
        texts.append(p["text"])
    return "\n".join(texts)


def items_to_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input`: a string is one user message; message items keep their role
    (`developer` is `system`); consecutive function_call items join the assistant message before them as its
    tool calls; a function_call_output is a `tool` message answering its `call_id`. Reasoning items are
    dropped; other item types are a 400."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, it in enumerate(items):
        kind = it.type or ("message" if it.role else None)
        where = f"input.{i}"
        if kind == "message":
            if it.role is None:
                raise APIError(400, f"{where}: a message item needs a role", param=f"{where}.role")
            role = "system" if it.role == "developer" else it.role
            out.append({"role": role, "content": _parts_text(it.content, f"{where}.content")})
        elif kind == "function_call":
            if not it.call_id or not it.name or it.arguments is None:
                raise APIError(
                    400, f"{where}: a function_call needs call_id, name and arguments", param=where
                )
            call = {
                "id": it.call_id,
                "type": "function",
                "function": {"name": it.name, "arguments": it.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not it.call_id:
                raise APIError(
                    400, f"{where}: a function_call_output needs a call_id", param=f"{where}.call_id"
                )
            text = it.output if isinstance(it.output, str) else _parts_text(it.output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": it.call_id, "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(
                400, f"{where}: input items of type {kind!r} are not supported", param=f"{where}.type"
            )
    return out
