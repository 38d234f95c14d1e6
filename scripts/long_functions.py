"""Sizes in surgeon/: files over 400 lines, and functions over a limit (default 60 lines), longest first.

Usage: python scripts/long_functions.py [LIMIT]
A function is counted whole (signature and docstring included) and by its code alone (the body without
its docstring), since keyword-only public signatures and their docstrings are long on purpose.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

FILE_LIMIT = 400


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        body = body[1:]
    return (body[-1].end_lineno or body[-1].lineno) - body[0].lineno + 1 if body else 0


def sizes(root: Path) -> tuple[list[tuple[int, str]], list[tuple[int, int, str, str]]]:
    """(lines, file) for every file; (whole lines, code lines, name, where) for every function."""
    files, functions = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.as_posix()
        text = path.read_text()
        files.append((len(text.splitlines()), rel))
        for node in ast.walk(ast.parse(text, rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                whole = (node.end_lineno or node.lineno) - node.lineno + 1
                functions.append((whole, _code_lines(node), node.name, f"{rel}:{node.lineno}"))
    return sorted(files, reverse=True), sorted(functions, reverse=True)


def main() -> None:
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    files, functions = sizes(Path("surgeon"))
    print(
        f"longest file: {files[0][1]} ({files[0][0]} lines); over {FILE_LIMIT}: {sum(n > FILE_LIMIT for n, _ in files)}"
    )
    for n, rel in files:
        if n > FILE_LIMIT:
            print(f"{n:6d}  {rel}")
    code = max(functions, key=lambda f: f[1])
    print(f"longest function code: {code[2]} at {code[3]} ({code[1]} lines)")
    print(f"functions over {limit} lines (whole / code):")
    for whole, body, name, where in functions:
        if whole > limit or body > limit:
            print(f"{whole:6d} / {body:3d}  {name:28s} {where}")


if __name__ == "__main__":
    main()
