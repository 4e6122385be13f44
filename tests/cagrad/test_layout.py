"""The package's layout is its pipeline: each stage sub-package imports only
the stages before it (and the leaf modules ``errors``, ``counters``,
``internals``, ``preserve``, ``logs``, ``events`` and ``internal_errors``), so that the folders show the architecture
and no import circles form."""

from __future__ import annotations

import ast
import pathlib

import cagrad

ROOT = pathlib.Path(cagrad.__file__).parent
STAGES = ["native", "autograd", "hooks", "keys", "capture", "compile", "run"]
# in order: a leaf imports only the leaves before it
LEAVES = ["errors", "counters", "internals", "lazy_cuda", "preserve", "logs", "events", "internal_errors"]


def _imports(path: pathlib.Path) -> list[tuple[int, list[str]]]:
    """(line, target module as a path inside cagrad) of each import, type-checking-only ones left out."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    here = list(path.relative_to(ROOT).parent.parts)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - (node.level - 1)]
            mod = base + (node.module.split(".") if node.module else [])
            found += [(node.lineno, mod + [a.name]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cagrad":
            found += [(node.lineno, node.module.split(".")[1:] + [a.name]) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == "cagrad"]
    return found


def test_every_stage_imports_only_earlier_stages_and_the_leaves():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if len(rel.parts) == 1:
            continue  # the top level joins the stages
        stage = STAGES.index(rel.parts[0])
        for line, target in _imports(path):
            head = target[0] if target else ""
            if head in STAGES:
                if STAGES.index(head) > stage:
                    bad.append(f"{rel}:{line} imports the later stage {'.'.join(target)}")
            elif head and head not in LEAVES:
                bad.append(f"{rel}:{line} imports the top-level {'.'.join(target)}")
    assert not bad, "\n".join(bad)


def test_the_leaf_modules_import_only_the_leaves_before_them():
    for i, name in enumerate(LEAVES):
        targets = {t[0] for _, t in _imports(ROOT / f"{name}.py")}
        assert targets <= set(LEAVES[:i]), (name, targets)


def test_every_module_is_in_a_stage_or_at_the_top():
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(STAGES)
