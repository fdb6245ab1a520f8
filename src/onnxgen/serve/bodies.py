"""Request bodies, checked before anything recursive touches them: size, nesting depth, strict JSON.

`read_json(request, schema, limit, timeout)` reads a body of at most `limit` bytes (else 413) within `timeout`
seconds (else 408: a trickled body never holds a request open), decodes it with `parse_json_body` and
validates it against a pydantic schema (a 400 naming the first field at fault). `check_json_text(text,
param)` applies the same checks to JSON carried as text inside a body (tool-call `arguments`).
`parse_json_body(raw)` returns the decoded JSON object or raises `APIError(400)` naming the problem:
- nesting deeper than `MAX_DEPTH` arrays/objects (measured on the raw bytes with string contents
  blanked out, in C-speed passes, so a 100,000-deep body never reaches a recursive parser);
- not JSON, `NaN` / `Infinity` (not JSON, though Python's parser takes them) or numbers that overflow
  to infinity (`1e999`);
- a string (key or value) with a lone UTF-16 surrogate (`"\\ud800"`): valid JSON escapes, but not text
  any tokenizer can encode. The error's `param` is the path to the first such string.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from onnxgen.errors import APIError

MAX_DEPTH = 64
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte except the four brackets


def nesting_depth(raw: bytes) -> int:
    """The deepest array/object nesting of a JSON text (brackets inside strings do not count)."""
    skeleton = _STRING.sub(b'""', raw).translate(None, _BRACKETS)
    if not skeleton:
        return 0
    b = np.frombuffer(skeleton, dtype=np.uint8)
    steps = np.where((b == ord("[")) | (b == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text} is out of range (numbers must be finite)")
    return v


def _surrogate_path(value: Any, path: list[str]) -> list[str] | None:
    """The path to the first string holding a lone surrogate, else None (iterative: no recursion)."""
    stack: list[tuple[Any, list[str]]] = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return p
        elif isinstance(v, dict):
            for k, item in v.items():
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return p
                stack.append((item, [*p, k]))
        elif isinstance(v, list):
            stack.extend((item, [*p, str(i)]) for i, item in enumerate(v))
    return None


def _decode(raw: bytes, what: str, param: str | None) -> Any:
    """JSON text → value, checked (depth, strict JSON, finite numbers, no lone surrogates). APIError(400)."""
    depth = nesting_depth(raw)
    if depth > MAX_DEPTH:
        raise APIError(
            400,
            f"{what} nests arrays/objects {depth} deep; at most {MAX_DEPTH} levels are accepted",
            param=param,
            code="invalid_json",
        )
    try:
        data = json.loads(raw, parse_constant=_no_constants, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise APIError(400, f"{what} is not valid JSON: {exc}", param=param, code="invalid_json") from None
    bad = _surrogate_path(data, [])
    if bad is not None:
        path = ".".join(p for p in ([param] if param else []) + bad) or None
        raise APIError(
            400,
            f"{path or what}: a string holds a lone UTF-16 surrogate (e.g. \\ud800), which is not "
            "text; send valid Unicode (pair surrogates, or escape the character itself)",
            param=path,
            code="invalid_value",
        )
    return data


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body (see the module docstring). Raises APIError(400)."""
    data = _decode(raw, "the request body", None)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


def check_json_text(text: str, param: str) -> Any:
    """Decode JSON carried as text inside a body (a tool call's `arguments`) with the body's checks; returns
    the value. Raises APIError(400) naming `param`."""
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate in the text itself
        raise APIError(
            400,
            f"{param}: holds a lone UTF-16 surrogate, which is not text",
            param=param,
            code="invalid_value",
        ) from None
    return _decode(raw, param, param)


async def read_json(request: Any, schema: Any, limit: int, timeout: float = 30.0) -> Any:
    """The body of `request` (a Starlette request) as an instance of the pydantic model `schema`. Raises
    APIError: 413 past `limit` bytes (by Content-Length, and while reading a body without one), 408 when the
    body has not arrived within `timeout` seconds, 400 for a body `parse_json_body` rejects or the schema does
    not admit (`param` names the field)."""
    import asyncio

    from pydantic import ValidationError

    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    chunks: list[bytes] = []

    async def read() -> None:
        n = 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise APIError(
                    413, f"the request body is larger than {limit} bytes", code="request_too_large"
                )
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {timeout:g} s", code="request_timeout"
        ) from None
    data = parse_json_body(b"".join(chunks))
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ())]
        param = ".".join(loc) or None
        raise APIError(
            400, f"{param or 'body'}: {err.get('msg')}", param=param, code="invalid_value"
        ) from None
