#!/usr/bin/env bash
# surgeon beside each training framework, tested there (.ci/run runs this after the wheel check; issues 29, 30):
#  for each of litgpt, OLMo-core, torchtitan and Megatron-Core, a fresh venv with CPU torch 2.13.0 first, then
#  `pip install <framework> <its extras> -e .` in ONE resolve (surgeon must install beside the framework's own pins),
#  `pip check`, and tests/integrations/test_frameworks_native.py with SURGEON_FRAMEWORK=<name>: that framework's tests must run
#  (a skip of one of them is a failure there), and tests/integrations/test_native_*.py the same way, judged by the framework's own forward and loader.
# Usage: scripts/frameworks_check.sh [VENVS_DIR] [NAME ...]   (default: a temporary folder, every framework)
# With VENVS_DIR given, a venv already there is reused (pip then only checks that it resolves).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ "${1:-}" = "--requirements" ]; then REQUIREMENTS_ONLY=$2; else REQUIREMENTS_ONLY=; fi
if [ -n "$REQUIREMENTS_ONLY" ]; then :
elif [ $# -ge 1 ]; then VENVS=$1; shift; mkdir -p "$VENVS"; else VENVS=$(mktemp -d /tmp/surgeon-frameworks.XXXXXX); trap 'rm -rf "$VENVS"' EXIT; fi
NAMES=("$@")
[ ${#NAMES[@]} -eq 0 ] && NAMES=(litgpt olmo titan megatron)
unset PYTHONPATH
shopt -s nullglob
TESTS=(tests/integrations/test_frameworks_native.py tests/integrations/test_native_*.py)
step() { printf '\n== %s (%ss)\n' "$1" "$SECONDS"; }

requirements() {  # the framework and what it needs beside CPU torch (docs/frameworks.md "From your training framework" lists them)
    case $1 in
        litgpt) echo "litgpt==0.5.13 requests" ;;
        olmo) echo "ai2-olmo-core==3.0.0" ;;
        titan) echo "torchtitan==0.3.0 triton" ;;
        megatron) echo "megatron-core==0.16.1 einops psutil" ;;
        *) echo "unknown framework $1 (litgpt, olmo, titan, megatron)" >&2; exit 2 ;;
    esac
}
if [ -n "$REQUIREMENTS_ONLY" ]; then requirements "$REQUIREMENTS_ONLY"; exit 0; fi

for name in "${NAMES[@]}"; do
    reqs=$(requirements "$name")
    venv="$VENVS/$name"
    step "$name: $reqs attention-surgeon"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    lock=(-c "$ROOT/constraints/framework-$name.txt")
    [ -n "${SURGEON_LOCK_WRITE:-}" ] && lock=()
    "$venv/bin/pip" install --quiet torch==2.13.0 "${lock[@]}"
    # shellcheck disable=SC2086  # the requirements are words
    "$venv/bin/pip" install --quiet $reqs -e "$ROOT" "pytest>=8" "${lock[@]}"
    "$venv/bin/pip" check
    [ -n "${SURGEON_LOCK_WRITE:-}" ] && continue
    "$venv/bin/python" "$ROOT/scripts/check_lock.py" "$ROOT/constraints/framework-$name.txt"
    "$venv/bin/python" -c "import importlib.metadata as m; print('resolved:', *(f'{d}=={m.version(d)}' for d in ('torch', 'huggingface-hub', 'attention-surgeon')))"
    (cd "$ROOT" && SURGEON_FRAMEWORK=$name HF_HUB_OFFLINE=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -W ignore "${TESTS[@]}")
done
step "done"
