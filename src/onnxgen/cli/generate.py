"""`onnxgen generate`: one prompt in, streamed text out (stdout), a stats line on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from onnxgen.cli.options import add_model_args, add_sampling_args, load_model, sampling_kwargs
from onnxgen.errors import InvalidRequest


def register(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate a reply to one prompt",
        description="Generate a reply. --prompt is a user message rendered through the chat template "
        "(add --raw to feed the text as is); --messages reads a JSON list of {role, content}.",
    )
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the user's message")
    src.add_argument("--messages", type=Path, metavar="FILE.json", help="a JSON list of {role, content} messages")
    p.add_argument("--system", help="a system message to put first")
    p.add_argument("--raw", action="store_true", help="feed --prompt as raw text, without the chat template")
    p.add_argument("--no-stream", action="store_true", help="print the text once at the end")
    add_sampling_args(p)
    c = p.add_argument_group("structured output (llguidance; one of)").add_mutually_exclusive_group()
    c.add_argument("--json", action="store_true", help="the reply is a JSON object")
    c.add_argument("--json-schema", type=Path, metavar="FILE.json", help="the reply is JSON valid against this schema")
    c.add_argument("--regex", metavar="PATTERN", help="the reply matches this regular expression")
    c.add_argument("--grammar", type=Path, metavar="FILE.lark", help="the reply follows this Lark grammar")
    p.set_defaults(func=run)


def build_prompt(args: argparse.Namespace) -> str | list[dict[str, Any]]:
    if args.messages is not None:
        try:
            messages = json.loads(args.messages.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidRequest(f"{args.messages}: cannot read a JSON list of messages ({exc})", field="messages") from exc
        if not isinstance(messages, list):
            raise InvalidRequest(f"{args.messages}: must hold a JSON list of {{role, content}} objects", field="messages")
    else:
        if args.raw:
            if args.system:
                raise InvalidRequest("--system needs the chat template; drop --raw or --system", field="system")
            return str(args.prompt)
        messages = [{"role": "user", "content": args.prompt}]
    if args.system:
        messages = [{"role": "system", "content": args.system}, *messages]
    return messages


def constraint(args: argparse.Namespace) -> tuple[str, Any] | None:
    """The structured-output constraint the flags ask for: (kind, source) or None."""
    if args.json:
        return "json_object", None
    if args.regex is not None:
        return "regex", args.regex
    for kind, path in (("json_schema", args.json_schema), ("lark", args.grammar)):
        if path is not None:
            try:
                return kind, path.read_text(encoding="utf-8")
            except OSError as exc:
                raise InvalidRequest(f"{path}: cannot read ({exc.strerror})", field=kind) from exc
    return None


def run(args: argparse.Namespace) -> int:
    wanted = constraint(args)
    model = load_model(args)
    prompt = build_prompt(args)
    processors = []
    if wanted is not None:
        from onnxgen.sampling.grammar import grammar_processor

        processors.append(grammar_processor(model, *wanted))

    def emit(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = model.generate(prompt, on_token=None if args.no_stream else emit, processors=processors,
                            **sampling_kwargs(args))  # fmt: skip
    if args.no_stream:
        sys.stdout.write(result.text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = result.stats
    print(
        f"[ {s.prompt_tokens} prompt tokens · {s.generated_tokens} generated · ttft {s.ttft_s * 1000:.0f} ms · "
        f"{s.decode_tok_s:.1f} tok/s · {s.backend}/{s.device} · finish {result.finish_reason} ]",
        file=sys.stderr,
    )
    return 0
