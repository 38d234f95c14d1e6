"""surgeon's own imports form no cycle (read from the source with ast, function-level imports and those under
``if TYPE_CHECKING:`` included: a cycle a type checker sees is a cycle of meaning too), and the tests' imports keep
to tests/README.md: shared code comes from helpers/, never from a test module.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.paths import ROOT, TESTS

PACKAGE = ROOT / "surgeon"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            found.update(subs if len(subs) == len(node.names) else [target, *subs])
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found.update(n for n in names if n in modules)
    return {m for m in found if m in modules and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "surgeon.plan.planner" in graph["surgeon.api"]  # the reader sees real imports
    assert "surgeon.vocab.change" in graph["surgeon.modes.base"]  # and those under TYPE_CHECKING
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "helpers" not in p.relative_to(TESTS).parts)


def test_no_test_file_imports_another_test_module_or_conftest():
    found = []
    for path in [*_test_files(), *sorted((TESTS / "helpers").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [
                f"{path.relative_to(TESTS)}: {n}" for n in names if n.split(".")[0].startswith(("test_", "conftest"))
            ]
    assert found == []


def test_test_folders_are_not_packages_and_test_basenames_are_unique():
    """pytest's prepend import mode imports each test file by its basename from its own folder."""
    folders = {p.parent for p in _test_files()}
    assert sorted(str(f.relative_to(TESTS)) for f in folders if (f / "__init__.py").exists()) == []
    names = [p.name for p in _test_files() if p.name.startswith("test_")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
