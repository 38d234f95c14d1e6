"""diffusers checkpoints (the real library, tiny models built offline): joint attention's context
stream, cross-attention by the module's role, the UNet's attention_head_dim quirk, fp16 variant files
and pipeline folders. The library's own modules say what is right: ``Attention.heads``,
``Attention.is_cross_attention``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from surgeon import reinit_
from surgeon.api import inspect_checkpoint, reinit_checkpoint
from surgeon.errors import CheckpointError

from helpers.diffusers_models import sd3, unet

diffusers = pytest.importorskip("diffusers")

WEIGHTS = "diffusion_pytorch_model.safetensors"


def attention_modules(model):
    """diffusers' attention modules (Attention, FluxAttention, ...): the ones holding to_q and their heads."""
    return {
        name: m
        for name, m in model.named_modules()
        if hasattr(m, "to_q") and isinstance(getattr(m, "heads", None), int)
    }


def test_sd3_joint_attention_context_projections_are_reinitialized_with_their_block(tmp_path):
    model = sd3()
    model.save_pretrained(tmp_path / "src")
    report = reinit_checkpoint(tmp_path / "src", output=tmp_path / "out", layers="0", heads="1")
    labels = {(r.block.label, r.role) for r in report.rows}
    assert labels == {(f"transformer_blocks.0{s}", r) for s in ("", ":context") for r in "qkv"}
    before, after = load_file(tmp_path / "src" / WEIGHTS), load_file(tmp_path / "out" / WEIGHTS)
    attn = "transformer_blocks.0.attn"
    projections = [f"to_{r}" for r in "qkv"] + [f"add_{r}_proj" for r in "qkv"]
    expected = {f"{attn}.{p}.{t}" for p in projections for t in ("weight", "bias")}
    assert {n for n in before if not torch.equal(before[n], after[n])} == expected
    heads = attention_modules(model)[attn].heads
    d = after[f"{attn}.add_q_proj.weight"].shape[0] // heads
    for role in ("q", "k"):
        w = after[f"{attn}.add_{role}_proj.weight"].double()
        head1 = w[d : 2 * d]
        assert torch.allclose(head1 @ head1.T, torch.eye(d, dtype=torch.float64), atol=1e-5)
        assert torch.equal(w[:d], before[f"{attn}.add_{role}_proj.weight"][:d].double())  # head 0 untouched
        assert torch.equal(after[f"{attn}.add_{role}_proj.bias"][d : 2 * d], torch.zeros(d))
    # the module route writes the same bytes
    live = sd3()
    example = dict(
        hidden_states=torch.randn(1, 4, 8, 8),
        encoder_hidden_states=torch.randn(1, 5, 16),
        pooled_projections=torch.randn(1, 8),
        timestep=torch.tensor([1]),
    )
    reinit_(live, layers="0", heads="1", example_inputs=example)
    mine = live.state_dict()
    assert all(torch.equal(mine[n], after[n]) for n in after)


def pixart():
    torch.manual_seed(0)
    return diffusers.PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        cross_attention_dim=16,
        sample_size=8,
        patch_size=2,
        caption_channels=12,
        norm_type="ada_norm_single",
        num_embeds_ada_norm=1000,
    )


def test_pixart_attn2_is_cross_attention_by_its_role(tmp_path):
    model = pixart()
    model.save_pretrained(tmp_path / "src")
    found = inspect_checkpoint(tmp_path / "src")
    modules = attention_modules(model)
    assert {b.module: b.kind for b in found.blocks} == {
        n: "cross" if m.is_cross_attention else "self" for n, m in modules.items()
    }
    assert any(b.kind == "cross" for b in found.blocks)
    reinit_checkpoint(tmp_path / "src", output=tmp_path / "out", attention="self")
    before, after = load_file(tmp_path / "src" / WEIGHTS), load_file(tmp_path / "out" / WEIGHTS)
    touched = {n.rsplit(".", 2)[0] for n in before if not torch.equal(before[n], after[n])}
    assert touched == {n for n, m in modules.items() if not m.is_cross_attention}


def test_unet_attention_head_dim_is_the_number_of_heads_per_block(tmp_path):
    model = unet()
    model.save_pretrained(tmp_path / "src")
    found = inspect_checkpoint(tmp_path / "src")
    modules = attention_modules(model)
    assert {b.module: b.heads for b in found.blocks} == {n: m.heads for n, m in modules.items()}
    assert {b.module: b.kind for b in found.blocks} == {
        n: "cross" if m.is_cross_attention else "self" for n, m in modules.items()
    }
    assert len({m.heads for m in modules.values()}) == 2


def test_fp16_variant_beside_the_full_weights_is_rewritten_alike(tmp_path):
    model = unet()
    model.save_pretrained(tmp_path / "src")
    model.to(torch.float16).save_pretrained(tmp_path / "src", variant="fp16")
    reinit_checkpoint(tmp_path / "src", output=tmp_path / "out", layers="0")
    full, half = (
        load_file(tmp_path / "out" / WEIGHTS),
        load_file(tmp_path / "out" / "diffusion_pytorch_model.fp16.safetensors"),
    )
    old_half = load_file(tmp_path / "src" / "diffusion_pytorch_model.fp16.safetensors")
    edited = {n for n in old_half if not torch.equal(old_half[n], half[n])}
    assert edited and all(half[n].dtype == torch.float16 for n in half)
    for name in edited:
        assert torch.allclose(
            half[name].float(), full[name].to(torch.float16).float(), atol=0, rtol=0
        ) or torch.allclose(half[name].float(), full[name], atol=2e-3), name


def test_pipeline_folder_names_its_components(tmp_path):
    pipe = tmp_path / "pipe"
    unet().save_pretrained(pipe / "unet")
    (pipe / "model_index.json").write_text(
        '{"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}'
    )
    with pytest.raises(CheckpointError, match=r"diffusers pipeline .*unet"):
        inspect_checkpoint(pipe)
    assert inspect_checkpoint(pipe / "unet").blocks


def test_sharded_fp16_variant_is_rewritten_and_in_place_is_refused(tmp_path):
    import json

    from surgeon.errors import OutputError

    model = unet()
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    model.to(torch.float16).save_pretrained(tmp_path / "src", variant="fp16", max_shard_size="20KB")
    with pytest.raises(OutputError, match="holds the weights twice"):
        reinit_checkpoint(tmp_path / "src", in_place=True)
    reinit_checkpoint(tmp_path / "src", output=tmp_path / "out", layers="0")
    index = json.loads((tmp_path / "out" / "diffusion_pytorch_model.safetensors.index.fp16.json").read_text())[
        "weight_map"
    ]
    name = next(n for n in index if n.endswith("attn1.to_q.weight") and n.startswith("down_blocks.0"))
    old = load_file(tmp_path / "src" / index[name])[name]
    new = load_file(tmp_path / "out" / index[name])[name]
    assert new.dtype == torch.float16 and not torch.equal(old, new)
    full = json.loads((tmp_path / "out" / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]
    assert torch.allclose(new.float(), load_file(tmp_path / "out" / full[name])[name], atol=2e-3)


def test_unconditional_unet_reads_attention_head_dim_as_a_head_size(tmp_path):
    torch.manual_seed(0)
    model = diffusers.UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=4,
    )
    model.save_pretrained(tmp_path / "src")
    found = inspect_checkpoint(tmp_path / "src")
    assert {b.module: (b.heads, b.head_dim) for b in found.blocks} == {
        n: (m.heads, 4) for n, m in attention_modules(model).items()
    }


def test_flux_joint_blocks_carry_their_context_stream(tmp_path):
    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    )
    model.save_pretrained(tmp_path / "src")
    found = inspect_checkpoint(tmp_path / "src")
    heads = {n: m.heads for n, m in attention_modules(model).items()}
    assert {b.module: b.heads for b in found.blocks} == {
        **heads,
        "transformer_blocks.0.attn:context": heads["transformer_blocks.0.attn"],
    }
    context = next(b for b in found.blocks if b.module.endswith(":context"))
    assert context.q.weight.tensor == "transformer_blocks.0.attn.add_q_proj.weight" and context.q.bias is not None
