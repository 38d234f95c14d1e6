"""DCP checkpoints built with plain torch (``dcp.save``) for tests/open/test_dcp.py, and hostile variants of them.

The hostile ones are built from a real checkpoint by editing what dcp.save wrote, with torch's own
metadata reader on the test's own folder (trusted data made here): each keeps everything else real, so a
reader that skipped the one check would read it happily. Payloads ``touch`` a marker file: it exists only
if code from the folder ran.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader


class Payload:
    """Unpickled, it runs ``touch marker`` (the global a pickle of it asks for is os.system)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def save(state: dict, folder: Path, config=None, storage_writer=None) -> Path:
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming ... a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=None if storage_writer else str(folder), storage_writer=storage_writer)
    if config is not None:
        config.save_pretrained(folder)
    return folder


def load(state: dict, folder: Path) -> None:
    """torch's own loader (it unpickles everything: only for folders the test made or surgeon wrote from them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(folder))


def training_state(model, marker: Path | None = None) -> dict:
    """model + AdamW state after one step + a non-tensor train state (a Payload in it when ``marker``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([[1, 2, 3, 4]])
    model(ids, labels=ids).loss.backward()
    opt.step()
    model.zero_grad()
    msd, osd = get_state_dict(model, opt)
    train = {"step": 1, "tokens_seen": 4}
    if marker is not None:
        train["hook"] = Payload(marker)
    return {"model": msd, "optim": osd, "train_state": train}


def metadata(folder: Path):
    return FileSystemReader(str(folder)).read_metadata()  # the test's own folder only


def spans(folder: Path) -> dict[tuple[str, tuple | None], tuple[str, bytes]]:
    """Every stored item's (file, bytes), by (key, chunk offsets), as torch's reader locates them."""
    md, out = metadata(folder), {}
    for index, info in md.storage_data.items():
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            out[(index.fqn, None if index.offset is None else tuple(index.offset))] = (
                info.relative_path,
                f.read(info.length),
            )
    return out


def copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def rewrite_metadata(folder: Path, edit) -> None:
    """``edit(md)`` changes torch's Metadata of ``folder``, which is written back as dcp.save pickles it."""
    md = metadata(folder)
    edit(md)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(md, f)


def move_chunk(md, key: str, **changes) -> None:
    """The storage info of ``key``'s first chunk with ``changes`` (relative_path, offset, length)."""
    for index, info in list(md.storage_data.items()):
        if index.fqn == key:
            md.storage_data[index] = dataclasses.replace(info, **changes)
            return
    raise KeyError(key)


def fsdp_save_worker(rank: int, world: int, state_file: str, folder: str) -> None:
    """The parameters of ``state_file`` (a tiny Llama's state dict, made by the test) under FSDP2 (fully_shard
    per layer and at the root), saved by dcp.save from every rank. The module tree is rebuilt from the names
    (transformers is not imported in the ranks: it costs seconds each); FSDP2 sees the same parameters."""
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    root = nn.Module()
    for name, value in torch.load(state_file, weights_only=True).items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(value))
    mesh = init_device_mesh("cpu", (world,))
    for layer in root.model.layers.children():
        fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)
    dcp.save({"model": get_model_state_dict(root)}, checkpoint_id=folder)


# --- shared by test_dcp.py and test_ranks.py ---------------------------------------------------
def fresh():
    torch.manual_seed(1)  # other values than tiny_llama's: a load that skipped a tensor would show
    from transformers import LlamaForCausalLM

    from helpers.tiny import tiny_llama

    return LlamaForCausalLM(tiny_llama().config).eval()


def conditioned(block, atol=1e-4):
    for w in (block.q, block.k):  # (heads, d, D): orthonormal rows per head
        gram = w @ w.transpose(1, 2)
        assert torch.allclose(gram, torch.eye(w.shape[1]).expand_as(gram), atol=atol)
    heads, d, width = block.v.shape
    assert torch.allclose(block.v, torch.eye(heads * d, width).reshape(heads, d, width), atol=atol)


def same_maps(a, b):
    for role in ("q", "k", "v"):
        assert torch.allclose(getattr(a, role), getattr(b, role), atol=1e-5), role
