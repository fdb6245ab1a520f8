"""Structural rules from ARCHITECTURE.md and REUSE.md, checked on the source tree."""

from __future__ import annotations

import ast
from pathlib import Path

import onnxgen

SRC = Path(onnxgen.__file__).parent
SEAM = {"kv_len", "rewind_to", "reset"}


def _calls(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SEAM:
            out.append((node.func.attr, node.lineno))
    return out


def test_only_the_reuse_policy_drives_the_kv_seam():
    """REUSE.md 6: outside backends (which implement the seam), only engine/reuse.py calls
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


def test_backends_do_not_import_the_engine_and_kv_imports_no_backend():
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        imported = _imports(path)
        if rel.startswith("backends/"):
            assert not any(m.startswith("onnxgen.engine") for m in imported), rel
        if rel.startswith("kv/"):
            assert not any(m.startswith("onnxgen.backends") for m in imported), rel


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
