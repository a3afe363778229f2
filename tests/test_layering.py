"""The dependency rule of the layout: the core (`atoll/`) imports no component, compression only the core,
and the coordinator and the nodes never import each other; `atoll.launch` sits above them all. Within the core,
a module never imports one that builds on it (`atoll.modelspec` never imports `atoll.hf`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPONENTS = ("atoll.coordinator", "atoll.node", "atoll.compression", "atoll.launch")
FORBIDDEN = {
    "atoll": COMPONENTS,
    "compression": ("atoll.coordinator", "atoll.node", "atoll.launch"),
    "coordinator": ("atoll.node", "atoll.launch"),
    "node": ("atoll.coordinator", "atoll.launch"),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, ast.Import):
            names.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module:
            names.add(n.module)
            names.update(f"{n.module}.{a.name}" for a in n.names)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_folder_imports_only_what_sits_below_it(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("atoll", "v1") or rel == Path("atoll/__main__.py"):
            continue  # generated code; the `python -m atoll` entry point hands over to atoll.launch
        for name in _imports(path):
            if any(name == c or name.startswith(c + ".") for c in FORBIDDEN[folder]):
                bad.append(f"{rel} imports {name}")
    assert not bad, "\n".join(bad)


NEVER_IMPORTS = {"atoll/modelspec.py": ("atoll.hf",)}
"""Core modules that must not import a given module at all, not even lazily inside a function: `atoll.hf` builds on
`atoll.modelspec`, so modelspec importing hf back would be a cycle (a model named or read from either source is
`atoll.models`, which sits above both)."""


def _imported_modules(source: str, package: str) -> set[str]:
    """Every module an import anywhere in `source` (a module of `package`) names, relative imports resolved:
    `import a.b` and `from a import b` both give a, a.b."""
    names: set[str] = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            full = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:  # from . import x, from .x import y: against the package, one level up per extra dot
                pkg = package.split(".")
                base = ".".join(pkg[:len(pkg) - n.level + 1] + ([base] if base else []))
            full = [base, *(f"{base}.{a.name}" for a in n.names)]
        else:
            continue
        for name in full:
            parts = name.split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return names


def test_the_import_check_sees_lazy_and_relative_imports():
    source = "def f():\n    from atoll.hf import config_from_hf\n\ndef g():\n    from . import hf\n\nimport atoll.hf as x\n"
    for line in source.split("\n\n"):
        assert "atoll.hf" in _imported_modules(line, "atoll"), line
    assert "atoll.hf" not in _imported_modules("from atoll.fsutil import read_text_file\nimport json\n", "atoll")


@pytest.mark.parametrize("module", sorted(NEVER_IMPORTS))
def test_a_module_never_imports_what_builds_on_it(module):
    names = _imported_modules((ROOT / module).read_text(encoding="utf-8"), "atoll")
    bad = sorted(name for name in names for f in NEVER_IMPORTS[module] if name == f or name.startswith(f + "."))
    assert not bad, f"{module} imports {bad} (lazily or not)"
