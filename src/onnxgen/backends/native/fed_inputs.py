"""`FedInputs`: the device buffers a static step (a CUDA graph) of a decoder fed embeddings reads instead of
token ids — a vision pipeline's decoder (`backends/multimodal.py`), given `inputs_embeds` `[1, n, hidden]` and
MRoPE position ids `[3, 1, n]` each forward. A forward's values are copied in before the step (its padding up
to the step size a copy of the last token's: their keys land past the valid length and are never read)."""

from __future__ import annotations

from typing import Any

import torch

from onnxgen.backends.native.device import Staging


class FedInputs:
    """Buffers for steps of up to `rows` tokens of the graph inputs at slots `embeds` and `pos` (-1: the graph
    reads no positions) on `device`; `rows` 0: the decoder takes no fed forward as a static step."""

    def __init__(
        self, spec: Any, embeds: int, pos: int, rows: int, pos_dtype: torch.dtype, staging: Staging
    ) -> None:
        """`staging`: the decoder's uploads (`device.Staging`: host positions copied without a stream sync)."""
        self.embeds, self.pos, self._staging = embeds, pos, staging
        dev = staging.device
        kind = next((io.dtype for io in spec.inputs if io.name == spec.inputs_embeds_name), None)
        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(kind or "", torch.float32)
        self._e = torch.zeros((1, rows, spec.hidden_size if rows else 0), dtype=dtype, device=dev)
        self._p = torch.zeros((3, rows if pos >= 0 else 0), dtype=pos_dtype, device=dev)
        self._flat = torch.zeros(3 * rows if pos >= 0 else 0, dtype=pos_dtype, device=dev)  # an upload's

    def takes(self, extra: dict[int, torch.Tensor]) -> bool:
        """Whether a static step can take a forward's extra inputs (by slot): exactly the embeddings and,
        where the graph reads positions, MRoPE's `[3, 1, n]` ones."""
        p = extra.get(self.pos)
        return (
            self._e.shape[1] > 0
            and set(extra) == {self.embeds, self.pos} - {-1}
            and (p is None or (p.dim() == 3 and p.shape[0] == 3))
        )

    def stage(self, extra: dict[int, torch.Tensor], n: int, m: int) -> None:
        """Copy a forward's `n` tokens' inputs (`takes(extra)`, on the host or the device) into the buffers of
        a step of `m` tokens."""
        e = extra[self.embeds].reshape(n, -1)
        self._e[0, :n].copy_(e)
        self._e[0, n:m].copy_(e[-1:].expand(m - n, -1))
        if self.pos >= 0:
            p = extra[self.pos].reshape(3, n)
            if p.device.type == "cpu" and self._flat.device.type != "cpu":
                flat = self._flat[: 3 * n]
                self._staging.upload(p.reshape(-1).to(flat.dtype), flat)
                p = flat.view(3, n)
            self._p[:, :n].copy_(p)
            self._p[:, n:m].copy_(p[:, -1:].expand(3, m - n))

    def bind(self, env: list[Any], m: int) -> None:
        """Put the step's views (`m` tokens) into a program's `env`."""
        env[self.embeds] = self._e[:, :m]
        if self.pos >= 0:
            env[self.pos] = self._p[:, :m].unsqueeze(1)
