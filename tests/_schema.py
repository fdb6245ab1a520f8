"""A hand-written validator for the JSON Schema subset the tests use (jsonschema is not a dependency)."""

from __future__ import annotations

from typing import Any


def validate(value: Any, schema: dict[str, Any], path: str = "$") -> None:
    """A hand-written validator for the JSON Schema subset used below (jsonschema isn't installed)."""
    t = schema.get("type")
    types = {"object": dict, "string": str, "boolean": bool, "array": list}
    if t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: not an integer: {value!r}"
    elif t == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{path}: not a number"
    elif t is not None:
        assert isinstance(value, types[t]), f"{path}: not {t}: {value!r}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in enum"
    if "minimum" in schema:
        assert value >= schema["minimum"], path
    if "maximum" in schema:
        assert value <= schema["maximum"], path
    if t == "string":
        assert len(value) <= schema.get("maxLength", 10**9), f"{path}: too long"
        assert len(value) >= schema.get("minLength", 0), f"{path}: too short"
    if t == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 10**9), path
        for i, v in enumerate(value):
            validate(v, schema["items"], f"{path}[{i}]")
    if t == "object":
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key!r}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{path}: extra keys {set(value) - set(props)}"
        for key, v in value.items():
            if key in props:
                validate(v, props[key], f"{path}.{key}")
