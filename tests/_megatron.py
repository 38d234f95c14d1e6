"""Megatron-Core on CPU for tests/test_native_megatron.py: a tiny GPTModel built by Megatron's own code, its
distributed checkpoint (torch_dist) saved and loaded by Megatron's own dist_checkpointing, and each layer's
attention maps read through Megatron's own q/k/v split (SelfAttention.get_query_key_value_tensors).

Megatron asks CUDA for its device (the model's init, the checkpoint saver's failure broadcast) and to
synchronize: on CPU the device is "cpu" and synchronizing does nothing; gloo stands in for NCCL. Importable
only where megatron-core is installed (the test asks tests/_frameworks.py first).
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch

from _modules import Maps, _solve, probe

HEADS, GROUPS, WIDTH, LAYERS = 4, 2, 32, 2
# What Megatron-LM's save_checkpoint puts beside the model's sharded state (into common.pt): its arguments
ARGS = argparse.Namespace(
    num_attention_heads=HEADS, num_query_groups=GROUPS, group_query_attention=True, kv_channels=WIDTH // HEADS
)


def on_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None


def gpt(seed: int = 0):
    """A 2-layer GPTModel, 4 query heads in 2 query groups, width 32, with biases (made non-zero), under the
    model parallel state already set up (its tensor-parallel size decides each rank's slice)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=WIDTH,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        use_cpu_initialization=True,
        add_bias_linear=True,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_qkv.bias"):
                p.normal_(0, 0.1)
    return model.eval()


def maps(model, layer: int) -> tuple[Maps, int]:
    """Per-head maps of one layer from Megatron's own q/k/v split, k and v repeated to the query heads as
    grouped-query attention reads them; and the number of query heads per key/value head."""
    attn = model.decoder.layers[layer].self_attention
    x = probe(WIDTH)  # (1, T, D); Megatron runs (T, B, D)
    with torch.no_grad():
        q, k, v = attn.get_query_key_value_tensors(x.transpose(0, 1), None)[:3]  # (T, B, heads, d)
    q, k, v = (t.permute(1, 2, 0, 3).float() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    (qw, qb), (kw, kb), (vw, vb) = (_solve(x, t.repeat_interleave(rep, dim=1)) for t in (q, k, v))
    return Maps(qw, qb, kw, kb, vw, vb), rep


def save_dist(model, folder: Path) -> Path:
    """``dist_checkpointing.save`` as Megatron-LM's save_checkpoint calls it: the model's sharded state under
    "model", its arguments and checkpoint version beside it (those go to common.pt)."""
    from megatron.core import dist_checkpointing

    folder.mkdir(parents=True)
    state = {"model": model.sharded_state_dict(), "args": ARGS, "checkpoint_version": 3.0, "iteration": 10}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist_checkpointing.save(state, str(folder))
    return folder


def load_dist(model, folder: Path):
    """Megatron's own loader into ``model``: dist_checkpointing.load of its sharded state, then load_state_dict."""
    from megatron.core import dist_checkpointing

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(folder))
    model.load_state_dict(state["model"])
    return model
