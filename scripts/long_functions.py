"""List functions in surgeon/ longer than a limit (default 60 lines), longest first.

Usage: python scripts/long_functions.py [LIMIT] [--all]
Without --all, skips the files other refactors own (api, cli, output, report, formats/, audit/).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SKIP = ("surgeon/api.py", "surgeon/cli.py", "surgeon/output.py", "surgeon/report.py")
SKIP_DIRS = ("surgeon/formats/", "surgeon/audit/")


def long_functions(root: Path, limit: int, everything: bool) -> list[tuple[int, str, str]]:
    rows = []
    for path in sorted(root.rglob("*.py")):
        rel = path.as_posix()
        if not everything and (rel in SKIP or rel.startswith(SKIP_DIRS)):
            continue
        tree = ast.parse(path.read_text(), rel)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    rows.append((n, node.name, f"{rel}:{node.lineno}"))
    return sorted(rows, reverse=True)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--all"]
    limit = int(args[0]) if args else 60
    for n, name, where in long_functions(Path("surgeon"), limit, "--all" in sys.argv):
        print(f"{n:4d}  {name:32s} {where}")


if __name__ == "__main__":
    main()
