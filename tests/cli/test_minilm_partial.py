"""Partial and restoring resets on the real pretrained all-MiniLM-L6-v2: a soft reset of its top layers is the mixture
of its weights and a full reset's; a "fine-tuned" copy (its top layers' attention moved) restored from MiniLM is
MiniLM again, tensor for tensor and byte for byte; verify accepts both and refuses one changed element."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file, save_file

from helpers.elements import nudge

TOP = ("encoder.layer.4.", "encoder.layer.5.")


def _attention(name: str) -> bool:
    return name.startswith(TOP) and ".attention.self." in name


def test_a_soft_reset_of_the_top_layers_is_the_mixture(cli, minilm_dir, tmp_path):
    full, soft = tmp_path / "full", tmp_path / "soft"
    cli("reinit", minilm_dir, "--layers", "-2-", "-o", full)
    cli("reinit", minilm_dir, "--layers", "-2-", "--strength", "0.25:0.5", "-o", soft)
    base, one, got = (load_file(p / "model.safetensors") for p in (minilm_dir, full, soft))
    for name in base:
        if _attention(name) and name.endswith("weight"):
            t = 0.25 if name.startswith(TOP[0]) else 0.5  # the ramp: 0.25 at layer 4, 0.5 at layer 5
            expected = ((1 - t) * base[name].double() + t * one[name].double()).to(base[name].dtype)
        else:
            expected = one[name]  # the rest as a full reset leaves it: untouched, or (biases) zeroed
        assert torch.equal(got[name].view(torch.uint8), expected.view(torch.uint8)), name
    assert cli("verify", minilm_dir, soft).stdout.startswith("verified:")
    nudge(soft / "model.safetensors", "encoder.layer.5.attention.self.query.weight", index=100)
    assert cli("verify", minilm_dir, soft, ok=False).exit_code == 3


def test_a_tuned_copy_restored_from_minilm_is_minilm_again(cli, minilm_dir, tmp_path):
    tuned, out = tmp_path / "tuned", tmp_path / "restored"
    shutil.copytree(minilm_dir, tuned)
    weights = load_file(minilm_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    moved = {
        n: t + 0.01 * torch.randn(t.shape, generator=generator) if _attention(n) else t for n, t in weights.items()
    }
    save_file(moved, tuned / "model.safetensors", metadata={"format": "pt"})

    cli("reinit", tuned, "--mode", "restore", "--from", minilm_dir, "--layers", "4-5", "-o", out)
    got = load_file(out / "model.safetensors")
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[n].view(torch.uint8), weights[n].view(torch.uint8)) for n in weights)
    assert cli("verify", tuned, out, "--from", minilm_dir).stdout.startswith("verified:")
    nudge(out / "model.safetensors", "encoder.layer.4.attention.self.key.bias")
    assert cli("verify", tuned, out, "--from", minilm_dir, ok=False).exit_code == 3
