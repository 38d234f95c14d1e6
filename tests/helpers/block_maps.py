"""Detected blocks paired with observed attention modules by the maps they compute."""

from __future__ import annotations

import torch

from surgeon.compute.engine import head_matrices
from surgeon.formats.safetensors import SafetensorsWeights


def our_maps(weights, block):
    """What detection says each head's map is, read from the file."""
    maps = {}
    for proj in block.projections:
        maps[proj.role] = head_matrices(weights.read(proj.weight.tensor), proj.weight).double()
        if proj.bias is None:
            maps[f"{proj.role}_bias"] = torch.zeros(proj.heads, proj.head_dim, dtype=torch.float64)
        else:
            b = weights.read(proj.bias.tensor).double()
            maps[f"{proj.role}_bias"] = torch.stack([b[proj.bias.head_slice(h)] for h in range(proj.heads)])
    return maps


def equal_maps(ours, obs) -> bool:
    keys = ("q", "k", "v", "q_bias", "k_bias", "v_bias")
    return all(
        ours[k].shape == getattr(obs, k).shape and torch.allclose(ours[k], getattr(obs, k).double(), atol=1e-6)
        for k in keys
    )


def match_blocks(src, observed):
    """Detected block (file names) -> observed attention module (in-memory names), by equal maps.

    transformers 5 renames some modules in memory (ViT's attention.attention.query -> attention.q_proj)
    while checkpoints keep the old names, so the two are paired by what they compute.
    """
    from surgeon.api import inspect_checkpoint

    report = inspect_checkpoint(src)
    weights = SafetensorsWeights(src, [p.name for p in sorted(src.glob("*.safetensors"))])
    pairs = {}
    for block in report.blocks:
        ours = our_maps(weights, block)
        hits = [m for m, obs in observed.items() if equal_maps(ours, obs)]
        assert len(hits) == 1, (block.module, hits)
        obs = observed[hits[0]]
        assert block.kind == ("cross" if obs.cross else "self")
        assert (block.heads, block.kv_heads, block.head_dim) == (obs.q.shape[0], obs.k.shape[0], obs.q.shape[1])
        pairs[block.module] = hits[0]
    return report, pairs
