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


_TOP_P_WINDOW = 256


def _top_p_numpy(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Zero all but the smallest set of most likely tokens whose mass reaches `top_p` of the total.

    Sorts only a partial selection of the top `_TOP_P_WINDOW` (enough for almost every real, peaked
    distribution); when the window's mass falls short (a flat distribution) it bisects on the
    probability threshold instead of sorting the whole vocabulary (O(V) per step, about 30 steps).
    """
    target = top_p * probs.sum()
    n = probs.shape[0]
    cand = np.argpartition(-probs, _TOP_P_WINDOW)[:_TOP_P_WINDOW] if n > _TOP_P_WINDOW else np.arange(n)
    order = cand[np.argsort(-probs[cand], kind="stable")]
    cum = np.cumsum(probs[order])
    if cum[-1] >= target:
        cut = int(np.searchsorted(cum, target)) + 1
        keep = np.zeros_like(probs)
        keep[order[:cut]] = probs[order[:cut]]
        return keep
    lo, hi = 0.0, float(probs[order[-1]])  # the answer's threshold is below the window's smallest
    for _ in range(40):  # largest threshold t with mass(probs >= t) >= target
        mid = (lo + hi) / 2
        if probs[probs >= mid].sum() >= target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= hi * 1e-7:
            break
    return np.where(probs >= lo, probs, 0.0).astype(probs.dtype)


class Sampler:
    """Per-request sampler: owns the RNG and the penalty bookkeeping. Not shared across requests."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int] = (),
        processors: Sequence[LogitsProcessor] = (),
    ) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self._seed = seed & 0xFFFF_FFFF_FFFF_FFFF
        self._np_rng = np.random.default_rng(self._seed)
        self._torch_gen: Any = None
        self._seen = set(prompt_ids) if params.repetition_penalty != 1.0 else set()
        self._counts: Counter[int] = Counter()
        self._generated: list[int] = []
        self._processors = list(processors)

    @property
    def plain_greedy(self) -> bool:
        """True when the choice is the argmax of the raw logits (greedy, no penalties, no processors), so
        a batch of such requests can pick their tokens in one device call (`batch_argmax`)."""
        return self.params.greedy and not self.params.has_penalties and not self._processors

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
        """Pick a token from processed logits (greedy or stochastic, per the params)."""
        p = self.params
        if _is_torch(logits):
            return self._choose_torch(logits)
        if p.greedy:
            return int(np.argmax(logits))
        x = logits / p.temperature
        x = x - np.max(x)
        if p.top_k and p.top_k < x.shape[0]:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x = np.where(x < kth, -np.inf, x)
        probs = np.exp(x)
        probs /= probs.sum()
        if p.min_p > 0.0:
            probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
        if p.top_p < 1.0:
            probs = _top_p_numpy(probs, p.top_p)
        probs = probs / probs.sum()
        return int(np.searchsorted(np.cumsum(probs), self._np_rng.random() * 1.0, side="right").clip(0, probs.size - 1))

    def _choose_torch(self, logits: Any) -> int:
        import torch

        p = self.params
        if p.greedy:
            return int(torch.argmax(logits).item())
        if self._torch_gen is None:
            self._torch_gen = torch.Generator(device=logits.device)
            self._torch_gen.manual_seed(self._seed)
        x = logits.float() / p.temperature
        if p.top_k and p.top_k < x.shape[0]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
        probs = torch.softmax(x, dim=-1)
        if p.min_p > 0.0:
            probs = torch.where(probs < p.min_p * probs.max(), torch.zeros_like(probs), probs)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True, stable=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = (cum - sorted_p) >= p.top_p * cum[-1]
            sorted_p = torch.where(drop, torch.zeros_like(sorted_p), sorted_p)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self._torch_gen).item())

    def sample(self, logits: Any) -> int:
        """process + choose + accept: the whole step. Returns the token id."""
        token = self.choose(self.process(logits))
        self.accept(token)
        return token


def batch_argmax(rows: Sequence[Any]) -> list[int]:
    """The argmax of each logits row (numpy arrays or torch tensors of one device), in one device call and
    one host transfer for torch: the choice of every `plain_greedy` sampler of a step."""
    if not rows:
        return []
    if _is_torch(rows[0]):
        import torch

        return torch.stack(list(rows)).argmax(-1).tolist()
    return [int(np.argmax(r)) for r in rows]
