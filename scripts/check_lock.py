"""Check that the running environment holds exactly the packages of a lock file, at the lock's versions.

    python scripts/check_lock.py constraints/test.txt

Exit 1 with one line per difference (a version that differs, a locked package missing, a package the lock does
not name); surgeon itself and pip's own tooling are not locked. Used by .ci/run after each install."""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys

UNLOCKED = {"attention-surgeon", "pip", "setuptools", "wheel"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: str) -> dict[str, str]:
    pins = {}
    for line in open(path, encoding="utf-8"):
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path}: {line!r} is not name==version"
            pins[canonical(name)] = version
    return pins


def main(path: str) -> int:
    lock = read_lock(path)
    installed = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}
    problems = [
        f"{name}: installed {installed[name]}, locked {lock[name]}"
        for name in sorted(lock.keys() & installed.keys())
        if installed[name] != lock[name]
    ]
    problems += [f"{name}: locked {lock[name]}, not installed" for name in sorted(lock.keys() - installed.keys())]
    problems += [
        f"{name}: installed {installed[name]}, not in the lock"
        for name in sorted(installed.keys() - lock.keys() - UNLOCKED)
    ]
    for problem in problems:
        print(f"{path}: {problem}")
    if problems:
        print(f"{path}: the environment differs from the lock in {len(problems)} packages: re-run scripts/lock.sh")
        return 1
    print(f"ok: the environment is exactly {path} ({len(lock)} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
