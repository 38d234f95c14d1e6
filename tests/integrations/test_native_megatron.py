"""Megatron-Core's own checkpoints and models (issues 29, 30), judged by Megatron's own loader and q/k/v split.

* **Stacked-layer tensors**: ``dist_checkpointing.save`` of a tiny GPTModel (torch_dist: ``.metadata``,
  ``.distcp`` files, ``common.pt``, ``metadata.json``) keys each layer's tensors without the layer's number,
  every layer stacked along axis 0 (``decoder.layers.self_attention.linear_qkv.weight`` is (2, 64, 32), one
  DCP chunk per layer); ``dcp_to_torch_save`` of the folder keeps them stacked. surgeon reads both the folder
  and that ``.pt``, layer by layer, numbered by their index in the stack; the result goes back through
  Megatron's ``dist_checkpointing.load`` (the ``.pt`` first through torch's ``torch_save_to_dcp``).
* **2 ranks = 1 process**: the torch_dist folder under reinit_checkpoint(distributed=True), byte for byte.
* **Tensor parallel in memory**: ``surgeon.reinit_`` on a GPTModel built with tensor_model_parallel_size=2
  on 2 gloo ranks is refused in one line naming tensor parallelism, nothing written.

Run in Megatron's venv (scripts/frameworks_check.sh megatron); elsewhere these tests skip.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
import torch

import surgeon
from surgeon.api import inspect_checkpoint, reinit_checkpoint
from surgeon.errors import CheckpointError, SurgeonError

from helpers.distributed import spawn
from helpers.frameworks import framework
from helpers.modules import assert_conditioned, assert_same

QKV = ("linear_qkv.weight", "linear_qkv.bias")
STACKED = [f"decoder.layers.self_attention.{p}" for p in QKV]
HINTS = {"num_heads": 4, "num_kv_heads": 2}


@pytest.fixture(scope="module")
def megatron():
    framework("megatron")
    from helpers.megatron import one_process

    with one_process():
        yield


def torch_state(folder: Path, file: Path) -> dict:
    """The folder's tensors as torch's own converter gives them (dcp_to_torch_save), then torch.load."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(file))
    return torch.load(file, weights_only=True)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("route", ["torch_dist folder", "dcp_to_torch_save .pt"])
def test_megatron_stacked_layers(tmp_path, megatron, route):
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    from helpers.megatron import gpt, load_dist, maps, save_dist

    model = gpt()
    before = [maps(model, i)[0] for i in range(2)]
    folder = save_dist(model, tmp_path / "iter_0000010")
    stored = torch_state(folder, tmp_path / "stored.pt")
    # what Megatron really writes: every layer stacked along axis 0, no per-layer key
    assert stored[STACKED[0]].shape == (2, 64, 32) and stored[STACKED[1]].shape == (2, 64)
    assert not any(k.startswith("decoder.layers.0.") for k in stored)
    if route == "torch_dist folder":  # heads from the arguments Megatron-LM keeps in common.pt
        source, output, hints = folder, tmp_path / "out", {}
    else:  # a plain state dict of the stacked tensors: the heads are hints
        source, output, hints = tmp_path / "stored.pt", tmp_path / "out.pt", HINTS

    found = inspect_checkpoint(source, **hints)
    assert [(b.module, b.layer, b.heads, b.kv_heads, b.head_dim) for b in found.blocks] == [
        (f"decoder.layers.{i}.self_attention", i, 4, 2, 8) for i in range(2)
    ]
    report = reinit_checkpoint(source, output=output, layers="1", seed=4, **hints)
    assert any("stacked-layer tensors under decoder.layers" in n for n in report.notes), report.notes
    if route == "torch_dist folder":
        assert "head counts from the model arguments saved in common.pt" in report.notes
    assert {(r.block.layer, r.role) for r in report.rows if r.heads_changed} == {(1, "q"), (1, "k"), (1, "v")}

    if route == "torch_dist folder":
        assert surgeon.verify(source, output).summary()
        out = torch_state(output, tmp_path / "out_state.pt")
        for name in ("common.pt", "metadata.json", ".metadata"):  # carried over as they are
            assert (output / name).read_bytes() == (folder / name).read_bytes(), name
        back = output
    else:
        out = torch.load(output, weights_only=True)
        back = tmp_path / "back"  # torch's way back to a DCP folder; Megatron's own side files beside it
        torch_save_to_dcp(str(output), str(back))
        for name in ("common.pt", "metadata.json"):
            shutil.copyfile(folder / name, back / name)
    changed = {k for k, v in stored.items() if isinstance(v, torch.Tensor) and bits(v) != bits(out[k])}
    assert changed == set(STACKED)
    for name in STACKED:  # layer 0's slice byte for byte, layer 1's new
        assert bits(out[name][0]) == bits(stored[name][0]) and bits(out[name][1]) != bits(stored[name][1])

    fresh = load_dist(gpt(seed=1), back)  # Megatron's own loader
    assert_same(maps(fresh, 0)[0], before[0])
    layer1, groups = maps(fresh, 1)
    assert groups == 2
    assert_conditioned(layer1, kv_groups=groups)

    # layer 1 of the stack is Megatron's own layer 1: the same draws as its per-layer state dict
    torch.save(model.state_dict(), tmp_path / "per_layer.pt")
    reinit_checkpoint(tmp_path / "per_layer.pt", output=tmp_path / "per_layer_out.pt", layers="1", seed=4, **HINTS)
    per_layer = torch.load(tmp_path / "per_layer_out.pt", weights_only=True)
    for p, name in zip(QKV, STACKED):
        assert bits(per_layer[f"decoder.layers.1.self_attention.{p}"]) == bits(out[name][1])


def test_megatron_torch_dist_two_ranks_equal_one_process(tmp_path, megatron):
    """Each of 2 ranks writes its own .distcp files of the stacked tensors: the folder 1 process writes."""
    from helpers.megatron import gpt, save_dist

    folder = save_dist(gpt(), tmp_path / "iter_0000010")
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]
    spawn(_ranks_worker, 2, tmp_path, str(folder), str(tmp_path / "two" / "out"))
    reinit_checkpoint(folder, output=tmp_path / "one" / "out", layers="1")
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("*") if p.is_file())
    for rel in files:
        assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "two" / rel).read_bytes(), rel


def _ranks_worker(rank: int, world: int, src: str, out: str) -> None:
    report = surgeon.reinit_checkpoint(src, output=out, layers="1", distributed=True)
    assert [r.block.layer for r in report.rows] == [1, 1, 1]


def test_stacked_layers_in_one_chunk_and_a_hostile_common_pt(tmp_path):
    """Plain torch (runs everywhere): dcp.save of stacked tensors writes both layers in one chunk, so layer 1's
    new values go into a chunk layer 0 shares, which keeps its bytes; the result equals the per-layer state
    dict's (the same draws). A common.pt whose pickle runs code is not read (the marker proves it), only named."""
    from helpers import dcp as dcp_helpers

    torch.manual_seed(0)
    stacked = {name: torch.randn(2, 64, 32) if name.endswith("weight") else torch.randn(2, 64) for name in STACKED}
    folder = dcp_helpers.save(stacked, tmp_path / "iter_0000010")
    assert all(len(e.chunks) == 1 for e in dcp_helpers.metadata(folder).state_dict_metadata.values())
    marker = tmp_path / "ran"
    torch.save({"args": dcp_helpers.Payload(marker)}, folder / "common.pt")
    report = reinit_checkpoint(folder, output=tmp_path / "out", layers="1", seed=4, **HINTS)
    assert not marker.exists()
    assert any(n.startswith("common.pt not read for head counts") for n in report.notes), report.notes
    out = {name: torch.empty_like(t) for name, t in stacked.items()}
    dcp_helpers.load(out, tmp_path / "out")  # torch's own loader

    per_layer = {name.replace("layers.", f"layers.{i}."): t[i] for name, t in stacked.items() for i in range(2)}
    torch.save(per_layer, tmp_path / "per_layer.pt")
    reinit_checkpoint(tmp_path / "per_layer.pt", output=tmp_path / "per_layer_out.pt", layers="1", seed=4, **HINTS)
    expected = torch.load(tmp_path / "per_layer_out.pt", weights_only=True)
    for name in STACKED:
        assert bits(out[name][0]) == bits(stacked[name][0])
        assert bits(out[name][1]) == bits(expected[name.replace("layers.", "layers.1.")]) != bits(stacked[name][1])


def test_stacked_layers_that_disagree_are_refused(tmp_path):
    """Stacked tensors of one stack with different numbers of layers: which slice is which layer is unknown."""
    state = {
        "decoder.layers.self_attention.linear_qkv.weight": torch.zeros(2, 64, 32),
        "decoder.layers.mlp.linear_fc1.weight": torch.zeros(3, 128, 32),
    }
    torch.save(state, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="do not agree on the number of layers"):
        inspect_checkpoint(tmp_path / "model.pt", **HINTS)


# --------------------------------------------------------------------------- Megatron-LM legacy (pre-Core)


def legacy_load(path: Path) -> dict:
    """torch.load of a legacy model_optim_rng.pt (its args an argparse.Namespace); the context's exit removes what
    it was given, so never Megatron's own registration of Namespace (made at its import)."""
    allowed = [] if argparse.Namespace in torch.serialization.get_safe_globals() else [argparse.Namespace]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


def tensors_of(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(tensors_of(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("version, groups", [(3.0, 2), (2.0, 4), (None, 4)], ids=["v3 GQA", "v2", "no version: 0"])
def test_megatron_legacy_nested_query_key_value(tmp_path, megatron, version, groups):
    """Megatron-LM's legacy model_optim_rng.pt: the model as nested dicts (language_model / embedding / encoder),
    query_key_value packed as its checkpoint_version says. megatron-core 0.16 ships no legacy model (no
    megatron/legacy): the legacy checkpoint is Megatron-Core's GPTModel's weights under the legacy names, and the
    result is judged by Megatron-Core's own split after the version's own conversion (checkpointing.py)."""
    from helpers.megatron import core_state, gpt, legacy_model, maps, transpose_first_dim

    model = gpt(groups=groups)
    before = [maps(model, i)[0] for i in range(2)]
    legacy = legacy_model(model.state_dict())
    encoder = legacy["language_model"]["encoder"]
    qkv = [f"layers.{i}.self_attention.query_key_value.{p}" for i in range(2) for p in ("weight", "bias")]
    if version is None:  # version 0 stored the rows as [3, heads, d]: the inverse of Megatron-LM's conversion
        for key in qkv:
            t = encoder[key]
            encoder[key] = t.view(4, 3, 8, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()
    args = argparse.Namespace(
        num_attention_heads=4, num_query_groups=groups, group_query_attention=groups != 4, kv_channels=8
    )
    ckpt = {"args": args, "iteration": 5, "model": legacy}
    if version is not None:
        ckpt["checkpoint_version"] = version
    torch.save(ckpt, tmp_path / "model_optim_rng.pt")

    found = inspect_checkpoint(tmp_path / "model_optim_rng.pt")
    assert [(b.module, b.heads, b.kv_heads, b.head_dim) for b in found.blocks] == [
        (f"language_model.encoder.layers.{i}.self_attention", 4, groups, 8) for i in range(2)
    ]
    reinit_checkpoint(tmp_path / "model_optim_rng.pt", output=tmp_path / "out.pt", layers="1", seed=4)
    out = legacy_load(tmp_path / "out.pt")
    assert out.keys() == ckpt.keys() and vars(out["args"]) == vars(args) and out["iteration"] == 5
    new, old = tensors_of(out["model"]), tensors_of(legacy)
    assert new.keys() == old.keys()  # the nesting kept
    assert {k for k in old if bits(old[k]) != bits(new[k])} == {f"language_model.encoder.{k}" for k in qkv[2:]}

    encoder = out["model"]["language_model"]["encoder"]
    if version is None:  # Megatron-LM's own conversion of version 0 on load (fix_query_key_value_ordering)
        for key in qkv:
            encoder[key] = transpose_first_dim(encoder[key], 4, num_splits_first=True)
    fresh = gpt(seed=1, groups=groups)
    fresh.load_state_dict(core_state(out["model"], fresh.state_dict()))
    assert_same(maps(fresh, 0)[0], before[0])
    layer1, rep = maps(fresh, 1)
    assert rep == 4 // groups
    assert_conditioned(layer1, kv_groups=rep)


@pytest.mark.parametrize("version", [1.0, 4.0, "3"])
def test_megatron_legacy_versions_not_known_are_refused(tmp_path, version):
    """Version 1.0 stored query_key_value's rows as [heads, d, 3]: no packing surgeon writes; later ones unknown."""
    legacy = {"language_model": {"encoder": {"layers.0.self_attention.query_key_value.weight": torch.randn(96, 32)}}}
    args = argparse.Namespace(num_attention_heads=4, kv_channels=8)
    torch.save({"args": args, "checkpoint_version": version, "model": legacy}, tmp_path / "model_optim_rng.pt")
    with pytest.raises(SurgeonError, match=f"checkpoint_version {version!r}: surgeon knows how query_key_value"):
        reinit_checkpoint(tmp_path / "model_optim_rng.pt", output=tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


# --------------------------------------------------------------------------- tensor parallel in memory


def test_megatron_tensor_parallel_refused(tmp_path):
    framework("megatron")
    spawn(_tensor_parallel_worker, 2, tmp_path, str(tmp_path))
    for rank in range(2):
        seen = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert "tensor parallel" in seen["error"] and seen["unchanged"], seen


def _tensor_parallel_worker(rank: int, world: int, tmp: str) -> None:
    from megatron.core import parallel_state

    from helpers.megatron import gpt, on_cpu

    on_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = gpt()
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.shape == (32, 32) and qkv.tensor_model_parallel  # this rank's half of the query groups
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        surgeon.reinit_(model, seed=4)
        error = ""
    except SurgeonError as exc:
        error = str(exc)
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    torch.save({"error": error, "unchanged": unchanged}, Path(tmp) / f"rank{rank}.pt")
    parallel_state.destroy_model_parallel()
