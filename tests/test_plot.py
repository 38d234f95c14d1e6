"""--plot: a PNG of each head's kappa per layer, drawn from the report's own numbers."""

from __future__ import annotations

import json

import matplotlib.image
import pytest

from conftest import expect_cli_error


def test_inspect_plot_of_the_real_minilm(cli, minilm_dir, tmp_path):
    png = tmp_path / "k.png"
    report = json.loads(cli("inspect", minilm_dir, "--plot", png, "--json").stdout)
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 900 and image.std() > 0.01
    from surgeon import inspect
    from surgeon.plot import points

    pts = points(inspect(minilm_dir))
    assert len(pts) == 6 * 3 * 12 and {p[2] for p in pts} == {"before"}
    by_json = sorted((p["role"], p["layer"], k) for p in report["projections"] for k in p["before"]["heads"])
    drawn = sorted((r, x, k) for r, x, _, k, _ in pts)
    assert [d[:2] for d in drawn] == [j[:2] for j in by_json]
    assert [d[2] for d in drawn] == pytest.approx([j[2] for j in by_json], rel=1e-9)


def test_reinit_plot_before_and_after(cli, minilm_dir, tmp_path):
    png = tmp_path / "r.png"
    result = cli("reinit", minilm_dir, "--layers", "-2-", "-o", tmp_path / "out", "--plot", png)
    assert f"wrote {png}" in result.stdout and matplotlib.image.imread(png).shape[1] > 900
    from surgeon import reinit
    from surgeon.plot import points

    pts = points(reinit(minilm_dir, layers="-2-", output=tmp_path / "out2"))
    after = [k for _, x, w, k, _ in pts if w == "after"]
    assert len(after) == 2 * 3 * 12 and after == pytest.approx([1.0] * len(after), abs=1e-5)
    assert {x for _, x, w, _, _ in pts if w == "after"} == {0, 1}  # the report lists the reset blocks only


def test_plot_refusals(cli, llama_dir, tmp_path):
    expect_cli_error(cli, llama_dir, "inspect", llama_dir, "--plot", tmp_path / "k.jpg", match="--plot writes a PNG")
    expect_cli_error(cli, llama_dir, "reinit", llama_dir, "--dry-run", "--plot", tmp_path / "k.png", match="a --dry-run computes none")
