"""Tool calling: how a model writes tool calls (formats), how they are parsed back, and how a conversation
with tools and tool calls is prepared for a chat template.

A format knows three things about one family of models:
- `render(calls)`: the exact text the model emits for a list of calls (`{"name", "arguments": dict}`);
- `parse(text)`: the model's output split into plain content and calls (never raises; text that is not
  a well-formed call stays content);
- `lark(tools, required, parallel)`: an llguidance grammar that admits only well-formed calls whose
  arguments validate against each tool's JSON schema (`required`), or plain text / calls (`auto`).

Formats: `hermes` (Hermes, Qwen: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`), `llama3_json`
(Llama 3.1: `{"name": ..., "parameters": {...}}`, calls separated by `; `) and `mistral`
(`[TOOL_CALLS][{"name": ..., "arguments": {...}}]`). `detect_format(template)` picks one from the chat
template's text (hermes when nothing tells).

`prepare_messages` makes a conversation renderable by any template in Hugging Face's semantics: tool-call
`arguments` sent as JSON text (OpenAI) become dicts (what templates' `tojson` expects); for a template that
does not render `tool_calls` the calls are written into the assistant's content in the format's own text,
and for a template that ignores `tools` their descriptions go into a system message. The calls are then
rendered exactly as the model wrote them, so the next turn reuses the whole cached reply.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from onnxgen.errors import InvalidRequest

# JSON inside calls is laid out as json.dumps lays it out (the grammar enforces the same layout), so a
# call re-rendered from its parsed arguments is byte for byte the text the model generated.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. `arguments` is JSON text (as OpenAI's API carries it); `id` is `call_<hex>`."""

    name: str
    arguments: str
    id: str

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False)


def _new_call(name: str, args: Any) -> ToolCall:
    return ToolCall(name=name, arguments=_dumps(args), id=f"call_{secrets.token_hex(12)}")


def function_specs(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """The `function` parts of OpenAI-style tools, validated (name, optional description, parameters).
    Raises InvalidRequest(field="tools")."""
    out = []
    for i, t in enumerate(tools or ()):
        if (
            not isinstance(t, Mapping)
            or t.get("type", "function") != "function"
            or not isinstance(t.get("function"), Mapping)
        ):
            raise InvalidRequest(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}",
                field="tools",
            )
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise InvalidRequest(
                f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}",
                field="tools",
            )
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise InvalidRequest(
                f"tools[{i}].function.parameters must be a JSON schema object", field="tools"
            )
        out.append({"name": name, "description": f.get("description", ""), "parameters": dict(params)})
    if len({f["name"] for f in out}) != len(out):
        raise InvalidRequest("tools: two tools have the same name", field="tools")
    return out


def scoped(schema: Mapping[str, Any], key: str) -> dict[str, Any]:
    """A copy of a tool's parameter schema for use as the property `key` of a wrapper schema: its local
    references (`#`, `#/$defs/...`, `#/definitions/...`, any `#/...` pointer) resolved in its own scope, i.e.
    rewritten to `#/properties/<key>/...`. Walks the schema with an explicit stack (no recursion, whatever its
    depth). Raises InvalidRequest for a reference outside the schema (a URL or another document)."""
    prefix = f"#/properties/{key}"
    root: dict[str, Any] = {}
    stack: list[tuple[Any, Any]] = [(schema, root)]  # (a source object or array, its copy)
    while stack:
        src, dst = stack.pop()
        items = src.items() if isinstance(src, Mapping) else enumerate(src)
        for name, v in items:
            if name == "$ref" and isinstance(src, Mapping) and isinstance(v, str):
                if not v.startswith("#"):
                    raise InvalidRequest(
                        f"tool parameter schemas may only use local references ('#/$defs/...'), got {v!r}",
                        field="tools",
                    )
                v = prefix + v[1:]
            if isinstance(v, Mapping):
                child: Any = {}
            elif isinstance(v, list):
                child = [None] * len(v)
            else:
                child = v
            dst[name] = child
            if isinstance(v, Mapping | list):
                stack.append((v, child))
    return root


class ToolFormat:
    name = ""
    marker = ""  # how a call starts; streamed text that may begin one is held back

    def render(self, calls: Sequence[Mapping[str, Any]]) -> str:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def _call_schema(self, f: Mapping[str, Any], args_key: str = "arguments") -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, args_key: scoped(f["parameters"], args_key)},
            "required": ["name", args_key],
            "additionalProperties": False,
            "x-guidance": _LAYOUT,
        }

    def _body_rules(self, funcs: Sequence[Mapping[str, Any]], args_key: str = "arguments") -> str:
        alts = " | ".join(f"c{i}" for i in range(len(funcs)))
        rules = [f"body: {alts}"]
        rules += [f"c{i}: %json {_dumps(self._call_schema(f, args_key))}" for i, f in enumerate(funcs)]
        return "\n".join(rules)

    def lark(self, funcs: Sequence[Mapping[str, Any]], *, required: bool, parallel: bool) -> str:
        """An llguidance Lark grammar: calls only (`required`), or plain text not starting like a call /
        calls (`auto`); one call, or several when `parallel`."""
        raise NotImplementedError

    def _start(
        self, one: str, sep: str, *, required: bool, parallel: bool, wrap: tuple[str, str] = ("", "")
    ) -> str:
        """The `start` rule: `one` call (a rule name), several joined by the literal `sep` when `parallel`,
        inside the literals `wrap`; with `auto`, or else a text whose first character cannot begin a call."""
        calls = f'{one} ("{sep}" {one})*' if parallel else one
        if wrap != ("", ""):
            calls = f'"{wrap[0]}" {calls} "{wrap[1]}"'
        if required:
            return f"start: {calls}"
        first = re.escape(self.marker[0])
        return f"start: TEXT | {calls}\nTEXT: /[^{first}][\\s\\S]*/"


def _calls_from_objects(objs: Any, args_key: str) -> list[ToolCall] | None:
    if isinstance(objs, Mapping):
        objs = [objs]
    if not isinstance(objs, list) or not objs:
        return None
    calls = []
    for o in objs:
        if not isinstance(o, Mapping) or not isinstance(o.get("name"), str):
            return None
        args = o.get(args_key, o.get("arguments", o.get("parameters", {})))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, Mapping):
            return None
        calls.append(_new_call(o["name"], args))
    return calls


class Hermes(ToolFormat):
    name = "hermes"
    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def render(self, calls: Sequence[Mapping[str, Any]]) -> str:
        return "\n".join(
            f"<tool_call>\n{_dumps({'name': c['name'], 'arguments': c['arguments']})}\n</tool_call>"
            for c in calls
        )

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls: list[ToolCall] = []
        rest = []
        pos = 0
        for m in self._CALL.finditer(text):
            try:
                parsed = _calls_from_objects(json.loads(m.group(1)), "arguments")
            except ValueError:
                parsed = None
            if parsed is None:
                continue
            rest.append(text[pos : m.start()])
            pos = m.end()
            calls += parsed
        rest.append(text[pos:])
        content = "".join(rest).strip() if calls else text
        return (content or None), calls

    def lark(self, funcs: Sequence[Mapping[str, Any]], *, required: bool, parallel: bool) -> str:
        start = self._start("call", "\\n", required=required, parallel=parallel)
        return f'{start}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n{self._body_rules(funcs)}\n'


class Llama3Json(ToolFormat):
    name = "llama3_json"
    marker = "{"

    def render(self, calls: Sequence[Mapping[str, Any]]) -> str:
        return "; ".join(_dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return (text or None), []
        calls: list[ToolCall] = []
        dec = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                obj, j = dec.raw_decode(body, i)
            except ValueError:
                return (text or None), []
            parsed = _calls_from_objects(obj, "parameters")
            if parsed is None:
                return (text or None), []
            calls += parsed
            i = j
            while i < len(body) and body[i] in " ;\n":
                i += 1
        return None, calls

    def lark(self, funcs: Sequence[Mapping[str, Any]], *, required: bool, parallel: bool) -> str:
        start = self._start("body", "; ", required=required, parallel=parallel)
        return f"{start}\n{self._body_rules(funcs, 'parameters')}\n"


class Mistral(ToolFormat):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def render(self, calls: Sequence[Mapping[str, Any]]) -> str:
        return "[TOOL_CALLS]" + _dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls])

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = text.find("[TOOL_CALLS]")
        if i < 0:
            return (text or None), []
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[i + len("[TOOL_CALLS]") :].lstrip())
        except ValueError:
            return (text or None), []
        calls = _calls_from_objects(obj, "arguments")
        if calls is None:
            return (text or None), []
        return (text[:i].strip() or None), calls

    def lark(self, funcs: Sequence[Mapping[str, Any]], *, required: bool, parallel: bool) -> str:
        start = self._start("body", ", ", required=required, parallel=parallel, wrap=("[TOOL_CALLS][", "]"))
        return f"{start}\n{self._body_rules(funcs)}\n"


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral())}


def get_format(name: str) -> ToolFormat:
    if name not in FORMATS:
        raise InvalidRequest(
            f"unknown tool-call format {name!r}; choose one of {', '.join(FORMATS)}", field="tool_parser"
        )
    return FORMATS[name]


def detect_format(template: str | None) -> ToolFormat:
    """The format a chat template's model writes calls in (hermes when the template does not tell)."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"]
    if "<tool_call>" in t:
        return FORMATS["hermes"]
    if "<|python_tag|>" in t or '"parameters"' in t:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def _tools_prompt(fmt: ToolFormat, funcs: Sequence[Mapping[str, Any]]) -> str:
    example = fmt.render([{"name": "<function name>", "arguments": {"<argument>": "<value>"}}])
    listing = "\n".join(_dumps(f) for f in funcs)
    return (
        "You can call functions. To call one, answer with nothing but the call, in exactly this form:\n"
        f"{example}\nThe functions:\n{listing}"
    )


def prepare_messages(
    messages: Sequence[Mapping[str, Any]],
    fmt: ToolFormat,
    template: str | None,
    funcs: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """A conversation ready for `template` (see the module docstring). The caller's objects are not modified."""
    t = template or ""
    renders_calls = "tool_calls" in t
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        msg = dict(m)
        calls = msg.get("tool_calls")
        if calls:
            parsed = []
            for j, c in enumerate(calls):
                f = c.get("function", c) if isinstance(c, Mapping) else None
                if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
                    raise InvalidRequest(
                        f"messages[{i}].tool_calls[{j}] must have a function name", field="messages"
                    )
                args = f.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise InvalidRequest(
                            f"messages[{i}].tool_calls[{j}].function.arguments is not JSON", field="messages"
                        ) from None
                parsed.append({"name": f["name"], "arguments": args, "id": c.get("id")})
            if renders_calls:
                msg["tool_calls"] = [
                    {
                        "id": p["id"],
                        "type": "function",
                        "function": {"name": p["name"], "arguments": p["arguments"]},
                        "name": p["name"],
                        "arguments": p["arguments"],
                    }
                    for p in parsed
                ]
            else:
                content = msg.get("content") or ""
                msg.pop("tool_calls")
                msg["content"] = (content + "\n" if content else "") + fmt.render(parsed)
        out.append(msg)
    if funcs and "tools" not in t:
        note = _tools_prompt(fmt, funcs)
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out
