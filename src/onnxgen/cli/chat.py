"""`onnxgen chat`: an interactive conversation on one session.

Each turn re-renders the whole history through the chat template, so the session's KV reuse is
what keeps turns fast: only the new suffix is prefilled. On a terminal a stats line follows each
reply on stderr; with piped stdin/stdout it is a plain line loop (one line in, the reply out).
Ctrl-C stops the current reply; the partial reply stays in the history and the session simply
recomputes what it no longer holds. `--save FILE` writes the conversation (messages and KV, a session file)
on exit; `--resume FILE` continues it, its KV reused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from onnxgen.cli.options import add_model_args, add_sampling_args, load_model, sampling_kwargs
from onnxgen.errors import OnnxgenError

HELP = """commands:
  /help          this text
  /reset         forget the conversation and empty the KV cache
  /system TEXT   set the system message (the next turn reuses the cache up to where it changed)
  /stats         the last reply's numbers and what the session retains
  /exit          leave (also Ctrl-D)"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "chat",
        help="chat interactively (KV reused across turns)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    p.add_argument("--system", help="a system message for the conversation")
    p.add_argument(
        "--save", type=Path, metavar="FILE", help="save the conversation and its KV to FILE on exit"
    )
    p.add_argument(
        "--resume",
        type=Path,
        metavar="FILE",
        help="continue the conversation a --save wrote to FILE (its KV reused)",
    )
    add_sampling_args(p)
    p.set_defaults(func=run)


class Repl:
    """The chat loop over one session; I/O streams are injectable for tests."""

    def __init__(
        self,
        model: Any,
        sampling: dict[str, Any],
        system: str | None,
        stdin: TextIO,
        stdout: TextIO,
        stderr: TextIO,
    ) -> None:
        self.model = model
        self.session = model.session("chat")
        self.sampling = sampling
        self.system = system
        self.history: list[dict[str, str]] = []
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.interactive = stdin.isatty() and stdout.isatty()
        self.last: Any = None

    def resume(self, path: Path) -> None:
        """Continue the conversation `save` wrote to `path`: its messages, and its KV (`Model.restore_session`).
        Raises `SessionFileError` (then nothing changed)."""
        session = self.model.restore_session(path, "chat")
        saved = json.loads(session.note or "{}")
        self.session.close()
        self.session = session
        self.system = saved.get("system", self.system)
        self.history = list(saved.get("history", []))

    def save(self, path: Path) -> int:
        """Save the conversation's messages and KV to `path` (a session file); returns its size."""
        note = json.dumps({"system": self.system, "history": self.history})
        return self.session.save(path, note=note)

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def command(self, line: str) -> bool:
        """Handle a /command; return False to exit."""
        cmd, _, arg = line.partition(" ")
        if cmd in ("/exit", "/quit"):
            return False
        if cmd == "/help":
            print(HELP, file=self.stdout)
        elif cmd == "/reset":
            self.history.clear()
            self.session.clear()
            print("[ conversation and KV cache cleared ]", file=self.stdout)
        elif cmd == "/system":
            self.system = arg.strip() or None
            print(f"[ system message {'set' if self.system else 'cleared'} ]", file=self.stdout)
        elif cmd == "/stats":
            last = self.last.stats.line() if self.last is not None else "[ no reply yet ]"
            print(last, file=self.stdout)
            print(
                f"[ session retains {self.session.retained_tokens} tokens · "
                f"{self.session.kv_bytes() / 2**20:.1f} MiB of KV ]",
                file=self.stdout,
            )
        else:
            print(f"unknown command {cmd!r}; /help lists them", file=self.stdout)
        self.stdout.flush()
        return True

    def turn(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})
        pieces: list[str] = []

        def emit(piece: str) -> None:
            pieces.append(piece)
            self.stdout.write(piece)
            self.stdout.flush()

        try:
            self.last = self.session.generate(self.messages(), on_token=emit, **self.sampling)
            reply = self.last.text
        except KeyboardInterrupt:
            reply = "".join(pieces)
            self.stdout.write(" [interrupted]")
        except OnnxgenError as exc:
            self.history.pop()
            print(f"error: {exc}", file=self.stderr)
            return
        self.stdout.write("\n")
        self.stdout.flush()
        self.history.append({"role": "assistant", "content": reply})
        if self.interactive and self.last is not None:
            print(self.last.stats.line(), file=self.stderr)

    def loop(self) -> int:
        if self.interactive:
            print("onnxgen chat — /help for commands, Ctrl-D to leave", file=self.stderr)
        while True:
            try:
                if self.interactive:
                    line = input("> ")
                else:
                    raw = self.stdin.readline()
                    if not raw:
                        break
                    line = raw.rstrip("\n")
            except EOFError:
                break
            except KeyboardInterrupt:
                print("", file=self.stderr)
                continue
            if not line.strip():
                continue
            if line.startswith("/"):
                if not self.command(line.strip()):
                    break
                continue
            self.turn(line)
        return 0


def run(args: argparse.Namespace) -> int:
    model = load_model(args)
    repl = Repl(model, sampling_kwargs(args), args.system, sys.stdin, sys.stdout, sys.stderr)
    if args.resume is not None:
        repl.resume(args.resume)
        print(
            f"[ resumed {len(repl.history)} messages, {repl.session.retained_tokens} tokens of KV ]",
            file=sys.stderr,
        )
    code = repl.loop()
    if args.save is not None and repl.session.retained_tokens:
        size = repl.save(args.save)
        print(f"[ saved the conversation to {args.save} ({size / 2**20:.1f} MiB) ]", file=sys.stderr)
    return code
