"""HTTP errors in each family's shape: OpenAI's `{"error": {"message", "type", "param", "code"}}` (chat
completions, completions, responses and the server's own routes) and Anthropic's
`{"type": "error", "error": {"type", "message"}}` (messages)."""

from __future__ import annotations

from typing import Any

from onnxgen.errors import (
    APIError,
    Cancelled,
    ContextOverflow,
    InvalidRequest,
    MissingRequiredInput,
    OnnxgenError,
    TemplateError,
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    499: "cancelled",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
}


def body_for(path: str, err: APIError) -> dict[str, Any]:
    """The error body in the shape of the family the request path `path` belongs to."""
    return anthropic_error_body(err) if path.startswith("/v1/messages") else error_body(err)


def error_body(exc: APIError) -> dict[str, Any]:
    """The JSON body of an error response."""
    return {
        "error": {
            "message": exc.message,
            "type": _TYPES.get(exc.status, "invalid_request_error"),
            "param": exc.param,
            "code": exc.code,
        }
    }


def anthropic_error_body(exc: APIError) -> dict[str, Any]:
    """The JSON body of an error response of the Anthropic Messages API."""
    kind = _ANTHROPIC_TYPES.get(exc.status)
    if kind is None:
        kind = "api_error" if exc.status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def from_engine_error(exc: BaseException, *, prompt_field: str = "messages") -> APIError:
    """Map a typed onnxgen error to an APIError (bad input → 400 naming the field)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflow):
        return APIError(400, str(exc), param=prompt_field, code="context_length_exceeded")
    if isinstance(exc, InvalidRequest):
        field = exc.field
        if field == "prompt":
            field = prompt_field
        elif field == "max_new_tokens":
            field = "max_tokens"
        return APIError(400, str(exc), param=field, code="invalid_value")
    if isinstance(exc, MissingRequiredInput):  # an image placeholder without its image
        return APIError(400, str(exc), param=prompt_field, code="missing_required_input")
    if isinstance(exc, TemplateError):
        return APIError(
            400,
            f"the chat template failed on these messages: {exc}",
            param=prompt_field,
            code="invalid_value",
        )
    if isinstance(exc, Cancelled):
        return APIError(499, "the request was cancelled", code="cancelled")
    if isinstance(exc, OnnxgenError):
        return APIError(500, f"{type(exc).__name__}: {exc}", code="internal_error")
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
