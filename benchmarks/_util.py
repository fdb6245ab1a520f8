"""What the benchmark tools share: models named on the command line, engines built from load options,
interleaved timing, medians, the device's name, the copy-bandwidth floor, onnxruntime-genai and
transformers peers, and markdown tables.

Models (`--model`, comma-separated where a tool takes several):
    default                      the embedded SmolLM2-135M-Instruct int4 package (built on first use);
                                 default-fp32: its fp32 reference, from the same GGUF
    PATH                         any package folder
    synthetic:PRESET[:k=v,...]   onnxgen's own writer (`onnxgen.convert.synthetic`): tiny, 1b, 8b, with
                                 SyntheticConfig fields overridden (`synthetic:8b:num_layers=4,quant=int4`)
    builder:SHAPE[:PRECISION]    a random checkpoint saved by transformers (`onnxgen.convert.reference`
                                 SHAPES: Llama tiny, 2048x4, 135m, 0.5b, 1b, 8b, 8b16k; Gemma 3 gemma3_1b,
                                 gemma3_6l, gemma3_tiny; gpt-oss MoE gptoss-tiny, gptoss-20b, gptoss-20bx8,
                                 gptoss-20bx2; Phi-3 LongRoPE switching at 4096 tokens phi4mini, phi4minix4)
                                 converted by onnxruntime-genai's builder (bf16 by default; fp32, fp16, int4);
                                 needs --tokenizer
    convert:SRC[:PRECISION]      a Hugging Face folder or a .gguf file converted by the builder (bf16)
                                 (PRECISION@EP picks the builder's execution provider: int4@cpu; default
                                 cpu for fp32, cuda otherwise)
Packages that are built go under --work (default /tmp/onnxgen_bench) and are reused when present.

Engines (`--engine`, repeatable): comma-separated `onnxgen.load` options, e.g. `backend=ort,threads=2` or
`decode_steps=4,cuda_graphs=false`; `label=NAME` names the contender. Engine policy is a load option
(`onnxgen.config`), kernel switches are `ONNXGEN_*` environment variables (`onnxgen.envs`), set before the
run; a tool never assigns attributes of onnxgen's modules or engines.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROUNDS_MIN = 5
WORK = Path("/tmp/onnxgen_bench")
PRECISIONS = ("fp32", "fp16", "bf16", "int4")
# `qwen_vl:PRESET`: `convert.qwen_vl.VLShape` fields over its defaults (tiny: the tests' fixture; small: a
# text decoder of 8 x 512 and a vision tower of 8 x 320, two of its blocks attending over the whole image;
# 2b: Qwen2-VL-2B's text decoder with Qwen2.5-VL's vision tower of 32 x 1280, the GPU's 2B-class shape)
VL_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_layers": 8,
        "num_heads": 8,
        "num_kv_heads": 2,
        "mrope_section": (8, 12, 12),
        "vision_depth": 8,
        "vision_hidden": 320,
        "vision_heads": 5,
        "vision_intermediate": 896,
        "window_size": 112,
        "fullatt_blocks": (3, 7),
        "init_std": 0.02,
    },
    "2b": {
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_layers": 28,
        "num_heads": 12,
        "num_kv_heads": 2,
        "mrope_section": (16, 24, 24),
        "rope_theta": 1e6,
        "context_length": 32768,
        "vision_depth": 32,
        "vision_hidden": 1280,
        "vision_heads": 16,
        "vision_intermediate": 3420,
        "window_size": 112,
        "fullatt_blocks": (7, 15, 23, 31),
        "init_std": 0.02,
    },
}

# --- arguments ---------------------------------------------------------------------------------------


def parser(doc: str | None, *, model: str = "default", device: str = "cpu", runs: int = 5) -> Any:
    """An argparse parser with the arguments every tool takes (the tool adds its own)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=model, help=f"model(s), comma-separated (default: {model})")
    ap.add_argument("--device", default=device, choices=("cpu", "cuda"))
    ap.add_argument(
        "--engine",
        action="append",
        default=None,
        help="an engine's load options, k=v comma-separated (repeat for several contenders)",
    )
    ap.add_argument(
        "--threads", type=int, default=2, help="intra-op threads, equal for every side (0: defaults)"
    )
    ap.add_argument(
        "--runs", type=int, default=runs, help=f"interleaved rounds, median reported (>= {ROUNDS_MIN})"
    )
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer files for builder:* checkpoints")
    ap.add_argument("--work", type=Path, default=WORK, help="where built packages are kept")
    ap.add_argument("--json", type=Path, default=None, help="write every measured number here")
    ap.add_argument("--dry-run", action="store_true", help=f"allow --runs below {ROUNDS_MIN} (checks only)")
    return ap


def check_args(ap: Any, args: Any) -> None:
    if args.runs < ROUNDS_MIN and not args.dry_run:
        ap.error(
            f"--runs must be >= {ROUNDS_MIN} (medians of fewer runs are not reported; --dry-run to check)"
        )
    if args.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def value(text: str) -> Any:
    """A command-line value: true/false, none, an int, a float (or a size such as 8GiB), else the text."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for unit, k in (("gib", 1 << 30), ("mib", 1 << 20), ("kib", 1 << 10)):
        if low.endswith(unit) and low[: -len(unit)].isdigit():
            return int(low[: -len(unit)]) * k
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def options(text: str) -> dict[str, Any]:
    """`k=v,k=v` -> a dict of values (see `value`)."""
    out: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, val = part.partition("=")
        if not sep:
            raise SystemExit(f"expected key=value, got {part!r} in {text!r}")
        out[key.strip()] = value(val.strip())
    return out


def engines(specs: Sequence[str] | None, default: Sequence[str] = ("",)) -> dict[str, dict[str, Any]]:
    """`--engine` strings -> {label: load options}; an empty string is the default engine."""
    out: dict[str, dict[str, Any]] = {}
    for spec in specs or default:
        opts = options(spec)
        label = str(opts.pop("label", spec or "default"))
        out[label] = opts
    return out


# --- devices -----------------------------------------------------------------------------------------


def require_cuda(device: str, tool: str) -> None:
    """Exit with a clear message when `device` is cuda and this machine has none."""
    if device != "cuda":
        return
    try:
        import torch
    except ImportError:
        raise SystemExit(f"{tool}: --device cuda needs torch with CUDA; torch is not installed") from None
    if not torch.cuda.is_available():
        raise SystemExit(
            f"{tool}: --device cuda, but torch {torch.__version__} sees no CUDA device here. Run it on the GPU "
            "host (benchmarks/gpu_session.sh) or pass --device cpu with a small model for a dry run."
        )


def machine() -> str:
    """This host's CPU, cores and Python, as a result's caption names them."""
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"


def describe(device: str, threads: int | None = None) -> str:
    """The device a table's absolute numbers come from: the card's name for CUDA, the machine for the CPU."""
    if device == "cuda":
        import torch

        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return machine() + (f", {threads} threads" if threads else ", default threads")


def set_threads(threads: int) -> None:
    """torch's intra-op threads (the native backend on the CPU); onnxruntime's come through the load option."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def release(device: str) -> None:
    """Collect the engines dropped so far (and on CUDA return their memory) before the next one loads."""
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """This GPU's device-to-device copy bandwidth in bytes/s (read + write), median of 10 copies of 2 GiB
    after 2 warm-up copies: the ceiling a decode step's bytes are measured against."""
    import torch

    x = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    y = torch.empty_like(x)
    ts = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * (2 << 30) / statistics.median(ts[2:])


# --- models ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Package:
    """A model to benchmark: its package folder, and the Hugging Face folder it was made from (if known)."""

    name: str
    path: Path
    hf: Path | None = None


def default_tokenizer() -> Path | None:
    """SmolLM2's tokenizer files: `.carry/tok` (the GPU host's carried copy) or the default model's folder."""
    carried = Path(__file__).resolve().parents[1] / ".carry" / "tok"
    if (carried / "tokenizer.json").is_file():
        return carried
    from onnxgen.convert.default import resolve_model_path

    for name in ("default", "default-fp32"):
        home = resolve_model_path(name, build=False)
        if (home / "tokenizer.json").is_file():
            return home
    return None


def _split_precision(rest: str, default: str = "bf16") -> tuple[str, str, str]:
    """`SRC[:PRECISION[@EP]]` -> (SRC, precision, the builder's execution provider: cpu for fp32, else cuda)."""
    head, _, tail = rest.rpartition(":")
    precision, _, ep = tail.partition("@")
    if not head or precision not in PRECISIONS:
        head, precision, ep = rest, default, ""
    return head, precision, ep or ("cpu" if precision == "fp32" else "cuda")


def resolve(spec: str, *, work: Path = WORK, tokenizer: Path | None = None, device: str = "cpu") -> Package:
    """A `--model` string -> a package on disk, built under `work` when it is not there yet."""
    kind, _, rest = spec.partition(":")
    from onnxgen.package.home import default_precision

    precision = default_precision(spec)
    if precision is not None:
        from onnxgen.convert.default import resolve_model_path

        return Package(f"SmolLM2-135M-Instruct {precision}", resolve_model_path(spec))
    if kind == "synthetic" and rest:
        from onnxgen.convert.synthetic import LLAMA_1B, LLAMA_8B, SyntheticConfig, write_package

        preset, _, over = rest.partition(":")
        presets = {"tiny": SyntheticConfig(), "1b": LLAMA_1B, "8b": LLAMA_8B}
        if preset not in presets:
            raise SystemExit(f"synthetic presets: {', '.join(presets)}; got {preset!r}")
        cfg = dataclasses.replace(presets[preset], **options(over))
        out = work / ("synthetic_" + rest.replace(":", "_").replace(",", "_").replace("=", "-"))
        if not (out / "genai_config.json").is_file():
            write_package(out, cfg, seed=0)
        return Package(f"synthetic {rest}", out)
    if kind == "qwen_vl" and rest:
        from onnxgen.convert.qwen_vl import VLShape, qwen_vl_package, random_qwen_vl_checkpoint

        preset, _, over = rest.partition(":")
        if preset not in VL_PRESETS:
            raise SystemExit(f"qwen_vl presets: {', '.join(VL_PRESETS)}; got {preset!r}")
        shape = dataclasses.replace(VLShape(**VL_PRESETS[preset]), **options(over))
        name = "qwen_vl_" + rest.replace(":", "_").replace(",", "_").replace("=", "-")
        hf, out = work / f"{name}_hf", work / name
        if not (hf / "config.json").is_file():
            random_qwen_vl_checkpoint(hf, shape)
        if not (out / "genai_config.json").is_file():
            qwen_vl_package(hf, out, cache_dir=work / f"{name}_cache", shape=shape)
        return Package(f"qwen_vl {rest} fp32", out, hf)
    if kind == "builder" and rest:
        from onnxgen.convert.checkpoint import convert_checkpoint
        from onnxgen.convert.reference import SHAPES, random_checkpoint

        shape, precision, ep = _split_precision(rest)
        if shape not in SHAPES:
            raise SystemExit(f"builder shapes: {', '.join(SHAPES)}; got {shape!r}")
        tok = tokenizer or default_tokenizer()
        if tok is None:
            raise SystemExit(
                "builder:* needs SmolLM2's tokenizer files: --tokenizer DIR (or build the default model)"
            )
        hf, out = work / f"{shape}_hf", work / f"{shape}_{precision}_{ep}"
        if not (hf / "config.json").is_file():
            random_checkpoint(hf, SHAPES[shape], tok, device="cuda" if device == "cuda" else "cpu")
        if not (out / "genai_config.json").is_file():
            convert_checkpoint(hf, out, precision=precision, execution_provider=ep, progress=False)
        return Package(f"builder {shape} {precision}", out, hf)
    if kind == "convert" and rest:
        from onnxgen.convert.checkpoint import convert_checkpoint

        src, precision, ep = _split_precision(rest)
        out = work / f"converted_{Path(src).stem}_{precision}_{ep}"
        if not (out / "genai_config.json").is_file():
            convert_checkpoint(src, out, precision=precision, execution_provider=ep, progress=False)
        hf = Path(src) if Path(src).is_dir() else None
        return Package(f"{Path(src).name} {precision}", out, hf)
    path = Path(spec).expanduser()
    if not (path / "genai_config.json").is_file():
        raise SystemExit(f"{spec}: not a package folder (no genai_config.json) nor a model name; see --help")
    return Package(path.name, path)


def models(args: Any) -> list[Package]:
    return [
        resolve(s, work=args.work, tokenizer=args.tokenizer, device=args.device)
        for s in args.model.split(",")
    ]


def config_fields() -> set[str]:
    try:
        from onnxgen.config import Config
    except ImportError:
        return set()
    return set(Config.options())


def load(pkg: Package | Path | str, device: str, opts: dict[str, Any], threads: int = 0) -> Any:
    """`onnxgen.load(path, device=..., **opts)`, with the onnxruntime thread count set when `threads` is.
    A config field this tree's `load()` does not take yet ends the run with a message saying so."""
    import onnxgen
    from onnxgen.errors import InvalidRequest

    path = pkg.path if isinstance(pkg, Package) else Path(pkg)
    opts = dict(opts)
    if threads:
        opts.setdefault("threads", threads)
    try:
        return onnxgen.load(str(path), device=device, **opts)
    except InvalidRequest as exc:
        if exc.field in opts and exc.field in config_fields():
            raise SystemExit(
                f"load option {exc.field}={opts[exc.field]!r} is an onnxgen.config field, but this tree's "
                f"onnxgen.load() does not take it yet ({exc})"
            ) from None
        raise


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    """`n` token ids drawn uniformly from the vocabulary, past the first ids (often special tokens)."""
    import numpy as np

    low = min(100, vocab // 4)
    high = min(vocab, 32000) if vocab > 32000 else vocab
    return np.random.default_rng(seed).integers(low, high, n).tolist()


def step_bytes(path: Path) -> int:
    """Bytes of the package's weights that one decode step reads: every initializer of the decoder graph,
    except tables only gathered from (an embedding reads one row a step); a MoE / QMoE layer's experts count
    for the k of its E experts one token reads (the active weights: attention, router, top-k experts,
    lm_head). int4 weights count as stored."""
    import onnx

    from onnxgen.package.spec import load_spec

    graph = onnx.load(str(load_spec(path).decoder_path), load_external_data=False).graph
    users: dict[str, set[str]] = {}
    share: dict[str, float] = {}  # an expert tensor's share read per token: k / E
    for node in graph.node:
        for name in node.input:
            users.setdefault(name, set()).add(node.op_type)
        if node.op_type in ("MoE", "QMoE"):
            k = next((a.i for a in node.attribute if a.name == "k"), 1)
            e = next((t.dims[0] for t in graph.initializer if t.name == node.input[2]), 0)
            for name in node.input[2:]:
                if name and e:
                    share[name] = min(1.0, k / e)
    size = {1: 4, 2: 1, 3: 1, 5: 2, 6: 4, 7: 8, 10: 2, 11: 8, 16: 2}  # onnx.TensorProto element sizes
    total = 0
    for t in graph.initializer:
        ops = users.get(t.name)
        if not ops or ops <= {"Gather", "GatherBlockQuantized"}:
            continue
        ext = {e.key: e.value for e in t.external_data}
        if "length" in ext:
            nbytes = int(ext["length"])
        elif t.raw_data:
            nbytes = len(t.raw_data)
        else:
            n = 1
            for d in t.dims:
                n *= d
            nbytes = n * size.get(t.data_type, 4)
        total += int(nbytes * share.get(t.name, 1.0))
    return total


def kv_read_bytes(path: Path, tokens: int) -> int:
    """Bytes of KV one decode step reads at `tokens` of context: every layer's keys and values of the context,
    or of its sliding window only (genai_config's `sliding_window`: its layers and `window_size`)."""
    from onnxgen.package.spec import load_spec

    spec = load_spec(path)
    per_layer = spec.kv_bytes_per_token // spec.num_layers
    sw = json.loads((Path(path) / "genai_config.json").read_text())["model"]["decoder"].get("sliding_window")
    local = set(sw.get("layers", ())) if sw else set()
    window = int(sw["window_size"]) if sw else tokens
    return per_layer * sum(min(tokens, window) if i in local else tokens for i in range(spec.num_layers))


# --- timing ------------------------------------------------------------------------------------------


def interleave(rounds: int, contenders: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
    """Run each contender once per round, the order reversed every other round; `rounds` rounds."""
    out: dict[str, list[Any]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            out[name].append(contenders[name]())
    return out


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def p99(xs: Iterable[float]) -> float:
    """The 99th percentile, nearest rank."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(0.99 * len(ys)))]


def spread(xs: Sequence[float]) -> float:
    """Run-to-run noise: interquartile range over the median (0 for fewer than 2 values)."""
    if len(xs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(xs)


# --- peers -------------------------------------------------------------------------------------------


def genai_model(path: Path, threads: int) -> Any:
    """An onnxruntime-genai Model on `path` with `threads` intra-op threads (0: its default)."""
    import onnxruntime_genai as og

    cfg = og.Config(str(path))
    if threads:
        opts = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        cfg.overlay(json.dumps({"model": {"decoder": {"session_options": opts}}}))
    return og.Model(cfg)


def hf_model(hf: Path, dtype: str, device: str) -> Any:
    """transformers on a Hugging Face folder, eager sdpa (cuDNN's SDPA off), in `dtype`. The rotary
    `inv_freq` buffer stays float32 (loading in the dtype keeps it so; `.to(dtype)` would not)."""
    import torch
    from transformers import AutoModelForCausalLM

    if device == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            hf, dtype=getattr(torch, dtype), attn_implementation="sdpa"
        )
    except ValueError:  # no sdpa (gpt-oss: its attention sinks): transformers' eager attention
        model = AutoModelForCausalLM.from_pretrained(
            hf, dtype=getattr(torch, dtype), attn_implementation="eager"
        )
    return model.to(device).eval()


# --- output ------------------------------------------------------------------------------------------


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A markdown table, columns padded."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    return "\n".join(
        [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])]
    )


def report(caption: str, tables: Sequence[tuple[str, str]], args: Any, data: Any) -> None:
    """Print the caption and the tables last; write `data` to --json when asked."""
    if args.json is not None:
        args.json.write_text(json.dumps(data, indent=1, default=str))
    print(f"\n{caption}", flush=True)
    for title, text in tables:
        print(f"\n{title}\n\n{text}" if title else f"\n{text}", flush=True)


def kernels_by_name(prof: Any) -> list[tuple[str, float, int]]:
    """A torch.profiler run's CUDA kernels summed by name: (name, ms, how many), most time first."""
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            row = by_name.setdefault(e.name, [0.0, 0])
            row[0] += e.time_range.elapsed_us() / 1e3
            row[1] += 1
    return sorted(((k, v[0], int(v[1])) for k, v in by_name.items()), key=lambda r: -r[1])


def fmt(x: float | None, digits: int = 1) -> str:
    """A number with thousands separators, or '-' for a missing one."""
    if x is None or x != x:
        return "-"
    return f"{x:,.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"
