"""The packages import one way: no module reaches itself through imports.

Every ``import`` and ``from ... import`` is read from the source with
:mod:`ast`, at any depth (an import inside a function still ties the two
modules: it only moves the cycle to run time), and the module graph is sorted
topologically with :mod:`graphlib`, which names a cycle when there is one.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            # a package importing its own submodules is how packages are built
            if t and t != name and not t.startswith(name + ".") and not name.startswith(t + "."):
                found.add(t)
    return found


@pytest.mark.parametrize("package", ["cagrad", "harness", "fuzz", "golden_graphs"])
def test_package_has_no_import_cycle(package):
    known = _modules(package)
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle in {package}: {' -> '.join(exc.args[1])}")
