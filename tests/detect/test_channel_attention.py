"""DaViT's channel attention (Florence-2's vision tower) splits its channels into ``num_groups`` groups and
attends within each (modeling_florence2.py Florence2VisionChannelAttention): surgeon reads those groups as its
heads where the config's num_heads agrees (every released config), and refuses the block by name where they
differ, never cutting it into the wrong groups. Judged on the model's own modules, built with transformers'
own code."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import surgeon
from surgeon.errors import SelectionError

from helpers.census import build

STAGES = {"embed_dim": [32, 64, 128, 256], "num_heads": [1, 2, 4, 8]}


def test_channel_attention_is_cut_into_the_groups_its_forward_uses(tmp_path):
    model, _ = build("florence_vision", tmp_path / "model", **STAGES, num_groups=[1, 2, 4, 8])
    surgeon.reinit_checkpoint(tmp_path / "model", layers="all", output=tmp_path / "out")
    after = load_file(tmp_path / "out" / "model.safetensors")
    channel = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "Florence2VisionChannelAttention"]
    assert channel
    for name, module in channel:
        weight = after[f"{name}.qkv.weight"].double()
        dim, groups = module.dim, module.groups  # the module's own width and groups
        for role, rows in (("q", weight[:dim]), ("k", weight[dim : 2 * dim])):
            for g in range(groups):
                block = rows[g * dim // groups : (g + 1) * dim // groups]
                s = torch.linalg.svdvals(block)
                assert s.max() / s.min() == pytest.approx(1.0, abs=1e-6), (name, role, g)
            if groups > 1:  # independent draws per group: not one orthonormal block across groups
                s = torch.linalg.svdvals(rows)
                assert s.max() / s.min() > 1.01, (name, role)


def test_channel_attention_whose_groups_are_not_its_heads_is_refused_by_name(tmp_path):
    build("florence_vision", tmp_path / "model", **STAGES, num_groups=[2, 4, 8, 16])
    with pytest.raises(SelectionError, match=r"blocks\.0\.0\.channel_block\.channel_attn: it runs .*num_groups"):
        surgeon.reinit_checkpoint(tmp_path / "model", layers="all", output=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # the spatial (window) attention beside it is still read, with its heads
    report = surgeon.inspect_checkpoint(tmp_path / "model")
    assert [b.heads for b in report.blocks if "window_attn" in b.module][:3] == [1, 2, 4]
