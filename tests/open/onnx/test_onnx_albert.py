"""Weights shared across layers (ALBERT): the ONNX graph calls one attention layer several times;
surgeon sees one block per set of weights, as it does in the PyTorch checkpoint, and changes it once
(polar at strength 0.5 takes each head's kappa to kappa ** 0.5, not kappa ** 0.25)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from surgeon import inspect_checkpoint, reinit_checkpoint

from helpers.onnx_helpers import as_param, export, initializers, locate, ort_run, torch_forward

HEADS, D = 4, 8


def albert():
    from transformers import AlbertConfig, AlbertModel

    torch.manual_seed(0)
    cfg = AlbertConfig(
        vocab_size=96,
        embedding_size=16,
        hidden_size=HEADS * D,
        num_hidden_layers=3,
        num_attention_heads=HEADS,
        intermediate_size=48,
        max_position_embeddings=32,
    )
    model = AlbertModel(cfg).eval()
    with torch.no_grad():  # trained-looking biases: none of them zero
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.05)
    return model


def head_kappas(w: torch.Tensor) -> torch.Tensor:
    s = torch.linalg.svdvals(w.double().reshape(HEADS, D, -1))
    return s[:, 0] / s[:, -1]


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_shared_layer_is_one_block_changed_once(tmp_path, exporter):
    model = albert()
    path = tmp_path / "model.onnx"
    feeds = export(model, "bert", path, dynamo=exporter == "dynamo")
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    from_bin = inspect_checkpoint(tmp_path / "bin", device="cpu").blocks
    blocks = inspect_checkpoint(path, device="cpu").blocks
    assert len(blocks) == len(from_bin) == 1
    assert (blocks[0].stack, blocks[0].layer) == ("model." + from_bin[0].stack, from_bin[0].layer)

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    before = initializers(path)
    out = tmp_path / "out.onnx"
    report = reinit_checkpoint(path, output=out, layers="0", mode="polar", strength=0.5, device="cpu")
    assert len(report.rows) == 3 and any("used by 3 attention calls" in n for n in report.notes)
    after = initializers(out)
    reference = albert()
    prefix = "encoder.albert_layer_groups.0.albert_layers.0.attention."
    for leaf in ("query", "key", "value"):
        name = prefix + leaf + ".weight"
        where = locate(params, before, name)
        new = as_param(after, where)
        np.testing.assert_allclose(head_kappas(new), head_kappas(params[name]) ** 0.5, rtol=1e-4)
        with torch.no_grad():
            reference.get_parameter(name).copy_(new)
    changed = {locate(params, before, prefix + leaf + ".weight")[0] for leaf in ("query", "key", "value")}
    assert all(after[n].tobytes() == before[n].tobytes() for n in before if n not in changed)
    got = ort_run(out, feeds)
    np.testing.assert_allclose(got, torch_forward(reference, feeds), atol=1e-4, rtol=1e-4)
    assert not np.allclose(got, torch_forward(model, feeds), atol=1e-4)
