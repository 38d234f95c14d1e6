"""No module reads or writes another module's private attributes (``obj._name`` where ``_name`` is an attribute
that some other surgeon module gives its objects): what one stage needs of another's object is public, so a module's
private state can change without a reader elsewhere breaking silently. Read from the source with ast."""

from __future__ import annotations

import ast
import sys

from helpers.paths import ROOT

PACKAGE = ROOT / "surgeon"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _owned(tree: ast.AST) -> set[str]:
    """The private attributes a module gives its own objects: ``self._x = ...`` and ``_x`` in a class body."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                out.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                    out.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and _private(item.target.id):
                    out.add(item.target.id)
    return out


def _crossings() -> list[str]:
    trees = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}
    owned = {path: _owned(tree) for path, tree in trees.items()}
    found = []
    for path, tree in trees.items():
        elsewhere = set().union(*(names for other, names in owned.items() if other != path)) - owned[path]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in elsewhere):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "super"):
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return found


def test_no_module_reads_another_modules_private_attributes():
    assert _crossings() == []


def test_the_rule_sees_a_private_attribute_read_from_another_module(tmp_path, monkeypatch):
    """The check itself: a module reading ``engine._zeroed`` (the engine's own set) is found."""
    (tmp_path / "surgeon").mkdir()
    (tmp_path / "surgeon" / "engine.py").write_text(
        "class Engine:\n    def __init__(self):\n        self._zeroed = set()\n"
    )
    (tmp_path / "surgeon" / "ranks.py").write_text("def share(engine):\n    return engine._zeroed\n")
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "ROOT", tmp_path)
    monkeypatch.setattr(here, "PACKAGE", tmp_path / "surgeon")
    assert _crossings() == ["surgeon/ranks.py:2: ._zeroed"]
