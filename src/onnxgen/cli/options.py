"""Argument groups shared by several commands (model selection, sampling), defaults in one place."""

from __future__ import annotations

import argparse
from typing import Any

from onnxgen.config import DecodingConfig

DEFAULT_MAX_NEW_TOKENS = DecodingConfig.max_new_tokens  # the CLI's defaults are the config's


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="package folder (default: the embedded SmolLM2-135M-Instruct, built on first use)",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "ort", "native"),
        default="auto",
        help="auto: native on CUDA, ort on CPU (default: auto)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: cpu")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="prefill at most N tokens per step (default: the package's chunk_size, else unchunked)",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the ort backend")
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="shard every layer over N processes (the native backend; gloo on the CPU, NCCL over N GPUs on "
        "CUDA; docs/tensor-parallel.md; default: 1)",
    )
    p.add_argument(
        "--tool-parser",
        choices=("hermes", "llama3_json", "mistral"),
        default=None,
        help="how the model writes tool calls (default: read off the chat template)",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        metavar="N",
        help=f"default: {DEFAULT_MAX_NEW_TOKENS}",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy (default: the package's search settings, greedy unless do_sample)",
    )
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None, help="make sampling reproducible")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    g.add_argument(
        "--speculative",
        choices=("prompt_lookup", "off"),
        default=None,
        help="draft tokens from the context and verify them in one forward; same output "
        "(default: the engine's choice, prompt_lookup; on CUDA a request drafts only while "
        "running alone)",
    )


def load_model(args: argparse.Namespace, **options: Any) -> Any:
    """`onnxgen.load` from the shared model flags (+ `options`); the default model is built with progress bars."""
    import onnxgen

    opts: dict[str, Any] = dict(options)
    if args.threads:
        opts["threads"] = args.threads
    if args.tool_parser:
        opts["tool_parser"] = args.tool_parser
    backend = args.backend
    if args.tensor_parallel != 1:
        opts["tensor_parallel"] = args.tensor_parallel
        if backend == "auto":  # only the native backend shards
            backend = "native"
    from onnxgen.cli.progress import RichReporter
    from onnxgen.convert.default import resolve_model_path

    path = resolve_model_path(args.model, progress=RichReporter())  # builds the default model with bars, once
    return onnxgen.load(str(path), backend=backend, device=args.device, chunk_size=args.prefill_chunk, **opts)


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop,
        "speculative": args.speculative,
    }
