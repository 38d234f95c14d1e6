"""OLMo-core checkpoints written by OLMo-core itself (issues 29, 30), judged by OLMo-core: the result is loaded
back by its own loader (``load_model_and_optim_state`` into a fresh model and a fresh AdamW, or safetensors /
``torch.load`` of its unsharded export into ``load_state_dict``) and the chosen layers' heads are read through
its own projection and head split (``Attention._prepare_qkv``); every other tensor, the optimizer state and the
non-tensor entries must be unchanged, byte for byte where they are stored.

Built with OLMo-core's own code, on the CPU: ``save_model_and_optim_state`` of a model whose AdamW stepped once,
the Trainer's own checkpoint folder (``stepN/`` with ``model_and_optim/``, ``train/rank0.pt``, ``.metadata.json``
and its ConfigSaverCallback's ``config.json``, from a real ``Trainer.fit`` of two steps), the same model saved
from 2 gloo ranks under FSDP2 (OLMo-core's ``apply_fsdp``), and ``unshard_checkpoint``'s .pt and safetensors.
Run in OLMo-core's venv (scripts/frameworks_check.sh, SURGEON_FRAMEWORK=olmo); skipped elsewhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from test_frameworks_native import olmo_maps, olmo_model  # OLMo-core's builder; its own q/k/v split

import _dcp
from _frameworks import framework
from _modules import assert_conditioned, assert_same
from conftest import expect_cli_error

ROOT = Path(__file__).resolve().parents[1]
HINTS = ("--num-heads", "4", "--num-kv-heads", "2")
PROJECTIONS = ("w_q", "w_k", "w_v")


def stepped(seed=0):
    """An OLMo-core model (4 heads, 2 key/value heads, 2 layers) and a torch AdamW that has stepped once."""
    model = olmo_model(seed).train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.arange(1, 17).reshape(2, 8) % 64
    model(ids).float().logsumexp(-1).mean().backward()
    optim.step()
    optim.zero_grad()
    return model.eval(), optim


def torchrun(*args) -> subprocess.CompletedProcess:
    """``surgeon`` under ``torchrun --nproc-per-node 2``, as a user runs it (tests/test_ranks.py imports
    transformers, which OLMo-core's venv does not have)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "surgeon"]
    run = subprocess.run([*cmd, *map(str, args)], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def same_tree(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def olmo_save(folder: Path, model, optim) -> Path:
    from olmo_core.distributed.checkpoint import save_model_and_optim_state

    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming ... a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        save_model_and_optim_state(str(folder), model, optim)
    return folder


def olmo_load(folder: Path, seed: int):
    """A fresh model and AdamW (other values than the saved ones), filled by OLMo-core's own loader."""
    from olmo_core.distributed.checkpoint import load_model_and_optim_state

    model = olmo_model(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        load_model_and_optim_state(str(folder), model, optim)
    return model, optim


def same_optim(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key, state in a["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["state"][key][name]), (key, name)


def judge(src: Path, out: Path, layers: set[int]) -> None:
    """``out`` (a DCP folder surgeon wrote from ``src``), loaded by OLMo-core: ``layers`` conditioned through
    its own split, the other layers, every other tensor and the optimizer state as ``src`` loads them; in
    the files, every stored item but the chosen projections' chunks byte for byte."""
    before, before_optim = olmo_load(src, seed=1)
    after, after_optim = olmo_load(out, seed=2)
    for layer in range(2):
        if layer in layers:
            maps, groups = olmo_maps(after, layer)
            assert groups == 2
            assert_conditioned(maps, kv_groups=groups)
        else:
            assert_same(olmo_maps(after, layer)[0], olmo_maps(before, layer)[0])
    chosen = {f"blocks.{i}.attention.{w}.weight" for i in layers for w in PROJECTIONS}
    a, b = before.state_dict(), after.state_dict()
    assert {k for k in a if not torch.equal(a[k], b[k])} == chosen
    same_optim(before_optim.state_dict(), after_optim.state_dict())
    old, new = _dcp.spans(src), _dcp.spans(out)  # torch's own reader, on folders the test made
    assert old.keys() == new.keys()
    assert {key for key in old if old[key] != new[key]} == {(f"model.{k}", (0, 0)) for k in chosen}
    assert any(key.startswith("optim.") for key, _ in old)  # the optimizer's entries were there, and kept


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``save_model_and_optim_state`` of the model and its stepped AdamW (no config beside it)."""
    framework("olmo")
    return olmo_save(tmp_path_factory.mktemp("saved") / "ckpt", *stepped())


def test_save_model_and_optim_state(saved, tmp_path, cli, one_thread):
    inspected = cli("inspect", saved, *HINTS).output
    assert "blocks  self  0-1         4   2         8  separate  w_q.weight, w_k.weight, w_v.weight" in inspected
    cli("reinit", saved, "-o", tmp_path / "out", "--layers", "1", "--seed", "5", *HINTS)
    assert "verified" in cli("verify", saved, tmp_path / "out", *HINTS).output
    judge(saved, tmp_path / "out", {1})


def test_without_heads_the_refusal_names_the_hints(saved, tmp_path, cli):
    line = expect_cli_error(cli, saved, "reinit", saved, "-o", tmp_path / "out", match="--num-heads")
    assert "--num-kv-heads" in line
    assert not (tmp_path / "out").exists()
