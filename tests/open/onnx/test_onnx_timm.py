"""timm/ViT-style fused QKV: ``qkv(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)``, then
``qkv[0], qkv[1], qkv[2]`` (Gather on axis 0) or ``unbind(0)`` (Split, or Slices from the dynamo
exporter), from both exporters: every block found with its heads, one layer re-initialized, and
onnxruntime computes what PyTorch computes with the same new weights."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

from surgeon import inspect_checkpoint, reinit_checkpoint
from surgeon.compute.engine import head_matrices
from surgeon.formats.onnx import open_onnx

from helpers.modules import TimmAttention
from helpers.onnx_helpers import (
    as_param,
    assert_semi_orthogonal,
    assert_value_identity,
    export_one_input,
    initializers,
    locate,
    ort_run,
    weights_as_constants,
)

DIM, HEADS = 32, 4


class GatherAttention(TimmAttention):
    """The same module, q/k/v taken as ``qkv[0], qkv[1], qkv[2]`` (older timm, many ViT ports)."""

    def forward(self, x, attn_mask=None, is_causal=False):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class Vit(torch.nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(DIM) for _ in range(2)])
        self.blocks = torch.nn.ModuleList(
            [cls(DIM, num_heads=HEADS, qkv_bias=True, fused_attn=False) for _ in range(2)]
        )

    def forward(self, x):
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x))
        return x


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("pick", ["gather", "unbind"])
def test_timm_fused_qkv(tmp_path, pick, exporter):
    torch.manual_seed(0)
    model = Vit(GatherAttention if pick == "gather" else TimmAttention).eval()
    path = tmp_path / "model.onnx"
    feeds = export_one_input(model, (1, 5, DIM), path, exporter=exporter)
    x = torch.from_numpy(feeds["x"])
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    inits = initializers(path)
    blocks = inspect_checkpoint(path, device="cpu").blocks
    weights = open_onnx(path)
    assert [b.layer for b in blocks] == [0, 1]
    for i, block in enumerate(blocks):
        assert (block.heads, block.kv_heads, block.head_dim) == (HEADS, HEADS, DIM // HEADS) and "fused" in block.layout
        w = params[f"blocks.{i}.qkv.weight"]
        for j, role in enumerate("qkv"):
            proj = block.projection(role)
            assert proj.weight.tensor == locate(params, inits, f"blocks.{i}.qkv.weight")[0]
            heads = head_matrices(weights.read(proj.weight.tensor).double(), proj.weight)
            assert torch.equal(heads.reshape(-1, DIM), w[j * DIM : (j + 1) * DIM].double()), (i, role)
            assert proj.bias is not None and proj.bias.tensor == locate(params, inits, f"blocks.{i}.qkv.bias")[0]
    out = tmp_path / "out.onnx"
    reinit_checkpoint(path, output=out, layers="1", device="cpu")
    after = initializers(out)
    reference = copy.deepcopy(model)
    changed = set()
    for leaf in ("weight", "bias"):
        where = locate(params, inits, f"blocks.1.qkv.{leaf}")
        changed.add(where[0])
        with torch.no_grad():
            reference.get_parameter(f"blocks.1.qkv.{leaf}").copy_(as_param(after, where))
    new_w = reference.get_parameter("blocks.1.qkv.weight").detach()
    assert_semi_orthogonal(new_w[:DIM], DIM // HEADS, "q")
    assert_semi_orthogonal(new_w[DIM : 2 * DIM], DIM // HEADS, "k")
    assert_value_identity(new_w[2 * DIM :], "v")
    assert not reference.get_parameter("blocks.1.qkv.bias").any()
    assert all(after[n].tobytes() == v.tobytes() for n, v in inits.items() if n not in changed)
    with torch.no_grad():
        want = reference(x).numpy()
        old = model(x).numpy()
    got = ort_run(out, feeds)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not np.allclose(got, old, atol=1e-4)


class SliceAttention(torch.nn.Module):
    """q, k, v sliced out of one fused projection at bounds computed from its shape
    (``qkv.shape[-1] // 3``): Shape -> Gather -> Div -> Slice in the graph."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(DIM, 3 * DIM), torch.nn.Linear(DIM, DIM)

    def forward(self, x):
        B, N, _ = x.shape
        qkv = self.qkv(x)
        d = qkv.shape[-1] // 3
        q, k, v = qkv[..., :d], qkv[..., d : 2 * d], qkv[..., 2 * d :]
        hd = d // HEADS
        q, k, v = (t.reshape(B, N, HEADS, hd).transpose(1, 2) for t in (q, k, v))
        a = (q @ k.transpose(-1, -2) / hd**0.5).softmax(-1)
        return self.out((a @ v).transpose(1, 2).reshape(B, N, d))


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_slice_bounds_computed_from_shapes(tmp_path, exporter):
    torch.manual_seed(0)
    model = torch.nn.Sequential(SliceAttention(), SliceAttention()).eval()
    x = torch.randn(1, 5, DIM)
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":  # batch and sequence dynamic: only the feature axis is static
            torch.onnx.export(
                model,
                (x,),
                str(path),
                input_names=["x"],
                dynamo=False,
                opset_version=18,
                dynamic_axes={"x": {0: "b", 1: "n"}},
            )
        else:
            torch.onnx.export(
                model,
                (x,),
                str(path),
                input_names=["x"],
                dynamo=True,
                dynamic_shapes=({0: torch.export.Dim("b"), 1: torch.export.Dim("n")},),
            )
    blocks = inspect_checkpoint(path, device="cpu").blocks
    assert [(b.layer, b.heads, b.head_dim) for b in blocks] == [(0, HEADS, DIM // HEADS), (1, HEADS, DIM // HEADS)]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    inits = initializers(path)
    assert [blocks[1].projection(r).weight.offsets[0] for r in "qkv"] == [0, DIM, 2 * DIM]
    out = tmp_path / "out.onnx"
    reinit_checkpoint(path, output=out, layers="1", device="cpu")
    after = initializers(out)
    reference = copy.deepcopy(model)
    changed = set()
    for leaf in ("weight", "bias"):
        where = locate(params, inits, f"1.qkv.{leaf}")  # found by value in the export, not by surgeon
        changed.add(where[0])
        with torch.no_grad():
            reference.get_parameter(f"1.qkv.{leaf}").copy_(as_param(after, where))
    new_w = reference.get_parameter("1.qkv.weight").detach()
    hd = DIM // HEADS
    for j, role in enumerate("qk"):
        rows = new_w[j * DIM : (j + 1) * DIM].double()
        assert_semi_orthogonal(rows, hd, role)
        assert (rows[:hd] @ rows[hd : 2 * hd].T).abs().max() > 1e-3, (
            f"{role}: heads of {hd} rows orthogonal to each other (a wrong head size)"
        )
    assert_value_identity(new_w[2 * DIM :], "v")
    assert not reference.get_parameter("1.qkv.bias").any()
    assert after.keys() == inits.keys()
    assert [
        n for n, v in inits.items() if n not in changed and after[n].tobytes() != v.tobytes()
    ] == []  # layer 0 and the rest as they were
    x2 = torch.randn(2, 6, DIM)  # other batch and sequence sizes: the bounds are computed at run time
    with torch.no_grad():
        want, old = reference(x2).numpy(), model(x2).numpy()
    got = ort_run(out, {"x": x2.numpy()})
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not np.allclose(got, old, atol=1e-4)


def test_weights_in_constant_nodes(tmp_path):
    """The same export with every 2-D weight moved into a Constant node (as some optimizers leave
    them): read and patched in place like initializers, the same values as from initializers."""
    import onnx

    from helpers.families import FAMILIES
    from helpers.onnx_helpers import changed_byte_ranges, export

    path = tmp_path / "model.onnx"
    feeds = export(FAMILIES["bert"].make(), "bert", path, dynamo=False)
    model = weights_as_constants(onnx.load(str(path)))
    consts = tmp_path / "consts.onnx"
    onnx.save_model(model, str(consts))
    blocks = inspect_checkpoint(consts, device="cpu").blocks
    assert [b.q.weight.tensor for b in blocks] == [
        b.q.weight.tensor for b in inspect_checkpoint(path, device="cpu").blocks
    ]
    reinit_checkpoint(path, output=tmp_path / "a.onnx", layers="1", device="cpu")
    reinit_checkpoint(consts, output=tmp_path / "b.onnx", layers="1", device="cpu")
    a = initializers(tmp_path / "a.onnx")
    b = onnx.load(str(tmp_path / "b.onnx"))
    values = {
        n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in b.graph.node if n.op_type == "Constant"
    }
    values |= {t.name: onnx.numpy_helper.to_array(t) for t in b.graph.initializer}
    assert all(values[n].tobytes() == v.tobytes() for n, v in a.items())
    old, new = consts.read_bytes(), (tmp_path / "b.onnx").read_bytes()
    assert changed_byte_ranges(old, new[: len(old)])  # patched in place: the same length up to surgeon's record
    np.testing.assert_array_equal(ort_run(tmp_path / "b.onnx", feeds), ort_run(tmp_path / "a.onnx", feeds))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn = torch.nn.LayerNorm(DIM), TimmAttention(DIM, num_heads=HEADS, fused_attn=False)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class SequentialVit(torch.nn.Module):
    """timm's VisionTransformer: ``self.blocks = nn.Sequential(*blocks)``, called as one module."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(Block(), Block())

    def forward(self, x):
        return self.blocks(x)


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_module_paths_inside_a_called_sequential(tmp_path, exporter):
    """The legacy exporter names the nodes /blocks/blocks.0/attn/...: the module is blocks.0.attn,
    as the dynamo exporter and the PyTorch model say, so --stack blocks works with both."""
    torch.manual_seed(0)
    model = SequentialVit().eval()
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (torch.randn(1, 5, DIM),),
            str(path),
            input_names=["x"],
            dynamo=exporter == "dynamo",
            opset_version=18 if exporter == "legacy" else None,
        )
    blocks = inspect_checkpoint(path, device="cpu").blocks
    assert [(b.stack, b.layer, b.module) for b in blocks] == [
        ("blocks", 0, "blocks.0.attn"),
        ("blocks", 1, "blocks.1.attn"),
    ]
    report = reinit_checkpoint(path, output=tmp_path / "out.onnx", stack="blocks", layers="-1", device="cpu")
    assert {r.block.module for r in report.rows} == {"blocks.1.attn"}
