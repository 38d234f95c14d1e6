#!/usr/bin/env python
"""A small, fair replication: default vs redraw vs conditioned vs scale-matched conditioned init of a GPT.

    python examples/replicate_small.py                # 3 seeds x 4 starts, a few minutes on a CPU
    python examples/replicate_small.py --quick        # a smoke run in seconds

The model, data and loop are those of examples/pretrain_gpt.py (a byte-level GPT-2 trained on the
Python standard library's source, validation on unseen files). Four starts per seed, each from the
same default-initialized model (torch.manual_seed(seed)), with the same batches and optimizer:

  default             GPT-2's own initialization, untouched
  redraw              surgeon.reinit_(model, mode="redraw"): q/k/v drawn again from the same
                      normal(0, 0.02), biases zeroed -- the control: "was it just a fresh draw?"
  conditioned         surgeon.reinit_(model): the paper's recipe (semi-orthogonal Q/K, identity V)
  conditioned-matched surgeon.reinit_(model, gain=0.02 * sqrt(width)): the same, with Q/K scaled to
                      the default init's Frobenius norm ("is it the conditioning or the scale?")
  mimetic             (opt-in, --variants default,mimetic) surgeon.reinit_(model, mode="mimetic"):
                      Trockman & Kolter's init of Q/K/V and W_O

Reported per start, over seeds (mean and min-max): the final validation loss, the step at which the
validation loss first reaches the default's final value (same seed), and the mean over training of
the attention Jacobian's exact condition number (surgeon.jacobian_report on one short validation
sequence, every evaluation, mean over layers and heads). Prints a table, saves JSON and a plot in
examples/out/.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _compare  # noqa: E402
import pretrain_gpt  # noqa: E402  (corpus, model and batches)
import torch  # noqa: E402

import surgeon  # noqa: E402

VARIANTS = ("default", "redraw", "conditioned", "conditioned-matched", "mimetic")
DEFAULT_VARIANTS = VARIANTS[:4]  # mimetic is opt-in: --variants default,mimetic


def reset(model, variant: str, seed: int, args) -> str:
    if variant == "default":
        return "GPT-2 default init (normal, std 0.02)"
    if variant == "mimetic":
        surgeon.reinit_(model, mode="mimetic", seed=seed)
        return "surgeon mimetic: W_Q W_K^T ~ 0.7 Z + 0.7 I, W_V W_O ~ 0.4 Z - 0.4 I (W_O written too)"
    if variant == "redraw":
        surgeon.reinit_(model, mode="redraw", seed=seed)
        return "surgeon redraw: q/k/v normal(0, 0.02) drawn again, biases zeroed"
    gain = 0.02 * math.sqrt(args.width) if variant == "conditioned-matched" else None
    surgeon.reinit_(model, seed=seed, gain=gain)
    return "surgeon conditioned" + (f", q/k gain {gain:.3f}" if gain else "")


def jacobian_kappa(model, probe: torch.Tensor) -> float:
    """Mean over layers and heads of the exact kappa(J) of each head on ``probe``."""
    report = surgeon.jacobian_report(model, probe, exact=True)
    values = [r.exact for r in report.rows]
    return statistics.mean(values)


def run(variant: str, seed: int, args, train, val) -> dict:
    torch.manual_seed(seed)
    model = pretrain_gpt.build(args)
    how = reset(model, variant, seed, args)
    stream = pretrain_gpt.batches(train, args, random.Random(seed))
    val_rng = random.Random(10_000 + seed)
    val_batches = [next(pretrain_gpt.batches(val, args, val_rng)) for _ in range(args.val_batches)]
    probe = val_batches[0][0, : args.probe_tokens]

    def evaluate(step: int) -> tuple[int, float, float]:
        model.eval()
        with torch.no_grad():
            loss = statistics.mean(float(model(input_ids=b, labels=b).loss) for b in val_batches)
        kj = jacobian_kappa(model, probe)
        model.train()
        return step, loss, kj

    curve, evals = pretrain_gpt.train_loop(model, args, stream, evaluate)
    return {"variant": variant, "seed": seed, "init": how, "train_loss": curve, "evals": evals}


bits = pretrain_gpt.bits


def spread(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    mean = statistics.mean(values)
    return f"{mean:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})" if len(values) > 1 else f"{mean:{fmt}}"


def summarize(results: list[dict], args) -> tuple[list[str], dict]:
    base = {r["seed"]: r["evals"][-1][1] for r in results if r["variant"] == "default"}
    table: dict[str, dict] = {}
    for v in args.variants:
        runs = [r for r in results if r["variant"] == v]
        finals = [bits(r["evals"][-1][1]) for r in runs]
        reach, missed = [], 0
        for r in runs:
            if r["seed"] not in base:
                continue
            hit = next((s for s, loss, _ in r["evals"] if loss <= base[r["seed"]]), None)
            if hit is None:
                missed += 1
            else:
                reach.append(hit)
        kj = [statistics.mean(k for _, _, k in r["evals"]) for r in runs]
        table[v] = {"final_bits": finals, "steps_to_default_final": reach, "missed": missed, "mean_kappa_j": kj}
    head = (
        f"{'start':<20} {'final val bits/byte':>26} {'steps to default final':>26} {'mean kappa(J) over training':>34}"
    )
    lines = [f"{len(set(r['seed'] for r in results))} seed(s), {args.steps} steps; mean (min-max) over seeds", head]
    for v, t in table.items():
        reach = spread(t["steps_to_default_final"], ".0f") if t["steps_to_default_final"] else "never"
        if t["missed"] and t["steps_to_default_final"]:
            reach += f", {t['missed']} never"
        lines.append(f"{v:<20} {spread(t['final_bits'], '.4f'):>26} {reach:>26} {spread(t['mean_kappa_j'], '.3g'):>34}")
    lines.append(
        "steps to default final: first evaluation (every "
        f"{args.eval_every} steps) whose validation loss is at or below the default start's final loss, same seed"
    )
    return lines, table


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pretrain_gpt.add_model_options(
        parser, steps=300, context=64, width=64, layers=2, val_batches=4, text_bytes=2_000_000
    )
    parser.add_argument(
        "--probe-tokens", type=int, default=16, help="tokens of the sequence the Jacobian is measured on"
    )
    _compare.add_options(
        parser, variants=VARIANTS, plot_name="replicate_small.png", quick="5 steps, 1 seed, a tiny model"
    )
    parser.set_defaults(seeds=3, variants=",".join(DEFAULT_VARIANTS))
    args = _compare.parse(parser, argv, VARIANTS)
    if args.quick:
        args.steps, args.seeds, args.batch, args.context, args.width, args.layers = 5, 1, 4, 32, 32, 2
        args.eval_every, args.val_batches, args.text_bytes, args.warmup, args.probe_tokens = 5, 1, 200_000, 2, 8
    results, started = pretrain_gpt.run_starts(args, run)
    lines, table = summarize(results, args)
    plot = lambda: plot_runs(results, args)  # noqa: E731
    out = _compare.finish(results, lines, args, plot, started)
    out["table"] = table
    return out


def plot_runs(results: list[dict], args) -> str:
    plt = _compare.pyplot()
    if plt is None:
        return _compare.NO_PLOT
    colors = _compare.COLORS
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps = [s for s, _, _ in r["evals"]]
        label = r["variant"] if r["seed"] == 0 else None
        ax1.plot(steps, [bits(v) for _, v, _ in r["evals"]], color=colors[r["variant"]], lw=1, alpha=0.8, label=label)
        ax2.plot(steps, [k for _, _, k in r["evals"]], color=colors[r["variant"]], lw=1, alpha=0.8, label=label)
    ax1.set(title="validation loss (unseen files)", xlabel="step", ylabel="bits per byte")
    ax2.set(title="mean exact kappa(J) of the attention heads", xlabel="step", ylabel="kappa(J)", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"GPT-2 ({args.layers} layers, width {args.width}, {args.heads} heads), stdlib source; one line per seed",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    plt.close(fig)
    return f"plot: {args.out}"


if __name__ == "__main__":
    main()
