#!/usr/bin/env bash
# Type-check surgeon against the newest torch on the package index, whose stubs can differ from the pinned one's.
# torch goes in with --no-deps: mypy reads only its .py/.pyi files, so the CUDA wheels it depends on are not needed.
# The versions are constraints/mypy-newest.txt's (scripts/lock.sh moves them to the newest; with SURGEON_LOCK_WRITE=1,
# as lock.sh runs it, the newest are installed and mypy is not run).
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

lock=(-c "$repo/constraints/mypy-newest.txt")
[[ -n ${SURGEON_LOCK_WRITE:-} ]] && lock=()  # unpinned: the newest torch the index (and pip's constraints in force) allows
"${pip[@]}" install --upgrade --no-deps torch "${lock[@]}"
echo "mypy_newest: torch $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')"
"${pip[@]}" install "mypy>=2.4,<2.5" numpy huggingface-hub onnx click tqdm typing-extensions \
    sympy filelock jinja2 networkx fsspec safetensors "${lock[@]}"
[[ -n ${SURGEON_LOCK_WRITE:-} ]] && exit 0
[[ ${SURGEON_CHECK_LOCK:-} ]] && "$venv/bin/python" "$repo/scripts/check_lock.py" "$repo/constraints/mypy-newest.txt"

cd "$repo"
"$venv/bin/python" -m mypy surgeon
