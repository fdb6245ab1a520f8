"""Convert a checkpoint (a Hugging Face folder or a GGUF file) into an ONNX Runtime GenAI package.

The work is done by ONNX Runtime GenAI's model builder (`onnxruntime_genai.models.builder`, with the patches of
`convert/builder_run.py`), run as a subprocess whose (very chatty) output goes to a log file while a progress
reporter (`onnxgen.convert.progress`) shows the phases. A GGUF file is first turned into a temporary Hugging
Face folder by transformers (dequantized to float32), also in a subprocess, so the calling process never
imports torch or transformers. Before the builder runs, `convert/builder_config.py` checks the architecture
(a clear error where the builder cannot help) and normalizes the transformers-5 config settings the builder
misreads (the log lists each change).

Atomicity: everything is written into a temporary folder beside OUT and renamed into place only
once the package is complete and `load_spec` accepts it. A failed conversion leaves OUT untouched
(absent if it was absent) and raises `ConversionError` with the tail of the log and the log's path.

This module imports nothing heavy at import time; it needs the `convert` extra only when a
conversion actually runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import onnxgen.envs as envs
from onnxgen.convert.progress import Reporter, as_reporter
from onnxgen.errors import ConversionError, PackageError

PRECISIONS = ("fp32", "fp16", "bf16", "int4")
EXECUTION_PROVIDERS = ("cpu", "cuda")
# Precision x execution provider pairs the builder accepts (from its own list, restricted to ours).
VALID_COMBINATIONS = frozenset(
    {("fp32", "cpu"), ("fp32", "cuda"), ("fp16", "cuda"), ("bf16", "cuda"), ("int4", "cpu"), ("int4", "cuda")}
)
INSTALL_HINT = "pip install 'onnxgen[convert]'"

# Python modules each source kind needs (import name -> distribution name for the message).
_HF_DEPS = {"torch": "torch", "transformers": "transformers", "onnxruntime_genai": "onnxruntime-genai"}
_GGUF_DEPS = {**_HF_DEPS, "gguf": "gguf", "accelerate": "accelerate"}

_LOG_TAIL_LINES = 25


def missing_convert_deps(*, gguf: bool = False) -> list[str]:
    """Distribution names of the `convert` extra's packages that are not importable here.

    Cheap: only looks the modules up, never imports them.
    """
    deps = _GGUF_DEPS if gguf else _HF_DEPS
    return [dist for mod, dist in deps.items() if importlib.util.find_spec(mod) is None]


def convert_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    precision: str = "fp32",
    execution_provider: str = "cpu",
    progress: bool | Reporter = True,
    extra_options: Mapping[str, object] | None = None,
    overwrite: bool = False,
    keep_hf: str | os.PathLike[str] | None = None,
) -> Path:
    """Convert `src` (a Hugging Face folder with config.json + weights, or a `.gguf` file) into the
    package folder `out` and return `out`.

    `precision` is one of PRECISIONS and `execution_provider` one of EXECUTION_PROVIDERS (only the
    pairs in VALID_COMBINATIONS); `extra_options` are passed to the builder as `--extra_options
    KEY=VALUE`. If `out` exists and is not empty this refuses unless `overwrite=True`, in which case
    the old folder is replaced only after the new package is complete. Progress goes to `progress`, a
    `onnxgen.convert.progress.Reporter` (True: the logging default; False: silent; the CLI passes one that
    draws bars on stderr).

    The package always holds `chat_template.jinja` when the source has a chat template. The result
    is validated with `onnxgen.package.load_spec` before it is moved into place. `keep_hf` (GGUF sources
    only): also keep the dequantized Hugging Face folder there (moved into place after the package; it must
    not exist), e.g. as the transformers reference of parity tests.

    Raises ConversionError (bad arguments, missing source, missing `convert` extra, OUT not empty,
    builder failure with the log's tail and path, or an unreadable result). On any failure `out`
    is left as it was.
    """
    rep = as_reporter(progress)
    src_path = Path(src).expanduser()
    out_path = Path(out).expanduser().absolute()
    _check_target_combo(precision, execution_provider)
    kind = _source_kind(src_path)
    missing = missing_convert_deps(gguf=kind == "gguf")
    if missing:
        raise ConversionError(
            f"converting a checkpoint needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            f"not installed: run `{INSTALL_HINT}`"
        )
    _check_out(out_path, overwrite)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.onnxgen-tmp-", dir=out_path.parent))
    # The log lives outside `work` so it survives the cleanup of a failed conversion.
    fd, log_name = tempfile.mkstemp(prefix=f"onnxgen-convert-{out_path.name}-", suffix=".log")
    os.close(fd)
    log_path = Path(log_name)
    ok = False
    t0 = time.perf_counter()
    try:
        hf_dir = src_path
        if kind == "gguf":
            from onnxgen.convert.builder_config import check_gguf

            check_gguf(src_path)  # seconds, where reading the GGUF takes minutes
            hf_dir = work / "hf"
            _run_logged(
                [
                    sys.executable,
                    "-m",
                    "onnxgen.convert.checkpoint",
                    "gguf-to-hf",
                    str(src_path),
                    str(hf_dir),
                ],
                log_path,
                "Reading the GGUF",
                _GgufProgress(),
                rep,
                what=f"reading {src_path}",
            )
        from onnxgen.convert.builder_config import builder_source

        src_dir, notes = builder_source(hf_dir, work)
        if notes:
            with open(log_path, "a", encoding="utf-8") as logf:
                logf.write("".join(f"onnxgen: for the model builder, {n}\n" for n in notes))
            rep.info(f"Adjusted the config for the model builder: {'; '.join(notes)}")
        pkg = work / "package"
        cmd = [
            sys.executable,
            "-m",
            "onnxgen.convert.builder_run",
            "-i",
            str(src_dir),
            "-o",
            str(pkg),
            "-p",
            precision,
            "-e",
            execution_provider,
            "-c",
            str(work / "cache"),
        ]
        if extra_options:
            cmd += ["--extra_options", *(_kv(k, v) for k, v in extra_options.items())]
        _run_logged(
            cmd,
            log_path,
            f"Building the ONNX package ({precision}/{execution_provider})",
            _BuilderProgress(_num_layers(hf_dir)),
            rep,
            what="onnxruntime-genai's model builder",
        )
        ensure_chat_template(hf_dir, pkg)
        from onnxgen.package import load_spec

        try:
            load_spec(pkg)
        except PackageError as exc:
            raise ConversionError(
                f"the model builder produced a package onnxgen cannot read: {exc}\nfull log: {log_path}"
            ) from exc
        _install(pkg, out_path, overwrite)
        if keep_hf is not None and kind == "gguf":
            keep = Path(keep_hf).expanduser().absolute()
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(hf_dir), str(keep))
        ok = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if ok:
            log_path.unlink(missing_ok=True)
    rep.info(f"Converted {src_path} -> {out_path} in {time.perf_counter() - t0:.1f} s")
    return out_path


# --- argument checks ---------------------------------------------------------------------------


def _check_target_combo(precision: str, execution_provider: str) -> None:
    if precision not in PRECISIONS:
        raise ConversionError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if execution_provider not in EXECUTION_PROVIDERS:
        raise ConversionError(
            f"unknown execution provider {execution_provider!r}; choose one of {', '.join(EXECUTION_PROVIDERS)}"
        )
    if (precision, execution_provider) not in VALID_COMBINATIONS:
        pairs = ", ".join(f"{p}/{e}" for p, e in sorted(VALID_COMBINATIONS))
        raise ConversionError(
            f"the model builder cannot make a {precision} package for {execution_provider}; valid pairs: {pairs}"
        )


def _source_kind(src: Path) -> str:
    """'hf' for a folder with config.json, 'gguf' for a .gguf file; ConversionError otherwise."""
    if src.is_file() and src.suffix.lower() == ".gguf":
        return "gguf"
    if src.is_dir():
        cfg = src / "config.json"
        if not cfg.is_file():
            raise ConversionError(
                f"{src}: not a Hugging Face checkpoint folder (no config.json); pass a folder with "
                "config.json and the weights, or a .gguf file"
            )
        try:
            json.loads(cfg.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConversionError(f"{cfg}: not valid JSON ({exc}); fix the checkpoint's config.json") from exc
        return "hf"
    if src.is_file():
        raise ConversionError(
            f"{src}: unsupported checkpoint file; pass a Hugging Face folder or a .gguf file"
        )
    raise ConversionError(f"{src}: no such file or folder")


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out}: exists and is not a folder; choose another output path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConversionError(
            f"{out}: the output folder exists and is not empty; choose another path or pass "
            "overwrite=True (`onnxgen convert --overwrite`) to replace it"
        )


def _kv(key: str, value: object) -> str:
    v = str(value).lower() if isinstance(value, bool) else str(value)
    return f"{key}={v}"


def _num_layers(hf_dir: Path) -> int | None:
    try:
        cfg = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}
    n = cfg.get("num_hidden_layers") if isinstance(cfg, dict) else None
    return n if isinstance(n, int) and n > 0 else None


# --- running a logged subprocess with a progress display ----------------------------------------

_TQDM = re.compile(r"^(?P<desc>[^\r\n]*?):\s*\d+%\|[^|]*\|\s*(?P<n>\d+)/(?P<t>\d+)")


class _LineProgress:
    """Turns a subprocess's output lines into progress-bar updates (description, completed, total)."""

    def feed(self, line: str) -> tuple[str | None, float | None, float | None]:
        raise NotImplementedError


class _BuilderProgress(_LineProgress):
    """Phases of onnxruntime-genai's builder, recognised from its log lines."""

    def __init__(self, num_layers: int | None) -> None:
        self.num_layers = num_layers

    def feed(self, line: str) -> tuple[str | None, float | None, float | None]:
        m = _TQDM.match(line)
        if m:
            n, t = float(m["n"]), float(m["t"])
            if m["desc"].startswith("Loading weights"):
                return "loading weights", n, t
            if m["desc"].startswith("Saving"):
                return "writing model.onnx", n, t
            return None, n, t
        if line.startswith("Reading embedding layer"):
            return "building layers", 0, self.num_layers
        m = re.match(r"Reading layer (\d+)", line)
        if m:
            return "building layers", int(m[1]) + 1, self.num_layers
        if line.startswith(("Reading final norm", "Reading LM head")):
            return "building layers", self.num_layers, self.num_layers
        if line.startswith("Saving ONNX model"):
            return "writing model.onnx", 0, None
        if line.startswith("Saving GenAI config"):
            return "writing genai_config.json", 0, None
        if line.startswith("Saving processing files"):
            return "writing tokenizer files", 0, None
        return None, None, None


class _GgufProgress(_LineProgress):
    """Phases printed by `_gguf_to_hf` (lines `PHASE: ...`) plus transformers' tqdm bars."""

    def feed(self, line: str) -> tuple[str | None, float | None, float | None]:
        if line.startswith("PHASE: "):
            return line[len("PHASE: ") :].strip(), 0, None
        m = _TQDM.match(line)
        if m:
            return None, float(m["n"]), float(m["t"])
        return None, None, None


def _run_logged(
    cmd: list[str],
    log_path: Path,
    title: str,
    parser: _LineProgress,
    rep: Reporter,
    *,
    what: str,
) -> None:
    """Run `cmd` with stdout+stderr appended to `log_path`, drawing progress from its lines.

    Raises ConversionError naming `what`, with the log's tail and path, when the command fails.
    Ctrl-C terminates the child and propagates.
    """
    env = envs.subprocess_env(PYTHONUNBUFFERED="1")
    with open(log_path, "ab") as logf, rep.bar(title) as bar:
        logf.write(f"$ {' '.join(cmd)}\n".encode())
        logf.flush()
        start = logf.tell()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        pending = ""
        pos = start
        try:
            while True:
                rc = proc.poll()
                with open(log_path, "rb") as r:
                    r.seek(pos)
                    chunk = r.read()
                pos += len(chunk)
                pending += chunk.decode("utf-8", errors="replace")
                *lines, pending = re.split(r"[\r\n]", pending)
                for line in lines:
                    desc, done, total = parser.feed(line.strip())
                    if desc is not None or done is not None:
                        phase_desc = f"{title}: {desc}" if desc else None
                        bar.update(completed=done, total=total, description=phase_desc)
                if rc is not None:
                    break
                time.sleep(0.1)
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        if rc != 0:
            raise ConversionError(
                f"{what} failed (exit code {rc}). Last lines of its output:\n"
                + _tail(log_path)
                + f"\nfull log: {log_path}"
            )


def _tail(log_path: Path, n: int = _LOG_TAIL_LINES) -> str:
    text = log_path.read_text(encoding="utf-8", errors="replace")
    lines = [ln.rstrip() for ln in re.split(r"[\r\n]", text) if ln.strip()]
    return "\n".join("  " + (ln if len(ln) <= 300 else ln[:297] + "...") for ln in lines[-n:])


# --- finishing the package -----------------------------------------------------------------------


def _source_chat_template(hf_dir: Path) -> str | None:
    jinja = hf_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    tmpl = tok_cfg.get("chat_template") if isinstance(tok_cfg, dict) else None
    return tmpl if isinstance(tmpl, str) else None


def ensure_chat_template(hf_dir: Path, pkg: Path) -> None:
    """Make sure `pkg/chat_template.jinja` exists when the source has a chat template.

    The builder normally writes it (transformers' tokenizer.save_pretrained); this is the fallback
    for sources whose tokenizer did not carry it.
    """
    target = pkg / "chat_template.jinja"
    if target.is_file() or not pkg.is_dir():
        return
    tmpl = _source_chat_template(hf_dir)
    if tmpl is None:
        try:
            tok_cfg = json.loads((pkg / "tokenizer_config.json").read_text(encoding="utf-8"))
            tmpl = tok_cfg.get("chat_template") if isinstance(tok_cfg.get("chat_template"), str) else None
        except (OSError, json.JSONDecodeError, AttributeError):
            tmpl = None
    if tmpl is not None:
        target.write_text(tmpl, encoding="utf-8")


def _install(pkg: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished `pkg` to `out` (same filesystem), replacing `out` only when allowed.

    NOTE: the rename is the commit point: `out` is either absent/old or the complete new package.
    """
    if out.is_dir():
        if not any(out.iterdir()):
            out.rmdir()
        elif overwrite:
            old = out.with_name(f".{out.name}.onnxgen-old-{uuid.uuid4().hex[:8]}")
            os.replace(out, old)
            try:
                os.replace(pkg, out)
            except OSError:
                os.replace(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
            return
        else:
            raise ConversionError(
                f"{out}: the output folder appeared while converting and is not empty; "
                "pass overwrite=True to replace it"
            )
    try:
        os.replace(pkg, out)
    except OSError as exc:
        raise ConversionError(f"{out}: cannot move the finished package into place ({exc})") from exc


# --- GGUF -> Hugging Face folder (runs in a child process) --------------------------------------


def _gguf_to_hf(gguf: Path, dest: Path) -> None:
    """Load `gguf` with transformers (dequantized to float32) and save it as a Hugging Face folder.

    Runs in a subprocess (`python -m onnxgen.convert.checkpoint gguf-to-hf GGUF DEST`), printing
    `PHASE: ...` lines that the parent turns into progress.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from onnxgen.convert.builder_config import gguf_architecture, gguf_metadata

    print("PHASE: loading the tokenizer", flush=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # NOTE: transformers maps no head_dim for qwen2/qwen3 GGUFs (it reads `attention.key_length` only for
    # MoE variants), so the config falls back to its class default (Qwen3: 128) and any other head size
    # fails to load; take it from the file.
    arch = gguf_architecture(gguf)
    key_length = gguf_metadata(gguf, {f"{arch}.attention.key_length"}).get(f"{arch}.attention.key_length")
    if isinstance(key_length, int) and getattr(config, "head_dim", None) not in (None, key_length):
        print(f"PHASE: head_dim {key_length} from {arch}.attention.key_length", flush=True)
        config.head_dim = key_length
    print("PHASE: dequantizing weights", flush=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, config=config, dtype=torch.float32
    )
    # The weights are plain float32 tensors now; without this save_pretrained refuses
    # ("quantized with gguf and is not serializable").
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    print("PHASE: saving as a Hugging Face folder", flush=True)
    model.save_pretrained(str(dest))
    tok.save_pretrained(str(dest))


def _main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "gguf-to-hf":
        _gguf_to_hf(Path(argv[1]), Path(argv[2]))
        return 0
    print("usage: python -m onnxgen.convert.checkpoint gguf-to-hf GGUF DEST", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
