"""Graphs with ONNX Runtime's fused attention: com.microsoft Attention (packed (in, 3*out) weight
and packed bias), MultiHeadAttention (packed bias) and GroupQueryAttention (packed QKV MatMul).

They are built from tiny PyTorch models the way ONNX Runtime's tools emit them (tests/helpers/onnx_graphs.py)
and first checked to compute what the PyTorch model computes, so the packing is the real one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from surgeon import inspect_checkpoint, reinit_checkpoint
from surgeon.compute.engine import head_matrices
from surgeon.formats.onnx import open_onnx

from helpers.families import FAMILIES
from helpers.onnx_graphs import bert_fused, llama_group_query
from helpers.onnx_helpers import assert_semi_orthogonal, assert_value_identity, initializers, ort_run
from helpers.tiny import tiny_llama

SEQ = 7
OPS = ("Attention", "MultiHeadAttention", "GroupQueryAttention")


@dataclass
class Fused:
    op: str
    model: torch.nn.Module
    path: Path
    feeds: dict[str, np.ndarray]
    where: dict  # (layer, role) -> (weight initializer, its columns, bias initializer, its columns)

    def torch_params(self, layer: int, role: str) -> tuple[str, str]:
        if self.op == "GroupQueryAttention":
            name = f"model.layers.{layer}.self_attn.{role}_proj"
        else:
            name = f"encoder.layer.{layer}.attention.self.{dict(q='query', k='key', v='value')[role]}"
        return f"{name}.weight", f"{name}.bias"

    def reference(self, model=None) -> np.ndarray:
        model = model or self.model
        with torch.no_grad():
            hidden = torch.from_numpy(self.feeds["hidden"])
            if self.op == "GroupQueryAttention":
                return model.model(inputs_embeds=hidden, attention_mask=torch.ones(1, SEQ, dtype=torch.long))[0].numpy()
            return model.encoder(hidden)[0].numpy()


@pytest.fixture(scope="module", params=OPS)
def fused(request, tmp_path_factory) -> Fused:
    op = request.param
    ids = torch.randint(3, 90, (1, SEQ), generator=torch.Generator().manual_seed(0))
    if op == "GroupQueryAttention":
        # ORT's CPU kernel needs a head size that is a multiple of 16; random biases make zeroing visible
        model = tiny_llama(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True, num_hidden_layers=2
        )
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
            hidden = model.model.embed_tokens(ids)
        graph, where = llama_group_query(model, SEQ)
        feeds = {
            "hidden": hidden.numpy(),
            "seqlens_k": np.array([SEQ - 1], np.int32),
            "total_sequence_length": np.array(SEQ, np.int32),
        }
    else:
        model = FAMILIES["bert"].make()
        with torch.no_grad():
            hidden = model.embeddings(input_ids=ids)
        graph, where = bert_fused(model, op, SEQ)
        feeds = {"hidden": hidden.numpy()}
        if op == "Attention":
            feeds["mask_index"] = np.ones((1, SEQ), np.int32)
    path = tmp_path_factory.mktemp(op) / "model.onnx"
    onnx.save(graph, str(path))
    return Fused(op, model, path, feeds, where)


def test_fused_graph_is_detected_with_the_pytorch_heads(fused):
    # the built graph is the real thing: onnxruntime computes what PyTorch computes
    np.testing.assert_allclose(ort_run(fused.path, fused.feeds), fused.reference(), atol=1e-5, rtol=1e-5)
    report = inspect_checkpoint(fused.path, device="cpu")
    assert len(report.blocks) == 2
    weights = open_onnx(fused.path)
    params = dict(fused.model.named_parameters())
    for layer, block in enumerate(report.blocks):
        assert block.layer == layer and block.kind == "self"
        assert block.layout.startswith(f"com.microsoft.{fused.op}")
        cfg = fused.model.config
        assert (block.heads, block.kv_heads) == (
            cfg.num_attention_heads,
            getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
        )
        for role in "qkv":
            weight, _, bias, _ = fused.where[(layer, role)]
            proj = block.projection(role)
            assert (proj.weight.tensor, proj.bias.tensor) == (weight, bias)
            w_name, b_name = fused.torch_params(layer, role)
            heads = head_matrices(weights.read(weight).double(), proj.weight)
            assert torch.equal(heads.reshape(-1, heads.shape[-1]), params[w_name].detach().double())
            got = torch.cat([weights.read(bias)[proj.bias.head_slice(h)] for h in range(proj.heads)])
            assert torch.equal(got, params[b_name].detach())
    if fused.op == "MultiHeadAttention":  # scopes recovered from the q/k/v MatMuls the fused op kept
        assert [b.module for b in report.blocks] == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]
    else:  # the fused node carries no scope: named after the node, numbered in graph order
        assert [b.stack for b in report.blocks] == ["", ""]
        assert [b.module for b in report.blocks] == [f"{fused.op}_0", f"{fused.op}_1"]


def test_reinit_fused_graph(fused, tmp_path):
    out = tmp_path / "out.onnx"
    reinit_checkpoint(fused.path, output=out, layers="1", device="cpu")
    before, after = initializers(fused.path), initializers(out)
    reference = copy.deepcopy(fused.model)
    params = dict(reference.named_parameters())
    changed = set()
    for (layer, role), (weight, cols, bias, bias_cols) in fused.where.items():
        rows = torch.from_numpy(after[weight][:, cols].T.copy())
        w_name, b_name = fused.torch_params(layer, role)
        if layer == 0:
            assert torch.equal(rows, params[w_name].detach()), (layer, role)
            continue
        changed |= {weight, bias}
        if role == "v":
            assert_value_identity(rows, f"layer {layer} v")
        else:
            assert_semi_orthogonal(
                rows, fused.model.config.head_dim if fused.op == "GroupQueryAttention" else 12, f"layer {layer} {role}"
            )
        assert not after[bias][bias_cols].any(), f"layer {layer} {role} bias"
        with torch.no_grad():
            params[w_name].copy_(rows)
            params[b_name].zero_()
    for name, value in before.items():
        if name not in changed:
            assert after[name].tobytes() == value.tobytes(), name
    np.testing.assert_allclose(ort_run(out, fused.feeds), fused.reference(reference), atol=1e-4, rtol=1e-4)
