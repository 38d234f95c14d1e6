"""Megatron-Core on CPU for tests/integrations/test_native_megatron.py: a tiny GPTModel built by Megatron's
own code, its distributed checkpoint (torch_dist) saved and loaded by Megatron's own dist_checkpointing, and each layer's
attention maps read through Megatron's own q/k/v split (SelfAttention.get_query_key_value_tensors).

Megatron asks CUDA for its device (the model's init, the checkpoint saver's failure broadcast) and to
synchronize: on CPU the device is "cpu" and synchronizing does nothing; gloo stands in for NCCL. Importable
only where megatron-core is installed (the test asks tests/helpers/frameworks.py first).
"""

from __future__ import annotations

import argparse
import os
import socket
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from helpers.modules import Maps, _solve, probe

HEADS, GROUPS, WIDTH, LAYERS = 4, 2, 32, 2
# What Megatron-LM's save_checkpoint puts beside the model's sharded state (into common.pt): its arguments
ARGS = argparse.Namespace(
    num_attention_heads=HEADS, num_query_groups=GROUPS, group_query_attention=True, kv_channels=WIDTH // HEADS
)


def on_cpu() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None


@contextmanager
def one_process() -> Iterator[None]:
    """Megatron's model-parallel state over one gloo process (tensor and pipeline parallel size 1), on CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    on_cpu()
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def gpt(seed: int = 0, groups: int = GROUPS):
    """A 2-layer GPTModel, 4 query heads in ``groups`` query groups, width 32, with biases (made non-zero), under
    the model parallel state already set up (its tensor-parallel size decides each rank's slice)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=WIDTH,
        num_attention_heads=HEADS,
        num_query_groups=groups,
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


# Megatron-LM's legacy (pre-Core) GPT model's names for the same weights (legacy/model/transformer.py
# ParallelTransformerLayer, language_model.py TransformerLanguageModel.state_dict_for_save_checkpoint), whose
# query_key_value rows at checkpoint_version 3.0 are Megatron-Core's linear_qkv's: per query group [q heads | k | v].
LEGACY_LAYER = {
    "input_layernorm": "input_norm",
    "self_attention.linear_qkv": "self_attention.query_key_value",
    "self_attention.linear_proj": "self_attention.dense",
    "pre_mlp_layernorm": "post_attention_norm",
    "mlp.linear_fc1": "mlp.dense_h_to_4h",
    "mlp.linear_fc2": "mlp.dense_4h_to_h",
}


def legacy_model(core_state: dict) -> dict:
    """Megatron-Core's GPT state dict as legacy Megatron-LM nests it in model_optim_rng.pt's "model":
    {"language_model": {"embedding": {"word_embeddings": {"weight"}, ...}, "encoder": {"layers.N....", "final_norm..."},
    "output_layer": {"weight"}}} (dicts of tensors)."""
    encoder = {}
    for name, t in core_state.items():
        if name.startswith("decoder.layers.") and not name.endswith("_extra_state"):
            layer, rest = name.removeprefix("decoder.layers.").split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            encoder[f"layers.{layer}.{LEGACY_LAYER[module]}.{leaf}"] = t
    encoder["final_norm.weight"] = core_state["decoder.final_layernorm.weight"]
    encoder["final_norm.bias"] = core_state["decoder.final_layernorm.bias"]
    embedding = {
        "word_embeddings": {"weight": core_state["embedding.word_embeddings.weight"]},
        "position_embeddings": {"weight": core_state["embedding.position_embeddings.weight"]},
    }
    return {
        "language_model": {
            "embedding": embedding,
            "encoder": encoder,
            "output_layer": {"weight": core_state["output_layer.weight"]},
        }
    }


def core_state(legacy: dict, like: dict) -> dict:
    """The inverse of :func:`legacy_model`, for Megatron-Core's load_state_dict (``like``: a core state dict,
    for its other entries)."""
    lm = legacy["language_model"]
    out = dict(like)
    back = {v: k for k, v in LEGACY_LAYER.items()}
    for name, t in lm["encoder"].items():
        if name.startswith("layers."):
            layer, rest = name.removeprefix("layers.").split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            out[f"decoder.layers.{layer}.{back[module]}.{leaf}"] = t
    out["decoder.final_layernorm.weight"] = lm["encoder"]["final_norm.weight"]
    out["decoder.final_layernorm.bias"] = lm["encoder"]["final_norm.bias"]
    out["embedding.word_embeddings.weight"] = lm["embedding"]["word_embeddings"]["weight"]
    out["embedding.position_embeddings.weight"] = lm["embedding"]["position_embeddings"]["weight"]
    out["output_layer.weight"] = lm["output_layer"]["weight"]
    return out


def transpose_first_dim(t: torch.Tensor, heads: int, num_splits_first: bool) -> torch.Tensor:
    """Megatron-LM's checkpointing.py _transpose_first_dim (3 splits), by which fix_query_key_value_ordering
    turns a version-0 ([3, heads, d], num_splits_first) or 1.0 ([heads, d, 3]) query_key_value into
    [heads, 3, d]."""
    rest, d = t.shape[1:], t.shape[0] // (3 * heads)
    if num_splits_first:
        t = t.view(3, heads, d, *rest).transpose(0, 1).contiguous()
    else:
        t = t.view(heads, d, 3, *rest).transpose(1, 2).contiguous()
    return t.view(3 * heads * d, *rest)
