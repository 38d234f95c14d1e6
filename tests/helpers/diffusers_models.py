"""Tiny diffusers models, their biases drawn so that a bias map shows."""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")


def randomized(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def sd3(**extra):
    """A tiny SD3 transformer (``extra``: more of its arguments, e.g. SD3.5's dual_attention_layers)."""
    torch.manual_seed(0)
    return randomized(
        diffusers.SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            caption_projection_dim=16,
            pooled_projection_dim=8,
            out_channels=4,
            pos_embed_max_size=8,
            **extra,
        )
    )


def unet():
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=12,
        attention_head_dim=(2, 4),  # the number of heads per block, despite the name
    )
