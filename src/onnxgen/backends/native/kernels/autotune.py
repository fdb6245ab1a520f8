"""Per-shape choices among a kernel's configurations, timed on CUDA as a decode step runs them: launches
captured in a CUDA graph (launch costs that graphs remove do not count) over copies of the weights cycled out
of the L2 (every weight of a decode step is read once, from HBM). Decisions are cached by shape key in
`CHOICES` for the life of the process; under the interpreter the first configuration is taken untimed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from onnxgen.backends.native.graphs import repair_after_failed_capture

CHOICES: dict[tuple[Any, ...], Any] = {}  # `fastest`'s decisions, by shape key (read before timing anew)
COLD_BYTES = 192 << 20  # several times the L2: weights cycled through this many bytes are read from HBM


def choose_config(
    key: tuple[Any, ...],
    x: torch.Tensor,
    w: torch.Tensor,
    configs: Sequence[Any],
    reference: Callable[[Any], Any] | None,
    candidate: Callable[[Any, Any], Any],
) -> Any:  # pragma: cuda
    """The per-shape decision of a kernel with several configurations against its reference: the cached
    choice under `key`; under the interpreter the first configuration; on CUDA `fastest` over
    `reference(weight)` (None: use the reference; no `reference`: a configuration is always chosen) and
    `candidate(weight, config)` for each of `configs`, timed over copies of the weight `w` cycled out of
    the L2."""
    if key in CHOICES:
        return CHOICES[key]
    if not x.is_cuda:
        return configs[0]
    copies = cold_copies(w)
    cands: list[tuple[Any, Any]] = [] if reference is None else [(None, lambda i: reference(copies[i]))]
    cands += [(cfg, lambda i, cfg=cfg: candidate(copies[i], cfg)) for cfg in configs]
    return fastest(key, cands, len(copies))


def cold_copies(*ts: torch.Tensor) -> list[Any]:  # pragma: cuda
    """Enough copies of the tensors `ts` (the first copy is `ts` themselves) that launches cycling through
    them find none in the L2, as in a decode step, where every weight is read once: a single tensor, or a
    tuple per copy."""
    nbytes = sum(t.numel() * t.element_size() for t in ts)
    n = max(1, min(64, -(-COLD_BYTES // max(1, nbytes))))
    one = ts[0] if len(ts) == 1 else ts
    return [one] + [(ts[0].clone() if len(ts) == 1 else tuple(t.clone() for t in ts)) for _ in range(n - 1)]


def fastest(key: tuple[Any, ...], candidates: list[tuple[Any, Any]], copies: int) -> Any:  # pragma: cuda
    """The config of the candidate whose launches take the least GPU time, cached under `key`: each
    candidate `(config, fn)` is `fn(i)` over copy `i` of its weights, `max(10, copies)` launches captured
    in one CUDA graph (launch costs that graphs remove do not count; the weights come from HBM, not the
    L2). A candidate that fails to compile or capture is skipped. When first asked during a capture
    (nothing can be timed then), or when the first candidate (the reference) cannot be timed, returns the
    first candidate's config without caching it."""
    if torch.cuda.is_current_stream_capturing():
        return candidates[0][0]
    best: tuple[float, Any] | None = None
    for i, (cfg, fn) in enumerate(candidates):
        try:
            t = graph_ms(fn, max(10, copies), copies)
        except Exception:  # not here: the reference must time, the others may fail
            if i == 0:
                return cfg
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    assert best is not None
    CHOICES[key] = best[1]
    return best[1]


def graph_ms(fn: Callable[[int], Any], launches: int, copies: int, replays: int = 5) -> float:  # pragma: cuda
    """GPU milliseconds of `launches` calls `fn(i % copies)` captured in one CUDA graph (the mean of
    `replays` replays after a warm-up replay). A failed capture is repaired before its error propagates."""
    fn(0)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for i in range(launches):
                fn(i % copies)
    except Exception:
        repair_after_failed_capture(torch.device("cuda", torch.cuda.current_device()))
        raise
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        graph.replay()
    b.record()
    b.synchronize()
    del graph
    return a.elapsed_time(b) / replays
