"""The examples run end to end at a tiny size (--quick): real model, real data, real training steps."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from helpers.paths import ROOT

EXAMPLES = ROOT / "examples"


@pytest.fixture(autouse=True)
def keep_threads():
    threads = torch.get_num_threads()  # the examples' --threads sets torch's global thread count
    yield
    torch.set_num_threads(threads)


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefinetune_minilm_quick(tmp_path, capsys):
    out = tmp_path / "minilm.png"
    result = load("prefinetune_minilm").main(["--quick", "--threads", "1", "--out", str(out)])
    runs = {r["variant"]: r for r in result["results"]}
    assert set(runs) == {"none", "conditioned", "default"}
    assert "kappa" in runs["conditioned"]["reset"] and runs["conditioned"]["reset"].endswith("-> max 1.0000")
    for r in runs.values():
        assert len(r["train_loss"]) == 4 and all(math.isfinite(x) for x in r["train_loss"])
        assert [s for s, _, _ in r["evals"]] == [0, 2, 4]
        assert all(0.0 <= acc <= 1.0 and math.isfinite(loss) for _, acc, loss in r["evals"])
    # "none" and "default" start from different encoders but the same head and batches
    assert runs["none"]["evals"][0] != runs["conditioned"]["evals"][0]
    printed = capsys.readouterr().out
    assert "mean test accuracy" in printed and f"plot: {out}" in printed
    assert out.stat().st_size > 10_000
    saved = json.loads(out.with_suffix(".json").read_text())
    assert len(saved["results"]) == 3


def test_pretrain_gpt_quick(tmp_path, capsys):
    out = tmp_path / "gpt.png"
    result = load("pretrain_gpt").main(["--quick", "--threads", "1", "--out", str(out)])
    runs = {r["variant"]: r for r in result["results"]}
    assert set(runs) == {"default", "conditioned"}
    assert runs["conditioned"]["init"].startswith("surgeon.reinit_: 6 projections")
    for r in runs.values():
        assert len(r["train_loss"]) == 6
        # a byte-level model starts near log2(256) = 8 bits per byte and learns something in 6 steps
        first, last = r["evals"][0][1] / math.log(2), r["evals"][-1][1] / math.log(2)
        assert 7.0 < first < 8.5 and last < first
    printed = capsys.readouterr().out
    assert "final validation" in printed and f"plot: {out}" in printed
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize("name", ["prefinetune_minilm", "pretrain_gpt"])
def test_bad_variant_is_a_usage_error(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        load(name).main(["--variants", "mimetic"])
    assert exit_.value.code == 2
    assert "unknown variant(s) ['mimetic']" in capsys.readouterr().err


def test_replicate_small_quick(tmp_path, capsys):
    out = tmp_path / "rep.png"
    result = load("replicate_small").main(["--quick", "--threads", "1", "--out", str(out)])
    runs = {r["variant"]: r for r in result["results"]}
    assert set(runs) == {"default", "redraw", "conditioned", "conditioned-matched"}
    assert "gain 0.113" in runs["conditioned-matched"]["init"]  # 0.02 * sqrt(32)
    for r in runs.values():
        assert len(r["train_loss"]) == 5 and [s for s, _, _ in r["evals"]] == [0, 5]
        assert all(math.isfinite(loss) and kj >= 1 for _, loss, kj in r["evals"])
    # at step 0 the conditioned heads are far better conditioned than the default ones (same seed, same model)
    assert runs["conditioned"]["evals"][0][2] < runs["default"]["evals"][0][2] / 5
    table = result["table"]
    assert table["default"]["steps_to_default_final"] == [5]  # the default reaches its own final loss at its last step
    assert table["conditioned"]["mean_kappa_j"][0] == pytest.approx(
        sum(k for _, _, k in runs["conditioned"]["evals"]) / 2
    )
    printed = capsys.readouterr().out
    assert "steps to default final" in printed and f"plot: {out}" in printed
    assert out.stat().st_size > 10_000 and len(json.loads(out.with_suffix(".json").read_text())["results"]) == 4


def test_replicate_small_mimetic_is_opt_in(tmp_path):
    result = load("replicate_small").main(
        ["--quick", "--threads", "1", "--variants", "default,mimetic", "--out", str(tmp_path / "m.png")]
    )
    runs = {r["variant"]: r for r in result["results"]}
    assert set(runs) == {"default", "mimetic"} and "W_O written too" in runs["mimetic"]["init"]
    assert all(math.isfinite(loss) for _, loss, _ in runs["mimetic"]["evals"])


def test_replicate_vit_quick(tmp_path, capsys):
    module = load("replicate_vit")
    images, labels = module.bars(64, __import__("torch").Generator().manual_seed(0))
    assert images.shape == (64, 1, 12, 12) and set(labels.tolist()) <= {0, 1, 2, 3}
    # each image holds one bar brighter than the noise, along its class's direction: a horizontal bar
    # makes one row's sum stand out, a vertical one a column's
    row_max, col_max = images[:, 0].sum(2).max(1).values, images[:, 0].sum(1).max(1).values
    assert float((row_max > col_max)[labels == 0].float().mean()) > 0.9
    assert float((col_max > row_max)[labels == 1].float().mean()) > 0.9
    out = tmp_path / "vit.png"
    result = module.main(["--quick", "--threads", "1", "--out", str(out)])
    runs = {r["variant"]: r for r in result["results"]}
    assert (
        set(runs) == {"default", "redraw", "conditioned", "conditioned-matched"}
        and "ViT default" in runs["default"]["init"]
    )
    for r in runs.values():
        assert [s for s, _, _ in r["evals"]] == [0, 5] and all(math.isfinite(x) for _, x, _ in r["evals"])
        assert all(k >= 1 for k in r["kappa_j"])
    assert runs["conditioned"]["kappa_j"][0] < runs["default"]["kappa_j"][0]  # same model, conditioned heads
    assert "kappa(J) start -> end" in capsys.readouterr().out and out.stat().st_size > 5_000


@pytest.mark.parametrize("name", ["pretrain_gpt", "prefinetune_minilm"])
def test_a_quick_run_without_out_writes_a_temporary_folder_not_the_tracked_results(name, tmp_path, capsys, monkeypatch):
    import tempfile

    from helpers.digests import tree_digest

    tracked = tree_digest(EXAMPLES / "out")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes the run's folder
    load(name).main(["--quick", "--threads", "1"])
    assert tree_digest(EXAMPLES / "out") == tracked
    plots = list(tmp_path.glob(f"surgeon-example-*/{name}.png"))
    assert len(plots) == 1 and plots[0].with_suffix(".json").is_file()
    assert f"plot: {plots[0]}" in capsys.readouterr().out
