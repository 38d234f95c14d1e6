"""Every supported family, end to end: save a tiny random model, reinit some layers, reload it with
transformers and check through the model's own forward (see helpers/observe.py) that

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

from helpers.block_maps import match_blocks
from helpers.families import FAMILIES
from helpers.observe import observe

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
