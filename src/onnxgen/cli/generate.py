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
    src.add_argument(
        "--messages", type=Path, metavar="FILE.json", help="a JSON list of {role, content} messages"
    )
    p.add_argument("--system", help="a system message to put first")
    p.add_argument("--raw", action="store_true", help="feed --prompt as raw text, without the chat template")
    p.add_argument("--no-stream", action="store_true", help="print the text once at the end")
    add_sampling_args(p)
    c = p.add_argument_group("structured output (llguidance; one of)").add_mutually_exclusive_group()
    c.add_argument("--json", action="store_true", help="the reply is a JSON object")
    c.add_argument(
        "--json-schema", type=Path, metavar="FILE.json", help="the reply is JSON valid against this schema"
    )
    c.add_argument("--regex", metavar="PATTERN", help="the reply matches this regular expression")
    c.add_argument("--grammar", type=Path, metavar="FILE.lark", help="the reply follows this Lark grammar")
    t = p.add_argument_group("tool calling")
    t.add_argument(
        "--tools",
        type=Path,
        metavar="FILE.json",
        help="OpenAI-style tool definitions (a JSON list); the reply is printed as JSON: "
        "{content, tool_calls, finish_reason}",
    )
    t.add_argument(
        "--tool-choice",
        default="auto",
        metavar="auto|required|none|NAME",
        help="auto (text or calls; default), required (calls only), none, or a tool's name",
    )
    p.set_defaults(func=run)


def read_tools(args: argparse.Namespace) -> tuple[list[Any] | None, Any]:
    """(tools, tool_choice) from --tools / --tool-choice."""
    if args.tools is None:
        if args.tool_choice != "auto":
            raise InvalidRequest("--tool-choice needs --tools FILE.json", field="tool_choice")
        return None, None
    try:
        tools = json.loads(args.tools.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequest(
            f"{args.tools}: cannot read a JSON list of tools ({exc})", field="tools"
        ) from exc
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest(f"{args.tools}: must hold a non-empty JSON list of tools", field="tools")
    choice = args.tool_choice
    if choice not in ("auto", "required", "none"):
        choice = {"type": "function", "function": {"name": choice}}
    return tools, choice


def build_prompt(args: argparse.Namespace) -> str | list[dict[str, Any]]:
    if args.messages is not None:
        try:
            messages = json.loads(args.messages.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidRequest(
                f"{args.messages}: cannot read a JSON list of messages ({exc})", field="messages"
            ) from exc
        if not isinstance(messages, list):
            raise InvalidRequest(
                f"{args.messages}: must hold a JSON list of {{role, content}} objects", field="messages"
            )
    else:
        if args.raw:
            if args.system:
                raise InvalidRequest(
                    "--system needs the chat template; drop --raw or --system", field="system"
                )
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
    tools, tool_choice = read_tools(args)
    if tools is not None and (wanted is not None or args.raw):
        raise InvalidRequest(
            "--tools cannot be combined with --raw or a structured-output flag", field="tools"
        )
    model = load_model(args)
    prompt = build_prompt(args)
    processors = []
    if wanted is not None:
        from onnxgen.sampling.grammar import grammar_processor

        processors.append(grammar_processor(model, *wanted))

    def emit(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    if tools is not None:  # the reply is structured: print it once, as JSON
        result = model.generate(
            prompt, processors=processors, tools=tools, tool_choice=tool_choice, **sampling_kwargs(args)
        )
        sys.stdout.write(
            json.dumps(
                {
                    "content": result.content,
                    "tool_calls": [c.openai() for c in result.tool_calls],
                    "finish_reason": result.finish_reason,
                },
                ensure_ascii=False,
                indent=2,
            )
        )
    else:
        result = model.generate(
            prompt, on_token=None if args.no_stream else emit, processors=processors, **sampling_kwargs(args)
        )
    if args.no_stream and tools is None:
        sys.stdout.write(result.text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = result.stats
    drafts = f" · {s.accepted_tokens}/{s.draft_tokens} drafts kept" if s.draft_tokens else ""
    print(
        f"[ {s.prompt_tokens} prompt tokens · {s.generated_tokens} generated · ttft {s.ttft_s * 1000:.0f} ms · "
        f"{s.decode_tok_s:.1f} tok/s{drafts} · {s.backend}/{s.device} · finish {result.finish_reason} ]",
        file=sys.stderr,
    )
    return 0
