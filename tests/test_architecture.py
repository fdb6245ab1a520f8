"""Structural rules from docs/architecture.md and docs/reuse.md, checked on the source tree."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import onnxgen
from tests.conftest import native_available

SRC = Path(onnxgen.__file__).parent
SEAM = {"kv_len", "rewind_to"}  # names unique to the decoder seam; reset() is checked at run time below


def _calls(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SEAM:
            out.append((node.func.attr, node.lineno))
    return out


def test_only_the_reuse_policy_drives_the_kv_seam():
    """docs/reuse.md, invariant 6: outside backends (which implement the seam), only engine/reuse.py calls
    kv_len/rewind_to/reset on a decoder."""
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(("backends/", "kv/")) or rel == "engine/reuse.py":
            continue
        offenders += [f"{rel}:{line} calls .{name}()" for name, line in _calls(path)]
    assert offenders == []


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize(
    "backend",
    [
        "ort",
        pytest.param(
            "native", marks=pytest.mark.skipif(not native_available(), reason="native backend not importable")
        ),
    ],
)
def test_at_run_time_only_the_policy_calls_the_seam(tiny_dir, monkeypatch, backend):
    """Every kv_len/rewind_to/reset call on a decoder during generation, reuse, eviction, failure
    and cancellation comes from engine/reuse.py (or from inside the backend itself), on both backends."""
    import sys
    import threading

    if backend == "ort":
        from onnxgen.backends.ort.decoder import OrtDecoder as cls
    else:
        from onnxgen.backends.native.decoder import NativeDecoder as cls

    callers: list[str] = []

    def spy(name):
        original = getattr(cls, name)

        def wrapped(self, *a, **k):
            callers.append(Path(sys._getframe(1).f_code.co_filename).as_posix())
            return original(self, *a, **k)

        monkeypatch.setattr(cls, name, wrapped)

    for name in ("kv_len", "rewind_to", "reset"):
        spy(name)
    m = onnxgen.load(str(tiny_dir), backend=backend, threads=1, kv_floor=16, max_sessions=1, paged=False)
    assert m.backend == backend
    a, b = m.session(), m.session()
    base = list(range(3, 40))
    r = a.generate(base, max_new_tokens=4)
    a.generate(base + r.tokens + [5], max_new_tokens=4)  # Keep
    a.generate(base[:10] + [7] + base[11:], max_new_tokens=4)  # Rewind
    b.generate(base, max_new_tokens=4)  # evicts a (max_sessions=1)
    ev = threading.Event()
    try:
        b.generate(base, max_new_tokens=4, on_token=lambda _: ev.set(), cancel=ev)
    except onnxgen.OnnxgenError:
        pass
    m.generate(base, max_new_tokens=2, reuse=False)
    b.clear()
    m.close()
    seen = {Path(c).name for c in callers}
    assert "reuse.py" in seen, "the spy saw no seam calls from the policy"
    bad = sorted(
        {c for c in callers if not (c.endswith("onnxgen/engine/reuse.py") or "/onnxgen/backends/" in c)}
    )
    assert bad == []


@pytest.mark.skipif(not native_available(), reason="native backend not importable")
def test_at_run_time_only_the_kv_manager_changes_pages(tiny_dir, monkeypatch):
    """With paged KV, page holders change only in kv/ (the allocator is driven by the manager and the
    index), the index is changed only by the manager (and pins by engine/paged.py), and the manager is
    called only by engine/paged.py (each class may call itself): through generation, reuse, session eviction, failure, cancellation,
    `reuse=False` and close."""
    import sys
    import threading

    from onnxgen.kv.manager import KVManager
    from onnxgen.kv.pages import PageAllocator
    from onnxgen.kv.prefix import PrefixIndex

    allowed = {
        PageAllocator: ({"alloc", "incref", "decref"}, ("onnxgen/kv/manager.py", "onnxgen/kv/prefix.py")),
        PrefixIndex: (
            {"insert", "insert_path", "evict", "pin", "unpin", "clear"},
            ("onnxgen/kv/prefix.py", "onnxgen/kv/manager.py", "onnxgen/engine/paged.py"),
        ),
        KVManager: (
            {"open", "grow", "commit", "release"},
            ("onnxgen/kv/manager.py", "onnxgen/engine/paged.py"),
        ),
    }
    bad: list[str] = []
    seen: set[str] = set()

    def spy(cls, name, ok):
        original = getattr(cls, name)

        def wrapped(self, *a, **k):
            caller = Path(sys._getframe(1).f_code.co_filename).as_posix()
            seen.add(f"{cls.__name__}.{name}")
            if not caller.endswith(ok):
                bad.append(f"{cls.__name__}.{name} from {caller}")
            return original(self, *a, **k)

        monkeypatch.setattr(cls, name, wrapped)

    for cls, (names, ok) in allowed.items():
        for name in names:
            spy(cls, name, ok)
    m = onnxgen.load(str(tiny_dir), backend="native", max_sessions=1, kv_bytes=6 << 20)
    assert m.paged
    a, b = m.session(), m.session()
    base = list(range(3, 40))
    r = a.generate(base, max_new_tokens=4)
    a.generate(base + r.tokens + [5], max_new_tokens=4)
    a.generate(base[:10] + [7] + base[11:], max_new_tokens=4)
    b.generate(base, max_new_tokens=4)  # unpins a (max_sessions=1)
    ev = threading.Event()
    try:
        b.generate(base, max_new_tokens=4, on_token=lambda _: ev.set(), cancel=ev)
    except onnxgen.OnnxgenError:
        pass
    m.generate(base, max_new_tokens=2, reuse=False)
    b.clear()
    m.close()
    assert {
        "PageAllocator.alloc",
        "PrefixIndex.insert_path",
        "PrefixIndex.pin",
        "PrefixIndex.unpin",
        "KVManager.open",
        "KVManager.commit",
        "KVManager.release",
    } <= seen
    assert bad == []


def test_backends_do_not_import_the_engine_and_kv_imports_no_backend():
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        imported = _imports(path)
        if rel.startswith("backends/"):
            assert not any(m.startswith("onnxgen.engine") for m in imported), rel
        if rel.startswith("kv/"):
            assert not any(m.startswith("onnxgen.backends") for m in imported), rel


def test_a_session_reaches_its_engine_only_through_the_runner_protocol():
    """engine/session.py never imports engine/engine.py, not even for type checking: `Engine` satisfies
    `session.Runner`, so the engine depends on sessions and not the other way round."""
    assert "onnxgen.engine.engine" not in _imports(SRC / "engine" / "session.py")


def test_every_error_type_lives_in_errors_py():
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel == "errors.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                assert not (bases & {"Exception", "OnnxgenError", "ValueError", "RuntimeError"}), (
                    f"{rel}: error class {node.name} belongs in onnxgen/errors.py"
                )


def test_structure_doc_lists_every_module():
    doc = (SRC.parent.parent / "docs" / "structure.md").read_text(encoding="utf-8")
    missing = [
        p.relative_to(SRC.parent).as_posix()
        for p in SRC.rglob("*.py")
        if p.name != "__init__.py" and p.relative_to(SRC.parent).as_posix() not in doc
    ]
    assert missing == [], f"docs/structure.md lacks: {missing}"


# a module's length is a smell test for "one idea per module"; the lowering (one op table) is the exception
MAX_LINES = {"backends/native/lowering.py": None, "engine/engine.py": 399}


def test_no_module_is_over_its_line_bound():
    """No module over 500 lines except the lowering; the engine under 400."""
    over = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        bound = MAX_LINES.get(rel, 500)
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if bound is not None and lines > bound:
            over.append(f"{rel}: {lines} lines (at most {bound})")
    assert over == [], over


def _runtime_imports(path: Path) -> set[str]:
    """Modules `path` imports when it runs (at module level or inside functions), leaving out imports under
    `if TYPE_CHECKING:`; relative imports resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    pkg = "onnxgen." + ".".join(path.relative_to(SRC).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    pkg.rstrip(".").split(".")[: len(pkg.split(".")) - node.level + 1]
                    + ([base] if base else [])
                )
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.startswith("onnxgen")}


def test_no_import_cycles_in_src():
    """Modules of src/onnxgen form no import cycle (function-level imports included: a lazy import is
    still a dependency)."""
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = (
            ".".join(("onnxgen", *parts[:-1])) if parts[-1] == "__init__" else ".".join(("onnxgen", *parts))
        )
        mods[name] = path
    graph = {m: {d for d in _runtime_imports(p) if d in mods and d != m} for m, p in mods.items()}
    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert cycles == [], f"import cycles: {cycles}"


# The rooms of src/onnxgen and what each may import (docs/architecture.md): the layers, lowest first.
ALLOWED = {
    "errors": set(),
    "envs": set(),
    "config": {"errors"},
    "package": {"errors", "envs"},
    "kv": {"errors"},
    "text": {"errors", "package"},
    "sampling": {"errors", "package", "text"},
    "backends": {"errors", "envs", "package", "kv"},
    "convert": {"errors", "envs", "package"},
    "engine": {"errors", "config", "package", "kv", "text", "sampling", "backends"},
    "serve": {"errors", "sampling", "__init__"},  # the public Model/Session API and nothing of the engine
    "__init__": {"errors", "config", "package", "convert", "engine", "sampling"},
    "cli": {
        "errors",
        "config",
        "envs",
        "package",
        "convert",
        "engine",
        "sampling",
        "serve",
        "text",
        "__init__",
    },
}


def _room(rel: str) -> str:
    return rel.split("/")[0].removesuffix(".py")


def test_each_room_imports_only_the_rooms_below_it():
    """Layer order, lazy imports included: e.g. nothing outside cli/ imports cli/, serve/ never reaches
    into the engine, kv/ imports no backend, backends/ import no engine."""
    bad = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        room = _room(rel)
        for mod in _imports(path):
            if not mod.startswith("onnxgen"):
                continue
            parts = mod.split(".")
            target = parts[1] if len(parts) > 1 else "__init__"
            if target != room and target not in ALLOWED[room]:
                bad.append(f"{rel} imports {mod}")
    assert bad == [], bad
    assert set(ALLOWED) == {_room(p.relative_to(SRC).as_posix()) for p in SRC.rglob("*.py")}, (
        "a room without rules"
    )


def test_http_and_schema_libraries_only_in_serve():
    """pydantic, fastapi, starlette and uvicorn live at the HTTP edge only (serve/; the CLI starts it)."""
    edge = ("pydantic", "fastapi", "starlette", "uvicorn")
    bad = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("serve/") or rel == "cli/serve.py":
            continue
        bad += [f"{rel} imports {m}" for m in _imports(path) if m.split(".")[0] in edge]
    assert bad == []


def test_no_environment_variable_is_read_outside_the_registry():
    """`onnxgen/envs.py` is the only module of src/onnxgen that reads the environment (`os.environ`,
    `os.getenv`, `os.environb`): every knob is listed there with what it does."""
    bad = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel == "envs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb", "putenv"):
                bad.append(f"{rel}:{node.lineno} uses os.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                bad += [
                    f"{rel}:{node.lineno} imports os.{a.name}"
                    for a in node.names
                    if a.name.startswith(("environ", "getenv"))
                ]
    assert bad == [], bad


# The documented API of `onnxgen.Model` (README "Python"): nothing else of it is public.
MODEL_API = {
    "backend",
    "chat_template",
    "close",
    "config",
    "default_session",
    "device",
    "encode",
    "eos_token_ids",
    "from_spec",
    "generate",
    "kv_snapshot",
    "kv_stats",
    "max_running",
    "paged",
    "prepare",
    "restore_session",
    "session",
    "settle",
    "spec",
    "submit",
    "tokenizer",
    "tool_format",
}


def test_the_public_model_exposes_only_the_documented_api(tiny_dir):
    """`onnxgen.Model` is a thin face over the engine: its public names are exactly the documented ones (none
    of the engine's parts: executor, scheduler, registry, step ...), on the class and on a loaded model, and
    the README names each."""
    m = onnxgen.load(str(tiny_dir), backend="ort", threads=1)
    assert {n for n in dir(type(m)) if not n.startswith("_")} == MODEL_API
    assert {n for n in vars(m) if not n.startswith("_")} == set()
    readme = (SRC.parent.parent / "README.md").read_text(encoding="utf-8")
    assert [n for n in sorted(MODEL_API) if f"{n}" not in readme] == []


def _defined_names(roots: list[Path]) -> set[str]:
    """Every name the Python files under `roots` define or name: modules, classes, functions, methods,
    parameters, assigned names and attributes (`self.x = ...`), dataclass fields, imported modules, and
    identifier-like string constants (op types registered by name)."""
    names: set[str] = set()
    for root in roots:
        for path in root.rglob("*.py"):
            names.update(path.relative_to(root).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.alias):
                    names.update(node.name.split("."))
                elif (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and node.value.isidentifier()
                ):
                    names.add(node.value)
    return names


def test_structure_doc_names_only_symbols_that_exist():
    """Every code name docs/structure.md mentions in backticks (`Name`, `module.Name`, `Class.method`, a file)
    exists in the tree: the map never describes code that is gone."""
    import re

    root = SRC.parent.parent
    doc = (root / "docs" / "structure.md").read_text(encoding="utf-8")
    names = _defined_names([SRC, root / "tests", root / "benchmarks"])
    files = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]
    missing = []
    for token in re.findall(r"`([^`\n]+)`", doc):
        token = token.strip()
        if " " not in token and ("/" in token or re.search(r"\.(py|md|sh|json|jinja)$", token)):
            path = token.rstrip("/")
            if not any(f == path or f.endswith("/" + path) or f"/{path}/" in f"/{f}" for f in files):
                if not token.endswith((".json", ".jinja")):  # package files named, not files of this tree
                    missing.append(token)
            continue
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(\(\))?", token):
            continue  # prose, values, commands
        last = token.removesuffix("()").split(".")[-1]
        if last.startswith("ONNXGEN_") or last in (
            "onnxgen",
            "gpu",
            "slow",
        ):  # variables, the package, markers
            continue
        if last not in names:
            missing.append(token)
    assert missing == [], f"docs/structure.md names what does not exist: {missing}"
