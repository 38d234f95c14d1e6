"""Models built from a config and not trained: every q/k/v bias and LayerNorm bias is zero, so the
exporters merge them into one shared initializer. Zeroing a bias that is zero already changes no
byte, so it is no conflict: surgeon re-initializes these exports (both exporters, every layer or one)
and onnxruntime computes what PyTorch computes with the same new weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from surgeon import reinit_checkpoint

from helpers.onnx_helpers import check_against_pytorch, export, initializers, ort_run, torch_forward


def untrained(family: str) -> torch.nn.Module:
    from transformers import (
        BartConfig,
        BartModel,
        BertConfig,
        BertModel,
        DistilBertConfig,
        DistilBertModel,
        RobertaConfig,
        RobertaModel,
        ViTConfig,
        ViTModel,
    )

    torch.manual_seed(0)
    small = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, hidden_size=32)
    if family == "bert":
        return BertModel(BertConfig(vocab_size=96, max_position_embeddings=32, **small)).eval()
    if family == "roberta":
        return RobertaModel(RobertaConfig(vocab_size=96, max_position_embeddings=40, **small)).eval()
    if family == "vit":
        return ViTModel(ViTConfig(image_size=16, patch_size=4, **small)).eval()
    if family == "distilbert":
        return DistilBertModel(
            DistilBertConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_position_embeddings=32)
        ).eval()
    cfg = BartConfig(
        vocab_size=96,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        max_position_embeddings=32,
    )
    return BartModel(cfg).eval()


CASES = [(f, e) for f in ("bert", "distilbert", "roberta", "vit", "bart") for e in ("legacy", "dynamo")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def case(request, tmp_path_factory):
    family, exporter = request.param
    model = untrained(family)
    path = tmp_path_factory.mktemp(f"untrained-{family}-{exporter}") / "model.onnx"
    feeds = export(
        model, "bart" if family == "bart" else "vit" if family == "vit" else "bert", path, dynamo=exporter == "dynamo"
    )
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return model, path, feeds, params, initializers(path)


def _layer(module: str) -> int:
    return int(next(p for p in module.split(".") if p.isdigit()))


@pytest.mark.parametrize("layers", ["all", "0"])
def test_untrained_export_with_merged_zero_biases(case, tmp_path: Path, layers):
    model, path, feeds, params, inits = case
    biases = [n for n, p in params.items() if n.endswith("bias") and ("attention" in n or "attn" in n or "_lin" in n)]
    assert biases and all(not params[n].any() for n in biases)  # untrained: the q/k/v biases are zero
    assert len(inits) < len(params)  # and the exporter merged equal initializers
    out = tmp_path / "out.onnx"
    report = reinit_checkpoint(path, output=out, layers=layers, device="cpu")
    assert any("zero already" in n for n in report.notes)
    chosen = (lambda tb: True) if layers == "all" else (lambda tb: _layer(tb.module) == 0)
    _, reference = check_against_pytorch(model, params, inits, initializers(out), chosen)
    got = ort_run(out, feeds)
    np.testing.assert_allclose(got, torch_forward(reference, feeds), atol=1e-4, rtol=1e-4)
    assert not np.allclose(got, torch_forward(model, feeds), atol=1e-4)
