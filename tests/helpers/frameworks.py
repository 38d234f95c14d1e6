"""The training frameworks the native tests build with, each importable only in its own venv.

``framework("titan")`` imports the framework's top module or skips the test; under
``SURGEON_FRAMEWORK=titan`` (what scripts/frameworks_check.sh sets in that framework's venv, in CI) a
missing framework fails instead, so its tests can never be skipped where they are meant to run.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from helpers.modules import Maps, _solve, probe

MODULES = {"litgpt": "litgpt", "olmo": "olmo_core", "titan": "torchtitan", "megatron": "megatron.core"}


def framework(name: str):
    module = MODULES[name]
    if os.environ.get("SURGEON_FRAMEWORK") == name:
        return importlib.import_module(module)  # in its own venv: an ImportError fails the test
    return pytest.importorskip(module)


def maps_of(x, q, k, v, heads_axis=2, time_axis=1):
    """Per-head maps from the framework's own (q, k, v) for input x (B, T, D); k and v repeated to the query
    heads as grouped-query attention reads them (head h uses key/value head h // (H/KV))."""

    def bhtd(t):
        batch_axis = ({0, 1, 2} - {heads_axis, time_axis}).pop()
        return t.permute(batch_axis, heads_axis, time_axis, 3).float()

    q, k, v = bhtd(q), bhtd(k), bhtd(v)
    rep = q.shape[1] // k.shape[1]
    (qw, qb), (kw, kb), (vw, vb) = (_solve(x, t.repeat_interleave(rep, dim=1)) for t in (q, k, v))
    return Maps(qw, qb, kw, kb, vw, vb), rep


def olmo_model(seed=0):
    from olmo_core.nn.transformer import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig.llama_like(d_model=32, vocab_size=64, n_layers=2, n_heads=4, n_kv_heads=2)
    return config.build(init_device="cpu").eval()


def olmo_maps(model, layer):
    attn = model.blocks[str(layer)].attention if hasattr(model.blocks, "keys") else model.blocks[layer].attention
    x = probe(32)
    rope, attn.rope = attn.rope, None  # the projections alone: RoPE rotates by position, no map of the input
    try:
        with torch.no_grad():
            q, k, v = attn._prepare_qkv(x)  # OLMo-core's own projection and head split, (B, T, heads, d)
    finally:
        attn.rope = rope
    return maps_of(x, q, k, v)
