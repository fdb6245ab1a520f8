"""`onnxgen.Model`: the public face of a loaded package — a thin object over the engine and its loop.

    model = onnxgen.load("pkg")                                  # onnxgen.load(path, config=None, **overrides)
    r = model.generate(messages, max_new_tokens=64)              # wait for a Result
    h = model.submit(messages, on_token=print)                   # a Handle: h.result(), h.cancel(), h.future
    chat = model.session()                                       # a conversation whose KV is kept between turns
    chat.generate(messages + [reply, next_question])             # prefills only what changed

Every method is thread-safe. Requests from any number of threads are batched into the same engine steps
(with paged KV), all driven by the model's one loop thread; `on_token` callbacks run on that thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict, Unpack

from onnxgen.config import Config
from onnxgen.engine.engine import Engine
from onnxgen.engine.input import Prepared, Prompt
from onnxgen.engine.loop import EngineLoop, on_passing_thread
from onnxgen.engine.output import Handle, Result
from onnxgen.engine.request import Request
from onnxgen.engine.session import Session
from onnxgen.errors import InvalidRequest
from onnxgen.package.spec import ModelSpec
from onnxgen.sampling import LogitsProcessor, SamplingParams


class GenerateOptions(TypedDict, total=False):
    """The options of one request (`Model.generate`, `submit`, `prepare`, `Session.generate`).

    max_new_tokens: tokens to generate at most (default `DecodingConfig.max_new_tokens`). temperature, top_k,
    top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, seed: sampling (None: the package's
    `search` defaults, else greedy) — or `params`, a `SamplingParams`. stop: strings that end generation (not
    returned). output_logits: keep each step's raw logits (`Result.logits`). reuse: False computes from scratch
    and neither reads nor changes any cache. inputs: extra graph inputs by name (they join the identity).
    processors: logits processors. tools / tool_choice / parallel_tool_calls: OpenAI-style tool definitions and
    choice ("auto" | "none" | "required" | {"type": "function", "function": {"name": N}}); output constrained to
    text or well-formed calls, parsed into `Result.tool_calls`. speculative: "prompt_lookup" or "off" (None: the
    model's default); the output is exactly plain decoding's. salt: part of the identity (requests under
    different salts share no KV). images: for a vision package, the images of the prompt's placeholders
    (encoded bytes, data: URLs, PIL images or [H, W, 3] uint8 arrays), after those of its image content
    parts; each joins the identity at its position (`package/attachments.py`).
    """

    max_new_tokens: int | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    seed: int | None
    params: SamplingParams | None
    stop: str | Sequence[str] | None
    output_logits: bool
    reuse: bool
    inputs: Mapping[str, Any] | None
    processors: Sequence[LogitsProcessor]
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool
    speculative: str | bool | None
    salt: str | None
    images: Sequence[Any] | None


class Model:
    """A loaded model package, ready to generate. Create with `onnxgen.load()`; see the module doc."""

    def __init__(self, engine: Engine) -> None:
        """The public face of `engine` (`onnxgen.load` builds it), which the model's loop thread drives from
        now on: nothing else may call its `step`."""
        self._engine = engine
        self._loop = EngineLoop(engine)
        self._default = Session(engine, name="default")

    @classmethod
    def from_spec(cls, spec: ModelSpec, config: Config | None = None) -> Model:
        """Load `spec`'s package with `config` (what `onnxgen.load` does after reading the package), then
        warm it up where `ModelConfig.warmup_for` says so (`engine.warmup`). On the CPU the engine is built on
        a thread that ends with the load (`loop.on_passing_thread`: the loop thread's OpenMP pool is then the
        process's only one)."""
        cpu = (config or Config()).model.device == "cpu"
        model = cls(on_passing_thread(lambda: Engine(spec, config)) if cpu else Engine(spec, config))
        if model.config.model.warmup_for():
            from onnxgen.engine.warmup import warm_up

            warm_up(model)
        return model

    # --- what is loaded (read-only) ----------------------------------------------------------------------

    @property
    def spec(self) -> ModelSpec:
        """The package as read (`onnxgen.package.ModelSpec`), with the configured chunk size applied."""
        return self._engine.spec

    @property
    def config(self) -> Config:
        return self._engine.config

    @property
    def backend(self) -> str:
        """ "ort" or "native"."""
        return self._engine.backend

    @property
    def device(self) -> str:
        return self._engine.device

    @property
    def paged(self) -> bool:
        """Whether requests share one paged KV pool, batched (else one decoder each)."""
        return self._engine.paged

    @property
    def max_running(self) -> int:
        """How many requests run at once (the rest wait)."""
        return self._engine.scheduler.max_running

    @property
    def tokenizer(self) -> Any:
        """The package's `onnxgen.text.Tokenizer`."""
        return self._engine.tokenizer

    @property
    def chat_template(self) -> Any:
        """The package's `onnxgen.text.ChatTemplate` (None: it has none): `render(messages)` gives the text a
        chat prompt is encoded from."""
        return self._engine.chat_template

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._engine.eos_token_ids

    @property
    def tool_format(self) -> Any:
        """How this model writes tool calls (`onnxgen.text.tools.ToolFormat`)."""
        return self._engine.tool_format

    # --- requests ----------------------------------------------------------------------------------------

    def encode(
        self, prompt: Prompt, *, tools: Sequence[Mapping[str, Any]] | None = None, history: Sequence[int] = ()
    ) -> list[int]:
        """The token ids a prompt (raw text, chat messages or ids) runs on, checked; `history`: a session's last
        context, whose ids a chat prompt keeps where its text spells them. Raises `InvalidRequest`,
        `EmptyPrompt`, `ContextOverflow`."""
        return self._engine.inputs.encode(prompt, history, tools)

    def prepare(self, prompt: Prompt, **options: Unpack[GenerateOptions]) -> Prepared:
        """Check and encode a request once, without running it (a server answers 400 before it streams);
        submit the result once (`submit`, `Session.submit`). Raises `InvalidRequest` naming the field."""
        return self._engine.prepare(prompt, **options)

    def generate(
        self,
        prompt: Prompt | Prepared,
        *,
        on_token: Callable[[str], Any] | None = None,
        cancel: threading.Event | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Result:
        """Generate and wait for the `Result`. `prompt`: raw text, a list of `{"role", "content"}` messages
        (rendered by the chat template) or token ids, or a `Prepared` request. `on_token(text)`: each piece of
        text as it is generated (on the model's loop thread). `cancel`: set it to stop the request (`Cancelled`).
        Stateless callers reuse too: with paged KV through the prefix index, else through the retained contexts
        of recent stateless requests (matched by longest prefix). Raises `InvalidRequest` for bad options, and what the request failed with."""
        return self.submit(prompt, on_token=on_token, cancel=cancel, **options).result()

    def submit(
        self,
        prompt: Prompt | Prepared,
        *,
        on_token: Callable[[str], Any] | None = None,
        cancel: threading.Event | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Handle:
        """Queue a request and return its `Handle` at once (`generate` without the wait). Stateless requests run
        concurrently and reuse cached prefixes under their identity (salt included): with paged KV through the
        prefix index, else through the contexts of recent stateless requests, matched by longest prefix."""
        engine = self._engine
        if isinstance(prompt, Prepared):
            if options:
                raise InvalidRequest("a prepared request takes no options", field=next(iter(options)))
            prepared = prompt
        else:
            prepared = engine.prepare(prompt, **options)
        handle = Handle(cancel)

        def done(req: Request) -> None:
            if req.error is not None:
                handle.set_error(req.error)
            else:
                handle.set_result(engine.result_of(req))

        engine.submit(prepared, on_token=on_token, cancel=handle.cancel_event, on_done=done)
        return handle

    def session(
        self, name: str | None = None, *, salt: str | None = None, history: Sequence[int] = ()
    ) -> Session:
        """A new conversation whose KV is kept between its requests. `salt`: part of every identity of its
        requests; requests under different salts never share KV (a server gives each tenant its own). With
        paged KV, sessions under the same salt share the pages of common prefixes. `history`: the ids of a
        context the conversation continues (a stateless request's `prompt_ids` + `tokens`): its first chat
        prompt keeps them where its text spells them, so that context's cached KV is found whole."""
        return Session(self._engine, name, salt=salt, history=history)

    def restore_session(
        self, path: str | Path, name: str | None = None, *, salt: str | None = None
    ) -> Session:
        """A session that continues the conversation `Session.save` wrote to `path`: its KV attached, so its
        next turn prefills only what is new; its `note` is the file's. `salt`: the one it was saved under. Raises `SessionFileError`
        naming why the file cannot be used (another package, backend or salt; truncated, corrupted or
        edited): nothing is attached, and a new session recomputes the context. `DeviceOutOfMemory` when
        the KV does not fit."""
        header, state = self._engine.load_state(path, salt)
        session = Session(self._engine, name, salt=salt, history=header.tokens)
        session.note = header.note
        session.adopt(state)
        return session

    @property
    def default_session(self) -> Session:
        """A session made with the model, for callers that want one conversation without making their own
        (stateless `generate` calls do not use it: they run concurrently, see `submit`)."""
        return self._default

    # --- state -------------------------------------------------------------------------------------------

    def kv_stats(self) -> dict[str, Any]:
        """KV and scheduling numbers now: running and waiting requests, preemptions, `retained_kv_bytes` (what
        sessions keep), with paged KV the pool's pages and prefix-cache hits, and with a vision package
        `vision_runs`, `vision_cache_hits` and `images_cached`. Waits for the step running."""
        return self._engine.kv_stats()

    def kv_snapshot(self) -> dict[str, Any]:
        """`kv_stats` without waiting: computed now if no step is running, else the last numbers computed
        (a metrics endpoint reads this, so it never waits for a long prefill)."""
        return self._engine.kv_snapshot()

    def settle(self) -> None:
        """Wait for device work launched past requests that already finished (a benchmark calls it before
        timing a request, so the request does not pay for the previous one's tail)."""
        self._engine.settle()

    def close(self) -> None:
        """Free every cache's device memory (sessions stay usable and reuse nothing next time; requests running
        go on). The model can still generate; the weights go with the last reference. With no request left, it
        returns once the engine's thread has let go of the engine, so that dropping the model then frees it."""
        self._engine.close()
        if not self._engine.has_work():
            self._loop.wait_idle(5.0)

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
