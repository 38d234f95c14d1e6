"""Tensors that look like attention but are not projections are never detected nor touched."""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import save_file

from surgeon import reinit_checkpoint

from helpers.families import FAMILIES


def raw(path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    return {
        k: data[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]]
        for k, v in header.items()
        if k != "__metadata__"
    }


def test_old_gpt2_mask_buffers_and_rotary_buffers(tmp_path):
    model = FAMILIES["gpt2"].make()
    sd = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to wte
    n = model.config.n_positions
    lookalikes = {}
    for i in range(model.config.n_layer):
        lookalikes[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, n, n, dtype=torch.bool))
        lookalikes[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        lookalikes[f"transformer.h.{i}.attn.rotary_emb.inv_freq"] = torch.rand(4)
        lookalikes[f"transformer.h.{i}.attn.q_norm.weight"] = torch.rand(16)
        lookalikes[f"transformer.h.{i}.attn.relative_attention_bias.weight"] = torch.rand(32, 4)
    lookalikes["transformer.position_ids"] = torch.arange(n)
    folder = tmp_path / "gpt2"
    folder.mkdir()
    model.config.save_pretrained(folder)
    save_file({**sd, **lookalikes}, folder / "model.safetensors", metadata={"format": "pt"})
    report = reinit_checkpoint(folder, output=tmp_path / "out")
    assert [b.module for b in report.blocks] == [f"transformer.h.{i}.attn" for i in range(model.config.n_layer)]
    touched = {r.block.projection(r.role).weight.tensor for r in report.rows} | {
        r.block.projection(r.role).bias.tensor for r in report.rows
    }
    assert touched == {
        f"transformer.h.{i}.attn.c_attn.{p}" for i in range(model.config.n_layer) for p in ("weight", "bias")
    }
    before, after = raw(folder / "model.safetensors"), raw(tmp_path / "out" / "model.safetensors")
    for name in lookalikes:
        assert after[name] == before[name], name


def test_qk_norm_weights_are_left_alone(tmp_path):
    from transformers import Qwen3ForCausalLM

    from helpers.tiny import tiny_qwen3

    model = tiny_qwen3()  # its q/k norm weights away from 1, so that a rewrite of them would show
    model.save_pretrained(tmp_path / "qwen3")
    report = reinit_checkpoint(tmp_path / "qwen3", output=tmp_path / "out")
    assert len(report.blocks) == 2 and all(r.after.head_max < 1 + 1e-5 for r in report.rows)
    before, after = raw(tmp_path / "qwen3" / "model.safetensors"), raw(tmp_path / "out" / "model.safetensors")
    norms = [n for n in before if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 4 and all(after[n] == before[n] for n in norms)
    reloaded = Qwen3ForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.isfinite(reloaded(torch.tensor([[1, 2, 3]])).logits).all()
