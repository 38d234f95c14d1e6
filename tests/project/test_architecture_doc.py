"""docs/ARCHITECTURE.md names every module of surgeon/, and every name, file and test it names exists, so that its
claims can be checked and a rename that leaves it behind fails here."""

from __future__ import annotations

import ast
import importlib
import re

import pytest

from helpers.paths import ROOT

TRIVIAL = {"__init__.py", "__main__.py", "_version.py"}
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
QUOTED = re.findall(r"`([^`\n]+)`", DOC)


def test_every_module_is_named_in_the_architecture_doc():
    named = {n.rsplit("/", 1)[-1] for n in re.findall(r"`([A-Za-z_/]+\.py)`", DOC)}
    named |= {n.rsplit("/", 1)[-1] for n in re.findall(r"([A-Za-z_/]+\.py)\b", DOC)}
    missing = [
        str(p.relative_to(ROOT)) for p in sorted((ROOT / "surgeon").rglob("*.py")) if p.name not in TRIVIAL | named
    ]
    assert not missing, f"add a line for these to docs/ARCHITECTURE.md: {missing}"


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            found = getattr(found, attr)  # AttributeError: the doc names what is not there
        return found
    raise ModuleNotFoundError(dotted)


DOTTED = sorted({q for q in QUOTED if re.fullmatch(r"surgeon(\.[A-Za-z_]\w*)+", q)})
PATHS = sorted({q for q in QUOTED if re.fullmatch(r"(surgeon|tests|scripts|docs)/[\w/.]*(::\w+)?", q)})


def test_the_doc_names_enough_to_check():
    assert len(DOTTED) > 40 and len(PATHS) > 40  # the checks below read real references, not an empty list


@pytest.mark.parametrize("dotted", DOTTED)
def test_every_surgeon_name_in_the_doc_exists(dotted):
    _resolve(dotted)


@pytest.mark.parametrize("path", PATHS)
def test_every_file_and_test_in_the_doc_exists(path):
    file, _, test = path.partition("::")
    if re.search(r"(/|_)X\.py$", file):  # a recipe's placeholder (formats/X.py, test_native_X.py)
        return
    assert (ROOT / file).exists(), f"docs/ARCHITECTURE.md names {file}, which is not there"
    if test:
        defined = {n.name for n in ast.walk(ast.parse((ROOT / file).read_text())) if isinstance(n, ast.FunctionDef)}
        assert test in defined, f"docs/ARCHITECTURE.md names {path}, and {file} has no such test"
