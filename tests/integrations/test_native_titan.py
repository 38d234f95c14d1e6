"""torchtitan 0.3 models in memory (issue 29), built and initialized by torchtitan itself (tests/helpers/titan.py).

* Flex attention (its language models' attention on CPU) is seen by the forward probe, with the inputs its
  trainer passes or with none (surgeon builds them with the model's own get_attention_masks), and its fused
  in-memory ``qkv_linear.wqkv`` (per KV head [its query heads | key | value]) is read right: judged by
  torchtitan's own qkv_linear split, and equal, bit for bit, to the checkpoint route on the state dict its
  hook saves (wq/wk/wv), loaded back by its own hook into a fresh model whose forward gives the same logits.
* FSDP2 (fully_shard per block and at the root) on 2 gloo ranks gives the bits of one process.
* Tensor parallelism (wqkv column-wise, wo row-wise): refused in one line naming it and num_heads, nothing
  changed; with the heads passed, the layout comes from the parameter names and the global result is one process's.
"""

from __future__ import annotations

import pytest
import torch

import surgeon
from surgeon.api import inspect_checkpoint, reinit_checkpoint

from helpers.distributed import spawn
from helpers.frameworks import framework
from helpers.modules import Maps, _solve, assert_conditioned, assert_same, probe
from helpers.titan import SEED, build, full_state, heads, hf_adapter, inputs, logits, manager, save_steps


@pytest.fixture(autouse=True)
def titan():
    framework("titan")


def titan_maps(model, layer: int) -> tuple[Maps, int]:
    """Per-head maps from torchtitan's own qkv_linear (projection and split, (B, T, heads, d)); key/value heads
    repeated to the query heads as its GQA reads them (query head h uses key/value head h // (H / KV))."""
    qkv = model.layers[str(layer)].attention.qkv_linear
    width = model.config.dim
    x = probe(width, rows=width + 16)
    with torch.no_grad():
        q, k, v = (t.transpose(1, 2).float() for t in qkv(x))
    rep = q.shape[1] // k.shape[1]
    (qw, qb), (kw, kb), (vw, vb) = (_solve(x, t.repeat_interleave(rep, dim=1)) for t in (q, k, v))
    return Maps(qw, qb, kw, kb, vw, vb), rep


@pytest.mark.parametrize("given", [True, False], ids=["example_inputs", "no_inputs"])
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_flex_attention_fused_wqkv_in_memory_equals_checkpoint_route(tmp_path, name, given):
    model = build(name)
    n_heads, n_kv, head_dim = heads(model)
    example = inputs(model)
    before = titan_maps(model, 0)[0]
    kwargs = {"example_inputs": example} if given else {}
    found = surgeon.inspect(model, **kwargs)
    assert [(b.module, b.layout, b.heads, b.kv_heads, b.head_dim) for b in found.blocks] == [
        (f"layers.{i}.attention", "forward: fused qkv_linear.wqkv", n_heads, n_kv, head_dim) for i in model.layers
    ]
    # the checkpoint route on what torchtitan saves: its hook splits wqkv into wq/wk/wv
    torch.save(model.state_dict(), tmp_path / "model.pt")
    reinit_checkpoint(
        tmp_path / "model.pt", output=tmp_path / "out.pt", layers="1", seed=SEED, num_heads=n_heads, num_kv_heads=n_kv
    )
    saved = torch.load(tmp_path / "out.pt", weights_only=True)
    surgeon.reinit_(model, layers="1", seed=SEED, **kwargs)
    mine = model.state_dict()
    assert mine.keys() == saved.keys()
    assert [k for k in mine if not torch.equal(mine[k], saved[k])] == []  # the same draws, bit for bit
    fresh = build(name, seed=1)
    fresh.load_state_dict(saved)  # its load hook fuses wq/wk/wv back into wqkv
    assert torch.equal(logits(fresh, example), logits(model, example))
    maps, groups = titan_maps(model, 1)
    assert groups == n_heads // n_kv
    assert_conditioned(maps, kv_groups=groups)
    assert_same(titan_maps(model, 0)[0], before)


def test_separate_wq_wk_wv_in_memory(tmp_path):
    """Qwen3's non-fused QKVLinear: wq/wk/wv in memory, the same names as its saved state dict."""
    model = build("qwen3-separate")
    found = surgeon.inspect(model)
    assert {b.layout for b in found.blocks} == {"forward: qkv_linear.wq, qkv_linear.wk, qkv_linear.wv"}
    surgeon.reinit_(model, layers="0", seed=SEED)
    maps, groups = titan_maps(model, 0)
    assert_conditioned(maps, kv_groups=groups)


def test_fsdp2_two_ranks_equal_one_process(tmp_path):
    spawn(_titan_worker("fsdp_worker"), 2, tmp_path, str(tmp_path), "llama3")
    single = build("llama3")
    example = inputs(single)
    surgeon.reinit_(single, seed=SEED, layers="1-")
    expected = full_state(single)
    for rank in range(2):
        got = torch.load(tmp_path / f"fsdp-llama3-{rank}.pt", weights_only=True)
        assert got["state"].keys() == expected.keys()
        assert [n for n, t in expected.items() if not torch.equal(got["state"][n], t)] == []
        assert torch.allclose(got["logits"], logits(single, example), atol=1e-5)
        assert {layout for _, layout, _, _ in got["blocks"]} == {"forward: fused qkv_linear.wqkv"}


def test_tensor_parallel_refused_without_heads_and_global_with_them(tmp_path):
    spawn(_titan_worker("tp_worker"), 2, tmp_path, str(tmp_path), "llama3")
    single = build("llama3")
    surgeon.reinit_(single, seed=SEED)  # one process, the layout from its forward
    expected = full_state(single)
    for rank in range(2):
        got = torch.load(tmp_path / f"tp-llama3-{rank}.pt", weights_only=True)
        error = got["error"]
        assert error is not None and error.startswith("TensorParallelError: layers.0.attention.qkv_linear.wqkv.weight")
        assert "tensor parallelism" in error and "num_heads" in error and "\n" not in error
        assert got["unchanged"]
        assert {layout for _, layout, _, _ in got["blocks"]} == {"fused qkv_linear.wqkv"}
        assert [n for n, t in expected.items() if not torch.equal(got["state"][n], t)] == []  # global, bit for bit
        assert any("tensor parallelism" in note for note in got["notes"])


def loaded(base, step: int | None = None, model_only_from=None):
    """A fresh model (and optimizer, LR schedulers) loaded by torchtitan's own CheckpointManager: a full state
    at ``step`` under ``base``, or a model-only folder as its initial_load_path."""
    model = build("llama3", seed=1)
    config = {"initial_load_path": str(model_only_from), "initial_load_model_only": True} if model_only_from else {}
    loader = manager(model, base, **config)
    assert loader.load(step if step is not None else -1)
    states = {k: v.state_dict() for k, v in loader.states.items() if k in ("optimizer", "lr_scheduler")}
    loader.close()
    return model, states


def assert_same_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, dict):
            assert_same_states(value, b[key])
        elif isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


@pytest.mark.parametrize("ranks", [1, 2])
def test_its_own_dcp_checkpoints_loaded_back_by_its_manager(tmp_path, ranks):
    """CheckpointManager's step-5 (model, optimizer, LR schedulers) and last step-10 (the model alone), from one
    process or 2 FSDP2 ranks: reinit by surgeon, loaded back by torchtitan into a fresh model; the model equals
    reinit_ in memory on what the source checkpoint loads, the rest of the state loads unchanged."""
    source, out = tmp_path / "run", tmp_path / "out"
    if ranks == 1:
        save_steps(build("llama3"), source).close()
    else:
        spawn(_titan_worker("dcp_fsdp_worker"), 2, tmp_path, str(source), "llama3")
        assert (source / "checkpoint" / "step-5" / "__1_0.distcp").is_file()
    n_heads, n_kv, _ = heads(build("llama3"))
    hints = {"num_heads": n_heads, "num_kv_heads": n_kv}
    for step in (5, 10):
        found = inspect_checkpoint(source / "checkpoint" / f"step-{step}", **hints)
        assert {(b.module.rpartition(".")[0], b.layout) for b in found.blocks} == {
            (f"layers.{i}.attention", "separate") for i in range(6)
        }
        reinit_checkpoint(
            source / "checkpoint" / f"step-{step}",
            output=out / "checkpoint" / f"step-{step}",
            layers="1",
            seed=SEED,
            **hints,
        )
    for step in (5, 10):
        if step == 5:
            (expected, their_states), (got, states) = loaded(source, 5), loaded(out, 5)
            assert_same_states(states, their_states)  # optimizer and LR schedulers unchanged
            assert states["optimizer"]
        else:
            model_only = {"model_only_from": out / "checkpoint" / "step-10", "base": tmp_path / "empty-a"}
            got, _ = loaded(**model_only)
            expected, _ = loaded(tmp_path / "empty-b", model_only_from=source / "checkpoint" / "step-10")
        before = titan_maps(expected, 0)[0]
        surgeon.reinit_(expected, layers="1", seed=SEED)  # in memory, on what the source checkpoint holds
        assert [n for n, t in full_state(expected).items() if not torch.equal(full_state(got)[n], t)] == []
        maps, groups = titan_maps(got, 1)
        assert_conditioned(maps, kv_groups=groups)
        assert_same(titan_maps(got, 0)[0], before)


def test_its_hf_export_sharded_copy_left_out_and_loaded_back_by_its_hf_loader(tmp_path):
    """last_save_in_hf: its export writes the consolidated safetensors and a sharded/ copy; surgeon rewrites the
    first and leaves sharded/ out with a note; torchtitan's own HF loader (initial_load_in_hf) takes the result."""
    model = build("llama3")
    adapter = hf_adapter(model, tmp_path / "assets")
    saver = manager(model, tmp_path / "run", sd_adapter=adapter, last_save_model_only=True, last_save_in_hf=True)
    saver.save(10, last_step=True)
    saver.close()
    source, out = tmp_path / "run" / "checkpoint" / "step-10", tmp_path / "out" / "step-10"
    assert (source / "sharded").is_dir()
    report = reinit_checkpoint(source, output=out, layers="1", seed=SEED, num_heads=16)
    assert not (out / "sharded").exists()
    assert any("sharded/" in note for note in report.notes)

    def hf_loaded(folder, base):
        fresh = build("llama3", seed=1)
        config = {"initial_load_path": str(folder), "initial_load_in_hf": True, "initial_load_model_only": True}
        loader = manager(fresh, base, sd_adapter=hf_adapter(fresh, tmp_path / "assets"), **config)
        assert loader.load()
        loader.close()
        return fresh

    got, theirs = hf_loaded(out, tmp_path / "empty-a"), hf_loaded(source, tmp_path / "empty-b")
    maps, groups = titan_maps(got, 1)
    assert_conditioned(maps, kv_groups=groups)
    assert_same(titan_maps(got, 0)[0], titan_maps(theirs, 0)[0])
    changed = {n for n, t in full_state(theirs).items() if not torch.equal(full_state(got)[n], t)}
    assert changed == {"layers.1.attention.qkv_linear.wqkv.weight"}


def _titan_worker(name: str):
    from helpers import titan

    return getattr(titan, name)
