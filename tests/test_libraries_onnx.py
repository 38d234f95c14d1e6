"""ONNX from libraries' exports: a quantized (QDQ int8) graph is refused by name."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from surgeon.api import inspect_checkpoint
from surgeon.errors import UnsupportedWeightsError

from _modules import TimmVisionTransformer

pytest.importorskip("onnxruntime")


def test_qdq_quantized_graph_is_refused_as_quantized(tmp_path):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    torch.manual_seed(0)
    model = TimmVisionTransformer(img_size=8, patch_size=4, dim=16, depth=1, num_heads=2).eval()
    x = torch.randn(1, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(tmp_path / "float.onnx"), input_names=["pixel_values"], output_names=["out"], dynamo=False, opset_version=17)
    assert inspect_checkpoint(tmp_path / "float.onnx").blocks  # the float export is read

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([{"pixel_values": np.random.default_rng(i).standard_normal((1, 3, 8, 8)).astype(np.float32)} for i in range(4)])

        def get_next(self):
            return next(self.feeds, None)

    quantize_static(str(tmp_path / "float.onnx"), str(tmp_path / "int8.onnx"), Reader(), quant_format=QuantFormat.QDQ)
    with pytest.raises(UnsupportedWeightsError, match=r"quantized \(QuantizeLinear/DequantizeLinear\): re-initialize the float model, then quantize again"):
        inspect_checkpoint(tmp_path / "int8.onnx")
