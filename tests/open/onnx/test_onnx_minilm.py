"""The real all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads of 32), exported to ONNX with dynamic
batch and sequence axes as optimum exports it, re-initialized through the CLI and run."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from helpers.onnx_helpers import (
    assert_only_changed_bytes_differ,
    check_against_pytorch,
    export,
    initializers,
    ort_run,
    torch_forward,
)


@pytest.fixture(scope="module")
def minilm_onnx(minilm_dir, tmp_path_factory):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(minilm_dir), local_files_only=True).eval()
    path = tmp_path_factory.mktemp("minilm") / "model.onnx"
    export(model, "bert", path, dynamo=False, dynamic=True)
    return model, path


def test_minilm_onnx_reinit_last_two_layers(minilm_onnx, cli, tmp_path):
    model, path = minilm_onnx
    out = tmp_path / "minilm-reinit.onnx"
    report = json.loads(cli("reinit", path, "--layers", "-2-", "-o", out, "--device", "cpu", "--json").output)
    assert [(b["stack"], b["layer"], b["heads"], b["head_dim"]) for b in report["blocks"]] == [
        ("model.encoder.layer", i, 12, 32) for i in range(6)
    ]
    assert [(p["layer"], p["role"]) for p in report["projections"]] == [
        (layer, role) for layer in (4, 5) for role in "qkv"
    ]
    for row in report["projections"]:  # the pretrained heads are badly conditioned (method.md); the new ones are not
        assert row["before"]["head_kappa"]["median"] > 1.5 and abs(row["after"]["head_kappa"]["max"] - 1) < 1e-4

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    before, after = initializers(path), initializers(out)
    chosen = lambda tb: tb.module.split(".")[2] in ("4", "5")  # noqa: E731
    changed, reference = check_against_pytorch(model, params, before, after, chosen)
    assert len(changed) == 12  # q/k/v weights and biases of two layers
    assert_only_changed_bytes_differ(path, out, changed)
    assert [n.SerializeToString() for n in onnx.load(str(out)).graph.node] == [
        n.SerializeToString() for n in onnx.load(str(path)).graph.node
    ]

    # dynamic axes: run on another batch and sequence length than the export used
    rng = np.random.default_rng(0)
    feeds = {
        "input_ids": rng.integers(1000, 20000, (2, 11)).astype(np.int64),
        "attention_mask": np.ones((2, 11), np.int64),
    }
    feeds["attention_mask"][1, 8:] = 0
    got = ort_run(out, feeds)
    np.testing.assert_allclose(got, torch_forward(reference, feeds), atol=1e-4, rtol=1e-4)
    assert np.isfinite(got).all()
