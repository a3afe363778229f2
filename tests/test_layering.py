"""The dependency rule of the layout: the core (`atoll/`) imports no component, compression only the core,
and the coordinator and the nodes never import each other; `atoll.launch` sits above them all."""

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
