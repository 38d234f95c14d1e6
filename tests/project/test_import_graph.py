"""surgeon's own imports form no cycle and run down one package order (read from the source with ast,
function-level imports and those under ``if TYPE_CHECKING:`` included: a cycle a type checker sees is a cycle of
meaning too), and the tests' imports keep to tests/README.md: shared code comes from helpers/, never from a test
module.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.paths import ROOT, TESTS

PACKAGE = ROOT / "surgeon"

# surgeon's packages (a folder, or a module of the package root), lowest first: a module imports from its own package
# or from one earlier here, never from a later one. The stages keep the data path's order (open -> detect -> plan ->
# compute -> write -> report), but for report below write: the write stage's runs make the report's values. Under
# the stages sit the terms, modes and formats every stage shares; the entry points (API, CLI) are on top.
ORDER = [
    "_version",
    "text",  # how surgeon shows text: names escaped, tokens redacted (the errors print through it)
    "errors",
    "_compat",  # private or fast-moving APIs, imported on first use (raises DependencyError)
    "vocab",  # the terms every stage shares: blocks, changes, selections, detections, spectra, config keys
    "modes",  # the init modes and the draws they make
    "options",
    "files",  # the file system as inputs may use it: capped reads, the folder boundary, the checkpoint lock
    "formats",  # each file format (and the in-place journal's): read, written and compared in one module
    "open",
    "detect",
    "plan",
    "compute",
    "report",
    "hub",  # the Hub at the two ends: a Hub model read where it is (open_model), a folder committed (push)
    "write",
    "audit",
    "api",
    "in_memory",
    "integrations",
    "cli",
    "__main__",
    "surgeon",  # the package root: the public API's lazy exports
]
# (importing module, imported module) pairs allowed to run up the order, each with why a move cannot fix it
UPWARD: dict[tuple[str, str], str] = {}


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


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_import_cycle():
    graph = _graph()
    assert "surgeon.plan.planner" in graph["surgeon.api"]  # the reader sees real imports
    assert "surgeon.vocab.change" in graph["surgeon.modes.base"]  # and those under TYPE_CHECKING
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a package to a later one in ORDER (or to one ORDER leaves out), but UPWARD's."""
    rank = {p: i for i, p in enumerate(ORDER)}
    return sorted(
        f"{a} imports {b} ({_package(a)} is below {_package(b)})"
        for a, imported in graph.items()
        for b in imported
        if _package(a) != _package(b)
        and rank.get(_package(b), len(ORDER)) > rank.get(_package(a), -1)
        and (a, b) not in UPWARD
    )


def test_the_order_checker_finds_an_upward_import():
    graph = {"surgeon.errors": {"surgeon.report.shown", "surgeon.text.shown"}, "surgeon.text.shown": set()}
    assert _upward(graph) == ["surgeon.errors imports surgeon.report.shown (errors is below report)"]
    assert _upward({"surgeon.api": {"surgeon.errors"}, "surgeon.errors": set()}) == []


def test_every_package_has_a_place_in_the_order():
    packages = {_package(m) for m in _modules()}
    assert sorted(packages - set(ORDER)) == []  # a new package: give it its place
    assert sorted(set(ORDER) - packages) == []  # a package gone: take it out


def test_imports_run_down_the_package_order():
    graph = _graph()
    found = _upward(graph)
    assert not found, f"{len(found)} imports run up the package order:\n" + "\n".join(found)
    assert all(b in graph[a] for a, b in UPWARD), "an exception no longer needed: take it out of UPWARD"


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
