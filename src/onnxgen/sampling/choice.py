"""Choosing tokens from processed logits, one row or a whole batch at once, numpy or torch alike.

    tokens = choose_rows(params, steps, seeds, logits)     # logits [R, V]; one host transfer for torch

Each row has its own `SamplingParams` (greedy, temperature, top-k, top-p, min-p), its request's seed and
its step (how many tokens the request has generated). Stochastic rows are drawn by an exponential race:
the token with the largest `p / E` where `E ~ Exp(1)` is drawn independently per vocabulary entry wins
with probability exactly `p` (normalised). The noise comes from a counter-based hash of (seed, step,
token id), so a row's choice depends only on its own logits, seed and step: the same in a batch of 64 as
alone, on the CPU as on the GPU, in numpy as in torch (`tests/test_processors.py` and `test_engine.py`).

Filtering order, as before: temperature, top-k, softmax, min-p, top-p (the smallest set of most likely
tokens whose mass reaches top-p).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from onnxgen.sampling.params import SamplingParams

_M64 = (1 << 64) - 1
_STEP = 0x632BE59BD9B4E019
_TOKEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def race_noise_numpy(seed: int, step: int, n: int) -> np.ndarray:
    """`Exp(1)` draws for token ids 0..n-1 at (seed, step): splitmix64 of a counter, float64."""
    with np.errstate(over="ignore"):
        x = (
            np.uint64(seed & _M64)
            + np.uint64((step * _STEP) & _M64)
            + np.arange(n, dtype=np.uint64) * np.uint64(_TOKEN)
        )
        x ^= x >> np.uint64(30)
        x *= np.uint64(_MIX1)
        x ^= x >> np.uint64(27)
        x *= np.uint64(_MIX2)
        x ^= x >> np.uint64(31)
    u = ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    return -np.log(u)


def race_noise_torch(seeds: Any, steps: Any, n: int) -> Any:
    """The same draws as `race_noise_numpy`, for rows of (seed, step) (`[R]` int64 tensors) -> `[R, n]`
    float64, computed with wrapping int64 arithmetic (bit-identical to numpy's uint64)."""
    import torch

    dev = seeds.device
    idx = torch.arange(n, dtype=torch.int64, device=dev)
    x = seeds[:, None] + steps[:, None] * _signed(_STEP) + idx[None, :] * _signed(_TOKEN)

    def shr(v: Any, s: int) -> Any:  # logical right shift of int64 bits
        return (v >> s) & ((1 << (64 - s)) - 1)

    x = x ^ shr(x, 30)
    x = x * _signed(_MIX1)
    x = x ^ shr(x, 27)
    x = x * _signed(_MIX2)
    x = x ^ shr(x, 31)
    u = (shr(x, 11).to(torch.float64) + 0.5) * 2.0**-53
    return -torch.log(u)


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


def choose_numpy(p: SamplingParams, seed: int, step: int, logits: np.ndarray) -> int:
    """One row on the host (see the module docstring)."""
    if p.greedy:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / p.temperature
    if p.top_k and p.top_k < x.shape[0]:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x = np.where(x < kth, -np.inf, x)
    x = x - np.max(x)
    probs = np.exp(x)
    probs /= probs.sum()
    if p.min_p > 0.0:
        probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
    if p.top_p < 1.0:
        probs = _top_p_numpy(probs, p.top_p)
    return int(np.argmax(probs / race_noise_numpy(seed, step, probs.shape[0])))


def choose_rows(
    params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int], logits: Any
) -> list[int]:
    """The token of each row of `logits` (`[R, V]`, numpy or torch). torch rows are chosen together on
    their device with one transfer to the host (`RowChooser`)."""
    if not _is_torch(logits):
        return [choose_numpy(p, s, t, row) for p, s, t, row in zip(params, seeds, steps, logits, strict=True)]
    return RowChooser(params, seeds, steps, logits.device)(logits).tolist()


class RowChooser:
    """The choice of a fixed batch of rows on their torch device, as a tensor (no host transfer): per-row
    settings are uploaded once, so the same batch can choose at several consecutive steps (`offset`: how
    many tokens each row has generated since `steps`). Rows differing in their settings are filtered with
    per-row values (a top-k or top-p of 0 / 1 keeps every token)."""

    def __init__(
        self, params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int], device: Any
    ) -> None:
        import torch

        self.params = list(params)
        self.greedy = all(p.greedy for p in params)
        self._ks: Any = None
        if self.greedy:
            return
        dev = device
        f64 = torch.float64
        self.temp = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=f64, device=dev)
        self.top_k = [p.top_k for p in params]
        self.min_p = (
            torch.tensor([p.min_p for p in params], dtype=f64, device=dev)
            if any(p.min_p > 0 for p in params)
            else None
        )
        self.top_p = (
            torch.tensor([p.top_p for p in params], dtype=f64, device=dev)
            if any(p.top_p < 1 for p in params)
            else None
        )
        self.seeds = torch.tensor([_signed(s & _M64) for s in seeds], dtype=torch.int64, device=dev)
        self.steps = torch.tensor(list(steps), dtype=torch.int64, device=dev)
        self.is_greedy = torch.tensor([p.greedy for p in params], device=dev)

    def __call__(self, logits: Any, offset: int = 0) -> Any:
        """`[R]` int64 tokens on the logits' device."""
        import torch

        if self.greedy:
            return logits.argmax(-1)
        dev = logits.device
        v = logits.shape[1]
        x = logits.to(torch.float64) / self.temp[:, None]
        ks = [k if 0 < k < v else v for k in self.top_k]
        if min(ks) < v:
            if self._ks is None:  # uploaded once for the batch, not at every step of a run
                self._ks = torch.tensor(ks, device=dev)[:, None] - 1
            kth = torch.topk(x, max(ks), dim=-1).values.gather(1, self._ks)
            x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
        probs = torch.softmax(x, dim=-1)
        if self.min_p is not None:
            keep = probs >= self.min_p[:, None] * probs.amax(-1, keepdim=True)
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        if self.top_p is not None:
            sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = ((cum - sorted_p) >= self.top_p[:, None] * cum[:, -1:]) & (self.top_p[:, None] < 1)
            probs = probs.scatter(1, order, torch.where(drop, torch.zeros_like(sorted_p), sorted_p))
        noise = race_noise_torch(self.seeds, self.steps + offset, v)
        return torch.where(self.is_greedy, logits.argmax(-1), (probs / noise).argmax(-1))
