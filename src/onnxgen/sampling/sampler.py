"""Turn one step's logits into a token: processors, then greedy or temperature/top-k/top-p/min-p.

Logits arrive in the backend's array type. numpy arrays are sampled with numpy; torch tensors are
sampled with torch on their own device, so a GPU backend never copies logits to the host just to
sample (only the chosen token id crosses).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from onnxgen.sampling.choice import choose_numpy, choose_rows
from onnxgen.sampling.params import SamplingParams


class LogitsProcessor(Protocol):
    """Adjusts one step's logits. Must handle numpy arrays and torch tensors (same semantics).

    `generated` are the ids sampled so far in this request. Returns the adjusted logits (may be the
    same object, modified in place).
    """

    def __call__(self, logits: Any, generated: Sequence[int]) -> Any: ...


# A processor may also define `accept(token: int) -> None`: the sampler calls it with each chosen token
# right after the choice (before the token is streamed), e.g. to attach a logprob to it at once.


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


class Sampler:
    """Per-request sampler: owns the seed and the penalty bookkeeping. Not shared across requests.

    `sample(logits)` = `process` (penalties, processors) + `choose` + `accept`. The choice is
    `onnxgen.sampling.choice`'s: greedy, or an exponential race over a hash of (seed, step, token), so a
    request's tokens depend only on its logits, seed and step, never on what it is batched with; the
    engine chooses the tokens of a whole step's requests in one call (`choose_rows`)."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int] = (),
        processors: Sequence[LogitsProcessor] = (),
    ) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.seed = seed & 0xFFFF_FFFF_FFFF_FFFF
        self._seen = set(prompt_ids) if params.repetition_penalty != 1.0 else set()
        self._counts: Counter[int] = Counter()
        self._generated: list[int] = []
        self._processors = list(processors)

    @property
    def step(self) -> int:
        """How many tokens this sampler has accepted (the counter of its random draws)."""
        return len(self._generated)

    @property
    def needs_processing(self) -> bool:
        """False when the choice reads the raw logits (no penalties, no processors)."""
        return self.params.has_penalties or bool(self._processors)

    def accept(self, token: int) -> None:
        """Record that `token` was emitted (updates penalties and processors' view)."""
        self._generated.append(token)
        for proc in self._processors:
            hook = getattr(proc, "accept", None)
            if hook is not None:
                hook(token)
        if self.params.has_penalties:
            self._counts[token] += 1
            if self.params.repetition_penalty != 1.0:
                self._seen.add(token)

    def process(self, logits: Any) -> Any:
        """Apply penalties and processors; returns float32 logits of the same array type (a copy)."""
        p = self.params
        if _is_torch(logits):
            import torch

            x = logits.float().clone()
            if p.repetition_penalty != 1.0 and self._seen:
                idx = torch.tensor(sorted(self._seen), device=x.device, dtype=torch.long)
                vals = x[idx]
                x[idx] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and self._counts:
                ids = list(self._counts)
                idx = torch.tensor(ids, device=x.device, dtype=torch.long)
                cnt = torch.tensor([self._counts[i] for i in ids], device=x.device, dtype=torch.float32)
                x[idx] -= p.presence_penalty + p.frequency_penalty * cnt
        else:
            x = np.array(logits, dtype=np.float32, copy=True)
            if p.repetition_penalty != 1.0 and self._seen:
                idx = np.fromiter(self._seen, dtype=np.int64)
                vals = x[idx]
                x[idx] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and self._counts:
                idx = np.fromiter(self._counts.keys(), dtype=np.int64)
                cnt = np.fromiter(self._counts.values(), dtype=np.float32)
                x[idx] -= p.presence_penalty + p.frequency_penalty * cnt
        for proc in self._processors:
            x = proc(x, self._generated)
        return x

    def choose(self, logits: Any) -> int:
        """Pick a token from processed logits (1-D, numpy or torch), per the params."""
        if _is_torch(logits):
            return choose_rows([self.params], [self.seed], [self.step], logits.reshape(1, -1))[0]
        return choose_numpy(self.params, self.seed, self.step, logits)

    def choose_ahead(self, rows: Any) -> list[int]:
        """The choices of `rows` (`[R, V]` raw logits) at this step and the R - 1 after it, in one call (one
        device round trip): what R `sample` calls in order would pick when none needs processing. Does not
        `accept`."""
        assert not self.needs_processing, "processed choices depend on the tokens accepted before them"
        r = len(rows)
        return choose_rows([self.params] * r, [self.seed] * r, [self.step + i for i in range(r)], rows)

    def sample(self, logits: Any) -> int:
        """process + choose + accept: the whole step. Returns the token id."""
        token = self.choose(self.process(logits) if self.needs_processing else logits)
        self.accept(token)
        return token


def sample_rows(samplers: Sequence[Sampler], rows: Sequence[Any], processed: bool = False) -> list[int]:
    """The next token of each request from its logits row (numpy or torch, one kind per call): each row
    processed by its own sampler when it needs it (unless `processed`), then every choice made together
    (`choose_rows`: one device call and one host transfer for torch). Raises what a processor raises.
    Does not `accept`."""
    if not rows:
        return []
    if not processed:
        rows = [s.process(r) if s.needs_processing else r for s, r in zip(samplers, rows, strict=True)]
    if _is_torch(rows[0]):
        import torch

        stacked = torch.stack([r.reshape(-1).float() for r in rows])
    else:
        stacked = np.stack([np.asarray(r, dtype=np.float32).reshape(-1) for r in rows])
    return choose_rows(
        [s.params for s in samplers], [s.seed for s in samplers], [s.step for s in samplers], stacked
    )
