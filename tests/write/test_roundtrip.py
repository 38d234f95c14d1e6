"""Format round trips on real (tiny) transformers checkpoints: single, sharded, .bin, fp16/bf16."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from surgeon import reinit_checkpoint
from surgeon.formats.safetensors import SafetensorsWeights
from surgeon.formats.torchfile import TorchWeights

from helpers.digests import sha256, tree_digest
from helpers.tiny import tiny_llama

LAYER0 = (
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
)


def state(folder):
    """Every tensor of a saved model folder, whatever its format."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    for f in sorted(folder.glob("*.bin")):
        out.update(torch.load(f, weights_only=True))
    return out


def check_layer0_only(before, after):
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert after[name].dtype == t.dtype and after[name].shape == t.shape
        if name in LAYER0:
            assert not torch.equal(after[name], t), name
        else:
            assert torch.equal(after[name], t), name


def save_bin(model, folder, shards: int = 1):
    """A PyTorch-format model folder (transformers 5 writes safetensors only)."""
    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    sd = model.state_dict()
    if shards == 1:
        torch.save(sd, folder / "pytorch_model.bin")
        return
    names = list(sd)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: sd[n] for n in names[i::shards]}
        torch.save(part, folder / file)
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))


def save_model(model, folder, kind):
    if kind == "safetensors":
        model.save_pretrained(folder)
    elif kind == "sharded":
        model.save_pretrained(folder, max_shard_size="40KB")
        assert len(list(folder.glob("*.safetensors"))) > 1
    elif kind == "bin":
        save_bin(model, folder)
    else:
        save_bin(model, folder, shards=3)


@pytest.mark.parametrize("kind", ["safetensors", "sharded", "bin", "sharded-bin"])
def test_folder_round_trip(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    save_model(tiny_llama(), src, kind)
    (src / "tokenizer.json").write_text('{"not": "touched"}')
    (src / "sub").mkdir()
    (src / "sub" / "extra.txt").write_text("kept")
    before_files = tree_digest(src)
    out = tmp_path / "out"
    report = reinit_checkpoint(src, output=out, layers="0")
    assert tree_digest(src) == before_files  # the input is never modified
    # same files, same names, same shards, plus the model card (checked in test_hub_card.py)
    assert sorted(tree_digest(out)) == sorted([*before_files, "README.md"])
    for rel, digest in before_files.items():
        if rel.endswith((".json", ".txt")):
            assert tree_digest(out)[rel] == digest, rel  # config, index, tokenizer: unchanged bytes
    check_layer0_only(state(src), state(out))
    model = AutoModelForCausalLM.from_pretrained(out)  # transformers loads the result
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    assert {r.role for r in report.rows} == {"q", "k", "v"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_stored_in_its_own_dtype(tmp_path, dtype):
    src = tmp_path / "src"
    tiny_llama().to(dtype).save_pretrained(src)
    out = tmp_path / "out"
    report = reinit_checkpoint(src, output=out, layers="all")
    after = state(out)
    before = state(src)
    for name, t in after.items():
        assert t.dtype == before[name].dtype
    for row in report.rows:
        assert row.dtype == str(dtype).removeprefix("torch.")
        # computed from the stored half-precision values: close to, not exactly, 1
        assert 1.0 <= row.after.head_max < (1.02 if dtype == torch.float16 else 1.1)


def test_single_file_input_writes_a_file_beside_it(tmp_path, llama_dir):
    src = llama_dir / "model.safetensors"
    report = reinit_checkpoint(src, layers="0")
    out = llama_dir / "model.reinit.safetensors"
    assert report.output == str(out) and out.is_file()
    check_layer0_only(load_file(src), load_file(out))


def test_output_is_deterministic_and_keyed_by_seed(tmp_path, llama_dir):
    a, b, c = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "c.safetensors"
    src = llama_dir / "model.safetensors"
    reinit_checkpoint(src, output=a, seed=7)
    reinit_checkpoint(src, output=b, seed=7)
    reinit_checkpoint(src, output=c, seed=8)
    assert sha256(a) == sha256(b)
    assert sha256(a) != sha256(c)


def test_draw_does_not_depend_on_selection_order_or_sharding(tmp_path):
    src_single, src_sharded = tmp_path / "single", tmp_path / "sharded"
    tiny_llama().save_pretrained(src_single)
    tiny_llama().save_pretrained(src_sharded, max_shard_size="40KB")
    all_layers = state_after(src_single, tmp_path / "o1", layers="all")
    one_layer = state_after(src_single, tmp_path / "o2", layers="1")
    sharded = state_after(src_sharded, tmp_path / "o3", layers="all")
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(all_layers[name], one_layer[name])
    for key, t in all_layers.items():
        assert torch.equal(sharded[key], t), key


def state_after(src, out, **kw):
    reinit_checkpoint(src, output=out, **kw)
    return state(out)


def test_torch_wrapper_entries_are_kept(tmp_path):
    sd = tiny_llama().state_dict()
    src = tmp_path / "ckpt.pt"
    torch.save({"state_dict": sd, "epoch": 3, "note": "hello"}, src)
    out = tmp_path / "out.pt"
    reinit_checkpoint(src, output=out, layers="0", config=_llama_config(tmp_path))
    loaded = torch.load(out, weights_only=True)
    assert loaded["epoch"] == 3 and loaded["note"] == "hello"
    check_layer0_only(sd, loaded["state_dict"])


def _llama_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(tiny_llama().config.to_json_string())
    return path


def test_folder_with_safetensors_and_bin_changes_both(tmp_path):
    src = tmp_path / "src"
    model = tiny_llama()
    model.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")  # save_pretrained would delete the other copy
    assert (src / "model.safetensors").is_file() and (src / "pytorch_model.bin").is_file()
    out = tmp_path / "out"
    reinit_checkpoint(src, output=out, layers="0")
    st = load_file(out / "model.safetensors")
    pt = torch.load(out / "pytorch_model.bin", weights_only=True)
    for name in LAYER0:
        assert torch.equal(st[name], pt[name])


def test_in_place_replaces_the_input(tmp_path, llama_dir):
    src = llama_dir / "model.safetensors"
    before = {k: v.clone() for k, v in load_file(src).items()}  # load_file may map the file, which is now patched
    reinit_checkpoint(src, in_place=True, layers="0")
    check_layer0_only(before, load_file(src))
    assert sorted(p.name for p in llama_dir.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_weight_sets_report_formats(tmp_path, llama_dir):
    w = SafetensorsWeights(llama_dir, ["model.safetensors"])
    assert w.describe() == "safetensors (model.safetensors)"
    sd_dir = tmp_path / "pt"
    save_bin(tiny_llama(), sd_dir, shards=3)
    index = next(sd_dir.glob("*.index.json"))
    tw = TorchWeights.from_index(index)
    assert len(tw.files) > 1 and set(json.loads(index.read_text())["weight_map"]) == set(tw.tensors)


def test_stale_copies_in_other_formats_are_left_out(tmp_path, llama_dir):
    (llama_dir / "tf_model.h5").write_bytes(b"old weights")
    (llama_dir / "onnx").mkdir()
    (llama_dir / "onnx" / "model.onnx").write_bytes(b"old graph")
    (llama_dir / "tokenizer.json").write_text("{}")
    report = reinit_checkpoint(llama_dir, output=tmp_path / "out", layers="0")
    out = tree_digest(tmp_path / "out")
    assert "tf_model.h5" not in out and "onnx/model.onnx" not in out and "tokenizer.json" in out
    assert any("onnx/, tf_model.h5" in note for note in report.notes)
    assert "onnx/, tf_model.h5 (re-export them from the output)" in report.render()


def test_leftover_weight_files_beside_a_sharded_checkpoint_are_left_out(tmp_path):
    src = tmp_path / "mistral-like"
    tiny_llama().save_pretrained(src, max_shard_size="40KB")
    (src / "consolidated.safetensors").write_bytes((next(src.glob("model-*.safetensors"))).read_bytes())
    (src / "training_args.bin").write_bytes(b"not weights")
    report = reinit_checkpoint(src, output=tmp_path / "out", layers="0")
    out = tree_digest(tmp_path / "out")
    assert "consolidated.safetensors" not in out and "training_args.bin" in out
    assert any("consolidated.safetensors" in n for n in report.notes)
