"""Graphs without scopes (node names and metadata stripped, as some tools leave them): attention
blocks are numbered in graph order and grouped by their core node's name prefix, so --layers,
--stack and inspect still pick the right blocks."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from surgeon import inspect_checkpoint, reinit_checkpoint

from helpers.onnx_graphs import tiny_attention
from helpers.onnx_helpers import initializers, ort_run

FEEDS = {"x": np.linspace(-1, 1, 40, dtype=np.float32).reshape(1, 5, 8)}


def unscoped(softmax_names: list[str] | None, path) -> tuple[object, dict[int, set[str]]]:
    """tiny_attention with every node renamed ``Op_i`` (Softmax nodes as given) and no metadata;
    returns the path and, per layer, the initializers its nodes read."""
    model = tiny_attention(layers=2)
    per_layer: dict[int, set[str]] = {0: set(), 1: set()}
    inits = {t.name for t in model.graph.initializer}
    softmaxes = iter(softmax_names or [])
    for i, node in enumerate(model.graph.node):
        for layer in (0, 1):
            if node.name.startswith(f"/layers.{layer}/"):
                per_layer[layer] |= {
                    x for x in node.input if x in inits and "proj" in x or x.startswith("onnx::MatMul")
                }
        node.name = next(softmaxes) if node.op_type == "Softmax" and softmax_names else f"{node.op_type}_{i}"
        del node.metadata_props[:]
    onnx.save_model(model, str(path))
    return path, per_layer


@pytest.mark.parametrize("names", [None, ["attn_softmax", "attn_softmax_1"]])
def test_one_group_numbered_in_graph_order(tmp_path, names):
    path, per_layer = unscoped(names, tmp_path / "model.onnx")
    blocks = inspect_checkpoint(path, device="cpu").blocks
    assert [(b.stack, b.layer) for b in blocks] == [("", 0), ("", 1)]
    out = tmp_path / "out.onnx"
    report = reinit_checkpoint(path, output=out, layers="1", device="cpu")
    before, after = initializers(path), initializers(out)
    changed = {n for n in before if before[n].tobytes() != after[n].tobytes()}
    assert changed and changed <= per_layer[1] and {r.block.layer for r in report.rows} == {1}
    assert np.isfinite(ort_run(out, FEEDS)).all()


def test_several_prefixes_are_stacks(tmp_path):
    path, per_layer = unscoped(["enc_softmax_0", "dec_softmax_0"], tmp_path / "model.onnx")
    blocks = inspect_checkpoint(path, device="cpu").blocks
    assert [(b.stack, b.layer) for b in blocks] == [("enc_softmax", 0), ("dec_softmax", 0)]
    out = tmp_path / "out.onnx"
    reinit_checkpoint(path, output=out, stack="dec_softmax", device="cpu")
    before, after = initializers(path), initializers(out)
    changed = {n for n in before if before[n].tobytes() != after[n].tobytes()}
    assert changed and changed <= per_layer[1]
    assert np.isfinite(ort_run(out, FEEDS)).all()
