"""A copy of the surgeon package with one init mode added the way docs/ARCHITECTURE.md's recipe says (a module in
surgeon/modes/ and one entry in the registry), and surgeon run from that copy in a fresh process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from helpers.paths import ROOT

REGISTRY = "_REGISTRY: dict[str, Mode] = {m.name: m for m in ("  # the registry's one line, up to its entries


def package_with_mode(tmp_path: Path, module: str, source: str, cls: str) -> Path:
    """``tmp_path/src``: the package, with ``surgeon/modes/<module>.py`` holding ``source`` and ``cls()`` registered."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "surgeon", src / "surgeon", ignore=shutil.ignore_patterns("__pycache__"))
    modes = src / "surgeon" / "modes"
    (modes / f"{module}.py").write_text(source)
    init = (modes / "__init__.py").read_text()
    end = init.index(")}", init.index(REGISTRY))
    init = init[:end] + f", {cls}()" + init[end:]
    (modes / "__init__.py").write_text(
        init.replace("from .base import", f"from .{module} import {cls}\nfrom .base import")
    )
    return src


def _env(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"}


def surgeon_from(src: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI of the copy at ``src`` (checked to be that copy, not the installed package)."""
    code = (
        "import sys, surgeon; assert surgeon.__file__.startswith(sys.argv[1]); "
        "from surgeon.cli.commands import main; sys.argv[1:2] = []; main()"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(src), *args],
        env=_env(src),
        cwd=src,
        capture_output=True,
        text=True,
        timeout=600,
    )


def python_from(src: Path, code: str) -> subprocess.CompletedProcess:
    """Python ``code`` run against the copy at ``src``."""
    return subprocess.run(
        [sys.executable, "-c", code], env=_env(src), cwd=src, capture_output=True, text=True, timeout=600
    )


def assert_layer_1_qk_heads_at(model: Path, out: Path, value: float) -> None:
    """``out`` is the BERT ``model`` with layer 1's query and key changed, and nothing else: every head's
    singular values at ``value`` (read back with the reference safetensors reader)."""
    before, after = load_file(model / "model.safetensors"), load_file(out / "model.safetensors")
    config = json.loads((model / "config.json").read_text())
    heads, width = config["num_attention_heads"], config["hidden_size"]
    changed = {n for n in before if not np.array_equal(before[n], after[n])}
    assert changed == {f"encoder.layer.1.attention.self.{p}.{t}" for p in ("query", "key") for t in ("weight", "bias")}
    for p in ("query", "key"):
        weight = after[f"encoder.layer.1.attention.self.{p}.weight"].astype(np.float64)
        for head in weight.reshape(heads, width // heads, width):
            np.testing.assert_allclose(np.linalg.svd(head, compute_uv=False), value, rtol=1e-5)
