"""Two tensors, one draw key: refused. Draws are keyed by a tensor's name inside its base model, so a checkpoint
holding a model twice (``bert.encoder.*`` beside ``encoder.*``) or a module holding two models of one kind would
give both the same heads; surgeon names both in one line and writes nothing. One copy alone is keyed as ever."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import BertConfig, BertForMaskedLM, BertModel

import surgeon
from surgeon.errors import SelectionError

from helpers.cli import expect_cli_error

QUERY = "encoder.layer.0.attention.self.query.weight"


def _config() -> BertConfig:
    return BertConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
    )


@pytest.fixture
def checkpoints(tmp_path):
    """(BertForMaskedLM folder: names under bert., BertModel folder: names without, the two merged in one file
    under the task class's config), all saved by transformers."""
    torch.manual_seed(0)
    mlm, base, both = tmp_path / "mlm", tmp_path / "base", tmp_path / "both"
    BertForMaskedLM(_config()).save_pretrained(mlm)
    BertModel(_config()).save_pretrained(base)
    shutil.copytree(mlm, both)
    merged = {**load_file(mlm / "model.safetensors"), **load_file(base / "model.safetensors")}
    assert f"bert.{QUERY}" in merged and QUERY in merged
    save_file(merged, both / "model.safetensors", {"format": "pt"})
    return mlm, base, both


def test_a_checkpoint_holding_the_model_twice_is_refused_and_one_copy_is_keyed_as_ever(cli, tmp_path, checkpoints):
    mlm, base, both = checkpoints
    line = expect_cli_error(
        cli,
        tmp_path,
        "reinit",
        both,
        "-o",
        tmp_path / "out",
        match=f"bert.{QUERY} and {QUERY} would draw the same heads",
    )
    assert "--stack bert.encoder.layer, then --stack encoder.layer" in line and "--seed" in line
    assert not (tmp_path / "out").exists()

    # the same model with one prefix: as ever, the same heads whichever class holds it
    for src in (mlm, base):
        cli("reinit", src, "-o", tmp_path / f"{src.name}-out", "--seed", "3")
    task = load_file(tmp_path / "mlm-out" / "model.safetensors")
    plain = load_file(tmp_path / "base-out" / "model.safetensors")
    assert not torch.equal(plain[QUERY], load_file(base / "model.safetensors")[QUERY])  # re-initialized
    assert torch.equal(task[f"bert.{QUERY}"], plain[QUERY])
    # the merged checkpoint, one copy selected: that copy's heads, the other copy as it was
    cli("reinit", both, "--stack", "encoder.layer", "-o", tmp_path / "one", "--seed", "3")
    one, before = load_file(tmp_path / "one" / "model.safetensors"), load_file(both / "model.safetensors")
    assert torch.equal(one[QUERY], plain[QUERY]) and torch.equal(one[f"bert.{QUERY}"], before[f"bert.{QUERY}"])
    cli("verify", both, tmp_path / "one")


class _Dual(nn.Module):
    """Two encoders of one kind in one module (a retriever's query and document towers)."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.doc = BertModel(_config()), BertModel(_config())


def test_two_models_of_one_kind_in_a_module_are_refused():
    torch.manual_seed(0)
    model = _Dual()
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    with pytest.raises(SelectionError) as caught:
        surgeon.reinit_(model, seed=3)
    assert f"query.{QUERY} and doc.{QUERY} would draw the same heads" in str(caught.value)
    assert "(stack=query.encoder.layer, then stack=doc.encoder.layer)" in str(caught.value)
    assert "\n" not in str(caught.value)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())  # nothing changed
    surgeon.reinit_(model, stack="query.encoder.layer", seed=3)  # one tower: done
    after = model.state_dict()
    assert not torch.equal(after[f"query.{QUERY}"], before[f"query.{QUERY}"])
    assert torch.equal(after[f"doc.{QUERY}"], before[f"doc.{QUERY}"])
