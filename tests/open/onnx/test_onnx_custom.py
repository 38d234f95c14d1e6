"""Attention written with plain PyTorch modules rather than transformers: nn.TransformerEncoderLayer
(nn.MultiheadAttention's packed in_proj, unflattened to (3, E) and picked by Gather) and a module on
2-D (sequence, features) inputs, whose Linear layers export as Gemm with transB=1."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

from surgeon import inspect_checkpoint, reinit_checkpoint
from surgeon.compute.engine import head_matrices
from surgeon.formats.onnx import open_onnx

from helpers.onnx_helpers import (
    as_param,
    assert_semi_orthogonal,
    assert_value_identity,
    check_against_pytorch,
    export_one_input,
    initializers,
    locate,
    ort_run,
    torch_blocks,
)


class SelfAttention2d(torch.nn.Module):
    def __init__(self, width: int = 16, num_heads: int = 4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, width // num_heads
        self.query, self.key, self.value, self.out = (torch.nn.Linear(width, width) for _ in range(4))

    def forward(self, x):  # (sequence, width)
        n = x.shape[0]
        q, k, v = (
            m(x).view(n, self.num_heads, self.head_dim).transpose(0, 1) for m in (self.query, self.key, self.value)
        )
        p = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim**0.5, dim=-1)
        return self.out((p @ v).transpose(0, 1).reshape(n, -1))


class Stack2d(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([SelfAttention2d() for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x)


MODELS = {"encoder-layer": (Encoder, (1, 6, 32)), "linear-2d": (Stack2d, (5, 16))}


@pytest.fixture(
    scope="module", params=[(m, e) for m in MODELS for e in ("legacy", "dynamo")], ids=lambda p: f"{p[0]}-{p[1]}"
)
def exported(request, tmp_path_factory):
    name, exporter = request.param
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    model = cls().eval()
    path = tmp_path_factory.mktemp(f"{name}-{exporter}") / "model.onnx"
    return model, path, export_one_input(model, shape, path, exporter=exporter)


def test_custom_modules_detected_and_reinitialized(exported, tmp_path):
    model, path, feeds = exported
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    inits = initializers(path)
    blocks = inspect_checkpoint(path, device="cpu").blocks
    weights = open_onnx(path)
    expected = torch_blocks(model)
    assert [b.layer for b in blocks] == [0, 1] and len(expected) == 2
    for block, tb in zip(blocks, expected):
        assert block.module.endswith(tb.module) or block.module.endswith(tb.module.rsplit(".", 1)[0])
        assert (block.heads, block.head_dim) == (tb.heads, tb.head_dim)
        for role, tp in tb.roles.items():
            proj = block.projection(role)
            assert proj.weight.tensor == locate(params, inits, tp.weight)[0]
            heads = head_matrices(weights.read(proj.weight.tensor).double(), proj.weight)
            assert torch.equal(heads.reshape(-1, heads.shape[-1]), tp.rows(params)), (tb.module, role)
    out = tmp_path / "out"
    reinit_checkpoint(path, output=out, layers="1", device="cpu")
    out = out / "model.onnx" if out.is_dir() else out  # the dynamo exporter writes external data
    second = expected[1].module
    _, reference = check_against_pytorch(model, params, inits, initializers(out), lambda tb: tb.module == second)
    with torch.no_grad():
        want = reference(torch.from_numpy(feeds["x"])).numpy()
    np.testing.assert_allclose(ort_run(out, feeds), want, atol=1e-5, rtol=1e-5)


def test_identical_layers_share_one_initializer(cli, tmp_path):
    """nn.TransformerEncoder deep-copies its layer: the exporter stores the equal weights once
    (behind Identity nodes). One layer alone gets its own copy of the shared weight in the output;
    the other layer keeps the original, and onnxruntime computes what PyTorch computes."""
    torch.manual_seed(0)
    model = Encoder().eval()
    x = torch.randn(1, 6, 32)
    path = tmp_path / "m" / "model.onnx"
    path.parent.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), input_names=["x"], dynamo=False, opset_version=18)
    blocks = inspect_checkpoint(path, device="cpu").blocks
    assert len(blocks) == 2 and blocks[0].q.weight.tensor == blocks[1].q.weight.tensor
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    before = initializers(path)
    name, transposed = locate(params, before, "encoder.layers.1.self_attn.in_proj_weight")
    out = tmp_path / "one.onnx"
    report = reinit_checkpoint(path, output=out, layers="1", device="cpu")
    assert any(f"the chosen projections read a new copy of it, '{name}.surgeon_copy'" in n for n in report.notes)
    after = initializers(out)
    assert after.keys() == before.keys() | {f"{name}.surgeon_copy"}
    assert all(after[n].tobytes() == v.tobytes() for n, v in before.items())  # every original as it was
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.get_parameter("encoder.layers.1.self_attn.in_proj_weight").copy_(
            as_param(after, (f"{name}.surgeon_copy", transposed))
        )
    new = reference.get_parameter("encoder.layers.1.self_attn.in_proj_weight").detach()
    assert_semi_orthogonal(new[:32], 8, "q")
    assert_value_identity(new[64:], "v")
    with torch.no_grad():
        want = reference(x).numpy()
    got = ort_run(out, {"x": x.numpy()})
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert not np.allclose(got, model(x).numpy(), atol=1e-4)
    both = tmp_path / "both.onnx"
    cli("reinit", path, "-o", both)
    assert initializers(both).keys() == before.keys()
    assert np.isfinite(ort_run(both, {"x": x.numpy()})).all()


@pytest.mark.parametrize("cut", ["split", "slice"])
def test_packed_projection_cut_into_roles(tmp_path, cut):
    """One (in, 3*out) weight per layer cut by Split or by Slices, a separate bias after each cut."""
    import onnx

    from helpers.onnx_graphs import tiny_attention
    from helpers.onnx_helpers import assert_semi_orthogonal, assert_value_identity

    path = tmp_path / "packed.onnx"
    onnx.save_model(tiny_attention(packed=cut), str(path))
    [b0, b1] = inspect_checkpoint(path, device="cpu").blocks
    assert b1.layout == "MatMul qkv (fused)" and b1.module == "layers.1.attn"
    assert [b1.projection(r).weight.offsets for r in "qkv"] == [(0, 4), (8, 12), (16, 20)]
    assert [b1.projection(r).bias.offsets for r in "qkv"] == [(0, 4)] * 3  # each part's own bias
    out = tmp_path / "out.onnx"
    reinit_checkpoint(path, output=out, layers="1", device="cpu")
    before, after = initializers(path), initializers(out)
    packed = torch.from_numpy(after["onnx::MatMul_1qkv"].T.astype(np.float64))
    assert_semi_orthogonal(packed[0:8], 4, "q")
    assert_semi_orthogonal(packed[8:16], 4, "k")
    assert_value_identity(packed[16:24], "v")
    for role in "qkv":
        assert not after[f"layers.1.attn.{role}_proj.bias"].any()
    changed = {"onnx::MatMul_1qkv"} | {f"layers.1.attn.{r}_proj.bias" for r in "qkv"}
    assert all(after[n].tobytes() == v.tobytes() for n, v in before.items() if n not in changed)
    assert np.isfinite(ort_run(out, {"x": np.ones((1, 5, 8), np.float32)})).all()
