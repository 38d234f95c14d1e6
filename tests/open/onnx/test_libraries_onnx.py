"""ONNX from libraries' exports: a quantized (QDQ int8) graph is refused by name."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from surgeon.api import inspect_checkpoint
from surgeon.errors import UnsupportedWeightsError

from helpers.libraries import CoAtNet, VitsEncoder
from helpers.modules import TimmVisionTransformer

pytest.importorskip("onnxruntime")


def test_qdq_quantized_graph_is_refused_as_quantized(tmp_path):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    torch.manual_seed(0)
    model = TimmVisionTransformer(img_size=8, patch_size=4, dim=16, depth=1, num_heads=2).eval()
    x = torch.randn(1, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (x,),
            str(tmp_path / "float.onnx"),
            input_names=["pixel_values"],
            output_names=["out"],
            dynamo=False,
            opset_version=17,
        )
    assert inspect_checkpoint(tmp_path / "float.onnx").blocks  # the float export is read

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(
                [
                    {"pixel_values": np.random.default_rng(i).standard_normal((1, 3, 8, 8)).astype(np.float32)}
                    for i in range(4)
                ]
            )

        def get_next(self):
            return next(self.feeds, None)

    quantize_static(str(tmp_path / "float.onnx"), str(tmp_path / "int8.onnx"), Reader(), quant_format=QuantFormat.QDQ)
    with pytest.raises(
        UnsupportedWeightsError,
        match=r"quantized \(QuantizeLinear/DequantizeLinear\): re-initialize the float model, then quantize again",
    ):
        inspect_checkpoint(tmp_path / "int8.onnx")


def test_vits_1x1_conv_projections_are_followed(tmp_path):
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from surgeon.api import reinit_checkpoint

    torch.manual_seed(0)
    model = VitsEncoder(channels=16, n_heads=2, n_layers=2).eval()
    with torch.no_grad():
        for conv in model.modules():
            if isinstance(conv, torch.nn.Conv1d):
                conv.bias.normal_(0, 0.1)
    x = torch.randn(1, 16, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (x,),
            str(tmp_path / "vits.onnx"),
            input_names=["x"],
            output_names=["y"],
            dynamo=False,
            opset_version=17,
        )
    found = inspect_checkpoint(tmp_path / "vits.onnx")
    assert [(b.layer, b.kind, b.heads, b.head_dim) for b in found.blocks] == [(0, "self", 2, 8), (1, "self", 2, 8)]
    reinit_checkpoint(tmp_path / "vits.onnx", output=tmp_path / "out.onnx", heads="0", layers="1")
    before = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "vits.onnx")).graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "out.onnx")).graph.initializer}
    block = found.blocks[1]
    q = torch.tensor(after[block.q.weight.tensor]).reshape(16, 16).double()
    assert after[block.q.weight.tensor].shape == (16, 16, 1)
    assert torch.allclose(q[:8] @ q[:8].T, torch.eye(8, dtype=torch.float64), atol=1e-5)
    assert np.array_equal(after[block.q.weight.tensor][8:], before[block.q.weight.tensor][8:])
    v = torch.tensor(after[block.v.weight.tensor]).reshape(16, 16)
    assert torch.equal(v[:8], torch.eye(16)[:8])
    assert np.all(after[block.q.bias.tensor][:8] == 0) and np.array_equal(
        after[block.q.bias.tensor][8:], before[block.q.bias.tensor][8:]
    )
    untouched = found.blocks[0].q.weight.tensor
    assert np.array_equal(after[untouched], before[untouched])
    # the rewritten graph runs, and matches the PyTorch model given the same weights
    model.attn_layers[1].conv_q.weight.data = torch.tensor(after[block.q.weight.tensor])
    model.attn_layers[1].conv_q.bias.data = torch.tensor(after[block.q.bias.tensor])
    model.attn_layers[1].conv_k.weight.data = torch.tensor(after[block.k.weight.tensor])
    model.attn_layers[1].conv_k.bias.data = torch.tensor(after[block.k.bias.tensor])
    model.attn_layers[1].conv_v.weight.data = torch.tensor(after[block.v.weight.tensor])
    model.attn_layers[1].conv_v.bias.data = torch.tensor(after[block.v.bias.tensor])
    got = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.numpy()}
    )[0]
    with torch.no_grad():
        assert np.allclose(got, model(x).numpy(), atol=1e-4)


def test_fused_per_head_1x1_conv_qkv_is_not_guessed(tmp_path):
    """timm's Attention2d (CoAtNet) packs its 1x1-conv qkv per head and cuts q, k, v after the head
    split: the walk refuses it rather than reading one head of 3 d features."""
    from surgeon.errors import NoAttentionFoundError

    attn = CoAtNet(dim=32, depth=1).stages[0].blocks[0]["attn"].eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            attn,
            (torch.randn(1, 32, 3, 3),),
            str(tmp_path / "coat.onnx"),
            input_names=["x"],
            output_names=["y"],
            dynamo=False,
            opset_version=17,
        )
    with pytest.raises(NoAttentionFoundError, match="1x1 convolution.*after its head split"):
        inspect_checkpoint(tmp_path / "coat.onnx")
