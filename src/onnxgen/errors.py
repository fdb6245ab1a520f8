"""Every typed error onnxgen raises, in one module shared by all layers.

This module depends on nothing else in onnxgen, so backends, the engine, the CLI and the server
can all raise and catch the same types without importing each other. Each message names the
problem and, where there is one, the fix.
"""

from __future__ import annotations

from pathlib import Path


class OnnxgenError(Exception):
    """Base class of every error onnxgen raises on purpose."""


# --- packages -------------------------------------------------------------------------------


class PackageError(OnnxgenError):
    """A model package cannot be used. `path` is the file or folder at fault."""

    def __init__(self, message: str, path: Path | str | None = None) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None


class PackageNotFound(PackageError):
    """The model folder does not exist."""


class InvalidConfig(PackageError):
    """`genai_config.json` is missing, unreadable, or lacks/invalidates a key (`key`)."""

    def __init__(self, message: str, path: Path | str | None = None, key: str | None = None) -> None:
        super().__init__(message, path)
        self.key = key


class MissingModelFile(PackageError):
    """The ONNX graph or its external data file is missing."""


class MissingTokenizer(PackageError):
    """`tokenizer.json` (or another tokenizer file the package needs) is missing."""


class UnsupportedModel(PackageError):
    """The package's model type (or an op in its graph) is not supported."""


class ModelNotBuilt(PackageError):
    """The default model is not built and cannot be built here (e.g. the `convert` extra is missing)."""


class ConversionError(OnnxgenError):
    """Converting a checkpoint into a package failed."""


# --- requests -------------------------------------------------------------------------------


class InvalidRequest(OnnxgenError, ValueError):
    """A request argument is out of range or of the wrong type. `field` names the argument."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class EmptyPrompt(InvalidRequest):
    """The prompt has no tokens."""

    def __init__(self, message: str = "the prompt is empty: pass at least one token of text") -> None:
        super().__init__(message, field="prompt")


class ContextOverflow(InvalidRequest):
    """The prompt is at or over the model's context length."""

    def __init__(self, prompt_tokens: int, context_length: int) -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens but the model's context length is {context_length}: "
            f"shorten the prompt to at most {context_length - 1} tokens",
            field="prompt",
        )
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length


class MissingRequiredInput(OnnxgenError):
    """A required graph input has no source (e.g. `pixel_values` for a vision model)."""

    def __init__(self, name: str, hint: str | None = None) -> None:
        fix = hint or f"pass it with generate(..., inputs={{{name!r}: array}})"
        super().__init__(f"the model's graph requires the input {name!r} but the request has none: {fix}")
        self.name = name


class TemplateError(OnnxgenError):
    """The chat template failed to render (or raised via `raise_exception`)."""


class GrammarError(InvalidRequest):
    """A structured-output constraint (JSON schema, regex, grammar) is invalid."""


class GrammarFailed(GrammarError):
    """A constraint that compiled could not go on mid-generation (llguidance hit one of its limits, or the
    grammar admits no continuation): the request fails rather than end with output that breaks it."""


# --- backends -------------------------------------------------------------------------------


class BackendUnavailable(OnnxgenError):
    """The requested backend or device cannot be used here (missing extra, no CUDA, ...)."""


class DeviceOutOfMemory(OnnxgenError):
    """The device ran out of memory while running the model. The original error is chained."""


class UnsupportedSharding(UnsupportedModel):
    """Tensor parallelism cannot shard a node of the graph (`backends/native/tp/shard.py`). `op` and `node` name
    it; the message says why."""

    def __init__(self, op: str, node: str, why: str, world: int) -> None:
        super().__init__(
            f"tensor_parallel={world} cannot shard node {node!r} ({op}): {why}. "
            "Load this package with tensor_parallel=1."
        )
        self.op = op
        self.node = node


class UnsupportedOp(UnsupportedModel):
    """The native backend cannot lower an op of the graph."""

    def __init__(self, op: str, domain: str, node: str, supported: list[str]) -> None:
        dom = domain or "ai.onnx"
        super().__init__(
            f"unsupported op {dom}::{op} (node {node!r}); the native backend supports: "
            + ", ".join(sorted(supported))
            + ". Use backend='ort' for this package."
        )
        self.op = op
        self.domain = dom
        self.node = node


class OutOfPages(OnnxgenError):
    """Internal: the paged KV pool has too few free pages for an allocation (the scheduler makes the
    request wait; never reaches a user)."""


class NotCapturable(OnnxgenError):
    """Internal to the native backend: a step cannot run in a captured CUDA graph (it needs host
    values or dynamic shapes); the decoder falls back to eager execution. Never reaches users."""


class Cancelled(OnnxgenError):
    """The generation was cancelled by its caller (e.g. a client disconnected)."""


# --- server ---------------------------------------------------------------------------------


class APIError(OnnxgenError):
    """An HTTP error response of the server, OpenAI-shaped. `param` names the request field at
    fault; `headers` are sent with the response (e.g. Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


class QueueFull(OnnxgenError):
    """The engine worker's queue already holds its maximum of waiting requests."""


class SessionLimit(OnnxgenError):
    """An API key already holds the maximum number of server sessions."""


class ClusterStartError(OnnxgenError):
    """Ray Serve applications of onnxgen did not come up (`serve.cluster.deployment.deploy`): one failed to
    deploy, or was not running in time. The message names each deployment's state and Serve's own message
    (e.g. replicas waiting for resources: what each asks and what the cluster has)."""


class SessionFileError(OnnxgenError):
    """A session file cannot be restored (`Model.restore_session`): `reason` names why ("unreadable",
    "format", "truncated", "checksum", "package", "backend", "dtype", "shape", "salt", "tokens"), `path` the
    file. Nothing of it was attached; the conversation can go on by recomputing its context."""

    def __init__(self, message: str, reason: str, path: Path | str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.path = Path(path) if path is not None else None
