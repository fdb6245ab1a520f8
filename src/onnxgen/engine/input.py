"""Input processing: a prompt and its options become a `Prepared` request, checked and encoded once.

    prepared = inputs.prepare(messages, max_new_tokens=64, tools=[...])   # any thread; raises InvalidRequest
    ids = inputs.rebase(prepared, session_history)                         # against a session's last context
    req = inputs.request(prepared, ids, owner=..., held=..., drafts=...)   # the engine's record

Everything that can be wrong with a request is found by `prepare`, before it is queued (so a server answers
400 before it streams): the prompt (text, chat messages or token ids; vocabulary, context length), the
sampling settings, stop strings, extra graph inputs, the tool choice (its llguidance grammar compiled here,
once) and the speculation mode. A server prepares a request once and submits that (the engine does not
encode it again).

A chat prompt keeps its rendered text: a session whose last context (the ids an earlier turn ran on and the
reply it generated) the new ids do not start with re-encodes it keeping those ids where the text spells them
(`rebase`; `Tokenizer.encode_after`), since a reply's text does not always re-tokenize into the ids that were
sampled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxgen.engine import images as image_inputs
from onnxgen.engine import reuse as reuse_policy
from onnxgen.engine.drafts import MODES as DRAFT_MODES
from onnxgen.engine.identity import Identity, make_identity
from onnxgen.engine.request import Request
from onnxgen.errors import ContextOverflow, EmptyPrompt, InvalidRequest
from onnxgen.package.attachments import IMAGES, ImageInput, key_images, unkey
from onnxgen.package.spec import ModelSpec
from onnxgen.sampling import LogitsProcessor, Sampler, SamplingParams

Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int]
SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


def _all_ints(seq: Sequence[Any]) -> bool:
    """True when every element is a plain int (bool excluded); fast for long lists of ids."""
    return set(map(type, seq)) <= {int}


@dataclass(frozen=True)
class Prepared:
    """A request checked and encoded, ready to submit — once: its processors (grammar, logprobs) keep state
    for one generation. `ids`: the prompt's token ids; `text`: the chat text they encode (None for raw text
    and ids). `params`: the sampling settings, the package's defaults applied. `tool_marker`: how a tool
    call starts in this model's format ("" when the request parses no tools), for a stream to hold back.
    `t0`: when preparation began (time to first token counts from here). `images`: the prompt's images, in
    order (a vision package's; `ids` then hold their keys, `text` their placeholders expanded: see
    `package/attachments.py`)."""

    ids: tuple[int, ...]
    text: str | None
    params: SamplingParams
    processors: tuple[LogitsProcessor, ...]
    max_new_tokens: int
    stop: tuple[str, ...]
    output_logits: bool
    reuse: bool
    inputs: Mapping[str, Any] | None
    speculative: str | bool | None
    tools: tuple[Mapping[str, Any], ...] | None
    tool_choice: str | Mapping[str, Any] | None
    tool_marker: str
    salt: str | None
    t0: float
    images: tuple[ImageInput, ...] = ()


class InputProcessor:
    """Prompts -> prepared requests -> engine records, for one loaded package. Thread-safe (holds no
    per-request state)."""

    def __init__(
        self,
        spec: ModelSpec,
        tokenizer: Any,
        chat_template: Any,
        tool_format: Any,
        *,
        package_key: str,
        eos_ids: tuple[int, ...],
        max_new_tokens: int,
    ) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tool_format = tool_format
        self.package_key = package_key
        self.eos_ids = eos_ids
        self.max_new_tokens = max_new_tokens
        mm = spec.multimodal
        self.images = image_inputs.ImageInputs(mm.processor) if mm is not None else None

    # --- prompts -------------------------------------------------------------------------------------

    def encode(
        self,
        prompt: Prompt,
        history: Sequence[int] = (),
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a prompt: raw text, chat messages or ids (validated); see `_encode`."""
        return self._encode(prompt, history, tools)[0]

    def _encode(
        self,
        prompt: Prompt,
        history: Sequence[int] = (),
        tools: Sequence[Mapping[str, Any]] | None = None,
        images: Sequence[Any] = (),
    ) -> tuple[list[int], str | None, tuple[ImageInput, ...]]:
        """(ids, chat text or None, images). `history`: ids a session's cache holds; chat messages whose
        rendering starts with exactly the text of a prefix of it keep that prefix as it is (`rebase`). `tools`:
        OpenAI-style tool definitions the chat template sees (messages with `tool_calls` and `role: "tool"`
        are prepared by `onnxgen.text.tools`). `images`: image sources for the prompt's placeholders (after
        those of its image content parts; `engine/images.py`). Raises `InvalidRequest`, `EmptyPrompt`,
        `ContextOverflow`, `MissingRequiredInput` (an image placeholder without its image)."""
        text = None
        sources = list(images or ())
        if isinstance(prompt, str):
            if tools:
                raise InvalidRequest(
                    "tools need a chat prompt (a list of messages), not raw text", field="tools"
                )
            ids, imgs, _ = self._text_ids(prompt, sources, add_special=True) if prompt else ([], (), "")
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt):
            if self.chat_template is None:
                raise InvalidRequest(
                    f"{self.spec.path}: the package has no chat template; pass raw text or token ids "
                    "(or add chat_template.jinja to the package)",
                    field="prompt",
                )
            from onnxgen.text import tools as tool_text

            prompt, sources = image_inputs.split_messages(prompt, sources)
            if sources:
                self._vision()  # a text-only package refuses images before its template sees them
            funcs = tool_text.function_specs(tools)
            messages = tool_text.prepare_messages(prompt, self.tool_format, self.chat_template.source, funcs)
            text = self.chat_template.render(
                messages, add_generation_prompt=True, tools=list(tools) if tools else None
            )
            ids, imgs, text = self._text_ids(text, sources, add_special=False)
            ids = self._keep_keyed(ids, text, history, imgs)
        elif isinstance(prompt, Sequence) and _all_ints(prompt):
            if tools:
                raise InvalidRequest(
                    "tools need a chat prompt (a list of messages), not token ids", field="tools"
                )
            ids = list(prompt)
            self._check_ids(ids)
            imgs = ()
            mm = self.spec.multimodal
            if sources or (mm is not None and mm.image_token_id in ids):  # placeholders need their images
                mm = self._vision()
                imgs = tuple(self.images.prepare(s) for s in sources)  # type: ignore[union-attr]
                ids = image_inputs.expand_ids(ids, mm.image_token_id, imgs, mm.vision.pixel_values)
                ids = key_images(ids, mm.image_token_id, imgs)
        else:
            raise InvalidRequest(
                "prompt must be a string, a list of {'role', 'content'} messages, or a list of token ids",
                field="prompt",
            )
        if not ids:
            raise EmptyPrompt()
        self._check_length(ids)
        return ids, text, imgs

    # --- images --------------------------------------------------------------------------------------------

    def _vision(self) -> Any:
        if self.spec.multimodal is None:
            raise InvalidRequest(
                f"{self.spec.path}: the package has no vision part; it cannot take images", field="images"
            )
        return self.spec.multimodal

    def _pad(self) -> str:
        mm = self._vision()
        pad = self.tokenizer.id_to_token(mm.image_token_id)
        assert pad is not None, "the image token is not in the tokenizer's vocabulary"
        return pad

    def _text_ids(
        self, text: str, sources: list[Any], add_special: bool
    ) -> tuple[list[int], tuple[ImageInput, ...], str]:
        """(ids, images, text): each image placeholder of a vision package's `text` expanded to its image's
        tokens, their ids keyed (`package/attachments.py`). Raises as `images.check_count`."""
        if self.spec.multimodal is None:
            if sources:
                self._vision()
            return self.tokenizer.encode(text, add_special_tokens=add_special), (), text
        mm, pad = self.spec.multimodal, self._pad()
        given = [s for s in sources if s is not None]  # None: an image part without its image
        image_inputs.check_count(text.count(pad), len(given), mm.vision.pixel_values)
        imgs = tuple(self.images.prepare(s) for s in given)  # type: ignore[union-attr]
        if not imgs:
            return self.tokenizer.encode(text, add_special_tokens=add_special), (), text
        text = image_inputs.expand_text(text, pad, imgs)
        ids = self.tokenizer.encode(text, add_special_tokens=add_special)
        return key_images(ids, mm.image_token_id, imgs), imgs, text

    def _keep_keyed(
        self, ids: list[int], text: str, history: Sequence[int], imgs: Sequence[ImageInput]
    ) -> list[int]:
        """`_keep_history` for ids that may hold image keys: kept on the placeholder ids, keyed again."""
        if not imgs:
            return self._keep_history(ids, text, history)
        pad_id = self.spec.multimodal.image_token_id  # type: ignore[union-attr]
        kept = self._keep_history(unkey(ids, pad_id), text, unkey(history, pad_id))
        try:
            return key_images(kept, pad_id, imgs)
        except ValueError:  # the kept ids split an image differently: keep the plain encoding
            return ids

    def _check_ids(self, ids: list[int]) -> None:
        # NOTE: vectorised: prompts may hold many thousand ids
        vocab = self.spec.vocab_size
        try:
            arr = np.asarray(ids, dtype=np.int64)
        except OverflowError:  # an id beyond int64
            big = str(next(i for i in ids if not -(2**63) <= i < 2**63))
            big = big if len(big) <= 24 else f"{big[:12]}...({len(big)} digits)"
            raise InvalidRequest(
                f"token id {big} is outside the vocabulary [0, {vocab})", field="prompt"
            ) from None
        if arr.size and (arr.min() < 0 or arr.max() >= vocab):
            bad = int(arr[(arr < 0) | (arr >= vocab)][0])
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", field="prompt")

    def _check_length(self, ids: Sequence[int]) -> None:
        if len(ids) >= self.spec.context_length:
            raise ContextOverflow(len(ids), self.spec.context_length)

    def _keep_history(self, ids: list[int], text: str, history: Sequence[int]) -> list[int]:
        """`ids` (the plain encoding of chat `text`), or the encoding that keeps more of `history` where the
        text spells it (`Tokenizer.encode_after`)."""
        if history and reuse_policy.common_prefix(ids, history) < len(history):
            kept = self.tokenizer.encode_after(text, history)
            if reuse_policy.common_prefix(kept, history) > reuse_policy.common_prefix(ids, history):
                return kept
        return ids

    def rebase(self, prepared: Prepared, history: Sequence[int]) -> list[int]:
        """The ids `prepared` runs on in a session whose last context is `history`: its own ids, or for a chat
        prompt the encoding that keeps `history`'s ids where the text spells them. Raises `ContextOverflow`."""
        ids = list(prepared.ids)
        if prepared.text is None or not history:
            return ids
        ids = self._keep_keyed(ids, prepared.text, history, prepared.images)
        self._check_length(ids)
        return ids

    # --- options ---------------------------------------------------------------------------------------

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
                f"tool_choice must be one of {', '.join(tool_text.TOOL_CHOICES)} or a named function, got {choice!r}",
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
        compiler = GrammarCompiler.for_tokenizer(self.tokenizer, self.spec.vocab_size, self.eos_ids)
        return compiler.processor("lark", grammar)

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

    def prepare(
        self,
        prompt: Prompt,
        *,
        params: SamplingParams | None = None,
        max_new_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        output_logits: bool = False,
        reuse: bool = True,
        inputs: Mapping[str, Any] | None = None,
        processors: Sequence[LogitsProcessor] = (),
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        speculative: str | bool | None = None,
        salt: str | None = None,
        images: Sequence[Any] | None = None,
        **sampling: Any,
    ) -> Prepared:
        """Check and encode one request (see the module doc). `params` or the sampling keywords
        (temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, seed;
        None: not given, the package's defaults apply), not both. Raises `InvalidRequest` naming the field."""
        t0 = time.perf_counter()
        if images is not None and (isinstance(images, str | bytes) or not isinstance(images, Sequence)):
            raise InvalidRequest("images must be a list of images", field="images")
        ids, text, imgs = self._encode(prompt, (), tools, images or ())
        tool_grammar = self.tool_processor(tools, tool_choice, parallel_tool_calls)
        procs = tuple(processors) + ((tool_grammar,) if tool_grammar is not None else ())
        if max_new_tokens is None:
            max_new_tokens = self.max_new_tokens
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise InvalidRequest(
                f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}", field="max_new_tokens"
            )
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) for s in stops):
            raise InvalidRequest("stop must be a string or a list of strings", field="stop")
        if params is not None:
            if not isinstance(params, SamplingParams):
                raise InvalidRequest("params must be an onnxgen.SamplingParams", field="params")
            if any(v is not None for v in sampling.values()):
                raise InvalidRequest("give params or sampling keywords, not both", field="params")
        else:
            try:
                params = SamplingParams.resolve(self.spec.search, **sampling)
            except TypeError as exc:  # an unknown keyword argument
                raise InvalidRequest(f"unknown generate() argument: {exc}", field="sampling") from exc
        self._check_inputs(inputs)
        if salt is not None and not isinstance(salt, str):
            raise InvalidRequest("salt must be a string", field="salt")
        if speculative not in (None, True, False, "off", *DRAFT_MODES):
            raise InvalidRequest(
                f"speculative must be one of {[*DRAFT_MODES, 'off']} or None, got {speculative!r}",
                field="speculative",
            )
        parses = bool(tools) and tool_choice != "none"
        return Prepared(
            ids=tuple(ids),
            text=text,
            params=params,
            processors=procs,
            max_new_tokens=max_new_tokens,
            stop=tuple(stops),
            output_logits=bool(output_logits),
            reuse=bool(reuse),
            inputs=inputs,
            speculative=speculative,
            tools=tuple(tools) if tools else None,
            tool_choice=tool_choice,
            tool_marker=self.tool_format.marker if parses else "",
            salt=salt,
            t0=t0,
            images=imgs,
        )

    # --- the engine's record ------------------------------------------------------------------------------

    def identity(self, ids: Sequence[int], salt: str | None, inputs: Any = None) -> Identity:
        """The identity of a context of `ids` (with extra graph `inputs`) under `salt`: the package's key and
        the salt digested with the inputs (`engine/identity.py`)."""
        key = self.package_key if salt is None else f"{self.package_key}|salt={salt}"
        return make_identity(ids, inputs, key)

    def request(
        self,
        prepared: Prepared,
        ids: list[int],
        *,
        owner: Any = None,
        held: Any = None,
        salt: str | None = None,
        drafts: Any = None,
        on_token: Callable[[str], Any] | None = None,
        cancel: threading.Event | None = None,
        on_done: Callable[[Request], None] | None = None,
    ) -> Request:
        """The engine's record of `prepared` running on `ids` (`rebase`'s), for `owner` holding `held`.
        `salt` (the session's, else the prepared one) is part of the identity: requests under different
        salts share no KV."""
        from onnxgen.text import IncrementalDetokenizer

        digest = self.identity(ids, salt, prepared.inputs).digest
        inputs = prepared.inputs
        text_ids: Sequence[int] = ids
        if prepared.images:  # the decoder's image pipeline reads them; sampling sees the placeholders
            inputs = {**(inputs or {}), IMAGES: prepared.images}
            text_ids = unkey(ids, self.spec.multimodal.image_token_id)  # type: ignore[union-attr]
        return Request(
            prompt=ids,
            digest=digest,
            sampler=Sampler(prepared.params, text_ids, list(prepared.processors)),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            max_new_tokens=prepared.max_new_tokens,
            context_length=self.spec.context_length,
            eos_ids=frozenset(self.eos_ids),
            stop=prepared.stop,
            inputs=inputs,
            on_token=on_token,
            output_logits=prepared.output_logits,
            cancel=cancel,
            reuse=prepared.reuse,
            chunk_size=self.spec.chunk_size,
            owner=owner,
            held=held,
            drafts=drafts,
            tools=prepared.tools,
            tool_choice=prepared.tool_choice,
            on_done=on_done,
            t_submit=prepared.t0,
        )
