#!/usr/bin/env bash
# The one reviewed step that moves the pinned environment to the newest releases (issue 46):
#   1. scripts/lock.sh re-resolves every lock in constraints/ (extra PINs go to the test lock);
#   2. prints what moved (package: old -> new, added, removed);
#   3. in a fresh venv at the new test lock: the whole census (scripts/census.py --update: new types, changed
#      verdicts, types gone) and the test suite (the failing tests, by id).
# Then review `git diff` (constraints/, tests/project/census_expected.json), fix what the new releases broke, say
# so in CHANGELOG.md, and commit the lock, the census and the fixes together.
# Usage: scripts/upgrade.sh [--no-tests] [--no-census] [PIN ...]
set -uo pipefail
cd "$(dirname "$0")/.."
TESTS=1; CENSUS=1
while [ $# -gt 0 ]; do
    case $1 in
        --no-tests) TESTS=0 ;;
        --no-census) CENSUS=0 ;;
        *) break ;;
    esac
    shift
done
WORK=$(mktemp -d /tmp/surgeon-upgrade.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
unset PYTHONPATH
step() { printf '\n== upgrade: %s (%ss)\n' "$1" "$SECONDS"; }

cp -r constraints "$WORK/old"
step "re-resolve the locks against the newest releases"
bash scripts/lock.sh "$@" || { echo "upgrade: scripts/lock.sh failed (above): the newest releases do not resolve"; exit 1; }

step "what moved"
python3 - "$WORK/old" constraints <<'PY'
import pathlib, re, sys
def pins(path):
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out
old, new = map(pathlib.Path, sys.argv[1:])
for lock in sorted(new.glob("*.txt")):
    before, after = pins(old / lock.name) if (old / lock.name).exists() else {}, pins(lock)
    moved = [f"  {n}: {before[n]} -> {after[n]}" for n in sorted(before.keys() & after.keys()) if before[n] != after[n]]
    moved += [f"  {n}: added {after[n]}" for n in sorted(after.keys() - before.keys())]
    moved += [f"  {n}: removed (was {before[n]})" for n in sorted(before.keys() - after.keys())]
    print(f"{lock.name}: {len(moved) or 'nothing'} moved")
    print("\n".join(moved)) if moved else None
PY

step "a fresh venv at the new test lock"
python3 -m venv "$WORK/venv" && "$WORK/venv/bin/pip" install -q torch==2.13.0 \
    && "$WORK/venv/bin/pip" install -q -c constraints/test.txt -e '.[test]' \
    && "$WORK/venv/bin/python" scripts/check_lock.py constraints/test.txt || exit 1

status=0
if [ $CENSUS = 1 ]; then
    step "the census on the new releases (rewrites tests/project/census_expected.json: review its diff)"
    HF_HUB_OFFLINE=1 "$WORK/venv/bin/python" scripts/census.py --update --json "$WORK/census.json" >"$WORK/census.log" 2>&1 \
        || status=1
    grep -E "^(wrong|crash|changed|gone) " "$WORK/census.log"
    tail -1 "$WORK/census.log"
fi
if [ $TESTS = 1 ]; then
    step "the test suite on the new releases"
    HF_HUB_OFFLINE=1 "$WORK/venv/bin/python" -m pytest -q -p no:cacheprovider >"$WORK/tests.log" 2>&1 || status=1
    grep -E "^(FAILED|ERROR) " "$WORK/tests.log"
    tail -1 "$WORK/tests.log"
fi
step "done: review git diff, fix what broke, add a CHANGELOG entry, commit the lock and the census together"
exit $status
