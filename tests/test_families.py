"""Every supported family, end to end: save a tiny random model, reinit some layers, reload it with
transformers and check through the model's own forward (see _observe.py) that

- detection finds exactly the attention modules the forward uses, with the right rows per head;
- chosen layers now have semi-orthogonal per-head query/key maps, a rectangular-identity value map
  and zero biases;
- every other attention block computes exactly what it computed before;
- every tensor that was not re-initialized is byte-identical in the file.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from surgeon import reinit_checkpoint
from surgeon.compute.engine import head_matrices
from surgeon.open.formats.safetensors import SafetensorsWeights

from _families import FAMILIES
from _observe import observe

ATOL = 2e-5  # float32 storage


pytestmark = pytest.mark.usefixtures("one_thread")


def raw_bytes(folder):
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        for name, e in json.loads(data[8 : 8 + n]).items():
            if name != "__metadata__":
                out[name] = data[8 + n + e["data_offsets"][0] : 8 + n + e["data_offsets"][1]]
    return out


def semi_orthogonal_heads(maps):
    for w in maps:  # (d, D): orthonormal rows (d <= D) or columns
        gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
        assert torch.allclose(gram, torch.eye(gram.shape[0], dtype=gram.dtype), atol=1e-4), gram.diagonal()


def block_identity(maps, head_dim):
    for h, w in enumerate(maps):
        expected = torch.eye(len(maps) * head_dim, w.shape[1], dtype=w.dtype)[h * head_dim : (h + 1) * head_dim]
        assert torch.allclose(w, expected, atol=ATOL)


def same_maps(a, b):
    for role in ("q", "k", "v"):
        assert torch.allclose(getattr(a, role), getattr(b, role), atol=1e-6, rtol=1e-5), role
        assert torch.allclose(getattr(a, f"{role}_bias"), getattr(b, f"{role}_bias"), atol=1e-6, rtol=1e-5), role


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


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_detection_matches_the_forward(name, saved_family):
    """Every attention module of the forward is found once, with the rows the forward really uses."""
    src, observed = saved_family(name)
    _, pairs = match_blocks(src, observed)
    assert sorted(pairs.values()) == sorted(observed)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_reinit_first_layer_through_forward(name, saved_family, tmp_path):
    src, before = saved_family(name)
    _, pairs = match_blocks(src, before)
    out = tmp_path / "out"
    report = reinit_checkpoint(src, output=out, layers="0", seed=1)
    after = observe(FAMILIES[name].load(out))
    chosen = {pairs[b.module] for b in report.blocks if b.layer == 0}
    assert {pairs[r.block.module] for r in report.rows} == chosen
    assert set(after) == set(before)
    for module, obs in after.items():
        if module not in chosen:
            same_maps(obs, before[module])
            continue
        semi_orthogonal_heads(obs.q)
        semi_orthogonal_heads(obs.k)
        block_identity(obs.v, obs.v.shape[1])
        for role in ("q", "k", "v"):
            bias = getattr(obs, f"{role}_bias")
            assert torch.allclose(bias, torch.zeros_like(bias), atol=1e-6)
    touched = {
        rows.tensor
        for r in report.rows
        for rows in (r.block.projection(r.role).weight, r.block.projection(r.role).bias)
        if rows
    }
    old, new = raw_bytes(src), raw_bytes(out)
    assert old.keys() == new.keys()
    for tensor, data in old.items():
        assert (new[tensor] == data) == (tensor not in touched), tensor
