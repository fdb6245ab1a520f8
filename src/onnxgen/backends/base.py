"""The Decoder protocol: the only seam between the engine and a backend.

A decoder runs one model package for one sequence (batch 1) and owns its KV cache. The engine
feeds it tokens at increasing positions and reads back the logits of the last position. Both
backends (`ort`, `native`) obey every point below; `tests/test_decoder_contract.py` runs the same
checks against each of them.

Contract
--------
Attributes (declared, never probed with getattr):
- `backend` ("ort" | "native"), `device` ("cpu" | "cuda"): what runs it. The device name was checked
  at the edge (`onnxgen.backends.resolve_backend`, called by the engine); a decoder asserts it.
- `can_rewind`: whether `rewind_to(n)` can truncate the cache (ort off the CPU cannot).
- `info`: a read-only snapshot (a new mapping on every read) describing the decoder, for display,
  benchmarks and tests. Keys every decoder has:
    `backend`, `device`       as the attributes
    `kv_dtype`                the dtype the KV is stored in (the model's: "float32", "bfloat16", ...)
    `kv_capacity`             positions the allocated cache holds before it must grow (>= kv_len();
                              equal to kv_len() where the KV is sized by its length: ort's concat mode)
    `weights`                 an opaque id of the loaded weights: decoders sharing weights (forks) report
                              the same value
  Backend-specific keys are documented in each decoder's docstring.

Running:
- `forward(tokens, start_pos, inputs)` appends the KV of `tokens` and returns the logits of the last fed
  position as a 1-D float32 array of `vocab_size` in the backend's own array type (numpy for ort, a
  torch tensor on the device for native; never a `[seq, vocab]` array, never a view the next forward
  overwrites). `forward(tokens, start_pos, inputs, rows=r)` with r > 1 returns the logits of the last r
  fed positions as `[r, vocab_size]` float32 instead (speculative decoding verifies drafts with it;
  `1 <= r <= len(tokens)`). `start_pos == kv_len()` and `len(tokens) >= 1` are the caller's invariants
  (asserted).
  `inputs` are extra graph inputs (e.g. `pixel_values`); a required one that is missing raises
  `MissingRequiredInput`. Errors: `ContextOverflow` when `start_pos + len(tokens)` exceeds the
  package's context length (raised before anything runs: the cache is unchanged), `DeviceOutOfMemory`
  when the device runs out of memory; anything else the runtime raises propagates unchanged. After
  any other exception the KV state is unspecified: the caller resets (the engine drops the retained
  context on failure).

The KV seam (only the reuse policy, `onnxgen.engine.reuse`, calls these three; a test enforces it):
- `kv_len()`: the number of positions whose KV the cache holds.
- `rewind_to(n)`: keep the first n positions and return True, or return False and change nothing when
  the backend cannot rewind (`can_rewind` False; `rewind_to(kv_len())` is always True). n outside
  `[0, kv_len()]` is a programming error of the caller (the policy never plans one): asserted.
- `reset()`: empty the cache (`kv_len()` becomes 0) and KEEP its allocated buffers for the next
  request: capacity buffers stay (`kv_bytes()` and `info["kv_capacity"]` unchanged), so a reset before a
  new prompt costs nothing and CUDA graphs captured on the buffers stay valid. KV sized by its length
  (ort's concat mode) has nothing to keep and goes.

Saved KV (session files, `onnxgen.kv.files`; called by the slot executor only, between requests):
- `export_kv()`: copies of the cache's `kv_len()` positions on the host, per layer `(k, v)` numpy arrays
  `[kv_heads, kv_len(), head_size]` of the KV dtype (bfloat16 as its raw uint16: `kv.storage.host_copy`).
- `import_kv(tokens, layers)`: replace the cache by `layers` (as `export_kv` gives) holding the KV of
  `tokens` (`kv_len()` becomes `len(tokens)`); `tokens` are what the cache was computed from (LongRoPE
  decoders keep them to recompute at the switch). Raises `DeviceOutOfMemory` with the cache left empty.

Memory and lifetime:
- `kv_bytes()`: the device memory the cache holds now, in bytes (allocated capacity, not the length).
- `close()`: empty the cache AND free its memory (`kv_bytes()` becomes 0) and the decoder's other
  private device state (CUDA graphs). Idempotent. The decoder stays usable: a later `forward`
  allocates again. The weights are shared (see `fork`) and go with the last decoder that holds them.
- `fork()`: a new decoder with an empty cache that shares this one's weights and options (no second
  load). Safe to call while another thread runs this decoder.

Construction: `create_decoder` in `onnxgen.backends`. Each backend declares the keyword options its
decoder takes as `OPTIONS` in its package (`onnxgen.backends.ort`, `onnxgen.backends.native`); the
engine validates the user's options against those declarations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

# The `info` keys every decoder has (see the contract above).
INFO_KEYS = ("backend", "device", "kv_dtype", "kv_capacity", "weights")


@runtime_checkable
class Decoder(Protocol):
    backend: str  # "ort" or "native"
    device: str  # "cpu" or "cuda"
    can_rewind: bool

    @property
    def info(self) -> Mapping[str, Any]: ...

    def forward(
        self, tokens: Sequence[int], start_pos: int, inputs: Mapping[str, Any] | None = None, rows: int = 1
    ) -> Any: ...

    def kv_len(self) -> int: ...

    def rewind_to(self, n: int) -> bool: ...

    def reset(self) -> None: ...

    def kv_bytes(self) -> int: ...

    def export_kv(self) -> list[tuple[Any, Any]]: ...

    def import_kv(self, tokens: Sequence[int], layers: Sequence[tuple[Any, Any]]) -> None: ...

    def close(self) -> None: ...

    def fork(self) -> Decoder: ...


def rope_parts(start_pos: int, n: int, rows: int, switch: int) -> list[tuple[int, int, int]]:
    """How a LongRoPE decoder's forward of `n` tokens at `start_pos` wanting the last `rows` logits runs:
    `(a, b, rows)` slices of the tokens, each fed in one regime. One part, unless rows are wanted on both sides
    of the switch (a verify step of drafts): those up to it must see the short factors, as one-token steps
    would, so the tokens up to the switch are fed first, then the rest."""
    end = start_pos + n
    if start_pos < switch < end and rows > end - switch:
        head = switch - start_pos
        return [(0, head, rows - (end - switch)), (head, n, end - switch)]
    return [(0, n, rows)]
