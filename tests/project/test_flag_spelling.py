"""The core names an option with ``surgeon.errors.opt`` and lets the reader's spelling show it (``num_heads`` to a
Python caller, ``--num-heads`` in a shell); it never writes one of surgeon's flags into a message by hand. Read
from the source with ast: every string outside ``surgeon/cli/`` that is not a docstring."""

from __future__ import annotations

import ast
import re

from helpers.paths import ROOT

# Whole command lines to run (a shell is what runs them), the shell spelling's own table, and the model card (a
# document written in the shell's terms, as its reproduce command).
ALLOWED = {
    ("surgeon/errors.py", "--output"),  # SHELL_FLAGS: how the shell spells output
    ("surgeon/detect/by_name.py", "--list-names"),  # LIST_NAMES: the command that lists the names surgeon knows
    ("surgeon/report/card.py", "--full"),
    ("surgeon/hub/copies.py", "--overwrite"),  # the reinit command line that finishes a stopped push
    *(("surgeon/hub/push_result.py", f) for f in ("--branch", "--create-pr", "--private", "--commit-message")),
    ("surgeon/hub/push_result.py", "--no-server-copy"),  # push_command: the `surgeon push` that finishes a push
}
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z-]+)")


def _flags() -> set[str]:
    from surgeon.cli.commands import main

    return {o for cmd in main.commands.values() for p in cmd.params for o in getattr(p, "opts", ()) if o[:2] == "--"}


def _spelt_by_hand(root=ROOT) -> set[tuple[str, str]]:
    flags, found = _flags(), set()
    for path in sorted((root / "surgeon").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("surgeon/cli/"):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                found |= {(rel, flag) for flag in FLAG.findall(node.value) if flag in flags}
    return found


def test_no_core_message_spells_a_flag_by_hand():
    assert _spelt_by_hand() - ALLOWED == set()


def test_the_check_finds_a_flag_spelt_by_hand(tmp_path):
    (tmp_path / "surgeon").mkdir()
    (tmp_path / "surgeon" / "m.py").write_text('"""--layers in a docstring is prose."""\nX = "pass --num-heads N"\n')
    assert _spelt_by_hand(tmp_path) == {("surgeon/m.py", "--num-heads")}
