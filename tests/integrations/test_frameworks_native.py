"""Checkpoints written by the training frameworks themselves (issue 30), judged by each framework's own q/k/v split
after its own loader took the result back: Megatron-Core (linear_qkv, per query group), OLMo-core (w_q/w_k/w_v,
state dict and safetensors) and torchtitan (qkv_linear.wq/wk/wv, saved by its fused module's own hook).

Each test skips when its framework is not importable (tests/helpers/frameworks.py), except where it is meant to run:
scripts/frameworks_check.sh (run by .ci/run) builds one venv per framework (CPU torch 2.13.0 first, then
`pip install <framework> -e .` in one resolve) and runs these tests there with SURGEON_FRAMEWORK=<name>, under
which that framework missing is a failure. By hand, with the venvs kept in a folder:

    bash scripts/frameworks_check.sh /work/venvs            # litgpt, olmo, titan, megatron
    bash scripts/frameworks_check.sh /work/venvs megatron   # one of them
"""

from __future__ import annotations

import argparse

import pytest
import torch

from surgeon.api import inspect_checkpoint, reinit_checkpoint

from helpers.frameworks import framework, maps_of, olmo_maps, olmo_model
from helpers.modules import assert_conditioned, assert_same, probe


def changed(before: dict, after: dict) -> set[str]:
    return {k for k, v in before.items() if isinstance(v, torch.Tensor) and not torch.equal(v, after[k])}


# --------------------------------------------------------------------------- Megatron-Core


@pytest.fixture(scope="module")
def megatron():
    framework("megatron")
    from helpers.megatron import one_process

    with one_process():
        yield


@pytest.mark.parametrize("container", ["state dict", "model_optim_rng.pt"])
def test_megatron_core_linear_qkv_per_query_group(tmp_path, megatron, container):
    from helpers.megatron import gpt
    from helpers.megatron import maps as megatron_maps

    model = gpt()
    before = [megatron_maps(model, i)[0] for i in range(2)]
    state = model.state_dict()
    if container == "state dict":  # no config: the heads are hints
        torch.save(state, tmp_path / "model.pt")
        hints = {"num_heads": 4, "num_kv_heads": 2}
    else:  # Megatron-LM's legacy checkpoint: its arguments, an argparse.Namespace, beside the weights
        args = argparse.Namespace(num_attention_heads=4, num_query_groups=2, group_query_attention=True, kv_channels=8)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 5, "model": state}, tmp_path / "model.pt")
        hints = {}
    found = inspect_checkpoint(tmp_path / "model.pt", **hints)
    assert [(b.module, b.heads, b.kv_heads, b.head_dim, b.layout) for b in found.blocks] == [
        (f"decoder.layers.{i}.self_attention", 4, 2, 8, "fused linear_qkv") for i in range(2)
    ]
    reinit_checkpoint(tmp_path / "model.pt", output=tmp_path / "out.pt", layers="1", seed=4, **hints)
    # the context's exit removes what it was given: never Megatron's own registration of Namespace (at import)
    allowed = [] if argparse.Namespace in torch.serialization.get_safe_globals() else [argparse.Namespace]
    with torch.serialization.safe_globals(allowed):
        out = torch.load(tmp_path / "out.pt", weights_only=True)
    out = out if container == "state dict" else out["model"]
    assert changed(state, out) == {f"decoder.layers.1.self_attention.linear_qkv.{p}" for p in ("weight", "bias")}
    fresh = gpt(seed=1)
    fresh.load_state_dict(out)  # Megatron's own loader
    assert_same(megatron_maps(fresh, 0)[0], before[0])
    maps, groups = megatron_maps(fresh, 1)
    assert groups == 2
    assert_conditioned(maps, kv_groups=groups)


# --------------------------------------------------------------------------- OLMo-core


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_olmo_core_w_q_w_k_w_v(tmp_path, suffix):
    framework("olmo")
    model = olmo_model()
    before = [olmo_maps(model, i)[0] for i in range(2)]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if suffix == ".pt":
        torch.save(state, tmp_path / f"model{suffix}")
    else:  # an unsharded export (olmo_core.distributed.checkpoint.unshard_checkpoint(use_safetensors=True))
        from safetensors.torch import save_file

        save_file(state, tmp_path / f"model{suffix}")
    hints = {"num_heads": 4, "num_kv_heads": 2}
    found = inspect_checkpoint(tmp_path / f"model{suffix}", **hints)
    assert [(b.module, b.layout) for b in found.blocks] == [(f"blocks.{i}.attention", "separate") for i in range(2)], (
        found.blocks
    )
    reinit_checkpoint(tmp_path / f"model{suffix}", output=tmp_path / f"out{suffix}", layers="0", seed=2, **hints)
    if suffix == ".pt":
        out = torch.load(tmp_path / f"out{suffix}", weights_only=True)
    else:
        from safetensors.torch import load_file

        out = load_file(tmp_path / f"out{suffix}")
    assert changed(state, out) == {f"blocks.0.attention.{w}.weight" for w in ("w_q", "w_k", "w_v")}
    fresh = olmo_model(seed=1)
    fresh.load_state_dict(out)
    maps, groups = olmo_maps(fresh, 0)
    assert_conditioned(maps, kv_groups=groups)
    assert_same(olmo_maps(fresh, 1)[0], before[1])


# --------------------------------------------------------------------------- torchtitan


def titan_model(seed=0):
    from torchtitan.models.llama3 import llama3_configs

    torch.manual_seed(seed)
    return llama3_configs["debugmodel"](attn_backend="flex").build().eval()


def titan_maps(model, layer):
    qkv = model.layers[str(layer)].attention.qkv_linear
    x = probe(256, rows=272)
    with torch.no_grad():
        q, k, v = qkv(x)  # torchtitan's own fused projection and split, (B, T, heads, d)
    return maps_of(x, q, k, v)


def test_torchtitan_qkv_linear_saved_by_its_fused_module(tmp_path):
    framework("titan")
    model = titan_model()
    before = titan_maps(model, 0)[0]
    state = model.state_dict()  # FusedQKVLinear's save hook splits wqkv into wq/wk/wv
    torch.save(state, tmp_path / "model.pt")
    reinit_checkpoint(tmp_path / "model.pt", output=tmp_path / "out.pt", layers="2", num_heads=16, seed=1)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert changed(state, out) == {f"layers.2.attention.qkv_linear.{w}.weight" for w in ("wq", "wk", "wv")}
    fresh = titan_model(seed=1)
    fresh.load_state_dict(out)  # its load hook fuses them back into wqkv
    maps, groups = titan_maps(fresh, 2)
    assert_conditioned(maps, kv_groups=groups)
    assert_same(titan_maps(fresh, 0)[0], before)
