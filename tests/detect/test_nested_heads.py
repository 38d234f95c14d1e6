"""Heads a config keeps where no path word leads: JEV's model is built from its text_config, Gemma 3n's audio
conformer runs conf_num_attention_heads heads. Each type is built tiny with transformers' own code and judged by
the heads its own attention modules use (tests/helpers/census.py), never by surgeon's tables."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import surgeon

from helpers.census import build, census_one


@pytest.mark.parametrize("model_type", ["jev", "gemma3n_audio"])
def test_heads_kept_in_a_nested_or_prefixed_config_are_read(model_type, tmp_path):
    verdict = census_one(model_type, work=tmp_path)
    assert verdict.verdict == "right", f"{verdict.verdict} {verdict.detail}"


def test_gemma3n_audio_tower_inside_the_whole_model_reads_its_heads(tmp_path):
    """A Gemma 3n checkpoint keeps its audio tower under model.audio_tower (modeling_gemma3n.py Gemma3nModel builds
    it from audio_config), beside a config.json of the whole model: the tower's weights saved under those names are
    re-initialized head by head at the heads its own attention modules run."""
    from transformers import AutoConfig

    tower, audio_config = build("gemma3n_audio", tmp_path / "tower")
    folder = tmp_path / "model"
    folder.mkdir()
    own = load_file(tmp_path / "tower" / "model.safetensors")
    save_file({f"model.audio_tower.{n}": t for n, t in own.items()}, folder / "model.safetensors")
    whole = AutoConfig.for_model("gemma3n", audio_config=audio_config.to_dict()).to_dict()
    (folder / "config.json").write_text(json.dumps(whole))
    report = surgeon.reinit_checkpoint(folder, output=tmp_path / "out", seed=1)
    after = {
        n.removeprefix("model.audio_tower."): t for n, t in load_file(tmp_path / "out" / "model.safetensors").items()
    }
    attns = {n: m for n, m in tower.named_modules() if type(m).__name__ == "Gemma3nAudioAttention"}
    assert attns and {b.module.removeprefix("model.audio_tower.") for b in report.blocks} == set(attns)
    changed = {n for n in own if not torch.equal(own[n], after[n])}
    assert changed == {f"{a}.{p}_proj.weight" for a in attns for p in "qkv"}
    for name, attn in attns.items():
        assert {b.heads for b in report.blocks if b.module.endswith(name)} == {attn.num_heads}
        for role in "qk":  # each head's rows orthonormal at the head size the module runs
            w = after[f"{name}.{role}_proj.weight"].double().view(attn.num_heads, attn.head_dim, -1)
            gram = w @ w.transpose(1, 2)
            assert torch.allclose(gram, torch.eye(attn.head_dim, dtype=torch.float64).expand_as(gram), atol=1e-5)
    tower.load_state_dict(after)  # the tower's own class takes the output back
