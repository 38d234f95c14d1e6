"""What both examples share: options, the loop over seeds and starts, the plot of curves, the saved numbers."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

OUT = Path(__file__).resolve().parent / "out"


def add_options(parser: argparse.ArgumentParser, *, variants: tuple[str, ...], plot_name: str, quick: str) -> None:
    parser.add_argument("--seeds", type=int, default=2, help="runs per start, seeds 0..N-1 (default 2)")
    parser.add_argument(
        "--variants", default=",".join(variants), help=f"comma-separated subset of {','.join(variants)}"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help=f"the plot (numbers beside it, .json); default: examples/out/{plot_name}, "
        "or a new temporary folder for --quick (a smoke run never overwrites the tracked results)",
    )
    parser.set_defaults(plot_name=plot_name)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for torch (default: torch's choice; 1 is fastest on a busy machine)",
    )
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {quick}")


def parse(parser: argparse.ArgumentParser, argv: list[str] | None, variants: tuple[str, ...]) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.out is None:
        folder = Path(tempfile.mkdtemp(prefix="surgeon-example-")) if args.quick else OUT
        args.out = folder / args.plot_name
    if args.threads:
        torch.set_num_threads(args.threads)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if set(args.variants) - set(variants):
        parser.error(f"unknown variant(s) {sorted(set(args.variants) - set(variants))}: use {', '.join(variants)}")
    return args


def run_all(args, run: Callable[[str, int], dict], describe: Callable[[dict, float], str]) -> list[dict]:
    """Every start for every seed, seed-major so that a partial run still compares like with like."""
    results = []
    for seed in range(args.seeds):
        for variant in args.variants:
            start = time.perf_counter()
            results.append(run(variant, seed))
            print(f"  {variant:<12} seed {seed}: {describe(results[-1], time.perf_counter() - start)}", flush=True)
    return results


def finish(results: list[dict], lines: list[str], args, plot: Callable[[], str], started: float) -> dict:
    """Print the summary, save the plot and every number beside it."""
    print("\n" + "\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(plot())
    args.out.with_suffix(".json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results})
    )
    print(f"numbers: {args.out.with_suffix('.json')}; total {time.perf_counter() - started:.0f} s")
    return {"results": results, "summary": lines}


NO_PLOT = "matplotlib is not installed (pip install 'attention-surgeon[examples]'): no plot"
COLORS = {  # one color per variant in every replication plot
    "default": "tab:gray",
    "redraw": "tab:orange",
    "conditioned": "tab:blue",
    "conditioned-matched": "tab:green",
    "mimetic": "tab:red",
}


def pyplot():
    """matplotlib.pyplot drawing to files (the Agg backend), or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_curves(
    results: list[dict],
    args,
    *,
    colors: dict[str, str],
    train: Callable[[dict], list[float]],
    window: int,
    evals: Callable[[dict], list[tuple[int, float]]],
    left: tuple[str, str],
    right: tuple[str, str],
    suptitle: str,
    right_ylim: tuple[float, float] | None = None,
    max_top: float | None = None,
) -> str:
    """Training curves (moving average) on the left, evaluations on the right: thin lines per seed,
    thick lines the mean over seeds. ``left``/``right`` are (title, y label)."""
    plt = pyplot()
    if plt is None:
        return NO_PLOT
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for variant in args.variants:
        runs = [r for r in results if r["variant"] == variant]
        losses = torch.tensor([train(r) for r in runs])
        k = max(1, min(window, losses.shape[1] // 5))
        smooth = F.avg_pool1d(losses[:, None], k, stride=1)[:, 0]
        steps = range(k, k + smooth.shape[1])
        values = torch.tensor([[v for _, v in evals(r)] for r in runs])
        eval_steps = [s for s, _ in evals(runs[0])]
        for i in range(len(runs)):
            ax1.plot(steps, smooth[i], color=colors[variant], alpha=0.25, lw=1)
            ax2.plot(eval_steps, values[i], color=colors[variant], alpha=0.25, lw=1)
        ax1.plot(steps, smooth.mean(0), color=colors[variant], lw=2.2, label=variant)
        ax2.plot(
            eval_steps,
            values.mean(0),
            color=colors[variant],
            lw=2.2,
            marker=".",
            label=f"{variant} (mean of {len(runs)})",
        )
    ax1.set(title=left[0], xlabel="step", ylabel=left[1])
    ax2.set(title=right[0], xlabel="step", ylabel=right[1])
    if right_ylim:
        ax2.set_ylim(*right_ylim)
    if max_top is not None:
        for ax in (ax1, ax2):
            ax.set_ylim(top=min(max_top, ax.get_ylim()[1]))
    ax2.legend(fontsize=8)
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    plt.close(fig)
    return f"plot: {args.out}"
