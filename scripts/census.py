"""The census: every model type the installed transformers knows, built tiny offline, re-initialized by surgeon
with --layers all and --layers -1, and judged against the model's own forward (tests/helpers/census.py).

    HF_HUB_OFFLINE=1 python scripts/census.py                 # every type: the table, then one summary line
    HF_HUB_OFFLINE=1 python scripts/census.py --types bert,t5  # some types
    HF_HUB_OFFLINE=1 python scripts/census.py --update         # rewrite tests/project/census_expected.json
    HF_HUB_OFFLINE=1 python scripts/census.py --head-classes   # head classes, under a Hub checkpoint's key names

Exits 1 when a type is silently wrong or crashes, or (with --check) when a verdict differs from the
expectations file.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
EXPECTED = ROOT / "tests" / "project" / "census_expected.json"
TIMEOUT_S = 240


def _alarm(signum, frame):
    raise TimeoutError(f"over {TIMEOUT_S} s")


def _worker_init() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ["TQDM_DISABLE"] = "1"
    import torch

    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _alarm)


def _one(model_type: str, head_classes: bool = False) -> dict:
    from helpers.census import BASE_FIRST, HEAD_FIRST, Verdict, census_one

    signal.alarm(TIMEOUT_S)
    try:
        verdict = census_one(model_type, mappings=HEAD_FIRST if head_classes else BASE_FIRST)
    except TimeoutError as e:
        verdict = Verdict(model_type, f"crash: {e}")
    except Exception as e:  # noqa: BLE001 - one type's failure is its verdict, not the census's
        verdict = Verdict(model_type, f"crash: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    finally:
        signal.alarm(0)
    return {
        "type": model_type,
        "verdict": verdict.verdict,
        "reason": verdict.reason,
        "judged_by": verdict.judged_by,
        "detail": verdict.detail,
        "seconds": verdict.seconds,
    }


def all_types() -> list[str]:
    from transformers import CONFIG_MAPPING

    return sorted(CONFIG_MAPPING.keys())


def expected_verdict(verdict: str) -> str:
    """What the expectations file keeps of a verdict: its kind and refusal reason, not the free text."""
    kind, _, rest = verdict.partition(": ")
    return verdict if kind == "refused" else kind


def run(types: list[str], jobs: int, head_classes: bool = False) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(jobs, initializer=_worker_init, maxtasksperchild=25) as pool:
        out = []
        for row in pool.imap_unordered(functools.partial(_one, head_classes=head_classes), types):
            out.append(row)
            print(f"{row['type']:32s} {row['seconds']:6.1f}s  {row['verdict'][:110]}", flush=True)
    return sorted(out, key=lambda r: r["type"])


def summary(rows: list[dict]) -> str:
    import transformers

    kinds = [r["verdict"].split(":")[0] for r in rows]
    counts = {k: kinds.count(k) for k in ("right", "none", "refused", "wrong", "crash", "unjudged", "unbuildable")}
    built = sum(r.get("judged_by") == "construction" for r in rows if r["verdict"] == "right")
    return (
        f"census of {len(rows)} model types (transformers {transformers.__version__}): {counts['right']} right "
        f"({built} of them judged by the heads their attention modules were built with, the forward not run), "
        f"{counts['none']} without attention (surgeon and the forward agree), "
        f"{counts['refused']} refused, {counts['wrong']} silently wrong, {counts['crash']} crashed, "
        f"{counts['unjudged']} built but not judged (their forward could not be run), "
        f"{counts['unbuildable']} not buildable offline"
    )


def _by_reason(rows: list[dict], kind: str) -> str:
    """How many types of ``kind`` for each reason of helpers.census.NOT_JUDGED (and any no reason names)."""
    from helpers.census import NOT_JUDGED

    reasons = [r["reason"] for r in rows if r["verdict"].split(":")[0] == kind]
    named = [f"{reasons.count(reason)} {reason}" for reason, _ in NOT_JUDGED[kind] if reason in reasons]
    return ", ".join(named + ([f"{reasons.count(None)} with no reason named"] if None in reasons else [])) or "none"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: every type)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--json", type=Path, help="also write every row here")
    parser.add_argument("--update", action="store_true", help="rewrite tests/project/census_expected.json")
    parser.add_argument("--check", action="store_true", help="fail when a verdict differs from the expectations")
    parser.add_argument(
        "--head-classes",
        action="store_true",
        help="build each type's head class (what a Hub checkpoint is saved from, its own key names) rather than "
        "its base model; the expectations file is for base models: not with --update or --check",
    )
    args = parser.parse_args()
    if args.head_classes and (args.update or args.check):
        parser.error("--head-classes cannot --update or --check the expectations (they are for base models)")
    types = args.types.split(",") if args.types else all_types()
    start = time.perf_counter()
    rows = run(types, args.jobs, args.head_classes)
    print()
    for kind in ("wrong", "crash", "refused"):
        for r in (r for r in rows if r["verdict"].startswith(kind)):
            print(f"{kind:8s} {r['type']:28s} {r['verdict'][len(kind) + 2 :]} | {r['detail'][:200]}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    expected = json.loads(EXPECTED.read_text())["verdicts"] if EXPECTED.is_file() else {}
    changed = [r for r in rows if expected.get(r["type"]) != expected_verdict(r["verdict"])]
    for r in changed:
        was = expected.get(r["type"], "(new type)")
        print(f"changed  {r['type']:28s} {was} -> {expected_verdict(r['verdict'])}")
    if not args.types:
        for gone in sorted(set(expected) - {r["type"] for r in rows}):
            print(f"gone     {gone:28s} (no longer in transformers {expected.get(gone)})")
    if args.update:
        import transformers

        # every type: exactly this transformers' types (a type it dropped goes); some: those rows replaced
        new = {} if not args.types else dict(expected)
        new |= {r["type"]: expected_verdict(r["verdict"]) for r in rows}
        EXPECTED.write_text(
            json.dumps({"transformers": transformers.__version__, "verdicts": dict(sorted(new.items()))}, indent=1)
            + "\n"
        )
    print(summary(rows) + f" ({time.perf_counter() - start:.0f} s)")
    for kind in ("unjudged", "unbuildable"):
        print(f"  {kind}, by reason: {_by_reason(rows, kind)}")
    bad = any(r["verdict"].split(":")[0] in ("wrong", "crash") for r in rows)
    return 1 if bad or (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
