"""Chat templates: a package's jinja2 template rendered in Hugging Face's semantics, sandboxed.

Templates come from model repositories, so they are untrusted code. They run in jinja2's
`ImmutableSandboxedEnvironment` (no mutation of lists/dicts, no access to Python internals); on
top of that, any access to an unsafe attribute (`__class__`, `__globals__`, ...) raises at once
instead of rendering as an empty value, and everything the template sees is rebuilt from plain
JSON types first.

What a template sees, as in transformers' `apply_chat_template`:
`messages`, `add_generation_prompt`, `tools`, `documents`, the named special tokens of the
tokenizer (`bos_token`, `eos_token`, `unk_token`, `pad_token`, ...), any extra keyword argument,
and the globals `raise_exception(msg)`, `strftime_now(fmt)`, `namespace(...)`, `dict(...)`; the
`tojson` filter is HF's (`ensure_ascii=False`, optional `indent`, `separators`, `sort_keys`); the
environment has `trim_blocks`, `lstrip_blocks`, loop controls (`break`/`continue`) and HF's
`{% generation %}` block (rendered as its body).

Every failure is an `onnxgen.errors.TemplateError` (syntax errors at construction, runtime and
sandbox errors, `raise_exception`); malformed messages are `InvalidRequest(field="messages")`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from onnxgen.errors import InvalidRequest, OnnxgenError, TemplateError

if TYPE_CHECKING:
    import jinja2

    from onnxgen.package.spec import ModelSpec
    from onnxgen.text.tokenizer import Tokenizer

# Names a message's reasoning may come under; templates read `reasoning_content` (gpt-oss: `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _plain(value: Any) -> Any:
    """A copy of `value` built only from JSON types (dict, list, tuple, str, int, float, bool, None);
    anything else becomes the inert string `<TypeName>`. Subclasses are reduced to the base type, so
    the sandbox never sees an object with surprising methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        try:
            return _plain(value.item())
        except Exception:
            pass
    return f"<{type(value).__name__}>"


def _content_text(content: Any, index: int) -> str | list[dict[str, Any]] | None:
    """A message's content as a string: a str as is, a list of text parts joined with newlines. A list with
    image placeholders (`{"type": "image"}`, what `engine/images.py` leaves of an image part) stays a list of
    text and image parts, for a vision model's template to render."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "image" and len(part) == 1:
                parts.append({"type": "image"})
                continue
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise InvalidRequest(
                    f"messages[{index}].content[{j}] must be {{'type': 'text', 'text': str}}, got a {kind!r} part "
                    "(only text and, for vision models, image content is supported)",
                    field="messages",
                )
            texts.append(part["text"])
            parts.append({"type": "text", "text": part["text"]})
        return parts if len(parts) > len(texts) else "\n".join(texts)
    return None


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate and copy a conversation into what templates expect.

    Each message must be a dict with a str `role` and a `content` that is a str or a list of
    `{"type": "text", "text": str}` parts (joined with newlines). `content` may be missing/None only
    for a message with `tool_calls`. Keys whose value is None are dropped and reasoning fields are
    aliased, as transformers does. Other keys pass through. Raises InvalidRequest(field="messages").
    The caller's objects are not modified.
    """
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequest(
            f"messages must be a list of dicts, got {type(messages).__name__}", field="messages"
        )
    if not messages:
        raise InvalidRequest(
            "messages is empty: pass at least one {'role', 'content'} message", field="messages"
        )
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequest(f"messages[{i}] must be a dict, got {type(msg).__name__}", field="messages")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(
                f"messages[{i}].role must be a non-empty str, got {role!r}", field="messages"
            )
        m = {k: v for k, v in msg.items() if v is not None}
        content = msg.get("content")
        if content is None and msg.get("tool_calls"):
            pass
        else:
            text = _content_text(content, i)
            if text is None:
                raise InvalidRequest(
                    f"messages[{i}].content must be a str or a list of text parts, got {type(content).__name__}",
                    field="messages",
                )
            m["content"] = text
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(_plain(m))
    return out


def _make_environment() -> jinja2.Environment:
    """The sandboxed environment with HF's globals, filters and extensions."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Sandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
            # NOTE: jinja2 renders an unsafe attribute as an Undefined that only fails on further use;
            # failing at the access itself makes escapes loud and keeps the template from probing.
            raise SecurityError(
                f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
            )

    class _Generation(jinja2.ext.Extension):
        """HF's `{% generation %}...{% endgeneration %}` marks assistant text; here it renders its body."""

        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class _Namespace(jinja2.utils.Namespace):
        """`namespace()` that refuses underscore-prefixed names (no storing into internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"a template namespace cannot hold the underscore name {name!r}")

    def raise_exception(message: Any) -> None:
        raise TemplateError(f"chat template error: {message}")

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    def make_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = make_dict
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token variables it renders with. Immutable; `render`
    is safe to call from several threads."""

    def __init__(
        self, source: str, *, bos_token: str | None = None, eos_token: str | None = None, **extra: Any
    ) -> None:
        """Compile `source`. `bos_token`, `eos_token` and `extra` (e.g. `unk_token`, `pad_token`) become
        template variables; None values are left undefined, as transformers does.
        Raises TemplateError on a syntax error, naming the line."""
        import jinja2

        if not isinstance(source, str):
            raise TemplateError(f"a chat template must be a str, got {type(source).__name__}")
        self.source = source
        self.variables: dict[str, Any] = {
            k: _plain(v)
            for k, v in {"bos_token": bos_token, "eos_token": eos_token, **extra}.items()
            if v is not None
        }
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template syntax error at line {exc.lineno}: {exc.message}") from exc
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template cannot be compiled: {exc}") from exc

    @classmethod
    def from_spec(cls, spec: ModelSpec, tokenizer: Tokenizer) -> ChatTemplate | None:
        """The package's template (chat_template.jinja, else tokenizer_config's `chat_template`) with
        the tokenizer's special tokens, or None when the package has none."""
        source = spec.chat_template
        if source is None:
            return None
        return cls(source, **tokenizer.special_tokens())

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation to the prompt text (to be encoded without adding special tokens).

        `messages` is validated by `normalize_messages`; `tools` (a list of JSON-schema dicts) and
        `documents` pass through; other keyword arguments become template variables and override
        the special tokens. Raises InvalidRequest for bad messages/tools and TemplateError for every
        failure inside the template (including `raise_exception` and sandbox violations).
        """
        import jinja2

        msgs = normalize_messages(messages)
        tools = kwargs.pop("tools", None)
        if tools is not None and (
            not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise InvalidRequest("tools must be a list of JSON-schema dicts", field="tools")
        documents = kwargs.pop("documents", None)
        context = {
            **self.variables,
            **{k: _plain(v) for k, v in kwargs.items()},
            "messages": msgs,
            "tools": _plain(tools),
            "documents": _plain(documents),
            "add_generation_prompt": bool(add_generation_prompt),
        }
        try:
            return self._template.render(**context)
        except OnnxgenError:
            raise
        except jinja2.TemplateError as exc:
            kind = (
                "sandbox violation"
                if isinstance(exc, jinja2.exceptions.SecurityError)
                else type(exc).__name__
            )
            raise TemplateError(f"chat template failed ({kind}): {exc}{_where(exc)}") from exc
        except Exception as exc:  # a template can raise anything (TypeError from `'a' + none`, ...)
            raise TemplateError(f"chat template failed ({type(exc).__name__}): {exc}{_where(exc)}") from exc


def _where(exc: BaseException) -> str:
    """' (template line N)' from the traceback of an exception raised while rendering, if known."""
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (template line {line})" if line is not None else ""


def render_messages(
    template: ChatTemplate | None, messages: Sequence[Mapping[str, Any]], **kwargs: Any
) -> str:
    """Render with `template`, or raise TemplateError saying the package has no chat template."""
    if template is None:
        raise TemplateError(
            "this package has no chat template (no chat_template.jinja and no tokenizer_config chat_template): "
            "pass a raw prompt string or token ids instead of messages"
        )
    return template.render(list(messages), **kwargs)
