"""A package's fingerprint: what saved KV must have been computed from to be reused (session files).

`package_fingerprint(spec)` hashes (blake2b-128, hex) the package's `genai_config.json`, its tokenizer files
and chat template, and the decoder graph file with each external-data file beside it: a file up to
`WHOLE_BYTES` whole, a larger one by its size and `SAMPLES` blocks of `BLOCK` bytes spread evenly over it
(first and last included: a few MiB read however large the weights; other weights of the same shapes differ
in every block). Computed once per package folder and modification time in a process.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

WHOLE_BYTES = 64 << 20
SAMPLES = 64
BLOCK = 64 << 10
_TEXT_FILES = ("genai_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def package_fingerprint(spec: Any) -> str:
    """The fingerprint of `spec`'s package (see the module docstring)."""
    graph = Path(spec.decoder_path)
    stat = graph.stat()
    return _fingerprint(str(Path(spec.path).resolve()), str(graph.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _fingerprint(folder: str, graph: str, _mtime: int, _size: int) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in _TEXT_FILES:
        p = Path(folder) / name
        h.update(b"\x00file\x00" + name.encode())
        if p.is_file():
            h.update(p.read_bytes())
    base = os.path.basename(graph)
    files = [Path(graph)] + [
        p
        for p in sorted(Path(graph).parent.iterdir())
        if p.name != base and (p.name.startswith(base) or p.suffix == ".data") and p.is_file()
    ]
    for p in files:
        size = p.stat().st_size
        h.update(b"\x00data\x00" + p.name.encode() + b"\x00" + str(size).encode())
        with open(p, "rb") as f:
            if size <= WHOLE_BYTES:
                h.update(f.read())
                continue
            for i in range(SAMPLES):
                f.seek((size - BLOCK) * i // (SAMPLES - 1))
                h.update(f.read(BLOCK))
    return h.hexdigest()
