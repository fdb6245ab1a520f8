"""`onnxgen convert SRC OUT`: turn a Hugging Face folder or a GGUF file into a model package."""

from __future__ import annotations

import argparse
import sys

from onnxgen.errors import OnnxgenError

DESCRIPTION = """\
Convert a checkpoint into an ONNX Runtime GenAI model package that `onnxgen generate` can run.

SRC is either a Hugging Face model folder (config.json + *.safetensors/*.bin + tokenizer files) or
a single .gguf file (dequantized to float32 with transformers first). The conversion itself is
done by onnxruntime-genai's model builder; its output goes to a log file and a progress display
is shown instead. OUT is written atomically: it appears only once the package is complete.

Settings of transformers-5 checkpoints that the builder misreads (Gemma 3's RoPE per layer type,
Mistral/Phi-3 windows, LongRoPE, OLMo and Nemotron norms, SmolLM3's layers without RoPE) are normalized
on the way; an architecture the builder cannot convert, or whose package onnxgen cannot run, fails at
once with its name.

Valid --precision/--execution-provider pairs: fp32/cpu, int4/cpu, fp32/cuda, fp16/cuda, bf16/cuda,
int4/cuda. Needs the `convert` extra: pip install 'onnxgen[convert]'.
"""

EPILOG = """\
examples:
  onnxgen convert ./SmolLM2-135M-Instruct ./smollm2-fp32
  onnxgen convert ./model.Q8_0.gguf ./model-int4 --precision int4
  onnxgen convert ./Llama-3.2-1B ./llama-bf16 --precision bf16 --execution-provider cuda
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add the `convert` subcommand to `subparsers` and return its parser (`func=run`)."""
    from onnxgen.convert.checkpoint import EXECUTION_PROVIDERS, PRECISIONS

    p = subparsers.add_parser(
        "convert",
        help="convert a Hugging Face folder or a GGUF file into a model package",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC", help="Hugging Face model folder, or a .gguf file")
    p.add_argument("out", metavar="OUT", help="output package folder (must not exist or be empty)")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="weight precision of the package (default: fp32; int4 quantizes MatMul weights)",
    )
    p.add_argument(
        "--execution-provider",
        "-e",
        choices=EXECUTION_PROVIDERS,
        default="cpu",
        help="device the package is built for (default: cpu)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT if it exists and is not empty (only after the new package is complete)",
    )
    p.add_argument(
        "--extra-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="pass KEY=VALUE to the model builder's --extra_options (repeatable), e.g. block_size=64",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress display")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the conversion; print the package path to stdout. Returns 0, or 1 with the error on stderr."""
    from onnxgen.cli.progress import RichReporter
    from onnxgen.convert.checkpoint import convert_checkpoint

    extra: dict[str, object] = {}
    for item in getattr(args, "extra_option", []) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"error: --extra-option expects KEY=VALUE, got {item!r}", file=sys.stderr)
            return 2
        extra[key] = value
    try:
        out = convert_checkpoint(
            args.src,
            args.out,
            precision=args.precision,
            execution_provider=args.execution_provider,
            progress=RichReporter(enabled=not getattr(args, "quiet", False)),
            extra_options=extra or None,
            overwrite=args.overwrite,
        )
    except OnnxgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; nothing was written to OUT", file=sys.stderr)
        return 130
    print(out)
    return 0
