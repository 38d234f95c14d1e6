#!/usr/bin/env bash
# Re-resolve every pinned environment CI builds against the newest releases the index holds, and write the locks
# (plain `pip freeze` of each resolved venv; see constraints/README.md):
#   constraints/test.txt            the test environment: CPU torch 2.13.0, then `-e .[test]` (README, .ci/run)
#   constraints/floors.txt          the floors job of scripts/wheel_check.sh (pyproject's `>=` floors, pinned)
#   constraints/mypy-newest.txt     scripts/mypy_newest.sh (the newest torch's stubs)
#   constraints/framework-NAME.txt  scripts/frameworks_check.sh, one per framework
# Usage: scripts/lock.sh [--only test|floors|mypy|frameworks] [PIN ...]
#   PIN: an extra requirement for the test lock, e.g. transformers==5.24.0 (to hold one package back).
# Review the diff (scripts/upgrade.sh does, and runs the census and the tests on it) before committing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ONLY=all
if [ "${1:-}" = "--only" ]; then ONLY=$2; shift 2; fi
PINS=("$@")
WORK=$(mktemp -d /tmp/surgeon-lock.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
unset PYTHONPATH PIP_CONSTRAINT
step() { printf '\n== %s (%ss)\n' "$1" "$SECONDS"; }

# The lock of a venv: every distribution but surgeon itself, pinned; the header says how it was made.
freeze() {  # $1: venv, $2: lock file, $3: what was installed (for the header)
    {
        echo "# $(basename "$2"): written by scripts/lock.sh on $(date -u +%Y-%m-%d) from: $3"
        echo "# Do not edit by hand: re-run scripts/lock.sh (or scripts/upgrade.sh) and review the diff."
        "$1/bin/pip" freeze --exclude-editable | grep -viE '^(attention-surgeon|attention_surgeon)[= @]' | LC_ALL=C sort -f
    } >"$2"
    echo "wrote $2 ($(grep -vc '^#' "$2") packages)"
}

fresh_venv() {  # CPU torch first: an unpinned torch pulls a CUDA build
    python3 -m venv "$1"
    "$1/bin/pip" install --quiet torch==2.13.0
}

if [[ $ONLY == all || $ONLY == test ]]; then
    step "test: torch==2.13.0, -e .[test] ${PINS[*]:-}"
    fresh_venv "$WORK/test"
    "$WORK/test/bin/pip" install --quiet -e ".[test]" "${PINS[@]}"
    freeze "$WORK/test" constraints/test.txt "torch==2.13.0, then -e .[test] ${PINS[*]:-}"
fi

if [[ $ONLY == all || $ONLY == floors ]]; then
    step "floors: pyproject's floors, pinned"
    python3 scripts/floors.py >"$WORK/floors-spec.txt"
    fresh_venv "$WORK/floors"
    "$WORK/floors/bin/pip" install --quiet -e . $(cat scripts/floors-test-packages.txt) -c "$WORK/floors-spec.txt"
    freeze "$WORK/floors" constraints/floors.txt "torch==2.13.0, then -e . $(paste -sd' ' scripts/floors-test-packages.txt) with pyproject's floors"
fi

if [[ $ONLY == all || $ONLY == mypy ]]; then
    step "mypy-newest: the newest torch (stubs only) and mypy"
    SURGEON_LOCK_WRITE=1 bash scripts/mypy_newest.sh "$WORK/mypy" >/dev/null
    freeze "$WORK/mypy" constraints/mypy-newest.txt "scripts/mypy_newest.sh's packages, newest"
fi

if [[ $ONLY == all || $ONLY == frameworks ]]; then
    step "frameworks"
    SURGEON_LOCK_WRITE=1 bash scripts/frameworks_check.sh "$WORK/frameworks"
    for venv in "$WORK"/frameworks/*/; do
        name=$(basename "$venv")
        freeze "$venv" "constraints/framework-$name.txt" "torch==2.13.0, then $(bash scripts/frameworks_check.sh --requirements "$name") -e . pytest>=8"
    done
fi
step "done"
