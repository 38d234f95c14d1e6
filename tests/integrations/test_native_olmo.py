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

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from helpers import dcp as dcp_helpers
from helpers.cli import expect_cli_error
from helpers.distributed import spawn
from helpers.frameworks import framework, olmo_maps, olmo_model  # OLMo-core's builder; its own q/k/v split
from helpers.modules import assert_conditioned, assert_same
from helpers.paths import ROOT

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
    """``surgeon`` under ``torchrun --nproc-per-node 2``, as a user runs it (tests/write/test_ranks.py imports
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


def olmo_load(folder: Path, seed: int, trainer: bool = False):
    """A fresh model and AdamW (other values than the saved ones), filled by OLMo-core's own loader; ``trainer``:
    OLMo-core's own AdamW, whose state its train module saves flattened."""
    from olmo_core.distributed.checkpoint import load_model_and_optim_state
    from olmo_core.optim import AdamWConfig

    model = olmo_model(seed)
    optim = AdamWConfig(lr=1e-3).build(model) if trainer else torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        load_model_and_optim_state(str(folder), model, optim, flatten_optimizer_state=trainer)
    return model, optim


def same_optim(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for key, state in a["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["state"][key][name]), (key, name)


def judge(src: Path, out: Path, layers: set[int], trainer: bool = False) -> None:
    """``out`` (a DCP folder surgeon wrote from ``src``), loaded by OLMo-core: ``layers`` conditioned through
    its own split, the other layers, every other tensor and the optimizer state as ``src`` loads them; in
    the files, every stored item but the chosen projections' chunks byte for byte."""
    before, before_optim = olmo_load(src, seed=1, trainer=trainer)
    after, after_optim = olmo_load(out, seed=2, trainer=trainer)
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
    old, new = dcp_helpers.spans(src), dcp_helpers.spans(out)  # torch's own reader, on folders the test made
    assert old.keys() == new.keys()
    assert {key for key, _ in old if old[key, _] != new[key, _]} == {f"model.{k}" for k in chosen}
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


# --------------------------------------------------------------------------- the Trainer's checkpoint folder


@pytest.fixture(scope="module")
def trainer_step(tmp_path_factory):
    """stepN/ as OLMo-core's Trainer writes it: a real fit of 2 steps on a token file, its Checkpointer at step 2
    and its ConfigSaverCallback's config.json (the experiment's config: model, train module, trainer)."""
    framework("olmo")
    import numpy as np
    from olmo_core.config import Config
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import CheckpointerCallback, ConfigSaverCallback
    from olmo_core.train.train_module import TransformerTrainModuleConfig

    @dataclasses.dataclass
    class Experiment(Config):  # what OLMo-core's scripts give ConfigSaverCallback: the whole run's config
        model: TransformerConfig
        train_module: TransformerTrainModuleConfig
        trainer: TrainerConfig

    tmp = tmp_path_factory.mktemp("trainer")
    np.random.RandomState(0).randint(1, 60, size=4096).astype(np.uint16).tofile(tmp / "tokens.npy")
    torch.manual_seed(0)
    model_config = TransformerConfig.llama_like(d_model=32, vocab_size=64, n_layers=2, n_heads=4, n_kv_heads=2)
    dataset = NumpyFSLDatasetConfig(
        paths=[str(tmp / "tokens.npy")],
        sequence_length=16,
        tokenizer=TokenizerConfig(vocab_size=64, eos_token_id=0, pad_token_id=63),
        work_dir=str(tmp / "work"),
    ).build()
    module_config = TransformerTrainModuleConfig(
        rank_microbatch_size=32, max_sequence_length=16, optim=AdamWConfig(lr=1e-3)
    )
    train_module = module_config.build(model_config.build(init_device="cpu"), device=torch.device("cpu"))
    checkpointer = CheckpointerCallback(save_interval=2, ephemeral_save_interval=None, save_async=False)
    trainer_config = TrainerConfig(
        save_folder=str(tmp / "run"),
        work_dir=str(tmp / "work"),
        device="cpu",
        max_duration=Duration.steps(2),
        callbacks={"checkpointer": checkpointer, "config_saver": ConfigSaverCallback()},
    )
    data_loader = NumpyDataLoaderConfig(global_batch_size=32, seed=0, work_dir=str(tmp / "work")).build(dataset)
    trainer = trainer_config.build(train_module, data_loader)
    trainer.callbacks["config_saver"].config = Experiment(model_config, module_config, trainer_config).as_config_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit()
    step = tmp / "run" / "step2"
    assert sorted(p.name for p in step.iterdir()) == [
        ".metadata.json",
        "config.json",
        "data_paths.txt",
        "model_and_optim",
        "train",
    ]
    return step


@pytest.mark.parametrize("where", ["stepN", "stepN/model_and_optim"])
def test_trainer_checkpoint_heads_from_its_config(trainer_step, where, tmp_path, cli, one_thread):
    """No hints: the heads come from the run's config.json beside model_and_optim/."""
    src = trainer_step if where == "stepN" else trainer_step / "model_and_optim"
    inspected = cli("inspect", src).output
    assert "blocks  self  0-1         4   2         8  separate" in inspected
    cli("reinit", src, "-o", tmp_path / "out", "--layers", "0", "--seed", "2")
    assert "verified" in cli("verify", src, tmp_path / "out").output
    if where == "stepN":
        for rel in ("config.json", ".metadata.json", "data_paths.txt", "train/rank0.pt"):
            assert (tmp_path / "out" / rel).read_bytes() == (trainer_step / rel).read_bytes(), rel
        judge(trainer_step / "model_and_optim", tmp_path / "out" / "model_and_optim", {0}, trainer=True)
        # the same folder over 2 torchrun ranks: model_and_optim/'s data files dealt out, the rest shared
        torchrun("reinit", src, "-o", tmp_path / "two" / "out", "--layers", "0", "--seed", "2")
        same_tree(tmp_path / "two" / "out", tmp_path / "out")
    else:
        judge(src, tmp_path / "out", {0}, trainer=True)


def test_trainer_checkpoint_loaded_by_its_trainer(trainer_step, tmp_path, cli, one_thread):
    """The whole stepN/ output through OLMo-core's Checkpointer.load: the train state as it was saved."""
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train.checkpoint import Checkpointer
    from olmo_core.train.train_module import TransformerTrainModuleConfig

    cli("reinit", trainer_step, "-o", tmp_path / "out", "--layers", "1")
    assert Checkpointer.dir_is_checkpoint(tmp_path / "out")
    states = []
    for folder in (trainer_step, tmp_path / "out"):
        config = TransformerConfig.llama_like(d_model=32, vocab_size=64, n_layers=2, n_heads=4, n_kv_heads=2)
        module = TransformerTrainModuleConfig(
            rank_microbatch_size=32, max_sequence_length=16, optim=AdamWConfig(lr=1e-3)
        ).build(config.build(init_device="cpu"), device=torch.device("cpu"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            train_state = Checkpointer(work_dir=tmp_path / "work").load(folder, module)
        states.append((train_state, module.model))
    (old, before), (new, after) = states
    assert new["global_step"] == old["global_step"] == 2  # (its RNG states are numpy arrays: the bytes, above)
    assert new["data_loader"] == old["data_loader"] and new["global_train_tokens_seen"] > 0
    assert_same(olmo_maps(after, 0)[0], olmo_maps(before, 0)[0])
    maps, groups = olmo_maps(after, 1)
    assert_conditioned(maps, kv_groups=groups)


def test_heads_per_layer_from_block_overrides(tmp_path, cli, one_thread):
    """block_overrides gives layer 1 2 heads of 16 (1 key/value head) where layer 0 has 4 of 8 (2): the same
    tensor shapes, so only the config tells them apart (read as 4 of 8, each of its heads would be two
    unrelated orthonormal halves); read from the model's own config (as_config_dict) as config.json."""
    framework("olmo")
    from olmo_core.nn.transformer import TransformerConfig

    config = TransformerConfig.llama_like(d_model=32, vocab_size=64, n_layers=2, n_heads=4, n_kv_heads=2)
    attention = dataclasses.replace(config.block.sequence_mixer, n_heads=2, n_kv_heads=1)
    config.block_overrides = {1: dataclasses.replace(config.block, sequence_mixer=attention)}
    torch.manual_seed(0)
    model = config.build(init_device="cpu")
    olmo_save(tmp_path / "ckpt", model, torch.optim.AdamW(model.parameters()))
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config.as_config_dict()))
    inspected = cli("inspect", tmp_path / "ckpt").output
    assert "blocks  self  0           4   2         8  separate" in inspected
    assert "blocks  self  1           2   1        16  separate" in inspected
    cli("reinit", tmp_path / "ckpt", "-o", tmp_path / "out")
    from olmo_core.distributed.checkpoint import load_model_and_optim_state

    torch.manual_seed(1)
    fresh = config.build(init_device="cpu")
    load_model_and_optim_state(str(tmp_path / "out"), fresh)
    for layer, groups in ((0, 2), (1, 2)):
        maps, found = olmo_maps(fresh, layer)
        assert found == groups
        assert_conditioned(maps, kv_groups=found)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c["model"]["block"]["sequence_mixer"].update(n_heads="4"), "model.block.sequence_mixer.n_heads"),
        (lambda c: c["model"]["block"]["sequence_mixer"].update(n_kv_heads=[2]), "sequence_mixer.n_kv_heads"),
        (lambda c: c["model"].update(d_model=True), "model.d_model"),
        (lambda c: c["model"]["block"].pop("sequence_mixer"), "model.block.sequence_mixer"),
        (
            lambda c: c["model"].update(block_pattern=["a"], block={"a": c["model"]["block"]}, n_layers=10**9),
            "n_layers",
        ),
        (lambda c: c["model"].update(block_overrides={"x": {}}), "block_overrides"),
        (lambda c: c["model"].update(block_overrides={"²": {}}), "block_overrides"),  # isdigit(), not int()
    ],
    ids=[
        "heads-string",
        "kv-list",
        "width-bool",
        "no-attention-config",
        "pattern-of-1e9-layers",
        "override-key",
        "override-superscript",
    ],
)
def test_a_bad_olmo_config_is_refused_in_one_line(trainer_step, tmp_path, cli, edit, match):
    src = tmp_path / "step2"
    shutil.copytree(trainer_step, src)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))
    expect_cli_error(cli, tmp_path, "reinit", src, "-o", tmp_path / "out", match=match)


# --------------------------------------------------------------------------- 2 ranks under FSDP2


def fsdp_save_worker(rank: int, world: int, folder: str) -> None:
    """The model under FSDP2 by OLMo-core's own apply_fsdp on 2 gloo ranks, one AdamW step, then OLMo-core's
    save_model_and_optim_state from every rank (each projection cut in two, each rank its own files)."""
    from torch.distributed.device_mesh import init_device_mesh

    model = olmo_model(0)  # the same seed on every rank: the same model
    model.apply_fsdp(dp_mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.arange(1, 17).reshape(2, 8) % 64
    model(ids).float().logsumexp(-1).mean().backward()
    optim.step()
    olmo_save(Path(folder), model, optim)


@pytest.fixture(scope="module")
def fsdp_saved(tmp_path_factory):
    framework("olmo")
    tmp = tmp_path_factory.mktemp("fsdp")
    spawn(fsdp_save_worker, 2, tmp, str(tmp / "ckpt"))
    return tmp / "ckpt"


def test_two_ranks_fsdp2_one_process_and_torchrun_agree(fsdp_saved, tmp_path, cli, one_thread):
    md = dcp_helpers.metadata(fsdp_saved)  # the test's own folder: OLMo-core's files, two ranks' halves
    key = "model.blocks.0.attention.w_q.weight"
    assert len(md.state_dict_metadata[key].chunks) == 2
    files = sorted(p.name for p in fsdp_saved.glob("*.distcp"))
    assert {name.split("_")[2] for name in files} == {"0", "1"}  # __{rank}_{n}.distcp: both ranks wrote
    run = torchrun("reinit", fsdp_saved, "-o", tmp_path / "two" / "out", "--layers", "0", *HINTS)
    found = dict(re.findall(r"rank (\d) of 2 wrote (.*)$", run.stdout, re.M))
    assert sorted(f for names in found.values() for f in names.strip().split(", ")) == files, run.stdout
    cli("reinit", fsdp_saved, "-o", tmp_path / "one" / "out", "--layers", "0", *HINTS)
    same_tree(tmp_path / "two" / "out", tmp_path / "one" / "out")
    judge(fsdp_saved, tmp_path / "two" / "out", {0})


# --------------------------------------------------------------------------- unshard_checkpoint's export


@pytest.mark.parametrize("heads", ["hints", "the run's config"])
@pytest.mark.parametrize("suffix", ["pt", "safetensors"])
def test_unshard_checkpoint_export(trainer_step, tmp_path, cli, suffix, heads, one_thread):
    """OLMo-core's unshard_checkpoint of the Trainer's model_and_optim/ (.pt: model.pt and optim.pt; safetensors:
    model.safetensors alone). Without a config or hints the refusal names the hints."""
    from olmo_core.distributed.checkpoint import unshard_checkpoint

    model_file, _ = unshard_checkpoint(
        trainer_step / "model_and_optim", tmp_path / "export", use_safetensors=suffix == "safetensors", quiet=True
    )
    export = tmp_path / "export"
    assert sorted(p.name for p in export.iterdir()) == (
        ["model.pt", "optim.pt"] if suffix == "pt" else [model_file.name]
    )
    line = expect_cli_error(cli, export, "reinit", export, "-o", tmp_path / "out", match="--num-heads")
    assert "--num-kv-heads" in line
    given = HINTS if heads == "hints" else ("--config", trainer_step / "config.json")
    cli("reinit", export, "-o", tmp_path / "out", "--layers", "1", *given)
    assert "verified" in cli("verify", export, tmp_path / "out", *given).output
    if suffix == "pt":
        assert (tmp_path / "out" / "optim.pt").read_bytes() == (export / "optim.pt").read_bytes()
        old = torch.load(model_file, weights_only=True)
        new = torch.load(tmp_path / "out" / model_file.name, weights_only=True)
    else:
        from safetensors.torch import load_file

        old, new = load_file(model_file), load_file(tmp_path / "out" / model_file.name)
    assert {k for k in old if not torch.equal(old[k], new[k])} == {
        f"blocks.1.attention.{w}.weight" for w in PROJECTIONS
    }
    before, after = olmo_model(seed=1), olmo_model(seed=2)
    before.load_state_dict(old)  # OLMo-core's modules' own loader
    after.load_state_dict(new)
    assert_same(olmo_maps(after, 0)[0], olmo_maps(before, 0)[0])
    maps, groups = olmo_maps(after, 1)
    assert_conditioned(maps, kv_groups=groups)


def test_fused_v2_attention_w_qkv(tmp_path, cli, one_thread):
    """OLMo-core's fused_v2 attention keeps one w_qkv that its own forward splits (q_dim, kv_dim, kv_dim):
    [Q | K | V] with 2 key/value heads, judged through its own _prepare_qkv after load_state_dict."""
    framework("olmo")
    from olmo_core.nn.attention import AttentionType
    from olmo_core.nn.transformer import TransformerConfig

    config = TransformerConfig.llama_like(d_model=32, vocab_size=64, n_layers=2, n_heads=4, n_kv_heads=2)
    fused = dataclasses.replace(config.block.sequence_mixer, name=AttentionType.fused_v2)
    config.block = dataclasses.replace(config.block, sequence_mixer=fused)

    def build(seed):
        torch.manual_seed(seed)
        return config.build(init_device="cpu").eval()

    model = build(0)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    torch.save(state, tmp_path / "model.pt")
    assert (
        "blocks  self  0-1         4   2         8  fused w_qkv" in cli("inspect", tmp_path / "model.pt", *HINTS).output
    )
    cli("reinit", tmp_path / "model.pt", "-o", tmp_path / "out.pt", "--layers", "0", *HINTS)
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert {k for k in state if not torch.equal(state[k], out[k])} == {"blocks.0.attention.w_qkv.weight"}
    fresh = build(1)
    fresh.load_state_dict(out)
    maps, groups = olmo_maps(fresh, 0)
    assert groups == 2
    assert_conditioned(maps, kv_groups=groups)
    assert_same(olmo_maps(fresh, 1)[0], olmo_maps(model, 1)[0])
