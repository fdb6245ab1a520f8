"""Session files: one conversation's KV and what it was computed from, on disk (`Session.save`,
`Model.restore_session`).

The file is a safetensors file (any safetensors reader opens it): an 8-byte little-endian header length, a
JSON header naming each tensor's dtype, shape and byte range plus a `__metadata__` table of strings, then the
tensors' bytes. Tensors: `k.{layer}` and `v.{layer}`, each `[kv_heads, tokens, head_size]` in the KV dtype
(token-major within a head, whatever the backend's own layout: a paged pool's page size does not matter).
Metadata (`SessionHeader`): the format tag, the package fingerprint (`package.fingerprint`), the backend,
the KV dtype and shape, the token ids, a tag of the salt (a hash: the salt itself is a tenant's secret), the
session's name, an application note, and `checksum`.

The checksum (format 2, written): XXH3-128 over the other metadata and the digests (XXH3-128 each) of the
tensors' bytes in layer order (`k.0, v.0, k.1, ...`) cut into `chunk`-byte pieces, so a reader hashes the
pieces in parallel as it reads them. Format 1 files (SHA-256 over the metadata and the same bytes) are still
read. The checksum guards against corruption and edits by mistake, not against an adversary who can rewrite
the file (who could recompute any checksum); what guards a tenant's KV is that the salt never leaves the
process (only its tag does) and that a session is only restored under its own.

`read_session` checks everything before anything is attached, in this order: the file can be read and
parsed, its tensors lie inside it, the checksum matches, then that it fits the loaded package (fingerprint,
backend, dtype, shapes, salt, token ids): each failure is a `SessionFileError` naming its `reason`. A format 2
file whose tensors lie in layer order is read by several threads at once (`os.preadv`), each piece hashed
by the thread that read it and handed to a `Sink` (host memory by default; `kv/staging.py` copies the pieces
to a device while the rest is read). `write_session` writes a temporary file beside the target and renames it
into place: a failed save leaves the previous file (or none), never half of one. numpy and xxhash only
(bfloat16 tensors travel as their raw uint16 on the host).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash

from onnxgen.errors import SessionFileError

FORMAT = "onnxgen-session/2"
FORMAT_V1 = "onnxgen-session/1"  # SHA-256 over the whole stream: still read
# KV dtype -> (safetensors dtype, the numpy type its bytes are read as)
DTYPES: dict[str, tuple[str, Any]] = {
    "float32": ("F32", np.float32),
    "float16": ("F16", np.float16),
    "bfloat16": ("BF16", np.uint16),
}
MAX_HEADER = 64 << 20  # a header past this is not one this module wrote
READ_CHUNK = 32 << 20  # format 1: the tensors are read in chunks of this, each hashed while the next is read
CHUNK = 8 << 20  # format 2: the pieces the checksum digests one by one (a file records its own)
MIN_CHUNK, MAX_CHUNK = 4 << 10, 1 << 30  # the piece sizes a reader accepts
READERS = 8  # format 2: threads reading a file's pieces at once (at most the machine's cores)


def salt_tag(salt: str | None) -> str:
    """What a file records of a salt: "" for none, else a hash (the salt never leaves the process)."""
    if salt is None:
        return ""
    return hashlib.blake2b(b"onnxgen-session-salt\x00" + salt.encode("utf-8"), digest_size=16).hexdigest()


@dataclass(frozen=True)
class KVShape:
    """What KV was computed by: the package (`package.fingerprint`), the backend, the dtype and the shape."""

    fingerprint: str
    backend: str
    kv_dtype: str
    num_layers: int
    kv_heads: int
    head_size: int


@dataclass(frozen=True)
class SessionHeader:
    """What a session file says about its KV. `layers` (K, V) pairs follow it in the file."""

    shape: KVShape
    tokens: tuple[int, ...]
    salt: str  # `salt_tag` of the session's salt
    name: str = ""
    note: str = ""  # the application's own text (e.g. the chat CLI's messages), covered by the checksum

    def metadata(self) -> dict[str, str]:
        sh = self.shape
        return {
            "format": FORMAT,
            "fingerprint": sh.fingerprint,
            "backend": sh.backend,
            "kv_dtype": sh.kv_dtype,
            "num_layers": str(sh.num_layers),
            "kv_heads": str(sh.kv_heads),
            "head_size": str(sh.head_size),
            "tokens": json.dumps(list(self.tokens), separators=(",", ":")),
            "salt": self.salt,
            "name": self.name,
            "note": self.note,
        }


def _meta_bytes(meta: dict[str, str]) -> bytes:
    """The metadata a checksum covers (all but `checksum`), canonically."""
    return json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode()


def _hasher(meta: dict[str, str]) -> Any:
    """Format 1: SHA-256 over the metadata, ready for the tensors' bytes in layer order."""
    return hashlib.sha256(_meta_bytes(meta))


def _checksum_v1(meta: dict[str, str], chunks: Sequence[Any]) -> str:
    h = _hasher(meta)
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def _piece_digests(buffers: Sequence[Any], chunk: int) -> list[bytes]:
    """Format 2: the XXH3-128 digest of each `chunk`-byte piece of `buffers` laid end to end (the last piece
    shorter), without joining them."""
    out: list[bytes] = []
    h, room = xxhash.xxh3_128(), chunk
    for buf in buffers:
        view = memoryview(buf).cast("B")
        while len(view):
            take = view[:room]
            h.update(take)
            view, room = view[len(take) :], room - len(take)
            if room == 0:
                out.append(h.digest())
                h, room = xxhash.xxh3_128(), chunk
    if room != chunk:
        out.append(h.digest())
    return out


def _checksum_v2(meta: dict[str, str], digests: Sequence[bytes]) -> str:
    return xxhash.xxh3_128(_meta_bytes(meta) + b"".join(digests)).hexdigest()


def _read_hashing(f: Any, data: Any, h: Any | None) -> int:
    """Format 1: fill `data` (a writable buffer) from `f` in `READ_CHUNK`s; with a hasher, each chunk is hashed
    on a worker thread while the next is read (hashlib and file reads release the GIL), so a restore costs the
    slower of the two, not their sum. Returns the bytes read (fewer than `len(data)` where the file ended)."""
    from concurrent.futures import ThreadPoolExecutor

    view, got = memoryview(data), 0
    if h is None:
        return f.readinto(data)
    with ThreadPoolExecutor(1, thread_name_prefix="onnxgen-hash") as ex:
        pending = None
        while got < len(data):
            n = f.readinto(view[got : got + READ_CHUNK])
            if not n:
                break
            if pending is not None:
                pending.result()
            pending = ex.submit(h.update, view[got : got + n])
            got += n
        if pending is not None:
            pending.result()
    return got


class Sink(Protocol):
    """Where a format 2 file's tensor bytes go as they are read. `buffer` and `filled` are called from
    several reader threads at once, each for its own piece; `finish` once after every piece was filled."""

    def buffer(self, offset: int, n: int) -> memoryview:
        """A writable buffer of `n` bytes for the data section's bytes `[offset, offset + n)`."""
        ...

    def filled(self, offset: int, buf: memoryview) -> None:
        """`buf` (from `buffer(offset, ...)`) holds its bytes now (and they are hashed); also called for a
        piece whose read failed (the whole read is then discarded)."""
        ...

    def finish(self) -> Any:
        """The data section, once every piece has landed (what `tensor` views)."""
        ...

    def tensor(self, data: Any, dtype: str, dims: tuple[int, ...], start: int, end: int) -> Any:
        """A `[kv_heads, tokens, head_size]` view of bytes `[start, end)` of `data` (safetensors `dtype`)."""
        ...


class HostSink:
    """The data section in one host buffer; tensors as numpy views of it (bfloat16 as uint16)."""

    def __init__(self, nbytes: int) -> None:
        self.data = np.empty(nbytes, dtype=np.uint8)  # NOTE: not zero-filled: every byte is read into it

    def buffer(self, offset: int, n: int) -> memoryview:
        return memoryview(self.data[offset : offset + n])

    def filled(self, offset: int, buf: memoryview) -> None:
        pass

    def finish(self) -> Any:
        return self.data

    def tensor(self, data: Any, dtype: str, dims: tuple[int, ...], start: int, end: int) -> Any:
        np_type = next(t for code, t in DTYPES.values() if code == dtype)
        return data[start:end].view(np_type).reshape(dims)


def _read_pieces(path: Path, fd: int, base: int, nbytes: int, chunk: int, sink: Sink) -> list[bytes]:
    """Read the data section (`nbytes` at file offset `base`) into `sink` piece by piece on up to `READERS`
    threads, each piece hashed by the thread that read it; returns the pieces' digests in order. Raises
    `SessionFileError` when the file ends early, `OSError` when it cannot be read."""
    from concurrent.futures import ThreadPoolExecutor

    count = -(-nbytes // chunk)
    digests: list[bytes] = [b""] * count

    failed = threading.Event()

    def piece(i: int) -> None:
        if failed.is_set():  # another piece failed: the read is over
            return
        offset = i * chunk
        n = min(chunk, nbytes - offset)
        buf = sink.buffer(offset, n)
        try:
            got = 0
            while got < n:
                r = os.preadv(fd, [buf[got:]], base + offset + got)
                if r == 0:
                    raise _fail(path, "truncated", "the file changed while it was read")
                got += r
            digests[i] = xxhash.xxh3_128_digest(buf)
        except BaseException:
            failed.set()
            raise
        finally:  # every buffer given out goes back (a failed piece's bytes are never used)
            sink.filled(offset, buf)

    workers = max(1, min(READERS, os.cpu_count() or 1, count))
    if workers == 1:
        for i in range(count):
            piece(i)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="onnxgen-read") as ex:
            for f in [ex.submit(piece, i) for i in range(count)]:
                f.result()
    return digests


def _parse_header(head: bytes) -> tuple[dict[str, Any], dict[str, str]] | Exception:
    """A header's tensor table and its `__metadata__` table of strings, or why it is not a session file's
    (returned, not raised: `read_session` reports it after the read, in the order of its checks)."""
    try:
        table = json.loads(head.decode("utf-8"))
        meta = table.pop("__metadata__")
        if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
            raise ValueError("__metadata__ is not a table of strings")
    except Exception as exc:
        return exc
    return table, meta


def write_session(path: str | Path, header: SessionHeader, layers: Sequence[tuple[Any, Any]]) -> int:
    """Write `layers` (per layer `(k, v)`, numpy arrays `[kv_heads, tokens, head_size]` of the KV dtype's
    numpy type: uint16 for bfloat16) under `header` to `path`, atomically. Returns the file's size."""
    path = Path(path)
    sh = header.shape
    code, np_type = DTYPES[sh.kv_dtype]
    n = len(header.tokens)
    assert len(layers) == sh.num_layers, (len(layers), sh.num_layers)
    entries: dict[str, Any] = {}
    blobs: list[Any] = []
    offset = 0
    for i, (k, v) in enumerate(layers):
        for name, a in ((f"k.{i}", k), (f"v.{i}", v)):
            a = np.ascontiguousarray(a)
            assert a.dtype == np_type and a.shape[:2] == (sh.kv_heads, n), (name, a.dtype, a.shape)
            entries[name] = {
                "dtype": code,
                "shape": list(a.shape),
                "data_offsets": [offset, offset + a.nbytes],
            }
            offset += a.nbytes
            blobs.append(memoryview(a).cast("B"))
    meta = header.metadata()
    meta["chunk"] = str(CHUNK)
    meta["checksum"] = _checksum_v2(meta, _piece_digests(blobs, CHUNK))
    head = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # safetensors aligns the data section to 8 bytes
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for b in blobs:
                f.write(b)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return 8 + len(head) + offset


@dataclass(frozen=True)
class Expected:
    """What the restoring engine needs a file to be."""

    shape: KVShape
    vocab_size: int
    context_length: int
    salt: str  # `salt_tag` of the salt the session is restored under


def _fail(path: Path, reason: str, why: str) -> SessionFileError:
    return SessionFileError(f"{path}: cannot restore this session file: {why}", reason, path)


def read_session(
    path: str | Path, expect: Expected, sink: Callable[[int, int], Sink | None] | None = None
) -> tuple[SessionHeader, list[tuple[Any, Any]]]:
    """Read and check a session file against `expect`; returns its header and per-layer `(k, v)` tensors.
    `sink(nbytes, chunk)`: where a format 2 file's tensor bytes go, given their size and the file's piece size
    (None, or a sink that returns None: a `HostSink`, numpy arrays); format 1 files and files whose tensors
    are not in layer order are read into host memory.
    Raises `SessionFileError` (see the module docstring for the order of the checks)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise _fail(path, "truncated", "the file ends before its header")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > MAX_HEADER or 8 + hlen > size:
                raise _fail(
                    path, "truncated" if hlen <= MAX_HEADER else "format", "its header length is wrong"
                )
            head = f.read(hlen)
            parsed = _parse_header(head)
            if isinstance(parsed, tuple) and parsed[1].get("format") == FORMAT:
                return _read_v2(path, f, 8 + hlen, size - 8 - hlen, parsed, expect, sink)
            host = HostSink(size - 8 - hlen)
            streamed = _hasher(parsed[1]) if isinstance(parsed, tuple) else None
            got = _read_hashing(f, host.data, streamed)
    except OSError as exc:
        raise _fail(path, "unreadable", f"{type(exc).__name__}: {exc}") from exc
    data = host.finish()
    if got != len(data):
        raise _fail(path, "truncated", "the file changed while it was read")
    if isinstance(parsed, Exception):
        raise _fail(path, "format", "its header is not a session file's") from parsed
    table, meta = parsed
    if meta.get("format") != FORMAT_V1:
        raise _fail(path, "format", f"format {meta.get('format')!r}, expected {FORMAT!r}")
    header, spans = _layout(path, table, meta, len(data))
    if streamed is not None and _in_order(spans):
        digest = streamed.hexdigest()  # the tensors fill the data section in order: hashed as read
    else:
        digest = _checksum_v1(meta, [data[a:b] for *_, a, b in spans])
    if digest != meta.get("checksum"):
        raise _fail(path, "checksum", "its bytes do not match their checksum (corrupted or edited)")
    _check(path, header, expect)
    return header, _tensors(path, header, spans, host, data)


def _read_v2(
    path: Path,
    f: Any,
    base: int,
    nbytes: int,
    parsed: tuple[dict[str, Any], dict[str, str]],
    expect: Expected,
    sink: Callable[[int, int], Sink | None] | None,
) -> tuple[SessionHeader, list[tuple[Any, Any]]]:
    """A format 2 file from its data section on (`base`: its offset in the file, `nbytes`: its size)."""
    table, meta = parsed
    header, spans = _layout(path, table, meta, nbytes)
    try:
        chunk = int(meta["chunk"])
        if not MIN_CHUNK <= chunk <= MAX_CHUNK:
            raise ValueError(f"piece size {chunk}")
    except Exception as exc:
        raise _fail(path, "format", "its checksum's piece size is missing or wrong") from exc
    in_order = _in_order(spans)
    target: Sink = (sink(nbytes, chunk) if sink is not None and in_order else None) or HostSink(nbytes)
    try:
        digests = _read_pieces(path, f.fileno(), base, nbytes, chunk, target)
    finally:
        data = target.finish()
    if not in_order:  # another writer's order: the checksum is over the tensors in layer order
        host = np.asarray(data)
        digests = _piece_digests([host[a:b] for *_, a, b in spans], chunk)
    if _checksum_v2(meta, digests) != meta.get("checksum"):
        raise _fail(path, "checksum", "its bytes do not match their checksum (corrupted or edited)")
    _check(path, header, expect)
    return header, _tensors(path, header, spans, target, data)


def _layout(
    path: Path, table: dict[str, Any], meta: dict[str, str], nbytes: int
) -> tuple[SessionHeader, list[tuple[str, str, tuple[int, ...], int, int]]]:
    """The header a file's metadata describes and its tensors' spans `(name, dtype, dims, start, end)` in
    layer order, checked to lie inside the `nbytes` of its data section and to end where it does."""
    try:
        shape = KVShape(
            meta["fingerprint"],
            meta["backend"],
            meta["kv_dtype"],
            int(meta["num_layers"]),
            int(meta["kv_heads"]),
            int(meta["head_size"]),
        )
        header = SessionHeader(
            shape=shape,
            tokens=tuple(int(t) for t in json.loads(meta["tokens"])),
            salt=meta["salt"],
            name=meta.get("name", ""),
            note=meta.get("note", ""),
        )
        spans = []
        for i in range(shape.num_layers):
            for name in (f"k.{i}", f"v.{i}"):
                e = table[name]
                a, b = (int(x) for x in e["data_offsets"])
                spans.append((name, str(e["dtype"]), tuple(int(d) for d in e["shape"]), a, b))
    except Exception as exc:
        raise _fail(path, "format", "its header lacks a field or a tensor") from exc
    if any(not 0 <= a <= b <= nbytes for *_, a, b in spans) or (spans and spans[-1][4] != nbytes):
        raise _fail(path, "truncated", "its tensors run past the end of the file")
    return header, spans


def _in_order(spans: Sequence[tuple[str, str, tuple[int, ...], int, int]]) -> bool:
    """Whether the tensors fill the data section in layer order, end to end."""
    return all(s[3] == (spans[i - 1][4] if i else 0) for i, s in enumerate(spans))


def _tensors(
    path: Path, header: SessionHeader, spans: Sequence[Any], sink: Sink, data: Any
) -> list[tuple[Any, Any]]:
    """The checked file's per-layer `(k, v)`, each a view of `data` made by `sink`."""
    shape = header.shape
    code, np_type = DTYPES[shape.kv_dtype]
    n = len(header.tokens)
    arrays = []
    for name, dtype, dims, a, b in spans:
        ok = dtype == code and len(dims) == 3 and dims[:2] == (shape.kv_heads, n)
        ok = ok and (not name.startswith("k.") or dims[2] == shape.head_size)
        if not ok or (b - a) != int(np.prod(dims)) * np.dtype(np_type).itemsize:
            raise _fail(path, "shape", f"tensor {name} is {dtype} {list(dims)}, not the package's KV")
        arrays.append(sink.tensor(data, dtype, dims, a, b))
    return [(arrays[2 * i], arrays[2 * i + 1]) for i in range(shape.num_layers)]


def _check(path: Path, h: SessionHeader, e: Expected) -> None:
    """The checked file against the loaded package."""
    got, want = h.shape, e.shape
    if got.fingerprint != want.fingerprint:
        raise _fail(path, "package", "it was saved from another model package (or another version of it)")
    if got.backend != want.backend:
        raise _fail(
            path, "backend", f"it was saved by the {got.backend} backend; load the model with that one"
        )
    if got.kv_dtype != want.kv_dtype or got.kv_dtype not in DTYPES:
        raise _fail(path, "dtype", f"its KV is {got.kv_dtype}, the package's {want.kv_dtype}")
    if got != want:
        raise _fail(path, "shape", "its KV has another number of layers, heads or head size")
    if h.salt != e.salt:
        raise _fail(path, "salt", "it belongs to another salt (tenant): its KV is never attached to this one")
    if not h.tokens or len(h.tokens) > e.context_length or not all(0 <= t < e.vocab_size for t in h.tokens):
        raise _fail(path, "tokens", "its token ids do not fit the package (empty, too long or out of range)")
