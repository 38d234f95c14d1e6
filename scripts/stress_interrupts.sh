#!/usr/bin/env bash
# The tests that interrupt or kill a surgeon process, N times in a row while two CPU-bound processes run beside
# them (issue 46: a test must not depend on which process is faster). Prints one line per round and a summary.
# Usage: scripts/stress_interrupts.sh [N] [PYTEST -k EXPRESSION]   (venv active; default 20 rounds, every such test)
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-20}
# every test that interrupts, kills or waits on another surgeon process (24 tests)
K=${2:-"ctrl_c or kill or waits or half_way or exclude_each_other or running_in_place or recover_json or rolled_back_with or recovered_weights"}
TESTS=(tests/write/test_in_place_locks.py tests/write/test_in_place.py tests/write/test_crash.py tests/write/test_journal_fuzz.py tests/write/test_journal_security.py)
burners=()
for _ in 1 2; do python3 -c "while True: pass" & burners+=($!); done
trap 'kill "${burners[@]}" 2>/dev/null' EXIT
green=0
for i in $(seq 1 "$N"); do
    if out=$(HF_HUB_OFFLINE=1 python -m pytest -q -p no:cacheprovider "${TESTS[@]}" -k "$K" 2>&1); then
        green=$((green + 1))
    else
        echo "$out" | tail -30
    fi
    echo "round $i: $(echo "$out" | tail -1)"
done
echo "$green/$N rounds green (-k '$K', two CPU-bound processes beside)"
[ "$green" = "$N" ]
