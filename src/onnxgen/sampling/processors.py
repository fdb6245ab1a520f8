"""Logits processors beyond the built-in penalties: logit bias and logprob recording.

A processor is a callable `(logits, generated_ids) -> logits` (see `LogitsProcessor`), called by
`Sampler.process` after the penalties, in list order, once per step, with numpy arrays or torch
tensors (torch work stays on the tensor's device). `generated_ids` holds the tokens sampled so
far in this request, so a processor learns step k's chosen token at step k + 1.

Processors here hold per-request state; an empty `generated_ids` (a new request) resets them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxgen.errors import InvalidRequest


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


class LogitBias:
    """Adds a fixed bias to chosen token ids (OpenAI `logit_bias`: ids → bias in [-100, 100]).

    -100 effectively bans a token and +100 effectively forces it, as in the OpenAI API.
    """

    def __init__(self, bias: Mapping[int, float], vocab_size: int) -> None:
        ids: list[int] = []
        vals: list[float] = []
        for k, v in bias.items():
            try:
                tok = int(k)
                val = float(v)
            except (TypeError, ValueError) as exc:
                raise InvalidRequest(
                    f"logit_bias maps token ids to numbers, got {k!r}: {v!r}", field="logit_bias"
                ) from exc
            if not 0 <= tok < vocab_size:
                raise InvalidRequest(
                    f"logit_bias token id {tok} is outside [0, {vocab_size})", field="logit_bias"
                )
            if not -100.0 <= val <= 100.0:
                raise InvalidRequest(
                    f"logit_bias values must be in [-100, 100], got {val}", field="logit_bias"
                )
            ids.append(tok)
            vals.append(val)
        self._ids = np.asarray(ids, dtype=np.int64)
        self._vals = np.asarray(vals, dtype=np.float32)
        self._dev: Any = None
        self._t: tuple[Any, Any] | None = None

    def __call__(self, logits: Any, generated: Sequence[int]) -> Any:
        if self._ids.size == 0:
            return logits
        if _is_torch(logits):
            import torch

            if self._t is None or self._dev != logits.device:
                self._dev = logits.device
                self._t = (
                    torch.from_numpy(self._ids).to(logits.device),
                    torch.from_numpy(self._vals).to(logits.device),
                )
            idx, vals = self._t
            logits[idx] += vals.to(logits.dtype)
            return logits
        np.add.at(logits, self._ids, self._vals)
        return logits


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id, its log-probability and the `top` most likely alternatives
    (id, logprob) at that step, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = field(default=())


class LogprobsRecorder:
    """Records each step's log-probability distribution (log-softmax of the logits it receives,
    i.e. after the penalties and any processor placed before it; before temperature and any
    constraint placed after it) and, once the chosen token is known, its logprob and the `top`
    alternatives.

    The sampler reports each chosen token through `accept`, so step k's entry exists before its text
    is streamed. Without a sampler (a processor called directly), step k resolves at step k + 1 from
    `generated`, and `finish(tokens)` resolves the last. `entries` grows in generation order and may be
    read from another thread (appends only).
    """

    def __init__(self, top: int = 0) -> None:
        if not 0 <= top <= 20:
            raise InvalidRequest(f"top_logprobs must be in [0, 20], got {top}", field="top_logprobs")
        self.top = top
        self.entries: list[TokenLogprob] = []
        self._pending: tuple[Any, tuple[tuple[int, float], ...]] | None = None

    def _resolve(self, token: int) -> None:
        assert self._pending is not None
        lp, top = self._pending
        self._pending = None
        self.entries.append(TokenLogprob(int(token), float(lp[int(token)]), top))

    def accept(self, token: int) -> None:
        """The token chosen at the step last seen: record its entry now."""
        if self._pending is not None:
            self._resolve(token)

    def __call__(self, logits: Any, generated: Sequence[int]) -> Any:
        if not generated:
            self.entries = []
            self._pending = None
        elif self._pending is not None and len(generated) > len(self.entries):
            self._resolve(generated[len(self.entries)])
        if _is_torch(logits):
            import torch

            lp = torch.log_softmax(logits.float(), dim=-1)
            top: tuple[tuple[int, float], ...] = ()
            if self.top:
                vals, idx = torch.topk(lp, self.top)
                top = tuple(zip(idx.tolist(), vals.tolist(), strict=True))
        else:
            x = np.asarray(logits, dtype=np.float32)
            m = np.max(x)
            lp = x - (m + np.log(np.sum(np.exp(x - m))))
            top = ()
            if self.top:
                idx = np.argpartition(-lp, self.top - 1)[: self.top]
                idx = idx[np.argsort(-lp[idx], kind="stable")]
                top = tuple((int(i), float(lp[i])) for i in idx)
        self._pending = (lp, top)
        return logits

    def finish(self, tokens: Sequence[int]) -> list[TokenLogprob]:
        """Resolve the last step with the request's generated `tokens`; returns `entries`."""
        if self._pending is not None and len(tokens) > len(self.entries):
            self._resolve(tokens[len(self.entries)])
        return self.entries
