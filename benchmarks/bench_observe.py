"""Wall time of the test suite's ground truth, ``observe of tests/helpers/observe.py``, on the tiny family models.

    python benchmarks/bench_observe.py                    # the families the suite times most
    python benchmarks/bench_observe.py --families llama,t5 --repeats 9

``observe`` runs two whole-model forwards per call (tests/project/test_observe_selfcheck.py bounds that work);
this prints how long a call takes: the median and spread of ``--repeats`` calls after one warm-up call,
per family. The machine is shared: compare figures from the same run, and rerun when the spread is wide.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

DEFAULT = "llama,falcon_new,bloom,t5,whisper,swin"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--families", default=DEFAULT, help=f"comma-separated names from tests/helpers/families.py (default {DEFAULT})"
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from helpers.families import FAMILIES
    from helpers.observe import observe

    print(f"{'family':<14}{'median s':>10}{'min s':>10}{'max s':>10}")
    for name in args.families.split(","):
        model = FAMILIES[name].make()
        observe(model)  # warm-up: first-call costs (imports, kernel selection) are not observe's
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            observe(model)
            times.append(time.perf_counter() - start)
        print(f"{name:<14}{statistics.median(times):>10.3f}{min(times):>10.3f}{max(times):>10.3f}")


if __name__ == "__main__":
    main()
