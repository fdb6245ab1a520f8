"""What a request's KV depends on: its tokens plus a digest of everything else that shapes the KV.

The digest (blake2b, 128-bit) covers the package identity and every extra graph input's name, dtype,
shape and bytes. An input whose type cannot be digested makes the whole identity undigestable
(`digest is None`): such a request's KV is never retained (docs/reuse.md, invariant 4).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Identity:
    """Tokens fed to the model plus the digest of the non-token context (None: undigestable)."""

    tokens: tuple[int, ...]
    digest: bytes | None

    @property
    def retainable(self) -> bool:
        return self.digest is not None


def _absorb(h: Any, name: str, value: Any) -> bool:
    """Feed one input into the hash. Returns False when its type cannot be canonicalised."""
    h.update(b"\x00input\x00" + name.encode("utf-8") + b"\x00")
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        h.update(b"bytes\x00" + len(data).to_bytes(8, "little"))
        h.update(data)
        return True
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        h.update(b"ndarray\x00" + str(arr.dtype).encode() + b"\x00" + repr(arr.shape).encode() + b"\x00")
        h.update(arr.tobytes())
        return True
    if type(value).__module__.startswith("torch"):
        arr = value.detach().to("cpu").contiguous()
        h.update(b"torch\x00" + str(arr.dtype).encode() + b"\x00" + repr(tuple(arr.shape)).encode() + b"\x00")
        h.update(arr.view(-1).view(__import__("torch").uint8).numpy().tobytes())
        return True
    return False


def make_identity(tokens: Sequence[int], inputs: Mapping[str, Any] | None, package_key: str) -> Identity:
    """Build the identity of a request. Never raises on odd inputs: they make it undigestable."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"package\x00" + package_key.encode("utf-8"))
    for name in sorted(inputs or {}):
        if not _absorb(h, name, (inputs or {})[name]):
            return Identity(tuple(tokens), None)
    return Identity(tuple(tokens), h.digest())
