"""A hybrid written in plain PyTorch (attention in layers 1 and 3, a mixer without attention in 0 and
2) keeps its own layer numbers on the routes without names: the module walker (the forward probe)
and an ONNX export (the graph walker, numbered from the exporter's scopes)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from surgeon import inspect_checkpoint, reinit_, reinit_checkpoint
from surgeon.errors import SelectionError

from helpers.onnx_helpers import initializers, ort_run


class Attention(torch.nn.Module):
    def __init__(self, width: int = 16, heads: int = 4):
        super().__init__()
        self.heads, self.d = heads, width // heads
        self.query, self.key, self.value, self.out = (torch.nn.Linear(width, width) for _ in range(4))

    def forward(self, x):  # (sequence, width)
        n = x.shape[0]
        q, k, v = (m(x).view(n, self.heads, self.d).transpose(0, 1) for m in (self.query, self.key, self.value))
        p = torch.softmax(q @ k.transpose(-1, -2) / self.d**0.5, dim=-1)
        return self.out((p @ v).transpose(0, 1).reshape(n, -1))


class Mixer(torch.nn.Module):  # a stand-in for a Mamba/convolution layer: no attention
    def __init__(self, width: int = 16):
        super().__init__()
        self.mix = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.mix(x))


class Hybrid(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Mixer(), Attention(), Mixer(), Attention(), Mixer()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def hybrid():
    torch.manual_seed(0)
    return Hybrid().eval()


def test_module_walker_numbers_by_the_models_layers():
    model = hybrid()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        SelectionError, match="selects only layers without attention in layers .*: the layers with attention are 1,3$"
    ):
        reinit_(model, layers="-1", example_inputs=torch.randn(5, 16))  # layer 4, the last, is a mixer
    report = reinit_(model, layers="3", example_inputs=torch.randn(5, 16))
    assert {(r.block.module, r.block.layer) for r in report.rows} == {("layers.3", 3)}
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {f"layers.3.{p}.{t}" for p in ("query", "key", "value") for t in ("weight", "bias")}


def test_onnx_scopes_number_by_the_models_layers(tmp_path):
    model = hybrid()
    x = torch.randn(5, 16)
    path = tmp_path / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), input_names=["x"], dynamo=False, opset_version=18)
    blocks = inspect_checkpoint(path, device="cpu").blocks
    assert [(b.stack, b.layer) for b in blocks] == [("layers", 1), ("layers", 3)]
    with pytest.raises(SelectionError, match="the layers with attention are 1,3"):
        reinit_checkpoint(path, output=tmp_path / "never.onnx", layers="4", device="cpu")
    out = tmp_path / "out.onnx"
    report = reinit_checkpoint(path, output=out, layers="2-3", device="cpu")
    assert {r.block.layer for r in report.rows} == {3}
    assert any("layer 2 of layers has no attention" in n for n in report.notes)
    old, new = initializers(path), initializers(out)
    changed = sorted(k for k in old if not np.array_equal(old[k], new[k]))
    assert len(changed) == 6 and all("layers.1" not in k for k in changed), (
        changed
    )  # layer 3's q/k/v weights and biases
    feeds = {"x": x.numpy()}
    assert np.allclose(ort_run(path, feeds), model(x).detach().numpy(), atol=1e-5)
    assert not np.allclose(ort_run(out, feeds), ort_run(path, feeds))
