"""docs/ARCHITECTURE.md names every module of surgeon/, so that a new module comes with its line there."""

from __future__ import annotations

import re

from helpers.paths import ROOT

TRIVIAL = {"__init__.py", "__main__.py", "_version.py"}


def test_every_module_is_named_in_the_architecture_doc():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = {n.rsplit("/", 1)[-1] for n in re.findall(r"`([A-Za-z_/]+\.py)`", doc)}
    named |= {n.rsplit("/", 1)[-1] for n in re.findall(r"([A-Za-z_/]+\.py)\b", doc)}
    missing = [
        str(p.relative_to(ROOT)) for p in sorted((ROOT / "surgeon").rglob("*.py")) if p.name not in TRIVIAL | named
    ]
    assert not missing, f"add a line for these to docs/ARCHITECTURE.md: {missing}"
