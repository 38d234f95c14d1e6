"""surgeon.reinit_ on Hugging Face models in memory, every family of tests/helpers/families.py.

Checked through each model's own forward (tests/helpers/observe.py): the chosen layers get semi-orthogonal
per-head query/key maps, a block-identity value map and zero biases; every other attention block
computes exactly what it computed before. The in-memory path gives the same weights as the
checkpoint path on the model's saved file, and the forward route of the module walker (reading the
layout from the forward alone) finds exactly what names + config find.
"""

from __future__ import annotations

import pytest
import torch

import surgeon
from surgeon.detect.module import detect_module, probe_blocks

from helpers.families import FAMILIES
from helpers.observe import observe

pytestmark = pytest.mark.usefixtures("one_thread")


def semi_orthogonal(maps, atol=1e-4):
    for w in maps:
        gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
        assert torch.allclose(gram, torch.eye(gram.shape[0], dtype=gram.dtype), atol=atol), gram.diagonal()


def block_identity(maps, atol=2e-5):
    heads, d, width = maps.shape
    for h, w in enumerate(maps):
        assert torch.allclose(w, torch.eye(heads * d, width, dtype=w.dtype)[h * d : (h + 1) * d], atol=atol)


def same_maps(a, b):
    for role in ("q", "k", "v"):
        for key in (role, f"{role}_bias"):
            assert torch.allclose(getattr(a, key), getattr(b, key), atol=1e-6, rtol=1e-5), key


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_reinit_in_memory_through_forward(name):
    model = FAMILIES[name].make()
    before = observe(model)
    untouched = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = surgeon.reinit_(model, layers="0", seed=1)
    after = observe(model)

    # the blocks are named by the modules the forward really uses
    assert {b.module for b in report.blocks} == set(before)
    chosen = {b.module for b in report.blocks if b.layer == 0}
    assert {r.block.module for r in report.rows} == chosen
    for module, obs in after.items():
        if module not in chosen:
            same_maps(obs, before[module])
            continue
        semi_orthogonal(obs.q)
        semi_orthogonal(obs.k)
        block_identity(obs.v)
        for role in ("q", "k", "v"):
            bias = getattr(obs, f"{role}_bias")
            assert torch.allclose(bias, torch.zeros_like(bias), atol=1e-6)
    # nothing but the re-initialized projections changed
    edited = {
        rows.tensor
        for r in report.rows
        for rows in (r.block.projection(r.role).weight, r.block.projection(r.role).bias)
        if rows
    }
    for n, p in model.named_parameters():
        assert torch.equal(p, untouched[n]) == (n not in edited), n


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_same_weights_as_the_checkpoint_path(name, tmp_path):
    """reinit_ on a model and reinit_checkpoint on its saved file: identical weights for the same seed
    (ViT and Swin included, whose in-memory parameter names differ from their checkpoint's)."""
    family = FAMILIES[name]
    model = family.make()
    model.save_pretrained(tmp_path / "src")
    surgeon.reinit_checkpoint(tmp_path / "src", output=tmp_path / "out", layers="0,-1", seed=7)
    surgeon.reinit_(model, layers="0,-1", seed=7)
    expected = family.load(tmp_path / "out").state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for n in got:
        assert torch.equal(got[n], expected[n]), n


def test_renamed_models_draw_by_checkpoint_name():
    """transformers 5 keeps ViT's old names in checkpoints only; the draws follow the checkpoint names."""
    model = FAMILIES["vit"].make()
    found = detect_module(model)
    q = found.blocks[0].q.weight.tensor
    assert q == "layers.0.attention.q_proj.weight"
    assert found.seed_names[q] == "encoder.layer.0.attention.attention.query.weight"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_forward_route_agrees_with_names(name):
    """Reading the layout from the forward alone (no names, no config) finds the same blocks, rows,
    heads and biases as name-based detection, for fused, interleaved, grouped and GQA layouts."""
    model = FAMILIES[name].make()

    def key(b):
        return (b.module, b.stack, b.layer, b.kind, b.heads, b.kv_heads, b.head_dim, b.q, b.k, b.v)

    by_names = detect_module(model).blocks
    by_forward = probe_blocks(model)
    assert [key(b) for b in by_forward] == [key(b) for b in by_names]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_in_memory(dtype):
    """Stored in the model's dtype: the fp32 result rounded once, nothing else touched."""
    reference = FAMILIES["llama"].make()
    model = FAMILIES["llama"].make().to(dtype)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    surgeon.reinit_(reference, layers="1", seed=3)
    report = surgeon.reinit_(model, layers="1", seed=3)
    assert {r.dtype for r in report.rows} == {str(dtype).removeprefix("torch.")}
    edited = {
        n
        for r in report.rows
        for n in (r.block.projection(r.role).weight.tensor, r.block.projection(r.role).bias.tensor)
    }
    ref = reference.state_dict()
    for n, p in model.named_parameters():
        assert p.dtype == dtype
        if n in edited:
            assert torch.equal(p, ref[n].to(dtype)), n
        else:
            assert torch.equal(p, original[n]), n
    for r in report.rows:  # condition numbers of what is stored, in half precision
        assert r.after.head_max < 1.02


def test_forward_route_widens_and_restores_half_precision():
    model = FAMILIES["gpt2"].make().to(torch.bfloat16).train()
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    blocks = probe_blocks(model)
    assert len(blocks) == 2
    assert model.training and all(m.training for m in model.modules())
    after = model.state_dict()
    for n, t in before.items():
        assert after[n].dtype == t.dtype and torch.equal(after[n], t), n
