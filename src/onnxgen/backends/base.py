"""The Decoder protocol: the only seam between the engine and a backend.

A decoder runs one model package for one sequence (batch 1) and owns its KV cache. The engine
feeds it tokens at increasing positions and reads back the logits of the last position.

Contract
--------
- `forward(tokens, start_pos, inputs)` requires `start_pos == kv_len()` (asserted), appends the KV of
  `tokens` and returns the logits of the last fed position as a 1-D array of `vocab_size` in the
  backend's own array type (numpy for ort, torch for native): never a `[seq, vocab]` tensor.
  `inputs` are extra graph inputs (e.g. `pixel_values`) from the request; a required one that is
  missing raises `MissingRequiredInput`. On any exception the KV state is unspecified: callers must
  `reset()` (the engine drops the decoder's retained context on failure).
- `kv_len()` is the number of positions whose KV the cache holds.
- `rewind_to(n)` (0 <= n <= kv_len()) truncates the cache to its first n positions and returns True,
  or returns False and changes nothing when the backend cannot rewind.
- `reset()` empties the cache (kv_len() becomes 0) and may free device memory.
- `kv_bytes()` is the device memory the cache holds now, in bytes.

Only the reuse policy (`onnxgen.engine.reuse`) calls `kv_len`, `rewind_to` and `reset`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Decoder(Protocol):
    backend: str  # "ort" or "native"
    device: str  # "cpu" or "cuda"
    can_rewind: bool

    def kv_len(self) -> int: ...

    def forward(self, tokens: Sequence[int], start_pos: int, inputs: Mapping[str, Any] | None = None) -> Any: ...

    def rewind_to(self, n: int) -> bool: ...

    def reset(self) -> None: ...

    def kv_bytes(self) -> int: ...

    def close(self) -> None: ...
