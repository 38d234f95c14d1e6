"""``--plot FILE.png``: per layer, the per-head condition numbers of q, k and v (before and after a reinit).

matplotlib is an optional dependency (``pip install 'attention-surgeon[plot]'``), imported only when a plot is
asked for, with the non-interactive Agg backend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..vocab.blocks import Role
    from .report import Report

ROLES = ("q", "k", "v")
NAMES = {"q": "query", "k": "key", "v": "value"}


def points(report: Report) -> list[tuple[Role, int, str, float, bool]]:
    """What the plot draws: (role, block index, "before"/"after", kappa, has an after) per head; NaN/Inf left out."""
    blocks = list(dict.fromkeys(r.block.module for r in report.rows))
    out = []
    for r in report.rows:
        for which, spectrum in (("before", r.before), ("after", r.after)):
            if spectrum is not None:
                out += [
                    (r.role, blocks.index(r.block.module), which, k, r.after is not None)
                    for k in spectrum.head_kappas
                    if math.isfinite(k)
                ]
    return out


def plot_kappas(report: Report, path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG: one panel per projection (q, k, v), x = attention block in model order, y = each head's kappa (log).

    Inspect reports show the heads as they are; reinit reports show each projection before (grey)
    and after (colour); projections the reinit did not touch keep their before values only.
    """
    from ..errors import OptionError, opt

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        raise OptionError(f"{opt('plot')} needs matplotlib: pip install 'attention-surgeon[plot]'") from None
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise OptionError(f"{opt('plot')} writes a PNG: give a FILE.png, not {path.name}")
    blocks = list(dict.fromkeys(r.block.module for r in report.rows))
    label = {r.block.module: r.block.label + (" cross" if r.block.kind == "cross" else "") for r in report.rows}
    fig, axes = plt.subplots(1, 3, figsize=(max(9.0, 1.0 + 0.55 * len(blocks) * 3), 3.6), sharey=True, squeeze=False)
    pts = points(report)
    for ax, role in zip(axes[0], ROLES):
        for which, colour, offset in (("before", "0.55", -0.12), ("after", "C0", 0.12)):
            mine = [(x, k, moved) for r, x, w, k, moved in pts if r == role and w == which]
            if mine:
                ax.scatter(
                    [x + (offset if moved else 0.0) for x, _, moved in mine],
                    [k for _, k, _ in mine],
                    s=10,
                    c=colour,
                    alpha=0.7,
                    label=which,
                    linewidths=0,
                )
        ax.set_title(f"{NAMES[role]} ({role})")
        ax.set_yscale("log")
        ax.set_xticks(range(len(blocks)))
        ax.set_xticklabels([label[b] for b in blocks], rotation=60, ha="right", fontsize=7)
        ax.grid(True, which="both", axis="y", alpha=0.3)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    axes[0][0].set_ylabel("per-head condition number")
    if any(r.after is not None for r in report.rows):
        axes[0][0].legend(fontsize=8)  # labels once per panel: only the first panel shows them
    name = "/".join(Path(str(report.source)).parts[-2:])  # not the whole local path
    fig.suptitle(
        title
        or f"{name}: per-head kappa by attention block"
        + (" (before -> after)" if any(r.after is not None for r in report.rows) else ""),
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
