"""surgeon reinit over 2 ranks of torchrun (gloo, CPU), and reinit_checkpoint(distributed=True) in a script's ranks.

Inputs are real: a DCP folder written by 2 FSDP2 ranks (every parameter cut in two, one ``.distcp`` file per
rank) and a tiny Llama saved by transformers in 3 safetensors shards. The output of 2 ranks is judged through
torch's own readers and the model's forward (heads conditioned, other layers as they were), and equals one
process's output file for file, byte for byte. A rank that fails leaves no output and no staging folder.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import surgeon
from surgeon.errors import OptionError

from helpers import dcp as dcp_helpers
from helpers.distributed import spawn
from helpers.observe import observe
from helpers.paths import ROOT
from helpers.tiny import tiny_llama

Q = "model.layers.{}.self_attn.q_proj.weight"


def torchrun(*args, ok: bool = True) -> subprocess.CompletedProcess:
    """``surgeon`` under ``torchrun --nproc-per-node 2`` (its own module, as a user runs it)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "surgeon"]
    result = subprocess.run(
        [*cmd, *map(str, args)], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT, check=False
    )
    if ok:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def wrote(run: subprocess.CompletedProcess) -> dict[int, str]:
    """rank -> the files the report says it wrote (the report is printed once, by rank 0)."""
    found = re.findall(r"rank (\d) of 2 wrote (.*)$", run.stdout, re.M)
    assert len(found) == 2, run.stdout
    return {int(rank): files.strip() for rank, files in found}


def same_tree(a: Path, b: Path) -> None:
    """The same files with the same bytes (outputs of the same name: the model card names its folder)."""
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    torch.save(tiny_llama().state_dict(), tmp / "state.pt")
    spawn(dcp_helpers.fsdp_save_worker, 2, tmp, str(tmp / "state.pt"), str(tmp / "ckpt"))
    tiny_llama().config.save_pretrained(tmp / "ckpt")
    return tmp / "ckpt"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards") / "llama"
    tiny_llama().save_pretrained(folder, max_shard_size="160KB")
    assert len(list(folder.glob("*.safetensors"))) == 3  # 3 files over 2 ranks: rank 0 gets two
    return folder


def test_dcp_two_ranks_equal_one_process(fsdp, tmp_path, cli, one_thread):
    run = torchrun("reinit", fsdp, "-o", tmp_path / "two" / "out", "--layers", "0,2")
    assert wrote(run) == {0: "__0_0.distcp", 1: "__1_0.distcp"}
    model, loaded = tiny_llama(), dcp_helpers.fresh()
    state = {"model": loaded.state_dict()}
    dcp_helpers.load(state, tmp_path / "two" / "out")  # torch's own reader
    loaded.load_state_dict(state["model"])
    maps, before = observe(loaded), observe(model)
    dcp_helpers.conditioned(maps["model.layers.0.self_attn"])
    dcp_helpers.conditioned(maps["model.layers.2.self_attn"])
    dcp_helpers.same_maps(maps["model.layers.1.self_attn"], before["model.layers.1.self_attn"])
    spans, out = dcp_helpers.spans(fsdp), dcp_helpers.spans(tmp_path / "two" / "out")
    moved = {spans[k][0] for k in spans if spans[k] != out[k]}
    assert moved == {"__0_0.distcp", "__1_0.distcp"}  # each rank's half of a projection, in its own file
    cli("reinit", fsdp, "-o", tmp_path / "one" / "out", "--layers", "0,2")
    same_tree(tmp_path / "two" / "out", tmp_path / "one" / "out")
    assert not list((tmp_path / "two").glob(".*surgeon-tmp"))


def test_sharded_safetensors_two_ranks_equal_one_process(shards, tmp_path, cli, one_thread):
    run = torchrun("reinit", shards, "-o", tmp_path / "two" / "out", "--seed", "3")
    names = sorted(p.name for p in shards.glob("*.safetensors"))
    assert wrote(run) == {0: f"{names[0]}, {names[2]}", 1: names[1]}
    state = {}
    for name in names:
        state.update(load_file(tmp_path / "two" / "out" / name))  # the reference reader
    loaded = dcp_helpers.fresh()
    loaded.load_state_dict(state, strict=False)
    for block in observe(loaded).values():
        dcp_helpers.conditioned(block)
    cli("reinit", shards, "-o", tmp_path / "one" / "out", "--seed", "3")
    same_tree(tmp_path / "two" / "out", tmp_path / "one" / "out")


def test_a_failing_rank_leaves_nothing(shards, tmp_path):
    """NaN in a projection only rank 1 computes, and --keep-scale needs its old values: rank 1 refuses while
    rank 0 has written its shards into the staging folder; neither the output nor the staging folder is left."""
    src = tmp_path / "src"
    src.mkdir()
    names = sorted(p.name for p in shards.glob("*.safetensors"))
    for p in shards.iterdir():
        (src / p.name).write_bytes(p.read_bytes())
    second = load_file(src / names[1])
    bad = next(n for n in second if n.endswith("q_proj.weight"))
    second[bad][0, 0] = float("nan")
    save_file(second, src / names[1], metadata={"format": "pt"})
    run = torchrun("reinit", src, "-o", tmp_path / "out", "--keep-scale", ok=False)
    assert run.returncode != 0
    ours = sorted(line for line in run.stderr.splitlines() if line.startswith("surgeon: error: "))
    assert len(ours) == 2 and "another rank failed" in ours[0] and "NaN or Inf" in ours[1], run.stderr
    assert not [line for line in run.stderr.splitlines() if line.strip().startswith("File") and "/surgeon/" in line]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no staging folder


def _api_worker(rank: int, world: int, src: str, out: str) -> None:
    """A training script's ranks (their process group already made) call the API, all with the same arguments."""
    report = surgeon.reinit_checkpoint(src, output=out, layers="1", distributed=True)
    assert [r.block.layer for r in report.rows] == [1, 1, 1]  # every rank gets the whole report


def test_api_in_a_training_scripts_ranks(fsdp, tmp_path, cli, one_thread):
    spawn(_api_worker, 2, tmp_path, str(fsdp), str(tmp_path / "two" / "out"))
    cli("reinit", fsdp, "-o", tmp_path / "one" / "out", "--layers", "1")
    same_tree(tmp_path / "two" / "out", tmp_path / "one" / "out")
    loaded = dcp_helpers.fresh()
    state = {"model": loaded.state_dict()}
    dcp_helpers.load(state, tmp_path / "two" / "out")
    loaded.load_state_dict(state["model"])
    dcp_helpers.conditioned(observe(loaded)["model.layers.1.self_attn"])


@pytest.mark.parametrize(
    "kwargs, match",
    [({"in_place": True}, "in_place=True"), ({"push": "me/x"}, "push_to_hub")],
    ids=["in-place", "push"],
)
def test_what_cannot_run_over_ranks_is_refused(fsdp, kwargs, match, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_x")  # a push checks for a token before anything else
    with pytest.raises(OptionError, match=match):
        surgeon.reinit_checkpoint(fsdp, distributed=True, **kwargs)


def test_a_single_file_is_refused_under_torchrun(tmp_path):
    """A lone weight file's output is a file, not a folder of per-rank files: every rank refuses in one line."""
    tiny_llama().save_pretrained(tmp_path / "m")
    before = sorted(p.name for p in (tmp_path / "m").iterdir())
    run = torchrun("reinit", tmp_path / "m" / "model.safetensors", "-o", tmp_path / "out.safetensors", ok=False)
    assert run.returncode != 0
    ours = [line for line in run.stderr.splitlines() if line.startswith("surgeon: error: ")]
    assert len(ours) == 2 and all("a DCP folder or a sharded safetensors folder" in line for line in ours), run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == before
