"""Checkpoints as transformers 5 saves them from the class they are used with, whose key names differ from the
modules' (transformers' conversion mappings, reversed on save): Qwen2-VL's language model under ``model.layers.N``
and its vision tower under ``visual.blocks.N`` with the heads only in ``text_config`` / ``vision_config``; pi0's
PaliGemma and Gemma expert; T5Gemma 2's encoder under a head model's ``model.``; Kimi-K2.5's vision tower as one
fused ``vision_tower.blocks.N.wqkv``. Every attention module is
re-initialized in the heads it was built with (its own ``head_dim`` / ``num_heads``), not refused for want of
a head count config.json gives under another name."""

from __future__ import annotations

import json

import pytest
import torch

import surgeon

from helpers.census import HEAD_FIRST, build
from helpers.owned import changed, head_problems

CASES = {
    # the vision tower's heads apart from the language model's (4 of 16 after the census shrink)
    "qwen2_vl": {"vision_config.num_heads": 2},
    "pi0": {},
    "t5gemma2": {},
    # its vision tower fused as blocks.N.wqkv ([Q | K | V], rows permuted within each head for its rotary)
    "kimi_k25": {},
    # its vision tower under vit.layers.N (the module's vision_tower)
    "hunyuan_vl": {"vision_config.num_attention_heads": 2, "vision_config.num_key_value_heads": 2},
    # NeMo's names: perception.encoder.asr_encoder, ..., ctc_timestamp.decoder.transformer (the word-timestamp
    # encoder, heads of its own)
    "nemo_speechlm": {"word_timestamp_config.num_attention_heads": 2, "word_timestamp_config.num_key_value_heads": 2},
}


def _attention_rows(module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int, int]] | None:
    """role -> (rows, heads, head size) of an attention module, by the numbers it was built with: its
    ``head_dim``, and for a fused qkv its ``num_heads`` ([Q | K | V] as Qwen2-VL's vision forward reshapes it
    (seq, 3, num_heads, head_dim))."""
    d = getattr(module, "head_dim", None)
    if not isinstance(d, int):
        return None
    children = dict(module.named_children())
    if all(f"{r}_proj" in children for r in "qkv"):
        return {
            r: (children[f"{r}_proj"].weight, children[f"{r}_proj"].out_features // d, d)
            for r in "qkv"
            if isinstance(children[f"{r}_proj"], torch.nn.Linear)
        }
    if "qkv" in children and isinstance(getattr(module, "num_heads", None), int):
        h = module.num_heads
        q, k, v = children["qkv"].weight.split(h * d)
        return {"q": (q, h, d), "k": (k, h, d), "v": (v, h, d)}
    return None


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_a_checkpoint_under_its_saved_names_is_reset_in_its_modules_heads(model_type, tmp_path):
    model, _ = build(model_type, tmp_path / "model", HEAD_FIRST, **CASES[model_type])
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert "num_attention_heads" not in saved  # the heads only in the towers' configs
    if model_type == "qwen2_vl":
        from safetensors import safe_open

        with safe_open(tmp_path / "model" / "model.safetensors", "pt") as f:
            keys = set(f.keys())
        assert "model.layers.0.self_attn.q_proj.weight" in keys and "visual.blocks.0.attn.qkv.weight" in keys
    surgeon.reinit_checkpoint(tmp_path / "model", layers="all", output=tmp_path / "out", seed=0)
    loaded = type(model).from_pretrained(tmp_path / "out")
    attentions = {n: rows for n, m in loaded.named_modules() if (rows := _attention_rows(m)) is not None}
    assert len({d for rows in attentions.values() for _, _, d in rows.values()}) >= 1 and attentions
    problems = []
    for name, rows in attentions.items():
        for role, (weight, heads, d) in rows.items():
            problems += head_problems(f"{name} {role}", weight, heads, d, drawn=role != "v")
    assert not problems, problems[:4]
    touched = changed(model.state_dict(), loaded.state_dict())
    assert all(any(n.startswith(a + ".") for n in touched) for a in attentions)
