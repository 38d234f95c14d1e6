"""Real exports (torch.onnx.export, legacy and dynamo) of seven families, walked and re-initialized.

For every exporter x family, the walker must find each attention block the PyTorch model code
defines, with the same heads in the same order; re-initializing some layers must give per-head
semi-orthogonal Q/K and an identity V when read back through the PyTorch parameters, leave every
other initializer and every other byte alone, and give a model that onnxruntime runs and that
computes what the PyTorch model computes with the same new weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from surgeon import inspect_checkpoint, reinit_checkpoint
from surgeon.compute.engine import head_matrices
from surgeon.formats.onnx import open_onnx, surgeon_records

from helpers.families import FAMILIES
from helpers.onnx_helpers import (
    assert_only_changed_bytes_differ,
    check_against_pytorch,
    export,
    initializers,
    locate,
    ort_run,
    torch_blocks,
    torch_forward,
)

FAMILY_NAMES = ("bert", "distilbert", "gpt2", "llama", "vit", "t5", "bart")
CASES = [(f, e) for f in FAMILY_NAMES for e in ("legacy", "dynamo")] + [("llama", "dynamo-opset23")]
PREFIX = "model."  # the export wrapper's attribute: every module path starts with it


@dataclass
class Case:
    family: str
    exporter: str
    model: torch.nn.Module
    path: Path
    feeds: dict[str, np.ndarray]
    params: dict[str, torch.Tensor]
    inits: dict[str, np.ndarray]

    @property
    def encoder_decoder(self) -> bool:
        return FAMILIES[self.family].encoder_decoder


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def case(request, tmp_path_factory) -> Case:
    family, exporter = request.param
    model = FAMILIES[family].make()
    if family == "t5" and exporter != "legacy":
        # torch.export's decomposition of T5's sdpa path fails here ("Cannot view a tensor ... as
        # (1, 7, 32)"); the eager attention path exports.
        model.set_attn_implementation("eager")
    path = tmp_path_factory.mktemp(f"{family}-{exporter}") / "model.onnx"
    feeds = export(model, family, path, dynamo=exporter != "legacy", opset=23 if exporter.endswith("opset23") else None)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return Case(family, exporter, model, path, feeds, params, initializers(path))


def _stack_of(module: str) -> tuple[str, int]:
    parts = module.split(".")
    i = next(i for i, p in enumerate(parts) if p.isdigit())
    return ".".join(parts[:i]), int(parts[i])


def test_walker_finds_every_block_as_the_model_code_defines_it(case):
    report = inspect_checkpoint(case.path, device="cpu")
    weights = open_onnx(case.path)
    expected = torch_blocks(case.model)
    assert len(report.blocks) == len(expected) > 0
    assert len({b.module for b in report.blocks}) == len(report.blocks)
    if case.exporter.endswith("opset23"):
        assert all(b.layout.startswith("Attention (opset 23)") for b in report.blocks)
    by_module = {b.module: b for b in report.blocks}
    for tb in expected:
        block = by_module[PREFIX + tb.module]
        assert (block.kind, block.heads, block.kv_heads, block.head_dim) == (
            tb.kind,
            tb.heads,
            tb.kv_heads,
            tb.head_dim,
        ), tb.module
        stack, layer = _stack_of(tb.module)
        assert (block.stack, block.layer) == (PREFIX + stack, layer)
        for role, tp in tb.roles.items():
            proj = block.projection(role)
            assert proj.weight.tensor == locate(case.params, case.inits, tp.weight)[0], f"{tb.module} {role}"
            # surgeon's heads, read from the ONNX initializer, are the model code's heads in order
            heads = head_matrices(weights.read(proj.weight.tensor).double(), proj.weight)
            assert torch.equal(heads.reshape(-1, heads.shape[-1]), tp.rows(case.params)), f"{tb.module} {role}"
            if tp.bias is None:
                assert proj.bias is None
            else:
                assert proj.bias is not None and proj.bias.tensor == locate(case.params, case.inits, tp.bias)[0]
                bias = weights.read(proj.bias.tensor).double()
                got = torch.cat([bias[proj.bias.head_slice(h)] for h in range(proj.heads)])
                assert torch.equal(got, case.params[tp.bias][tp.cols].double())
    # the untouched export runs and matches PyTorch (the reference the next test relies on)
    np.testing.assert_allclose(
        ort_run(case.path, case.feeds), torch_forward(case.model, case.feeds), atol=1e-4, rtol=1e-4
    )


def test_reinit_changes_only_the_chosen_layers(case, tmp_path):
    if case.encoder_decoder:
        selection = dict(stack="decoder", layers="-1")  # the decoder's last layer: self- and cross-attention
        chosen = lambda tb: tb.module.startswith(("decoder.block.1.", "model.decoder.layers.1."))  # noqa: E731
    else:
        selection = dict(layers="1")
        chosen = lambda tb: _stack_of(tb.module)[1] == 1  # noqa: E731
    out = tmp_path / "out"
    report = reinit_checkpoint(case.path, output=out, device="cpu", **selection)
    new_path = out / "model.onnx" if out.is_dir() else out
    assert (out.is_dir()) == (len(open_onnx(case.path).files) > 1)  # external data: a folder, like a sharded index
    new = initializers(new_path)
    blocks = torch_blocks(case.model)
    assert {r.block.module for r in report.rows} == {PREFIX + tb.module for tb in blocks if chosen(tb)}

    changed, reference = check_against_pytorch(case.model, case.params, case.inits, new, chosen)
    old_model = onnx.load(str(case.path), load_external_data=False)
    new_model = onnx.load(str(new_path), load_external_data=False)
    assert [n.SerializeToString() for n in new_model.graph.node] == [
        n.SerializeToString() for n in old_model.graph.node
    ]
    [record] = surgeon_records(new_model)
    assert {b["module"] for b in record["blocks"]} == {PREFIX + tb.module for tb in blocks if chosen(tb)}
    assert_only_changed_bytes_differ(case.path, new_path, changed)

    # onnxruntime runs the output, and it computes what PyTorch computes with the same new weights
    got = ort_run(new_path, case.feeds)
    np.testing.assert_allclose(got, torch_forward(reference, case.feeds), atol=1e-4, rtol=1e-4)
    assert not np.allclose(got, torch_forward(case.model, case.feeds), atol=1e-4)
