"""Stacked-layer tensors (Megatron-Core's torch_dist keys) whose layer count is a number in a file: bounded before
any per-layer entry is made, layers of zero elements refused, and the count held to the model's config.

The hostile files are what ``torch.save`` and ``dcp.save`` themselves write of a zero-size tensor whose first
dimension is huge: a few KB on disk. Memory is judged by tracemalloc's peak over the opening (what a reader that
made one entry per claimed layer would allocate), never by a time.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
import torch

from surgeon.api import inspect_checkpoint
from surgeon.errors import CheckpointError
from surgeon.open.source import open_source

from helpers import dcp as dcp_helpers
from helpers.cli import expect_cli_error

LAYERS = 10**6  # claimed by the file; one entry per layer would take hundreds of MB
BOUND = 32 << 20  # bytes: opening the file and refusing it allocates far less than this
QKV = "decoder.layers.self_attention.linear_qkv.weight"


def _bomb() -> dict:
    return {QKV: torch.empty(LAYERS, 0, 32), "embedding.word_embeddings.weight": torch.randn(16, 32)}


def _pt(folder: Path) -> Path:
    folder.mkdir()
    torch.save(_bomb(), folder / "model.pt")
    return folder / "model.pt"


def _dcp(folder: Path) -> Path:
    dcp_helpers.save(_bomb(), folder)
    assert dcp_helpers.metadata(folder).state_dict_metadata[QKV].size[0] == LAYERS
    return folder


@pytest.mark.parametrize("build", [_pt, _dcp], ids=["pt", "dcp"])
def test_zero_size_stacked_layers_are_refused_in_bounded_memory(tmp_path, cli, build):
    path = build(tmp_path / "bomb")
    assert sum(f.stat().st_size for f in path.parent.rglob("*") if f.is_file()) < 1 << 20  # a small file
    refused: Exception | None = None
    tracemalloc.start()
    try:
        try:  # the open stage, where per-layer entries would be made
            open_source(path)
        except Exception as exc:
            refused = exc
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < BOUND, f"opening the file allocated {peak} bytes"  # before the message: a reader that enumerated
    assert isinstance(refused, CheckpointError) and "zero elements" in str(refused), refused
    expect_cli_error(cli, tmp_path, "inspect", path, "--num-heads", "4", match="zero elements")


def test_more_stacked_layers_than_any_model_are_refused_before_any_entry(tmp_path):
    """Layers that hold values, as many as the cap allows plus one: refused by the count alone."""
    from surgeon.formats.stacked import MAX_STACKED_LAYERS

    torch.save({QKV: torch.zeros(1, 1, 1).expand(MAX_STACKED_LAYERS + 1, 1, 1).clone()}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=f"claims {MAX_STACKED_LAYERS + 1} stacked layers"):
        inspect_checkpoint(tmp_path / "model.pt", num_heads=1)


def test_stacked_layer_count_must_agree_with_the_config(tmp_path, cli):
    """Two stacked layers under a config.json that says three: the weights are not that config's model."""
    torch.manual_seed(0)
    names = [f"decoder.layers.self_attention.linear_qkv.{p}" for p in ("weight", "bias")]
    state = {names[0]: torch.randn(2, 96, 32), names[1]: torch.randn(2, 96)}
    folder = tmp_path / "m"
    folder.mkdir()
    torch.save(state, folder / "model.pt")
    (folder / "config.json").write_text('{"num_attention_heads": 4, "hidden_size": 32, "num_layers": 3}')
    expect_cli_error(cli, tmp_path, "inspect", folder, match="stack 2 layers and the model's config says num_layers=3")
    (folder / "config.json").write_text('{"num_attention_heads": 4, "hidden_size": 32, "num_layers": 2}')
    found = inspect_checkpoint(folder)
    assert [(b.stack, b.layer) for b in found.blocks] == [("decoder.layers", 0), ("decoder.layers", 1)]
