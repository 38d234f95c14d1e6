"""The training frameworks the native tests build with, each importable only in its own venv.

``framework("titan")`` imports the framework's top module or skips the test; under
``SURGEON_FRAMEWORK=titan`` (what scripts/frameworks_check.sh sets in that framework's venv, in CI) a
missing framework fails instead, so its tests can never be skipped where they are meant to run.
"""

from __future__ import annotations

import importlib
import os

import pytest

MODULES = {"litgpt": "litgpt", "olmo": "olmo_core", "titan": "torchtitan", "megatron": "megatron.core"}


def framework(name: str):
    module = MODULES[name]
    if os.environ.get("SURGEON_FRAMEWORK") == name:
        return importlib.import_module(module)  # in its own venv: an ImportError fails the test
    return pytest.importorskip(module)
