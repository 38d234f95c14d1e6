"""Hybrid models are numbered by their own layers (Jamba, Bamba, Zamba2, LFM2, RecurrentGemma).

Attention sits in layers 1 and 3 only (RecurrentGemma: 1); the others are Mamba, convolution or
recurrent layers. Each test saves a tiny model, re-initializes by the model's own layer numbers and
judges through the model's forward (tests/helpers/hybrids.py: each attention module's output on a fixed
probe): the selected layer's attention changes, the others' do not.
"""

from __future__ import annotations

import pytest
import torch

from surgeon import reinit_checkpoint
from surgeon.api import inspect_checkpoint
from surgeon.errors import SelectionError

from helpers.cli import expect_cli_error
from helpers.hybrids import HYBRIDS, attention_calls, build, load, zamba2

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILIES = ["jamba", "bamba", "zamba2", "lfm2", "recurrent_gemma"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            path = tmp_path_factory.mktemp(name) / "src"
            build(name).save_pretrained(path)
            modules = sorted(set(HYBRIDS[name][0].values()))
            cache[name] = (path, attention_calls(load(path), modules))
        return cache[name]

    return get


def changed_modules(before, after):
    changed = set()
    for module, calls in before.items():
        assert len(calls) == len(after[module])
        if any(not torch.allclose(b, a, atol=1e-6) for b, a in zip(calls, after[module])):
            changed.add(module)
    return changed


@pytest.mark.parametrize("name", FAMILIES)
def test_the_selected_layer_is_the_models_own(name, saved, tmp_path):
    """--layers N re-initializes the attention of model.layers.N, reported as layer N."""
    src, before = saved(name)
    by_layer, _ = HYBRIDS[name]
    blocks = inspect_checkpoint(src).blocks
    assert sorted({n for b in blocks for n in b.users}) == sorted(by_layer)
    assert all(b.module.startswith(f"{b.stack}.{b.layer}.") for b in blocks)  # the layer is the one in the path
    last = max(by_layer)  # numbered by attention block, it would have been 1 (RecurrentGemma: 0)
    out = tmp_path / "out"
    report = reinit_checkpoint(src, output=out, layers=str(last), seed=3)
    (block,) = {r.block for r in report.rows}
    assert last in block.users and block.module == by_layer[block.layer]
    assert changed_modules(before, attention_calls(load(out), list(before))) == {by_layer[n] for n in block.users}
    from surgeon import verify

    assert "verified" in verify(src, out).summary()  # the record re-derives under the same numbering


@pytest.mark.parametrize("name", FAMILIES)
def test_a_layer_without_attention_is_refused_and_a_mixed_selection_noted(name, saved, tmp_path):
    src, _ = saved(name)
    by_layer, without = HYBRIDS[name]
    attended = ",".join(map(str, sorted(by_layer)))
    with pytest.raises(
        SelectionError, match=rf"selects only layers without attention .*: the layers with attention are {attended}$"
    ):
        reinit_checkpoint(src, output=tmp_path / "never", layers=str(without[0]))
    assert not (tmp_path / "never").exists()
    report = reinit_checkpoint(src, output=tmp_path / "mixed", layers=f"{without[0]}-{min(by_layer)}", dry_run=True)
    assert {r.block.layer for r in report.rows} == {min(by_layer)}
    assert any(f"layer {without[0]} of model.layers has no attention" in n for n in report.notes), report.notes


def test_the_cli_refusal_is_one_line(saved, cli, tmp_path):
    src, _ = saved("jamba")
    expect_cli_error(
        cli,
        src.parent,
        "reinit",
        src,
        "-o",
        tmp_path / "o",
        "--layers",
        "2",
        match="--layers 2 selects only layers without attention in model.layers (layer 2): the layers with attention are 1,3",
    )


def test_zamba2_shared_block_changes_every_layer_that_runs_it(saved, tmp_path):
    """Layers 1 and 3 run one shared transformer: selecting layer 3 says so and changes both calls."""
    src, before = saved("zamba2")
    (block,) = inspect_checkpoint(src).blocks
    assert (block.layer, block.shared_layers, block.label) == (1, (1, 3), "model.layers.1,3")
    out = tmp_path / "out"
    report = reinit_checkpoint(src, output=out, layers="3")
    shared = "model.layers.1.shared_transformer.self_attn is one block that layers 1,3 of model.layers all run"
    assert any(shared in n for n in report.notes)
    assert shared in (out / "README.md").read_text()
    assert changed_modules(before, attention_calls(load(out), list(before))) == set(before)  # layers 1 and 3


def test_the_module_route_uses_the_same_numbers():
    """surgeon.reinit_ on the model in memory: --layers 3 is model.layers.3."""
    from surgeon import reinit_

    model = build("bamba")
    modules = ["model.layers.1.self_attn", "model.layers.3.self_attn"]
    before = attention_calls(model, modules)
    report = reinit_(model, layers="3")
    assert {r.block.module for r in report.rows} == {"model.layers.3.self_attn"}
    assert changed_modules(before, attention_calls(model, modules)) == {"model.layers.3.self_attn"}
    with pytest.raises(SelectionError, match="the layers with attention are 1,3"):
        reinit_(model, layers="-2")


def test_zamba2_adapters_on_the_shared_block_are_named(tmp_path):
    """With use_shared_attention_adapter, each layer adds its own LoRA to q/k/v: kept, and the report says so."""
    torch.manual_seed(0)
    zamba2(use_shared_attention_adapter=True, adapter_rank=4).save_pretrained(tmp_path / "m")
    report = inspect_checkpoint(tmp_path / "m")
    assert [b.users for b in report.blocks] == [(1, 3)]
    assert any("use_shared_attention_adapter" in n and "adapters are kept" in n for n in report.notes), report.notes
