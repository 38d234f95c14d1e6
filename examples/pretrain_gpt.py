#!/usr/bin/env python
"""Pre-training from scratch: conditioned initialization of every attention layer of a small GPT.

    python examples/pretrain_gpt.py                # the full comparison, a few minutes on a CPU
    python examples/pretrain_gpt.py --quick        # a smoke run in seconds

A small GPT-2 (4 layers, width 128, 4 heads, byte-level vocabulary of 256) is built from a config and
trained on text every Python installation carries: the source files of its standard library (read
from disk; nothing is downloaded). Files are split into training and validation by file, so the
validation text is code the model has never seen.

Two starts, with the same data order and optimizer for each seed:
  default      GPT-2's own initialization (normal, std 0.02; scaled residual projections)
  conditioned  the same model, then surgeon.reinit_(model): every layer's Q/K per head semi-orthogonal,
               V the identity, q/k/v biases zero (the paper's recipe, applied at step 0)
It prints the training and validation losses (bits per byte) and saves a plot of the curves.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import surgeon  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _compare  # noqa: E402

VARIANTS = ("default", "conditioned")


def corpus(limit_bytes: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Bytes of the standard library's .py files (sorted, so every run reads the same text):
    every tenth file goes to validation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    train, val, total = bytearray(), bytearray(), 0
    for i, path in enumerate(files):
        data = path.read_bytes()
        (val if i % 10 == 9 else train).extend(data + b"\n")
        total += len(data)
        if total >= limit_bytes:
            break
    if not val:
        raise SystemExit(f"not enough text under {root}")
    as_ids = lambda b: torch.frombuffer(b, dtype=torch.uint8).long()  # noqa: E731
    return as_ids(train), as_ids(val), len(files)


def build(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=256,
        n_positions=args.context,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        loss_type="ForCausalLM",
    )
    return GPT2LMHeadModel(cfg)


def batches(data: torch.Tensor, args, rng: random.Random):
    while True:
        starts = [rng.randrange(0, len(data) - args.context - 1) for _ in range(args.batch)]
        yield torch.stack([data[s : s + args.context] for s in starts])


def run(variant: str, seed: int, args, train: torch.Tensor, val: torch.Tensor) -> dict:
    torch.manual_seed(seed)  # the same default init for both starts of a seed
    model = build(args)
    how = "GPT-2 default initialization"
    if variant == "conditioned":
        report = surgeon.reinit_(model, seed=seed)
        before = statistics.median(r.before.head_median for r in report.rows)
        how = f"surgeon.reinit_: {len(report.rows)} projections, median per-head kappa {before:.2f} -> {max(r.after.head_max for r in report.rows):.4f}"
    stream = batches(train, args, random.Random(seed))
    val_rng = random.Random(10_000 + seed)
    val_batches = [next(batches(val, args, val_rng)) for _ in range(args.val_batches)]

    def evaluate(step: int) -> tuple[int, float]:
        model.eval()
        with torch.no_grad():
            losses = [float(model(input_ids=b, labels=b).loss) for b in val_batches]
        model.train()
        return step, statistics.mean(losses)

    curve, evals = train_loop(model, args, stream, evaluate)
    return {"variant": variant, "seed": seed, "init": how, "train_loss": curve, "evals": evals}


def train_loop(model, args, stream, evaluate) -> tuple[list[float], list]:
    """AdamW (lr warmup, gradient clipping) on ``stream``'s batches; ``evaluate(step)`` at 0, every
    ``args.eval_every`` steps and at the end. Returns the training losses and the evaluations."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    curve, evals = [], [evaluate(0)]
    for step in range(1, args.steps + 1):
        x = next(stream)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        curve.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            evals.append(evaluate(step))
    return curve, evals


def bits(nats: float) -> float:
    return nats / math.log(2)


def summarize(results: list[dict], args) -> list[str]:
    steps = [s for s, _ in results[0]["evals"]]
    marks = sorted({steps[len(steps) // 4], steps[len(steps) // 2], steps[-1]})
    head = f"{'start':<12} {'seed':>4} " + " ".join(f"{'val@' + str(m):>9}" for m in marks) + f" {'train(last 20)':>15}"
    lines = [f"validation loss in bits per byte at steps {', '.join(map(str, marks))}", head]
    for r in results:
        by_step = dict(r["evals"])
        cells = " ".join(f"{bits(by_step[m]):>9.3f}" if m in by_step else f"{'-':>9}" for m in marks)
        lines.append(f"{r['variant']:<12} {r['seed']:>4} {cells} {bits(statistics.mean(r['train_loss'][-20:])):>15.3f}")
    lines.append("")
    for v in args.variants:
        finals = [bits(r["evals"][-1][1]) for r in results if r["variant"] == v]
        lines.append(
            f"{v:<12} final validation {statistics.mean(finals):.3f} bits/byte (min {min(finals):.3f}, max {max(finals):.3f}) over {len(finals)} seed(s)"
        )
    if set(VARIANTS) <= set(args.variants):
        base = {r["seed"]: dict(r["evals"]) for r in results if r["variant"] == "default"}
        for r in (r for r in results if r["variant"] == "conditioned"):
            target = base[r["seed"]][args.steps]
            hit = next((s for s, loss in r["evals"] if loss <= target), None)
            lines.append(
                f"seed {r['seed']}: conditioned reaches the default's final validation loss "
                + (f"at step {hit} of {args.steps}" if hit else "not within the run")
            )
    return lines


def run_starts(args, run) -> tuple[list[dict], float]:
    """Read the corpus, say what runs, then ``run(variant, seed, args, train, val)`` for every start of every seed."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    train, val, files = corpus(args.text_bytes)
    print(
        f"text: {len(train):,} training and {len(val):,} validation bytes from the first of {files} stdlib .py files; "
        f"model: GPT-2, {args.layers} layers, width {args.width}, {args.heads} heads, context {args.context}"
    )
    started = time.perf_counter()
    results = _compare.run_all(
        args,
        lambda variant, seed: run(variant, seed, args, train, val),
        lambda r, secs: (
            f"validation {bits(r['evals'][-1][1]):.3f} bits/byte after {args.steps} steps ({secs:.0f} s; {r['init']})"
        ),
    )
    return results, started


def add_model_options(
    parser, *, steps: int, context: int, width: int, layers: int, val_batches: int, text_bytes: int
) -> None:
    """The model, data and loop options shared by the GPT examples (their defaults differ)."""
    parser.add_argument("--steps", type=int, default=steps, help=f"training steps per run (default {steps})")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=context)
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--val-batches", type=int, default=val_batches)
    parser.add_argument(
        "--text-bytes", type=int, default=text_bytes, help=f"bytes of stdlib source to read (default {text_bytes:,})"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_options(parser, steps=400, context=128, width=128, layers=4, val_batches=8, text_bytes=4_000_000)
    _compare.add_options(parser, variants=VARIANTS, plot_name="pretrain_gpt.png", quick="6 steps, 1 seed, a tiny model")
    args = _compare.parse(parser, argv, VARIANTS)
    if args.quick:
        args.steps, args.seeds, args.batch, args.context, args.width, args.layers = 6, 1, 4, 32, 32, 2
        args.eval_every, args.val_batches, args.text_bytes, args.warmup = 3, 2, 200_000, 2
    results, started = run_starts(args, run)
    plot = lambda: _compare.plot_curves(  # noqa: E731
        results,
        args,
        colors={"default": "tab:gray", "conditioned": "tab:blue"},
        window=25,
        train=lambda r: [bits(x) for x in r["train_loss"]],
        evals=lambda r: [(s, bits(v)) for s, v in r["evals"]],
        left=("training loss (moving average)", "bits per byte"),
        right=("validation loss (unseen files)", "bits per byte"),
        suptitle=f"GPT-2 ({args.layers} layers, width {args.width}, {args.heads} heads) on Python stdlib source, byte level",
        max_top=8.2,
    )
    return _compare.finish(results, summarize(results, args), args, plot, started)


if __name__ == "__main__":
    main()
