"""Multi-process helpers: spawn N CPU ranks on gloo (FileStore rendezvous in a tmp folder), bounded in time.

``spawn(worker, world, tmp_path, *args)`` runs ``worker(rank, world, *args)`` in ``world`` fresh
processes (torch.multiprocessing, start method "spawn") with a gloo process group, and raises with
the failing rank's traceback, or after ``timeout`` seconds (the processes are killed: a guard against a
deadlock, set far beyond a normal run on a busy machine, never a claim about speed). The workers
live in this module so that the spawned processes can import them; they write what they saw with
torch.save under the tmp folder, and the test compares.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

SEED = 3


def spawn(worker, world: int, tmp_path: Path, *args, timeout: float = 600.0) -> None:
    store = tmp_path / f"store-{worker.__name__}-{world}"
    ctx = mp.start_processes(
        _entry, args=(worker, world, str(store), args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{worker.__name__} on {world} ranks did not finish in {timeout:.0f} s")
    finally:
        for p in ctx.processes:  # only the processes spawned here
            if p.is_alive():
                p.kill()
                p.join(5)


def _entry(rank: int, worker, world: int, store: str, args) -> None:
    import torch.distributed as dist

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        worker(rank, world, *args)
        dist.barrier()  # no rank tears its group down while another still talks to it
    finally:
        dist.destroy_process_group()
    # Done: leave without the interpreter's teardown, where gloo's threads (FSDP2's device mesh) can abort
    # the process ("terminate called without an active exception") after the work has succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def make(family: str):
    if family == "llama-large":  # for peak memory: 84 MB of float32, the largest projection 1 MB
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(large_config())
    from helpers.families import FAMILIES

    return FAMILIES[family].make()


def large_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=16384,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def tokens(family: str) -> torch.Tensor:
    return torch.arange(1, 13).reshape(2, 6) % 90


def layer_list(model):
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def full_state(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    return out


def report_rows(report) -> list:
    data = report.to_dict()
    return {
        k: data[k] for k in ("blocks", "projections", "options", "device")
    }  # not the timing, nor the wrapper's class name


# --------------------------------------------------------------------------- workers


def fsdp_worker(rank: int, world: int, out: str, families: list[str]) -> None:
    """FSDP2 fully_shard per layer and at the root, then reinit_, a forward, and inspect."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import surgeon

    mesh = init_device_mesh("cpu", (world,))
    for family in families:
        model = make(family)
        for layer in layer_list(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        report = surgeon.reinit_(model, seed=SEED, layers="0-")
        with torch.no_grad():
            logits = model(tokens(family)).logits
        inspected = surgeon.inspect(model)
        torch.save(
            {
                "state": full_state(model),
                "report": report_rows(report),
                "inspect": report_rows(inspected),
                "logits": logits,
                "printed": str(report) if rank == 0 else None,
            },
            Path(out) / f"fsdp-{family}-{rank}.pt",
        )


def dtensor_worker(rank: int, world: int, out: str, families: list[str]) -> None:
    """Plain DTensor parameters from a device mesh: 2-D weights sharded on their columns (dim 1), 1-D replicated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import surgeon

    mesh = init_device_mesh("cpu", (world,))
    for family in families:
        model = make(family)
        for mod in model.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                placement = Shard(1) if p.dim() == 2 else Replicate()
                mod.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [placement])))
        report = surgeon.reinit_(model, seed=SEED, layers="0-")
        torch.save(
            {"state": {n: p.full_tensor() for n, p in model.named_parameters()}, "report": report_rows(report)},
            Path(out) / f"dtensor-{family}-{rank}.pt",
        )


def ddp_worker(rank: int, world: int, out: str, families: list[str]) -> None:
    """DDP: reinit_ on the wrapper on every rank; no broadcast. Then one real training step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import surgeon

    for family in families:
        model = make(family)
        ddp = DDP(model)  # DDP broadcasts rank 0's weights here, once
        with (
            torch.no_grad()
        ):  # then let the attention projections drift apart per rank: reinit_ must not need a broadcast
            for name, p in model.named_parameters():
                if any(k in name for k in ("q_proj", "k_proj", "v_proj", "c_attn")):
                    p.add_(float(rank))
        report = surgeon.reinit_(ddp, seed=SEED, layers="0-")
        after = full_state(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x = tokens(family)
        ddp(x, labels=x).loss.backward()
        opt.step()
        torch.save(
            {"state": after, "stepped": full_state(model), "report": report_rows(report)},
            Path(out) / f"ddp-{family}-{rank}.pt",
        )


def _hwm_kb() -> tuple[int, int]:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)), int(re.search(r"VmRSS:\s+(\d+)", status).group(1))


def memory_worker(rank: int, world: int, out: str, checkpoint: str) -> None:
    """A model built on meta, sharded, filled from the checkpoint with only this rank's rows; peak RSS of reinit_."""
    import gc

    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    import surgeon
    from surgeon.compute.distributed import _local

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = LlamaForCausalLM(large_config())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with safe_open(checkpoint, "pt") as f, torch.no_grad():
        for name, p in model.named_parameters():
            local, shape, offset = _local(p)
            local.copy_(f.get_slice(name)[offset[0] : offset[0] + shape[0]])
    shard_bytes = sum(_local(p)[0].nbytes for p in model.parameters())
    surgeon.inspect(model)  # imports and thread pools warmed up (and inspect runs sharded too)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
    hwm0, rss0 = _hwm_kb()
    surgeon.reinit_(model, seed=SEED)
    hwm1, _ = _hwm_kb()
    state = {n: p.full_tensor() for n, p in model.named_parameters()}
    torch.save(
        {"state": state, "extra_peak": (hwm1 - rss0) * 1024, "shard_bytes": shard_bytes},
        Path(out) / f"memory-{rank}.pt",
    )
