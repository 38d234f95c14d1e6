"""Single-process checkpoints of training code outside transformers (issue 30), built here with torch alone:
from-scratch spellings (q_linear/k_linear/v_linear, nanochat's c_q/c_k/c_v), heads from a config stored in the
checkpoint's own container dict, and Megatron-LM's legacy model_optim_rng.pt (an argparse.Namespace beside the
weights). Judged through each module's own forward (``helpers.modules.observe``).

The frameworks' own models (Megatron-Core, OLMo-core, torchtitan, litgpt) are in tests/integrations/test_frameworks_native.py,
which runs in each framework's venv.
"""

from __future__ import annotations

import argparse
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from surgeon.api import inspect_checkpoint, reinit_checkpoint
from surgeon.errors import CheckpointError, LayoutError

from helpers.cli import expect_cli_error
from helpers.modules import assert_conditioned, assert_same, observe, randomize_biases


class FromScratchAttention(nn.Module):
    """The widely copied from-scratch block: q_linear/k_linear/v_linear (or nanochat's c_q/c_k/c_v), SDPA."""

    def __init__(self, width, heads, kv_heads, names):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, width // heads
        self.names = names
        q, k, v, o = names
        setattr(self, q, nn.Linear(width, heads * self.d))
        setattr(self, k, nn.Linear(width, kv_heads * self.d))
        setattr(self, v, nn.Linear(width, kv_heads * self.d))
        setattr(self, o, nn.Linear(heads * self.d, width))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v, o = (getattr(self, name) for name in self.names)
        split = lambda t, h: t.view(b, n, h, self.d).transpose(1, 2)  # noqa: E731
        rep = self.heads // self.kv_heads  # query head h reads key/value head h // rep (repeat_kv)
        y = F.scaled_dot_product_attention(
            split(q(x), self.heads),
            split(k(x), self.kv_heads).repeat_interleave(rep, dim=1),
            split(v(x), self.kv_heads).repeat_interleave(rep, dim=1),
        )
        return o(y.transpose(1, 2).reshape(b, n, -1))


class Model(nn.Module):
    def __init__(self, names, width=32, heads=4, kv_heads=4, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"attn": FromScratchAttention(width, heads, kv_heads, names)}) for _ in range(layers)
        )


def changed(before: dict, after: dict) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


SPELLINGS = {
    "q_linear": ("q_linear", "k_linear", "v_linear", "out"),
    "nanochat": ("c_q", "c_k", "c_v", "c_proj"),
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_from_scratch_spellings_with_heads_from_the_container_config(tmp_path, spelling):
    names = SPELLINGS[spelling]
    torch.manual_seed(0)
    model = randomize_biases(Model(names, heads=4, kv_heads=2)).eval()
    before = [observe(b["attn"], 32) for b in model.blocks]
    ckpt = {"model_state_dict": model.state_dict(), "config": {"n_head": 4, "n_kv_head": 2, "n_embd": 32}, "step": 9}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    found = inspect_checkpoint(tmp_path / "ckpt.pt")
    assert [(b.layer, b.heads, b.kv_heads, b.head_dim) for b in found.blocks] == [(0, 4, 2, 8), (1, 4, 2, 8)]
    reinit_checkpoint(tmp_path / "ckpt.pt", output=tmp_path / "out.pt", layers="1", seed=3)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out["config"] == ckpt["config"] and out["step"] == 9
    q, k, v, _ = names
    assert changed(ckpt["model_state_dict"], out["model_state_dict"]) == {
        f"blocks.1.attn.{n}.{p}" for n in (q, k, v) for p in ("weight", "bias")
    }
    model.load_state_dict(out["model_state_dict"])
    assert_same(observe(model.blocks[0]["attn"], 32), before[0])
    assert_conditioned(observe(model.blocks[1]["attn"], 32), kv_groups=2)


def test_without_heads_the_refusal_names_the_hint(tmp_path):
    torch.manual_seed(0)
    torch.save(Model(SPELLINGS["q_linear"]).state_dict(), tmp_path / "sd.pt")
    with pytest.raises(LayoutError, match="cannot tell the number of heads of blocks.0.attn: .* pass num_heads=N"):
        reinit_checkpoint(tmp_path / "sd.pt", output=tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


# --------------------------------------------------------------------------- Megatron-LM legacy model_optim_rng.pt


class MegatronSelfAttention(nn.Module):
    """Megatron-Core's split of linear_qkv, as transformer/attention.py SelfAttention.get_query_key_value_tensors
    writes it (re-implemented in torch for the tests that run without megatron-core; the real one is judged in
    tests/integrations/test_frameworks_native.py): rows viewed as (groups, (heads/groups + 2) * head_dim), split into the
    group's query heads, its key and its value."""

    def __init__(self, width, heads, groups, head_dim):
        super().__init__()
        self.heads, self.groups, self.d = heads, groups, head_dim
        self.linear_qkv = nn.Linear(width, (heads + 2 * groups) * head_dim)
        self.linear_proj = nn.Linear(heads * head_dim, width)

    def forward(self, x):  # x: (b, n, width), batch first here
        b, n, _ = x.shape
        mixed = self.linear_qkv(x).view(b, n, self.groups, (self.heads // self.groups + 2) * self.d)
        q, k, v = torch.split(mixed, [self.heads // self.groups * self.d, self.d, self.d], dim=3)
        q = q.reshape(b, n, self.heads, self.d).transpose(1, 2)
        # DotProductAttention: key.repeat_interleave(heads / groups) over the head axis
        k, v = (
            t.reshape(b, n, self.groups, self.d).transpose(1, 2).repeat_interleave(self.heads // self.groups, dim=1)
            for t in (k, v)
        )
        y = F.scaled_dot_product_attention(q, k, v)
        return self.linear_proj(y.transpose(1, 2).reshape(b, n, -1))


def megatron_state(heads=4, groups=2, layers=2, width=32):
    torch.manual_seed(0)
    attns = [
        randomize_biases(MegatronSelfAttention(width, heads, groups, width // heads)).eval() for _ in range(layers)
    ]
    state = {}
    for i, attn in enumerate(attns):
        for name, value in attn.state_dict().items():
            state[f"decoder.layers.{i}.self_attention.{name}"] = value
        # Transformer Engine's fused input norm sits in linear_qkv: not a projection, left alone
        state[f"decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight"] = torch.ones(width)
    return attns, state


def megatron_args(**over):
    args = dict(num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8, group_query_attention=True)
    args.update(num_query_groups=2, params_dtype=torch.float32, seq_length=16, save="/ckpt")
    args.update(over)
    return argparse.Namespace(**args)


def test_megatron_legacy_checkpoint_heads_from_its_args_namespace(tmp_path):
    attns, state = megatron_state()
    before = [observe(a, 32) for a in attns]
    ckpt = {"args": megatron_args(), "checkpoint_version": 3.0, "iteration": 10, "model": state}
    path = tmp_path / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save(ckpt, path)
    with pytest.raises(pickle.UnpicklingError):  # what surgeon's reading of it must get past, safely
        torch.load(path, weights_only=True)
    found = inspect_checkpoint(path)
    assert [(b.layer, b.heads, b.kv_heads, b.head_dim, b.layout) for b in found.blocks] == [
        (i, 4, 2, 8, "fused linear_qkv") for i in range(2)
    ]
    reinit_checkpoint(path, output=tmp_path / "out.pt", layers="0", seed=5)
    with torch.serialization.safe_globals([argparse.Namespace]):
        out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert vars(out["args"]) == vars(ckpt["args"]) and out["iteration"] == 10
    assert changed(state, out["model"]) == {
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_qkv.bias",
    }
    for i, attn in enumerate(attns):
        attn.load_state_dict(
            {
                k.split("self_attention.")[1]: v
                for k, v in out["model"].items()
                if f".{i}." in k and "layer_norm" not in k
            }
        )
    assert_conditioned(observe(attns[0], 32), kv_groups=2)
    assert_same(observe(attns[1], 32), before[1])


def test_megatron_args_without_group_query_attention_mean_one_group_per_head(tmp_path):
    # Megatron's --num-query-groups defaults to 1 and counts only with --group-query-attention
    _, state = megatron_state(heads=4, groups=4)
    args = megatron_args(group_query_attention=False, num_query_groups=1)
    torch.save({"args": args, "iteration": 1, "model": state}, tmp_path / "model_optim_rng.pt")
    found = inspect_checkpoint(tmp_path / "model_optim_rng.pt")
    assert {(b.heads, b.kv_heads) for b in found.blocks} == {(4, 4)}


@pytest.mark.parametrize(
    "split", [{"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2}, {"tensor_model_parallel_size": 1}]
)
def test_one_ranks_part_of_a_megatron_legacy_checkpoint_is_refused(tmp_path, cli, split):
    """An mp_rank_XX file of a tensor-parallel run holds that rank's heads only (a pipeline stage's file, its own
    layers numbered from 0): cut as the whole model it would be a per-slice draw. Refused naming the ranks'
    sizes and the merge, whatever hints are given; a TP=1, PP=1 file reads as before."""
    heads = 4 // split.get("tensor_model_parallel_size", 1)
    _, state = megatron_state(heads=heads, groups=heads)  # what one rank holds: its slice of the heads
    args = megatron_args(num_attention_heads=4, num_query_groups=4, **split)
    path = tmp_path / "mp_rank_01" / "model_optim_rng.pt"
    path.parent.mkdir()
    torch.save({"args": args, "checkpoint_version": 3.0, "model": state}, path)
    if max(split.values()) == 1:
        assert {(b.heads, b.kv_heads) for b in inspect_checkpoint(path).blocks} == {(4, 4)}
        return
    said = ", ".join(f"{k}={v}" for k, v in split.items())
    for command in (
        ("inspect", path, "--num-heads", heads),
        ("reinit", path, "-o", tmp_path / "out.pt", "--num-heads", heads, "--num-kv-heads", heads),
    ):
        expect_cli_error(cli, tmp_path, *command, match=f"saved with {said}: it holds a slice")
    assert not (tmp_path / "out.pt").exists()


class Stranger:
    """A class no allowlist names."""


def test_a_namespace_holding_anything_else_is_still_refused(tmp_path):
    _, state = megatron_state()
    torch.save({"args": megatron_args(extra=Stranger()), "model": state}, tmp_path / "model_optim_rng.pt")
    with pytest.raises(
        CheckpointError, match=r"cannot be loaded safely \(it asks for test_framework_layouts.Stranger\): "
    ):
        inspect_checkpoint(tmp_path / "model_optim_rng.pt")


@pytest.mark.parametrize("key", ["²", "١"], ids=["superscript-two", "arabic-indic-one"])
def test_an_olmo_core_override_key_that_is_not_an_ascii_layer_number_is_one_line(llama_dir, tmp_path, cli, key):
    """OLMo-core's block_overrides are keyed by layer number: a key str.isdigit() takes and int() refuses ("²"),
    or reads as another number ("١" is 1), is refused in one line naming the key, not an internal error."""
    import json

    from surgeon.detect.families import OLMO_CORE_MODEL_CLASS

    block = {"sequence_mixer": {"n_heads": 8, "n_kv_heads": 2}}
    model = {"_CLASS_": OLMO_CORE_MODEL_CLASS, "d_model": 64, "n_layers": 3, "block": block}
    (llama_dir / "config.json").write_text(json.dumps({"model": {**model, "block_overrides": {key: block}}}))
    said = expect_cli_error(cli, tmp_path, "inspect", llama_dir, match="model.block_overrides")
    assert repr(key) in said or key in said, said
