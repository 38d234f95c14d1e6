"""How one reinit goes through surgeon/api.py: the api.py functions it runs, how often control comes back
into api.py from another module (a callback), and how many calls api.py makes into the rest of surgeon.

Usage: python scripts/api_crossings.py MODEL OUTPUT   (OUTPUT is replaced; layers 0-1 are re-initialized)
Measured with sys.setprofile; generator resumptions count as calls, as the profiler sees them.
"""

from __future__ import annotations

import collections
import shutil
import sys

import surgeon.api as api

API = api.__file__
runs: collections.Counter[str] = collections.Counter()
back_in: collections.Counter[tuple[str, str]] = collections.Counter()
out_to: collections.Counter[tuple[str, str]] = collections.Counter()


def _where(code) -> str:
    return code.co_filename.split("surgeon/")[-1]


def _watch(frame, event, arg) -> None:
    if event != "call":
        return
    code, caller = frame.f_code, frame.f_back
    from_api = caller is not None and caller.f_code.co_filename == API
    if code.co_filename == API:
        runs[code.co_name] += 1
        if not from_api:
            back_in[(code.co_name, _where(caller.f_code) if caller else "?")] += 1
    elif from_api and "/surgeon/" in code.co_filename:
        out_to[(caller.f_code.co_name, f"{_where(code)}:{code.co_name}")] += 1


def main() -> None:
    model, output = sys.argv[1], sys.argv[2]
    shutil.rmtree(output, ignore_errors=True)
    sys.setprofile(_watch)
    try:
        api.reinit_checkpoint(model, output=output, layers="0-1")
    finally:
        sys.setprofile(None)
    print(f"api.py functions run: {len(runs)}, calls to them: {sum(runs.values())}")
    print(f"entries into api.py from outside it: {sum(back_in.values())}")
    for (fn, frm), n in back_in.most_common():
        print(f"  {n:4d}  {fn} <- {frm}")
    print(f"calls from api.py into other surgeon modules: {sum(out_to.values())} ({len(out_to)} distinct)")


if __name__ == "__main__":
    main()
