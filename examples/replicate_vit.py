#!/usr/bin/env python
"""The small replication on images: default vs redraw vs conditioned init of a tiny ViT.

    python examples/replicate_vit.py                  # 3 seeds x 4 starts, a few minutes on a CPU
    python examples/replicate_vit.py --quick          # a smoke run in seconds

Data: generated, nothing downloaded. 12 x 12 grey images of one bar (horizontal, vertical, diagonal
or anti-diagonal: the 4 classes) at a random place, length and brightness, on Gaussian noise; a fixed
validation set from its own seed. Model: transformers' ViTForImageClassification built from a config
(patch 4, so 9 patches + CLS), trained with AdamW. The starts are those of replicate_small.py
(default, redraw, conditioned, conditioned with q/k scaled to the default init's norm), each from the
same default-initialized model of the seed, with the same batches.

Reported over seeds (mean and min-max): final validation loss (nats) and accuracy, the step at which
the validation loss first reaches the default start's final value (same seed), and the exact attention
Jacobian kappa (surgeon.jacobian_report, mean over layers and heads, one validation image) at the
start and at the end of training. Prints a table, saves JSON and a plot in examples/out/.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _compare  # noqa: E402
import replicate_small  # noqa: E402  (the starts and the table)
import torch  # noqa: E402

import surgeon  # noqa: E402

VARIANTS = ("default", "redraw", "conditioned", "conditioned-matched")
SIDE, PATCH, CLASSES = 12, 4, 4


def bars(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images (n, 1, SIDE, SIDE) of one bar each, and their class (0 -, 1 |, 2 \\, 3 /)."""
    labels = torch.randint(0, CLASSES, (n,), generator=generator)
    images = torch.randn(n, 1, SIDE, SIDE, generator=generator) * 0.3
    for i, c in enumerate(labels.tolist()):
        length = int(torch.randint(5, SIDE - 1, (1,), generator=generator))
        r0, c0 = (int(v) for v in torch.randint(0, SIDE - length + 1, (2,), generator=generator))
        fixed = int(torch.randint(0, SIDE, (1,), generator=generator))
        level = 0.8 + 0.4 * float(torch.rand(1, generator=generator))
        for t in range(length):
            r, col = [(fixed, c0 + t), (r0 + t, fixed), (r0 + t, c0 + t), (r0 + t, c0 + length - 1 - t)][c]
            images[i, 0, r, col] += level
    return images, labels


def build(args):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        image_size=SIDE,
        patch_size=PATCH,
        num_channels=1,
        hidden_size=args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=2 * args.width,
        num_labels=CLASSES,
    )
    return ViTForImageClassification(cfg)


def kappa_j(model, image: torch.Tensor) -> float:
    report = surgeon.jacobian_report(model, {"pixel_values": image}, exact=True)
    return statistics.mean(r.exact for r in report.rows)


def run(variant: str, seed: int, args, val) -> dict:
    torch.manual_seed(seed)
    model = build(args)
    how = (
        "ViT default init (truncated normal, std 0.02)"
        if variant == "default"
        else replicate_small.reset(model, variant, seed, args)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    data = torch.Generator().manual_seed(seed)
    x_val, y_val = val

    def evaluate(step: int) -> tuple[int, float, float]:
        model.eval()
        with torch.no_grad():
            logits = model(pixel_values=x_val).logits
        model.train()
        return (
            step,
            float(torch.nn.functional.cross_entropy(logits, y_val)),
            float((logits.argmax(-1) == y_val).float().mean()),
        )

    kj_start = kappa_j(model, x_val[:1])
    model.train()
    evals = [evaluate(0)]
    for step in range(1, args.steps + 1):
        x, y = bars(args.batch, data)
        loss = torch.nn.functional.cross_entropy(model(pixel_values=x).logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            evals.append(evaluate(step))
    kj_end = kappa_j(model, x_val[:1])
    return {"variant": variant, "seed": seed, "init": how, "evals": evals, "kappa_j": [kj_start, kj_end]}


def summarize(results: list[dict], args) -> list[str]:
    base = {r["seed"]: r["evals"][-1][1] for r in results if r["variant"] == "default"}
    spread = replicate_small.spread
    lines = [
        f"{args.seeds} seed(s), {args.steps} steps of batch {args.batch}; mean (min-max) over seeds",
        f"{'start':<20} {'final val loss':>22} {'final val accuracy':>22} {'steps to default final':>24} {'kappa(J) start -> end':>28}",
    ]
    for v in args.variants:
        runs = [r for r in results if r["variant"] == v]
        reach = [
            next((s for s, loss, _ in r["evals"][1:] if loss <= base[r["seed"]]), None)
            for r in runs
            if r["seed"] in base
        ]
        hit = [s for s in reach if s is not None]
        reached = (spread(hit, ".0f") if hit else "never") + (
            f", {len(reach) - len(hit)} never" if hit and len(hit) < len(reach) else ""
        )
        kj = f"{spread([r['kappa_j'][0] for r in runs], '.3g')} -> {spread([r['kappa_j'][1] for r in runs], '.3g')}"
        lines.append(
            f"{v:<20} {spread([r['evals'][-1][1] for r in runs], '.4f'):>22} "
            f"{spread([r['evals'][-1][2] for r in runs], '.3f'):>22} {reached:>24} {kj:>28}"
        )
    return lines


def plot_runs(results: list[dict], args) -> str:
    plt = _compare.pyplot()
    if plt is None:
        return _compare.NO_PLOT
    colors = _compare.COLORS
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        ax.plot(
            [s for s, _, _ in r["evals"]],
            [v for _, v, _ in r["evals"]],
            color=colors[r["variant"]],
            lw=1,
            label=r["variant"] if r["seed"] == 0 else None,
        )
    ax.set(
        title=f"tiny ViT ({args.layers} layers, width {args.width}) on generated bars",
        xlabel="step",
        ylabel="validation loss (nats)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    plt.close(fig)
    return f"plot: {args.out}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--val-size", type=int, default=512)
    _compare.add_options(parser, variants=VARIANTS, plot_name="replicate_vit.png", quick="5 steps, 1 seed")
    parser.set_defaults(seeds=3, variants=",".join(VARIANTS))
    args = _compare.parse(parser, argv, VARIANTS)
    if args.quick:
        args.steps, args.seeds, args.batch, args.eval_every, args.val_size = 5, 1, 8, 5, 32
    from transformers.utils import logging

    logging.set_verbosity_error()
    val = bars(args.val_size, torch.Generator().manual_seed(12345))
    print(
        f"data: generated {SIDE}x{SIDE} bars, {CLASSES} classes, {args.val_size} validation images; model: ViT, "
        f"{args.layers} layers, width {args.width}, {args.heads} heads, patch {PATCH}"
    )
    started = time.perf_counter()
    results = _compare.run_all(
        args,
        lambda variant, seed: run(variant, seed, args, val),
        lambda r, secs: (
            f"validation loss {r['evals'][-1][1]:.4f}, accuracy {r['evals'][-1][2]:.3f} ({secs:.0f} s; {r['init']})"
        ),
    )
    lines = summarize(results, args)
    return _compare.finish(results, lines, args, lambda: plot_runs(results, args), started)


if __name__ == "__main__":
    main()
