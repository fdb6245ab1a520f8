"""`onnxgen show`: describe a package (shapes, I/O, dtype, tokens, defaults) without running it; `--options`
lists every load option (the config's fields and defaults) and `--env` every `ONNXGEN_*` variable."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser(
        "show", help="describe a model package", description="Print what onnxgen reads from a package."
    )
    p.add_argument(
        "model", nargs="?", default=None, metavar="MODEL", help="package folder (default: the embedded model)"
    )
    p.add_argument(
        "--options", action="store_true", help="list every load option with its section and default"
    )
    p.add_argument("--env", action="store_true", help="list every ONNXGEN_* environment variable")
    p.set_defaults(func=run)


def show_options() -> None:
    """Every flat load option (`onnxgen.load(..., name=value)`, `Config.replace`), its section and default."""
    import dataclasses

    from rich.console import Console
    from rich.table import Table

    from onnxgen.config import Config

    t = Table(title="load options (None: decided by device and backend)")
    t.add_column("option", no_wrap=True, min_width=max(len(n) for n in Config.options()))
    t.add_column("section", no_wrap=True)
    t.add_column("default")
    for sec in dataclasses.fields(Config):
        for f in dataclasses.fields(getattr(Config(), sec.name)):
            t.add_row(f.name, sec.name, repr(f.default))
    Console().print(t)


def show_env() -> None:
    from rich.console import Console
    from rich.table import Table

    import onnxgen.envs as envs

    rows = envs.describe()
    t = Table(title="environment variables")
    t.add_column("variable", no_wrap=True, min_width=max(len(n) for n, _, _ in rows))
    t.add_column("default", no_wrap=True)
    t.add_column("what it does")
    for name, default, doc in rows:
        t.add_row(name, default, doc)
    Console().print(t)


def run(args: argparse.Namespace) -> int:
    if args.options or args.env:
        if args.options:
            show_options()
        if args.env:
            show_env()
        return 0
    from rich.console import Console
    from rich.table import Table

    from onnxgen.cli.progress import RichReporter
    from onnxgen.convert.default import resolve_model_path
    from onnxgen.package.spec import load_spec

    spec = load_spec(resolve_model_path(args.model, progress=RichReporter()))
    t = Table(title=str(spec.path), show_header=False)
    rows = [
        ("model type", spec.model_type),
        ("graph", spec.decoder_path.name),
        (
            "layers / heads / kv heads / head size",
            f"{spec.num_layers} / {spec.num_heads} / {spec.num_kv_heads} / {spec.head_size}",
        ),
        ("hidden / vocab", f"{spec.hidden_size} / {spec.vocab_size}"),
        ("context length", str(spec.context_length)),
        (
            "KV dtype / layout",
            f"{spec.kv_dtype} / {spec.kv_layout} ({spec.kv_bytes_per_token} bytes per token)",
        ),
        ("bos / eos / pad", f"{spec.bos_token_id} / {list(spec.eos_token_ids)} / {spec.pad_token_id}"),
        ("chunk size", str(spec.chunk_size)),
        ("chat template", "yes" if spec.chat_template else "no"),
        ("search defaults", ", ".join(f"{k}={v}" for k, v in vars(spec.search).items())),
        (
            "inputs",
            ", ".join(f"{i.name}{list(i.shape)}:{i.dtype}" for i in spec.inputs[:4])
            + (" ..." if len(spec.inputs) > 4 else ""),
        ),
        ("extra inputs", ", ".join(i.name for i in spec.extra_inputs) or "none"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    return 0
