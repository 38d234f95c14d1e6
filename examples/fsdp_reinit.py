"""Conditioned re-initialization of a model sharded with FSDP2, on CPU (gloo), one process per rank.

    torchrun --nproc_per_node 2 examples/fsdp_reinit.py

Builds a small Llama (GQA) from its config on every rank, shards it with fully_shard, re-initializes
the Q/K/V of its last layer with surgeon.reinit_ (each rank writes only the rows it owns) and checks
that the sharded result equals, bit for bit, surgeon.reinit_ on the unsharded model. Rank 0 prints
the report. Nothing is downloaded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import surgeon


def build() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    report = surgeon.reinit_(model, layers="-1-", seed=0)  # on every rank; no broadcast needed
    if rank == 0:
        print(report)

    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # a gather, for the check only
    reference = build()
    surgeon.reinit_(reference, layers="-1-", seed=0)
    same = all(torch.equal(full[n], p) for n, p in reference.named_parameters())
    if rank == 0:
        print(f"sharded over {dist.get_world_size()} ranks == single process, bit for bit: {same}")
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
