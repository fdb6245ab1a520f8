"""What the batched runner can batch, and how a step's rows are computed: `batchable(program, spec)` (a
package runs ragged batches over the paged pool, or the reason it cannot) and `computes_rowwise(step)` (a
step that verifies drafts computes each row as a one-token step would)."""

from __future__ import annotations

from typing import Any

from onnxgen.backends.batch import BatchStep
from onnxgen.backends.native.kernels.linear import ROWWISE_ROWS
from onnxgen.backends.native.lowering import Program


def computes_rowwise(step: BatchStep, enabled: bool = True) -> bool:
    """Whether `step` verifies drafts and so computes every token exactly as a one-token step would
    (`RunCtx.rowwise`): each chunk wants the logits of all its tokens, some chunk has several, and the rows
    are few enough for rowwise products (`kernels.linear.ROWWISE_ROWS`). Such rows are the same bits as plain
    decoding's on a Triton device, so speculative decoding returns plain greedy decoding's tokens there.
    `enabled`: the runner's `ONNXGEN_ROWWISE` (off: verify steps run as ordinary chunks)."""
    n = step.num_tokens
    return (
        enabled and len(step.seqs) < n <= ROWWISE_ROWS and all(s.logits == len(s.tokens) for s in step.seqs)
    )


def batchable(program: Program, spec: Any) -> str | None:
    """None when the package can run ragged batches over a paged pool, else the reason it cannot."""
    if not program.static_ok:
        return "its attention is not one fused op per layer (KV concatenated in the graph)"
    if program.uses_attention_mask:
        return "the graph reads its attention mask beyond the KV lengths"
    if spec.extra_inputs:
        return f"the graph takes extra inputs ({', '.join(i.name for i in spec.extra_inputs)})"
    return None
