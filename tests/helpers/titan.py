"""torchtitan models built with its own code, its own q/k/v split, and the workers of its multi-rank tests.

The workers live here so that the spawned ranks (tests/helpers/distributed.py spawn) can import them; torchtitan is
imported inside each function (this module imports without it).
"""

from __future__ import annotations

from pathlib import Path

import torch

SEED = 3
CONFIGS = {  # name -> (torchtitan module, its configs dict, flavor)
    "llama3": ("torchtitan.models.llama3", "llama3_configs", "debugmodel"),
    "qwen3": ("torchtitan.models.qwen3", "qwen3_configs", "debugmodel"),  # q/k norms, 8 KV heads of 16
    "qwen3-separate": ("torchtitan.models.qwen3", "qwen3_configs", "debugmodel_non_fused_qkv"),
}


def build(name: str = "llama3", seed: int = 0):
    """torchtitan's own debug model (flex attention, its only backend for language models on CPU), initialized by it."""
    import importlib

    module, configs, flavor = CONFIGS[name]
    torch.manual_seed(seed)
    return getattr(importlib.import_module(module), configs)[flavor](attn_backend="flex").build().eval()


def inputs(model, tokens: int = 8) -> dict:
    """What its trainer hands the forward: token ids, positions, and the masks its own get_attention_masks builds."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(tokens)[None]
    with torch.compiler.set_stance("force_eager"):  # its compiled mask builder, eagerly (no compile wait)
        return {"tokens": ids, "positions": positions, "attention_masks": model.get_attention_masks(positions)}


def logits(model, given: dict) -> torch.Tensor:
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        return model(**given)


def heads(model) -> tuple[int, int, int]:
    attn = model.layers["0"].attention
    return attn.n_heads, attn.n_kv_heads, attn.head_dim


def full_state(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()
    }


# --------------------------------------------------------------------------- workers


def fsdp_worker(rank: int, world: int, out: str, name: str) -> None:
    """torchtitan's model under FSDP2 (fully_shard per block and at the root, as its parallelize does), then reinit_."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import surgeon

    mesh = init_device_mesh("cpu", (world,))
    model = build(name)
    given = inputs(model)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = surgeon.reinit_(model, seed=SEED, layers="1-")
    found = [(b.module, b.layout, b.heads, b.kv_heads) for b in report.blocks]
    torch.save(
        {"state": full_state(model), "logits": logits(model, given), "blocks": found},
        Path(out) / f"fsdp-{name}-{rank}.pt",
    )


def tp_worker(rank: int, world: int, out: str, name: str) -> None:
    """Tensor parallelism as torchtitan's plan sets it on attention (wqkv column-wise, wo row-wise); reinit_ without
    heads (refused), then with them (the layout from the parameter names)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import surgeon
    from surgeon.errors import SurgeonError

    mesh = init_device_mesh("cpu", (world,))
    model = build(name)
    plan = {}
    for i in model.layers:
        plan[f"layers.{i}.attention.qkv_linear.wqkv"] = ColwiseParallel()
        plan[f"layers.{i}.attention.wo"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    before = full_state(model)
    try:
        surgeon.reinit_(model, seed=SEED)
        error = None
    except SurgeonError as exc:
        error = f"{type(exc).__name__}: {exc}"
    unchanged = all(torch.equal(before[n], t) for n, t in full_state(model).items())
    n_heads, n_kv, _ = heads(model)
    report = surgeon.reinit_(model, seed=SEED, num_heads=n_heads, num_kv_heads=n_kv)  # the layout from the names
    torch.save(
        {
            "error": error,
            "unchanged": unchanged,
            "state": full_state(model),
            "blocks": [(b.module, b.layout, b.heads, b.kv_heads) for b in report.blocks],
            "notes": report.notes,
        },
        Path(out) / f"tp-{name}-{rank}.pt",
    )


# --------------------------------------------------------------------------- its checkpoints


def trainer_state(model):
    """torchtitan's own optimizer (AdamW container) and LR schedulers after one step on made-up gradients
    (flex attention has no backward on CPU)."""
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)  # a DTensor for an FSDP2 parameter, like its own
    optimizers.step()
    schedulers.step()
    optimizers.zero_grad()
    return optimizers, schedulers


def manager(model, base: Path, sd_adapter=None, **config):
    """torchtitan's CheckpointManager (its DCP saver and loader) over ``base``/checkpoint/step-N."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager

    optimizers, schedulers = trainer_state(model)
    cfg = CheckpointManager.Config(enable=True, folder="checkpoint", interval=5, keep_latest_k=0, **config)
    states: dict = {}
    return CheckpointManager(
        cfg,
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states=states,
        sd_adapter=sd_adapter,
        base_folder=str(base),
    )


def save_steps(model, base: Path):
    """A full training state at step 5, the model alone at the last step 10 (torchtitan's defaults)."""
    saver = manager(model, base, last_save_model_only=True)
    saver.save(5)
    saver.save(10, last_step=True)
    return saver


def dcp_fsdp_worker(rank: int, world: int, out: str, name: str) -> None:
    """torchtitan's model under FSDP2 on every rank, saved by its CheckpointManager: one .distcp file per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = build(name)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    save_steps(model, Path(out)).close()


def hf_adapter(model, assets: Path):
    """torchtitan's Llama3 HF adapter; an index.json in ``assets`` makes its export write sharded/ and consolidate."""
    import json

    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    keys = Llama3StateDictAdapter(model.config, None).to_hf(model.state_dict())
    assets.mkdir(parents=True, exist_ok=True)
    index = {"metadata": {}, "weight_map": dict.fromkeys(keys, "model-00001-of-00001.safetensors")}
    (assets / "model.safetensors.index.json").write_text(json.dumps(index))
    return Llama3StateDictAdapter(model.config, str(assets))
