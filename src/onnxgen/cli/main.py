"""`onnxgen` command line: generate | chat | serve | convert | show.

Generated text goes to stdout; stats, progress and errors go to stderr. Typed onnxgen errors
print one line naming the problem and the fix, and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from onnxgen.errors import OnnxgenError

# Each module exposes register(subparsers) and sets `func` on its parser.
COMMANDS = ("generate", "chat", "serve", "convert", "show")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnxgen",
        description="Run generative ONNX model packages (ONNX Runtime GenAI format) with KV reuse across turns.",
        epilog="MODEL is a package folder; omit it (or write 'default') for the embedded SmolLM2-135M-Instruct.",
    )
    from onnxgen import __version__

    parser.add_argument("--version", action="version", version=f"onnxgen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"onnxgen.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("onnxgen.cli."):
                continue  # command not built into this version
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except OnnxgenError as exc:
        print(f"onnxgen: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
