"""A synthetic burst at load, so that users' first requests do not pay for first uses.

A fresh engine on CUDA meets many things once: Triton kernels compiled per specialization (batch sizes,
lengths' divisibility, greedy or sampled), per-shape kernel choices timed (`kernels.autotune`), verify
graphs captured the first time a draft length is seen, the caching allocator's first blocks. A real burst
would wait for all of them. `warm_up` runs requests shaped like a burst through the engine's own path —
one request alone that drafts (prompt lookup over a repetitive prompt), one sampled, then bursts of
growing size with prompts of assorted lengths, half greedy and half sampled — before the model is handed
out. Every request runs with `reuse=False`: nothing is read from or written to any cache, the prefix
index's counters stay at zero, and every page goes back to the pool (checked).

    report = warm_up(model)         # what `onnxgen.load` does where `ModelConfig.warmup_for` says so
    report.requests, report.seconds
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onnxgen.engine.model import Model

log = logging.getLogger(__name__)

BURSTS = (2, 4, 8, 16, 32, 64)  # burst sizes warmed (those up to `max_running`, and `max_running` itself)
LONGEST = 320  # the longest warm-up prompt: several prefill chunk sizes, lengths of every divisibility


@dataclass(frozen=True)
class WarmupReport:
    """What a warm-up ran: requests, tokens generated, wall seconds."""

    requests: int
    tokens: int
    seconds: float


def burst_sizes(max_running: int) -> list[int]:
    """The burst sizes a warm-up runs for an engine of `max_running` requests at once."""
    return sorted({b for b in BURSTS if b < max_running} | {max_running})


def warm_up(model: Model, *, longest: int = LONGEST, seed: int = 0) -> WarmupReport:
    """Run a burst of synthetic requests through `model` and wait for them (see the module doc). Prompts are
    random token ids below the vocabulary's first tenth (ordinary tokens; never a vision package's image
    placeholder), at most `longest` long and within the context; every request runs `reuse=False`. Raises
    what a request raised."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    spec = model.spec
    vocab = max(2, min(spec.vocab_size // 10, 32000))
    room = max(1, spec.context_length // 2)
    longest = max(1, min(longest, room))
    new = 2 * max(1, model.config.decoding.steps_for(model.device == "cuda", model.paged)) + 1
    new = max(1, min(new, spec.context_length - longest))
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 1}
    tokens = requests = 0
    before = model.kv_stats()

    placeholder = spec.multimodal.image_token_id if spec.multimodal is not None else None

    def ids(n: int) -> list[int]:  # never an image placeholder: a prompt holding one needs its image
        out: list[int] = []
        while len(out) < n:
            t = rng.randrange(1, vocab)
            if t != placeholder:
                out.append(t)
        return out

    # alone: a repetitive prompt drafts (prompt lookup) and verifies; then a sampled one
    pattern = ids(min(16, longest))
    alone = [
        ((pattern * (longest // len(pattern) + 1))[:longest], {"max_new_tokens": max(new, 24)}),
        (ids(rng.randint(1, longest)), {"max_new_tokens": new, **sampled}),
    ]
    for prompt, opts in alone:
        r = model.generate(prompt, reuse=False, **opts)  # type: ignore[arg-type]
        tokens += len(r.tokens)
        requests += 1
    for b in burst_sizes(model.max_running):
        handles = [
            model.submit(
                ids(rng.randint(1, longest)),
                reuse=False,
                max_new_tokens=new,
                **(sampled if i % 2 else {}),  # type: ignore[arg-type]
            )
            for i in range(b)
        ]
        for h in handles:
            tokens += len(h.result().tokens)
        requests += b
    model.settle()
    after = model.kv_stats()
    for key in ("pages_used", "prefix_lookups", "retained_kv_bytes"):
        assert after.get(key) == before.get(key), (key, before.get(key), after.get(key))
    report = WarmupReport(requests, tokens, time.perf_counter() - t0)
    log.info("warm-up: %d requests, %d tokens in %.1f s", report.requests, tokens, report.seconds)
    return report
