"""--plot: a PNG of each head's kappa per layer, drawn from the report's own numbers.

What the figure shows is read back two ways -- the scatter points of the figure surgeon saved, and the
pixels of the PNG at those places -- and compared with kappas computed here by numpy from the weights
as the reference safetensors reader gives them, not from surgeon's numbers.
"""

from __future__ import annotations

import json

import matplotlib.figure
import matplotlib.image
import numpy as np
import pytest

from helpers.cli import expect_cli_error

ROLES = "qkv"


def weight_kappas(folder) -> dict[str, list[list[float]]]:
    """role -> per layer, each head's condition number, by numpy from the weights the reference reader gives
    (BERT's layout: head h is rows h*32..(h+1)*32 of encoder.layer.L.attention.self.{query,key,value}.weight)."""
    from safetensors.numpy import load_file

    state = load_file(folder / "model.safetensors")
    out = {}
    for role, leaf in zip(ROLES, ("query", "key", "value")):
        out[role] = []
        for layer in range(6):
            heads = state[f"encoder.layer.{layer}.attention.self.{leaf}.weight"].astype(np.float64).reshape(12, 32, 384)
            eig = np.linalg.eigvalsh(heads @ heads.transpose(0, 2, 1))  # squared singular values, ascending
            out[role].append(np.sqrt(eig[:, -1] / eig[:, 0]).tolist())
    return out


@pytest.fixture
def saved_figures(monkeypatch):
    """The figures surgeon saves, kept (with the dpi they were saved at) for reading back."""
    figures = []
    real = matplotlib.figure.Figure.savefig

    def savefig(self, *args, **kwargs):
        figures.append((self, kwargs.get("dpi", self.dpi)))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return figures


def drawn(figure) -> dict[tuple[str, str], np.ndarray]:
    """(role, "before"/"after") -> the (x, kappa) points of that panel's scatter."""
    axes = figure.axes[:3]
    assert [ax.get_title() for ax in axes] == ["query (q)", "key (k)", "value (v)"]
    return {(role, c.get_label()): np.asarray(c.get_offsets()) for role, ax in zip(ROLES, axes) for c in ax.collections}


def assert_pixels_drawn(png, figure, dpi, role, points) -> None:
    """The PNG is not background where each point sits (data -> display coordinates of its panel)."""
    image = matplotlib.image.imread(png)[..., :3]
    ax = figure.axes[ROLES.index(role)]
    xy = ax.transData.transform(points) * (dpi / figure.dpi)
    cols, rows = np.rint(xy[:, 0]).astype(int), np.rint(image.shape[0] - xy[:, 1]).astype(int)
    shade = image[rows, cols].mean(axis=-1)
    assert (shade < 0.9).all(), f"{role}: {int((shade >= 0.9).sum())} of {len(points)} points are not in the PNG"


def same_points(got: np.ndarray, want: list[tuple[float, float]], what: str) -> None:
    got = sorted(map(tuple, got.tolist()))
    want = sorted(want)
    assert len(got) == len(want), f"{what}: {len(got)} points drawn, {len(want)} heads"
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want]), f"{what}: points at the wrong blocks"
    assert [g[1] for g in got] == pytest.approx([w[1] for w in want], rel=1e-4), (
        f"{what}: the plotted kappas are not the weights'"
    )


def test_inspect_plot_of_the_real_minilm(cli, minilm_dir, tmp_path, saved_figures):
    png = tmp_path / "k.png"
    report = json.loads(cli("inspect", minilm_dir, "--plot", png, "--json").stdout)
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 900 and image.std() > 0.01
    [(figure, dpi)] = saved_figures
    kappas = weight_kappas(minilm_dir)
    panels = drawn(figure)
    assert set(panels) == {(r, "before") for r in ROLES}  # an inspect plot has no "after"
    for role in ROLES:
        same_points(panels[role, "before"], [(x, k) for x, layer in enumerate(kappas[role]) for k in layer], role)
        assert_pixels_drawn(png, figure, dpi, role, panels[role, "before"])
    from surgeon import inspect
    from surgeon.report.plot import points

    pts = points(inspect(minilm_dir))
    assert len(pts) == 6 * 3 * 12 and {p[2] for p in pts} == {"before"}
    by_json = sorted((p["role"], p["layer"], k) for p in report["projections"] for k in p["before"]["heads"])
    drawn_pts = sorted((r, x, k) for r, x, _, k, _ in pts)
    assert [d[:2] for d in drawn_pts] == [j[:2] for j in by_json]
    assert [d[2] for d in drawn_pts] == pytest.approx([j[2] for j in by_json], rel=1e-9)


def test_reinit_plot_before_and_after(cli, minilm_dir, tmp_path, saved_figures):
    png = tmp_path / "r.png"
    result = cli("reinit", minilm_dir, "--layers", "-2-", "-o", tmp_path / "out", "--plot", png)
    assert f"wrote {png}" in result.stdout and matplotlib.image.imread(png).shape[1] > 900
    [(figure, dpi)] = saved_figures
    before, after = weight_kappas(minilm_dir), weight_kappas(tmp_path / "out")
    panels = drawn(figure)
    for role in ROLES:
        # the reset blocks only (layers 4 and 5, drawn at x 0 and 1), before shifted left and after right
        same_points(
            panels[role, "before"],
            [(x - 0.12, k) for x, layer in enumerate(before[role][4:]) for k in layer],
            f"{role} before",
        )
        same_points(
            panels[role, "after"],
            [(x + 0.12, k) for x, layer in enumerate(after[role][4:]) for k in layer],
            f"{role} after",
        )
        assert (
            after[role][4] == pytest.approx([1.0] * 12, abs=1e-4) and after[role][:4] == before[role][:4]
        )  # only layers 4, 5 reset
        assert_pixels_drawn(png, figure, dpi, role, panels[role, "after"])
    from surgeon import reinit
    from surgeon.report.plot import points

    pts = points(reinit(minilm_dir, layers="-2-", output=tmp_path / "out2"))
    after_pts = [k for _, x, w, k, _ in pts if w == "after"]
    assert len(after_pts) == 2 * 3 * 12 and after_pts == pytest.approx([1.0] * len(after_pts), abs=1e-5)
    assert {x for _, x, w, _, _ in pts if w == "after"} == {0, 1}  # the report lists the reset blocks only


def test_plot_refusals(cli, llama_dir, tmp_path):
    expect_cli_error(cli, llama_dir, "inspect", llama_dir, "--plot", tmp_path / "k.jpg", match="--plot writes a PNG")
    expect_cli_error(
        cli,
        llama_dir,
        "reinit",
        llama_dir,
        "--dry-run",
        "--plot",
        tmp_path / "k.png",
        match="a --dry-run computes none",
    )
