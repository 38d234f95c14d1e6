#!/usr/bin/env bash
# Type-check surgeon against the newest torch on the package index, whose stubs can differ from the pinned one's.
# torch goes in with --no-deps: mypy reads only its .py/.pyi files, so the CUDA wheels it depends on are not needed.
# Usage: scripts/mypy_newest.sh [VENV_DIR]   (default: a fresh temporary directory, removed on exit)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -ge 1 ]]; then
    venv="$1"
else
    venv="$(mktemp -d)/mypy-newest"
    trap 'rm -rf "$(dirname "$venv")"' EXIT
fi
python="${PYTHON:-python3}"

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

# Unpinned, so pip takes the newest torch the index (and any pip constraints file in force) allows.
"${pip[@]}" install --upgrade --no-deps torch
echo "mypy_newest: torch $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')"
"${pip[@]}" install "mypy>=2.4,<2.5" numpy huggingface-hub onnx click tqdm typing-extensions \
    sympy filelock jinja2 networkx fsspec safetensors

cd "$repo"
"$venv/bin/python" -m mypy surgeon
