"""Mutation testing of the engine and KV core: plant one small bug at a time and see whether a test fails.

    python benchmarks/mutation.py                       # every module of src/onnxgen/engine and kv
    python benchmarks/mutation.py --only engine/reuse.py --list      # the mutants, without running
    python benchmarks/mutation.py --report /tmp/mut.jsonl            # resumable: done mutants are skipped

Mutants (one per site, made on the AST and written back with `ast.unparse`): arithmetic operator swaps
(+ -, * //, ...), comparison boundaries and negations (< <=, > >=, == !=, is / is not, in / not in),
`and` / `or`, a dropped `not`, True / False, an integer constant + 1, a slice bound shrunk by one, a
dropped statement (a call, an augmented assignment, an assignment to an attribute or item) and a return
value replaced by None. Docstrings, f-strings, annotations, `assert` statements and `TYPE_CHECKING`
blocks are left alone.

How it runs: the source tree is copied once to a temporary folder; a parent process imports the heavy
third-party modules (numpy, torch, onnxruntime, tokenizers, hypothesis, pytest) and then, per mutant,
writes the mutated module into the copy and forks a child that runs pytest with `-x`, importing onnxgen
from the copy. The tests run are the module's selection (`SELECT`, fast tests only) narrowed to those that
execute the mutated line in a clean run (coverage contexts per test; a mutant outside function bodies, such
as a default argument or a module constant, gets the whole selection). A mutant is *killed*
when the selection fails, *timeout* when it runs past `--timeout-factor` x the clean run (+10 s; counted as
detected), *survived* when every test passes, and *uncovered* (a survivor) when the clean run of the
selection never executes the mutated line (coverage of the clean run; such mutants are not run).
Score = (killed + timeout) / all mutants.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"

# Per module: the fast, relevant pytest arguments (test files by name, found anywhere under tests/, and -k).
# Hypothesis property tests, SmolLM2 and server tests are left out; the ort backend (per-request decoders) and
# the native backend (the paged pool) exercise different engine modules, so each module names the backend whose
# path runs it.
_NO_SLOW = "not random_request and not batched_requests_equal and not smollm2 and not server and not cuda"
_REUSE = ["test_reuse.py", "test_reuse_edges.py"]
_ORT = f"not native and {_NO_SLOW}"
SELECT: dict[str, list[str]] = {
    "engine/reuse.py": [*_REUSE, "-k", _ORT],
    "engine/identity.py": [*_REUSE, "-k", _NO_SLOW],
    "engine/slots.py": [*_REUSE, "test_engine.py", "-k", _ORT],
    "engine/paged.py": [*_REUSE, "test_batching.py", "-k", f"not ort and {_NO_SLOW}"],
    "engine/session.py": [*_REUSE, "test_engine.py", "test_concurrency.py", "-k", _ORT],
    "engine/engine.py": [
        "test_engine.py",
        "test_engine_edges.py",
        "test_tools.py",
        *_REUSE,
        "test_batching.py",
        "-k",
        _NO_SLOW,
    ],
    "engine/result.py": [
        "test_engine.py",
        "test_engine_edges.py",
        "test_reuse_edges.py",
        "-k",
        _ORT,
    ],
    "engine/request.py": [
        "test_scheduler.py",
        "test_request.py",
        "test_engine.py",
        "test_engine_edges.py",
        "-k",
        _ORT,
    ],
    "engine/scheduler.py": [
        "test_scheduler.py",
        "test_request.py",
        "test_batching.py",
        "-k",
        _NO_SLOW,
    ],
    "kv/pages.py": ["test_kv_pages.py", "test_kv_edges.py"],
    "kv/prefix.py": ["test_kv_pages.py", "test_kv_edges.py"],
    "kv/manager.py": [
        "test_kv_pages.py",
        "test_kv_edges.py",
        "test_reuse_edges.py",
        "test_batching.py",
        "-k",
        _NO_SLOW,
    ],
    "kv/storage.py": [
        "test_kv_pages.py",
        "test_kv_edges.py",
        "test_paged_attention.py",
        "test_native_runner.py",
        "-k",
        "not cuda and not triton",
    ],
    "kv/buffers.py": [
        "test_native_backend.py",
        "test_decoder_contract.py",
        "test_kv_edges.py",
        "-k",
        "not cuda and not smollm2 and not fp16 and not int4 and not parity and not static "
        "and not unsupported and not ort",
    ],
}

_BINOP = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.FloorDiv: ast.Mult,
    ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.BitOr: ast.BitAnd,
    ast.BitAnd: ast.BitOr,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
    ast.Pow: ast.Mult,
}
_CMP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_SYM = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.FloorDiv: "//",
    ast.Div: "/",
    ast.Mod: "%",
    ast.BitOr: "|",
    ast.BitAnd: "&",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.Pow: "**",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.And: "and",
    ast.Or: "or",
}


_TYPE_NAMES = {
    "int",
    "str",
    "bytes",
    "bytearray",
    "memoryview",
    "float",
    "bool",
    "list",
    "dict",
    "tuple",
    "set",
}


def _is_type(e: ast.expr) -> bool:
    if isinstance(e, ast.BinOp):
        return isinstance(e.op, ast.BitOr) and _is_type(e.left) and _is_type(e.right)
    if isinstance(e, ast.Name):
        return e.id[:1].isupper() or e.id in _TYPE_NAMES
    if isinstance(e, ast.Attribute):
        return e.attr[:1].isupper()
    if isinstance(e, ast.Subscript):
        return _is_type(e.value)
    return isinstance(e, ast.Constant) and e.value is None


class _Mutator(ast.NodeTransformer):
    """Walks a module in a fixed order, numbering mutation sites; applies site `target` (None: none)."""

    def __init__(self, target: int | None) -> None:
        self.target = target
        self.sites: list[tuple[int, str, bool]] = []  # (line, description, inside a function body)
        self._depth = 0

    def _site(self, node: ast.AST, desc: str) -> bool:
        """Register a site; True when it is the one to apply."""
        self.sites.append((getattr(node, "lineno", 0), desc, self._depth > 0))
        return len(self.sites) - 1 == self.target

    # --- what is never mutated -------------------------------------------------------------------------
    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        return node

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.AST:
        return node

    def visit_arg(self, node: ast.arg) -> ast.AST:
        return node

    def visit_If(self, node: ast.If) -> ast.AST:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return node
        return self.generic_visit(node)

    def _visit_def(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        node.returns = node.returns  # annotations untouched (visit_arg covers the arguments)
        node.decorator_list = [self.visit(d) for d in node.decorator_list]
        node.args = self.visit(node.args)
        self._depth += 1
        node.body = self._body(node.body)
        self._depth -= 1
        return node

    visit_FunctionDef = _visit_def
    visit_AsyncFunctionDef = _visit_def

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is not None:
            node.value = self.visit(node.value)
        return node

    # --- statements: dropped or with a return value replaced --------------------------------------------
    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out = []
        for i, stmt in enumerate(body):
            docstring = i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
            droppable = not docstring and (
                (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call))
                or isinstance(stmt, ast.AugAssign)
                or (
                    isinstance(stmt, ast.Assign)
                    and all(isinstance(t, ast.Attribute | ast.Subscript) for t in stmt.targets)
                )
            )
            if droppable and self._site(stmt, f"drop `{ast.unparse(stmt)[:60]}`"):
                out.append(ast.copy_location(ast.Pass(), stmt))
                continue
            if (
                isinstance(stmt, ast.Return)
                and stmt.value is not None
                and not (isinstance(stmt.value, ast.Constant) and stmt.value.value is None)
            ):
                if self._site(stmt, f"`{ast.unparse(stmt)[:50]}` -> `return None`"):
                    out.append(ast.copy_location(ast.Return(ast.Constant(None)), stmt))
                    continue
            out.append(stmt if docstring else self.visit(stmt))
        return out

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for field, value in ast.iter_fields(node):
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                setattr(node, field, self._body(value))
            elif isinstance(value, list):
                value[:] = [self.visit(x) if isinstance(x, ast.AST) else x for x in value]
            elif isinstance(value, ast.AST):
                setattr(node, field, self.visit(value))
        return node

    def visit_Module(self, node: ast.Module) -> ast.AST:
        node.body = self._body(node.body)
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        node.body = self._body(node.body)
        return node

    # --- expressions --------------------------------------------------------------------------------------
    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        if _is_type(node):  # `A | B` naming types: a union, not arithmetic
            return node
        new = _BINOP.get(type(node.op))
        if new is not None and self._site(node, f"`{_SYM[type(node.op)]}` -> `{_SYM[new]}`"):
            node.op = new()
        return node

    def visit_AugAssign(self, node: ast.AugAssign) -> ast.AST:
        self.generic_visit(node)
        new = _BINOP.get(type(node.op))
        if new is not None and self._site(node, f"`{_SYM[type(node.op)]}=` -> `{_SYM[new]}=`"):
            node.op = new()
        return node

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        for i, op in enumerate(node.ops):
            new = _CMP.get(type(op))
            if new is not None and self._site(node, f"`{_SYM[type(op)]}` -> `{_SYM[new]}`"):
                node.ops[i] = new()
        return node

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        self.generic_visit(node)
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        if self._site(node, f"`{_SYM[type(node.op)]}` -> `{_SYM[new]}`"):
            node.op = new()
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.op, ast.Not) and self._site(node, "drop `not`"):
            return node.operand
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if isinstance(node.value, bool):
            if self._site(node, f"`{node.value}` -> `{not node.value}`"):
                return ast.copy_location(ast.Constant(not node.value), node)
        elif isinstance(node.value, int) and self._site(node, f"`{node.value}` -> `{node.value + 1}`"):
            return ast.copy_location(ast.Constant(node.value + 1), node)
        return node

    def visit_Slice(self, node: ast.Slice) -> ast.AST:
        self.generic_visit(node)
        if node.lower is not None and self._site(node.lower, f"slice lower `{ast.unparse(node.lower)}` + 1"):
            node.lower = ast.BinOp(node.lower, ast.Add(), ast.Constant(1))
        if node.upper is not None and self._site(node.upper, f"slice upper `{ast.unparse(node.upper)}` - 1"):
            node.upper = ast.BinOp(node.upper, ast.Sub(), ast.Constant(1))
        return node


def sites(source: str) -> list[tuple[int, str, bool]]:
    m = _Mutator(None)
    m.visit(ast.parse(source))
    return m.sites


def mutate(source: str, k: int) -> str:
    tree = ast.parse(source)
    m = _Mutator(k)
    tree = m.visit(copy.deepcopy(tree))
    return ast.unparse(ast.fix_missing_locations(tree))


@dataclass
class Outcome:
    module: str
    index: int
    line: int
    mutation: str
    status: str  # killed | survived | timeout | uncovered
    seconds: float


# --- running ---------------------------------------------------------------------------------------------


def _resolve(select: list[str]) -> list[str]:
    """A selection's test file names as paths under tests/ (wherever the layout keeps them)."""
    out = []
    for arg in select:
        if arg.startswith("test_") and arg.endswith(".py"):
            found = sorted((REPO / "tests").rglob(arg))
            if len(found) != 1:
                raise SystemExit(f"mutation: {arg} is {'ambiguous' if found else 'not found'} under tests/")
            arg = str(found[0].relative_to(REPO))
        out.append(arg)
    return out


def _preload() -> None:
    """Import what every test run needs but no mutant changes, once, before forking."""
    import numpy  # noqa: F401
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401
    import pytest  # noqa: F401
    import tokenizers  # noqa: F401
    from hypothesis import strategies  # noqa: F401

    try:
        import torch  # noqa: F401
    except ImportError:
        pass


def _child(tree: Path, args: list[str], log: Path, cover: str | None, cover_out: Path | None) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(REPO)
    sys.path.insert(0, str(tree))
    import pytest

    cov = None
    plugins = []
    if cover is not None:
        import coverage

        cov = coverage.Coverage(data_file=None, include=[cover], config_file=False)

        class Contexts:  # lines run by each test (fixture setup included); "" = at import
            @pytest.hookimpl(hookwrapper=True)
            def pytest_runtest_protocol(self, item, nextitem):
                cov.switch_context(item.nodeid)
                yield
                cov.switch_context("")

        plugins.append(Contexts())
        cov.start()
    rc = pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-p", "no:cov", *args], plugins=plugins)
    import onnxgen

    if not str(Path(onnxgen.__file__).resolve()).startswith(str(tree.resolve())):
        print(f"mutation: imported onnxgen from {onnxgen.__file__}, not from {tree}", flush=True)
        rc = 99
    if cov is not None and cover_out is not None:
        cov.stop()
        by_line = cov.get_data().contexts_by_lineno(cover)
        cover_out.write_text(json.dumps({str(k): sorted(v) for k, v in by_line.items()}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(rc))


def run_tests(
    tree: Path,
    args: list[str],
    timeout: float,
    log: Path,
    cover: str | None = None,
    cover_out: Path | None = None,
) -> tuple[str, float, int]:
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            _child(tree, args, log, cover, cover_out)
        finally:
            os._exit(98)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            return ("survived" if rc == 0 else "killed"), time.perf_counter() - t0, rc
        if time.perf_counter() - t0 > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", time.perf_counter() - t0, -9
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--only", default="", help="comma-separated modules under src/onnxgen (default: all in SELECT)"
    )
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--report", type=Path, help="JSON lines of outcomes; mutants already in it are skipped")
    ap.add_argument("--timeout-factor", type=float, default=3.0)
    ap.add_argument("--lines", default="", help="only mutants on these lines: module:line,module:line")
    ap.add_argument(
        "--sample",
        type=int,
        default=0,
        help="run a seeded random sample of this many mutants per module (0: all)",
    )
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    ap.add_argument(
        "--retry-survivors",
        action="store_true",
        help="run again the mutants the report lists as survived or uncovered (after adding tests)",
    )
    args = ap.parse_args()
    modules = [m for m in args.only.split(",") if m] or list(SELECT)
    unknown = [m for m in modules if m not in SELECT]
    if unknown:
        ap.error(f"no test selection for {unknown}; known: {', '.join(SELECT)}")
    only_lines = {tuple(x.rsplit(":", 1)) for x in args.lines.split(",") if x}
    plan = {m: sites((SRC / "onnxgen" / m).read_text()) for m in modules}
    if args.list:
        for m, ss in plan.items():
            for i, (line, desc, _) in enumerate(ss):
                print(f"{m}:{line} #{i} {desc}")
        print(f"{sum(map(len, plan.values()))} mutants in {len(plan)} modules")
        return
    done: dict[tuple[str, int], Outcome] = {}
    if args.report and args.report.exists():
        for line in args.report.read_text().splitlines():
            o = Outcome(**json.loads(line))
            if not (args.retry_survivors and o.status in ("survived", "uncovered")):
                done[(o.module, o.index)] = o
    sys.dont_write_bytecode = True  # the copy is rewritten per mutant: never load a stale .pyc
    _preload()
    results: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="onnxgen-mutation-") as tmp:
        tree = Path(tmp) / "src"
        shutil.copytree(SRC, tree, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        log = Path(tmp) / "pytest.log"
        for m, ss in plan.items():
            target = tree / "onnxgen" / m
            original = target.read_text()
            select = _resolve(SELECT[m])
            cov_out = Path(tmp) / "lines.json"
            status, clean_s, rc = run_tests(tree, select, 1800, log, cover=str(target), cover_out=cov_out)
            if status != "survived":
                raise SystemExit(
                    f"{m}: the clean run of {select} fails (rc {rc}):\n{log.read_text()[-3000:]}"
                )
            covered = {int(k): v for k, v in json.loads(cov_out.read_text()).items()}
            timeout = args.timeout_factor * clean_s + 10
            print(
                f"== {m}: {len(ss)} mutants; clean run {clean_s:.1f} s; {len(covered)} lines covered",
                flush=True,
            )
            chosen_ids = set(range(len(ss)))
            if args.sample and args.sample < len(ss):
                import random

                chosen_ids = set(random.Random(f"{args.seed}:{m}").sample(range(len(ss)), args.sample))
                print(f"   a sample of {args.sample} (seed {args.seed})", flush=True)
            for i, (line, desc, in_body) in enumerate(ss):
                if i not in chosen_ids or (only_lines and (m, str(line)) not in only_lines):
                    continue
                if (m, i) in done:
                    results.append(done[(m, i)])
                    continue
                if line not in covered:
                    o = Outcome(m, i, line, desc, "uncovered", 0.0)
                else:
                    tests = covered[line]
                    # code run at import (a def's defaults, a class body, a module constant) can change any
                    # test, whichever test happened to import the module: run the whole selection
                    chosen = select if (not in_body or "" in tests) else tests
                    target.write_text(mutate(original, i))
                    try:
                        status, secs, _ = run_tests(tree, chosen, timeout, log)
                    finally:
                        target.write_text(original)
                    o = Outcome(m, i, line, desc, status, round(secs, 2))
                results.append(o)
                if args.report:
                    with args.report.open("a") as f:
                        f.write(json.dumps(asdict(o)) + "\n")
                if o.status in ("survived", "uncovered"):
                    print(f"  {o.status:9} {m}:{line} #{i} {desc}", flush=True)
    summary(results)


def summary(results: list[Outcome]) -> None:
    by_mod: dict[str, Counter[str]] = {}
    for o in results:
        by_mod.setdefault(o.module, Counter())[o.status] += 1
    print("\n| module | mutants | killed | timeout | survived | uncovered | score |")
    print("|---|---|---|---|---|---|---|")
    total: Counter[str] = Counter()
    for m, c in by_mod.items():
        total.update(c)
        n = sum(c.values())
        print(
            f"| {m} | {n} | {c['killed']} | {c['timeout']} | {c['survived']} | {c['uncovered']} | "
            f"{(c['killed'] + c['timeout']) / n:.1%} |"
        )
    n = sum(total.values())
    if n:
        print(
            f"| **all** | {n} | {total['killed']} | {total['timeout']} | {total['survived']} | {total['uncovered']} | "
            f"**{(total['killed'] + total['timeout']) / n:.1%}** |"
        )


if __name__ == "__main__":
    main()
