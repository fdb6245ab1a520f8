"""The engine: one loaded package, its KV, the scheduler, sessions and the request path.

`Engine` is what `onnxgen.load()` returns (exported as `onnxgen.Model`). A request is a record
(`engine/request.py`) submitted to the scheduler; the engine runs steps until it is done:

    generate(prompt) = make_request -> submit -> drive (step until done) -> result
    step()           = schedule (chunks within a token budget) -> run (one batch) -> postprocess
                       (sample, stream, stop; finished requests commit their KV, failed ones drop it)

Threads that call `generate` at the same time are batched together: whichever thread is driving steps
for everyone, the others wait for their own request. KV comes from one of two adapters: a paged pool
shared by every request with a prefix index (`engine/paged.py`; the native backend on packages it can
batch) or one decoder per request (`engine/slots.py`; ort, and native packages it cannot batch).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from onnxgen.backends import backend_options, create_decoder, create_runner, resolve_backend
from onnxgen.backends.base import Decoder
from onnxgen.engine import reuse as reuse_policy
from onnxgen.engine.drafts import MODES as DRAFT_MODES
from onnxgen.engine.drafts import DraftControl, draft_control
from onnxgen.engine.identity import make_identity
from onnxgen.engine.request import Request, Status
from onnxgen.engine.result import Result, Stats
from onnxgen.engine.scheduler import Chunk, Scheduler
from onnxgen.engine.session import Session, SessionRegistry
from onnxgen.engine.slots import DecoderPool, SlotKV
from onnxgen.errors import (
    BackendUnavailable,
    Cancelled,
    ContextOverflow,
    DeviceOutOfMemory,
    EmptyPrompt,
    InvalidRequest,
)
from onnxgen.package.spec import ModelSpec
from onnxgen.sampling import LogitsProcessor, Sampler, SamplingParams, sample_rows

DEFAULT_MAX_NEW_TOKENS = 256
SPEC_DECODE_STEPS = 2  # decode steps per run at most while a request of the run is copying or confirming a
# match (`_run_steps`)


def _all_ints(seq: Sequence[Any]) -> bool:
    """True when every element is a plain int (bool excluded); fast for long lists of ids."""
    return set(map(type, seq)) <= {int}


def _held_prefix(ids: Sequence[Any], held: Sequence[int]) -> int:
    """len(held) when `ids` starts with `held` (a session's last context: ids that were checked when they were
    given or generated, so a growing conversation's prompt is checked for its new ids only), else 0."""
    n = len(held)
    return n if 0 < n <= len(ids) and tuple(ids[:n]) == tuple(held) else 0


Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int]


def _check_backend_options(options: Mapping[str, Any]) -> None:
    """Raise `InvalidRequest` for an option no backend declares (a typo must not be silently ignored),
    naming it and every option load() takes: the engine's own keyword arguments and the options the
    backends declare (a backend ignores another's, so one set works with backend="auto")."""
    declared = sorted({o for opts in backend_options().values() for o in opts})
    for name in options:
        if name not in declared:
            params = inspect.signature(Engine.__init__).parameters.values()
            own = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
            raise InvalidRequest(
                f"unknown option {name!r}; load() takes {', '.join(own)} and the backend options "
                f"{', '.join(declared)}",
                field=name,
            )


class Engine:
    """A loaded model package ready to generate. Create with `onnxgen.load()`.

    Thread-safety: every method may be called from any thread. Each `Session` serialises its own
    requests; requests of different sessions (and stateless `generate` calls) run concurrently, batched
    into the same steps when the KV is paged.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        backend: str = "auto",
        device: str = "cpu",
        chunk_size: int | None = None,
        max_sessions: int = 8,
        max_kv_bytes: int | None = None,
        tool_parser: str | None = None,
        paged: bool | None = None,
        max_running: int | None = None,
        max_batch_tokens: int | None = None,
        decode_steps: int | None = None,
        **backend_options: Any,
    ) -> None:
        """`paged`: share one paged KV pool between all requests, batched (None: when the backend can, i.e.
        native with a package whose attention is fused; True: required, else `BackendUnavailable`; False:
        one decoder per request). `max_running`: requests decoding at once (default 64 on CUDA, 16 on the
        CPU with paged KV, 8 with decoders). `max_batch_tokens`: tokens per step (default 4096 on CUDA, 512
        on the CPU; unbounded with decoders, where only `chunk_size` splits a prompt)."""
        from onnxgen.text import ChatTemplate, Tokenizer

        self.spec = spec.with_chunk_size(chunk_size)
        self.device = device
        self.backend = resolve_backend(backend, device)
        _check_backend_options(backend_options)
        for name, v in (
            ("max_running", max_running),
            ("max_batch_tokens", max_batch_tokens),
            ("decode_steps", decode_steps),
        ):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise InvalidRequest(f"{name} must be an int >= 1, got {v!r}", field=name)
        self.tokenizer = Tokenizer.from_spec(self.spec)
        self.chat_template = ChatTemplate.from_spec(self.spec, self.tokenizer)
        self.eos_token_ids = tuple(dict.fromkeys((*self.spec.eos_token_ids, *self.tokenizer.eos_token_ids)))
        self.pool: DecoderPool | None = None
        self.executor: Any = None
        cuda = device == "cuda"
        paged_running = max_running or (64 if cuda else 16)
        if paged is not False and self.backend == "native":
            try:
                from onnxgen.engine.paged import PagedKV

                runner = create_runner(
                    self.spec, self.backend, device, max_batch=paged_running, **backend_options
                )
                self.executor = PagedKV(runner)
            except BackendUnavailable:
                if paged:
                    raise
        elif paged:
            raise BackendUnavailable(f"paged KV needs the native backend (this engine runs {self.backend})")
        if self.executor is None:
            self._prototype = create_decoder(self.spec, self.backend, device, **backend_options)
            self._prototype_lock = threading.Lock()
            self.pool = DecoderPool(self._new_decoder)
            # NOTE: the prototype is an ordinary decoder too; a closed decoder stays usable and still forks
            self.pool.release(self._prototype)
            self.executor = SlotKV(self.pool)
        self.paged = self.executor.paged
        self.decode_steps = decode_steps or (8 if cuda and self.paged else 1)
        # runs that hold a copying request (one whose drafts were accepted lately: `DraftControl.hot`) are
        # shorter: a run is read after the next one is launched, and a match found on reading it is verified
        # only after that next run, so a copy waits up to two runs' tokens before its drafts are verified
        # (SmolLM2 bf16 on an H100, edit workload: 1.57x with runs of 8, 1.79x with 4, 1.95x with 2); a
        # request with nothing accepted keeps full runs (shorter ones cost free text 5-11 %;
        # docs/benchmarks/speculative-gpu.md) but for one short run after a match it has yet to confirm
        # (`DraftControl.stop_chain`: a chance match then costs a short run instead of a broken chain)
        self.spec_decode_steps = SPEC_DECODE_STEPS
        # what `speculative=None` means: prompt lookup, on the CPU (a verification forward costs about one
        # decode step there: docs/benchmarks/speculative-cpu.md) and on CUDA
        self.speculative: str | bool = "prompt_lookup"
        # on CUDA a speculating request drafts only while it runs alone: at batch 1 SmolLM2 bf16 on an H100
        # ran edit 1.8-2.0x, numbers 1.3-1.4x, explain 1.00x, free text 0.99x, but four requests drafting in
        # one batch ran 0.26x (bf16) and 0.54x (fp32) of the same batch without drafts — a verify step beside
        # other requests' decodes runs eagerly, outside their captured decode runs
        # (docs/benchmarks/speculative-gpu.md). On the CPU batches draft too.
        self.speculate_alone = cuda
        # the step that ends prompts launches their first decode run behind the device's choice of their first
        # token, before the host reads it (`_first_run`): no host round trip between prefill and decoding. On
        # CUDA only: on the CPU the host computes a run as it launches it, so the first token would wait for it
        self.launch_first = cuda
        # steps of that first run (0: `decode_steps`): it is launched before the host reads the first token, so
        # its launch is part of the time to the first token; one step is the least to launch there, and the
        # chain's next run (full length) is launched before it is read, so the device still never waits.
        # Measured on an H100 (docs/benchmarks/decode-gpu.md, fourteenth session): decode tok/s as with a full
        # first run; the full run's launch cost the 1B's first token up to 0.24 ms on one host, nothing on another
        self.first_run_steps = 1
        if self.paged:
            running = paged_running
            budget = max_batch_tokens or (4096 if cuda else 512)
        else:
            running = max_running or 8
            budget = max_batch_tokens or (1 << 40)
        self.scheduler = Scheduler(
            self.executor, max_running=running, token_budget=max(budget, running), preempt=self.paged
        )
        self._kv_lock = threading.RLock()  # held by the step, and by whoever changes KV state from outside
        self._progress = threading.Condition()
        self._completed = 0  # requests finished or failed so far: waiters are woken only when it changes
        self._driving = False
        self._stuck = 0
        # a launched run of decode steps that only finished requests fed (`_run_decodes`): nobody takes its
        # tokens, and the next step waits for it instead of the finished requests' callers (`settle`)
        self._trailing: Any = None
        self.registry = SessionRegistry(max_sessions=max_sessions, max_kv_bytes=max_kv_bytes)
        self._default_session = Session(self, name="default")
        self.package_key = f"{self.spec.path.resolve()}|{self.spec.kv_dtype}|{self.backend}|{device}"
        from onnxgen.text.tools import detect_format, get_format

        source = self.chat_template.source if self.chat_template is not None else None
        self.tool_format = get_format(tool_parser) if tool_parser else detect_format(source)

    # --- decoders & sessions -------------------------------------------------------------

    def _new_decoder(self) -> Decoder:
        """A new empty decoder sharing the loaded weights (`Decoder.fork`)."""
        with self._prototype_lock:
            return self._prototype.fork()

    def session(self, name: str | None = None, *, salt: str | None = None) -> Session:
        """A new conversation whose KV is retained between its requests. `salt`: part of every identity
        of its requests; requests under different salts never share KV (a server gives each tenant its
        own). With paged KV, sessions under the same salt share the pages of common prefixes."""
        return Session(self, name, salt=salt)

    @property
    def max_running(self) -> int:
        """How many requests run at once (the rest wait in the scheduler's queue)."""
        return self.scheduler.max_running

    @property
    def default_session(self) -> Session:
        return self._default_session

    def generate(self, prompt: Prompt, **kwargs: Any) -> Result:
        """Generate (stateless callers reuse too: with paged KV through the prefix index, with decoders on
        an implicit default session).

        prompt: `str` (raw text), a list of `{"role", "content"}` dicts (rendered through the chat
        template) or a list of token ids. Keyword arguments: max_new_tokens, temperature, top_k,
        top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, seed, stop,
        output_logits, on_token, reuse, inputs, processors, cancel, tools, tool_choice,
        parallel_tool_calls, salt. See `run_request`.
        """
        if self.paged:
            salt = kwargs.pop("salt", None)
            result, _ = self.run_request(prompt, owner=None, held=None, salt=salt, **kwargs)
            return result
        return self._default_session.generate(prompt, **kwargs)

    # --- prompts -------------------------------------------------------------------------

    def encode_prompt(
        self, prompt: Prompt, held: Sequence[int] = (), tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a prompt: raw text, chat messages or ids (validated).

        `held`: ids a session's cache holds. For chat messages whose rendering starts with exactly the
        text of a prefix of `held` (an earlier turn and the reply the model generated), that prefix is kept
        as it is and only the rest is encoded, when that keeps more of `held` than plain encoding does: a
        reply's text does not always re-tokenize into the ids that were sampled, and the model has seen
        its own ids (`Tokenizer.encode_after`). Token ids that start with exactly `held` are checked past it
        only (`held`'s were checked when they were given or generated). `tools`: OpenAI-style tool definitions the chat template
        sees (messages with `tool_calls` and `role: "tool"` are prepared by `onnxgen.text.tools`)."""
        if isinstance(prompt, str):
            if tools:
                raise InvalidRequest(
                    "tools need a chat prompt (a list of messages), not raw text", field="tools"
                )
            ids = self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            if self.chat_template is None:
                raise InvalidRequest(
                    f"{self.spec.path}: the package has no chat template; pass raw text or token ids "
                    "(or add chat_template.jinja to the package)",
                    field="prompt",
                )
            from onnxgen.text import tools as tool_text

            funcs = tool_text.function_specs(tools)
            messages = tool_text.prepare_messages(prompt, self.tool_format, self.chat_template.source, funcs)
            text = self.chat_template.render(
                messages, add_generation_prompt=True, tools=list(tools) if tools else None
            )
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if held and reuse_policy.common_prefix(ids, held) < len(held):
                kept = self.tokenizer.encode_after(text, held)
                if reuse_policy.common_prefix(kept, held) > reuse_policy.common_prefix(ids, held):
                    ids = kept
        elif isinstance(prompt, Sequence) and _all_ints(prompt[(known := _held_prefix(prompt, held)) :]):
            if tools:
                raise InvalidRequest(
                    "tools need a chat prompt (a list of messages), not token ids", field="tools"
                )
            ids = list(prompt)
            try:  # NOTE: vectorised: prompts may hold many thousand ids (those equal to `held`'s were checked)
                arr = np.asarray(ids[known:], dtype=np.int64)
            except OverflowError:  # an id beyond int64
                big = str(next(i for i in ids if not -(2**63) <= i < 2**63))
                big = big if len(big) <= 24 else f"{big[:12]}...({len(big)} digits)"
                raise InvalidRequest(
                    f"token id {big} is outside the vocabulary [0, {self.spec.vocab_size})", field="prompt"
                ) from None
            if arr.size and (arr.min() < 0 or arr.max() >= self.spec.vocab_size):
                bad = int(arr[(arr < 0) | (arr >= self.spec.vocab_size)][0])
                raise InvalidRequest(
                    f"token id {bad} is outside the vocabulary [0, {self.spec.vocab_size})", field="prompt"
                )
        else:
            raise InvalidRequest(
                "prompt must be a string, a list of {'role', 'content'} messages, or a list of token ids",
                field="prompt",
            )
        if not ids:
            raise EmptyPrompt()
        if len(ids) >= self.spec.context_length:
            raise ContextOverflow(len(ids), self.spec.context_length)
        return ids

    # --- the request path ----------------------------------------------------------------

    def submit(
        self,
        prompt: Prompt,
        *,
        owner: Any = None,
        held: Any = None,
        history: Sequence[int] | None = None,
        salt: str | None = None,
        max_new_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        output_logits: bool = False,
        on_token: Callable[[str], Any] | None = None,
        reuse: bool = True,
        inputs: Mapping[str, Any] | None = None,
        processors: Sequence[LogitsProcessor] = (),
        cancel: threading.Event | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        speculative: str | bool | None = None,
        **sampling: Any,
    ) -> Pending:
        """Queue one request and return at once; `Pending.result()` runs steps until it is done (and so
        does any other thread waiting for a request of this engine). Validation errors raise here.

        `owner`: the session the request's context is kept for (None: nobody; with paged KV its pages
        still join the prefix index). `held`: the owner's retained state, taken for this request: this
        call disposes of it on every path (reused, replaced, or dropped on failure). `history`: the ids of
        the owner's last context, which a chat prompt keeps where it spells them (`encode_prompt`); None:
        those `held` covers. `salt`: part of the
        identity (requests under different salts share no KV). `sampling` holds the
        `SamplingParams.resolve` keywords (temperature, top_k, top_p, min_p, repetition_penalty,
        presence_penalty, frequency_penalty, seed); None means "not given".

        `speculative`: "prompt_lookup" drafts tokens from the context (n-gram lookup) and verifies them
        in one forward per step, keeping the longest prefix that plain decoding would have produced and
        rewinding the KV past the rest: the output is exactly plain decoding's, greedy or sampled. False
        (or "off") decodes one token per step; None is the engine's choice (`Engine.speculative`).
        `Stats.draft_tokens` / `accepted_tokens` count what was proposed and kept. Drafts are verified on
        both executors (per-request decoders that can rewind, and ragged batches on the paged pool); on
        CUDA only while the request runs alone (`speculate_alone`; with it off, a CUDA batch's drafting
        rows are computed as the request's alone while plain decoding's batch bits come from a few-row
        product, so bf16 tokens may then differ from the same batch's plain ones at a near-tie).

        Tools (chat prompts): `tools` are OpenAI-style definitions; `tool_choice` is "auto" (the default
        with tools: text or calls), "none" (text, never parsed), "required" (one or more calls) or
        `{"type": "function", "function": {"name": N}}` (calls of N). Except for "none", output is
        constrained by llguidance to text or well-formed calls in the model's format (`tool_format`)
        whose arguments validate against the tool's schema ("required"/named: calls only), and parsed
        into `Result.tool_calls` (`finish_reason` "tool_calls", `Result.content` the text around them).

        `Pending.result()` raises `Cancelled` when `cancel` is set, and backend errors with their cause;
        on any of them nothing of the request stays in the cache.
        """
        t0 = time.perf_counter()
        try:
            if history is None:
                history = held.identity.tokens if held is not None else ()
            ids = self.encode_prompt(prompt, history if reuse else (), tools=tools)
            tool_grammar = self.tool_processor(tools, tool_choice, parallel_tool_calls)
            if tool_grammar is not None:
                processors = [*processors, tool_grammar]
            if max_new_tokens is None:
                max_new_tokens = DEFAULT_MAX_NEW_TOKENS
            if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
                raise InvalidRequest(
                    f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}", field="max_new_tokens"
                )
            stops = [stop] if isinstance(stop, str) else list(stop or [])
            if not all(isinstance(s, str) for s in stops):
                raise InvalidRequest("stop must be a string or a list of strings", field="stop")
            try:
                params = SamplingParams.resolve(self.spec.search, **sampling)
            except TypeError as exc:  # an unknown keyword argument
                raise InvalidRequest(f"unknown generate() argument: {exc}", field="sampling") from exc
            self._check_inputs(inputs)
            if salt is not None and not isinstance(salt, str):
                raise InvalidRequest("salt must be a string", field="salt")
            drafts = self._draft_control(speculative)
            key = self.package_key if salt is None else f"{self.package_key}|salt={salt}"
            digest = make_identity(ids, inputs, key).digest
            from onnxgen.text import IncrementalDetokenizer

            req = Request(
                prompt=ids,
                digest=digest,
                sampler=Sampler(params, ids, processors),
                detokenizer=IncrementalDetokenizer(self.tokenizer),
                max_new_tokens=max_new_tokens,
                context_length=self.spec.context_length,
                eos_ids=frozenset(self.eos_token_ids),
                stop=stops,
                inputs=inputs,
                on_token=on_token,
                output_logits=output_logits,
                cancel=cancel,
                reuse=reuse,
                chunk_size=self.spec.chunk_size,
                owner=owner,
                held=held,
                drafts=drafts,
            )
        except BaseException:
            self.drop_state(held)
            raise
        self.scheduler.add(req)
        return Pending(self, req, t0, tools, tool_choice)

    def _draft_control(self, speculative: str | bool | None) -> DraftControl | None:
        """The request's draft length control, or None when it decodes one token per step."""
        mode = self.speculative if speculative is None else speculative
        if mode in (False, "off"):
            return None
        if mode not in (True, *DRAFT_MODES):
            raise InvalidRequest(
                f"speculative must be one of {[*DRAFT_MODES, 'off']} or None, got {mode!r}",
                field="speculative",
            )
        return draft_control(
            str(self.device).startswith("cuda"), self.executor.verify_sizes, solo=self.speculate_alone
        )

    def run_request(self, prompt: Prompt, **kwargs: Any) -> tuple[Result, Any]:
        """`submit` and wait: the result, and the state the request's owner keeps (None: nothing)."""
        pending = self.submit(prompt, **kwargs)
        return pending.result(), pending.request.kept

    def _result(self, req: Request, t0: float, tools: Any, tool_choice: Any) -> Result:
        n = len(req.output)
        decode_s = req.t_done - req.t_first
        stats = Stats(
            prompt_tokens=len(req.prompt),
            reused_tokens=req.cached,
            prefilled_tokens=len(req.prompt) - req.cached,
            generated_tokens=n,
            ttft_s=req.t_first - t0,
            decode_tok_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
            total_s=req.t_done - t0,
            backend=self.backend,
            device=self.device,
            chunk_size=self.spec.chunk_size,
            draft_tokens=req.drafts.drafted if req.drafts is not None else 0,
            accepted_tokens=req.drafts.accepted if req.drafts is not None else 0,
        )
        content: str | None = req.text
        calls: list[Any] = []
        finish = req.finish_reason or "stop"
        if tools and tool_choice != "none":
            content, calls = self.tool_format.parse(req.text)
            if calls:
                finish = "tool_calls"
        return Result(
            text=req.text,
            tokens=list(req.output),
            finish_reason=finish,
            stats=stats,
            prompt_ids=req.prompt,
            logits=np.stack(req.logits) if req.output_logits else None,
            tool_calls=calls,
            content=content,
        )

    # --- steps ----------------------------------------------------------------------------

    def _drive(self, req: Request) -> None:
        """Run steps until `req` is done. One thread drives at a time; the others wait for their own request
        (it is stepped by the driver) or to take over driving when the driver's request is done."""
        while True:
            with self._progress:
                while not req.done.is_set() and self._driving:
                    self._progress.wait()
                if req.done.is_set():
                    return
                self._driving = True
            try:
                while not req.done.is_set():
                    seen = self._completed
                    self.step()
                    if self._completed != seen:  # waking every waiter each step costs the step's cores
                        with self._progress:
                            self._progress.notify_all()
            finally:
                with self._progress:
                    self._driving = False
                    self._progress.notify_all()

    def step(self) -> bool:
        """One engine step: schedule, run the batch, sample and stream, finish or fail requests. Returns
        False when there was nothing to do."""
        with self._kv_lock:
            self.settle()
            chunks, cancelled = self.scheduler.schedule()
            for req in cancelled:
                self._fail(req, Cancelled("generation cancelled"))
            if not chunks:
                if self.scheduler.waiting and not self.scheduler.running:
                    self._unstick()
                return bool(cancelled)
            self._stuck = 0
            k = self._decode_run(chunks)
            if k > 1:
                self._run_decodes(chunks, k)
                return True
            try:
                outs = self.executor.run(chunks)
            except Exception as exc:  # the batch failed: every request in it fails
                for c in chunks:
                    self._fail(c.req, exc)
                return True
            k, decodes = self._first_run(chunks)
            first = self._launch_first(decodes, outs, k) if k else None
            if (
                first is not None
            ):  # prompts' ends, their first decode run launched before their tokens are read
                tokens, run = first
                picked: dict[int, Any] = dict(enumerate(tokens))
            else:  # every sampled row's token in one call (one host transfer); a processor's error fails its request
                rows = [
                    i
                    for i, (c, out) in enumerate(zip(chunks, outs, strict=True))
                    if c.sample and not c.draft and out is not None and not isinstance(out, BaseException)
                ]
                picked = self._sample(chunks, outs, rows)
            for i, (c, out) in enumerate(zip(chunks, outs, strict=True)):
                req = c.req
                if isinstance(out, BaseException):
                    self._fail(req, out)
                    continue
                req.computed = c.start + c.n
                if not c.sample:
                    continue
                if c.draft:
                    self._verify(c, out)
                    continue
                if isinstance(picked.get(i), BaseException):
                    self._fail(req, picked[i])
                    continue
                try:
                    finished = req.accept(out, picked.get(i))
                except Exception as exc:  # a processor or the on_token callback
                    self._fail(req, exc)
                    continue
                if finished:
                    self._finish(req)
            if first is not None:
                self._continue_first(decodes, run, k)
            return True

    def _decode_run(self, chunks: Sequence[Any]) -> int:
        """How many decode steps to run back to back now (1: an ordinary step). More than one only when
        the KV is paged, every chunk is a plain decode whose choice needs nothing of the host (no
        processors or penalties, no logits kept, no drafts), and no waiting request could be admitted
        meanwhile; at most `decode_steps` (`_run_steps`: fewer while a request copies or confirms a match)
        and what every request may still generate; pages for them all reserved (else 1)."""
        k = self._run_steps(chunks)
        if k <= 1 or not self.paged or self._admissible():
            return 1
        for c in chunks:
            r = c.req
            if c.n != 1 or not c.sample or c.draft or r.output_logits or r.sampler.needs_processing:
                return 1
        return self._room(chunks, k, 0, least=2) or 1

    def _first_run(self, chunks: Sequence[Any]) -> tuple[int, list[Chunk]]:
        """How many decode steps to launch right behind a step of prompts' last chunks (0: none), and those
        chunks as decodes of their last prompt position (whose step chooses the first token: `launch_decodes`'
        run 0, so runs continue from there at offset 1). Some only when each chunk ends its prompt and
        samples its request's first token, and the request could then decode in runs (`_decode_run`: paged,
        nothing of the host needed to choose, no drafts, no waiting request to admit), and with
        `launch_first`; at most `decode_steps` (and `first_run_steps`) and what each request may still
        generate after that first token (`_room`, the first token counted as a step already chosen). Reserves
        the pages."""
        k = self.decode_steps
        if k <= 1 or not (self.paged and self.launch_first) or self._admissible():
            return 0, []
        k = min(k, self.first_run_steps or k)
        for c in chunks:
            r = c.req
            if (
                not c.sample
                or c.draft
                or r.output
                or r.cancelled
                or r.output_logits
                or r.sampler.needs_processing
                or (r.drafts is not None and r.drafts.active(len(chunks)))
            ):
                return 0, []
        decodes = [Chunk(c.req, c.start + c.n - 1, 1, True) for c in chunks]
        return self._room(decodes, k, 1), decodes

    def _launch_first(
        self, decodes: list[Chunk], outs: Sequence[Any], k: int
    ) -> tuple[list[int], Any] | None:
        """Choose the prompts' first tokens on the device (`outs`: their logits rows), launch `k` decode steps
        of `decodes` behind them, then read the tokens (the host's one wait: the device decodes meanwhile):
        (tokens, run; None if the launch failed), or None where nothing was chosen (the step goes on as it
        would have)."""
        try:
            first = self.executor.choose_first(decodes, outs)
        except Exception:  # chosen as usual below (a real fault recurs there)
            return None
        try:
            run = self.executor.launch_decodes(decodes, k, 1, first)
        except Exception:  # not launched: the requests decode from the next step (a real fault recurs there)
            run = None
        return self.executor.chosen(first), run

    def _continue_first(self, decodes: list[Chunk], run: Any, k: int) -> None:
        """After the prompts' first tokens were taken, the run launched behind them: decode runs go on from
        it as `_run_decodes`'; taken by the others and ended where a request finished or failed at its first
        token; left to the next step (`_trailing`) where all did."""
        if run is None:
            return
        done = {i for i, c in enumerate(decodes) if c.req.status is Status.FINISHED}
        if len(done) == len(decodes):
            self._trailing = run
            return
        self._run_decodes(decodes, k, run=run, offset=1, done=done)

    def _run_steps(self, chunks: Sequence[Any]) -> int:
        """Steps per run for `chunks`: `decode_steps`, at most `spec_decode_steps` when one of them is copying
        (a draft of it accepted lately, `DraftControl.hot`) or has a match waiting to be confirmed by the next
        run (`DraftControl.watching`)."""
        if any(
            c.req.drafts is not None
            and c.req.drafts.active(len(chunks))
            and c.req.drafts.watching(len(c.req.output))
            for c in chunks
        ):
            return min(self.decode_steps, self.spec_decode_steps)
        return self.decode_steps

    def _run_decodes(
        self, chunks: Sequence[Any], k: int, run: Any = None, offset: int = 0, done: set[int] | None = None
    ) -> None:
        """Runs of decode steps of `chunks` (`PagedKV.launch_decodes`), each request taking its tokens in
        order exactly as single steps would (EOS, stop strings and lengths checked per token). While the
        batch may continue (`_continue_run`), the next run is launched before the current one is read, so
        the device never waits for the host between runs; once a request finishes or fails, the run
        already launched is read too, the others take its tokens, and control returns to `step` — unless
        every request of the run finished: then nobody takes its tokens and the next step waits for it
        (`_trailing`), so the finished requests' callers do not.
        Positions fed after a request finished are taken back out of its cache. `run`: the first run, already
        launched at `offset` (`_continue_first`); `done`: the chunks whose requests have finished before it
        (the run is then the last one, taken by the others)."""
        if run is None:
            try:
                run = self.executor.launch_decodes(chunks, k)
            except Exception as exc:  # the run failed: every request in it fails
                for c in chunks:
                    self._fail(c.req, exc)
                return
        if done:  # some requests finished before this run: the others take it, then `step` schedules anew
            self._read(chunks, run, offset, set(done))
            return
        while True:
            k_next = self._continue_run(chunks, offset + k)
            nxt = None
            if k_next:
                try:
                    nxt = self.executor.launch_decodes(chunks, k_next, offset + k, run)
                except Exception:  # not launched: this run ends the sequence (a real fault recurs in `step`)
                    nxt = None
            done, ok = self._read(chunks, run, offset, set())
            if not ok:
                self._drain(nxt)
                return
            if nxt is None:
                return
            if len(done) == len(chunks):  # all finished: the launched run's steps lie past every context, and
                # its wait is left to the next step (this run's unread part is ordered before it), so the
                # finished requests' callers return now (a reply that ends by EOS stops inside a chain)
                self._trailing = nxt
                return
            if done or self._drafts_ready(chunks, done, k_next):  # the others take the launched run's tokens
                # too, then `step` schedules anew (a request that found drafts verifies them there)
                self._read(chunks, nxt, offset + k, done)
                return
            run, offset, k = nxt, offset + k, k_next

    def _read(self, chunks: Sequence[Any], run: Any, offset: int, done: set[int]) -> tuple[set[int], bool]:
        """Read a launched run part by part as the device completes them (`decode_parts`), the requests of
        `chunks` not in `done` taking each part's tokens (`_take_run`, fed from `offset`), until all are done:
        a reply that ends in a run's first part returns without waiting for the rest, which is left to the next
        step (`_trailing`). Returns (done, whether the run could be read; if not, the requests not done
        failed)."""
        parts = self.executor.decode_parts(run)
        got = 0
        for end in parts:
            try:
                rows = self.executor.collect_decodes(run, end)
            except Exception as exc:
                for i, c in enumerate(chunks):
                    if i not in done:
                        self._fail(c.req, exc)
                return done, False
            done = self._take_run(chunks, rows[got:], offset + got, done, parts[-1] - got)
            got = end
            if len(done) == len(chunks):
                if got < parts[-1]:  # the rest of the run: the next step's to wait for
                    self._trailing = run
                break
        return done, True

    def _continue_run(self, chunks: Sequence[Any], fed: int) -> int:
        """How many decode steps to launch after the `fed` steps already launched for `chunks` (0: none):
        as `_decode_run`, counting the launched steps as generated, and none once a request is cancelled
        or a waiting request could be admitted. Reserves the pages."""
        if self._admissible() or any(c.req.cancelled for c in chunks):
            return 0
        return self._room(chunks, self._run_steps(chunks), fed)

    def _admissible(self) -> bool:
        """Whether a waiting request could be admitted now (a run of decode steps would keep it waiting)."""
        sch = self.scheduler
        return bool(sch.num_waiting()) and len(sch.running) < sch.max_running

    def _room(self, chunks: Sequence[Any], k: int, fed: int, least: int = 1) -> int:
        """At most `k` decode steps for `chunks` (decodes: each feeds its request's last token at `start`)
        after the `fed` steps already launched or chosen for them: what every request may still generate,
        those steps counted, and its context hold; with the pages for them all reserved, or 0 when fewer than
        `least` fit."""
        for c in chunks:
            r = c.req
            unread = c.start + fed - r.num_tokens + 1  # launched steps whose tokens the request has not taken
            k = min(k, r.max_new_tokens - len(r.output) - unread, r.context_length - (c.start + fed) - 1)
        if k >= least and all(self.executor.reserve(c.req, c.start + fed + k) for c in chunks):
            return k
        return 0

    def _take_run(
        self, chunks: Sequence[Any], rows: list[list[int]], offset: int, done: set[int], fed: int = 0
    ) -> set[int]:
        """Each request of `chunks` not in `done` takes the run's tokens (`rows[j][i]`, fed at positions
        `start + offset + j`; `fed`: how many positions the run fed from `offset`, if more than the rows)
        until it finishes, the positions fed past its end taken back out; finished and failed requests join
        `done` (returned)."""
        k = len(rows)
        fed = max(fed, k)
        for i, c in enumerate(chunks):
            if i in done:
                continue
            req = c.req
            taken, finished = 0, False
            try:
                while taken < k and not finished:
                    finished = req.accept(None, rows[taken][i])
                    taken += 1
                req.computed = c.start + offset + taken
                if finished and taken < fed:
                    self.executor.discard(req, req.computed)
            except Exception as exc:  # a processor, the on_token callback, or the rewind
                self._fail(req, exc)
                done.add(i)
                continue
            if finished:
                self._finish(req)
                done.add(i)
        return done

    @staticmethod
    def _drafts_ready(chunks: Sequence[Any], done: set[int], unread: int) -> bool:
        """Whether to stop a chain of runs (the run just read taken, `unread` steps launched behind it) so
        that `step` verifies drafts: a speculating request of the run, not in `done`, that will still have room
        for a draft once it has taken the launched steps' tokens, asks for it (`DraftControl.stop_chain`)."""
        for i, c in enumerate(chunks):
            r = c.req
            if i in done or r.drafts is None or not r.drafts.active(len(chunks)):
                continue
            left = min(r.max_new_tokens - len(r.output), r.context_length - r.num_tokens) - unread
            if left >= 2 and r.drafts.stop_chain(r.prompt, r.output):  # a sample and at least one draft
                return True
        return False

    def settle(self) -> None:
        """Wait for the device work launched past requests that already finished (`_trailing`: a run of
        decode steps nobody reads; its steps wrote keys only past their contexts, and anything launched after
        it is ordered behind it on the device). Every step does this first, and `close` too; a benchmark
        calls it before timing a request, so that the request does not pay for the previous one's tail.
        Safe from any thread."""
        with self._kv_lock:
            run, self._trailing = self._trailing, None
            self._drain(run)

    def _drain(self, run: Any) -> None:
        """Wait for a launched run whose tokens nobody takes (its positions lie past every context)."""
        if run is not None:
            with contextlib.suppress(Exception):  # already failing: the caller reports the first error
                self.executor.collect_decodes(run)

    def _verify(self, c: Any, rows: Any) -> None:
        """A decode step that fed drafts: sample its rows as plain decoding would, keep the drafts up to
        the first that differs from its sample, and take the rest back out of the cache."""
        req = c.req
        try:
            finished, taken = req.accept_drafted(rows, c.draft)
        except Exception as exc:  # a processor or the on_token callback
            self._fail(req, exc)
            return
        req.drafts.update(len(c.draft), taken - 1, len(req.output))
        req.computed = c.start + taken  # the fed tokens the samples confirmed
        if taken < len(c.draft) + 1:
            try:
                self.executor.discard(req, req.computed)
            except Exception as exc:
                self._fail(req, exc)
                return
        if finished:
            self._finish(req)

    @staticmethod
    def _sample(chunks: Sequence[Any], outs: Sequence[Any], rows: Sequence[int]) -> dict[int, Any]:
        """The chosen token of each row in `rows` (indices into `chunks`), or the exception its processors
        raised (that request alone fails)."""
        ok: list[int] = []
        picked: dict[int, Any] = {}
        for i in rows:
            sampler = chunks[i].req.sampler
            if sampler.needs_processing:
                try:
                    outs_i = sampler.process(outs[i])
                except Exception as exc:
                    picked[i] = exc
                    continue
                picked[i] = outs_i  # processed logits, chosen below
            ok.append(i)
        logits = [picked.get(i, outs[i]) for i in ok]
        tokens = sample_rows([chunks[i].req.sampler for i in ok], logits, processed=True)
        picked.update(zip(ok, tokens, strict=True))
        return picked

    def _finish(self, req: Request) -> None:
        self.scheduler.remove(req)
        try:
            req.kept = self.executor.finish(req)
        except Exception as exc:
            self._fail(req, exc)
            return
        self.executor.drop(req.held)
        req.held = None
        req.status = Status.FINISHED
        req.t_done = time.perf_counter()
        self._completed += 1
        req.done.set()

    def _fail(self, req: Request, exc: BaseException) -> None:
        self.scheduler.remove(req)
        self.executor.release(req)
        self.executor.drop(req.held)
        req.held = None
        req.error = exc
        req.status = Status.FINISHED
        req.t_done = time.perf_counter()
        self._completed += 1
        req.done.set()

    def _unstick(self) -> None:
        """Nothing runs and the first waiting request cannot get KV: first let every session's pinned
        context go (they become evictable); if that was done already, the request cannot fit at all."""
        if self._stuck == 0:
            self._stuck = 1
            self.registry.evict_all()
            self._default_session.evict()
            return
        req = self.scheduler.waiting[0]
        cap = getattr(self.executor, "capacity_tokens", 0)
        self._fail(
            req,
            DeviceOutOfMemory(
                f"the KV pool holds {cap} tokens and cannot hold this request's {req.num_tokens}: load the model "
                f"with a larger kv_bytes, or send a shorter prompt"
            ),
        )

    # --- KV state kept by sessions -----------------------------------------------------------

    def drop_state(self, state: Any) -> None:
        """Let go of a session's retained state (its decoder back to the pool, or its pin)."""
        if state is not None:
            with self._kv_lock:
                self.executor.drop(state)

    def state_bytes(self, state: Any) -> int:
        return self.executor.state_bytes(state) if state is not None else 0

    def kv_stats(self) -> dict[str, Any]:
        """KV and scheduling numbers now: running and waiting requests, preemptions, and for paged KV the
        pool's pages (total, free, used, indexed, shared), pinned sessions and prefix-cache hits."""
        with self._kv_lock:
            out: dict[str, Any] = {
                "paged": self.paged,
                "running": len(self.scheduler.running),
                "waiting": self.scheduler.num_waiting(),
                "preemptions": self.scheduler.preemptions,
            }
            out.update(self.executor.stats())
        return out

    def tool_processor(
        self,
        tools: Sequence[Mapping[str, Any]] | None,
        choice: str | Mapping[str, Any] | None,
        parallel: bool,
    ) -> LogitsProcessor | None:
        """The llguidance constraint of a request's tool choice (None: no tools, or "none")."""
        from onnxgen.text import tools as tool_text

        if choice is not None and not isinstance(choice, (str, Mapping)):
            raise InvalidRequest(
                "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', ...}",
                field="tool_choice",
            )
        funcs = tool_text.function_specs(tools)
        if isinstance(choice, str) and choice not in tool_text.TOOL_CHOICES:
            raise InvalidRequest(
                f"tool_choice must be one of {', '.join(tool_text.TOOL_CHOICES)} or a named "
                f"function, got {choice!r}",
                field="tool_choice",
            )
        if not funcs:
            if choice not in (None, "none"):
                raise InvalidRequest(
                    f"tool_choice {choice!r} needs a non-empty tools list", field="tool_choice"
                )
            return None
        if choice == "none":
            return None
        required = choice == "required"
        if isinstance(choice, Mapping):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, Mapping) else None
            match = [f for f in funcs if f["name"] == name]
            if choice.get("type", "function") != "function" or not match:
                raise InvalidRequest(
                    f"tool_choice names {name!r}, which is not among the tools "
                    f"({', '.join(f['name'] for f in funcs)})",
                    field="tool_choice",
                )
            funcs, required = match, True
        from onnxgen.sampling.grammar import GrammarCompiler

        grammar = self.tool_format.lark(funcs, required=required, parallel=bool(parallel))
        return GrammarCompiler.for_model(self).processor("lark", grammar)

    def _check_inputs(self, inputs: Mapping[str, Any] | None) -> None:
        if inputs is None:
            return
        if not isinstance(inputs, Mapping):
            raise InvalidRequest(
                "inputs must be a mapping of graph input name to array or bytes", field="inputs"
            )
        known = {i.name for i in self.spec.extra_inputs}
        for name in inputs:
            if name not in known:
                raise InvalidRequest(
                    f"the graph has no extra input {name!r}; it accepts: {', '.join(sorted(known)) or 'none'}",
                    field="inputs",
                )

    def close(self) -> None:
        """Free the device memory of every cache this engine holds: retained sessions (they stay
        usable and reuse nothing next time), idle pooled decoders or the unpinned pages of the index. The weights go when the
        last engine of the package is dropped."""
        self._default_session.evict()
        self.registry.evict_all()
        with self._kv_lock:
            self.settle()
            self.executor.close()

    # --- what a server reads (public, read-only) -------------------------------------------------

    def retained_kv_bytes(self) -> int:
        """Bytes of KV cache this engine's sessions retain now (the default session included). Read-only,
        safe from any thread; a gauge for servers and monitoring."""
        return self.registry.total_kv_bytes()


class Pending:
    """A submitted request: `result()` waits for it (driving the engine's steps when no other thread is)."""

    def __init__(self, engine: Engine, req: Request, t0: float, tools: Any, tool_choice: Any) -> None:
        self.engine, self.request = engine, req
        self._t0, self._tools, self._tool_choice = t0, tools, tool_choice

    def done(self) -> bool:
        return self.request.done.is_set()

    def result(self) -> Result:
        """The finished request's `Result`; raises what it failed with (`Cancelled`, a backend error...)."""
        self.engine._drive(self.request)
        if self.request.error is not None:
            raise self.request.error
        return self.engine._result(self.request, self._t0, self._tools, self._tool_choice)
