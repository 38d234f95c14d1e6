"""Integrations with training libraries, each imported on first use: ``surgeon.integrations.transformers``
works after a plain ``import surgeon`` (and ``from surgeon.integrations.transformers import ...`` as usual)."""

from __future__ import annotations

import importlib
from types import ModuleType

_MODULES = ("init_hooks", "transformers")


def __getattr__(name: str) -> ModuleType:
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'surgeon.integrations' has no attribute {name!r}")
